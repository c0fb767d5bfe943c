"""The per-job control actor: the one thing a job's workers talk to.

It lives on the coordinator's node (it asks for the `smolforge-head` resource), so it writes
artifacts straight into the coordinator's artifact store: rank 0 hands it a checksummed checkpoint
payload through the Ray object store and waits for the acknowledgement, and every rank fetches the
checkpoint to resume from and the uploaded dataset from it. No shared filesystem is assumed.

The job runner (in the coordinator process) sets the stop / regroup flags and drains the progress
reports the workers push; workers poll the flags in the background, so none of this sits on the
training step's critical path.
"""

from __future__ import annotations

import threading
import time
from typing import Any

from smolforge.cluster.artifacts import ArtifactStore
from smolforge.cluster.ray_glue import HEAD_RESOURCE


class JobControl:
    """Ray actor class (wrapped with ray.remote by `create_control`)."""

    def __init__(self, job_id: str, artifacts_root: str):
        self.job_id = job_id
        self.store = ArtifactStore(artifacts_root)
        self.stop: str | None = None
        self.regroup = False
        self.regroup_now = False
        self.items: list[dict] = []
        self.lock = threading.Lock()  # threaded actor: reports and drains may overlap

    def set_stop(self, code: str | None) -> None:
        self.stop = code

    def set_regroup(self, at_checkpoint: bool) -> None:
        if at_checkpoint:
            self.regroup = True
        else:
            self.regroup_now = True

    def reset(self) -> None:
        self.stop, self.regroup, self.regroup_now = None, False, False

    def poll(self) -> dict:
        return {"stop": self.stop, "regroup": self.regroup, "regroup_now": self.regroup_now}

    def report(self, batch: list[dict]) -> None:
        with self.lock:
            self.items.extend(batch)

    def drain(self) -> list[dict]:
        with self.lock:
            out, self.items = self.items, []
        return out

    def put_artifact(self, kind: str, name: str, payload: dict, keep_last: int | None = None) -> dict:
        t = time.time()
        meta = self.store.put(self.job_id, kind, name, payload, keep_last=keep_last)
        meta["seconds"] = time.time() - t
        meta.pop("sha256", None)
        return meta

    def get_artifact(self, kind: str, name: str) -> dict:
        return self.store.get(self.job_id, kind, name)

    def get_upload(self, digest: str) -> bytes:
        return self.store.read_upload(digest)

    def ping(self) -> bool:
        return True


def create_control(job_id: str, artifacts_root: str) -> Any:
    """A fresh control actor for one run of a job, pinned to the coordinator's node."""
    import ray


    actor = ray.remote(JobControl).options(
        num_cpus=0, resources={HEAD_RESOURCE: 0.001}, max_restarts=0, max_concurrency=8,
    ).remote(job_id, artifacts_root)
    ray.get(actor.ping.remote(), timeout=120)
    return actor
