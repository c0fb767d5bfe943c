"""Job specs: what `smolforge submit job.yaml`, `smolforge launch` and `Client.submit_job` send.

A data-parallel job is a TrainConfig plus how many workers and what each needs:
    kind: data_parallel
    name: my-run
    num_workers: 2
    cpus_per_worker: 1
    max_retries: 2
    train:                      # exactly the `smolforge train` config
      model: tiny-llama
      data: {path: data.jsonl}  # a local file is uploaded to the coordinator with the job; or by name:
                                # {dataset_name: wikitext, dataset_config: wikitext-2-raw-v1} (read
                                # offline at submit into one JSONL file, uploaded as any)
      batch_size: 4             # per worker: the global batch is batch_size x num_workers
      max_steps: 100
      save_every: 20

A distillation job is the `smolforge distill` run (smolforge.distill.settings.DistillSettings) driven
by the coordinator, so it shows in `smolforge jobs` and the dashboard and can be paused, resumed
and cancelled like any job:
    kind: distill
    name: my-distill
    mode: hybrid                # or teacher_student
    distill:                    # the DistillSettings fields (`smolforge distill --help`)
      teacher: small-llama
      students: [tiny-llama]
      data: data.jsonl          # uploaded like a data-parallel job's data (or dataset_name: N)
      num_students: 2
      max_steps: 100

Every kind also takes what the seeds' TaskConfig names (`JobSpec`): `priority: high|normal|low`
(the queue's order), and a `resources:` block {cpu_cores, ram_gb, gpu_memory_gb, gpu_ids} per task
(a worker, a stage, a teacher or student), mapped onto the kind's own fields; `ram_gb` is reserved
on the node, not only checked. Giving both a block key and the field it maps onto, with different
values, is a contradiction (exit 2). Data-parallel and distill jobs take `checkpointing: bool`.

The global batch (batch_size x grad_accum x num_workers) is what the job means. If the group has
to re-form on fewer or more workers (a node died, a node joined), each worker's batch is resized
so the global batch, and therefore the result, stays the same.
"""

from __future__ import annotations

import copy
from typing import Any, ClassVar, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator, model_validator

from smolforge.config import (
    EVAL_SPLIT_KEY, NAMED_DATASET_KEYS, Loc, ModelDtype, Spec, SpecFile, TrainConfig, get_path, put_path, spec_error,
)
from smolforge.distill.settings import DistillSettings
from smolforge.errors import SmolforgeError
from smolforge.models.export.targets import ExportTarget, QuantName
from smolforge.split.settings import SplitTraining


PRIORITIES = ("high", "normal", "low")  # the queue's order, first to last
Priority = Literal["high", "normal", "low"]


class _SeedInit:
    """For specs users build in Python with keywords (the seeds' `TaskConfig(...)`): bad values are one
    SmolforgeError naming each field, as from a job file, not pydantic's traceback."""

    def __init__(self, **data: Any):
        try:
            super().__init__(**data)
        except ValidationError as err:
            raise spec_error(type(self), err, where=type(self).__name__) from None


class Resources(Spec):
    """The seeds' resource request, per task of the job (a worker, a stage, a teacher or student)."""

    cpu_cores: float | None = Field(None, gt=0, description="CPUs each task takes")
    ram_gb: float | None = Field(None, ge=0, description="RAM reserved for each task on its node")
    gpu_memory_gb: float | None = Field(None, ge=0, description="the node's GPUs have at least this much memory")
    gpu_ids: list[int] | None = Field(None, description="GPU indices the node must have (one GPU per id per task)")

    @field_validator("gpu_ids")
    @classmethod
    def _ids(cls, v: list[int] | None) -> list[int] | None:
        if v is not None and (not v or min(v) < 0 or len(set(v)) != len(v)):
            raise ValueError("gpu_ids must be distinct GPU indices >= 0, e.g. [0, 1]")
        return v


class ResourceConfig(_SeedInit, Resources):
    """`Resources` under the seeds' name, built in Python: `ResourceConfig(gpu_memory_gb=24, cpu_cores=8, ram_gb=64)`."""


