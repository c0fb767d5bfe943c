"""`ray start` for the coordinator's head node and for joining workers, run as our own child.

We run `ray start --block` as a child process instead of daemonising: its PID is ours, stopping it
stops exactly the Ray processes we started (never `ray stop`, which would kill every Ray on the
machine), and a worker's node goes away when `smolforge worker join` does (the child gets
SIGTERM through PR_SET_PDEATHSIG). Every port Ray would otherwise take at a fixed default is
picked free, so several nodes (and several test clusters) share one machine.

Token auth: the child gets RAY_AUTH_MODE=token and RAY_AUTH_TOKEN_PATH pointing at a 0600 file.
"""

from __future__ import annotations

import contextlib
import ctypes
import fcntl
import hashlib
import json
import os
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from pathlib import Path

from smolforge.cluster.nodes.statedir import free_ports, port_open
from smolforge.errors import SmolforgeError
from smolforge.net import is_loopback

HEAD_START_ATTEMPTS = 3  # a Ray head that exits during start-up is started again, with fresh ports (`start_head`)


def ray_executable() -> str:
    exe = Path(sys.executable).with_name("ray")
    return str(exe) if exe.exists() else "ray"


def ray_start(loopback: bool) -> list[str]:
    """`ray start`, or for a loopback cluster our wrapper that keeps the node address 127.0.0.1."""
    if loopback:
        return [sys.executable, "-m", "smolforge.cluster.nodes.ray_loopback", "start"]
    return [ray_executable(), "start"]


def _common_ports(ports: list[int]) -> list[str]:
    """The ports every node's agents take, and no log monitor: it tails every worker's log to stream it
    to drivers, and our drivers do not print them (`log_to_driver=False`); one Python process and its
    polling fewer per node."""
    agent, grpc, env, metrics = ports
    return ["--dashboard-agent-listen-port", str(agent), "--dashboard-agent-grpc-port", str(grpc),
            "--runtime-env-agent-port", str(env), "--metrics-export-port", str(metrics),
            "--include-log-monitor", "false"]


def _labels(labels: dict[str, str]) -> str:
    return ",".join(f"{k}={v}" for k, v in labels.items())


def _node_options(node_ip: str | None, temp_dir: str | None, object_store_mb: int | None,
                  memory_bytes: int | None) -> list[str]:
    """The `ray start` flags a head and a worker share, each only when set."""
    out: list[str] = []
    if node_ip:
        out += ["--node-ip-address", node_ip]
    if temp_dir:
        out += ["--temp-dir", temp_dir]
    if object_store_mb:
        out += ["--object-store-memory", str(int(object_store_mb) * 2**20)]
    if memory_bytes:
        out += ["--memory", str(int(memory_bytes))]
    return out


def head_command(port: int, *, cpus: int, node_ip: str | None, name: str, resources: dict[str, float],
                 labels: dict[str, str], temp_dir: str | None = None, object_store_mb: int | None = None,
                 memory_bytes: int | None = None) -> list[str]:
    dashboard, client, *common = free_ports(6, exclude={int(port)})  # distinct, and never the GCS port
    cmd = [*ray_start(bool(node_ip) and is_loopback(node_ip)), "--head", "--block", "--port", str(port), "--num-cpus", str(cpus),
           "--resources", json.dumps(resources), "--labels", _labels(labels), "--node-name", name,
           "--include-dashboard", "false", "--dashboard-port", str(dashboard),
           "--ray-client-server-port", str(client), "--disable-usage-stats", *_common_ports(common)]
    return cmd + _node_options(node_ip, temp_dir, object_store_mb, memory_bytes)


def worker_command(address: str, *, cpus: int, gpus: int, node_ip: str | None, name: str,
                   resources: dict[str, float], labels: dict[str, str], temp_dir: str | None = None,
                   object_store_mb: int | None = None, memory_bytes: int | None = None) -> list[str]:
    cmd = [*ray_start(bool(node_ip) and is_loopback(node_ip)), "--block", "--address", address, "--num-cpus", str(cpus),
           "--num-gpus", str(gpus), "--resources", json.dumps(resources), "--labels", _labels(labels),
           "--node-name", name, "--disable-usage-stats", *_common_ports(free_ports(4))]
    return cmd + _node_options(node_ip, temp_dir, object_store_mb, memory_bytes)


