"""Where smolforge keeps things on disk, and atomic writes.

Everything goes under `SMOLFORGE_HOME` (default `~/.smolforge`) so that tests can point it at a
temporary directory.
"""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Any

from smolforge.errors import SmolforgeError


def home() -> Path:
    return Path(os.environ.get("SMOLFORGE_HOME", Path.home() / ".smolforge")).expanduser()


def private_dir(path: str | Path) -> Path:
    """A directory only its owner can enter (0700): created so, or tightened when it is ours.

    Used for what holds cluster state (the job store, artifacts, uploads, logs). An existing
    directory owned by someone else is left alone (never chmod a shared dir a user pointed us at).
    """
    path = Path(path)
    path.mkdir(mode=0o700, parents=True, exist_ok=True)
    st = path.stat()
    if st.st_uid == os.getuid() and st.st_mode & 0o077:
        os.chmod(path, st.st_mode & ~0o077)
    return path


def private_file(path: str | Path) -> Path:
    """A file only its owner can read or write (0600), created empty if missing.

    An existing file is only chmod-ed, never opened: closing any descriptor of a file drops every
    POSIX lock this process holds on it, and SQLite's locks on jobs.db are such locks (closing a
    second descriptor of a live database is SQLite's first listed way to corrupt one).
    """
    path = Path(path)
    try:
        os.close(os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600))
    except FileExistsError:
        if path.stat().st_mode & 0o077:
            os.chmod(path, 0o600)
    return path


def atomic_write_bytes(path: str | Path, data: bytes) -> None:
    """Write via a temp file in the same directory, fsync, then rename: a crash leaves the old file."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
    try:
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def atomic_write_text(path: str | Path, text: str) -> None:
    atomic_write_bytes(path, text.encode("utf-8"))


def atomic_write_json(path: str | Path, obj: Any) -> None:
    atomic_write_text(path, json.dumps(obj, indent=2, sort_keys=True) + "\n")


def fsync_dir(path: str | Path) -> None:
    """Make a directory's entries (a rename, a new file) durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_tree(root: str | Path) -> None:
    """fsync every file under `root`, then every directory, deepest first: all of it is on disk."""
    root = Path(root)
    dirs = [root]
    for p in sorted(root.rglob("*")):
        if p.is_dir():
            dirs.append(p)
        elif p.is_file():
            with open(p, "rb") as f:
                os.fsync(f.fileno())
    for d in sorted(dirs, key=lambda d: len(d.parts), reverse=True):
        fsync_dir(d)


def atomic_replace_dir(tmp_dir: str | Path, final_dir: str | Path) -> None:
    """Swap a fully written directory into place, crash-safely.

    The new tree is fsynced before the swap; the old copy stays (renamed aside) until the new one
    is in place, is put back if the swap fails, and is removed only after the parent is fsynced.
    """
    tmp_dir, final_dir = Path(tmp_dir), Path(final_dir)
    fsync_tree(tmp_dir)
    old = None
    if final_dir.exists():
        old = final_dir.with_name(f".{final_dir.name}.old-{os.getpid()}")
        if old.exists():
            shutil.rmtree(old)
        os.replace(final_dir, old)
    try:
        os.replace(tmp_dir, final_dir)
    except BaseException:
        if old is not None and not final_dir.exists():
            os.replace(old, final_dir)  # the old copy comes back: never neither
        raise
    fsync_dir(final_dir.parent)
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)


def safe_join(root: str | Path, relative: str) -> Path:
    """Join a user-sent relative path under root, refusing `..` escapes and absolute paths."""

    root = Path(root).resolve()
    candidate = (root / relative).resolve()
    if candidate != root and root not in candidate.parents:
        raise SmolforgeError(
            f"path {relative!r} escapes {root}",
            fix="send a path relative to the artifact root without '..' or a leading '/'",
        )
    return candidate


def not_a_regular_file(path: str | Path) -> str | None:
    """Why `path` cannot be read as a user's file, in words for a message ("does not exist", "is a
    directory", "is not a regular file (a character device)"); None for a regular file (or a link to one).
    One answer for every reader of a file a user names (--config, --data): `/dev/null` used to be called
    "a directory"."""
    import stat

    p = Path(path)
    try:
        mode = p.stat().st_mode
    except FileNotFoundError:
        return "does not exist"
    except OSError as err:
        return f"cannot be read ({err.strerror})"
    if stat.S_ISREG(mode):
        return None
    if stat.S_ISDIR(mode):
        return "is a directory"
    kind = ("a character device" if stat.S_ISCHR(mode) else "a block device" if stat.S_ISBLK(mode) else
            "a named pipe" if stat.S_ISFIFO(mode) else "a socket" if stat.S_ISSOCK(mode) else "a special file")
    return f"is not a regular file ({kind})"
