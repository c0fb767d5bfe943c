"""`smolforge worker join HOST:PORT --token-file F`: lend this machine to the cluster.

1. Ask the coordinator's API whether the token is right (a wrong or missing token is refused within
   seconds; Ray alone would wait ~20 s and then report a bare ConnectionError).
2. Take stock of the machine (CPUs, RAM, GPUs, models) and refuse a name another live node has. With
   `--memory-limit GB` the node's RAM is the smaller of the machine's and the limit: it is the Ray
   `memory` resource and RAM label placement reads, it is in every process's environment
   (`telemetry.memory`: the stage planner's free memory stays within it), and where cgroup v2 allows
   it the worker's process tree runs under `memory.max` = the limit (`memcap`).
3. Run `ray start --address … --block` as our child with the same token, advertising all of it as
   Ray resources and labels (see `ray_glue`), and wait until the coordinator sees the node.
4. Stay in the foreground. Ctrl-C / SIGTERM leaves the cluster. If the Ray node ends on its own
   (the coordinator's machine went away), wait for the coordinator and join again.
5. Read the models again every SMOLFORGE_RESCAN_S seconds (30) and on `smolforge worker rescan`. Ray
   cannot change a running node's custom resources, so when the models changed the node re-joins (3.)
   with the new `model:<name>` resources, at a moment it runs none of our tasks (all its CPUs free).
"""

from __future__ import annotations

import json
import os
import re
import signal
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx

from smolforge.cluster.nodes import ray_glue, ray_process, ray_tls
from smolforge.cluster.nodes.memcap import MemoryCap, apply_memory_cap
from smolforge.auth import check_token_format, resolve_token, write_token
from smolforge.cluster.nodes.ray_auth import ray_auth_env
from smolforge.cluster.nodes.discovery import check_models_dir, discover, discover_models, model_changes
from smolforge.cluster.nodes.model_fetch import MODELS_DIR_ENV, RESCAN_REQUEST_ENV
from smolforge.cluster.nodes.statedir import StateDir
from smolforge.cluster.nodes.tls import FINGERPRINT_ENV, pinned_context
from smolforge.errors import SmolforgeError
from smolforge.net import is_loopback
from smolforge.paths import atomic_write_json, atomic_write_text, home
from smolforge.telemetry.memory import LIMIT_ENV

REJECTED = "coordinator rejected the token"
RESCAN_ENV = "SMOLFORGE_RESCAN_S"  # seconds between model rescans; 0 turns the timer off
RESCAN_DEFAULT_S = 30.0
POLL_S = 1.0  # how often the running worker looks for a `worker rescan` request and at its Ray node
PID_FILE = "worker.json"  # in the worker's state dir: which process runs the worker (for `worker rescan`)
RESCAN_FILE = "worker-rescan"  # in the worker's state dir: `worker rescan` asks, the worker removes it


def rescan_interval() -> float:
    """SMOLFORGE_RESCAN_S as seconds (0: no timer, only `worker rescan`), checked before joining."""
    text = os.environ.get(RESCAN_ENV, "").strip()
    try:
        value = float(text) if text else RESCAN_DEFAULT_S
    except ValueError:
        value = -1.0
    if not value >= 0:
        raise SmolforgeError(f"{RESCAN_ENV}={text!r} is not a number of seconds", where=RESCAN_ENV,
                             fix="set it to e.g. 30 (0 rescans only on `smolforge worker rescan`), or unset it")
    return value


