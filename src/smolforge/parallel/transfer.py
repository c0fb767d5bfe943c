"""Directories as checksummed payloads: how checkpoints and adapters move without shared storage.

A payload is a plain dict `{"files": {relpath: bytes}, "sha256": {relpath: hexdigest}}`: only bytes
and strings, so it crosses the Ray object store as data. `unpack_dir` verifies every digest, refuses
paths that escape the target, and swaps the directory in atomically, so a reader never sees a half
written checkpoint.

Large directories move in pieces instead (`send_dir` -> `DirReceiver`): a payload holds the whole
directory in memory, and a 100M-parameter full fine-tune's checkpoint is 1.3 GB, which the sender
held two or three times over (the bytes, Ray's serialised copy). Pieces are (relpath, offset, bytes)
of at most `CHUNK_BYTES`; the receiver writes them into a temp dir, hashes as they come, and swaps
the directory in only when every digest matches, with the same guarantees as `unpack_dir`.
"""

from __future__ import annotations

import hashlib
import shutil
import tempfile
from pathlib import Path
from typing import Callable, Iterator

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


CHUNK_BYTES = 32 << 20  # one piece per call: large enough to keep a link busy, small against memory


def sha256_path(path: str | Path, chunk_bytes: int = CHUNK_BYTES) -> str:
    """A file's sha256, read in pieces (never the whole file in memory)."""
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for data in iter(lambda: f.read(chunk_bytes), b""):
            h.update(data)
    return h.hexdigest()


def dir_files(path: str | Path) -> dict[str, Path]:
    """The regular files under `path` by relative path, sorted (what a payload of it would hold)."""
    root = Path(path)
    if not root.is_dir():
        raise SmolforgeError(f"{root} is not a directory", fix="pass the checkpoint or adapter directory")
    return {p.relative_to(root).as_posix(): p for p in sorted(root.rglob("*")) if p.is_file() and not p.is_symlink()}


def file_pieces(path: Path, chunk_bytes: int = CHUNK_BYTES, offset: int = 0,
                size: int | None = None) -> Iterator[tuple[int, bytes]]:
    """(offset, bytes) pieces of a file from `offset` (`size` bytes, or to its end); an empty file is one
    empty piece, so that it arrives too."""
    left = size
    with open(path, "rb") as f:
        f.seek(offset)
        while True:
            data = f.read(chunk_bytes if left is None else min(chunk_bytes, left))
            if data or offset == 0:
                yield offset, data
            offset += len(data)
            if left is not None:
                left -= len(data)
            if len(data) < chunk_bytes or left == 0:
                return


def send_dir(path: str | Path, put: Callable[[str, int, bytes], None], chunk_bytes: int = CHUNK_BYTES) -> dict[str, str]:
    """Hand every file under `path` to `put(relpath, offset, bytes)` in pieces, in order; returns the
    sha256 of each file (computed as it is read: what the receiver checks before it commits)."""
    sums: dict[str, str] = {}
    for rel, p in dir_files(path).items():
        h = hashlib.sha256()
        for offset, data in file_pieces(p, chunk_bytes):
            h.update(data)
            put(rel, offset, data)
        sums[rel] = h.hexdigest()
    return sums


class DirReceiver:
    """A directory built from `send_dir`'s pieces in a temp dir next to `dest`; `commit` checks every
    digest and swaps it into place atomically, `abort` (or a failed commit) leaves `dest` as it was."""

    def __init__(self, dest: str | Path):
        self.dest = Path(dest)
        self.dest.parent.mkdir(parents=True, exist_ok=True)
        self.tmp = Path(tempfile.mkdtemp(dir=self.dest.parent, prefix=f".{self.dest.name}."))
        self._hash: dict = {}  # relpath -> its running sha256
        self._size: dict[str, int] = {}

    def write(self, rel: str, offset: int, data: bytes) -> None:
        if not isinstance(data, (bytes, bytearray)):
            raise SmolforgeError(f"artifact file {rel}: a piece that is not bytes", fix="re-send the artifact")
        target = safe_join(self.tmp, rel)
        if offset != self._size.get(rel, 0):
            raise SmolforgeError(f"artifact file {rel}: a piece at byte {offset}, expected {self._size.get(rel, 0)}",
                                 fix="re-send the artifact (pieces of a file arrive in order)")
        target.parent.mkdir(parents=True, exist_ok=True)
        with open(target, "ab") as f:
            f.write(data)
        self._hash.setdefault(rel, hashlib.sha256()).update(data)
        self._size[rel] = offset + len(data)

    def commit(self, sums: dict[str, str]) -> int:
        """Verify, swap in; the bytes received. On a mismatch nothing changes at `dest`."""
        try:
            if set(sums) != set(self._hash):
                raise SmolforgeError("artifact payload lists files without checksums (or the reverse)",
                                     fix="re-send the artifact; it was built incorrectly")
            for rel, h in self._hash.items():
                if h.hexdigest() != sums[rel]:
                    raise SmolforgeError(f"artifact file {rel} failed its checksum",
                                         fix="the transfer was corrupted; retry the task")
            atomic_replace_dir(self.tmp, self.dest)
            return sum(self._size.values())
        finally:
            self.abort()

    def abort(self) -> None:
        if self.tmp.exists():
            shutil.rmtree(self.tmp, ignore_errors=True)
