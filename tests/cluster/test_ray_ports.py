"""Waiting for Ray's port: only the Ray this command started counts (issue 33, item 6).

Real processes, no Ray: a child that listens (ours), a grandchild that listens (Ray's GCS server is a
grandchild of `ray start`), a listener of the test's own (someone else's, as when a picked port is
taken before Ray binds it), and a child that dies. Each ends in its own clear state, within a bound.
"""

from __future__ import annotations

import socket
import subprocess
import sys

import pytest

from smolforge.cluster.nodes import ray_process
from smolforge.cluster.nodes.statedir import free_port
from smolforge.errors import SmolforgeError

LISTEN = ("import socket, time; s = socket.socket(); s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1); "
          "s.bind(('127.0.0.1', {port})); s.listen(); time.sleep(120)")


def _child(code: str) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", code])


@pytest.fixture
def procs():
    started: list[subprocess.Popen] = []
    yield started
    for p in started:  # only what this test started, by handle
        p.kill()
        p.wait(timeout=30)


def test_our_own_listener_is_waited_for(procs, tmp_path):
    port = free_port()
    procs.append(_child(LISTEN.format(port=port)))
    ray_process.wait_for_port("127.0.0.1", port, procs[0], 60, tmp_path / "log")
    assert ray_process.listens_on(procs[0].pid, port)


def test_a_grandchild_listener_is_ours(procs, tmp_path):
    port = free_port()
    code = f"import subprocess, sys, time; subprocess.Popen([sys.executable, '-c', {LISTEN.format(port=port)!r}]); time.sleep(120)"
    procs.append(_child(code))
    ray_process.wait_for_port("127.0.0.1", port, procs[0], 60, tmp_path / "log")
    assert ray_process.listens_on(procs[0].pid, port)


def test_someone_elses_listener_is_refused_saying_who(procs, tmp_path, monkeypatch):
    monkeypatch.setattr(ray_process, "FOREIGN_GRACE_S", 0.5)
    port = free_port()
    squatter = socket.socket()
    squatter.bind(("127.0.0.1", port))
    squatter.listen()
    try:
        procs.append(_child("import time; time.sleep(120)"))  # our "Ray", which never gets the port
        with pytest.raises(SmolforgeError) as err:  # the deadline's error would say "did not come up"
            ray_process.wait_for_port("127.0.0.1", port, procs[0], 120, tmp_path / "log")
        assert f"port {port} on 127.0.0.1 is held by" in err.value.what and "not by the Ray node" in err.value.what
        assert "--ray-port" in err.value.fix
        assert not ray_process.listens_on(procs[0].pid, port)
    finally:
        squatter.close()


def test_a_child_that_dies_ends_the_wait_with_its_log(procs, tmp_path):
    log = tmp_path / "ray.log"
    log.write_text("gcs_server: bind failed\n")
    procs.append(_child("import sys; sys.exit(3)"))
    with pytest.raises(SmolforgeError) as err:
        ray_process.wait_for_port("127.0.0.1", free_port(), procs[0], 60, log)
    assert "did not come up" in err.value.what and "bind failed" in err.value.what


def test_a_head_that_exits_during_start_up_is_started_again_with_a_fresh_command(tmp_path):
    """`start_head` (the coordinator's and the test clusters' one way to start a head): a head that exits
    during start-up (Ray's fixed 30 s node registration missed on a loaded machine: CI, stop 55) is started
    again from a command built afresh; one that exits every time raises the wait's error after `attempts`."""
    port, said = free_port(), []
    commands = [[sys.executable, "-c", "import sys; sys.exit(3)"], [sys.executable, "-c", LISTEN.format(port=port)]]
    made = iter(commands)
    proc = ray_process.start_head(lambda: next(made), "127.0.0.1", port, {}, tmp_path / "log", timeout=60,
                                  say=said.append)
    try:
        assert ray_process.listens_on(proc.pid, port) and proc.args == commands[1]
        assert said == ["the Ray head exited during start-up (code 3); starting it again with fresh ports (attempt 2 of 3)"]
    finally:
        proc.kill()
        proc.wait(timeout=30)
    said.clear()
    with pytest.raises(SmolforgeError, match="did not come up"):
        ray_process.start_head(lambda: [sys.executable, "-c", "import sys; sys.exit(4)"], "127.0.0.1", free_port(),
                               {}, tmp_path / "log2", timeout=60, attempts=2, say=said.append)
    assert len(said) == 1  # started twice, told once
