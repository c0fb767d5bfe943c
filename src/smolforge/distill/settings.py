"""A distillation run's settings (`DistillSettings`) and their checks: what `smolforge distill`,
`launch --mode teacher_student|hybrid` and a `kind: distill` job file's `distill:` section all mean.

One pydantic model, validated once where the settings enter (the CLI, a submitted job); the job
runner and the actors receive it as it is. The run itself (teachers → streaming students →
aggregation, on the cluster) is `smolforge.cluster.workloads.distill.run.run_distill`; it writes the seed layout:
    <output_dir>/teacher_outputs/batch_N.{safetensors,json}, plan.json
    <output_dir>/output/student_N/<peft>_adapter/ (+ summary.json)
    <output_dir>/merged_model/final_adapter/      (several bases: merged_model/<base>/final_adapter/)
    (with --students-sync ddp the students of a base write one adapter, to the first's student_N/)
    <output_dir>/distill_summary.json
"""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any, ClassVar, Literal

from pydantic import Field, field_validator, model_validator

from smolforge.config import DEFAULT_LR, ModelDtype, NamedDataset, PeftSpec, default_lr, validate
from smolforge.distill.prompts import GenSettings
from smolforge.errors import SmolforgeError, in_spec
from smolforge.rundir import check_run_dir, record

# How the students of a base become one adapter (`--aggregate`), one place: `distill/aggregate.py`
# implements them; the CLI's help and `check_run` read them here, without importing torch.
AGGREGATE_METHODS: tuple[str, ...] = ("mean", "ties")
AGGREGATE_CHOICES: tuple[str, ...] = (*AGGREGATE_METHODS, "none")  # none: the students' adapters stay apart


