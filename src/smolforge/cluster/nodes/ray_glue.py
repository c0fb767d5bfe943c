"""Ray glue: connect to the cluster (or start the embedded one), read the node table, place tasks.

API (stable; other packages build on it):
    connect(address=None, *, state_dir=None, num_cpus=None, token=None) -> ClusterHandle
        Join a running coordinator's Ray cluster, or start an embedded local one. `address` is a Ray
        address ("host:6379"). With none given it uses $SMOLFORGE_RAY_ADDRESS, then the
        coordinator recorded in `<state_dir>/coordinator.json` if its Ray port answers, and
        otherwise starts an in-process cluster of this machine (`ray.init(address="local")`) that
        advertises itself as a worker. "One machine" is a cluster of one, same code path.
        Token auth is always on: the token comes from `token=`, `<state_dir>/token` (the coordinator's
        machine), `<state_dir>/node-token` (a joined worker), or $SMOLFORGE_TOKEN; the embedded
        cluster creates one in `<state_dir>/token` (0600). Calling connect again while connected
        returns the same handle.

    ClusterHandle: .address, .embedded, .namespace, .nodes(), .check_placeable(req),
        .ray_options(req), .bundle(req), .head_node_id, .shutdown() (stops only an embedded cluster)

    nodes() -> list[NodeInfo]               the live node table (connects if needed)
    check_placeable(req) -> list[NodeInfo]  nodes that can run `req`; raises SmolforgeError at once,
                                            listing what every node has, when none can
    Requirements(model=None, min_ram_gb=0, cpus=1, gpu="no"|"preferred"|"required",
                 allowed_nodes=None, on_coordinator=False)
        .ray_options(nodes=None) -> dict    kwargs for `.options(...)` of a task or actor
        .bundle(nodes=None) -> (dict, dict) a placement-group bundle and its label selector

How nodes advertise themselves (workers via `smolforge worker join`; tests may build nodes by hand
with `ray start`/`ray.init` using the same names):
    resource  "smolforge-worker": <cpus>   the node takes training work (the coordinator does not)
    resource  "smolforge-head": 1000       the coordinator's node (job control actors live there)
    resource  "model:<name>": 1000         one per model the node holds (HF id, dir name, Ollama name)
    label     smolforge.io/name=<name>     the node's name (allowed_nodes matches it)
    label     smolforge.io/role=worker|coordinator|embedded
    label     smolforge.io/ram-gb, smolforge.io/gpus, smolforge.io/gpu-type, smolforge.io/gpu-mem-gb
Requirements turn into resources (CPU, GPU, smolforge-worker, model:<name>) and, where a subset of
nodes is meant (allowed_nodes, min_ram_gb, the coordinator), a label selector on the node name.
"""

from __future__ import annotations

import json
import logging
import os
import socket
import threading
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Literal

from smolforge.auth import load_or_create_token, write_token

from smolforge.cluster.nodes.ray_auth import apply_ray_auth
from smolforge.cluster.nodes.discovery import (by_backend, default_node_name, detect_cpus, detect_ram_gb, scan_hf_cache,
                                         with_aliases)
from smolforge.cluster.nodes.ray_loopback import keep_loopback
from smolforge.cluster.nodes.ray_process import metrics_port_env
from smolforge.cluster.nodes.statedir import StateDir, port_open
from smolforge.distill.backends import OLLAMA_TAG, WEIGHTS, loader
from smolforge.errors import SmolforgeError
from smolforge.net import is_loopback

NAMESPACE = "smolforge"
WORKER_RESOURCE = "smolforge-worker"
HEAD_RESOURCE = "smolforge-head"
MODEL_PREFIX = WEIGHTS.resource_prefix  # a model the node can load as weights (HF cache, --models-dir)
OLLAMA_PREFIX = OLLAMA_TAG.resource_prefix  # a model the node's Ollama serves (`ollama list`)
NAME_LABEL = "smolforge.io/name"
ROLE_LABEL = "smolforge.io/role"
RAM_LABEL = "smolforge.io/ram-gb"
GPUS_LABEL = "smolforge.io/gpus"
GPU_TYPE_LABEL = "smolforge.io/gpu-type"
GPU_MEM_LABEL = "smolforge.io/gpu-mem-gb"
MODEL_AMOUNT = 1000.0  # what a node advertises per model: many tasks may share the weights
MODEL_REQUEST = 0.001  # what a task asks for: "this node has the model", not an exclusive claim

