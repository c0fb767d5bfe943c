"""What split learning trains with, once: the settings `smolforge split train` and a `split` job share.

Why a module of its own, without torch: the job spec (`cluster.control.specs.SplitSettings`) is
parsed at submit on a coordinator that must not load torch for it, and it used to copy these fields
from `trainer.SplitTrainConfig` by hand, so a default or a bound changed on one side silently
differed on the other. Both now derive from `SplitTraining`: the job adds nothing but its own
default for `save_interval` (a job must checkpoint, or its trunk could not be placed again), the
command adds what a job owns (the server's address, token and TLS, output and session names,
resume, logging sinks).
"""

from __future__ import annotations

from typing import ClassVar, Literal

from pydantic import Field, model_validator

from smolforge.config import NamedDataset

Codec = Literal["fp32", "fp16", "bf16", "int8"]


class SplitTraining(NamedDataset):
    """The training settings of split learning (the seed's flag names, snake_cased). One LoRA for all
    three parts: the bottom and top on the client, the trunk on the server. The data is `dataset` or a
    dataset by name (`dataset_name`: config.NamedDataset)."""

    DATASET_FILE: ClassVar[str] = "dataset"
    EVAL_FILE: ClassVar[str | None] = "eval_dataset"

    model: str = Field(..., description="a model both sides hold (a job: the trunk's node and the client's), "
                       "or a preset")
    split_point_1: int = Field(..., ge=0, description="bottom = embeddings + layers [0, A) on the client")
    split_point_2: int = Field(..., ge=1, description="trunk = layers [A, B) on the server; the top is the rest")
    lora_rank: int = Field(8, ge=1)
    lora_alpha: float = Field(16.0, gt=0)
    lora_dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: list[str] | None = None
    batch_size: int = Field(4, ge=1)
    learning_rate: float = Field(2e-4, gt=0)
    weight_decay: float = Field(0.0, ge=0)
    num_epochs: float = Field(1.0, gt=0)
    max_steps: int | None = Field(None, ge=1)
    dataset: str = Field("bundled", description="JSONL file (a job uploads it to the coordinator), or 'bundled'")
    eval_dataset: str | None = Field(None, description="held-out JSONL for Val Loss, whole (a job uploads it); "
                                     "default: a split of `dataset` (or dataset_eval_split)")
    dataset_eval_split: str | None = Field(None, description="with dataset_name: its split held out for Val Loss, "
                                           "read as eval_dataset (e.g. validation)")
    data_format: Literal["auto", "alpaca", "chat", "prompt_completion", "text"] = "auto"
    max_train_samples: int | None = Field(None, ge=1)
    max_eval_samples: int | None = Field(64, ge=0)
    gradient_accumulation_steps: int = Field(1, ge=1)
    mixed_precision: bool = False
    max_seq_length: int = Field(256, ge=8)
    warmup_steps: int = Field(0, ge=0)
    max_grad_norm: float | None = 1.0
    scheduler: Literal["linear", "cosine", "constant"] = "linear"
    save_interval: int = Field(0, ge=0, description="checkpoint both sides every N steps; 0: at the end only")
    eval_interval: int = Field(0, ge=0, description="0: evaluate at the end only")
    log_interval: int = Field(10, ge=1)
    codec: Codec = "fp32"
    seed: int = 0
    device: str = Field("cpu", description="the client's device (a job's trunk follows its node: a GPU when it got one)")
    keep_last: int = Field(2, ge=1)
    rpc_timeout: float = Field(600.0, gt=0)

    @model_validator(mode="after")
    def _trunk_not_empty(self) -> "SplitTraining":
        if self.split_point_2 <= self.split_point_1:
            raise ValueError(f"split_point_2 ({self.split_point_2}) must be above split_point_1 "
                             f"({self.split_point_1}): the trunk is layers [split_point_1, split_point_2)")
        return self
