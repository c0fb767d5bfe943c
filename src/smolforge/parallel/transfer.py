"""Directories as checksummed payloads: how checkpoints and adapters move without shared storage.

A payload is a plain dict `{"files": {relpath: bytes}, "sha256": {relpath: hexdigest}}`: only bytes
and strings, so it crosses the Ray object store as data. `unpack_dir` verifies every digest, refuses
paths that escape the target, and swaps the directory in atomically, so a reader never sees a half
written checkpoint.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path

from smolforge.errors import SmolforgeError
from smolforge.paths import atomic_replace_dir, safe_join


def sha256_bytes(data: bytes) -> str:
    return hashlib.sha256(data).hexdigest()


def pack_dir(path: str | Path) -> dict:
    root = Path(path)
    if not root.is_dir():
        raise SmolforgeError(f"{root} is not a directory", fix="pass the checkpoint or adapter directory")
    files: dict[str, bytes] = {}
    for p in sorted(root.rglob("*")):
        if p.is_file() and not p.is_symlink():
            files[p.relative_to(root).as_posix()] = p.read_bytes()
    return {"files": files, "sha256": {k: sha256_bytes(v) for k, v in files.items()}}


def verify_payload(payload: dict) -> None:
    files, sums = payload.get("files") or {}, payload.get("sha256") or {}
    if set(files) != set(sums):
        raise SmolforgeError("artifact payload lists files without checksums (or the reverse)",
                             fix="re-send the artifact; it was built incorrectly")
    for name, data in files.items():
        if not isinstance(data, (bytes, bytearray)) or sha256_bytes(bytes(data)) != sums[name]:
            raise SmolforgeError(f"artifact file {name} failed its checksum",
                                 fix="the transfer was corrupted; retry the task")


def holds_exactly(dest: str | Path, sums: dict[str, str]) -> bool:
    """Does `dest` hold these files (by sha256) and nothing else?"""
    dest = Path(dest)
    have = {p.relative_to(dest).as_posix() for p in dest.rglob("*") if p.is_file()}
    return have == set(sums) and all(sha256_bytes((dest / rel).read_bytes()) == sums[rel] for rel in sums)


def check_download_dest(dest: str | Path, sums: dict[str, str], overwrite: bool = False) -> bool:
    """Before a download into `dest`: True when it already holds exactly this artifact (nothing to
    do); False when it is free (or `overwrite`); a SmolforgeError when it holds other files, which a
    download would otherwise replace."""
    dest = Path(dest)
    if not dest.exists() or (dest.is_dir() and not any(dest.iterdir())):
        return False
    if dest.is_dir() and holds_exactly(dest, sums):
        return True
    if overwrite:
        return False
    raise SmolforgeError("the download's destination already holds other files", where=str(dest),
                         fix="download into another directory, or move those files away first")


def unpack_dir(payload: dict, dest: str | Path) -> Path:
    """Verify, write into a temp dir next to `dest`, then swap it into place."""
    verify_payload(payload)
    dest = Path(dest)
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(dir=dest.parent, prefix=f".{dest.name}."))
    try:
        for rel, data in payload["files"].items():
            target = safe_join(tmp, rel)
            target.parent.mkdir(parents=True, exist_ok=True)
            target.write_bytes(bytes(data))
        atomic_replace_dir(tmp, dest)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return dest