GpuPolicy = Literal["required", "preferred", "no"]


def node_ip() -> str:
    """This process's node address as Ray sees it (what the other ranks can reach)."""
    try:
        import ray

        return ray.util.get_node_ip_address()
    except Exception:
        return socket.gethostbyname(socket.gethostname())


def model_resource(name: str, backend: str = "hf") -> str:
    """The Ray resource by which a node says it can load `name` with `backend` (`hf`: the weights,
    `ollama`: an Ollama tag). Separate, so a node holding only an Ollama tag never takes an `hf` task."""
    return loader(backend).resource_prefix + name.strip()


def advertised_models(models: dict[str, str]) -> dict[str, float]:
    """The model resources of a node from its discovered models (`discovery.Inventory.models`)."""
    return {model_resource(m, backend): MODEL_AMOUNT for backend, names in by_backend(models).items() for m in names}


@dataclass
class NodeInfo:
    """One row of the node table: a machine as Ray knows it (its advertised resources, labels and
    models, live or dead), read by placement, the queue, the API and the CLI. The stage planner's
    measured view of a node (FLOP/s, free memory, link) is `models.stage_costs.NodeCapacity`."""

    node_id: str
    name: str
    address: str
    alive: bool
    role: str  # worker | coordinator | embedded | other
    cpus: float
    gpus: float
    ram_gb: float
    gpu_type: str | None
    models: list[str]  # what it can load as weights (hf and reference teachers, students, training)
    resources: dict[str, float] = field(default_factory=dict)
    available: dict[str, float] = field(default_factory=dict)
    labels: dict[str, str] = field(default_factory=dict)
    ollama_models: list[str] = field(default_factory=list)  # what its Ollama serves (ollama teachers)

    @property
    def takes_work(self) -> bool:
        return self.resources.get(WORKER_RESOURCE, 0) > 0

    def describe(self) -> str:
        gpu = f"{int(self.gpus)} GPUs" + (f" ({self.gpu_type})" if self.gpu_type and self.gpus else "")
        models = ", ".join(self.models[:8]) + (" …" if len(self.models) > 8 else "") if self.models else "none"
        ollama = f"; Ollama: {', '.join(self.ollama_models[:8])}" if self.ollama_models else ""
        return (f"{self.name} [{self.role}{'' if self.alive else ', dead'}]: {self.cpus:g} CPUs, "
                f"{self.ram_gb:.1f} GB RAM, {gpu}; models: {models}{ollama}")

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