def metrics_port_env() -> dict[str, str]:
    """Ray's autoscaler and dashboard metrics servers take fixed ports (44217, 44227) unless these
    variables say otherwise: two heads on one machine (or an embedded cluster beside a head) collided."""
    autoscaler, dashboard = free_ports(2)
    return {"AUTOSCALER_METRIC_PORT": str(autoscaler), "DASHBOARD_METRIC_PORT": str(dashboard)}


def _die_with_parent() -> None:
    """preexec: the child gets SIGTERM when the process that started it dies (Linux only)."""
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass  # not Linux (no libc.so.6 / prctl): the caller stops its children itself


def spawn(cmd: list[str], env: dict[str, str], log_path: Path, die_with_parent: bool) -> subprocess.Popen:
    # No 30 s "drain" on SIGTERM (made for Ray Serve): our jobs recover from checkpoints anyway, and
    # Ctrl-C on a coordinator or worker should stop it now, taking all its Ray processes with it.
    env = {"RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S": "0", **env}
    log_path.parent.mkdir(parents=True, exist_ok=True)
    log = open(log_path, "ab")
    try:
        return subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                preexec_fn=_die_with_parent if die_with_parent else None)
    finally:
        log.close()


START_LOCK_WAIT_S = 300.0  # longer than one worker's whole start (3 tries of Ray's 30 s check + ours)


@contextlib.contextmanager
def node_start_lock(temp_dir: str | None, say=print) -> Iterator[None]:
    """Held while one node of this machine starts and registers: Ray names a node's sockets and logs
    in the cluster's session dir by "the first index whose file does not exist yet", which is a race
    between nodes that start at once on one machine. Seen in a CI run: three workers joining together, two
    raylets took `plasma_store.1`, one died with "bind: Address already in use", and its `ray start`
    then failed Ray's 30 s check three times. Nodes with another temp dir (another cluster's session)
    do not wait. A lock not had in START_LOCK_WAIT_S is passed by, with a line saying so."""
    root = os.path.realpath(temp_dir or os.environ.get("RAY_TMPDIR") or "/tmp/ray")
    key = hashlib.sha256(root.encode()).hexdigest()[:16]
    path = Path(tempfile.gettempdir()) / f"smolforge-node-start-{key}.lock"
    with open(path, "a+b") as fh:
        deadline, held = time.time() + START_LOCK_WAIT_S, False
        while True:
            try:
                fcntl.flock(fh, fcntl.LOCK_EX | fcntl.LOCK_NB)
                held = True
                break
            except BlockingIOError:
                if time.time() > deadline:
                    say(f"another node on this machine is still starting after {START_LOCK_WAIT_S:.0f} s; "
                        "starting anyway")
                    break
                time.sleep(0.2)
        try:
            yield
        finally:
            if held:
                fcntl.flock(fh, fcntl.LOCK_UN)


FOREIGN_GRACE_S = 10.0  # a listener not ours for this long: Ray lost the port to someone else


def listens_on(pid: int, port: int) -> bool:
    """True when process `pid` or one of its descendants listens on TCP `port` (Ray's GCS server is a
    grandchild of `ray start`). Only our own children are asked, which needs no privileges."""
    import psutil

    try:
        root = psutil.Process(pid)
        tree = [root, *root.children(recursive=True)]
    except psutil.Error:
        return False
    for p in tree:
        try:
            if any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port
                   for c in p.net_connections(kind="inet")):
                return True
        except psutil.Error:
            continue
    return False


