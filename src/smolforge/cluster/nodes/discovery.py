"""What this machine offers the cluster: CPUs, RAM, GPUs and the models it holds.

Models are found where users keep them: the Hugging Face cache (`models--org--name` folders with a
snapshot), a `--models-dir` (any folder with a `config.json`, one or two levels deep) and, when
Ollama is installed, `ollama list`. Each becomes a Ray custom resource so placement can send a task
to a node that can load it: `model:<name>` for weights, `ollama:<name>` for what Ollama serves
(`by_backend`). HF ids also advertise their Ollama aliases and Ollama models their HF ids, so either
spelling of a requirement matches, but only for the backend the node can load it with: a node with
only the Ollama tag never takes a task that needs the weights (it would download them from the hub).
"""

from __future__ import annotations

import os
import re
import shutil
import socket
import subprocess
from dataclasses import dataclass, field
from pathlib import Path

from smolforge.errors import SmolforgeError

NAME_RE = re.compile(r"^[a-zA-Z0-9]([a-zA-Z0-9_.-]{0,61}[a-zA-Z0-9])?$")


@dataclass
class GpuInfo:
    index: int
    name: str
    memory_gb: float


@dataclass
class Inventory:
    name: str
    cpus: int
    ram_gb: float
    gpus: list[GpuInfo] = field(default_factory=list)
    models: dict[str, str] = field(default_factory=dict)  # name -> where (local dir or "ollama")

    def summary(self) -> str:
        return (f"{self.cpus} CPUs, {self.ram_gb:.1f} GB RAM, {len(self.gpus)} GPUs; "
                f"{len(self.model_names())} models")

    def model_names(self) -> list[str]:
        """Distinct models, not counting the alias spellings."""
        return sorted({n for n, where in self.models.items() if not where.startswith("alias:")})


def default_node_name() -> str:
    host = socket.gethostname().split(".")[0] or "node"
    clean = re.sub(r"[^a-zA-Z0-9_.-]", "-", host).strip("-_.")[:63]
    return clean or "node"


def check_node_name(name: str) -> str:
    if not NAME_RE.match(name):
        raise SmolforgeError(f"node name {name!r} is not usable as a label",
                             fix="use letters, digits, '-', '_' or '.', at most 63 characters, "
                                 "starting and ending with a letter or digit")
    return name


def detect_cpus() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def detect_ram_gb() -> float:
    import psutil

    return psutil.virtual_memory().total / 1e9


def detect_gpus() -> list[GpuInfo]:
    """GPUs via nvidia-ml-py (a dependency); none when the NVIDIA driver is missing."""
    import pynvml

    try:
        pynvml.nvmlInit()
    except pynvml.NVMLError:
        return []
    try:
        out = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            name = pynvml.nvmlDeviceGetName(h)
            name = name.decode() if isinstance(name, bytes) else str(name)
            mem = pynvml.nvmlDeviceGetMemoryInfo(h).total / 1e9
            out.append(GpuInfo(i, name, round(mem, 1)))
        return out
    except pynvml.NVMLError:
        return []  # a GPU that fell off the bus mid-query: report none rather than fail the join
    finally:
        pynvml.nvmlShutdown()


def hf_cache_dir() -> Path:
    if os.environ.get("HF_HUB_CACHE"):
        return Path(os.environ["HF_HUB_CACHE"]).expanduser()
    if os.environ.get("HF_HOME"):
        return Path(os.environ["HF_HOME"]).expanduser() / "hub"
    return Path.home() / ".cache" / "huggingface" / "hub"


def scan_hf_cache(cache: Path | None = None) -> dict[str, str]:
    """`models--org--name` folders that hold at least one snapshot with a config.json."""
    cache = cache or hf_cache_dir()
    found: dict[str, str] = {}
    if not cache.is_dir():
        return found
    for entry in sorted(cache.iterdir()):
        if not entry.name.startswith("models--") or not entry.is_dir():
            continue
        snaps = entry / "snapshots"
        best = None
        if snaps.is_dir():
            for snap in sorted(snaps.iterdir()):
                if (snap / "config.json").exists():
                    best = snap
        if best is not None:
            name = entry.name[len("models--"):].replace("--", "/")
            found[name] = str(best)
    return found


def check_models_dir(path: str | None, flag: str = "--models-dir") -> None:
    """A `--models-dir` a user named must be a folder that exists: a typo used to join a node that holds
    no models, without a word. SmolforgeError (exit 2) before anything starts."""
    if path is None:
        return
    root = Path(path).expanduser()
    if not root.is_dir():
        what = "does not exist" if not root.exists() else "is not a folder"
        raise SmolforgeError(f"{flag} {path} {what}", where=flag,
                             fix="give the folder that holds your models (each in a folder with its config.json), "
                                 "or leave the flag out")


