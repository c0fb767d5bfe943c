"""Which learning rate suits each PEFT method: the sweep behind config.DEFAULT_LR.

tiny-llama is randomly initialised, so "the base" here is tiny-llama briefly fully fine-tuned
(--base-steps) on the bundled prompts and answers as plain text: it knows the words, not the chat
format, as a pretrained base knows language but not a new task's format. Each
method then trains --steps steps from that base at each rate of its grid, on the same data, and the
held-out eval loss is compared with the base's. Also shown: prompt tuning with peft's continuous
RANDOM init at 3e-3 (the old behaviour: `train --peft prompt --lr 3e-3` ended worse than the base).

    OMP_NUM_THREADS=1 .venv/bin/python bench/peft_default_lr.py --base-steps 60 --steps 30
    OMP_NUM_THREADS=1 .venv/bin/python bench/peft_default_lr.py --base-steps 60 --steps 100 --no-random-init \
        --grid '{"lora": [2e-3, 5e-3, 1e-2], ...}'   (the longer check of the best rates)
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time

os.environ.setdefault("HF_HUB_OFFLINE", "1")

GRID = {
    "lora": [2e-4, 1e-3, 2e-3, 5e-3],
    "ia3": [1e-3, 1e-2, 3e-2],
    "adapter": [2e-4, 1e-3, 2e-3, 5e-3],
    "prefix": [1e-3, 3e-3, 1e-2, 3e-2],
    "prompt": [3e-3, 1e-2, 3e-2, 1e-1],
    "none": [1e-4, 3e-4, 1e-3],
}


def plain_text_corpus(path: str) -> str:
    """The bundled training prompts and answers as plain text lines (no chat template): what the base
    is pretrained on, so it knows the words but not the chat format the PEFT runs then learn."""
    import json

    from smolforge.data.synthetic import bundled_paths

    train_path, _ = bundled_paths()
    lines = [json.loads(line) for line in open(train_path, encoding="utf-8")]
    with open(path, "w", encoding="utf-8") as f:
        f.writelines(json.dumps({"text": f"{r['prompt']} {r['completion']}"}) + "\n" for r in lines)
    return path


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--base-steps", type=int, default=60)
    ap.add_argument("--steps", type=int, default=30)
    ap.add_argument("--max-eval-samples", type=int, default=64)
    ap.add_argument("--methods", default=",".join(GRID))
    ap.add_argument("--grid", default=None, help='JSON {method: [lr, ...]} replacing GRID, e.g. \'{"lora": [2e-3]}\'')
    ap.add_argument("--no-random-init", action="store_true", help="skip the RANDOM-init prompt run")
    args = ap.parse_args()

    import torch

    from smolforge.config import DEFAULT_LR, DataSpec, PeftSpec, TrainConfig
    from smolforge.data.splits import load_splits
    from smolforge.models.loading import load_tokenizer
    from smolforge.train.engine import build_model, evaluate, train

    torch.set_num_threads(1)
    work = tempfile.mkdtemp(prefix="smolforge-peft-lr-")
    data = DataSpec(path="bundled", max_eval_samples=args.max_eval_samples)

    def cfg(model: str, peft: PeftSpec, lr: float | None, steps: int, out: str) -> TrainConfig:
        return TrainConfig(model=model, data=data, peft=peft, lr=lr, max_steps=steps, batch_size=8, num_threads=1,
                           device="cpu", eval_accuracy=False, quiet=True, tensorboard=False, output_dir=out, seed=0)

    t0 = time.time()
    corpus = plain_text_corpus(f"{work}/corpus.jsonl")
    pre = cfg("tiny-llama", PeftSpec(method="none"), 1e-3, args.base_steps, f"{work}/base")
    pre = pre.model_copy(update={"data": DataSpec(path=corpus, format="text", max_eval_samples=8)})
    base = train(pre).adapter_dir if args.base_steps else "tiny-llama"
    base_cfg = cfg(base, PeftSpec(method="none"), None, 1, f"{work}/unused")
    tok = load_tokenizer(base)
    _, model = build_model(base_cfg, torch.device("cpu"), tok)
    base_loss = evaluate(model, tok, load_splits(data, tok), base_cfg, torch.device("cpu"), accuracy=False)["eval_loss"]
    print(f"base: tiny-llama after {args.base_steps} full fine-tuning steps at 1e-3 on plain text ({time.time() - t0:.0f}s): "
          f"eval loss {base_loss:.4f}")

    import json

    grid = json.loads(args.grid) if args.grid else GRID
    runs = [(m, PeftSpec(method=m), lr) for m in (list(grid) if args.grid else args.methods.split(",")) for lr in grid[m]]
    if not args.no_random_init:
        runs.append(("prompt", PeftSpec(method="prompt", prompt_tuning_init="RANDOM"), 3e-3))
    print("| method | init | lr | eval loss | vs base | seconds |")
    print("|---|---|---:|---:|---:|---:|")
    for i, (method, peft, lr) in enumerate(runs):
        t = time.time()
        res = train(cfg(base, peft, lr, args.steps, f"{work}/run{i}"))
        loss = res.eval["eval_loss"]
        init = peft.prompt_tuning_init if method == "prompt" else ""
        mark = " (default)" if lr == DEFAULT_LR[method] and init != "RANDOM" else ""
        print(f"| {method} | {init} | {lr:g}{mark} | {loss:.4f} | {loss - base_loss:+.4f} | {time.time() - t:.0f} |",
              flush=True)


if __name__ == "__main__":
    main()