class DistillSettings(NamedDataset):
    """Everything a distillation run can set; defaults suit a small model on a CPU. The prompts are
    `data` (a JSONL file or a built-in set) or a dataset by name (`dataset_name`: config.NamedDataset)."""

    DATASET_FILE: ClassVar[str] = "data"
    EVAL_FILE: ClassVar[str | None] = "eval_data"

    teacher: str
    students: list[str]
    data: str | None = None
    eval_data: str | None = Field(None, description="held-out JSONL the students are evaluated on, whole (a job "
                                  "uploads it); default: a split of `data` (or dataset_eval_split)")
    dataset_eval_split: str | None = Field(None, description="with dataset_name: its split the students are "
                                           "evaluated on, read as eval_data (e.g. validation)")
    num_teachers: int | None = Field(None, ge=1)
    num_students: int = Field(2, ge=1)
    peft: str = "lora"
    peft_config: dict[str, Any] = Field(default_factory=dict)
    kd_loss: str = "forward_kl"
    kd_ratio: float = Field(0.5, ge=0, le=1)
    temperature: float = Field(1.0, gt=0, description="KD softmax temperature")
    beta: float = 0.5
    # On-policy distillation (GKD): this fraction of student steps trains on the student's own samples,
    # scored by the teacher loaded in the student's process (same tokenizer). See distill/on_policy.py.
    on_policy_ratio: float = Field(0.0, ge=0, le=1)
    on_policy_temperature: float = Field(1.0, gt=0)
    on_policy_start: float = Field(0.0, ge=0, lt=1)  # fraction of the steps before the first on-policy one
    top_k: int = Field(32, ge=0)
    compress_outputs: bool = True
    teacher_backend: str = "hf"
    teacher_quant: str = "q8_0"  # the llamacpp backend's GGUF weights (models.export.cache.TEACHER_QUANTS)
    ollama_host: str | None = None
    teacher_url: str | None = None  # the openai backend's endpoint, e.g. http://host:8000/v1
    teacher_key_file: str | None = None  # its API key's file, read on the teacher's node (else $OPENAI_API_KEY)
    gen_temperature: float = Field(0.0, ge=0, description="teacher sampling (0: greedy)")
    top_p: float = Field(1.0, gt=0, le=1)
    max_new_tokens: int = Field(32, ge=1)
    samples_per_prompt: int = Field(1, ge=1)
    teacher_responses: str = "generate"  # or "reference": score the dataset's answers (word-level KD)
    teacher_batch_size: int = Field(16, ge=1)
    num_shards: int | None = Field(None, ge=1)
    max_samples: int | None = Field(None, ge=1)
    max_steps: int | None = Field(None, ge=1)
    epochs: float = Field(1.0, gt=0)
    batch_size: int = Field(8, ge=1)
    grad_accum: int = Field(1, ge=1)
    lr: float | None = Field(None, gt=0, description="default: per PEFT method (config.DEFAULT_LR)")
    warmup_steps: int = Field(0, ge=0)
    save_every: int = 50  # student checkpoints, kept by the driver: a lost worker's student restarts there
    replace_timeout_s: float = 300.0  # a student whose node died waits this long for an eligible node, then fails
    max_length: int = Field(256, ge=8)
    seed: int = 0
    split_shards: bool | None = None
    # how the students of one base share what they learn (smolforge.cluster.workloads.distill.sync): "average"
    # trains them apart and averages their adapters; "ddp" makes them one data-parallel group (with
    # `students_strategy`: a strategy whose class says `distill_students`; ddp by default) and one adapter
    students_sync: Literal["average", "ddp"] = "average"
    students_strategy: str | None = None
    teacher_on_coordinator: bool = False  # the teachers run on the coordinator node (the user lends it)
    aggregate: str = "mean"  # one of AGGREGATE_CHOICES
    aggregate_rank: int | None = Field(None, ge=1)
    cpus_per_teacher: float = Field(1.0, gt=0)
    cpus_per_student: float = Field(1.0, gt=0)
    eval: bool = True
    max_eval_samples: int | None = 200
    eval_max_new_tokens: int = Field(16, ge=1)
    device: str = "auto"
    # Two dtypes, not one: the teacher only runs inference (bf16 halves a 7B teacher's ~28 GB and is
    # safe on any device), the students train (their frozen base may be bf16, the adapter stays fp32;
    # fp16 cannot train on a CPU). See smolforge.models.dtypes.
    teacher_dtype: ModelDtype = "fp32"
    student_dtype: ModelDtype = "fp32"

    @model_validator(mode="before")
    @classmethod
    def _known_and_required(cls, value: Any) -> Any:
        """One sentence for unknown or missing keys, naming what is known (pydantic's are terser)."""
        if not isinstance(value, dict):
            return value
        unknown = sorted(set(value) - set(cls.model_fields))
        if unknown:
            raise ValueError(f"unknown distill setting(s) {', '.join(unknown)}; known: {', '.join(sorted(cls.model_fields))}")
        for key in ("teacher", "students", "data"):
            if key not in value and not (key == "data" and value.get("dataset_name") is not None):
                raise ValueError(f"distill.{key} is required" + (" (or distill.dataset_name)" if key == "data" else ""))
        return value

    @field_validator("students", mode="before")
    @classmethod
    def _one_or_more(cls, value: Any) -> Any:
        return [value] if isinstance(value, str) else value

    @model_validator(mode="after")
    def _lr_for_method(self) -> "DistillSettings":
        """An omitted lr becomes the students' PEFT method's default (config.DEFAULT_LR)."""
        if self.lr is None and self.peft in DEFAULT_LR:
            self.lr = default_lr(self.peft)
        return self


def _slug(name: str) -> str:
    return re.sub(r"[^A-Za-z0-9_.-]+", "-", Path(name).name or name).strip("-") or "student"


def check_output_flag(output_dir: str | Path) -> None:
    """`smolforge distill --output-dir`: a path on this machine, relative or not, without '..' (a job
    spec's `output_dir` has its own rule: `cluster/control/kinds.check_output_dir`)."""
    if ".." in Path(output_dir).parts:
        raise SmolforgeError(f"--output-dir {output_dir} contains '..'", fix="give a plain directory path")


# the teacher's generation settings (distill.prompts.GenSettings) by their names in DistillSettings
GEN_FIELDS: dict[str, str] = {"temperature": "gen_temperature", "responses": "teacher_responses",
                              "batch_size": "teacher_batch_size"}