def scan_models_dir(root: Path | None) -> dict[str, str]:
    """Folders with a config.json: `root/name` or `root/org/name` (named `org/name`)."""
    found: dict[str, str] = {}
    if root is None:
        return found
    root = Path(root).expanduser()
    if not root.is_dir():
        return found
    for entry in sorted(root.iterdir()):
        if not entry.is_dir():
            continue
        if (entry / "config.json").exists():
            found[entry.name] = str(entry.resolve())
            continue
        for sub in sorted(entry.iterdir()):
            if sub.is_dir() and (sub / "config.json").exists():
                found[f"{entry.name}/{sub.name}"] = str(sub.resolve())
    return found


def scan_ollama(timeout: float = 5.0) -> list[str]:
    """Names from `ollama list` when Ollama is installed and answering; otherwise none."""
    exe = shutil.which("ollama")
    if not exe:
        return []
    try:
        out = subprocess.run([exe, "list"], capture_output=True, text=True, timeout=timeout)
    except (OSError, subprocess.TimeoutExpired):
        return []
    if out.returncode != 0:
        return []
    return parse_ollama_list(out.stdout)


def parse_ollama_list(text: str) -> list[str]:
    names = []
    for line in text.splitlines()[1:]:
        parts = line.split()
        if parts:
            name = parts[0]
            names.append(name[: -len(":latest")] if name.endswith(":latest") else name)
    return names


def with_aliases(models: dict[str, str]) -> dict[str, str]:
    """Add the other spelling of each model (Ollama name <-> HF id) so either requirement matches."""
    from smolforge.models.registry import OLLAMA_TO_HF

    out = dict(models)
    hf_to_ollama: dict[str, list[str]] = {}
    for oll, hf in OLLAMA_TO_HF.items():
        hf_to_ollama.setdefault(hf.lower(), []).append(oll)
    for name in list(models):
        for oll in hf_to_ollama.get(name.lower(), []):
            out.setdefault(oll, f"alias:{name}")
        hf = OLLAMA_TO_HF.get(name.lower())
        if hf:
            out.setdefault(hf, f"alias:{name}")
    return out


def by_backend(models: dict[str, str]) -> dict[str, list[str]]:
    """`{"hf": [...], "ollama": [...]}`: the names (aliases included) a node can load as weights and
    the ones its Ollama serves, from `Inventory.models` (name -> a directory, "ollama" or "alias:<name>")."""
    def backend(where: str, hops: int = 0) -> str:
        if where.startswith("alias:") and hops < 4:
            return backend(models.get(where[len("alias:"):], ""), hops + 1)
        return "ollama" if where == "ollama" else "hf"

    out: dict[str, list[str]] = {"hf": [], "ollama": []}
    for name, where in sorted(models.items()):
        out[backend(where)].append(name)
    return out


def discover(name: str | None = None, *, models_dir: str | Path | None = None, cpus: int | None = None,
             gpus: int | None = None, memory_gb: float | None = None, scan_cache: bool = True,
             use_ollama: bool = True) -> Inventory:
    """This machine as the cluster should see it; explicit flags override what is detected."""
    gpu_list = detect_gpus()
    if gpus is not None:
        gpu_list = gpu_list[:gpus] if gpus <= len(gpu_list) else gpu_list + [
            GpuInfo(i, "unknown", 0.0) for i in range(len(gpu_list), gpus)]
    return Inventory(
        name=check_node_name(name or default_node_name()),
        cpus=int(cpus) if cpus is not None else detect_cpus(),
        ram_gb=float(memory_gb) if memory_gb is not None else round(detect_ram_gb(), 1),
        gpus=gpu_list,
        models=discover_models(models_dir, scan_cache=scan_cache, use_ollama=use_ollama),
    )


def discover_models(models_dir: str | Path | None = None, *, scan_cache: bool = True,
                    use_ollama: bool = True) -> dict[str, str]:
    """The models part of `discover` alone (name -> where, aliases included): what a running worker
    reads again on every rescan, without asking the GPUs or RAM again."""
    models: dict[str, str] = {}
    if scan_cache:
        models.update(scan_hf_cache())
    models.update(scan_models_dir(Path(models_dir) if models_dir else None))
    if use_ollama:
        for n in scan_ollama():
            models.setdefault(n, "ollama")
    return with_aliases(models)


def model_changes(old: dict[str, str], new: dict[str, str]) -> tuple[list[str], list[str]]:
    """(found, gone): distinct model names (not alias spellings) that a rescan added or lost. A model
    that moved (same name, another directory) counts as found, since its path must be advertised anew."""
    def distinct(models: dict[str, str]) -> dict[str, str]:
        return {n: where for n, where in models.items() if not where.startswith("alias:")}

    before, after = distinct(old), distinct(new)
    found = sorted(n for n, where in after.items() if before.get(n) != where)
    gone = sorted(n for n in before if n not in after)
    return found, gone
