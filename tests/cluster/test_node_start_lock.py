"""One node of a machine starts at a time (`ray_process.node_start_lock`).

Ray names a node's sockets in the cluster's session dir by "the first index whose file does not
exist yet": two workers that joined at once took the same `plasma_store.1`, and one raylet died with
"bind: Address already in use" (a fresh-clone CI run lost test_param_server's cluster to it). Real processes,
no Ray: a child holds the lock of one temp dir until the test lets it go.
"""

from __future__ import annotations

import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest

from smolforge.cluster.nodes import ray_process

HOLD = ("import pathlib, sys, time; from smolforge.cluster.nodes.ray_process import node_start_lock\n"
        "held, release = pathlib.Path(sys.argv[2]), pathlib.Path(sys.argv[3])\n"
        "with node_start_lock(sys.argv[1]):\n"
        "    held.touch()\n"
        "    deadline = time.time() + 120  # a hang guard: the test lets go long before\n"
        "    while not release.exists() and time.time() < deadline:\n"
        "        time.sleep(0.05)\n")


@pytest.fixture
def holder(tmp_path):
    """A child process that holds the start lock of `tmp_path/ray-a`; `release()` lets it go."""
    held, release = tmp_path / "held", tmp_path / "release"
    child = subprocess.Popen([sys.executable, "-c", HOLD, str(tmp_path / "ray-a"), str(held), str(release)])
    deadline = time.time() + 60
    while not held.exists():
        assert child.poll() is None, "the holder exited before it held the lock"
        assert time.time() < deadline, "the holder did not take the lock in 60 s"
        time.sleep(0.05)

    def let_go() -> None:
        release.touch()
        child.wait(timeout=60)

    yield let_go
    if child.poll() is None:
        child.kill()
        child.wait(timeout=30)


def said_while_starting(temp_dir: Path) -> list[str]:
    said: list[str] = []
    with ray_process.node_start_lock(str(temp_dir), say=said.append):
        pass
    return said


def test_a_second_node_waits_for_the_first_and_only_in_the_same_temp_dir(holder, tmp_path):
    entered = threading.Event()

    def second() -> None:
        with ray_process.node_start_lock(str(tmp_path / "ray-a"), say=print):
            entered.set()

    thread = threading.Thread(target=second, daemon=True)
    thread.start()
    assert said_while_starting(tmp_path / "ray-b") == []  # another cluster's temp dir: no wait
    assert not entered.wait(1.0), "the second node started while the first held the lock"
    holder()
    assert entered.wait(60), "the second node did not start once the first let go"
    thread.join(timeout=60)


def test_a_lock_held_past_the_bound_is_passed_by_with_a_line(holder, tmp_path, monkeypatch):
    monkeypatch.setattr(ray_process, "START_LOCK_WAIT_S", 0.0)
    said = said_while_starting(tmp_path / "ray-a")
    assert len(said) == 1 and "another node on this machine is still starting" in said[0]
    holder()
    assert said_while_starting(tmp_path / "ray-a") == []  # let go: taken at once, nothing said