@dataclass
class Requirements:
    """What a task needs from the node it runs on."""

    model: str | None = None
    min_ram_gb: float = 0.0
    cpus: float = 1.0
    gpu: GpuPolicy = "no"
    allowed_nodes: list[str] | None = None
    on_coordinator: bool = False  # lent coordinator: run on the head node without the worker resource
    # Reserved, not just present: Ray's `memory` resource is taken for the task's lifetime, so two
    # tasks that together ask more than a node has never share it (min_ram_gb alone only filters).
    reserve_ram_gb: float = 0.0
    gpus: float = 1.0  # GPUs per task when it gets any (gpu required, or preferred on a GPU node)
    gpu_memory_gb: float = 0.0  # each GPU of the node (its smolforge.io/gpu-mem-gb label) at least this
    gpu_ids: list[int] | None = None  # the node must have these GPU indices (Ray assigns which it gives)
    model_backend: str = "hf"  # how the task loads `model`: its weights (hf) or an Ollama tag (ollama)

    def __post_init__(self):
        if self.gpu not in ("required", "preferred", "no"):
            raise SmolforgeError(f"gpu must be required, preferred or no, not {self.gpu!r}",
                                 fix="use gpu='required', 'preferred' or 'no'")
        if min(self.cpus, self.min_ram_gb, self.reserve_ram_gb, self.gpus, self.gpu_memory_gb) < 0:
            raise SmolforgeError("cpus, RAM and GPU amounts must be >= 0", fix="use non-negative numbers")

    def per_task(self, gpu: bool) -> dict[str, float]:
        """The Ray resources one task of this takes from its node (CPU, GPU, memory, worker share)."""
        cpus, gpus, res = self._resources(gpu)
        out = {"CPU": cpus, **{k: v for k, v in res.items() if not k.startswith((MODEL_PREFIX, OLLAMA_PREFIX))}}
        if gpus:
            out["GPU"] = gpus
        return {k: v for k, v in out.items() if v > 0}

    # -- matching -------------------------------------------------------------------------------

    def reasons(self, node: NodeInfo, ignore_model: bool = False) -> list[str]:
        """Why `node` cannot run this (empty: it can)."""
        why = []
        if not node.alive:
            why.append("node is dead")
        if self.on_coordinator:
            if node.role not in ("coordinator", "embedded"):
                why.append("not the coordinator node")
        elif not node.takes_work:
            why.append("takes no training work (coordinator node; lend it with `smolforge job join`)")
        if self.allowed_nodes and node.name not in self.allowed_nodes:
            why.append(f"not in allowed nodes {self.allowed_nodes}")
        if self.model and not ignore_model and model_resource(self.model, self.model_backend) not in node.resources:
            why.append(f"does not hold model {self.model}{loader(self.model_backend).where}")
        if node.cpus < self.cpus:
            why.append(f"has {node.cpus:g} CPUs < {self.cpus:g}")
        if node.ram_gb + 1e-9 < self.min_ram_gb:
            why.append(f"has {node.ram_gb:.1f} GB RAM < {self.min_ram_gb:g} GB")
        if self.gpu == "required" and node.gpus < self.gpus:
            why.append("has no GPU" if node.gpus < 1 else f"has {node.gpus:g} GPUs < {self.gpus:g}")
        if self.reserve_ram_gb and node.resources.get("memory", 0.0) + 1e6 < self.reserve_ram_gb * 1e9:
            why.append(f"can reserve {node.resources.get('memory', 0.0) / 1e9:.1f} GB RAM < {self.reserve_ram_gb:g} GB")
        if self.gpu_memory_gb and node.gpus >= 1:
            have = float(node.labels.get(GPU_MEM_LABEL) or 0)
            if have + 1e-9 < self.gpu_memory_gb:
                why.append(f"has {have:g} GB per GPU < {self.gpu_memory_gb:g} GB" if have else
                           "does not advertise its GPU memory (smolforge.io/gpu-mem-gb)")
        if self.gpu_ids and node.gpus < max(self.gpu_ids) + 1:
            why.append(f"has no GPU {max(self.gpu_ids)} (it has {node.gpus:g})")
        return why

    def candidates(self, nodes: list[NodeInfo]) -> list[NodeInfo]:
        ok = [n for n in nodes if not self.reasons(n)]
        if self.gpu == "preferred" and any(n.gpus >= 1 for n in ok):
            ok = [n for n in ok if n.gpus >= 1]
        return ok

    def _wants_gpu(self, cands: list[NodeInfo]) -> bool:
        return self.gpu == "required" or (self.gpu == "preferred" and bool(cands) and all(n.gpus >= 1 for n in cands))

    def _resources(self, gpu: bool) -> tuple[float, float, dict[str, float]]:
        res: dict[str, float] = {}
        if not self.on_coordinator:
            res[WORKER_RESOURCE] = max(self.cpus, 0.001)
        if self.model:
            res[model_resource(self.model, self.model_backend)] = MODEL_REQUEST
        if self.reserve_ram_gb:
            res["memory"] = self.reserve_ram_gb * 1e9
        return self.cpus, (self.gpus if gpu else 0.0), res

    def _selector(self, nodes: list[NodeInfo], cands: list[NodeInfo]) -> dict[str, str] | None:
        if self.on_coordinator:
            return {ROLE_LABEL: "in(coordinator,embedded)"}
        # Resources already pick nodes by model, CPUs, GPU and worker role; a name selector is only
        # needed where the requirement names a subset that resources cannot express.
        if not (self.allowed_nodes or self.min_ram_gb > 0 or self.gpu_memory_gb or self.gpu_ids):
            return None
        named = [n.name for n in cands if n.labels.get(NAME_LABEL)]
        if not named:
            return None
        return {NAME_LABEL: f"in({','.join(sorted(set(named)))})"}

    def ray_options(self, nodes: list[NodeInfo] | None = None) -> dict[str, Any]:
        """`.options(**...)` for a task or actor; checks placeability first (fails fast)."""
        nodes = nodes if nodes is not None else globals()["nodes"]()
        cands = _check(self, nodes)
        cpus, gpus, res = self._resources(self._wants_gpu(cands))
        memory = res.pop("memory", 0.0)
        opts: dict[str, Any] = {"num_cpus": cpus, "num_gpus": gpus, "resources": res}
        if memory:
            opts["memory"] = memory
        selector = self._selector(nodes, cands)
        if selector:
            opts["label_selector"] = selector
        elif len(cands) == 1 and (self.allowed_nodes or self.min_ram_gb or self.on_coordinator or self.gpu_memory_gb
                                    or self.gpu_ids):
            from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

            opts["scheduling_strategy"] = NodeAffinitySchedulingStrategy(cands[0].node_id, soft=False)
        return opts

    def bundle(self, nodes: list[NodeInfo] | None = None) -> tuple[dict[str, float], dict[str, str]]:
        """A placement-group bundle ({"CPU":…, …}) and its label selector ({} for any node)."""
        nodes = nodes if nodes is not None else globals()["nodes"]()
        cands = _check(self, nodes)
        cpus, gpus, res = self._resources(self._wants_gpu(cands))
        b = {"CPU": cpus, **res}
        if gpus:
            b["GPU"] = gpus
        return b, (self._selector(nodes, cands) or {})

    def to_dict(self) -> dict[str, Any]:
        return asdict(self)


