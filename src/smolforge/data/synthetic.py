"""The bundled task set: generated, never downloaded, with exact answers.

Small tasks a tiny model can learn in minutes on a CPU (arithmetic, string transforms, tiny code
questions), so the demo and benchmarks can show held-out exact-match accuracy rising, and the
distillation work can show a KD student beating a plainly fine-tuned one.
"""

from __future__ import annotations

import json
import random
from pathlib import Path

from smolforge.data.formats import jsonl_records
from smolforge.data.tabular import TABULAR_DATASETS
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


BUNDLED_PROMPTS = "bundled-prompts"
BUNDLED_PROMPTS_N = 4000  # its prompts
# names every node resolves itself: nothing to upload (the feature-row sets of `--model mlp` among them)
BUILTIN_DATASETS = ("bundled", BUNDLED_PROMPTS, *TABULAR_DATASETS)


def bundled_prompts_path(n: int = BUNDLED_PROMPTS_N, labelled: int = 512, seed: int = 1234) -> Path:
    """Write (once) `bundled-prompts`: n prompts without answers, for a teacher to label; returns its path.

    Why: distillation's input is prompts, not labels. A user typically has a few labelled examples and
    many more questions without answers (logs, a generator); a plainly fine-tuned student can learn only
    from the first, a distilled one from the teacher's answers to all of them. The file holds the first
    `labelled` bundled training prompts (the examples an SFT baseline trains on) and then fresh prompts
    from the same generator that are neither training nor held-out prompts, so the teacher (fine-tuned on
    the training set) answers them as it would any new question: no reference answer leaks through it.
    """
    root = home() / "datasets" / f"bundled-prompts-{n}-{labelled}-{seed}"
    path = root / "train.jsonl"
    if path.exists():
        return path
    train, eval_ = bundled_paths(seed=seed)
    train_prompts, eval_prompts = ([record["prompt"] for _line, record in jsonl_records(f)] for f in (train, eval_))
    taken = set(train_prompts) | set(eval_prompts)
    prompts = train_prompts[:labelled]
    rng = random.Random(seed + 7)
    for _ in range(100 * n):  # bounded: the generator has about 35,000 distinct prompts
        if len(prompts) >= n:
            break
        prompt, _answer = _task(rng)
        if prompt not in taken:
            taken.add(prompt)
            prompts.append(prompt)
    if len(prompts) < n:
        raise ValueError(f"the bundled generator has fewer than {n} new prompts")
    atomic_write_text(path, "".join(json.dumps({"prompt": p}) + "\n" for p in prompts))
    return path


# --------------------------------------------------------------------------- a generic corpus

_FILLER = (
    "the of and to in is you that it was for on are as with they at be this have from or one had by "
    "word but not what all were we when your can said there use an each which she do how their if "
    "will up other about out many then them these so some her would make like him into time has look "
    "two more write go see number no way could people my than first water been call who now find long "
    "down day did get come made may part letters answer question text string count"
).split()


def _fact(rng: random.Random) -> str:
    """One sentence that uses a skill the bundled tasks ask for, phrased as prose, never as their question."""
    kind = rng.randrange(7)
    if kind == 0:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        return rng.choice([f"{a} plus {b} makes {a + b}.", f"Adding {b} to {a} gives {a + b}.",
                           f"{a} and {b} together are {a + b}."])
    if kind == 1:
        a, b = rng.randint(0, 99), rng.randint(0, 99)
        hi, lo = max(a, b), min(a, b)
        return rng.choice([f"{hi} minus {lo} leaves {hi - lo}.", f"Taking {lo} from {hi} leaves {hi - lo}."])
    w = "".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(1, 6)))
    if kind == 2:
        return rng.choice([f"Backwards, {w} reads {w[::-1]}.", f"{w} spelled from the end is {w[::-1]}."])
    if kind == 3:
        return rng.choice([f"In capitals, {w} is {w.upper()}.", f"{w.upper()} is {w} in upper case."])
    if kind == 4:
        return rng.choice([f"The string {w} has {len(w)} letters.", f"{w} is {len(w)} characters long."])
    if kind == 5:
        return rng.choice([f"{w} twice is {w}{w}.", f"Say {w} two times: {w}{w}."])
    return " ".join(rng.choice(_FILLER) for _ in range(rng.randint(4, 12))).capitalize() + "."


def generic_corpus(n: int, seed: int = 0) -> list[dict[str, str]]:
    """n plain-text records for pretraining a student base: prose with numbers, words and string facts.

    Why: a real student (a pretrained 0.5B model) already knows language, arithmetic and spelling; it
    does not know the task's question format, its chat turns or its answer style. This corpus gives the
    tiny presets that starting point in minutes: the same skills, written as sentences, with no chat
    template and none of the bundled questions' wording, so fine-tuning or distillation still has the
    task itself to teach.
    """
    rng = random.Random(seed)
    return [{"text": " ".join(_fact(rng) for _ in range(rng.randint(3, 6)))} for _ in range(n)]


def generic_corpus_path(n: int = 20000, seed: int = 0) -> Path:
    """Write (once) the generic pretraining corpus as text JSONL; returns its path."""
    path = home() / "datasets" / f"generic-{n}-{seed}" / "train.jsonl"
    if not path.exists():
        atomic_write_text(path, "".join(json.dumps(r) + "\n" for r in generic_corpus(n, seed)))
    return path
