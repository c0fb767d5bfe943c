#!/usr/bin/env python
"""Usage: .venv/bin/python bench/serve_padding.py [small-llama] [400]

Decode-step cost of a joined batch with left padding against the same rows without it (what a paged
cache would attend over): 8 rows, 7 of `short` tokens and one of `long`; small-llama, 1 thread."""
import sys, time, statistics, torch
from smolforge.models.tiny import preset_dir
from smolforge.serve.model import ServedModel
torch.set_num_threads(1)
name = sys.argv[1] if len(sys.argv) > 1 else "small-llama"
m = ServedModel.load(str(preset_dir(name)), device="cpu")
short, long_, rows = 40, int(sys.argv[2]) if len(sys.argv) > 2 else 400, 8

def step_time(widths):
    W = max(widths)
    ids = torch.full((rows, W), 5); mask = torch.zeros((rows, W), dtype=torch.long)
    for i, w in enumerate(widths): mask[i, W - w:] = 1
    pos = (mask.cumsum(-1) - 1).clamp_min(0)
    cache = m.new_cache(); m.forward(ids, mask, pos, cache)
    last = torch.full((rows, 1), 7); lengths = mask.sum(-1)
    times = []
    for k in range(12):
        mask = torch.cat([mask, torch.ones((rows, 1), dtype=torch.long)], 1)
        t = time.perf_counter(); m.forward(last, mask, lengths[:, None], cache); times.append(time.perf_counter() - t)
        lengths = lengths + 1
    return statistics.median(times[2:])

for _ in range(2):
    padded = step_time([long_] + [short] * 7)   # the joined batch: 7 short rows padded to the long one
    unpadded = step_time([short] * 8)           # what the 7 short rows cost without padding
    alone_long = step_time([long_] * 1 + [long_] * 7)
    print(f"{name}: step with padding {padded*1e3:.2f} ms, all rows {short} tokens {unpadded*1e3:.2f} ms, all rows {long_} {alone_long*1e3:.2f} ms")
