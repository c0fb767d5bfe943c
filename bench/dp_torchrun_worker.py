"""One rank of the baseline: the same training engine under plain `torchrun` (no Ray, no reporting).

Run by bench/dp_step_time.py as
    python -m torch.distributed.run --standalone --nproc-per-node 2 bench/dp_torchrun_worker.py CFG.json OUT.json
Rank 0 writes {"median_step_s", "steps", "step_times"} to OUT.json.
"""

from __future__ import annotations

import json
import sys
import time

import torch
import torch.distributed as dist


def main() -> None:
    cfg_path, out_path = sys.argv[1], sys.argv[2]
    from smolforge.config import TrainConfig
    from smolforge.parallel.strategies import make_strategy
    from smolforge.train.engine import TrainHooks, train

    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cfg = TrainConfig.model_validate({**json.loads(open(cfg_path).read()), "output_dir": f"{out_path}.rank{rank}"})
    torch.set_num_threads(cfg.num_threads or 1)
    times: list[float] = []
    cpu: list[float] = []

    def on_step(info) -> None:
        times.append(time.time())
        cpu.append(time.process_time())

    train(cfg, TrainHooks(on_step=on_step), strategy=make_strategy("ddp"))  # the loop's peers: plain DDP
    if rank == 0:
        gaps = sorted(b - a for a, b in zip(times, times[1:]))
        with open(out_path, "w") as f:
            json.dump({"median_step_s": gaps[len(gaps) // 2], "cpu_step_s": (cpu[-1] - cpu[0]) / (len(cpu) - 1),
                       "steps": len(times)}, f)
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
