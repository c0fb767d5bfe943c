"""The trunk server of a split job as a Ray actor, and which node it goes on.

The runner picks the node (`choose_trunk_node`; the choice is `cluster.control.placement.trunk_plan`'s:
the kind's requirements, a GPU node first, one that has room, never where a trunk of this job was just
lost while another can take it) and pins the actor there. The actor first fetches the trunk
checkpoints the coordinator holds for the job (the ones the client's checkpoints were shipped with), then starts `smolforge.split.server` on its node's
address with a free port and the job's token (over TLS with the node's certificate, which the
cluster's CA signed, when the cluster runs with TLS: `serve_config`), so a client that rolls back to the newest checkpoint
both sides hold finds the trunk's half here, whichever node this is. `ship` sends one of its
checkpoints to the coordinator; the client calls it right after each checkpoint, before training on.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path
from typing import Any

from smolforge.cluster.control.kinds import TRUNK_CHECKPOINTS
from smolforge.cluster.control.placement import TrunkPlan, trunk_plan
from smolforge.cluster.control.specs import SplitJob
from smolforge.cluster.nodes import ray_glue, ray_tls
from smolforge.cluster.workloads.split.artifacts import download_dir, upload_dir
from smolforge.telemetry.tasklog import LineBuffer, start_capture, this_node
from smolforge.train.faults import node_dir

TRANSFER_TIMEOUT_S = 600.0
KEEP_STORED = 2  # trunk checkpoints the coordinator keeps per job (the client keeps its own keep_last)


def choose_trunk_node(req: ray_glue.Requirements, nodes: list[ray_glue.NodeInfo], avoid: set[str]) -> TrunkPlan:
    """The trunk's node (`placement.trunk_plan`: the kind's requirements, a node with room, a GPU node
    first, not where a trunk of this job was lost while another can take it), its actor pinned there.
    SmolforgeError, listing every node and why not, when none can run it."""
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    plan = trunk_plan(req, nodes, avoid)
    plan.options["scheduling_strategy"] = NodeAffinitySchedulingStrategy(plan.node.node_id, soft=False)
    return plan


def serve_config(spec: SplitJob, model: str, token: str, host: str, device: str, root: Path, tls: bool):
    """The trunk server's settings for a job: its split, a free port, the job's token and, on a `--tls`
    cluster, this node's certificate from the cluster's CA (the client trusts exactly that CA)."""
    from smolforge.split.server import ServeConfig

    s = spec.split
    files = ray_tls.node_files_from_env(required=True) if tls else None
    return ServeConfig(model=model, split_point_1=s.split_point_1, split_point_2=s.split_point_2,
                       lora_rank=s.lora_rank, lora_alpha=s.lora_alpha, lora_dropout=s.lora_dropout,
                       target_modules=s.target_modules, device=device, host=host, port=0, token=token,
                       tls_cert=files[0] if files else None, tls_key=files[1] if files else None,
                       checkpoint_dir=str(root), keep_last=s.keep_last + 1, num_threads=max(1, int(spec.cpus)))


def stored_steps(names: list[str]) -> list[int]:
    return [int(n.split("-", 1)[1]) for n in names]


class TrunkActor:
    """Ray actor class: one trunk server of a split job, on the node it was pinned to."""

    def __init__(self, job_id: str, placement: int, control: Any):
        self.lines = LineBuffer(f"trunk{placement}", this_node())
        start_capture(self.lines)  # for the actor's life: its process is its own
        self.job_id, self.control = job_id, control
        self.root = node_dir() / "split" / job_id / f"trunk-{placement}"  # fresh: only what the store holds
        self.server: Any = None

    def start(self, spec: SplitJob, token: str, session: str, stored: list[str], tls: bool = False) -> dict[str, Any]:
        """Fetch the stored trunk checkpoints, load the trunk and listen (over TLS with this node's
        certificate when the cluster runs with TLS); where it listens."""
        import ray

        from smolforge.cluster.workloads.data_parallel.rank import local_model_path, prepare_model
        from smolforge.split.server import serve

        self.lines.secrets.append(token)
        for name in stored:
            download_dir(self.control, TRUNK_CHECKPOINTS, name, self.root / session / name, TRANSFER_TIMEOUT_S)
        prepare_model(spec.split.model, node_dir())  # a preset built once per node, not by both sides at once
        host = ray_glue.node_ip()
        device = "cuda" if ray.get_gpu_ids() else "cpu"
        cfg = serve_config(spec, local_model_path(spec.split.model), token, host, device, self.root, tls)
        self.server = serve(cfg)
        print(self.server.describe(), flush=True)
        return {"host": host, "port": self.server.port, "node": this_node(), "pid": os.getpid(), "device": device,
                "stored": stored_steps(stored), "tls": self.server.tls}

    def status(self) -> dict[str, Any]:
        """The session's step (None before the client opens it) and what this process printed."""
        sessions = list(self.server.service.sessions.values()) if self.server is not None else []
        return {"step": max((s.step for s in sessions), default=None), "sessions": len(sessions),
                "pid": os.getpid(), "lines": self.lines.drain()}

    def ship(self, session: str, step: int) -> dict[str, Any]:
        """This trunk's checkpoint of `step` to the coordinator (the newest KEEP_STORED are kept)."""
        path = Path(self.root) / session / f"step-{step}"
        return upload_dir(self.control, TRUNK_CHECKPOINTS, path.name, path, TRANSFER_TIMEOUT_S, keep_last=KEEP_STORED)

    def stop(self) -> None:
        """Stop serving; this placement's checkpoints go (the coordinator holds the ones that count)."""
        if self.server is not None:
            self.server.stop(0)
            self.server = None
        shutil.rmtree(self.root, ignore_errors=True)