def _check(req: Requirements, nodes: list[NodeInfo]) -> list[NodeInfo]:
    cands = req.candidates(nodes)
    if cands:
        return cands
    alive = [n for n in nodes if n.alive]
    lines = [f"  - {n.describe()}: " + "; ".join(req.reasons(n)) for n in alive] or ["  (no live nodes)"]
    wanted = []
    if req.model:
        wanted.append(f"model {req.model}")
    wanted.append(f"{req.cpus:g} CPUs")
    if req.min_ram_gb or req.reserve_ram_gb:
        wanted.append(f">= {max(req.min_ram_gb, req.reserve_ram_gb):g} GB RAM")
    if req.gpu == "required":
        wanted.append("a GPU" if req.gpus <= 1 else f"{req.gpus:g} GPUs")
    if req.gpu_memory_gb:
        wanted.append(f">= {req.gpu_memory_gb:g} GB per GPU")
    if req.allowed_nodes:
        wanted.append(f"one of nodes {req.allowed_nodes}")
    if req.on_coordinator:
        wanted.append("the coordinator node")
    fix = "join a worker that has it (`smolforge worker join HOST:PORT --token-file F --models-dir DIR`)"
    if req.model:
        fix = (f"copy {req.model} into a worker's --models-dir (or its HF cache) and run `smolforge worker rescan` "
               "there (a job's model is then sent to the other workers it runs on: training, serving stages, "
               "export), pick a model "
               "some node holds (`smolforge nodes`), or set `require_model: false` in the job spec to let the "
               "ranks download it from the Hugging Face Hub")
        if req.model.startswith((".", "~", os.sep)):  # a path, not an HF id: read from the name alone, never
            # from whether it exists here (a refusal must not tell a client which paths the coordinator has)
            name = Path(req.model).expanduser().name
            fix = (f"{req.model} is a directory on this machine, and workers share no filesystem with it: copy it "
                   f"into each worker's --models-dir as {name}/, re-join them and pass --model {name} "
                   "(without a coordinator, the embedded cluster uses the directory in place)")
    raise SmolforgeError("no node can run this task (needs " + ", ".join(wanted) + "); nodes:\n" + "\n".join(lines),
                         where="placement", fix=fix)


