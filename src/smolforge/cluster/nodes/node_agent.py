"""Node agents (one Ray actor per node) and the coordinator's view of node health.

Each agent samples its machine every few seconds (CPU, RAM, GPU utilisation and memory via
nvidia-ml-py) and POSTs the sample to the coordinator's API with the cluster token. Pushing rather
than being polled means a busy or restarting coordinator never stalls the agents, and the heartbeat
is simply "when did this node last report". Agents are detached actors pinned to their node, so a
coordinator restart finds them still running.

Node state = Ray's node table + heartbeats: `dead` when Ray has declared the node dead, `online`
when it reported within STALE_AFTER seconds, `stale` when it is alive to Ray but silent, `joining`
for a node whose agent has not reported yet.
"""

from __future__ import annotations

import logging
import os
import threading
import time
from typing import Any

from ray.exceptions import RayError

from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.nodes.nodeview import node_view
from smolforge.cluster.nodes.ray_glue import NAMESPACE

INTERVAL_S = 3.0
STALE_AFTER_S = 12.0
AGENT_PREFIX = "smolforge-agent-"

log = logging.getLogger(__name__)


def sample_usage(gpus: bool = True) -> dict[str, Any]:
    import psutil

    vm = psutil.virtual_memory()
    out: dict[str, Any] = {
        "cpu_percent": psutil.cpu_percent(interval=None),
        "ram_used_gb": round((vm.total - vm.available) / 1e9, 2),
        "ram_total_gb": round(vm.total / 1e9, 2),
        "ram_percent": vm.percent,
        "load_1m": os.getloadavg()[0] if hasattr(os, "getloadavg") else None,
        "gpus": [],
    }
    if gpus:
        import pynvml  # nvidia-ml-py: a dependency; without a driver nvmlInit raises NVMLError

        try:
            pynvml.nvmlInit()
            try:
                for i in range(pynvml.nvmlDeviceGetCount()):
                    h = pynvml.nvmlDeviceGetHandleByIndex(i)
                    util = pynvml.nvmlDeviceGetUtilizationRates(h)
                    mem = pynvml.nvmlDeviceGetMemoryInfo(h)
                    out["gpus"].append({"index": i, "util_percent": util.gpu, "mem_used_gb": round(mem.used / 1e9, 2),
                                        "mem_total_gb": round(mem.total / 1e9, 2)})
            finally:
                pynvml.nvmlShutdown()
        except pynvml.NVMLError:
            pass  # the GPU went away or the driver is gone: report the rest
    return out


class NodeAgent:
    """Ray actor class: publishes this node's usage to the coordinator every INTERVAL_S."""

    def __init__(self, url: str, token: str, node_id: str, interval: float = INTERVAL_S, ca_pem: str | None = None):
        self.url, self.token, self.node_id, self.interval = url.rstrip("/"), token, node_id, interval
        self.ca_pem = ca_pem  # the coordinator's TLS certificate: trusted exactly, nothing else
        self.last: dict[str, Any] = {}
        self.sent = 0
        self.errors = 0
        self._stop = False
        sample_usage(gpus=False)  # primes psutil's CPU counter
        threading.Thread(target=self._loop, daemon=True, name="node-agent").start()

    def _loop(self) -> None:
        import httpx

        from smolforge.cluster.nodes.tls import trust_exactly

        while not self._stop:  # a new client whenever retarget() changes the address, token or certificate
            target = (self.url, self.token, self.ca_pem)
            tls = {"verify": trust_exactly(self.ca_pem)} if self.ca_pem else {}
            with httpx.Client(timeout=5.0, headers={"Authorization": f"Bearer {self.token}"}, **tls) as client:
                self._send_until_retarget(client, target)

    def _send_until_retarget(self, client, target: tuple) -> None:
        while not self._stop and (self.url, self.token, self.ca_pem) == target:
            try:
                self.last = {"ts": time.time(), "pid": os.getpid(), **sample_usage()}
                r = client.post(f"{self.url}/api/v1/nodes/{self.node_id}/heartbeat", json=self.last)
                if r.status_code == 200:
                    self.sent += 1
                else:
                    self.errors += 1
            except Exception:
                self.errors += 1  # the coordinator may be restarting; keep trying
            time.sleep(self.interval)

    def retarget(self, url: str, token: str, ca_pem: str | None = None) -> None:
        self.url, self.token, self.ca_pem = url.rstrip("/"), token, ca_pem

    def usage(self) -> dict[str, Any]:
        return {**self.last, "sent": self.sent, "errors": self.errors}

    def ping(self) -> bool:
        return True


def ensure_agent(node_id: str, url: str, token: str, interval: float = INTERVAL_S, ca_pem: str | None = None):
    """Start (or find) the agent for `node_id`; it needs no CPU and stays on that node."""
    import ray
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy


    name = AGENT_PREFIX + node_id[:20]
    actor = ray.remote(NodeAgent).options(
        name=name, namespace=NAMESPACE, lifetime="detached", get_if_exists=True, num_cpus=0,
        scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False), max_restarts=0,
        max_concurrency=4,
    ).remote(url, token, node_id, interval, ca_pem)
    return actor


