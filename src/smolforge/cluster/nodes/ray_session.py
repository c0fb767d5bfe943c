"""The Ray processes an embedded command starts, and reaping them after that command was killed.

`ray.init()` in an embedded command (`launch`, `job resume`, `dashboard`...) starts a GCS, a raylet
and the raylet's agents under it. When the command is SIGKILLed, the GCS and the raylet go with
it, but the dashboard and runtime-env agents are re-parented to init and live on for minutes. So
the command records what it started (`ray-sessions/<pid>.json` in the embedded state dir: its own
pid and start time, Ray's session dir, each Ray process's pid and start time) once Ray is up, and
drops the record when it closes Ray itself. The next embedded command reaps every record whose
owner is gone: the recorded processes, matched by pid *and* start time (a reused pid is never
touched), and any other process of this user that holds that session's files or names its dir on
its command line (by session, never by a process name).
"""

from __future__ import annotations

import json
import logging
import os
import signal
from pathlib import Path
from typing import Any

import psutil

from smolforge.paths import atomic_write_json

log = logging.getLogger(__name__)

TERM_GRACE_S = 1.0  # SIGTERM first (the agents may flush their logs), then SIGKILL


def _records(state_root: Path) -> Path:
    return Path(state_root) / "ray-sessions"


def _session_dir() -> str | None:
    """This process's Ray session dir (Ray has no public call for it)."""
    try:
        import ray

        return ray._private.worker.global_worker.node.get_session_dir_path()
    except Exception:  # noqa: BLE001 - an older or newer Ray: reaping by pid still works
        return None


def record(state_root: Path) -> Path:
    """After `ray.init()`: write down this process, its Ray session and the processes Ray started."""
    me, session = psutil.Process(), _session_dir()
    started = []
    for child in me.children():  # Ray's own (the session dir on their command line), and what they started
        try:
            if session is None or any(session in arg for arg in child.cmdline()):
                started += [child, *child.children(recursive=True)]
        except psutil.Error:
            continue
    procs = []
    for proc in started:
        try:
            procs.append([proc.pid, proc.create_time()])
        except psutil.Error:
            continue
    path = _records(state_root) / f"{me.pid}.json"
    atomic_write_json(path, {"owner": [me.pid, me.create_time()], "session_dir": session, "processes": procs})
    return path


def forget(state_root: Path) -> None:
    """Ray was shut down by this process: nothing of its session is left to reap."""
    try:
        (_records(state_root) / f"{os.getpid()}.json").unlink()
    except FileNotFoundError:
        pass


def _alive(pid: int, started: float) -> psutil.Process | None:
    """The process `pid` if it is still the one that started at `started` (and not a zombie)."""
    try:
        proc = psutil.Process(pid)
        if abs(proc.create_time() - started) < 1.0 and proc.status() != psutil.STATUS_ZOMBIE:
            return proc
    except psutil.Error:
        pass
    return None


def _of_session(session_dir: str) -> list[psutil.Process]:
    """This user's processes that name `session_dir` on their command line or hold a file in it."""
    found, me = [], os.getuid()
    prefix = session_dir.rstrip("/") + "/"
    for proc in psutil.process_iter(["uids", "cmdline"]):
        try:
            if proc.info["uids"] is None or proc.info["uids"].real != me or proc.pid == os.getpid():
                continue
            if any(prefix in arg or arg.endswith(session_dir) for arg in proc.info["cmdline"] or []) or \
                    any(f.path.startswith(prefix) for f in proc.open_files()):
                found.append(proc)
        except psutil.Error:
            continue
    return found


def _stop(procs: list[psutil.Process]) -> list[int]:
    for proc in procs:
        try:
            proc.send_signal(signal.SIGTERM)
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=TERM_GRACE_S)
    for proc in alive:
        try:
            proc.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=TERM_GRACE_S)
    return [p.pid for p in procs]


def reap_dead(state_root: Path) -> list[int]:
    """Stop what the Ray sessions of dead embedded commands left running; returns the pids stopped."""
    stopped: list[int] = []
    folder = _records(state_root)
    for path in sorted(folder.glob("*.json")) if folder.is_dir() else []:
        try:
            rec: dict[str, Any] = json.loads(path.read_text())
            if _alive(*rec["owner"]):
                continue  # a command still running: its session is its own
            procs = [p for p in (_alive(pid, started) for pid, started in rec.get("processes") or []) if p]
            if rec.get("session_dir"):
                procs += [p for p in _of_session(rec["session_dir"]) if p.pid not in {q.pid for q in procs}]
        except (OSError, ValueError, KeyError, TypeError):
            log.warning("unreadable Ray session record %s: dropped", path)
            procs = []
        stopped += _stop(procs)
        path.unlink(missing_ok=True)
    return stopped
