"""netlab: a slow network on one machine, for tests and benchmarks (Linux, root).

One network namespace per node (`coord`, `w1`, `w2` by default), each with `lo` and an `eth0`
whose other end sits on a bridge in a namespace of its own: the host's root namespace gets no
interface, address or route. Every node's egress is capped with `tc tbf` (this kernel has no netem),
so a node's upload is the Wi-Fi link of the issue (20 or 100 Mbit/s); traffic between two nodes
crosses the sender's cap.

    with Netlab(50) as lab:                        # 50 Mbit/s out of every node
        p = lab.popen("w1", [sys.executable, "-c", "..."])
        print(lab.addr("w1"), measure_rate(lab, "w1", "w2"))
        with lab.inside("coord"):                  # this thread's new sockets live in `coord`
            httpx.get(f"http://{lab.addr('coord')}:5000/health")

`NetCluster(lab, base)` is tests/cluster/localcluster.py's LocalCluster with the coordinator in one
namespace and each worker in another, every service on its namespace's address.

Why these tbf settings: tbf's timer is a high-resolution one, but on a loaded 2-core machine the
qdisc is often serviced late; tokens that piled up meanwhile (up to `burst`) make up for the delay,
so the burst is 10 ms of the rate (25 KB at 20 Mbit/s, 125 KB at 100 Mbit/s), never below 32 KiB
(a few full-size packets; a bucket smaller than one packet would send nothing). A burst is sent at
line rate once, so it inflates a 10 MB transfer by 0.25-1.25%. `latency 50ms` is the queue
(roughly what a home Wi-Fi buffers); TCP's small-queue limit keeps a local sender from overfilling
it, so nothing is dropped and TCP does not back off below the cap. Measured payload rates come out
~4-5% under the cap: tbf counts Ethernet/IP/TCP headers (66 B per 1448 B of payload).

Clean-up: `close()` (also run by `with`, atexit, and on KeyboardInterrupt through `with`) stops the
processes it started (their process groups), then any process still inside one of its namespaces
(only this lab's processes can be there), then deletes the namespaces (which takes the veths
with them). A lab whose creator was SIGKILLed leaves namespaces named `sfnl<pid>...`; the next lab
deletes those whose pid is gone.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import ipaddress
import itertools
import json
import os
import re
import shutil
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
if str(HERE / "cluster") not in sys.path:  # LocalCluster, for NetCluster below
    sys.path.insert(0, str(HERE / "cluster"))

from localcluster import LocalCluster  # noqa: E402

CLONE_NEWNET = 0x40000000
PREFIX = "sfnl"
IFACE = "eth0"  # every node's interface, inside its own namespace
_counter = itertools.count()
_lock = threading.Lock()


def _ip(*args: str, check: bool = True) -> subprocess.CompletedProcess:
    return subprocess.run(["ip", *args], capture_output=True, text=True, check=check, timeout=30)


def _ns_exists(ns: str) -> bool:
    return os.path.exists(f"/run/netns/{ns}")


def _ns_id(ns: str) -> tuple[int, int] | None:
    try:
        st = os.stat(f"/run/netns/{ns}")
    except OSError:
        return None
    return st.st_dev, st.st_ino


NS_FIX = ("run where network namespaces are allowed: as root on the host, or a container started with "
          "--cap-add NET_ADMIN --cap-add SYS_ADMIN (or --privileged)")


def missing() -> tuple[str, str] | None:
    """None if netlab can run here, else (what is missing, how to get it): for tests/helpers.require,
    which skips on a developer's machine and fails under CI."""
    if sys.platform != "linux":
        return "Linux network namespaces", "run the netlab tests on Linux"
    if os.geteuid() != 0:
        return "root (ip netns, tc)", "run the tests as root (.ci/run is run as root in CI)"
    for tool in ("ip", "tc"):
        if not shutil.which(tool):
            return f"`{tool}`", "apt-get install iproute2 (.ci/run does it as root)"
    return _probe()


def _probe() -> tuple[str, str] | None:
    """Make (then delete) one namespace with a tbf qdisc, a veth pair and a bridge: what a lab uses."""
    ns = f"{PREFIX}{os.getpid()}probe"
    try:
        r = _ip("netns", "add", ns, check=False)
        if r.returncode:
            return f"network namespaces ({r.stderr.strip()})", NS_FIX
        r = subprocess.run(["tc", "-n", ns, "qdisc", "add", "dev", "lo", "root", "tbf", "rate", "10mbit",
                            "burst", "32kb", "latency", "50ms"], capture_output=True, text=True, timeout=30)
        if r.returncode:
            return f"tc's tbf qdisc ({r.stderr.strip()})", "a kernel with sch_tbf (modprobe sch_tbf)"
        r = _ip("-n", ns, "link", "add", "sfprobe0", "type", "veth", "peer", "name", "sfprobe1", check=False)
        if r.returncode:
            return f"veth pairs ({r.stderr.strip()})", "a kernel with veth (modprobe veth)"
        r = _ip("-n", ns, "link", "add", "sfprobebr", "type", "bridge", check=False)
        if r.returncode:
            return f"bridges ({r.stderr.strip()})", "a kernel with bridge support (modprobe bridge)"
        return None
    finally:
        if _ns_exists(ns):
            _ip("netns", "del", ns, check=False)


