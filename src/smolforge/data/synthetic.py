"""The bundled task set: generated, never downloaded, with exact answers.

Small tasks a tiny model can learn in minutes on a CPU (arithmetic, string transforms, tiny code
questions), so the demo and benchmarks can show held-out exact-match accuracy rising, and the
distillation work can show a KD student beating a plainly fine-tuned one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from smolforge.paths import atomic_write_text, home

LETTERS = "abcdefghij"


def _word(rng: random.Random, lo: int = 2, hi: int = 4) -> str:
    return "".join(rng.choice(LETTERS) for _ in range(rng.randint(lo, hi)))


def _task(rng: random.Random) -> tuple[str, str]:
    kind = rng.randrange(6)
    if kind == 0:
        a, b = rng.randint(0, 9), rng.randint(0, 9)
        return f"What is {a} + {b}?", str(a + b)
    if kind == 1:
        a, b = rng.randint(10, 49), rng.randint(0, 9)
        return f"What is {a} - {b}?", str(a - b)
    if kind == 2:
        w = _word(rng)
        return f"Reverse the word: {w}", w[::-1]
    if kind == 3:
        w = _word(rng)
        return f"Uppercase: {w}", w.upper()
    if kind == 4:
        w = _word(rng)
        return f"What does len('{w}') return?", str(len(w))
    w = _word(rng, 1, 3)
    return f"Repeat twice: {w}", w + w


def generate(n: int, seed: int) -> list[dict[str, str]]:
    """n distinct prompt/completion records."""
    rng = random.Random(seed)
    seen: set[str] = set()
    out = []
    while len(out) < n:
        prompt, answer = _task(rng)
        if prompt in seen:
            continue
        seen.add(prompt)
        out.append({"prompt": prompt, "completion": answer})
    return out


def bundled_paths(n_train: int = 4000, n_eval: int = 200, seed: int = 1234) -> tuple[Path, Path]:
    """Write (once) train.jsonl and eval.jsonl with disjoint prompts; returns their paths."""
    root = home() / "datasets" / f"bundled-{n_train}-{n_eval}-{seed}"
    train, eval_ = root / "train.jsonl", root / "eval.jsonl"
    if train.exists() and eval_.exists():
        return train, eval_
    records = generate(n_train + n_eval, seed)
    rng = random.Random(seed + 1)
    rng.shuffle(records)
    atomic_write_text(eval_, "".join(json.dumps(r) + "\n" for r in records[:n_eval]))
    atomic_write_text(train, "".join(json.dumps(r) + "\n" for r in records[n_eval:]))
    return train, eval_
