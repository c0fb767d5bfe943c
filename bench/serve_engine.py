"""The generation engine against HF `generate` in one process: no server, no HTTP, the same model,
prompt, greedy decoding and one thread; alternated A B A B so noise hits both. It separates what the
engine costs from what `smolforge serve` adds around it (bench/serve.py).

    .venv/bin/python bench/serve_engine.py [--model llama-100m --tokens 32 --rounds 2]
"""

from __future__ import annotations

import argparse
import json
import os
import time


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", default="llama-100m")
    ap.add_argument("--tokens", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    args = ap.parse_args()
    os.environ.setdefault("HF_HUB_OFFLINE", "1")
    import torch

    from smolforge.models.tiny import is_preset, preset_dir
    from smolforge.serve.batch import Request
    from smolforge.serve.engine import Engine
    from smolforge.serve.model import ServedModel
    from smolforge.serve.sampling import SamplingParams

    torch.set_num_threads(1)
    served = ServedModel.load(str(preset_dir(args.model)) if is_preset(args.model) else args.model, device="cpu")
    ids = served.tokenizer("Once upon a time, in a village by the sea,")["input_ids"]

    def engine(n: int) -> int:
        done: list = []
        Engine(served).run_batch([Request(ids, SamplingParams(max_tokens=n, temperature=0), done.append)])
        return done[-1].completion_tokens  # the engine stops at EOS: count what it made

    def generate(n: int) -> int:
        with torch.inference_mode():
            out = served.model.generate(torch.tensor([ids]), max_new_tokens=n, min_new_tokens=n, do_sample=False,
                                        pad_token_id=0)
        return out.shape[1] - len(ids)

    engine(4)
    generate(4)  # warm-up
    rates: dict[str, list[float]] = {"engine": [], "generate": []}
    for _ in range(args.rounds):
        for name, fn in (("engine", engine), ("generate", generate)):
            t0 = time.perf_counter()
            made = fn(args.tokens)
            rates[name].append(made / (time.perf_counter() - t0))
    best = {k: max(v) for k, v in rates.items()}
    print(f"{args.model}, one request, {args.tokens} tokens, 1 thread: engine {best['engine']:.2f} tok/s, "
          f"generate {best['generate']:.2f} tok/s, ratio {best['engine'] / best['generate']:.2f}")
    print(json.dumps({"args": vars(args), "rates": rates, "best": best}))


if __name__ == "__main__":
    main()