def available() -> str | None:
    """None if netlab can run here, else why not and the fix, in one line (for the bench scripts)."""
    gap = missing()
    return None if gap is None else f"{gap[0]} is missing; {gap[1]}"


def tbf_args(rate_mbit: float) -> list[str]:
    """`tc ... tbf` arguments for a cap of `rate_mbit` (see the module's docstring for why)."""
    burst = max(32 * 1024, int(rate_mbit * 1e6 / 8 * 0.010))
    return ["rate", f"{rate_mbit:g}mbit", "burst", str(burst), "latency", "50ms"]


def _pick_subnet() -> ipaddress.IPv4Network:
    """A private /24 that no address or route of the host's namespace overlaps."""
    used = []
    for args in (("-4", "-o", "addr", "show"), ("-4", "route", "show", "table", "all")):
        for tok in re.findall(r"(\d+\.\d+\.\d+\.\d+(?:/\d+)?)", _ip(*args, check=False).stdout):
            with contextlib.suppress(ValueError):
                used.append(ipaddress.ip_network(tok, strict=False))
    for third in range(200, 256):
        net = ipaddress.ip_network(f"10.{third}.77.0/24")
        if not any(net.overlaps(u) for u in used if u.prefixlen > 0):
            return net
    raise RuntimeError("netlab: no free 10.x.77.0/24 on this host")


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
        return True
    except ProcessLookupError:
        return False
    except PermissionError:
        return True


def reap_stale() -> list[str]:
    """Delete namespaces left by labs whose process is gone (SIGKILLed); returns their names."""
    gone = []
    for line in _ip("netns", "list", check=False).stdout.splitlines():
        name = line.split()[0] if line.strip() else ""
        m = re.fullmatch(rf"{PREFIX}(\d+)x\d+-.+", name)
        if m and not _pid_alive(int(m.group(1))):
            _kill_inside([_ns_id(name)])
            _ip("netns", "del", name, check=False)
            gone.append(name)
    return gone


def _kill_inside(ids: list[tuple[int, int] | None]) -> list[int]:
    """SIGKILL every process (but this one) whose network namespace is one of `ids`."""
    ids = {i for i in ids if i}
    killed = []
    if not ids:
        return killed
    me = os.getpid()
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == me:
            continue
        try:
            st = os.stat(d / "ns" / "net")
        except OSError:
            continue
        if (st.st_dev, st.st_ino) in ids:
            with contextlib.suppress(ProcessLookupError):
                os.kill(int(d.name), signal.SIGKILL)
                killed.append(int(d.name))
    return killed


