"""What a step meant, and where a resumed run continues: the one rule every resuming run asks.

A checkpoint is named by its step, but a step only means something under the settings it was taken
with: step 6 at 4 rows per step is sample 24; read under 8 rows per step it would be sample 48, and a
run resumed there skips an epoch's half while its summary counts rows it never trained. So every
checkpoint of a run that trains over a known dataset (`smolforge train`, each data-parallel rank)
records a `StepMeaning` in its checksummed `state.json` (the rows per step and the batch, gradient
accumulation and world size that make them, the order's seed, max length, packing and a fingerprint
of the encoded training rows) and the data position in samples (`samples_done`).

`resume_point` is the rule, asked by the driver (`train.driver`) for a single run and for each rank of
a data-parallel round alike, whatever world size the round has:

- the same rows per step, however they are split into batch x accumulation x ranks (a data-parallel
  job keeps its global batch when its group re-forms on another number of nodes): the run continues at
  the saved step, which is the same sample of the same seeded order (`engine.SampleOrder`);
- other rows per step, or another seed: refused (exit 2), naming each setting and the value to pass.
  Continuing by samples under another global batch would also move the LR schedule, the warmup and the
  step count, all counted in steps; a new run (another output dir) is the honest way to change them;
- other training rows (a changed data file, or max length or packing, which re-encode every row):
  refused unless the user says so (`--resume-new-data`, `TrainConfig.resume_new_data`); then the run
  continues at the saved step and sample over the new data's order, and says so;
- a checkpoint from before these fields: resumed as before, with one line saying the position is
  inferred from the step.
"""

from __future__ import annotations

import hashlib
from array import array
from dataclasses import asdict, dataclass, fields
from typing import Any, Sequence

from smolforge.errors import SmolforgeError

STATE_KEY = "step_meaning"  # where a checkpoint's state.json keeps its StepMeaning
SAMPLES_KEY = "samples_done"  # ... and its data position: rows trained before the step, every rank together
NEW_DATA_FLAG = "--resume-new-data"
# the flag that sets each setting a refusal names, in the command that resumes (`smolforge train`'s here;
# `split train` names its own); "new_data": the flag that accepts changed rows (None: the command has none)
TRAIN_FLAGS = {"batch_size": "--batch-size", "grad_accum": "--grad-accum", "seed": "--seed",
               "max_length": "--max-length", "packing": "--packing", "new_data": NEW_DATA_FLAG}


@dataclass(frozen=True)
class StepMeaning:
    """What one optimizer step of a run is: which rows, in which order, encoded how."""

    rows_per_step: int  # every rank's rows of one step: batch_size x grad_accum x world
    batch_size: int  # rows per micro-batch, per rank
    grad_accum: int  # micro-batches per step, per rank
    world: int  # ranks sharing a step
    seed: int  # the sample order's seed
    max_length: int  # tokens per row (a longer one is cut)
    packing: bool
    data_rows: int  # training rows the order runs over
    data_sha256: str  # of those rows as encoded (`data_fingerprint`)

    def to_state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: Any) -> "StepMeaning | None":
        """The meaning a checkpoint recorded; None when it records none (or not all of it)."""
        names = {f.name for f in fields(cls)}
        if not isinstance(state, dict) or not names <= state.keys():
            return None
        return cls(**{k: state[k] for k in names})


@dataclass(frozen=True)
class ResumePoint:
    """Where a resumed run starts: its next step, the rows trained before it, and a line to say (or None)."""

    step: int
    samples: int
    note: str | None = None


def data_fingerprint(rows: Sequence[dict[str, Sequence[int]]]) -> str:
    """sha256 of encoded training rows (their token ids and labels, in order): any change of the data
    file, the tokenizer, max length or packing changes it. Seconds for a million rows of 256 tokens."""
    h = hashlib.sha256()
    for row in rows:
        ids, labels = array("q", row["input_ids"]), array("q", row["labels"])
        h.update(len(ids).to_bytes(8, "little"))
        h.update(ids.tobytes())
        h.update(labels.tobytes())
    return h.hexdigest()


