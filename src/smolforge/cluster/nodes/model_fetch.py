"""Models that travel: one node's model directory copied to another in checksummed, resumable pieces.

There is no shared filesystem, so a worker chosen for a job whose model it lacks fetches the model
from a node that holds it (the coordinator's models dir or HF cache, another worker's models dir).

The protocol, in three parts:
- `model_manifest` (on the holder): every file of the model with its size, its sha256 and the sha256
  of each of its pieces (`piece_bytes` each, the last one shorter).
- `read_piece` (on the holder): the bytes of piece `index` of file `rel`.
- `PieceReceiver` (on the fetching node): checks each piece against the manifest before writing it at
  its offset in a partial directory (`<models>/.partial/<name>/files/`), records it in a journal beside it,
  and, once every piece is in and every file's sha256 matches, renames the directory into place
  (`<models>/<name>`), so the models dir holds a complete model or none. A fetch cut mid-way (its
  process killed, the link gone) leaves the partial directory and its journal: the next fetch checks
  the pieces the journal lists against the manifest and asks only for the missing ones. A piece whose
  digest does not match is refused, never written, and asked for again.

The transport is Ray (`ModelSource` on the holder, `ModelFetcher` on the fetching node): actors the
cluster already authenticates (the cluster token, Ray's TLS where on), between our own processes, and
a holder need not be the coordinator (the HTTP API runs only there). Only bytes, strings and numbers
cross; the runner (`cluster.workloads.model_transfer`) drives it and turns its progress into events.

Before anything is sent, `check_space` refuses a node whose disk cannot take the model (what is
still missing, plus a margin) with the reason.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import Any

from smolforge.errors import SmolforgeError
from smolforge.parallel.transfer import sha256_bytes, sha256_path
from smolforge.paths import atomic_write_json, fsync_dir, safe_join
from smolforge.train.faults import fault_setting, node_dir

PIECE_BYTES_ENV = "SMOLFORGE_MODEL_PIECE_BYTES"  # tests make pieces small, so a tiny model has many
PIECE_BYTES = 8 << 20
DISK_MARGIN_BYTES = 256 << 20  # what a fetch leaves free on the disk besides the model
MODELS_DIR_ENV = "SMOLFORGE_MODELS_DIR"  # set by `worker join` for its Ray node: where fetched models go
RESCAN_REQUEST_ENV = "SMOLFORGE_RESCAN_REQUEST"  # set by `worker join`: the file that asks it to rescan
PIECE_TRIES = 3  # a piece refused this many times in a row fails the fetch (the source itself is bad)

log = logging.getLogger(__name__)


def piece_bytes() -> int:
    """Bytes per piece ($SMOLFORGE_MODEL_PIECE_BYTES, else 8 MiB): small enough to resume cheaply."""
    try:
        return max(1, int(os.environ.get(PIECE_BYTES_ENV) or PIECE_BYTES))
    except ValueError:
        return PIECE_BYTES


def models_dir() -> Path:
    """Where this node keeps fetched models: its worker's models dir, else `<node dir>/models`."""
    env = os.environ.get(MODELS_DIR_ENV)
    return Path(env).expanduser() if env else node_dir() / "models"


def held_model_dir(name: str) -> str | None:
    """This node's own copy of model `name`: what `worker join` (or the coordinator) found under that
    name (SMOLFORGE_MODEL_PATHS, aliases followed), else a complete fetched copy in `models_dir()`."""
    try:
        table = json.loads(os.environ.get("SMOLFORGE_MODEL_PATHS") or "{}")
    except ValueError:
        table = {}
    where = table.get(name)
    if where and where.startswith("alias:"):
        where = table.get(where[len("alias:"):])
    if where and where != "ollama" and Path(where).is_dir():
        return where
    try:
        fetched = safe_join(models_dir(), name)
    except SmolforgeError:
        return None
    return str(fetched) if (fetched / "config.json").is_file() else None


STAGES_DIR = ".stages"  # <models>/.stages/<name>/<cut>/: a stage's own part, never scanned as a model