def check_run(cfg: DistillSettings, mode: str = "teacher_student") -> None:
    """The checks across fields and into other modules' settings, before a cluster starts: bad
    flags fail in a second, not after the teachers. Each refusal of one setting names it as the
    error's `field` (DistillSettings' key: `config.placed` finds a spec file's line for it)."""
    from smolforge.distill.kdconfig import KDConfig

    if not cfg.students:
        raise SmolforgeError("no student model given", fix="pass --student NAME (repeat it for several bases)",
                             field=("students",))
    if cfg.aggregate not in AGGREGATE_CHOICES:
        raise SmolforgeError(f"unknown --aggregate {cfg.aggregate!r}", fix=f"use one of {', '.join(AGGREGATE_CHOICES)}",
                             field=("aggregate",))
    if mode not in ("teacher_student", "hybrid"):
        raise SmolforgeError(f"unknown --mode {mode!r}", fix="use teacher_student or hybrid")
    with in_spec(names={"loss": "kd_loss"}):
        KDConfig(loss=cfg.kd_loss, temperature=cfg.temperature, kd_ratio=cfg.kd_ratio, beta=cfg.beta)
    _check_peft(cfg)
    with in_spec(names=GEN_FIELDS):
        GenSettings(temperature=cfg.gen_temperature, top_p=cfg.top_p, max_new_tokens=cfg.max_new_tokens,
                    samples_per_prompt=cfg.samples_per_prompt, top_k=cfg.top_k, batch_size=cfg.teacher_batch_size,
                    responses=cfg.teacher_responses).check()
    _check_backend(cfg)
    if cfg.replace_timeout_s <= 0:
        raise SmolforgeError(f"replace_timeout_s must be positive, not {cfg.replace_timeout_s}",
                             fix="give the seconds a student whose node died may wait for another (e.g. 300)",
                             field=("replace_timeout_s",))
    if cfg.eval_data is not None and not cfg.eval:
        raise SmolforgeError("--eval-data names a held-out file, but --no-eval skips the students' evaluation",
                             fix="drop --no-eval (distill.eval: false), or drop --eval-data (distill.eval_data)",
                             fields=(("eval",), ("eval_data",)))
    if cfg.save_every < 0:
        raise SmolforgeError(f"--save-every must be 0 or more, not {cfg.save_every}",
                             fix="pass a step count (e.g. --save-every 50), or 0 for no student checkpoints",
                             field=("save_every",))
    check_shared_tokenizer(cfg.teacher, cfg.students, shared_tokenizer_needs(cfg.on_policy_ratio,
                                                                               cfg.teacher_responses))


def _check_peft(cfg: DistillSettings) -> None:
    """The students' PEFT method and config, as `PeftSpec` reads them; a refused key is `peft_config`'s
    (the method: `peft`) as the error's field."""
    try:
        validate(PeftSpec, {"method": cfg.peft, **cfg.peft_config}, where="--peft/--peft-config")
    except SmolforgeError as err:
        head = tuple(err.field or ())
        err.field = ("peft",) if head[:1] == ("method",) else ("peft_config", *head) if head else None
        raise


def _check_backend(cfg: DistillSettings) -> None:
    """The teacher backend can do what the settings ask of it (on-policy scoring, reference answers) and
    its own check (`TeacherBackend.check`); SmolforgeError naming the setting as its field."""
    from smolforge.distill.backends import backends_that, teacher_backend

    with in_spec(default=("teacher_backend",)):
        backend = teacher_backend(cfg.teacher_backend)
    if cfg.on_policy_ratio > 0 and not backend.on_policy:
        raise SmolforgeError(f"--on-policy-ratio needs a teacher that can score the student's samples; the "
                             f"{backend.name} backend cannot", fields=(("on_policy_ratio",), ("teacher_backend",)),
                             fix=f"use --teacher-backend {' or '.join(backends_that('on_policy'))}, or --on-policy-ratio 0")
    if cfg.teacher_responses == "reference" and not backend.scores_reference:
        raise SmolforgeError("--teacher-responses reference needs a teacher that scores given answers; the "
                             f"{backend.name} backend generates its own", fields=(("teacher_responses",), ("teacher_backend",)),
                             fix=f"use --teacher-backend {' or '.join(backends_that('scores_reference'))} for reference")
    backend.check(cfg)


