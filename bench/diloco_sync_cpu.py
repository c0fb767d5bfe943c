"""A diloco sync's CPU work, the whole-model path against the fused one (issue 45, stop 60).

The two ways the same sync can run, with the functions diloco has (`parallel/codecs.py`,
`parallel/strategies/diloco_stream.py`): **whole**: the pseudo-gradient into one buffer, encoded with its
error feedback, the payload packed, the parts summed into one average, the outer step, the merge (diloco
before stop 60); **fused**: the message encoded straight from the parameters a piece at a time and packed
once, the parts summed a piece at a time into the outer step, the merge (diloco since). Both give the same
bits (tests/test_codecs.py, tests/test_diloco_strategy.py); what differs is the memory traffic.

`--procs 2` runs two processes at once, one core each, as two netlab nodes on this machine share its
memory bandwidth; each times `--syncs` syncs of each path, alternated, after a round's simulated training
(not timed), and prints one JSON line with its seconds and their medians. No transfer: the parts are this
process's own message, `--world` times.

    .venv/bin/python bench/diloco_sync_cpu.py [--values 109529856 --codec int8 --syncs 4 --procs 2]
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def one_process(values: int, codec: str, syncs: int, world: int) -> dict:
    """Both paths' seconds per sync on this process's one thread."""
    import torch

    from smolforge.parallel.codecs import ErrorFeedback, make_codec, pack_payload, pack_pieces, unpack_payload
    from smolforge.parallel.strategies.diloco_stream import (Averaged, fill_pseudo_gradient, make_fragments,
                                                             merge_into, outer_step, pseudo_gradient)

    torch.set_num_threads(1)
    sizes = [values // 27] * 26 + [values - 26 * (values // 27)]  # llama-100m-like: a few large tensors
    params = [torch.nn.Parameter(torch.zeros(n), requires_grad=False) for n in sizes]
    frag = make_fragments(params, 1)[0]
    coder = make_codec(codec)
    outer = torch.optim.SGD([frag.shared], lr=0.7, momentum=0.9, nesterov=True)
    feedback, share = ErrorFeedback(coder), [1.0 / world] * world

    def whole() -> None:
        payload = feedback.encode(pseudo_gradient(params, frag))
        buf = pack_payload(payload)
        outer_step(outer, frag.shared, coder.aggregate([unpack_payload(buf, payload)] * world, share, values))
        merge_into(params, frag, 0.0)

    def fused() -> None:
        buf, like = pack_pieces(feedback.encode_pieces(values, fill_pseudo_gradient(params, frag)))
        mean = Averaged(coder, parts=[unpack_payload(buf, like)] * world, weights=share)
        outer_step(outer, frag.shared, mean.piece, mean.unit)
        merge_into(params, frag, 0.0)

    spent: dict[str, list[float]] = {"whole": [], "fused": []}
    for i in range(syncs):
        for name, fn in ((("whole", whole), ("fused", fused)) if i % 2 == 0 else (("fused", fused), ("whole", whole))):
            with torch.no_grad():
                for p in params:
                    p.add_(torch.randn(p.numel()) * 1e-3)  # a round's training
            t0 = time.perf_counter()
            fn()
            spent[name].append(round(time.perf_counter() - t0, 3))
    return {"values": values, "codec": codec, "seconds": spent,
            "median_s": {k: statistics.median(v) for k, v in spent.items()},
            "fused_over_whole": round(statistics.median(spent["fused"]) / statistics.median(spent["whole"]), 3)}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--values", type=int, default=109_529_856, help="fp32 values synced (default llama-100m's)")
    ap.add_argument("--codec", default="int8")
    ap.add_argument("--syncs", type=int, default=4, help="syncs timed per path and process")
    ap.add_argument("--world", type=int, default=2, help="parts summed (ranks)")
    ap.add_argument("--procs", type=int, default=2, help="processes at once, each pinned to one core")
    ap.add_argument("--core", type=int, default=None, help=argparse.SUPPRESS)  # a child's core
    args = ap.parse_args()
    if args.core is not None:
        os.sched_setaffinity(0, {args.core})
        print(json.dumps({"core": args.core, **one_process(args.values, args.codec, args.syncs, args.world)}))
        return
    cores = sorted(os.sched_getaffinity(0))[:args.procs]
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT / "src")}
    children = [subprocess.Popen([sys.executable, __file__, "--values", str(args.values), "--codec", args.codec,
                                  "--syncs", str(args.syncs), "--world", str(args.world), "--core", str(c)],
                                 env=env) for c in cores]
    sys.exit(max(c.wait(timeout=3600) for c in children))


if __name__ == "__main__":
    main()
