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

The global batch (batch_size x grad_accum x num_workers) is what the job means. If the group has
to re-form on fewer or more workers (a node died, a node joined), each worker's batch is resized
so the global batch, and therefore the result, stays the same.
"""

from __future__ import annotations

from typing import Literal

from pydantic import Field

from smolforge.config import Spec, TrainConfig


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
    backend: Literal["auto", "gloo", "nccl"] = "auto"
    dist_timeout_s: float = Field(300.0, gt=0, description="collective timeout (a peer lost without a TCP reset)")
    placement_timeout_s: float = Field(120.0, gt=0)
    lent_nodes: list[str] = Field(default_factory=list, description="nodes lent with `job join` (coordinator: '@coordinator')")

    @property
    def global_batch(self) -> int:
        return self.train.batch_size * self.num_workers


JOB_KINDS = {"data_parallel": DataParallelJob}
