"""A real cluster on one machine for tests: a coordinator and workers as separate processes.

Each process is `python -m smolforge.cli.main ...` (what a user runs), started in its own session
so the test can stop exactly the process group it started (os.killpg), never `ray stop`. Every
cluster gets its own short RAY_TMPDIR (Ray's socket paths have a length limit), its own state dirs
and free ports.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parents[2]


def free_port() -> int:
    from smolforge.cluster.nodes.statedir import free_port as fp

    return fp()


def cli_module() -> str:
    return "smolforge.cli.main" if (ROOT / "src/smolforge/cli/main.py").exists() else "smolforge.cli.cluster"


class Proc:
    def __init__(self, args: list[str], env: dict, log: Path, prefix: list[str] | None = None):
        self.args, self.log = args, log
        self._fh = open(log, "wb")
        # prefix: e.g. `ip netns exec NS` (tests/netlab.py), which execs the command: same pid
        self.p = subprocess.Popen([*(prefix or []), sys.executable, "-m", cli_module(), *args], env=env,
                                  stdout=self._fh, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                  start_new_session=True)
        self.pgid = self.p.pid

    def output(self) -> str:
        try:
            return self.log.read_text(errors="replace")
        except OSError:
            return ""

    def alive(self) -> bool:
        return self.p.poll() is None

    def wait_for(self, text: str, timeout: float) -> str:
        deadline = time.time() + timeout
        while time.time() < deadline:
            out = self.output()
            if text in out:
                return out
            if self.p.poll() is not None:
                raise AssertionError(f"{self.args[:3]} exited {self.p.returncode}:\n{self.output()[-3000:]}")
            time.sleep(0.2)
        raise AssertionError(f"{text!r} not seen from {self.args[:3]} in {timeout}s:\n{self.output()[-3000:]}")

    def kill_group(self, sig=signal.SIGKILL) -> None:
        try:
            os.killpg(self.pgid, sig)
        except ProcessLookupError:
            pass
        try:
            self.p.wait(timeout=15)
        except subprocess.TimeoutExpired:
            pass
        self._fh.close()


class LocalCluster:
    """coordinator + workers; `with LocalCluster(tmp) as c: c.add_worker("w1")`."""

    def __init__(self, base: Path, coordinator_cpus: int = 1, host: str = "127.0.0.1", prefix=None):
        """host: the coordinator's --host; prefix(node name) -> argv prefix that runs that node's
        process elsewhere ("coordinator" for the coordinator; tests/netlab.py: its namespace)."""
        self.base = Path(base)
        self.host = host
        self._prefix = prefix or (lambda node: [])
        self.tmp = Path(tempfile.mkdtemp(prefix="sfr", dir="/tmp"))  # short: Ray socket paths
        self.state = self.base / "coord-state"
        self.port, self.ray_port = free_port(), free_port()
        self.coordinator_cpus = coordinator_cpus
        self.env = {**os.environ, "RAY_TMPDIR": str(self.tmp), "RAY_AUTH_MODE": "token",
                    "RAY_USAGE_STATS_ENABLED": "0", "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1",
                    "HF_HUB_CACHE": str(self.base / "empty-hf-cache"), "PYTHONUNBUFFERED": "1"}
        for k in ("RAY_AUTH_TOKEN", "RAY_AUTH_TOKEN_PATH", "SMOLFORGE_COORDINATOR", "SMOLFORGE_TOKEN",
                  "SMOLFORGE_RAY_ADDRESS", "RAY_ADDRESS"):
            self.env.pop(k, None)
        self.coordinator: Proc | None = None
        self.old_coordinators: list[Proc] = []
        self.workers: dict[str, Proc] = {}
        self.head_pgids: list[int] = []
        self.tls_fingerprint: str | None = None  # set by start_coordinator(tls=True)

    # -- processes ----------------------------------------------------------------------------------

    def start_coordinator(self, timeout: float = 120, models_dir: Path | None = None,
                          tls: bool = False) -> "LocalCluster":
        log = self.base / f"coordinator-{len(self.old_coordinators)}.log"
        args = ["coordinator", "start", "--port", str(self.port), "--ray-port", str(self.ray_port),
                "--state-dir", str(self.state), "--cpus", str(self.coordinator_cpus), "--object-store-mb", "100"]
        if models_dir:
            args += ["--models-dir", str(models_dir)]
        if tls:
            args += ["--tls"]
        if self.host != "127.0.0.1":
            args += ["--host", self.host]
        self.coordinator = Proc(args, self.env, log, prefix=self._prefix("coordinator"))
        self.coordinator.wait_for("Join workers with:", timeout)
        info = json.loads((self.state / "coordinator.json").read_text())
        self.tls_fingerprint = info.get("tls_fingerprint")
        if info.get("head_pid"):
            try:
                self.head_pgids.append(os.getpgid(int(info["head_pid"])))
            except ProcessLookupError:
                pass
        return self

    @property
    def token(self) -> str:
        return (self.state / "token").read_text().strip()

    @property
    def hostport(self) -> str:
        return f"{'https://' if self.tls_fingerprint else ''}{self.host}:{self.port}"

    def add_worker(self, name: str, cpus: int = 1, models_dir: Path | None = None, token: str | None = None,
                   wait: bool = True, timeout: float = 120, tls_fingerprint: str | None = None,
                   memory_gb: float = 4) -> Proc:
        args = ["worker", "join", self.hostport, "--name", name, "--cpus", str(cpus), "--memory-limit", f"{memory_gb:g}",
                "--state-dir", str(self.base / f"node-{name}"), "--object-store-mb", "100"]
        if tls_fingerprint or self.tls_fingerprint:
            args += ["--tls-fingerprint", tls_fingerprint or self.tls_fingerprint]
        tok = self.token if token is None else token
        if tok:  # as the README says: a copy of the token file, never the token in argv
            token_file = self.base / f"token-copy-{name}"
            token_file.write_text(tok)
            token_file.chmod(0o600)
            args += ["--token-file", str(token_file)]
        if models_dir:
            args += ["--models-dir", str(models_dir)]
        proc = Proc(args, self.env, self.base / f"worker-{name}.log", prefix=self._prefix(name))
        self.workers[name] = proc
        if wait:
            proc.wait_for(f"Registered as {name}", timeout)
        return proc

    def add_workers(self, names: list[str], **kw) -> None:
        """Start several workers at once (each joins in ~10 s; in parallel that is ~10 s total)."""
        procs = [self.add_worker(n, wait=False, **kw) for n in names]
        for n, p in zip(names, procs):
            p.wait_for(f"Registered as {n}", 120)

    def kill_worker(self, name: str) -> None:
        self.workers[name].kill_group(signal.SIGKILL)

    def kill_coordinator(self) -> None:
        """SIGKILL the coordinator process only (its Ray head keeps running, as after a crash)."""
        assert self.coordinator is not None
        try:
            os.kill(self.coordinator.p.pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        self.coordinator.p.wait(timeout=15)
        self.old_coordinators.append(self.coordinator)
        self.coordinator = None

    def close(self) -> None:
        """Workers: SIGKILL their groups. Coordinator: SIGTERM (it stops its Ray head), then SIGKILL."""
        for proc in self.workers.values():
            proc.kill_group(signal.SIGKILL)
        if self.coordinator is not None and self.coordinator.alive():
            try:
                os.kill(self.coordinator.p.pid, signal.SIGTERM)
            except ProcessLookupError:
                pass
            deadline = time.time() + 15
            while self.coordinator.alive() and time.time() < deadline:
                time.sleep(0.2)
        for proc in ([self.coordinator] if self.coordinator else []) + self.old_coordinators:
            proc.kill_group(signal.SIGKILL)
        for pgid in self.head_pgids:
            try:
                os.killpg(pgid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not os.environ.get("SF_KEEP_RAY_TMP"):
            shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # -- API ------------------------------------------------------------------------------------------

    def api(self, method: str, path: str, token: str | None = "default", **kw) -> httpx.Response:
        headers = kw.pop("headers", {})
        tok = self.token if token == "default" else token
        if tok:
            headers["Authorization"] = f"Bearer {tok}"
        if self.tls_fingerprint:
            from smolforge.cluster.nodes.tls import trust_exactly

            kw["verify"] = trust_exactly((self.state / "tls" / "cert.pem").read_text())
        url = self.hostport if self.tls_fingerprint else f"http://{self.hostport}"
        return httpx.request(method, f"{url}{path}", headers=headers, timeout=60, **kw)

    def client(self):
        from smolforge.client import Client

        return Client(self.hostport, self.port, token=self.token, tls_fingerprint=self.tls_fingerprint)

    def wait_nodes(self, names: list[str], state: str = "online", timeout: float = 60) -> list[dict]:
        deadline = time.time() + timeout
        nodes: list[dict] = []
        while time.time() < deadline:
            nodes = self.api("GET", "/api/v1/nodes").json()
            have = {n["name"]: n["state"] for n in nodes}
            if all(have.get(n) == state for n in names):
                return nodes
            time.sleep(0.5)
        raise AssertionError(f"nodes {names} not {state} after {timeout}s: {nodes}")

    def cli(self, *args: str, timeout: float = 120) -> subprocess.CompletedProcess:
        env = {**self.env, "SMOLFORGE_COORDINATOR": self.hostport, "SMOLFORGE_TOKEN": self.token}
        return subprocess.run([*self._prefix("coordinator"), sys.executable, "-m", cli_module(), *args],
                              capture_output=True, text=True,
                              timeout=timeout, env=env)


@contextlib.contextmanager
def orchestrators_on(spawn, mode: str):
    """(handle, make) for Orchestrators on a cluster that `spawn(procs)` starts and returns as (handle,
    tmp dir): `make(mode)` builds one. Afterwards every orchestrator's threads are joined before Ray
    goes away (even after a failed test), then the cluster, its processes and its tmp dir are stopped.

    A `spawn` that fails after it connected (a node that never joined) returns no handle, but this
    process is a Ray driver all the same: it is disconnected before the head is stopped. Left connected,
    Ray ended the pytest process about a minute after its head went (stop 40's CI: `node down` two
    tests later, in another module)."""
    from types import SimpleNamespace

    from smolforge.cluster.nodes import ray_glue
    from smolforge.cluster.nodes.ray_process import stop
    from smolforge.orchestrator import Orchestrator

    procs: list = []
    made: list = []
    handle = tmp = None
    try:
        handle, tmp = spawn(procs)
        backend = SimpleNamespace(handle=handle, close=lambda: None)

        def make(how: str = mode):
            made.append(Orchestrator(how, backend=backend))
            return made[-1]

        yield handle, make
    finally:
        for orch in made:
            orch.shutdown_distill()
        connected = handle if handle is not None else ray_glue.connected_handle()
        if connected is not None:
            connected.shutdown()
        for p in reversed(procs):
            stop(p)
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
