"""Uploads are collected when no live job names them: a paused job keeps its dataset, a completed
one does not, and a fresh upload (its job may be on its way) is kept for the grace period."""

from __future__ import annotations

import hashlib
import os
import time

from smolforge.cluster.control.artifacts import UPLOAD_GRACE_S, ArtifactStore, upload_refs
from smolforge.cluster.coordinator import CoordinatorCore
from smolforge.cluster.control.jobstore import JobStore
from smolforge.cluster.nodes.statedir import StateDir


def _upload(store: ArtifactStore, tmp, text: str, age_s: float) -> str:
    src = tmp / f"{text}.jsonl"
    src.write_text(text)
    digest = store.add_upload(src)
    old = time.time() - age_s
    os.utime(store.upload_path(digest), (old, old))
    return digest


def test_only_uploads_no_live_job_names_are_collected(tmp_path):
    state = StateDir.at(tmp_path / "state")
    jobs, artifacts = JobStore(state.db_path), ArtifactStore(state.artifacts)
    core = CoordinatorCore(state, "t", jobs, artifacts, manager=None, monitor=None)
    old = UPLOAD_GRACE_S + 60
    paused_data, done_data = _upload(artifacts, tmp_path, "paused", old), _upload(artifacts, tmp_path, "done", old)
    fresh = _upload(artifacts, tmp_path, "fresh", 5)
    orphan = _upload(artifacts, tmp_path, "orphan", old)
    for digest, state_name in ((paused_data, "paused"), (done_data, "completed")):
        spec = {"kind": "data_parallel", "train": {"data": {"path": f"upload:{digest}", "eval_path": None}}}
        assert upload_refs(spec) == {digest}
        job = jobs.create_job("data_parallel", spec)
        jobs.set_state(job, state_name, "test", force=True)
    gone = core.collect_uploads()
    assert sorted(gone) == sorted([done_data, orphan])
    assert artifacts.has_upload(paused_data) and artifacts.has_upload(fresh)
    assert not artifacts.has_upload(done_data) and not artifacts.has_upload(orphan)
    assert hashlib.sha256(artifacts.read_upload(paused_data)).hexdigest() == paused_data