@dataclass
class WorkerOptions:
    coordinator: str
    token: str | None = None
    name: str | None = None
    models_dir: str | None = None
    cpus: int | None = None
    gpus: int | None = None
    memory_gb: float | None = None  # --memory-limit: the node's memory for placement, and its cgroup's memory.max
    state_dir: str | None = None
    object_store_mb: int | None = None
    tls_fingerprint: str | None = None
    rejoin: bool = True
    scan_hf_cache: bool = True

    def check(self) -> "WorkerOptions":
        """What this machine lends, checked before the coordinator is asked anything."""
        for flag, value, low in (("--cpus", self.cpus, 1), ("--gpus", self.gpus, 0), ("--memory-limit", self.memory_gb, 0.1),
                                 ("--object-store-mb", self.object_store_mb, 75)):
            if value is not None and not value >= low:  # `not >=`: NaN is refused too
                raise SmolforgeError(f"{flag} {value} is below {low}", where=flag, fix=f"give {low} or more, or leave it out")
        check_models_dir(self.models_dir)
        return self


def parse_coordinator(text: str, default_port: int = 5000) -> tuple[str, str, int]:
    """(scheme, host, port) of `HOST:PORT`, `http://HOST:PORT` or `https://HOST:PORT`; an https
    address stays https (never silently downgraded). Anything else (another scheme, a path, a bad
    IPv6 literal, a port out of range) is one message, before any connection is tried."""
    text = text.strip()
    scheme, sep, rest = text.partition("://")
    if not sep:
        scheme, rest = "http", text
    if scheme not in ("http", "https"):
        raise SmolforgeError(f"{text!r}: a coordinator is reached over http:// or https://, not {scheme}://",
                             fix=ADDRESS_FIX)
    host, port = _hostport(rest.rstrip("/"), default_port)
    return scheme, host, port


ADDRESS_FIX = "e.g. smolforge worker join 192.168.1.10:5000 --token-file ~/smolforge-token ([::1]:5000 for IPv6)"


def tls_for(scheme: str, host: str, port: int, fingerprint: str | None):
    """httpx's `verify` for a coordinator address: the pinned certificate for https, None for http."""
    if scheme != "https":
        return None
    fingerprint = fingerprint or os.environ.get(FINGERPRINT_ENV)
    if not fingerprint:
        raise SmolforgeError(f"https://{host}:{port} needs the coordinator's certificate fingerprint",
                             fix="pass --tls-fingerprint sha256:… (or set SMOLFORGE_TLS_FINGERPRINT) as "
                                 "`smolforge coordinator start --tls` printed it")
    return pinned_context(host, port, fingerprint)


def _hostport(text: str, default_port: int) -> tuple[str, int]:
    """HOST[:PORT] (an IPv6 host in brackets) -> (host, port); an empty host is this machine."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(f"//{text}")
        port = parts.port
    except ValueError as err:  # '[::1' (no closing bracket), a port that is not a number or past 65535
        raise SmolforgeError(f"{text!r} is not HOST:PORT ({err})", fix=ADDRESS_FIX) from None
    if parts.path or parts.query or parts.fragment or parts.username is not None or port == 0:
        raise SmolforgeError(f"{text!r} is not HOST:PORT", fix=ADDRESS_FIX)
    host, sep, tail = parts.netloc.rpartition(":")
    if not (sep and (tail.isdigit() or tail == "")):  # no port given (or only an IPv6 literal's own colons)
        host = parts.netloc
    return host or "127.0.0.1", (default_port if port is None else port)


def check_coordinator(host: str, port: int, token: str, timeout: float = 5.0, *, scheme: str = "http",
                      verify=None) -> dict:
    """The coordinator's public info if it accepts `token`; SmolforgeError otherwise (fast)."""
    url = f"{scheme}://{host}:{port}"
    try:
        ok = token and not any(c.isspace() for c in token)
        r = httpx.get(f"{url}/api/v1/auth/check", headers={"Authorization": f"Bearer {token}"} if ok else {},
                      timeout=timeout, **({"verify": verify} if verify is not None else {}))
    except httpx.HTTPError as err:
        raise SmolforgeError(f"cannot reach the coordinator at {url} ({type(err).__name__})",
                             fix="check HOST:PORT and that `smolforge coordinator start` runs there "
                                 "(with --host 0.0.0.0 for other machines)") from None
    if r.status_code == 401:
        raise SmolforgeError(REJECTED, where=url,
                             fix="copy the token printed by `smolforge coordinator start` (or from its state dir's `token` file)")
    if r.status_code != 200:  # something answers there, but not as a coordinator: say what, and where to look
        body = " ".join(r.text.split())[:200]
        none_there = ": no smolforge coordinator is there" if r.status_code == 404 else ""
        raise SmolforgeError(f"answered HTTP {r.status_code}{f' ({body})' if body else ''} to the coordinator's "
                             f"token check{none_there}", where=url,
                             fix="check HOST:PORT against the address `smolforge coordinator start` printed "
                                 "(port 5000 unless it was started with --port)")
    return r.json()


