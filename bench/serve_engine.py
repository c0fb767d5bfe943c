"""The generation engine against HF `generate` in one process: no server, no HTTP, the same model,
prompt, greedy decoding and thread count; alternated A B A B so noise hits both. It separates what
the engine costs from what `smolforge serve` adds around it (bench/serve.py).

Both make exactly --tokens new tokens: `generate` with `min_new_tokens`, the engine with the
model's EOS ids switched off (a random preset such as small-llama may pick EOS early, and the engine
stops there). tok/s = tokens / wall time of the call, prefill included for both; the median of
--rounds alternated runs, and the best. small-llama's forward is ~2 ms a token, so this is where
the engine's per-token overhead shows; llama-100m's ~60 ms hides it.

    .venv/bin/python bench/serve_engine.py [--model small-llama --tokens 64 --rounds 7 --threads 1]
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import statistics
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="small-llama", help="a preset or a model directory")
    ap.add_argument("--tokens", type=int, default=64)
    ap.add_argument("--rounds", type=int, default=7)
    ap.add_argument("--threads", type=int, default=1)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from smolforge.models.tiny import is_preset, preset_dir
    from smolforge.serve.batch import Request
    from smolforge.serve.engine import Engine
    from smolforge.serve.model import ServedModel
    from smolforge.serve.sampling import SamplingParams

    torch.set_num_threads(args.threads)
    served = ServedModel.load(str(preset_dir(args.model)) if is_preset(args.model) else args.model, device="cpu")
    no_eos = dataclasses.replace(served, eos_ids=frozenset())
    ids = served.tokenizer("Once upon a time, in a village by the sea,")["input_ids"]

    def engine(n: int) -> int:
        done: list = []
        Engine(no_eos).run_batch([Request(ids, SamplingParams(max_tokens=n, temperature=0), done.append)])
        return done[-1].completion_tokens

    def generate(n: int) -> int:
        with torch.inference_mode():
            out = served.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                        pad_token_id=served.pad_id)
        return out.shape[1] - len(ids)

    for fn in (engine, generate, engine, generate):  # warm-up
        fn(8)
    rates: dict[str, list[float]] = {"engine": [], "generate": []}
    for _ in range(args.rounds):
        for name, fn in (("engine", engine), ("generate", generate)):
            t0 = time.perf_counter()
            made = fn(args.tokens)
            rates[name].append(made / (time.perf_counter() - t0))
    med = {k: statistics.median(v) for k, v in rates.items()}
    best = {k: max(v) for k, v in rates.items()}
    print(f"{args.model}, one request, {args.tokens} tokens, {args.threads} thread(s), {args.rounds} rounds: "
          f"engine {med['engine']:.1f} tok/s, generate {med['generate']:.1f} tok/s (medians), "
          f"ratio {med['engine'] / med['generate']:.2f} (best of each: {best['engine'] / best['generate']:.2f})")
    print(json.dumps({"args": vars(args), "rates": rates, "median": med, "best": best,
                      "ratio_median": med["engine"] / med["generate"]}))


if __name__ == "__main__":
    main()