def resume_point(state: dict[str, Any], now: StepMeaning | None, rows_per_step: int,
                 allow_new_data: bool = False, where: str = "--resume",
                 flags: dict[str, str | None] = TRAIN_FLAGS) -> ResumePoint:
    """Where a run with step meaning `now` continues from a checkpoint's `state` (its state.json).

    `rows_per_step`: the run's rows per step (`now.rows_per_step` when it has a meaning; a run without
    one, a distillation student, replays its own order and is only told the step); `flags`: the resuming
    command's flag for each setting (`TRAIN_FLAGS`), for the fix. Raises SmolforgeError (exit 2) when
    the checkpoint's steps mean other samples under `now`; see the module's rules.
    """
    step = int(state["step"])
    if now is None:
        return ResumePoint(step, step * rows_per_step)
    saved = StepMeaning.from_state(state.get(STATE_KEY))
    if saved is None:
        return ResumePoint(step, step * now.rows_per_step,
                           f"checkpoint step-{step} records no data position (made before it was kept): the "
                           f"position is inferred from its step, sample {step * now.rows_per_step:,} at "
                           f"{now.rows_per_step} rows per step")
    samples = int(state.get(SAMPLES_KEY, step * saved.rows_per_step))
    _refuse_other_steps(step, saved, now, where, flags)
    data = _data_changes(saved, now)
    if not data:
        return ResumePoint(step, samples)
    new_data = flags.get("new_data")
    if not (allow_new_data and new_data):
        accept = f"pass {new_data} to continue from step {step} over the new data's order, or " if new_data else ""
        raise SmolforgeError(
            f"the training data changed since checkpoint step-{step} ({'; '.join(data)}): its step {step} "
            f"(sample {samples:,}) is a position in the old data's order", where=where,
            fix=f"resume with the data it was trained on{_encoding_flags(saved, now, flags)}, or "
                f"{accept}choose a new --output-dir")
    return ResumePoint(step, samples, f"continuing at step {step} (sample {samples:,}) over changed training data "
                                      f"({'; '.join(data)}), as {new_data} asks")


def _refuse_other_steps(step: int, saved: StepMeaning, now: StepMeaning, where: str,
                        flags: dict[str, str | None]) -> None:
    """Refuse (exit 2) when `now` reads the saved step as other samples: other rows per step or another seed."""
    changed, fixes = [], []
    if now.rows_per_step != saved.rows_per_step:
        for name in ("batch_size", "grad_accum", "world"):
            was, is_, flag = getattr(saved, name), getattr(now, name), flags.get(name)
            if was != is_:
                changed.append(f"{name} {was} -> {is_}")
                fixes.append(f"{flag} {was}" if flag else f"a {name.replace('_', ' ')} of {was}")
        changed.append(f"rows per step {saved.rows_per_step} -> {now.rows_per_step}")
    if now.seed != saved.seed:
        changed.append(f"seed {saved.seed} -> {now.seed}")
        fixes.append(f"{flags.get('seed', '--seed')} {saved.seed}")
    if not changed:
        return
    raise SmolforgeError(
        f"checkpoint step-{step} was trained at batch_size {saved.batch_size} x grad_accum {saved.grad_accum} x "
        f"world {saved.world} = {saved.rows_per_step} rows per step (seed {saved.seed}); this run changes "
        f"{', '.join(changed)}, so its step {step} would be other samples than the ones trained", where=where,
        fix=f"resume with {' '.join(fixes)} (batch_size x grad_accum x world = {saved.rows_per_step}; a data-parallel "
            f"job keeps its global batch), or start a new run in another --output-dir")


def _data_changes(saved: StepMeaning, now: StepMeaning) -> list[str]:
    """What about the training rows differs between a checkpoint and this run (empty: the same rows)."""
    out = [f"{name} {getattr(saved, name)} -> {getattr(now, name)}" for name in ("max_length", "packing")
           if getattr(saved, name) != getattr(now, name)]
    if saved.data_sha256 != now.data_sha256:
        out.append(f"{saved.data_rows} rows sha256 {saved.data_sha256[:12]} -> {now.data_rows} rows sha256 "
                   f"{now.data_sha256[:12]}")
    return out


def _encoding_flags(saved: StepMeaning, now: StepMeaning, flags: dict[str, str | None]) -> str:
    """The flags that give back the checkpoint's encoding of the rows, as words for a fix ("" when the same)."""
    out = [f"{flags.get('max_length')} {saved.max_length}"] if saved.max_length != now.max_length else []
    if saved.packing != now.packing:
        out.append(f"{flags.get('packing')}" if saved.packing else f"no {flags.get('packing')}")
    return f" ({' '.join(out)})" if out else ""
