"""A directory to and from the coordinator's artifact store through a job's control actor, in pieces.

The trunk's checkpoints go this way (the coordinator keeps the last ones, so a trunk placed again on
another node starts from them), and the client's final adapter. Pieces of `CHUNK_BYTES`, each file
checksummed, swapped in atomically on both ends (`parallel.transfer`), as a data-parallel rank ships
its checkpoints; no shared filesystem is assumed.
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

from smolforge.parallel.transfer import CHUNK_BYTES, DirReceiver, send_dir


def _left(deadline: float) -> float:
    return max(1.0, deadline - time.monotonic())


def upload_dir(control: Any, kind: str, name: str, path: Path, timeout_s: float,
               keep_last: int | None = None) -> dict:
    """`path` into the store as `<kind>/<name>`; its metadata. A failed upload leaves the store as it was."""
    import ray

    deadline = time.monotonic() + timeout_s
    upload_id = ray.get(control.begin_artifact.remote(kind, name), timeout=_left(deadline))
    try:
        sums = send_dir(path, lambda rel, off, data: ray.get(control.put_piece.remote(upload_id, rel, off, data),
                                                             timeout=_left(deadline)))
        return ray.get(control.commit_artifact.remote(upload_id, sums, keep_last), timeout=_left(deadline))
    except BaseException:
        control.abort_artifact.remote(upload_id)  # fire and forget: the actor may be gone
        raise


def download_dir(control: Any, kind: str, name: str, dest: Path, timeout_s: float) -> Path:
    """The stored `<kind>/<name>` into `dest`, verified file by file, swapped in whole."""
    import ray

    deadline = time.monotonic() + timeout_s
    files = ray.get(control.artifact_manifest.remote(kind, name), timeout=_left(deadline))
    receiver = DirReceiver(dest)
    try:
        for rel, info in files.items():
            offset = 0
            while offset < info["bytes"]:
                data = ray.get(control.get_piece.remote(kind, name, rel, offset, CHUNK_BYTES), timeout=_left(deadline))
                if not data:
                    break
                receiver.write(rel, offset, data)
                offset += len(data)
            if info["bytes"] == 0:
                receiver.write(rel, 0, b"")
        receiver.commit({rel: info["sha256"] for rel, info in files.items()})
    finally:
        receiver.abort()
    return dest