# -- the node table --------------------------------------------------------------------------------

def _node_from_ray(raw: dict, available: dict[str, dict[str, float]]) -> NodeInfo:
    res = {k: float(v) for k, v in (raw.get("Resources") or {}).items()}
    labels = {k: str(v) for k, v in (raw.get("Labels") or {}).items()}
    node_id = raw["NodeID"]
    role = labels.get(ROLE_LABEL) or ("coordinator" if HEAD_RESOURCE in res else "other")
    if role == "other" and res.get(WORKER_RESOURCE):
        role = "worker"
    ram = float(labels.get(RAM_LABEL) or 0) or res.get("memory", 0.0) / 1e9
    models = sorted(k[len(MODEL_PREFIX):] for k in res if k.startswith(MODEL_PREFIX))
    ollama_models = sorted(k[len(OLLAMA_PREFIX):] for k in res if k.startswith(OLLAMA_PREFIX))
    return NodeInfo(
        node_id=node_id,
        name=labels.get(NAME_LABEL) or raw.get("NodeName") or node_id[:12],
        address=raw.get("NodeManagerAddress", ""),
        alive=bool(raw.get("Alive")),
        role=role,
        cpus=res.get("CPU", 0.0),
        gpus=res.get("GPU", 0.0),
        ram_gb=round(ram, 1),
        gpu_type=labels.get(GPU_TYPE_LABEL) or labels.get("ray.io/accelerator-type"),
        models=models,
        resources=res,
        available=available.get(node_id, {}),
        labels=labels,
        ollama_models=ollama_models,
    )


def nodes(include_dead: bool = False) -> list[NodeInfo]:
    """Every node Ray knows (live ones only unless asked), newest state."""
    import ray

    if not ray.is_initialized():
        connect()
    try:
        from ray._private.state import available_resources_per_node

        avail = available_resources_per_node()
    except Exception:
        avail = {}
    out = [_node_from_ray(n, avail) for n in ray.nodes()]
    # Ray keeps dead entries; a restarted node appears twice under one name: keep the live one.
    out.sort(key=lambda n: (not n.alive, n.name))
    if not include_dead:
        out = [n for n in out if n.alive]
    return out


def check_placeable(requirements: Requirements, node_list: list[NodeInfo] | None = None) -> list[NodeInfo]:
    """The nodes that can run `requirements`; SmolforgeError at once (listing every node) if none."""
    return _check(requirements, node_list if node_list is not None else nodes())


def head_node_id() -> str | None:
    for n in nodes():
        if n.role in ("coordinator", "embedded"):
            return n.node_id
    return None


# -- connecting ------------------------------------------------------------------------------------

@dataclass
class ClusterHandle:
    address: str | None
    embedded: bool
    namespace: str = NAMESPACE
    state_dir: Path | None = None

    def nodes(self, include_dead: bool = False) -> list[NodeInfo]:
        return nodes(include_dead)

    def check_placeable(self, requirements: Requirements) -> list[NodeInfo]:
        return check_placeable(requirements)

    def ray_options(self, requirements: Requirements) -> dict[str, Any]:
        return requirements.ray_options(self.nodes())

    def bundle(self, requirements: Requirements):
        return requirements.bundle(self.nodes())

    @property
    def head_node_id(self) -> str | None:
        return head_node_id()

    def shutdown(self) -> None:
        """Disconnect; an embedded cluster stops with it (a joined one keeps running)."""
        global _HANDLE
        import ray

        with _LOCK:
            if ray.is_initialized():
                ray.shutdown()
            _HANDLE = None


_HANDLE: ClusterHandle | None = None
_LOCK = threading.RLock()


def _resolve_address(address: str | None, sd: StateDir) -> str | None:
    if address:
        return address
    env = os.environ.get("SMOLFORGE_RAY_ADDRESS")
    if env:
        return env
    info = sd.read_coordinator()
    if info and info.get("ray_address"):
        host, _, port = str(info["ray_address"]).rpartition(":")
        if port.isdigit() and port_open(host or "127.0.0.1", int(port), timeout=0.5):
            return info["ray_address"]
    return None