class TaskConfig(_SeedInit, Spec):
    """The seeds' task settings: `TaskConfig(name, type, priority, resources=ResourceConfig(gpu_memory_gb,
    cpu_cores, ram_gb), max_retries, checkpointing)`.

    The Orchestrator's task-creating calls take it as `task_config=`. A data-parallel task is a job:
    every field lands on the job spec (`job_fields`). Teacher and student tasks take what they have
    (`cpu_cores`, `max_retries`, `checkpointing`) and refuse the rest, saying where it does apply:
    nothing is silently ignored.
    """

    name: str | None = None
    type: str | None = Field(None, description="the seeds' task type (training, inference, ...); the call "
                             "that takes the config decides what runs")
    priority: Priority = "normal"
    resources: Resources | None = None
    max_retries: int | None = Field(None, ge=0)
    checkpointing: bool | None = None

    def job_fields(self) -> dict[str, Any]:
        """The JobSpec keys this sets (name, priority, resources, max_retries, checkpointing)."""
        out: dict[str, Any] = {"priority": self.priority}
        if self.resources is not None:
            out["resources"] = self.resources.model_dump(exclude_none=True)
        for key in ("name", "max_retries", "checkpointing"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out


class JobSpec(Spec):
    """What every kind shares: a name, its place in the queue, and the seeds' resource request.

    A kind says where each `resources` key lands in its own spec (`RESOURCE_PATHS`, comma-separated
    dotted paths); a key it cannot honour is refused with the keys it can, never silently ignored.
    """

    name: str | None = None
    priority: Priority = Field("normal", description="queue order: high, normal, low (FIFO within one)")
    resources: Resources | None = None

    RESOURCE_PATHS: ClassVar[dict[str, str]] = {}

    @model_validator(mode="before")
    @classmethod
    def _map_resources(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("resources"), dict):
            return data
        data = copy.deepcopy(data)
        kind = cls.model_fields["kind"].default
        for key, value in data["resources"].items():
            if value is None or key not in Resources.model_fields:
                continue  # unknown keys: Resources reports them
            paths = cls.RESOURCE_PATHS.get(key)
            if not paths:
                raise ValueError(f"resources.{key}: a {kind} job cannot reserve it; it takes "
                                 f"{', '.join(cls.RESOURCE_PATHS) or 'no resources block'}")
            for path in paths.split(","):
                current = get_path(data, path)
                if current is not None and current != value:
                    raise ValueError(f"resources.{key} is {value} but {path} is {current}: they set the same "
                                     "thing; give one of them")
                put_path(data, path, value)
        return data


def default_save_every(max_steps: int | None) -> int:
    """A data-parallel job's checkpoints when nothing sets them (every road: `launch`, `submit`, the
    client, the seeds' calls and `checkpointing: true`; `DataParallelJob` applies it, nothing else):
    a dead worker then costs minutes, not the run. A tenth of the steps, at least 10 (a checkpoint
    costs an upload to the coordinator) and at most 200; 50 when the step count comes from epochs.
    (`smolforge train` alone keeps TrainConfig's 0: one process has no worker to lose.)"""
    return 50 if not max_steps else max(10, min(200, max_steps // 10))


def _checkpointing(data: Any, save_every: str, default: int) -> Any:
    """`checkpointing: true|false` (the seeds' flag) onto the kind's save_every; a save_every that
    contradicts it is refused."""
    if not isinstance(data, dict) or data.get("checkpointing") is None:
        return data
    data = copy.deepcopy(data)
    current = get_path(data, save_every)
    if data["checkpointing"] is False:
        if current:
            raise ValueError(f"checkpointing is false but {save_every} is {current}: drop one of them")
        put_path(data, save_every, 0)
    elif not current:
        put_path(data, save_every, default)
    return data


class DataParallelJob(JobSpec):
    RESOURCE_PATHS: ClassVar[dict[str, str]] = {"cpu_cores": "cpus_per_worker", "ram_gb": "min_ram_gb",
                                                "gpu_memory_gb": "gpu_memory_gb", "gpu_ids": "gpu_ids"}

    kind: Literal["data_parallel"] = "data_parallel"
    train: TrainConfig
    num_workers: int = Field(2, ge=1, description="ranks in the group")
    cpus_per_worker: float = Field(1.0, gt=0)
    gpu: Literal["required", "preferred", "no"] = "no"
    min_ram_gb: float = Field(0.0, ge=0, description="RAM reserved for each worker on its node")
    gpu_memory_gb: float = Field(0.0, ge=0, description="each worker's GPU has at least this much memory")
    gpu_ids: list[int] | None = Field(None, description="GPU indices a worker's node must have; one GPU per id")
    checkpointing: bool | None = Field(None, description="the seeds' flag: false sets train.save_every 0; true "
                                       "sets default_save_every where it is unset or 0 (unset, it is the default "
                                       "anyway)")
    allowed_nodes: list[str] | None = None
    require_model: bool | None = Field(
        None, description="place only on nodes that hold the model; default: yes unless it is a tiny preset")
    max_retries: int = Field(2, ge=0, description="worker failures survived before the job fails")
    strategy: str = Field("ddp", description="how the ranks share learning (smolforge.parallel.strategies)")
    strategy_config: dict[str, Any] = Field(default_factory=dict, description="the strategy's own settings")
    balance: Literal["auto", "off"] = Field(
        "auto", description="synchronous strategies: rows per rank in proportion to each rank's measured speed "
                            "when they differ by more than 20% (auto), or equal slices (off)")
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    dist_timeout_s: float = Field(300.0, gt=0, description="collective timeout (a peer lost without a TCP reset); "
                                  "never shorter than checkpoint_upload_timeout_s + 60, so the ranks waiting at a "
                                  "checkpoint outlast rank 0's upload")
    checkpoint_upload_timeout_s: float = Field(600.0, gt=0, description="how long rank 0 may take to ship a "
                                               "checkpoint to the coordinator (big ones over Wi-Fi are slow)")
    placement_timeout_s: float = Field(120.0, gt=0)
    lent_nodes: list[str] = Field(default_factory=list, description="nodes lent with `job join` (coordinator: '@coordinator')")
    stages: int | None = Field(None, ge=1, description="model parallelism: pipeline stages, one per rank (sets "
                                                       "strategy pipeline and num_workers)")
    output_dir: str | None = Field(None, description="embedded cluster only (an absolute path): where the job's "
                                   "TensorBoard (tensorboard/rank<R>) and W&B (wandb/) files go; a coordinator "
                                   "keeps them in <state dir>/runs/<job>/")

    @model_validator(mode="before")
    @classmethod
    def _seed_shape_and_checkpointing(cls, data: Any) -> Any:
        data = from_seed_task(data)
        if isinstance(data, dict) and isinstance(data.get("train"), dict):
            steps = data["train"].get("max_steps")
            default = default_save_every(int(steps) if steps else None)
            data = _checkpointing(data, "train.save_every", default)
            if data["train"].get("save_every") is None:  # unset: the one default, whichever road the spec came by
                data = {**data, "train": {**data["train"], "save_every": default}}
        return data

    @model_validator(mode="after")
    def _gpu_request_needs_a_gpu(self) -> "DataParallelJob":
        if not (self.gpu_ids or self.gpu_memory_gb) or self.gpu == "required":
            return self
        if "gpu" in self.model_fields_set and self.gpu == "no":
            raise ValueError("gpu is 'no' but the job asks for GPU ids or GPU memory: drop one of them")
        self.gpu = "required"
        return self

    @model_validator(mode="before")
    @classmethod
    def _stages_mean_pipeline(cls, data: Any) -> Any:
        """`stages: N` is `strategy: pipeline` with `num_workers: N`; anything else alongside it is a contradiction."""
        if not isinstance(data, dict) or data.get("stages") is None:
            return data
        stages = data["stages"]
        if data.get("strategy", "pipeline") != "pipeline":
            raise ValueError(f"stages is pipeline parallelism, but strategy is {data['strategy']!r}: "
                             "drop one of them")
        if data.get("num_workers", stages) != stages:
            raise ValueError(f"stages {stages} and num_workers {data['num_workers']} differ: a pipeline has one "
                             "rank per stage (give one of them)")
        return {**data, "strategy": "pipeline", "num_workers": stages}

    @field_validator("strategy")
    @classmethod
    def _known_strategy(cls, value: str) -> str:
        from smolforge.parallel.strategies import check_name  # torch.distributed: the client imports specs

        try:
            return check_name(value)
        except SmolforgeError as err:
            raise ValueError(err.what) from None

    @field_validator("strategy_config")
    @classmethod
    def _strategy_settings(cls, value: dict[str, Any], info: ValidationInfo) -> dict[str, Any]:
        """The settings the (valid) strategy takes: refused as `strategy_config`'s (a spec file's line), the
        strategy beside it named in the message."""
        from smolforge.parallel.strategies import strategy_class

        strategy = info.data.get("strategy")
        if strategy is None:  # the strategy itself was refused: that is the message
            return value
        try:
            strategy_class(strategy).check_settings(value)
        except ValidationError as err:
            raise ValueError("; ".join(f"strategy_config.{'.'.join(map(str, e['loc']))}: {e['msg']} for "
                                       f"--strategy {strategy}" for e in err.errors())) from None
        return value

    @property
    def global_batch(self) -> int:
        return self.train.batch_size * self.num_workers


# the seeds' task shape's keys -> where a data-parallel job has them (`from_seed_task`): one table, by
# which both the spec and its file's lines (`config.SpecFile.moved`) are translated
SEED_TASK_MOVES: dict[Loc, Loc] = {("model",): ("train", "model"), ("dataset",): ("train", "data", "path"),
                                   **{(key,): ("train", "data", key) for key in (*NAMED_DATASET_KEYS, EVAL_SPLIT_KEY)}}


def _is_seed_task(data: Any) -> bool:
    return (isinstance(data, dict) and "train" not in data and "model" in data
            and data.get("kind", "data_parallel") == "data_parallel")  # a serve job names its `model` too


def _seed_moved(data: dict[str, Any]) -> dict[str, Any]:
    """DATA's keys moved by `SEED_TASK_MOVES`, the rest as they are."""
    out = {key: value for key, value in data.items() if (key,) not in SEED_TASK_MOVES}
    for (key,), new in SEED_TASK_MOVES.items():
        if key in data:
            put_path(out, ".".join(new), data[key])
    return out


def from_seed_task(data: Any) -> Any:
    """The seeds' task shape, `{"model": M, "dataset": D, "resources": {...}, ...}`, as a data-parallel
    job (`train: {model: M, data: {path: D}}`; `dataset_name: N` and its companions go beside it, into
    `train.data`); a job spec with `train` passes unchanged. Read from a file (`config.SpecFile`), the
    result is the file's too, each moved key at its line (`SpecFile.moved`): a bad `dataset` is named
    `task.yaml:LINE`, not `train.data.path`."""
    if not _is_seed_task(data):
        return data
    moved = _seed_moved(data)
    if not isinstance(data, SpecFile):
        return moved
    loaded = _seed_moved(data.loaded) if _is_seed_task(data.loaded) else data.loaded
    return data.moved(moved, loaded, SEED_TASK_MOVES)


class DistillJob(JobSpec):
    RESOURCE_PATHS: ClassVar[dict[str, str]] = {"cpu_cores": "distill.cpus_per_teacher,distill.cpus_per_student"}

    kind: Literal["distill"] = "distill"
    checkpointing: bool | None = Field(None, description="the seeds' flag: student checkpoints on (distill."
                                       "save_every, 50 when unset) or off")
    mode: Literal["teacher_student", "hybrid"] = "teacher_student"
    distill: DistillSettings
    # Where the run writes (teacher_outputs/, output/, merged_model/): only on the embedded cluster,
    # where the job runs on this machine (`smolforge distill --output-dir`); a coordinator refuses
    # it and keeps the run in its state dir (the client downloads the adapter and the summary).
    output_dir: str | None = None
    tensorboard: bool = Field(False, description="TensorBoard event files per student (tensorboard/student<N>) "
                              "in the run dir")
    wandb: str | None = Field(None, description="W&B project: one offline run per student in the run dir's wandb/")

    @model_validator(mode="before")
    @classmethod
    def _checkpointing(cls, data: Any) -> Any:
        return _checkpointing(data, "distill.save_every", DistillSettings.model_fields["save_every"].default)


class DistillTaskJob(JobSpec):
    """One of the seeds' distillation calls as a job: `Orchestrator.create_teacher_task` and
    `create_parallel_teacher_tasks` (stage teacher: writes a teacher store), `create_student_tasks`
    (stage students: reads a finished teacher job's store), `aggregate_student_outputs` (stage
    aggregate: merges finished students' adapters). A whole `distill` run is the three in one job; a
    stage is the seeds' call, so its settings are the call's own keyword arguments (`args`), checked
    against the call at submit (`workloads/distill/stage_args.py`). Task ids are `<job>-teacher-N` /
    `<job>-student-N`, the job's task rows: any process resolves them."""

    kind: Literal["distill_task"] = "distill_task"
    stage: Literal["teacher", "students", "aggregate"]
    mode: Literal["teacher_student", "hybrid"] = "teacher_student"
    args: dict[str, Any] = Field(default_factory=dict, description="the call's keyword arguments, as the seeds "
                                 "write them (paths where it writes are the job's: output_dir below)")
    teacher_job: str | None = Field(None, description="students: the teacher (or distill) job whose store they read")
    student_tasks: list[str] = Field(default_factory=list, description="aggregate: the student tasks "
                                     "(`<job>-student-N`) whose adapters are merged")
    first_student: int = Field(0, ge=0, description="students: their numbering (task ids, output/student_N) starts "
                               "here, so one orchestrator's calls number their students as the seeds' layout does")
    # embedded cluster only (absolute paths on this machine), as DistillJob's output_dir; a coordinator
    # keeps each run in its state dir and reads only its own jobs' stores and adapters
    output_dir: str | None = None
    store_dir: str | None = Field(None, description="students, embedded only: a teacher store no job of this "
                                  "cluster wrote")
    student_dirs: list[str] = Field(default_factory=list, description="aggregate, embedded only: student output "
                                    "directories no job of this cluster wrote")

    @model_validator(mode="after")
    def _inputs_for_the_stage(self) -> "DistillTaskJob":
        if self.stage == "students" and (self.teacher_job is None) == (self.store_dir is None):
            raise ValueError("a students stage reads one teacher store: give teacher_job (or, embedded, store_dir)")
        if self.stage == "aggregate" and not (self.student_tasks or self.student_dirs):
            raise ValueError("an aggregate stage merges students: give student_tasks (or, embedded, student_dirs)")
        return self


class ServeJob(JobSpec):
    """A model served from stage actors on the nodes that hold it, behind an OpenAI-compatible API on
    the coordinator's machine (`smolforge serve --stages N`). It runs until cancelled."""

    RESOURCE_PATHS: ClassVar[dict[str, str]] = {"cpu_cores": "cpus_per_stage"}

    kind: Literal["serve"] = "serve"
    model: str = Field(..., description="a model the workers hold (its name there), or a preset")
    adapter: str | None = Field(None, description="a lora/ia3/adapter directory on the coordinator's machine; "
                                "its files are sent to the stages and merged there")
    stages: int | Literal["auto"] = Field(2, description="pipeline stages: one actor each, on nodes holding the "
                                          "model; auto: the placement plan chooses (one node when that is faster)")
    host: str = Field("127.0.0.1", description="where the API listens (on the coordinator's machine)")
    port: int = Field(8000, ge=0, le=65535, description="the API's port (0: any free port, shown in the events)")
    max_batch: int = Field(8, ge=1, description="most requests generated together")
    model_name: str | None = Field(None, description="the name clients use in `model` (default: model)")
    cpus_per_stage: float = Field(1.0, gt=0)
    device: Literal["auto", "cpu", "cuda"] = "cpu"
    dtype: ModelDtype = Field("fp32", description="the stages' weights: fp32, bf16, fp16 or auto (the checkpoint's "
                              "own where the device runs it well)")
    step_timeout_s: float = Field(120.0, gt=0, description="a stage that answers no step within this is replaced")
    load_timeout_s: float = Field(300.0, gt=0, description="how long a stage may take to load its layers")
    stage_nodes: list[str] | None = Field(None, description="the nodes the stages may run on (default: every node "
                                          "that holds the model and, when it travels there, every worker)")

    @field_validator("stages")
    @classmethod
    def _positive_stages(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("stages must be 1 or more, or auto")
        return v

    def start_timeout_s(self) -> float:
        """How long starting may take: measuring the nodes, then each stage loading in turn."""
        return self.load_timeout_s * ((self.stages if isinstance(self.stages, int) else 2) + 2) + 60


class ExportJob(JobSpec):
    """A model (plus adapters) exported on a node that holds it (`smolforge export --coordinator`); the
    result is the job's `export/<to>` artifact, which the client downloads (smolforge.models.export)."""

    RESOURCE_PATHS: ClassVar[dict[str, str]] = {"cpu_cores": "cpus"}

    kind: Literal["export"] = "export"
    model: str = Field(..., description="a model the workers hold (its name there), a preset or a local directory")
    adapters: list[str] = Field(default_factory=list, description="adapter directories merged in order: on the "
                                "embedded cluster only (they are read on this machine)")
    to: ExportTarget = "gguf"
    quant: QuantName = "f16"
    dtype: ModelDtype = Field("auto", description="--to hf: the dtype the merged tensors are written in (auto: "
                              "the checkpoint's own); a GGUF's is quant")
    model_name: str | None = Field(None, description="the name in the GGUF and in `ollama create` (--name)")
    verify: bool = Field(True, description="compare the GGUF with the HF model in llama.cpp; fail when off")
    cpus: float = Field(1.0, gt=0)
    require_model: bool | None = Field(
        None, description="place only on nodes that hold the model; default: yes unless it is a tiny preset")
    timeout_s: float = Field(3600.0, gt=0, description="the export (and its upload) must finish within this")

    @model_validator(mode="after")
    def _dtype_for_hf(self) -> "ExportJob":
        if self.dtype != "auto" and self.to != "hf":
            raise ValueError(f"dtype {self.dtype} applies to to: hf; a {self.to} export's weights dtype is quant")
        return self


class SplitSettings(SplitTraining):
    """What a split job trains: `smolforge split train`'s settings (`split.settings.SplitTraining`, the
    one list both derive from) less the ones the job owns (where the trunk is, its token and TLS, the
    output and session names, resume): the runner places the trunk and hands the client its address."""

    save_interval: int | None = Field(None, ge=0, description="checkpoint both sides every N steps (the trunk's "
                                      "copy goes to the coordinator); unset: default_save_every(max_steps); 0: none")


class SplitJob(JobSpec):
    """Split learning as a job (`smolforge launch --mode split`): the trunk server on a node the
    coordinator picks (a GPU first, one holding the model), placed again from the last shared
    checkpoint when its node dies; the client (data, labels, bottom and top) where `client_node` says.
        kind: split
        client_node: "@coordinator"   # or a worker's name
        split: {model: tiny-llama, split_point_1: 1, split_point_2: 3, dataset: data.jsonl, max_steps: 100}
    """

    RESOURCE_PATHS: ClassVar[dict[str, str]] = {"cpu_cores": "cpus"}

    kind: Literal["split"] = "split"
    split: SplitSettings
    checkpointing: bool | None = Field(None, description="the seeds' flag: false sets split.save_interval 0; true "
                                       "sets default_save_every where it is unset or 0")
    client_node: str = Field("@coordinator", description="where the client side runs, with the data: "
                             "@coordinator (the coordinator's machine, which holds the uploaded data; on the "
                             "embedded cluster, this machine) or a worker's name")
    trunk_gpu: Literal["required", "preferred", "no"] = Field(
        "preferred", description="the trunk's node: a GPU node first (preferred), only one (required), or any")
    trunk_nodes: list[str] | None = Field(None, description="nodes the trunk may be placed on (default: any worker)")
    require_model: bool | None = Field(
        None, description="place the trunk only on nodes that hold the model; default: yes unless it is a preset")
    cpus: float = Field(1.0, gt=0, description="CPUs (and torch threads) of each side")
    max_retries: int = Field(2, ge=0, description="trunk losses (re-placed from the last shared checkpoint) and "
                             "failed attempts survived")
    replace_timeout_s: float = Field(300.0, gt=0, description="how long the trunk may have no node before the job "
                                     "fails; also how long the client waits for a trunk placed again")
    start_timeout_s: float = Field(600.0, gt=0, description="how long a trunk may take to load its layers")

    @model_validator(mode="before")
    @classmethod
    def _save_interval(cls, data: Any) -> Any:
        if not isinstance(data, dict) or not isinstance(data.get("split"), dict):
            return data
        steps = data["split"].get("max_steps")
        default = default_save_every(int(steps) if isinstance(steps, int) else None)
        data = _checkpointing(data, "split.save_interval", default)
        if data["split"].get("save_interval") is None:  # a job without checkpoints could not survive its trunk
            data = {**data, "split": {**data["split"], "save_interval": default}}
        return data
