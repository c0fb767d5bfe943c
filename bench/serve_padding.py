"""What left padding costs a decode step: rows joining a running batch are padded to its widest row.

Eight rows, seven of 40 tokens and one of --long tokens (the seven padded to it: the joined batch),
against the seven short rows' width alone (the floor a paged cache could reach) and every row long.
The median of 10 decode steps after 2 of warm-up, twice.

    .venv/bin/python bench/serve_padding.py [--model small-llama --long 400 --threads 1]
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch


def step_ms(model, widths: list[int]) -> float:
    """Median decode-step time (ms) of a batch whose rows hold `widths` tokens, left-padded to the widest."""
    rows, width = len(widths), max(widths)
    ids = torch.full((rows, width), 5)
    mask = torch.zeros((rows, width), dtype=torch.long)
    for i, w in enumerate(widths):
        mask[i, width - w:] = 1
    cache = model.new_cache()
    model.forward(ids, mask, (mask.cumsum(-1) - 1).clamp_min(0), cache)
    last, lengths, times = torch.full((rows, 1), 7), mask.sum(-1), []
    for _ in range(12):
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=torch.long)], 1)
        t0 = time.perf_counter()
        model.forward(last, mask, lengths[:, None], cache)
        times.append(time.perf_counter() - t0)
        lengths = lengths + 1
    return 1e3 * statistics.median(times[2:])


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-llama")
    ap.add_argument("--long", type=int, default=400)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    from smolforge.models.tiny import is_preset, preset_dir
    from smolforge.serve.model import ServedModel

    torch.set_num_threads(args.threads)
    model = ServedModel.load(str(preset_dir(args.model)) if is_preset(args.model) else args.model, device="cpu")
    for _ in range(2):
        padded = step_ms(model, [args.long] + [40] * 7)
        short = step_ms(model, [40] * 8)
        long = step_ms(model, [args.long] * 8)
        print(f"{args.model}: padded to {args.long} {padded:.2f} ms, all 40 {short:.2f} ms, "
              f"all {args.long} {long:.2f} ms")


if __name__ == "__main__":
    main()