def _label_value(text: str) -> str:
    clean = re.sub(r"[^a-zA-Z0-9_.-]+", "-", text).strip("-_.")[:63]
    return clean or "unknown"


def node_resources(inv, cpus: int) -> tuple[dict[str, float], dict[str, str]]:
    res = {ray_glue.WORKER_RESOURCE: float(cpus), **ray_glue.advertised_models(inv.models)}
    labels = {ray_glue.NAME_LABEL: inv.name, ray_glue.ROLE_LABEL: "worker",
              ray_glue.RAM_LABEL: f"{inv.ram_gb:.2f}", ray_glue.GPUS_LABEL: str(len(inv.gpus))}
    if inv.gpus:
        labels[ray_glue.GPU_TYPE_LABEL] = _label_value(inv.gpus[0].name)
        labels[ray_glue.GPU_MEM_LABEL] = f"{inv.gpus[0].memory_gb:.0f}"
    return res, labels


class WorkerNode:
    def __init__(self, opts: WorkerOptions, announce=print):
        self.opts = opts.check()
        self.announce = announce
        self.proc = None
        self.stopping = threading.Event()
        self.scheme, self.host, self.port = parse_coordinator(opts.coordinator)
        self.verify = tls_for(self.scheme, self.host, self.port, opts.tls_fingerprint)
        self.rescan_s = rescan_interval()
        self.said_busy = ""  # the last "busy: re-registering when idle" line (said once, not at every check)
        self.token = ""
        self.models_dir = opts.models_dir  # at join: --models-dir, else <state>/models (where fetched models go)
        self.cap: MemoryCap | None = None  # --memory-limit: where it is enforced (applied once, at the first join)

    def _nodes(self, token: str) -> list[dict]:
        r = httpx.get(f"{self.scheme}://{self.host}:{self.port}/api/v1/nodes",
                      headers={"Authorization": f"Bearer {token}"}, timeout=10,
                      **({"verify": self.verify} if self.verify is not None else {}))
        r.raise_for_status()
        return r.json()

    def _post(self, token: str, path: str, body: dict) -> dict:
        r = httpx.post(f"{self.scheme}://{self.host}:{self.port}{path}", json=body,
                       headers={"Authorization": f"Bearer {token}"}, timeout=30,
                       **({"verify": self.verify} if self.verify is not None else {}))
        if r.status_code != 200:
            raise SmolforgeError(f"the coordinator refused this node's Ray TLS certificate ({r.status_code}): "
                                 f"{r.text[:200]}", fix="check that the coordinator and this worker run the same smolforge")
        return r.json()

    def start(self) -> str:
        """Join once; returns the registration line. Raises SmolforgeError on any refusal."""
        token = resolve_token(self.opts.token) or ""  # --token(-file) as given, else the environment
        # Ask the coordinator even without a token: the answer ("rejected") is the useful message.
        info = check_coordinator(self.host, self.port, token, scheme=self.scheme, verify=self.verify)
        token = check_token_format(token)
        self.models_dir = self.opts.models_dir or str(StateDir.at(self.opts.state_dir).root / "models")
        inv = discover(self.opts.name, models_dir=self.models_dir, cpus=self.opts.cpus, gpus=self.opts.gpus,
                       memory_gb=self._memory_gb(), scan_cache=self.opts.scan_hf_cache)
        for n in self._nodes(token):
            if n["name"] == inv.name and n["state"] != "dead":
                raise SmolforgeError(f"a node named {inv.name!r} is already in the cluster",
                                     fix="pick another --name")
        self.inv, self.token = inv, token
        state = StateDir.at(self.opts.state_dir)
        write_token(state.node_token_path, token)
        res, labels = node_resources(inv, inv.cpus)
        # A loopback cluster (its Ray head on 127.0.0.1) keeps this node on loopback too; a worker that
        # reaches a LAN coordinator through 127.0.0.1 still lets Ray pick the address others can reach.
        node_ip = "127.0.0.1" if is_loopback(str(info.get("ray_address", "")).rpartition(":")[0]) else None
        models = {k: v for k, v in inv.models.items()}
        env = {**os.environ, **ray_auth_env(state.node_token_path), "RAY_USAGE_STATS_ENABLED": "0",
               "SMOLFORGE_NODE_DIR": str(state.node_dir), "SMOLFORGE_NODE_NAME": inv.name,
               "SMOLFORGE_MODEL_PATHS": json.dumps(models), MODELS_DIR_ENV: self.models_dir,
               RESCAN_REQUEST_ENV: str(state.root / RESCAN_FILE)}  # a model fetched for a job asks for a rescan
        env.pop("RAY_AUTH_TOKEN", None)
        env.pop(LIMIT_ENV, None)
        if self.opts.memory_gb is not None:
            env[LIMIT_ENV] = f"{inv.ram_gb * 1000:.0f}"  # every stage and rank of this node plans within it
            self._cap(inv.name, int(inv.ram_gb * 1e9))
        if info.get("ray_tls"):  # the coordinator's CA signs this node's certificate for Ray's own TLS
            env.update(ray_tls.request_node_env(lambda path, body: self._post(token, path, body),
                                                state.root / "tls"))
        cmd = ray_process.worker_command(f"{self.host}:{info['ray_port']}", cpus=inv.cpus, gpus=len(inv.gpus),
                                         node_ip=node_ip, name=inv.name, resources=res, labels=labels,
                                         temp_dir=os.environ.get("RAY_TMPDIR"),
                                         object_store_mb=self.opts.object_store_mb,
                                         memory_bytes=int(inv.ram_gb * 1e9))
        self.log = state.root / "logs" / f"ray-worker-{inv.name}.log"
        return self._start_node(cmd, env, token, info['ray_port'])

    def _start_node(self, cmd: list[str], env: dict[str, str], token: str, ray_port: int) -> str:
        """`ray start` until the coordinator sees this node: a loaded machine can make Ray's own 30 s
        start-up check fail, and starting again usually works. One node of this machine starts at a
        time (`node_start_lock`)."""
        inv = self.inv
        for attempt in range(3):
            with ray_process.node_start_lock(env.get("RAY_TMPDIR"), say=self.announce):
                self.proc = ray_process.spawn(cmd, env, self.log, die_with_parent=True)
                if self._registered(inv.name, token):
                    return f"Registered as {inv.name}: {inv.summary()}"
            if self.stopping.is_set():
                break
            if self.proc.poll() is None:
                self.stop()
                self.stopping.clear()
                raise SmolforgeError(f"the coordinator did not see node {inv.name} within 90 s:\n"
                                     f"{ray_process.tail(self.log)}",
                                     fix=f"check that this machine can reach {self.host}:{ray_port} (Ray's port)")
            if attempt < 2:
                self.announce(f"the Ray node exited during start-up (code {self.proc.returncode}); retrying")
                time.sleep(2)
        raise SmolforgeError(f"the Ray node exited (code {self.proc.returncode}):\n{ray_process.tail(self.log)}",
                             fix=f"see {self.log}")

    def _registered(self, name: str, token: str) -> bool:
        """Wait (90 s at most) until the coordinator lists this node alive; False when our `ray start`
        exited first or we are told to stop."""
        deadline = time.time() + 90
        while time.time() < deadline and not self.stopping.is_set():
            if self.proc.poll() is not None:
                return False
            try:
                if any(n["name"] == name and n["alive"] for n in self._nodes(token)):
                    return True
            except (httpx.HTTPError, ValueError):
                pass  # the coordinator is busy or restarting: ask again
            time.sleep(0.5)
        return False

    def _memory_gb(self) -> float | None:
        """--memory-limit, or the machine's RAM when that is less: what placement may count on here."""
        from smolforge.cluster.nodes.discovery import detect_ram_gb

        limit = self.opts.memory_gb
        return None if limit is None else round(min(limit, detect_ram_gb()), 3)

    def _cap(self, name: str, limit_bytes: int) -> None:
        """The kernel's cap on this process tree, once (a re-join keeps the group it is in); says where."""
        if self.cap is None:
            self.cap = apply_memory_cap(limit_bytes, name)
            self.announce(self.cap.describe())

    def stop(self) -> None:
        self.stopping.set()
        if self.proc is not None:
            ray_process.stop(self.proc, timeout=20)

    def run(self) -> int:
        """Join, then stay up (re-joining after the cluster comes back) until told to stop."""
        def _on_signal(signum, frame):
            self.stopping.set()
            if self.proc is not None and self.proc.poll() is None:
                try:
                    os.kill(self.proc.pid, signal.SIGTERM)
                except ProcessLookupError:
                    pass

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, _on_signal)
            signal.signal(signal.SIGTERM, _on_signal)
        self.announce(self.start())
        state = StateDir.at(self.opts.state_dir)
        pid_file = state.root / PID_FILE
        atomic_write_json(pid_file, {"pid": os.getpid(), "name": self.inv.name})
        try:
            return self._serve(state)
        finally:
            _remove_if_ours(pid_file)
            if self.cap is not None:
                self.cap.release()

    def _serve(self, state: StateDir) -> int:
        """Until stopped: watch the Ray node; join again after it ended on its own or after a rescan
        found other models."""
        while True:
            code = self._watch(state)
            if self.stopping.is_set():
                self.stop()
                return 0
            if code is not None:
                self.announce(f"the Ray node stopped (exit {code}); waiting for the coordinator to re-join")
                if not self.opts.rejoin:
                    return 1
            while not self.stopping.is_set():
                try:
                    self.announce(self.start())
                    break
                except SmolforgeError as err:
                    if err.what == REJECTED:
                        raise
                    self.stopping.wait(3)
            if self.stopping.is_set():
                self.stop()
                return 0

    def _watch(self, state: StateDir) -> int | None:
        """The Ray node's exit code once it ends, or None once a rescan stopped it to re-register.
        Polls (POLL_S) rather than blocking in wait() so a `worker rescan` request is seen at once."""
        request = state.root / RESCAN_FILE
        next_scan = time.monotonic() + self.rescan_s if self.rescan_s else float("inf")
        while True:
            code = self.proc.poll()
            if code is not None:
                return code
            if self.stopping.wait(POLL_S):
                return 0
            asked = request.exists()
            if not (asked or time.monotonic() >= next_scan):
                continue
            outcome = self._rescan(request if asked else None)
            retry = min(self.rescan_s or BUSY_RETRY_S, BUSY_RETRY_S)
            next_scan = time.monotonic() + (retry if outcome == "busy" else self.rescan_s or float("inf"))
            if outcome == "changed":
                ray_process.stop(self.proc, timeout=20)
                return None

    def _rescan(self, request: Path | None) -> str:
        """Read the models again: "same", "busy" (changed, but a task of ours runs here: the next
        check tries again) or "changed" (re-register now). Answers a `worker rescan` request."""
        try:
            found, gone = model_changes(self.inv.models, discover_models(self.models_dir,
                                                                         scan_cache=self.opts.scan_hf_cache))
            unreadable = ""
        except OSError as err:  # a folder removed or unreadable mid-scan: keep what is advertised
            found, gone, unreadable = [], [], f"models not read again ({err}); keeping the ones advertised"
        what = "; ".join([*(f"found model {m}" for m in found), *(f"model {m} is gone" for m in gone)])
        busy = self._busy() if what else ""
        if unreadable:
            line, outcome = unreadable, "same"
        elif not what:
            line, outcome = f"models rescanned: no change ({len(self.inv.model_names())} models)", "same"
        elif busy:
            line, outcome = f"{what}; this node is busy ({busy}): re-registering when it is idle", "busy"
        else:
            line, outcome = f"{what}; re-registering", "changed"
        again = request is None and outcome == "busy" and line == self.said_busy  # the timer's check, said before
        if (what or unreadable or request is not None) and not again:
            self.announce(line)
        self.said_busy = line if outcome == "busy" else ""
        if request is not None:
            atomic_write_text(request.parent / (RESCAN_FILE + ".result"), line + "\n")
            request.unlink(missing_ok=True)
        return outcome

    def _busy(self) -> str:
        """Why this node should not leave Ray now ("" when idle): one of our tasks holds some of its
        CPUs (Ray's available < total), or the coordinator cannot tell us."""
        try:
            nodes = self._nodes(self.token)
        except (httpx.HTTPError, ValueError) as err:
            return f"the coordinator did not answer ({type(err).__name__})"
        for n in nodes:
            if n.get("name") == self.inv.name and n.get("alive"):
                total = float((n.get("ray_resources") or {}).get("CPU", 0.0))
                free = float((n.get("available") or {}).get("CPU", 0.0))
                return "" if free >= total else f"{total - free:g} of {total:g} CPUs in use"
        return ""