def _token_file(sd: StateDir, create: bool, token: str | None = None) -> Path:
    if token:
        write_token(sd.node_token_path, token.strip())
        return sd.node_token_path
    for p in (sd.token_path, sd.node_token_path):
        if p.exists() and p.read_text().strip():
            return p
    env = os.environ.get("SMOLFORGE_TOKEN")
    if env:
        write_token(sd.node_token_path, env.strip())
        return sd.node_token_path
    if not create:
        raise SmolforgeError(f"no cluster token in {sd.root}",
                             fix="set SMOLFORGE_TOKEN to the token printed by `smolforge coordinator start`")
    load_or_create_token(sd.token_path)
    return sd.token_path


def embedded_resources(num_cpus: int, models: dict[str, str] | None = None) -> dict[str, float]:
    return {WORKER_RESOURCE: float(num_cpus), HEAD_RESOURCE: 1000.0, **advertised_models(models or {})}


def connect(address: str | None = None, *, state_dir: str | Path | None = None,
            num_cpus: int | None = None, object_store_mb: int | None = None, token: str | None = None) -> ClusterHandle:
    """Join the coordinator's Ray cluster, or start the embedded one (see the module docstring)."""
    global _HANDLE
    import ray

    with _LOCK:
        if ray.is_initialized():
            if _HANDLE is None:
                _HANDLE = ClusterHandle(address=address, embedded=False)
            return _HANDLE
        sd = StateDir.at(state_dir)
        addr = _resolve_address(address, sd)

        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        if addr:
            host, _, port = addr.rpartition(":")
            if not port.isdigit() or not port_open(host or "127.0.0.1", int(port), timeout=3):
                raise SmolforgeError(f"cannot reach the cluster's Ray port at {addr}",
                                     fix="start the coordinator (`smolforge coordinator start`) or check host/port")
            apply_ray_auth(_token_file(sd, create=False, token=token))
            if is_loopback(host or "127.0.0.1"):
                keep_loopback()  # a loopback head: this driver's node address must stay 127.0.0.1 too
            try:
                ray.init(address=addr, namespace=NAMESPACE, logging_level=logging.ERROR, log_to_driver=False)
            except Exception as err:  # Ray reports auth failures and timeouts as several types
                raise SmolforgeError(f"could not join the Ray cluster at {addr}: {type(err).__name__}: "
                                     f"{str(err).splitlines()[0] if str(err) else ''}",
                                     fix="check that the token matches the coordinator's") from err
            _HANDLE = ClusterHandle(address=addr, embedded=False, state_dir=sd.root)
            return _HANDLE
        apply_ray_auth(_token_file(sd, create=True))
        keep_loopback()
        for k, v in metrics_port_env().items():
            os.environ.setdefault(k, v)  # read by the Ray processes ray.init starts

        cpus = int(num_cpus or detect_cpus())
        models = with_aliases(scan_hf_cache())
        kwargs: dict[str, Any] = dict(
            address="local", num_cpus=cpus, resources=embedded_resources(cpus, models),
            labels={NAME_LABEL: default_node_name(), ROLE_LABEL: "embedded", RAM_LABEL: f"{detect_ram_gb():.1f}"},
            include_dashboard=False, namespace=NAMESPACE, logging_level=logging.ERROR, log_to_driver=False,
            _node_ip_address="127.0.0.1",  # nobody joins an embedded cluster: every listener on loopback
        )
        if object_store_mb:
            kwargs["object_store_memory"] = int(object_store_mb) * 2**20
        tmp = os.environ.get("RAY_TMPDIR")
        if tmp:
            kwargs["_temp_dir"] = tmp
        start_embedded(ray.init, kwargs)
        _HANDLE = ClusterHandle(address=None, embedded=True, state_dir=sd.root)
        return _HANDLE


class RayStartFailed(SmolforgeError):
    """The embedded Ray cluster did not start (ours, not the caller's: exit 1)."""

    exit_code = 1


