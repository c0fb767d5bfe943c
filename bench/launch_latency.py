"""Launch latency and per-step overhead on a real cluster (coordinator + 2 workers on this machine).

Measures, in one run:
- how long `smolforge coordinator start` and `smolforge worker join` take to be usable;
- time from `launch` (the submit call) to the first training step, for a 2-worker job;
- the per-step overhead of running as a cluster task (Ray actor, progress reporting, the
  pause/cancel poll): median step time of a 1-worker cluster job minus the same config trained in
  this process with no hooks (the baseline, measured in the same run).

    .venv/bin/python bench/launch_latency.py [--model tiny-llama --steps 60]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path


def free_port() -> int:
    from smolforge.cluster.nodes.statedir import free_port as fp

    return fp()


def spawn(args: list[str], env: dict, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "smolforge.cli.main", *args], env=env, stdout=open(log, "wb"),
                            stderr=subprocess.STDOUT, start_new_session=True)


def wait_text(proc: subprocess.Popen, log: Path, text: str, timeout: float = 180) -> float:
    t0 = time.time()
    while time.time() - t0 < timeout:
        if text in log.read_text(errors="replace"):
            return time.time() - t0
        if proc.poll() is not None:
            raise SystemExit(f"{log.name} exited:\n{log.read_text()[-2000:]}")
        time.sleep(0.1)
    raise SystemExit(f"timed out waiting for {text!r} in {log}")


def cluster_env(tmp: Path) -> dict:
    """The environment for a bench's own cluster: its Ray dir under `tmp`, token auth, offline,
    and nothing inherited that would point it at another cluster."""
    env = {**os.environ, "RAY_TMPDIR": str(tmp / "r"), "RAY_AUTH_MODE": "token", "HF_HUB_OFFLINE": "1",
           "RAY_USAGE_STATS_ENABLED": "0", "PYTHONUNBUFFERED": "1"}
    for k in ("SMOLFORGE_COORDINATOR", "SMOLFORGE_TOKEN", "RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH"):
        env.pop(k, None)
    return env


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="tiny-llama")
    ap.add_argument("--steps", type=int, default=60)
    ap.add_argument("--batch-size", type=int, default=4)
    ap.add_argument("--max-length", type=int, default=128)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sfl", dir="/tmp"))
    env = cluster_env(tmp)
    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    preset_dir(args.model)
    data = tmp / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(1000, seed=3)))
    port, ray_port = free_port(), free_port()
    procs: list[subprocess.Popen] = []
    out: dict = {"model": args.model, "steps": args.steps, "batch": args.batch_size}
    try:
        t0 = time.time()
        coord = spawn(["coordinator", "start", "--port", str(port), "--ray-port", str(ray_port), "--state-dir",
                       str(tmp / "state"), "--cpus", "0", "--object-store-mb", "100"], env, tmp / "coord.log")
        procs.append(coord)
        out["coordinator_start_s"] = round(wait_text(coord, tmp / "coord.log", "Join workers with:"), 2)
        token = (tmp / "state" / "token").read_text().strip()
        workers = []
        for name in ("b1", "b2"):  # one after the other: each join is timed on its own
            p = spawn(["worker", "join", f"127.0.0.1:{port}", "--token-file", str(tmp / "state" / "token"), "--name", name, "--cpus", "1",
                       "--state-dir", str(tmp / name), "--object-store-mb", "100"], env, tmp / f"{name}.log")
            procs.append(p)
            workers.append(p)
            out[f"worker_join_{name}_s"] = round(wait_text(p, tmp / f"{name}.log", f"Registered as {name}"), 2)
        from smolforge.client import Client

        client = Client("127.0.0.1", port, token=token)
        train = {"model": args.model, "data": {"path": str(data), "max_length": args.max_length, "max_eval_samples": 4},
                 "max_steps": args.steps, "batch_size": args.batch_size, "eval_accuracy": False, "save_every": 0,
                 "peft": {"dropout": 0.0}}
        import torch

        from smolforge.config import TrainConfig
        from smolforge.train.engine import TrainHooks
        from smolforge.train.engine import train as run_train

        torch.set_num_threads(1)

        def plain_run(i: int) -> tuple[float, float]:
            """The baseline: the same 1-rank config in this process, no hooks but the timer."""
            times: list[float] = []
            cpu: list[float] = []

            def on_step(info) -> None:
                times.append(time.time())
                cpu.append(time.process_time())

            cfg = TrainConfig.model_validate({**train, "output_dir": str(tmp / f"plain-{i}"), "quiet": True,
                                              "tensorboard": False, "num_threads": 1})
            run_train(cfg, TrainHooks(on_step=on_step))
            gaps = sorted(b - a for a, b in zip(times, times[1:]))
            return gaps[len(gaps) // 2], (cpu[-1] - cpu[0]) / (len(cpu) - 1)

        firsts, step_cluster, plain, cpu_cluster, cpu_plain = [], [], [], [], []
        for i, world in enumerate((2, 1, 2, 1, 1)):  # alternating with the baseline: same background load
            spec = {"kind": "data_parallel", "num_workers": world,
                    "train": {**train, "batch_size": args.batch_size // world}}
            t_submit = time.time()
            job = client.submit_job(spec)
            st = client.wait_for_job(job, timeout=900, poll=0.5)
            assert st["state"] == "completed", st
            if world == 2:
                firsts.append(st["result"]["first_step_ts"] - t_submit)
            else:
                step_cluster.append(st["result"]["median_step_s"])
                cpu_cluster.append(st["result"]["cpu_step_s"])
                wall, cpu = plain_run(i)
                plain.append(wall)
                cpu_plain.append(cpu)
        out["launch_to_first_step_s"] = round(statistics.median(firsts), 2)
        b, c = statistics.median(plain), statistics.median(step_cluster)
        bc, cc = statistics.median(cpu_plain), statistics.median(cpu_cluster)
        out.update(plain_ms_per_step=round(b * 1000, 2), cluster_1rank_ms_per_step=round(c * 1000, 2),
                   overhead_ms_per_step=round((c - b) * 1000, 2), overhead_ratio=round(c / b, 3),
                   plain_cpu_ms_per_step=round(bc * 1000, 2), cluster_1rank_cpu_ms_per_step=round(cc * 1000, 2),
                   overhead_cpu_ms_per_step=round((cc - bc) * 1000, 2))
    except BaseException:
        print(f"failed; logs kept in {tmp}", file=sys.stderr)
        raise
    else:
        shutil.rmtree(tmp, ignore_errors=True)
    finally:
        for p in reversed(procs):
            try:
                os.killpg(p.pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    print(json.dumps(out, indent=2))


if __name__ == "__main__":
    main()
