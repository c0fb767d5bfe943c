"""The coordinator's artifact store: checksummed directories that jobs produce and consume.

Layout: `<state>/artifacts/<job_id>/<kind>/<name>/` plus `<name>.artifact.json` beside it (the
sha256 of every file and when it was stored). Kinds used by data-parallel jobs: `checkpoints`
(`step-<N>`), `adapter` (`<method>_adapter`), `dataset` (uploaded JSONL files, content-addressed
under `uploads/`). Writes go to a temp dir first and are renamed into place, so an artifact is
either complete and verified or absent.
"""

from __future__ import annotations

import hashlib
import json
import re
import shutil
import time
from pathlib import Path

from smolforge.errors import SmolforgeError
from smolforge.parallel.transfer import (
    DirReceiver,
    dir_files,
    file_pieces,
    pack_dir,
    sha256_path,
    unpack_dir,
    verify_payload,
)
from smolforge.paths import atomic_write_bytes, atomic_write_json, private_dir, safe_join

SAFE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.:-]{0,127}$")
UPLOAD_REF = re.compile(r"upload:([0-9a-f]{64})")
UPLOAD_GRACE_S = 3600.0  # an upload this young may belong to a job whose submit is on its way


def upload_refs(spec: object) -> set[str]:
    """Every `upload:<sha256>` a job spec names, at any depth."""
    return set(UPLOAD_REF.findall(json.dumps(spec)))


def _check(part: str, what: str) -> str:
    if not SAFE.match(part or ""):
        raise SmolforgeError(f"bad artifact {what} {part!r}", fix="use letters, digits, '-', '_', '.' only")
    return part


def _step(name: str) -> int:
    try:
        return int(name.split("-", 1)[1])
    except (IndexError, ValueError):
        return -1