def stage_part_name(name: str, bounds: list[int], index: int | None) -> str:
    """Where (under the models dir) the part of `name` that stage `index` of the cut `bounds` loads is
    kept: three levels down, under a dot, so `discovery.scan_models_dir` never advertises a partial
    model as `model:<name>`. `index` None: the config part (config and tokenizer, no tensor), one per
    model whatever the cut."""
    if index is None:
        return f"{STAGES_DIR}/{_flat(name)}/config"
    return f"{STAGES_DIR}/{_flat(name)}/{'-'.join(str(b) for b in bounds)}.{index}"


def held_stage_dir(name: str, bounds: list[int], index: int | None) -> str | None:
    """What stage `index` loads on this node: the node's whole copy of `name`, else its part fetched
    for that stage (`stage_part_name`; `index` None: the config part), else None."""
    whole = held_model_dir(name)
    if whole is not None:
        return whole
    part = models_dir() / stage_part_name(name, bounds, index)
    return str(part) if (part / "config.json").is_file() else None


def model_files(root: Path) -> dict[str, Path]:
    """The files of a model directory by relative path (an HF snapshot's symlinks followed)."""
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file()
            and not p.name.startswith(".")}


def model_manifest(root: str | Path, size: int) -> dict[str, Any]:
    """{"piece_bytes", "bytes", "pieces", "files": {rel: {"bytes", "sha256", "pieces": [sha256, ...]}}}."""
    files: dict[str, dict] = {}
    for rel, path in model_files(Path(root)).items():
        whole, pieces, n = hashlib.sha256(), [], 0
        with open(path, "rb") as f:
            for data in iter(lambda: f.read(size), b""):
                whole.update(data)
                pieces.append(sha256_bytes(data))
                n += len(data)
        files[rel] = {"bytes": n, "sha256": whole.hexdigest(), "pieces": pieces or [sha256_bytes(b"")]}
    return {"piece_bytes": size, "files": files, "bytes": sum(f["bytes"] for f in files.values()),
            "pieces": sum(len(f["pieces"]) for f in files.values())}


def manifest_id(manifest: dict) -> str:
    """One digest for a whole manifest: a journal from another version of the model is not resumed."""
    return sha256_bytes(json.dumps(manifest, sort_keys=True).encode())


def read_piece(root: str | Path, rel: str, index: int, size: int) -> bytes:
    with open(safe_join(root, rel), "rb") as f:
        f.seek(index * size)
        return f.read(size)


def _flat(name: str) -> str:
    return name.replace("/", "--")