# A busy node checks again this soon (or at its timer, when that is shorter): one GET of the coordinator's
# node table. Its model waits unadvertised meanwhile; at 10 s a job that had just fetched it was
# advertised up to 10 s after its tasks ended (tests/cluster/test_model_travel.py: 22 s from a job's end
# to the re-join, 10 of them this wait).
BUSY_RETRY_S = 2.0


def _pid_alive(pid: int) -> bool:
    import psutil

    return psutil.pid_exists(pid)


def _remove_if_ours(pid_file: Path) -> None:
    try:
        if json.loads(pid_file.read_text()).get("pid") == os.getpid():
            pid_file.unlink()
    except (OSError, ValueError, AttributeError):
        pass


def request_rescan(state_dir: str | None, timeout: float = 60.0) -> str:
    """`smolforge worker rescan`: ask the worker running with this state dir to read its models again,
    and return its answer. A request file it polls (not a signal): no pid of another process is ever
    signalled, and it works whichever thread runs the worker."""
    root = Path(state_dir).expanduser().resolve() if state_dir else home().resolve()
    pid_file = root / PID_FILE
    fix = ("start one with `smolforge worker join HOST:PORT --token-file F`, and give this command the "
           "same --state-dir")
    try:
        pid = int(json.loads(pid_file.read_text())["pid"])
    except (OSError, ValueError, KeyError, TypeError):
        raise SmolforgeError(f"no worker runs with state dir {root}", where=str(pid_file), fix=fix) from None
    if not _pid_alive(pid):
        raise SmolforgeError(f"the worker that wrote {pid_file} (pid {pid}) is gone", where=str(pid_file), fix=fix)
    result, request = root / (RESCAN_FILE + ".result"), root / RESCAN_FILE
    result.unlink(missing_ok=True)
    request.write_text(f"{time.time()}\n")
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if not request.exists():
            try:
                return result.read_text().strip()
            except OSError:
                return "the worker read its models again (see its output)"
        if not _pid_alive(pid):
            raise SmolforgeError(f"the worker (pid {pid}) exited before it read its models again",
                                 where=str(pid_file), fix=fix)
        time.sleep(0.2)
    request.unlink(missing_ok=True)
    raise SmolforgeError(f"the worker (pid {pid}) did not answer within {timeout:.0f} s", where=str(root),
                         fix="it may be joining the cluster again; see its output and try once more")