def node_state(alive: bool, last_heartbeat: float | None, first_seen: float, now: float | None = None) -> str:
    now = now or time.time()
    if not alive:
        return "dead"
    if last_heartbeat is None:
        return "joining" if now - first_seen < STALE_AFTER_S * 2 else "stale"
    return "online" if now - last_heartbeat <= STALE_AFTER_S else "stale"


class NodeMonitor(threading.Thread):
    """Coordinator side: starts agents on new nodes, remembers heartbeats, logs joins and losses."""

    def __init__(self, url: str, token: str, store=None, interval: float = 2.0, ca_pem: str | None = None):
        super().__init__(daemon=True, name="node-monitor")
        self.url, self.token, self.store, self.interval, self.ca_pem = url, token, store, interval, ca_pem
        self.heartbeats: dict[str, dict[str, Any]] = {}
        self.first_seen: dict[str, float] = {}
        self.agents: dict[str, Any] = {}
        self.known_alive: dict[str, str] = {}  # node_id -> name, for join/leave events
        self.members: frozenset[str] = frozenset()  # the nodes alive in Ray's table at the last tick
        self.refused = 0  # heartbeats from ids that are not members (kept nowhere)
        self.stopped = threading.Event()
        self.lock = threading.Lock()

    def heartbeat(self, node_id: str, sample: dict[str, Any]) -> bool:
        """Keep `sample` as `node_id`'s latest usage; False (and nothing kept) when no node of that id
        has joined. Why: any token holder may post, and heartbeats from invented ids (1,024 GPU entries
        each) grew the coordinator by 88 MB per 300; now what is kept is one sample per node Ray lists
        (the schema, `heartbeat.py`, bounds each sample)."""
        with self.lock:
            if node_id not in self.members:
                self.refused += 1
                return False
            self.heartbeats[node_id] = {**sample, "received": time.time()}
            return True

    def _set_members(self, alive: set[str], listed: set[str]) -> None:
        """The nodes whose heartbeats are kept (`alive`), before their agents start; forget what is kept
        of nodes Ray no longer lists at all (`listed`, dead ones included)."""
        with self.lock:
            self.members = frozenset(alive)
            for table in (self.heartbeats, self.first_seen):
                for gone in [nid for nid in table if nid not in listed]:
                    del table[gone]

    def snapshot(self) -> list[dict[str, Any]]:
        """Every node with its state and latest usage, coordinator first."""
        now = time.time()
        out = []
        seen_alive_names = set()
        for n in ray_glue.nodes(include_dead=True):
            if not n.alive and n.name in seen_alive_names:
                continue  # a node that left and re-joined under the same name
            if n.alive:
                seen_alive_names.add(n.name)
            hb = self.heartbeats.get(n.node_id)
            first = self.first_seen.setdefault(n.node_id, now)
            state = node_state(n.alive, hb["received"] if hb else None, first, now)
            out.append(node_view(n, state=state, usage={k: v for k, v in (hb or {}).items() if k != "received"} or None,
                                 heartbeat_age_s=round(now - hb["received"], 1) if hb else None))
        order = {"coordinator": 0, "embedded": 0, "worker": 1}
        out.sort(key=lambda d: (d["state"] == "dead", order.get(d["role"], 2), d["name"]))
        return out

    def tick(self) -> None:
        nodes = ray_glue.nodes(include_dead=True)
        alive_now = {n.node_id: n.name for n in nodes if n.alive}
        self._set_members(set(alive_now), {n.node_id for n in nodes})
        for nid, name in alive_now.items():
            self.first_seen.setdefault(nid, time.time())
            if nid not in self.agents:
                try:
                    agent = ensure_agent(nid, self.url, self.token, ca_pem=self.ca_pem)
                    agent.retarget.remote(self.url, self.token, self.ca_pem)  # an agent from before a coordinator restart
                    self.agents[nid] = agent
                except (RayError, ValueError) as err:  # the node went away meanwhile: next tick tries again
                    log.info("no agent on node %s yet: %s", name, err)
            if nid not in self.known_alive and self.store is not None:
                self.store.add_event(None, "node_joined", f"node {name} joined", {"node_id": nid, "name": name})
        for nid, name in self.known_alive.items():
            if nid not in alive_now:
                self.agents.pop(nid, None)
                if self.store is not None:
                    self.store.add_event(None, "node_lost", f"node {name} left or died", {"node_id": nid, "name": name})
        self.known_alive = alive_now

    def run(self) -> None:
        while not self.stopped.is_set():
            try:
                self.tick()
            except Exception:  # a monitor must outlive any one bad tick; say what it was
                log.warning("node monitor tick failed", exc_info=True)
            self.stopped.wait(self.interval)

    def stop(self) -> None:
        self.stopped.set()