def holder_of(port: int) -> str:
    """Who listens on `port`, as far as this process may see ("pid 123 (nginx)"), for the error."""
    import psutil

    try:
        for c in psutil.net_connections(kind="inet"):
            if c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port and c.pid:
                try:
                    return f"pid {c.pid} ({psutil.Process(c.pid).name()})"
                except psutil.Error:
                    return f"pid {c.pid}"
    except psutil.Error:
        pass
    return "another process"


def wait_for_port(host: str, port: int, proc: subprocess.Popen | None, timeout: float, log_path: Path) -> None:
    """Wait until the Ray we started (`proc`) listens on host:port; any other listener is not enough.

    A port picked free can be taken by another process before Ray binds it: then the port answers but
    our Ray never will. Seen as a coordinator that "started" on someone else's port and then retried
    its connection until the deadline. Ends in one of three clear states: ours is up (return), ours
    died (its log), or the port stayed someone else's for FOREIGN_GRACE_S (who holds it)."""
    deadline = time.time() + timeout
    foreign_since: float | None = None
    while time.time() < deadline:
        if port_open(host, port, timeout=0.5):
            if proc is None or listens_on(proc.pid, port):
                return
            foreign_since = foreign_since or time.time()
            if time.time() - foreign_since > FOREIGN_GRACE_S:
                raise SmolforgeError(f"port {port} on {host} is held by {holder_of(port)}, not by the Ray node "
                                     f"this command started (pid {proc.pid}):\n{tail(log_path)}",
                                     fix="pick another --ray-port, or stop what holds it")
        else:
            foreign_since = None
        if proc is not None and proc.poll() is not None:
            break
        time.sleep(0.3)
    raise SmolforgeError(f"Ray did not come up on {host}:{port}:\n{tail(log_path)}",
                         fix=f"see {log_path}; another process may hold the port (pick --ray-port)")


def start_head(command: Callable[[], list[str]], host: str, port: int, env: dict[str, str], log_path: Path, *,
               timeout: float = 60.0, attempts: int = HEAD_START_ATTEMPTS, die_with_parent: bool = False,
               say: Callable[[str], None] = lambda line: print(line, flush=True)) -> subprocess.Popen:
    """Start a Ray head (`command()`, called once per attempt so its other ports are picked afresh) and wait
    until it listens on host:port (`wait_for_port`, `timeout` s each): the started process.

    A head that exits during start-up is started again, up to `attempts` times: Ray's own node registration
    has a fixed 30 s bound that a loaded machine can miss (seen in CI beside other Ray clusters), and a port
    picked free may be taken before Ray binds it. A head that is alive but not ours on the port, or that
    failed every attempt, raises `wait_for_port`'s SmolforgeError (it says which); the failed process is stopped."""
    for attempt in range(attempts):
        proc = spawn(command(), env, log_path, die_with_parent=die_with_parent)
        try:
            wait_for_port(host, port, proc, timeout, log_path)
            return proc
        except SmolforgeError:
            exited = proc.poll() is not None
            stop(proc)
            if not exited or attempt == attempts - 1:
                raise
            say(f"the Ray head exited during start-up (code {proc.returncode}); starting it again with fresh ports "
                f"(attempt {attempt + 2} of {attempts})")
    raise AssertionError("unreachable: the last attempt returns or raises")


def tail(path: Path, lines: int = 15) -> str:
    try:
        return "\n".join(path.read_text(errors="replace").splitlines()[-lines:])
    except OSError:
        return "(no log)"


def stop(proc: subprocess.Popen | None, pid: int | None = None, timeout: float = 20.0) -> None:
    """Stop a `ray start --block` we started: SIGTERM (it stops its own children), then SIGKILL."""
    if proc is not None:
        pid = proc.pid
    if not pid:
        return
    try:
        os.kill(pid, signal.SIGTERM)
    except ProcessLookupError:
        return
    deadline = time.time() + timeout
    while time.time() < deadline:
        if proc is not None:
            if proc.poll() is not None:
                return
        else:
            try:
                os.kill(pid, 0)
            except ProcessLookupError:
                return
        time.sleep(0.2)
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass
