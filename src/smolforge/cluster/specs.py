"""Job specs: what `smolforge submit job.yaml`, `smolforge launch` and `Client.submit_job` send.

A data-parallel job is a TrainConfig plus how many workers and what each needs:
    kind: data_parallel
    name: my-run
    num_workers: 2
    cpus_per_worker: 1
    max_retries: 2
    train:                      # exactly the `smolforge train` config
      model: tiny-llama
      data: {path: data.jsonl}  # a local file is uploaded to the coordinator with the job
      batch_size: 4             # per worker: the global batch is batch_size x num_workers
      max_steps: 100
      save_every: 20

A distillation job is the `smolforge distill` run (smolforge.distill.pipeline.DistillSettings) driven
by the coordinator, so it shows in `smolforge jobs` and the dashboard and can be paused, resumed
and cancelled like any job:
    kind: distill
    name: my-distill
    mode: hybrid                # or teacher_student
    distill:                    # the DistillSettings fields (`smolforge distill --help`)
      teacher: small-llama
      students: [tiny-llama]
      data: data.jsonl          # uploaded like a data-parallel job's data
      num_students: 2
      max_steps: 100

The global batch (batch_size x grad_accum x num_workers) is what the job means. If the group has
to re-form on fewer or more workers (a node died, a node joined), each worker's batch is resized
so the global batch, and therefore the result, stays the same.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import Field, ValidationError, field_validator, model_validator

from smolforge.config import Spec, TrainConfig
from smolforge.distill.pipeline import DistillSettings
from smolforge.errors import SmolforgeError


class DataParallelJob(Spec):
    kind: Literal["data_parallel"] = "data_parallel"
    name: str | None = None
    train: TrainConfig
    num_workers: int = Field(2, ge=1, description="ranks in the group")
    cpus_per_worker: float = Field(1.0, gt=0)
    gpu: Literal["required", "preferred", "no"] = "no"
    min_ram_gb: float = Field(0.0, ge=0)
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

    @model_validator(mode="after")
    def _strategy_settings(self) -> "DataParallelJob":
        from smolforge.parallel.strategies import STRATEGIES

        try:
            STRATEGIES[self.strategy].check_settings(self.strategy_config)
        except ValidationError as err:
            raise ValueError("; ".join(f"strategy_config.{'.'.join(map(str, e['loc']))}: {e['msg']} for "
                                       f"--strategy {self.strategy}" for e in err.errors())) from None
        return self

    @property
    def global_batch(self) -> int:
        return self.train.batch_size * self.num_workers


class DistillJob(Spec):
    kind: Literal["distill"] = "distill"
    name: str | None = None
    mode: Literal["teacher_student", "hybrid"] = "teacher_student"
    distill: DistillSettings
    # Where the run writes (teacher_outputs/, output/, merged_model/): only on the embedded cluster,
    # where the job runs on this machine (`smolforge distill --output-dir`); a coordinator refuses
    # it and keeps the run in its state dir (the client downloads the adapter and the summary).
    output_dir: str | None = None
    tensorboard: bool = Field(False, description="TensorBoard event files per student (tensorboard/student<N>) "
                              "in the run dir")
    wandb: str | None = Field(None, description="W&B project: one offline run per student in the run dir's wandb/")


class ServeJob(Spec):
    """A model served from stage actors on the nodes that hold it, behind an OpenAI-compatible API on
    the coordinator's machine (`smolforge serve --stages N`). It runs until cancelled."""

    kind: Literal["serve"] = "serve"
    name: str | None = None
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
    step_timeout_s: float = Field(120.0, gt=0, description="a stage that answers no step within this is replaced")
    load_timeout_s: float = Field(300.0, gt=0, description="how long a stage may take to load its layers")

    @field_validator("stages")
    @classmethod
    def _positive_stages(cls, v: int | str) -> int | str:
        if isinstance(v, int) and v < 1:
            raise ValueError("stages must be 1 or more, or auto")
        return v

    def start_timeout_s(self) -> float:
        """How long starting may take: measuring the nodes, then each stage loading in turn."""
        return self.load_timeout_s * ((self.stages if isinstance(self.stages, int) else 2) + 2) + 60


class ExportJob(Spec):
    """A model (plus adapters) exported on a node that holds it (`smolforge export --coordinator`); the
    result is the job's `export/<to>` artifact, which the client downloads (smolforge.models.export)."""

    kind: Literal["export"] = "export"
    name: str | None = None
    model: str = Field(..., description="a model the workers hold (its name there), a preset or a local directory")
    adapters: list[str] = Field(default_factory=list, description="adapter directories merged in order: on the "
                                "embedded cluster only (they are read on this machine)")
    to: Literal["hf", "gguf", "ollama"] = "gguf"
    quant: Literal["f16", "bf16", "q8_0"] = "f16"
    model_name: str | None = Field(None, description="the name in the GGUF and in `ollama create` (--name)")
    verify: bool = Field(True, description="compare the GGUF with the HF model in llama.cpp; fail when off")
    cpus: float = Field(1.0, gt=0)
    require_model: bool | None = Field(
        None, description="place only on nodes that hold the model; default: yes unless it is a tiny preset")
    timeout_s: float = Field(3600.0, gt=0, description="the export (and its upload) must finish within this")


JOB_KINDS = {"data_parallel": DataParallelJob, "distill": DistillJob, "serve": ServeJob, "export": ExportJob}