def shared_tokenizer_needs(on_policy_ratio: float, teacher_responses: str = "generate") -> list[tuple[str, str, str]]:
    """The settings of a run that only work when the teacher's and the students' token ids agree, as
    (what needs it, the fix, its setting: DistillSettings' key): on-policy steps (the teacher scores the student's own sampled ids), and
    reference responses (the teacher's only product is its log-probs over the dataset's answers; a
    student of another vocabulary drops them and trains on the answers alone, plain fine-tuning after a
    whole teacher stage). Everything else works across tokenizers: the students fall back to
    sequence-level KD on the teacher's text."""
    needs = []
    if on_policy_ratio > 0:
        needs.append((f"--on-policy-ratio {on_policy_ratio} (the teacher scores the student's own token ids)",
                      "pass --on-policy-ratio 0 (the student learns from the teacher's text: sequence-level KD)",
                      "on_policy_ratio"))
    if teacher_responses == "reference":
        needs.append(("--teacher-responses reference (the teacher's log-probs over the dataset's answers are "
                      "all it produces)", "pass --teacher-responses generate (sequence-level KD on the teacher's "
                                          "own answers)", "teacher_responses"))
    return needs


def check_shared_tokenizer(teacher: str, students: list[str], needs: list[tuple[str, str, str]],
                           names: tuple[str, str] = ("teacher", "students")) -> None:
    """Refuse at submit (exit 2), from the tokenizers alone (their files, no weights), settings that
    `shared_tokenizer_needs` says need one vocabulary when the teacher's and a student's differ, rather
    than after the teacher stage ran. A model whose tokenizer this machine cannot load without a
    download (a name only the workers hold, an Ollama tag, a GGUF: checked by `_check_local_gguf`) is
    checked where it runs instead (distill/student.py refuses a mismatched on-policy teacher there).
    The refusal's `fields`: the settings that need one vocabulary (what its fix changes), then NAMES
    (the teacher's and the students' keys in the settings checked)."""
    if not needs:
        return
    from smolforge.distill.store import tokenizer_hash
    from smolforge.models.loading import tokenizer_here

    teacher_tok = tokenizer_here(teacher)
    if teacher_tok is None:
        return
    for student in dict.fromkeys(students):
        student_tok = tokenizer_here(student)
        if student_tok is not None and tokenizer_hash(student_tok) != tokenizer_hash(teacher_tok):
            raise SmolforgeError(
                f"the teacher {teacher} and the student {student} have different tokenizers (vocabularies of "
                f"{len(teacher_tok)} and {len(student_tok)} tokens, ids that do not agree), and "
                f"{' and '.join(what for what, _fix, _key in needs)} need{'s' if len(needs) == 1 else ''} one vocabulary",
                fix="; or ".join(fix for _what, fix, _key in needs) + f"; or pick a student with {teacher}'s tokenizer",
                fields=(*((key,) for _what, _fix, key in needs), (names[1],), (names[0],)))


# the top-level names a distillation run writes in its --output-dir (its manifest: `rundir`)
DISTILL_OUTPUTS = ("teacher_outputs", "output", "merged_model", "distill_summary.json", "export")


def refuse_used_run_dir(output_dir: str | Path, resume: bool) -> None:
    """A distillation rerun into a run dir whose students left checkpoints either continues them
    (`resume`) or is refused: their steps are never deleted, nor continued by a run with other settings.
    Teacher shards are always reused (they are checked against the plan). A directory of another kind of
    run (its manifest: `rundir`) is refused either way; the run's names are recorded in it."""
    run = check_run_dir(output_dir, "distill")
    if not resume:
        _refuse_kept_checkpoints(output_dir)
    record(run, DISTILL_OUTPUTS)


def _refuse_kept_checkpoints(output_dir: str | Path) -> None:
    kept = sorted(Path(output_dir).glob("output/student_*/checkpoints/step-*"))
    if kept:
        raise SmolforgeError(f"{output_dir} holds student checkpoints of an earlier run ({kept[-1].parent.parent.name}: "
                             f"{kept[-1].name})", where="--output-dir",
                             fix="pass --resume to continue that run, or choose a new --output-dir (nothing was deleted)")