class PieceReceiver:
    """A model arriving in pieces into `<root>/.partial/<name>/files/`, journalled beside it."""

    def __init__(self, root: str | Path, name: str, manifest: dict):
        self.root, self.name, self.manifest = Path(root), name, manifest
        self.dest = safe_join(self.root, name)
        # two levels down, under a dot: never taken for a model by `discovery.scan_models_dir`
        self.partial = self.root / ".partial" / _flat(name) / "files"
        self.journal = self.root / ".partial" / _flat(name) / "journal.json"
        self.done: set[tuple[str, int]] = set()
        self.refused = 0  # pieces whose digest did not match: never written, asked for again
        self.resumed = 0  # pieces a cut fetch had already written (checked, not sent again)

    def complete(self) -> bool:
        """Does the destination already hold exactly this model (every file's sha256)?"""
        if not self.dest.is_dir():
            return False
        have = model_files(self.dest)
        files = self.manifest["files"]
        return set(have) == set(files) and all(sha256_path(have[r]) == f["sha256"] for r, f in files.items())

    def missing_bytes(self) -> int:
        size = self.manifest["piece_bytes"]
        return sum(min(size, f["bytes"] - i * size) for rel, f in self.manifest["files"].items()
                   for i in range(len(f["pieces"])) if (rel, i) not in self.done)

    def open(self) -> None:
        """Take over what a cut fetch of this manifest left (its journalled pieces that still check out);
        anything else there (another version, no journal) goes."""
        try:
            journal = json.loads(self.journal.read_text())
        except (OSError, ValueError):
            journal = {}
        if journal.get("manifest") != manifest_id(self.manifest) or not self.partial.is_dir():
            shutil.rmtree(self.partial, ignore_errors=True)
            journal = {}
        size = self.manifest["piece_bytes"]
        for rel, index in journal.get("done", []):
            meta = self.manifest["files"].get(rel)
            if meta is None or index >= len(meta["pieces"]):
                continue
            try:
                if sha256_bytes(read_piece(self.partial, rel, index, size)) == meta["pieces"][index]:
                    self.done.add((rel, index))
            except OSError:
                continue
        self.resumed = len(self.done)
        self.partial.mkdir(parents=True, exist_ok=True)
        for rel, meta in self.manifest["files"].items():
            path = safe_join(self.partial, rel)
            path.parent.mkdir(parents=True, exist_ok=True)
            with open(path, "ab") as f:
                f.truncate(meta["bytes"])
        self._save()

    def wanted(self) -> list[tuple[str, int]]:
        return [(rel, i) for rel, f in self.manifest["files"].items() for i in range(len(f["pieces"]))
                if (rel, i) not in self.done]

    def write(self, rel: str, index: int, data: bytes) -> bool:
        """Write one piece if its digest matches the manifest; False (refused, nothing written) if not."""
        want = self.manifest["files"][rel]["pieces"][index]
        if not isinstance(data, (bytes, bytearray)) or sha256_bytes(bytes(data)) != want:
            self.refused += 1
            return False
        fd = os.open(safe_join(self.partial, rel), os.O_WRONLY)
        try:
            os.pwrite(fd, data, index * self.manifest["piece_bytes"])
            os.fsync(fd)
        finally:
            os.close(fd)
        self.done.add((rel, index))
        self._save()
        return True

    def _save(self) -> None:
        atomic_write_json(self.journal, {"manifest": manifest_id(self.manifest), "name": self.name,
                                         "done": sorted(self.done)})

    def commit(self) -> None:
        """Every file's sha256 checked, then the directory renamed into place, the journal removed."""
        for rel, meta in self.manifest["files"].items():
            if sha256_path(safe_join(self.partial, rel)) != meta["sha256"]:
                self.done = {d for d in self.done if d[0] != rel}
                self._save()
                raise SmolforgeError(f"model {self.name}: {rel} failed its checksum after every piece matched",
                                     where=str(self.partial), fix="run the job again: the file is fetched anew")
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        if self.dest.exists():  # an older or damaged copy under this name: the complete one replaces it
            shutil.rmtree(self.dest)
        os.rename(self.partial, self.dest)
        fsync_dir(self.dest.parent)
        shutil.rmtree(self.journal.parent, ignore_errors=True)


def space_refusal(root: Path, need: int, margin: int = DISK_MARGIN_BYTES) -> str | None:
    """Why `root`'s disk cannot take `need` more bytes (plus the margin), or None when it can."""
    probe = root
    while not probe.exists() and probe != probe.parent:
        probe = probe.parent
    free = shutil.disk_usage(probe).free
    if free >= need + margin:
        return None
    return (f"{free / 1e9:.2f} GB free in {root}, the model needs {need / 1e9:.2f} GB "
            f"(+ {margin / 1e9:.2f} GB kept free)")


def _one_shot_fault(name: str) -> str:
    """A test's fault for this node (train.faults), removed as it fires so a retry runs clean."""
    value = fault_setting(name)
    if value:
        (node_dir() / f"fault-{name}").unlink(missing_ok=True)
    return value