class Netlab:
    """Namespaces `names` on one bridge, each node's egress capped at `rate_mbit` (None: uncapped);
    `rates` overrides the cap per node. `uncapped_to`: nodes that traffic *to* is never capped (an `htb`
    root used as a classifier, its u32 filter sending packets for their addresses past the tbf; this kernel
    has no `prio`): for a benchmark whose link under test is between the workers, with the coordinator on one
    of the home machines, so a job's checkpoint upload and events do not cross the capped link. A context
    manager; `close()` undoes everything."""

    def __init__(self, rate_mbit: float | None = None, names: tuple[str, ...] = ("coord", "w1", "w2"),
                 rates: dict[str, float | None] | None = None, uncapped_to: tuple[str, ...] = ()):
        if len(set(names)) != len(names) or not names:
            raise ValueError(f"netlab: node names must be distinct: {names}")
        if set(uncapped_to) - set(names):
            raise ValueError(f"netlab: uncapped_to names no node: {sorted(set(uncapped_to) - set(names))}")
        self.uncapped_to = tuple(uncapped_to)
        self.names = tuple(names)
        self.rates = {n: (rates or {}).get(n, rate_mbit) for n in self.names}
        with _lock:
            self.tag = f"{PREFIX}{os.getpid()}x{next(_counter)}"
        self.bridge_ns = f"{self.tag}-br"
        self.subnet: ipaddress.IPv4Network | None = None
        self._addr: dict[str, str] = {}
        self._procs: list[subprocess.Popen] = []
        self._made: list[str] = []  # namespaces created, in order
        self._ids: list[tuple[int, int] | None] = []
        self._closed = False
        self._started = False

    # -- set-up and tear-down ---------------------------------------------------------------------

    def ns(self, name: str) -> str:
        if name not in self.names:
            raise KeyError(f"netlab has no node {name!r} (nodes: {', '.join(self.names)})")
        return f"{self.tag}-{name}"

    def addr(self, name: str) -> str:
        self.ns(name)  # KeyError naming the nodes for a name that is not one
        return self._addr[name]

    def start(self) -> "Netlab":
        if self._started:
            return self
        self._started = True
        if os.geteuid() != 0:
            raise RuntimeError("netlab needs root (ip netns, tc); netlab.available() says why it cannot run")
        reap_stale()
        atexit.register(self.close)
        try:
            self.subnet = _pick_subnet()
            hosts = list(self.subnet.hosts())
            self._add_ns(self.bridge_ns)
            _ip("-n", self.bridge_ns, "link", "add", "br0", "type", "bridge")
            _ip("-n", self.bridge_ns, "link", "set", "br0", "up")
            for i, name in enumerate(self.names):
                ns = self.ns(name)
                self._add_ns(ns)
                port = f"v{i}"  # the bridge's end; the node's end is eth0 in its own namespace
                _ip("-n", self.bridge_ns, "link", "add", port, "type", "veth", "peer", "name", IFACE, "netns", ns)
                _ip("-n", self.bridge_ns, "link", "set", port, "master", "br0")
                _ip("-n", self.bridge_ns, "link", "set", port, "up")
                addr = str(hosts[i])
                _ip("-n", ns, "addr", "add", f"{addr}/{self.subnet.prefixlen}", "dev", IFACE)
                _ip("-n", ns, "link", "set", "lo", "up")
                _ip("-n", ns, "link", "set", IFACE, "up")
                self._addr[name] = addr
            for name in self.names:  # every address known: a filter names the uncapped ones
                self.set_rate(name, self.rates[name])
            self._wait_reachable()
        except BaseException:
            self.close()
            raise
        return self

    def _add_ns(self, ns: str) -> None:
        _ip("netns", "add", ns)
        self._made.append(ns)
        self._ids.append(_ns_id(ns))

    def _wait_reachable(self, timeout: float = 10) -> None:
        """The bridge forwards once its ports leave the listening state (at once with STP off, but
        IPv6 DAD and carrier can lag): wait until the first node reaches every other one."""
        first, *rest = self.names
        deadline = time.time() + timeout
        for name in rest:
            while True:
                code = ("import socket,sys\ns=socket.socket();s.settimeout(0.5)\n"
                        f"r=s.connect_ex(({self.addr(name)!r},9))\nsys.exit(0 if r in (0,111) else 1)")
                r = subprocess.run(["ip", "netns", "exec", self.ns(first), sys.executable, "-c", code],
                                   capture_output=True, timeout=30)
                if r.returncode == 0:  # refused (111) is an answer: the packet got there
                    break
                if time.time() > deadline:
                    raise RuntimeError(f"netlab: {name} not reachable from {first} after {timeout}s")
                time.sleep(0.1)

    def set_rate(self, name: str, rate_mbit: float | None) -> None:
        """Cap `name`'s egress at rate_mbit (None: remove the cap)."""
        ns = self.ns(name)
        subprocess.run(["tc", "-n", ns, "qdisc", "del", "dev", IFACE, "root"], capture_output=True, timeout=30)
        exempt = [self._addr[n] for n in self.uncapped_to if n != name]
        tc = ["tc", "-n", ns]
        if rate_mbit is not None and not exempt:
            subprocess.run([*tc, "qdisc", "replace", "dev", IFACE, "root", "tbf", *tbf_args(rate_mbit)],
                           check=True, capture_output=True, text=True, timeout=30)
        elif rate_mbit is not None:  # an htb root: class 1:10 for the exempt addresses, the rest (1:20) through tbf
            line = ["rate", "10gbit", "quantum", "60000"]  # htb as a classifier only: far above any link here
            cmds = [["qdisc", "add", "dev", IFACE, "root", "handle", "1:", "htb", "default", "20"],
                    ["class", "add", "dev", IFACE, "parent", "1:", "classid", "1:10", "htb", *line],
                    ["class", "add", "dev", IFACE, "parent", "1:", "classid", "1:20", "htb", *line],
                    ["qdisc", "add", "dev", IFACE, "parent", "1:20", "handle", "20:", "tbf", *tbf_args(rate_mbit)]]
            cmds += [["filter", "add", "dev", IFACE, "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                      "match", "ip", "dst", f"{a}/32", "flowid", "1:10"] for a in exempt]
            for c in cmds:
                subprocess.run([*tc, *c], check=True, capture_output=True, text=True, timeout=30)
        self.rates[name] = rate_mbit

    def sent_bytes(self, name: str) -> int:
        """Bytes that left `name` through its eth0 (its queue's counter when capped)."""
        r = _ip("-n", self.ns(name), "-s", "-j", "link", "show", IFACE)
        return int(json.loads(r.stdout)[0]["stats64"]["tx"]["bytes"])

    def capped_bytes(self, name: str) -> int:
        """Bytes that went through `name`'s cap (its tbf qdisc's counter; 0 when uncapped)."""
        r = subprocess.run(["tc", "-s", "-j", "-n", self.ns(name), "qdisc", "show", "dev", IFACE],
                           check=True, capture_output=True, text=True, timeout=30)
        return sum(int(q.get("bytes", 0)) for q in json.loads(r.stdout) if q.get("kind") == "tbf")

    def close(self) -> None:
        """Stop what this lab started, then delete its namespaces (their veths go with them)."""
        if self._closed:
            return
        self._closed = True
        for p in self._procs:
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGTERM)
        deadline = time.time() + 5
        for p in self._procs:
            try:
                p.wait(timeout=max(0.1, deadline - time.time()))
            except subprocess.TimeoutExpired:
                with contextlib.suppress(ProcessLookupError, PermissionError):
                    os.killpg(p.pid, signal.SIGKILL)
        for p in self._procs:  # a group leader that exited may leave children behind
            with contextlib.suppress(ProcessLookupError, PermissionError):
                os.killpg(p.pid, signal.SIGKILL)
            with contextlib.suppress(subprocess.TimeoutExpired):
                p.wait(timeout=5)
        for _ in range(20):  # anything else inside our namespaces (Ray's workers, grandchildren)
            if not _kill_inside(self._ids):
                break
            time.sleep(0.1)
        for ns in reversed(self._made):
            _ip("netns", "del", ns, check=False)
        with contextlib.suppress(Exception):
            atexit.unregister(self.close)

    def __enter__(self) -> "Netlab":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.close()

    # -- running things inside -------------------------------------------------------------------

    def prefix(self, name: str) -> list[str]:
        """argv prefix that runs a command inside `name`'s namespace."""
        return ["ip", "netns", "exec", self.ns(name)]

    def popen(self, name: str, argv: list[str], **kw) -> subprocess.Popen:
        """Start argv inside `name` (its own session: close() stops its process group)."""
        kw.setdefault("start_new_session", True)
        kw.setdefault("stdin", subprocess.DEVNULL)
        p = subprocess.Popen([*self.prefix(name), *argv], **kw)
        self._procs.append(p)
        return p

    def run(self, name: str, argv: list[str], **kw) -> subprocess.CompletedProcess:
        kw.setdefault("capture_output", True)
        kw.setdefault("text", True)
        return subprocess.run([*self.prefix(name), *argv], **kw)

    @contextlib.contextmanager
    def inside(self, name: str):
        """Sockets this thread opens meanwhile are in `name`'s namespace (setns is per thread)."""
        libc = ctypes.CDLL(None, use_errno=True)
        with open("/proc/thread-self/ns/net") as home, open(f"/run/netns/{self.ns(name)}") as there:
            if libc.setns(there.fileno(), CLONE_NEWNET) != 0:
                raise OSError(ctypes.get_errno(), f"setns into {self.ns(name)}")
            try:
                yield self
            finally:
                if libc.setns(home.fileno(), CLONE_NEWNET) != 0:
                    raise OSError(ctypes.get_errno(), "setns back to this thread's own namespace")


# -- the 10 MB tensor --------------------------------------------------------------------------------

def measure_rate(lab: Netlab, src: str, dst: str, mbytes: float = 10.0, repeats: int = 2,
                 port: int = 29517, timeout: float = 120) -> dict:
    """Rank 0 in `src` sends a `mbytes` MB float32 tensor to rank 1 in `dst` with torch.distributed
    gloo send/recv, `repeats` times after a warm-up. Each transfer is timed on the sender from the
    send to rank 1's 1-element acknowledgement. Returns MB/s (1 MB = 1e6 bytes) per transfer, their
    median and the cap of `src`."""
    env = {**os.environ, "GLOO_SOCKET_IFNAME": IFACE, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
    me = str(Path(__file__).resolve())
    common = [lab.addr(src), str(port), str(mbytes), str(repeats)]
    recv = lab.popen(dst, [sys.executable, me, "rate-worker", "1", *common], env=env,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    send = lab.popen(src, [sys.executable, me, "rate-worker", "0", *common], env=env,
                     stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out0, _ = send.communicate(timeout=timeout)
        out1, _ = recv.communicate(timeout=30)
    except subprocess.TimeoutExpired:
        for p in (send, recv):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(p.pid, signal.SIGKILL)
        raise AssertionError(f"netlab rate measurement {src}->{dst} took over {timeout}s")
    if send.returncode or recv.returncode:
        raise AssertionError(f"netlab rate workers failed ({send.returncode}, {recv.returncode}):\n"
                             f"sender:\n{out0[-3000:]}\nreceiver:\n{out1[-3000:]}")
    line = [x for x in out0.splitlines() if x.startswith("{")][-1]
    res = json.loads(line)
    res.update(src=src, dst=dst, cap_mbit=lab.rates[src])
    return res


def _rate_worker(rank: int, master: str, port: int, mbytes: float, repeats: int) -> None:
    import statistics
    from datetime import timedelta

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    timeout = timedelta(seconds=120)
    store = dist.TCPStore(master, port, 2, is_master=rank == 0, timeout=timeout)
    dist.init_process_group("gloo", store=store, rank=rank, world_size=2, timeout=timeout)
    n = int(mbytes * 1e6) // 4
    big = torch.ones(n, dtype=torch.float32) if rank == 0 else torch.empty(n, dtype=torch.float32)
    ack = torch.zeros(1)
    warm = big[: max(1, n // 10)]  # warm-up: connections made, TCP windows grown
    rates = []
    for i in range(repeats + 1):
        payload = warm if i == 0 else big
        if rank == 0:
            t0 = time.perf_counter()
            dist.send(payload, dst=1)
            dist.recv(ack, src=1)
            dt = time.perf_counter() - t0
            if i:
                rates.append(payload.numel() * 4 / dt / 1e6)
        else:
            dist.recv(payload, src=0)
            dist.send(ack, dst=0)
    if rank == 0:
        print(json.dumps({"mbytes": n * 4 / 1e6, "rates_MBps": rates, "MBps": statistics.median(rates),
                          "Mbps": statistics.median(rates) * 8}), flush=True)
    dist.destroy_process_group()


# -- a smolforge cluster across the namespaces ------------------------------------------------------

class _InNamespace:
    """Calls `obj`'s methods with this thread inside a namespace (for a Client built in the test)."""

    def __init__(self, obj, lab: Netlab, name: str):
        self._obj, self._lab, self._name = obj, lab, name

    def __getattr__(self, attr):
        value = getattr(self._obj, attr)
        if not callable(value):
            return value

        def call(*a, **kw):
            with self._lab.inside(self._name):
                return value(*a, **kw)
        return call


class NetCluster(LocalCluster):
    """LocalCluster with the coordinator in namespace `coordinator` and every worker in the namespace
    of its name, each service on its namespace's address (`--host`; workers' Ray nodes take the
    address that reaches the coordinator). API calls and `client()` run inside the coordinator's
    namespace; `cli()` too."""

    def __init__(self, lab: Netlab, base: Path, coordinator: str = "coord", coordinator_cpus: int = 1):
        self.lab, self.coord_node = lab, coordinator
        super().__init__(base, coordinator_cpus=coordinator_cpus, host=lab.addr(coordinator),
                         prefix=lambda node: lab.prefix(coordinator if node == "coordinator" else node))

    def add_worker(self, name: str, **kw):
        """Each worker gets a Ray temp dir of its own, as on a machine of its own. In one shared dir two
        nodes starting together pick the same socket name (`sockets/plasma_store.1`); one raylet dies
        with "bind: Address already in use" and its `ray start` times out after 30 s."""
        tmp = self.tmp / name
        tmp.mkdir(exist_ok=True)
        shared, self.env = self.env, {**self.env, "RAY_TMPDIR": str(tmp)}
        try:
            return super().add_worker(name, **kw)
        finally:
            self.env = shared

    def api(self, *a, **kw):
        with self.lab.inside(self.coord_node):
            return super().api(*a, **kw)

    def client(self):
        with self.lab.inside(self.coord_node):
            return _InNamespace(super().client(), self.lab, self.coord_node)


if __name__ == "__main__" and len(sys.argv) > 1 and sys.argv[1] == "rate-worker":
    _rate_worker(int(sys.argv[2]), sys.argv[3], int(sys.argv[4]), float(sys.argv[5]), int(sys.argv[6]))
