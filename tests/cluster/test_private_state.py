"""Cluster state is readable by its owner only: the job store 0600 (its WAL too), artifact and log
directories 0700; a directory the user named that existed already keeps its own mode."""

from __future__ import annotations

import os
import stat

from smolforge.cluster.control.artifacts import ArtifactStore
from smolforge.cluster.control.jobstore import JobStore
from smolforge.cluster.nodes.statedir import StateDir


def _mode(path) -> int:
    return stat.S_IMODE(os.stat(path).st_mode)


def test_state_is_private(tmp_path):
    old = os.umask(0o022)  # a typical umask: without care, files would be 0644 and dirs 0755
    try:
        state = StateDir.at(tmp_path / "state")
        store = JobStore(state.db_path)
        store.create_job("data_parallel", {"kind": "data_parallel"}, name="x")
        artifacts = ArtifactStore(state.root / "artifacts")
        (artifacts.root / "uploads").mkdir()
    finally:
        os.umask(old)
    assert _mode(state.root) == 0o700 and _mode(state.root / "logs") == 0o700
    assert _mode(state.db_path) == 0o600
    for extra in ("-wal", "-shm"):
        side = state.db_path.with_name(state.db_path.name + extra)
        if side.exists():
            assert _mode(side) == 0o600, extra
    assert _mode(artifacts.root) == 0o700


def test_a_directory_the_user_named_keeps_its_mode(tmp_path):
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    state = StateDir.at(shared)
    assert _mode(shared) == 0o755  # never chmod a directory we did not create
    assert _mode(state.root / "logs") == 0o700