class ModelSource:
    """Ray actor on the holder: the manifest and the pieces of one model it holds, or of the part of it
    one stage loads (`stage`: (bounds, index); written once per cut under this node's dir; index None:
    the config part)."""

    def __init__(self, name: str, size: int, stage: tuple[list[int], int | None] | None = None):
        self.name, self.size = name, size
        where = held_model_dir(name)
        if where is None:
            raise SmolforgeError(f"this node does not hold model {name}", fix="pick a node that advertises it")
        self.root = Path(where)
        if stage is not None:
            from smolforge.models.stage_load import write_stage_part

            part = node_dir() / "model-parts" / stage_part_name(name, *stage)
            if not (part / "config.json").is_file():  # a part is written whole, then renamed
                tmp = part.with_name(part.name + f".tmp{os.getpid()}")
                shutil.rmtree(tmp, ignore_errors=True)
                write_stage_part(self.root, stage[0], stage[1], tmp)
                shutil.rmtree(part, ignore_errors=True)
                os.rename(tmp, part)
            self.root = part
        self._manifest: dict | None = None
        self.served = 0
        corrupt = _one_shot_fault("fetch-corrupt-piece")  # tests: this piece number goes out damaged once
        self.corrupt_at = int(corrupt) if corrupt.isdigit() else None

    def manifest(self) -> dict:
        if self._manifest is None:
            self._manifest = model_manifest(self.root, self.size)
        return self._manifest

    def piece(self, rel: str, index: int) -> bytes:
        data = read_piece(self.root, rel, index, self.size)
        self.served += 1
        if self.corrupt_at is not None and self.served == self.corrupt_at and data:
            self.corrupt_at = None
            data = bytes([data[0] ^ 0xFF]) + data[1:]
        return data

    def stats(self) -> dict:
        return {"served": self.served}


class ModelFetcher:
    """Ray actor on the fetching node: checks its disk, then pulls the pieces it lacks from a source."""

    def __init__(self, name: str, manifest: dict, dest: str | None = None, rescan: bool = True):
        # dest: where under the models dir it goes (a stage's part: `stage_part_name`), else `name`;
        # rescan False: a part is no model to advertise, so the worker is not asked to read its models
        self.receiver = PieceReceiver(models_dir(), dest or name, manifest)
        self.rescan = rescan
        self.progress_ = {"pieces": 0, "bytes": 0, "refused": 0, "resumed": 0, "state": "new",
                          "pieces_total": manifest["pieces"], "bytes_total": manifest["bytes"]}
        self._lock = threading.Lock()

    def prepare(self) -> dict:
        """{"cache_hit": True} when the model is here already; else {"refused": reason} when the disk
        cannot take what is missing; else {"resumed": pieces a cut fetch left, "missing_bytes"}."""
        r = self.receiver
        r.root.mkdir(parents=True, exist_ok=True)
        if r.complete():
            return {"cache_hit": True}
        r.open()
        why = space_refusal(r.root, r.missing_bytes())
        if why:
            return {"refused": why}
        self._set(resumed=r.resumed, state="ready")
        return {"resumed": r.resumed, "missing_bytes": r.missing_bytes()}

    def fetch(self, source: Any) -> dict:
        """Every missing piece from `source` (a ModelSource handle), then the model put in place and
        this node's worker asked to rescan its models. Returns the final progress."""
        import ray

        r = self.receiver
        exit_after = _one_shot_fault("fetch-exit-after")  # tests: this process dies after N pieces
        for rel, index in r.wanted():
            for _ in range(PIECE_TRIES):
                data = ray.get(source.piece.remote(rel, index))
                if r.write(rel, index, data):
                    break
                self._set(refused=r.refused)
            else:
                raise SmolforgeError(f"model {r.name}: piece {index} of {rel} failed its checksum {PIECE_TRIES} times",
                                     fix="check the holder's copy of the model")
            with self._lock:
                self.progress_["pieces"] += 1
                self.progress_["bytes"] += len(data)
            if exit_after.isdigit() and self.progress_["pieces"] >= int(exit_after):
                os._exit(1)  # a killed transfer, as a test asked: the next fetch resumes from the journal
        r.commit()
        if self.rescan:
            ask_rescan_here()
        self._set(state="done")
        return self.progress()

    def _set(self, **kw: Any) -> None:
        with self._lock:
            self.progress_.update(kw)

    def progress(self) -> dict:
        with self._lock:
            return dict(self.progress_)


def ask_rescan_here() -> None:
    """Ask this node's worker to read its models again, so it advertises the new one (once idle); also
    run as a Ray task on a node by `workloads.model_transfer.ask_rescan`."""
    request = os.environ.get(RESCAN_REQUEST_ENV)
    if request:
        try:
            Path(request).write_text(f"{time.time()}\n")
        except OSError as err:  # the next timed rescan finds it anyway
            log.info("could not ask for a rescan: %s", err)
