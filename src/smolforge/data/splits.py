"""From a DataSpec to train/eval token datasets plus the raw eval examples for accuracy."""

from __future__ import annotations

import random
from dataclasses import dataclass, field

from smolforge.config import DataSpec
from smolforge.data.encode import EncodeStats, encode_all
from smolforge.data.formats import Example, read_examples
from smolforge.data.synthetic import BUNDLED_PROMPTS, bundled_paths, bundled_prompts_path
from smolforge.errors import SmolforgeError


class TokenRows(list):
    """A list of {"input_ids", "labels"} rows; a list is already a map-style torch Dataset."""


@dataclass
class Splits:
    train: TokenRows
    eval: TokenRows
    eval_examples: list[Example]
    format: str
    skipped: int
    train_stats: EncodeStats
    eval_stats: EncodeStats
    notes: list[str] = field(default_factory=list)

    @property
    def stats(self) -> dict:
        return {
            "format": self.format,
            "train_sequences": len(self.train),
            "eval_sequences": len(self.eval),
            "skipped_lines": self.skipped,
            "folded_system": self.folded,
            "truncated": self.train_stats.truncated + self.eval_stats.truncated,
            "dropped_no_target": self.train_stats.dropped_no_target + self.eval_stats.dropped_no_target,
            "train_tokens": self.train_stats.tokens,
            "train_target_tokens": self.train_stats.target_tokens,
        }

    @property
    def folded(self) -> int:
        """Examples (train and eval) whose system turns were folded into the next user turn."""
        return self.train_stats.folded + self.eval_stats.folded


def read_spec(spec: DataSpec, prompts_only: bool = False) -> tuple[list[Example], list[Example], str, int]:
    """(train examples, eval examples, format, skipped lines); `prompts_only`: train answers optional
    (a teacher's prompts), eval examples keep needing theirs."""
    path, eval_path = spec.path, spec.eval_path
    if eval_path == "bundled":  # a held-out set by name: the generated task set's held-out file
        eval_path = str(bundled_paths()[1])
    if path == "bundled":
        train_p, eval_p = bundled_paths()
        path, eval_path = str(train_p), eval_path or str(eval_p)
    elif path == BUNDLED_PROMPTS:  # prompts without answers, scored on the bundled held-out examples
        path, eval_path = str(bundled_prompts_path()), eval_path or str(bundled_paths()[1])
    res = read_examples(path, spec.format, spec.skip_bad_lines, prompts_only)
    train, skipped = res.examples, res.skipped
    if eval_path:
        ev = read_examples(eval_path, spec.format if spec.format != "auto" else res.format, spec.skip_bad_lines)
        eval_ex, skipped = ev.examples, skipped + ev.skipped
    elif spec.eval_fraction > 0 and len(train) > 1:
        rng = random.Random(0)
        order = list(range(len(train)))
        rng.shuffle(order)
        n_eval = max(1, int(len(train) * spec.eval_fraction))
        held = set(order[:n_eval])
        eval_ex = [e for i, e in enumerate(train) if i in held]
        train = [e for i, e in enumerate(train) if i not in held]
    else:
        eval_ex = []
    if spec.max_samples:
        train = train[: spec.max_samples]
    if spec.max_eval_samples:
        eval_ex = eval_ex[: spec.max_eval_samples]
    if prompts_only:  # a prompt without an answer (from the split of a teacher's data) scores nothing
        eval_ex = [e for e in eval_ex if e.messages is None or e.answer is not None]
    return train, eval_ex, res.format, skipped


def load_splits(spec: DataSpec, tokenizer, read: tuple[list[Example], list[Example], str, int] | None = None, *,
                system_role: bool = True) -> Splits:
    """`read`: what read_spec(spec) returned, when the caller has read (and so checked) the data already.
    `system_role`: whether the model's chat template renders a system turn (the family's answer, which
    data/ cannot ask: the caller passes `abilities(tokenizer).system`); False folds system turns into the
    next user turn. A record the template refuses is a bad line (SmolforgeError at file:line, or skipped
    and counted under `spec.skip_bad_lines`)."""
    train_ex, eval_ex, fmt, skipped = read if read is not None else read_spec(spec)
    train_rows, train_stats = encode_all(tokenizer, train_ex, spec.max_length, spec.packing,
                                         system_role=system_role, skip_bad_lines=spec.skip_bad_lines)
    if train_ex and train_stats.skipped == len(train_ex):
        raise SmolforgeError(f"no usable examples ({train_stats.skipped} bad lines skipped)", where=str(spec.path),
                             fix="check the records against the model's chat template; the first problems were: "
                             + "; ".join(train_stats.problems[:3]))
    eval_rows, eval_stats = encode_all(tokenizer, eval_ex, spec.max_length, packing=False,
                                       system_role=system_role, skip_bad_lines=spec.skip_bad_lines)
    return Splits(
        train=TokenRows(train_rows), eval=TokenRows(eval_rows),
        eval_examples=[e for e in eval_stats.kept if e.messages], format=fmt,
        skipped=skipped + train_stats.skipped + eval_stats.skipped,
        train_stats=train_stats, eval_stats=eval_stats,
    )