class ArtifactStore:
    def __init__(self, root: str | Path):
        self.root = private_dir(root)  # checkpoints, adapters, uploads: the owner's only

    def path(self, job_id: str, kind: str, name: str) -> Path:
        return self.root / _check(job_id, "job") / _check(kind, "kind") / _check(name, "name")

    def _meta_path(self, job_id: str, kind: str, name: str) -> Path:
        p = self.path(job_id, kind, name)
        return p.with_name(p.name + ".artifact.json")

    def put(self, job_id: str, kind: str, name: str, payload: dict, keep_last: int | None = None) -> dict:
        """Store a payload (see parallel.transfer) after checking every checksum."""
        verify_payload(payload)
        dest = self.path(job_id, kind, name)
        unpack_dir(payload, dest)
        return self._record(job_id, kind, name, dict(payload["sha256"]),
                            sum(len(v) for v in payload["files"].values()), keep_last)

    def begin(self, job_id: str, kind: str, name: str) -> DirReceiver:
        """An artifact arriving in pieces (parallel.transfer.send_dir): write them into the receiver,
        then `commit`. What an earlier, interrupted transfer of this name left behind goes first."""
        dest = self.path(job_id, kind, name)
        if dest.parent.is_dir():
            for stale in dest.parent.glob(f".{name}.*"):
                shutil.rmtree(stale, ignore_errors=True)
        return DirReceiver(dest)

    def commit(self, job_id: str, kind: str, name: str, receiver: DirReceiver, sums: dict[str, str],
               keep_last: int | None = None) -> dict:
        """Check every digest, swap the artifact in, record it (as `put` does)."""
        nbytes = receiver.commit(sums)
        return self._record(job_id, kind, name, dict(sums), nbytes, keep_last)

    def _record(self, job_id: str, kind: str, name: str, sums: dict[str, str], nbytes: int,
                keep_last: int | None) -> dict:
        meta = {"job_id": job_id, "kind": kind, "name": name, "stored": time.time(), "sha256": sums,
                "bytes": nbytes}
        atomic_write_json(self._meta_path(job_id, kind, name), meta)
        if keep_last:
            for old in self.list(job_id, kind)[:-keep_last]:
                self.delete(job_id, kind, old)
        return meta

    def put_dir(self, job_id: str, kind: str, name: str, src: str | Path) -> dict:
        return self.put(job_id, kind, name, pack_dir(src))

    def verify(self, job_id: str, kind: str, name: str) -> bool:
        p, mp = self.path(job_id, kind, name), self._meta_path(job_id, kind, name)
        try:
            meta = json.loads(mp.read_text())
            for rel, digest in meta["sha256"].items():
                if sha256_path(safe_join(p, rel)) != digest:
                    return False
            return True
        except (OSError, ValueError, KeyError, SmolforgeError):
            return False

    def get(self, job_id: str, kind: str, name: str) -> dict:
        """The payload of a stored artifact, verified."""
        if not self.verify(job_id, kind, name):
            raise SmolforgeError(f"artifact {job_id}/{kind}/{name} is missing or corrupt",
                                 fix="re-run the task that produces it")
        payload = pack_dir(self.path(job_id, kind, name))
        meta = json.loads(self._meta_path(job_id, kind, name).read_text())
        if payload["sha256"] != meta["sha256"]:
            raise SmolforgeError(f"artifact {job_id}/{kind}/{name} changed on disk", fix="re-run the task")
        return payload

    def manifest(self, job_id: str, kind: str, name: str) -> dict[str, dict]:
        """A stored artifact's files, verified: {relpath: {"sha256", "bytes"}} (to fetch it in pieces)."""
        if not self.verify(job_id, kind, name):
            raise SmolforgeError(f"artifact {job_id}/{kind}/{name} is missing or corrupt",
                                 fix="re-run the task that produces it")
        sums = json.loads(self._meta_path(job_id, kind, name).read_text())["sha256"]
        files = dir_files(self.path(job_id, kind, name))
        if set(files) != set(sums):
            raise SmolforgeError(f"artifact {job_id}/{kind}/{name} changed on disk", fix="re-run the task")
        return {rel: {"sha256": sums[rel], "bytes": files[rel].stat().st_size} for rel in sums}

    def piece(self, job_id: str, kind: str, name: str, rel: str, offset: int, size: int) -> bytes:
        """`size` bytes of one file of an artifact from `offset` (the receiver checks the whole file's digest)."""
        path = safe_join(self.path(job_id, kind, name), rel)
        return b"".join(data for _, data in file_pieces(path, size, offset=offset, size=size))

    def list(self, job_id: str, kind: str) -> list[str]:
        """Names of complete artifacts of a kind; checkpoints sorted by step."""
        d = self.root / _check(job_id, "job") / _check(kind, "kind")
        if not d.is_dir():
            return []
        names = [p.name[: -len(".artifact.json")] for p in d.glob("*.artifact.json")]
        names = [n for n in names if (d / n).is_dir()]
        return sorted(names, key=lambda n: (_step(n), n))

    def latest_checkpoint(self, job_id: str) -> str | None:
        for name in reversed(self.list(job_id, "checkpoints")):
            if self.verify(job_id, "checkpoints", name):
                return name
        return None

    def delete(self, job_id: str, kind: str, name: str) -> None:
        self._meta_path(job_id, kind, name).unlink(missing_ok=True)
        shutil.rmtree(self.path(job_id, kind, name), ignore_errors=True)

    def delete_job(self, job_id: str) -> None:
        """Every artifact of a job (`smolforge job delete`); uploads are shared and stay (collected when no job names them)."""
        shutil.rmtree(self.root / _check(job_id, "job"), ignore_errors=True)

    def all_for_job(self, job_id: str) -> list[dict]:
        out = []
        base = self.root / _check(job_id, "job")
        if not base.is_dir():
            return out
        for kind_dir in sorted(p for p in base.iterdir() if p.is_dir()):
            for name in self.list(job_id, kind_dir.name):
                try:
                    meta = json.loads(self._meta_path(job_id, kind_dir.name, name).read_text())
                except (OSError, ValueError):
                    continue
                out.append({"kind": kind_dir.name, "name": name, "files": sorted(meta["sha256"]),
                            "sha256": meta["sha256"],
                            "bytes": meta.get("bytes"), "stored": meta.get("stored")})
        return out

    # -- uploads (datasets sent with a job) -----------------------------------------------------

    def add_upload(self, src: str | Path) -> str:
        """Copy a local file in (content-addressed); returns its sha256."""
        data = Path(src).read_bytes()
        digest = hashlib.sha256(data).hexdigest()
        dest = self.root / "uploads" / digest
        if not dest.exists():
            atomic_write_bytes(dest, data)
        return digest

    def clean_upload_temps(self) -> int:
        """Remove half-written uploads (`.upload.*`) a killed coordinator left; returns how many."""
        gone = 0
        for tmp in (self.root / "uploads").glob(".upload.*"):
            tmp.unlink(missing_ok=True)
            gone += 1
        return gone

    def uploads_bytes(self) -> int:
        return sum(p.stat().st_size for p in (self.root / "uploads").glob("*") if p.is_file())

    def gc_uploads(self, referenced: set[str], now: float | None = None) -> list[str]:
        """Delete uploads no live job names, older than the grace period; returns their ids."""
        now = time.time() if now is None else now
        gone = []
        for p in (self.root / "uploads").glob("*"):
            if (UPLOAD_REF.fullmatch(f"upload:{p.name}") and p.name not in referenced
                    and now - p.stat().st_mtime > UPLOAD_GRACE_S):
                p.unlink(missing_ok=True)
                gone.append(p.name)
        return gone

    def upload_path(self, digest: str) -> Path:
        if not re.fullmatch(r"[0-9a-f]{64}", digest or ""):
            raise SmolforgeError(f"bad upload id {digest!r}", fix="use the id returned by the upload")
        return self.root / "uploads" / digest

    def has_upload(self, digest: str) -> bool:
        return self.upload_path(digest).exists()

    def read_upload(self, digest: str) -> bytes:
        p = self.upload_path(digest)
        if not p.exists():
            raise SmolforgeError(f"upload {digest[:12]} is not on the coordinator", fix="upload the file again")
        data = p.read_bytes()
        if hashlib.sha256(data).hexdigest() != digest:
            raise SmolforgeError(f"upload {digest[:12]} is corrupt", fix="upload the file again")
        return data