def start_embedded(init: Any, kwargs: dict[str, Any]) -> None:
    """`ray.init(**kwargs)` for the embedded cluster; a start that fails (Ray gives its node a fixed 30 s
    to register with its GCS, which a loaded machine can miss, and raises a bare Exception) is one
    message naming Ray's logs: RayStartFailed, not a traceback."""
    try:
        init(**kwargs)
    except Exception as err:  # noqa: BLE001 (Ray raises Exception itself for a start-up timeout)
        first = str(err).splitlines()[0] if str(err) else ""
        logs = Path(kwargs.get("_temp_dir") or "/tmp/ray") / "session_latest" / "logs"
        raise RayStartFailed(f"the embedded Ray cluster did not start: {type(err).__name__}: {first}",
                             fix=f"run the command again (on a loaded machine Ray's start can time out); "
                                 f"Ray's own logs: {logs}") from None


def connected_handle() -> ClusterHandle | None:
    return _HANDLE


def describe_nodes(node_list: list[NodeInfo]) -> str:
    return json.dumps([n.to_dict() for n in node_list], indent=2)


# -- is a node still there? ------------------------------------------------------------------------

def _probe_fn() -> bool:
    return True


_PROBE: Any = None


NODE_VERDICT_S = 60.0  # how long a listed node has to answer a probe before it is called gone (stop 51)
PROBE_SLICE_S = 1.0  # between looks at Ray's node table while a probe waits


def probe_node(node_id: str, timeout: float = NODE_VERDICT_S) -> bool:
    """Does the node still run tasks? The one verdict every runner asks before it sets a node aside.

    A zero-CPU task pinned to the node answers once a worker process there runs it: at once where an idle
    one waits, but on a node whose only worker just died (the usual question: a task's worker was lost)
    a new process must start first — seconds, more on a loaded machine (7.4 s measured at load 15; a 4 s
    probe called such live nodes gone and their jobs waited for nodes that would never come: the stop 50
    CI failure). So a live node has `timeout` (NODE_VERDICT_S) to answer, while a dead one is called gone
    as soon as Ray's node table drops it (looked at every PROBE_SLICE_S) or the pinned task fails; a node
    Ray already does not list: at once. A caller that only *clears* a suspicion may pass a short timeout
    (a false "no" there only delays)."""
    global _PROBE
    import ray
    from ray.exceptions import RayError
    from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

    if node_id not in {n.node_id for n in nodes()}:
        return False
    if _PROBE is None:
        _PROBE = ray.remote(_probe_fn)
    ref = _PROBE.options(num_cpus=0, scheduling_strategy=NodeAffinitySchedulingStrategy(node_id, soft=False),
                         max_retries=0).remote()
    deadline = time.monotonic() + timeout
    try:
        while True:
            ready, _ = ray.wait([ref], timeout=max(0.0, min(PROBE_SLICE_S, deadline - time.monotonic())))
            if ready:
                return ray.get(ref, timeout=5) is True
            if time.monotonic() >= deadline or node_id not in {n.node_id for n in nodes()}:
                break
    except RayError:
        pass
    ray.cancel(ref, force=True)
    return False


# -- has an actor started? -------------------------------------------------------------------------

def actor_waits_for_cpus(actor: Any) -> bool | None:
    """Whether Ray still waits for resources to start `actor`: True while its creation is pending and no
    worker process has been leased to it (GCS's actor table: state PENDING_CREATION, pid 0 — measured on Ray
    2.60: an actor whose lease was granted shows its worker's pid and port while its process starts, one
    waiting for CPUs shows neither); False once it has a worker (Ray's resource table then shows its CPUs)
    or has ended; None when the table cannot say (it is Ray's private state API: a caller then waits as if
    it could not tell). One GCS call, no dashboard."""
    try:
        from ray._private import state as ray_state

        info = ray_state.actors(actor._actor_id.hex())
    except Exception:  # noqa: BLE001 - a private API: its absence only makes the caller wait longer
        return None
    if not isinstance(info, dict) or "State" not in info:
        return None
    return info["State"] in ("DEPENDENCIES_UNREADY", "PENDING_CREATION") and not info.get("Pid")
