"""Typed plans for a distillation's teachers and students (issue 42, item 2): settings checked once,
then passed whole.

Two ways into a run ask the same two builders:
- the seeds' calls (`create_parallel_teacher_tasks`, `create_student_tasks`, on `Orchestrator` or on a
  session; a `distill_task` job's `args`): their keyword arguments, as the seeds write them, are a
  `TeacherCall` / `StudentCall` (the one list of those arguments, their order and defaults: a name
  the call does not take is Python's TypeError), and `plan_teachers` / `plan_students` check them;
- a whole run (`smolforge distill`, a `kind: distill` job): `run.distill_plans` writes its
  `DistillSettings` as those two calls, then asks the same builders.

A plan holds what the tasks need, resolved: the seeds' spellings (`lora_config`, `task_config`,
`peft_type` + `peft_config`) are gone into one `PeftSpec`, the CPUs, retries and checkpoint interval
the TaskConfig and the arguments agree on, the KD and sampling settings as their own checked types,
and the students' sync plug-in (`sync.make_sync`, asked here only). The session's `start_teachers` /
`start_students` take a plan and do what needs the cluster (nodes, the dataset, the store on disk).
No Ray, no torch: the builders are pure and cheap.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING, Any

from smolforge.cluster.control.specs import TaskConfig
from smolforge.cluster.workloads.distill.seed_args import resolve, student_args, task_options
from smolforge.cluster.workloads.distill.sync import AverageSync, DataParallelSync, make_sync
from smolforge.config import PeftSpec
from smolforge.distill import backends
from smolforge.distill.kdconfig import KDConfig
from smolforge.distill.prompts import GenSettings
from smolforge.errors import SmolforgeError

if TYPE_CHECKING:  # (a store's plan.json: an annotation only)
    from smolforge.distill.store import StorePlan


def store_dir_of(output_dir: str | Path) -> Path:
    """The teacher store under a run dir: `<output_dir>/teacher_outputs` (a dir of that name as is)."""
    p = Path(output_dir)
    return p if p.name == "teacher_outputs" else p / "teacher_outputs"


@dataclass(frozen=True)
class TeacherCall:
    """The seeds' `create_parallel_teacher_tasks` arguments, as they write them, in their order.

    The positional order is the seeds' (`model_path, dataset_path, output_dir, num_teachers`).
    Teachers run only on nodes that can load `model_path` with `backend` (an `hf` or `reference`
    teacher needs the weights, an `ollama` one the Ollama tag), GPU nodes first. Shards go to
    `<output_dir>/teacher_outputs/` (an output_dir named teacher_outputs is used as is). A failed
    teacher's shards go to another eligible node, `max_retries` times per shard (default 2).
    `task_config` (the seeds' TaskConfig) may give resources.cpu_cores and max_retries (see
    seed_args.py). `teacher_on_coordinator`: the teachers run on the coordinator (head) node, which
    otherwise takes no work. `backend` llamacpp: a GGUF in llama.cpp with `cpus_per_teacher` threads
    (`quant`: the weights its node exports the HF teacher to, once; `tokenizer`: the HF tokenizer whose
    ids a given GGUF file must have, the student's). `backend` openai: `model_path` is the name the
    endpoint `teacher_url` serves (`teacher_key_file`: its key's file on the teacher's node).
    """

    model_path: str
    dataset_path: str
    output_dir: str | Path
    num_teachers: int | None = None  # None: one per eligible node
    batch_size: int = 8
    compress_outputs: bool = True
    max_samples: int | None = None
    top_k: int = 32
    temperature: float = 0.0
    top_p: float = 1.0
    max_new_tokens: int = 32
    samples_per_prompt: int = 1
    num_shards: int | None = None
    shard_size: int | None = None
    backend: str = "hf"
    cpus_per_teacher: float | None = None
    device: str = "auto"
    dtype: str = "fp32"
    ollama_host: str | None = None
    tokenizer: str | None = None
    data_format: str = "auto"
    seed: int = 0
    responses: str = "generate"
    max_retries: int | None = None
    task_config: TaskConfig | None = None
    teacher_on_coordinator: bool = False
    quant: str = "q8_0"
    teacher_url: str | None = None
    teacher_key_file: str | None = None


@dataclass(frozen=True)
class TeacherPlan:
    """A teacher stage, checked: what `TeacherTasks.start_teachers` needs (no seed spellings left).

    `store_dir`: `<output_dir>/teacher_outputs` (not resolved: the session makes and resolves it);
    `num_teachers` None: one per eligible node; `cpus` per teacher (TaskConfig's cpu_cores or the
    argument, default 1); `max_retries` per shard (default 2); `settings`: the sampling, checked."""

    model: str
    dataset: str
    store_dir: Path
    num_teachers: int | None
    settings: GenSettings
    compress: bool
    max_samples: int | None
    num_shards: int | None
    shard_size: int | None
    backend: str
    cpus: float
    max_retries: int
    device: str
    dtype: str
    ollama_host: str | None
    tokenizer: str | None
    data_format: str
    on_coordinator: bool
    quant: str
    teacher_url: str | None
    teacher_key_file: str | None


def plan_teachers(call: TeacherCall) -> TeacherPlan:
    """The teacher stage's plan from the seeds' arguments: a SmolforgeError for what the call cannot
    honour (a TaskConfig's RAM/GPU/priority, an unknown backend, bad sampling, no teachers)."""
    opts = task_options(call.task_config, "teacher")
    backends.teacher_backend(call.backend)  # an unknown name: the choices, before any work
    settings = GenSettings(temperature=call.temperature, top_p=call.top_p, max_new_tokens=call.max_new_tokens,
                           samples_per_prompt=call.samples_per_prompt, top_k=call.top_k, batch_size=call.batch_size,
                           seed=call.seed, responses=call.responses)
    settings.check()
    if call.num_teachers is not None and int(call.num_teachers) < 1:
        raise SmolforgeError("num_teachers must be ≥ 1", fix="pass --num-teachers 1 or more (or leave it unset)")
    return TeacherPlan(
        model=call.model_path, dataset=str(call.dataset_path), store_dir=store_dir_of(call.output_dir),
        num_teachers=None if call.num_teachers is None else int(call.num_teachers), settings=settings,
        compress=call.compress_outputs, max_samples=call.max_samples, num_shards=call.num_shards,
        shard_size=call.shard_size, backend=call.backend,
        cpus=resolve("cpus_per_teacher", call.cpus_per_teacher, opts.get("cpus"), 1.0),
        max_retries=resolve("max_retries", call.max_retries, opts.get("max_retries"), 2), device=call.device,
        dtype=call.dtype, ollama_host=call.ollama_host, tokenizer=call.tokenizer, data_format=call.data_format,
        on_coordinator=call.teacher_on_coordinator, quant=call.quant, teacher_url=call.teacher_url,
        teacher_key_file=call.teacher_key_file)


def stored_teacher_plan(stored: StorePlan, store_dir: Path, settings: GenSettings) -> TeacherPlan:
    """The teacher plan of a store an earlier run left (`stored`: its plan.json; `settings`: its sampling),
    to regenerate its missing or corrupt shards: its teacher, dataset, backend and compression, the rest
    the seeds' defaults (`TeacherCall`'s)."""
    call = TeacherCall(stored.teacher, stored.dataset, store_dir, backend=stored.backend,
                       compress_outputs=stored.compress)
    return replace(plan_teachers(call), settings=settings)


@dataclass(frozen=True)
class StudentCall:
    """The seeds' `create_student_tasks` arguments, as they write them, in their order.

    `base_model` may be a list (several student bases learn from one teacher output). With several
    students per base the shards are split so no two of them train on the same one;
    `split_shards=False` gives each the whole set. Outputs: `<output_dir>/output/student_N/` (default
    output_dir: the run dir holding teacher_outputs/). With `resume`, a paused student continues from
    its checkpoint in `student_N/checkpoints/`; without it, such checkpoints are stale and removed.
    `peft_config` takes each method's keys as the seeds write them (LoRA r/alpha/dropout, prefix/prompt
    num_virtual_tokens, prompt prompt_tuning_init TEXT|RANDOM with prompt_tuning_init_text, adapter
    reduction_factor, IA3 {}); `lora_config={"r": 8, "alpha": 16}` is `peft_type="lora"` with that
    peft_config. `task_config` (a TaskConfig) may give resources.cpu_cores, max_retries (restarts after
    a lost worker) and checkpointing (false: none; true: every 50 steps unless save_every is set).
    `students_sync` (`sync.py`): "average", or "ddp": the students of each base are one data-parallel
    group (`students_strategy`, DDP by default) that writes ONE adapter, to its first member's
    `student_N/`. `on_policy_ratio` > 0: that fraction of each student's steps (after the first
    `on_policy_start` of them) trains on its own samples scored by `teacher_model` (default: the store's
    teacher), which the student's node loads (distill/on_policy.py).
    """

    base_model: str | list[str]
    teacher_outputs_dir: str | Path
    num_students: int = 2
    peft_type: str = "lora"
    peft_config: dict[str, Any] | None = None
    lora_config: dict[str, Any] | None = None
    task_config: TaskConfig | None = None
    max_retries: int | None = None
    output_dir: str | Path | None = None
    split_shards: bool | None = None
    kd_loss: str = "forward_kl"
    kd_ratio: float = 0.5
    temperature: float = 1.0
    beta: float = 0.5
    max_steps: int | None = None
    epochs: float = 1.0
    batch_size: int = 8
    grad_accum: int = 1
    lr: float | None = None
    warmup_steps: int = 0
    max_length: int = 256
    seed: int = 0
    cpus_per_student: float | None = None
    eval_data: str | None = None
    eval_path: str | None = None  # a held-out file read whole (a dataset's eval split), in place of eval_data's split
    max_eval_samples: int | None = 200
    eval_accuracy: bool = True
    max_new_tokens: int = 16
    device: str = "auto"
    save_every: int | None = None
    wait_timeout_s: float = 900.0
    resume: bool = False
    replace_timeout_s: float = 300.0
    students_sync: str = "average"
    students_strategy: str | None = None
    on_policy_ratio: float = 0.0
    on_policy_temperature: float = 1.0
    on_policy_start: float = 0.0
    teacher_model: str | None = None
    dtype: str = "fp32"
    teacher_dtype: str = "fp32"


@dataclass(frozen=True)
class StudentTraining:
    """What every student of a plan trains with (their actors' `config`, beside base and output dir)."""

    max_steps: int | None
    epochs: float
    batch_size: int
    grad_accum: int
    lr: float | None
    warmup_steps: int
    max_length: int
    seed: int
    device: str
    max_eval_samples: int | None
    eval_accuracy: bool
    max_new_tokens: int
    wait_timeout_s: float
    on_policy_ratio: float
    on_policy_temperature: float
    on_policy_start: float
    dtype: str
    teacher_dtype: str


@dataclass(frozen=True)
class StudentPlan:
    """A students stage, checked: what `StudentTasks.start_students` needs (no seed spellings left).

    `store_dir`: the teacher store read (`<teacher_outputs_dir>/teacher_outputs` unless it is one);
    `run_dir` None: the store's parent; `split`: whether the students of a base split the shards;
    `sync`: the plug-in that says which shards each reads and which form a group; `cpus` per student;
    `save_every` 0: no checkpoints; `max_retries` None: the session's default restarts;
    `teacher_model` None: the store's teacher when on-policy steps need one."""

    bases: tuple[str, ...]
    store_dir: Path
    run_dir: Path | None
    num_students: int
    split: bool
    sync: AverageSync | DataParallelSync
    peft: PeftSpec
    kd: KDConfig
    cpus: float
    save_every: int
    max_retries: int | None
    eval_data: str | None
    eval_path: str | None
    resume: bool
    replace_timeout_s: float
    teacher_model: str | None
    training: StudentTraining

    def student_config(self, store_teacher: str) -> dict[str, Any]:
        """The actors' shared `config` (JSON-able): `store_teacher` scores on-policy steps when the plan
        names no teacher_model."""
        on_policy = self.training.on_policy_ratio > 0
        return {"peft": self.peft.model_dump(), "kd": asdict(self.kd), **asdict(self.training),
                "num_threads": max(1, int(self.cpus)), "save_every": self.save_every,
                "teacher_model": self.teacher_model or (store_teacher if on_policy else None)}


def plan_students(call: StudentCall, mode: str = "teacher_student") -> StudentPlan:
    """The students stage's plan from the seeds' arguments, for a session of `mode`: a SmolforgeError
    for what the call cannot honour (no base, a PEFT config or KD setting its checks refuse, a
    TaskConfig that disagrees with an argument, an unknown sync or strategy, hybrid without a split)."""
    args = student_args(call.peft_type, call.peft_config, call.lora_config, call.task_config, call.cpus_per_student,
                        call.save_every, call.max_retries)
    bases = (call.base_model,) if isinstance(call.base_model, str) else tuple(call.base_model)
    if not bases:
        raise SmolforgeError("no student base model given", fix="pass --student NAME")
    if mode == "hybrid" and call.split_shards is False:
        raise SmolforgeError("hybrid mode splits the shards across data-parallel students",
                             fix="drop split_shards=False, or use mode teacher_student for an ensemble",
                             field=("split_shards",))
    training = StudentTraining(
        max_steps=call.max_steps, epochs=call.epochs, batch_size=call.batch_size, grad_accum=call.grad_accum,
        lr=call.lr, warmup_steps=call.warmup_steps, max_length=call.max_length, seed=call.seed, device=call.device,
        max_eval_samples=call.max_eval_samples, eval_accuracy=call.eval_accuracy, max_new_tokens=call.max_new_tokens,
        wait_timeout_s=call.wait_timeout_s, on_policy_ratio=call.on_policy_ratio,
        on_policy_temperature=call.on_policy_temperature, on_policy_start=call.on_policy_start, dtype=call.dtype,
        teacher_dtype=call.teacher_dtype)
    return StudentPlan(
        bases=bases, store_dir=store_dir_of(call.teacher_outputs_dir),
        run_dir=Path(call.output_dir) if call.output_dir else None, num_students=call.num_students,
        split=(call.num_students > 1) if call.split_shards is None else bool(call.split_shards),
        sync=make_sync(call.students_sync, call.students_strategy), peft=args.peft,
        kd=KDConfig(loss=call.kd_loss, temperature=call.temperature, kd_ratio=call.kd_ratio, beta=call.beta),
        cpus=args.cpus, save_every=args.save_every, max_retries=args.max_retries, eval_data=call.eval_data,
        eval_path=call.eval_path, resume=call.resume, replace_timeout_s=call.replace_timeout_s,
        teacher_model=call.teacher_model, training=training)
