"""Bearer tokens for every smolforge service: made, stored, found and compared the same way.

Why one module below the layers: the coordinator, the split-learning trunk server and `smolforge
serve` all take the same `--token-file` / `$SMOLFORGE_TOKEN` / state-dir token, and a service that
needs no cluster (serve) must not import `smolforge.cluster` to get it. Pure Python, no Ray: the
Ray side of the cluster token (`RAY_AUTH_TOKEN_PATH`) is `cluster/nodes/ray_auth.py`.

Why one token for a cluster: a worker joining needs both the API and Ray, and users should have to
copy exactly one secret. It is generated once, kept with mode 0600, compared in constant time, and
handed to Ray through a file, so it never shows in `ps` or `/proc/<pid>/environ`.
"""

from __future__ import annotations

import hmac
import os
import secrets
from pathlib import Path

from smolforge.errors import SmolforgeError


def load_or_create_token(path: Path) -> str:
    """The token at `path`; generated (and written 0600) the first time."""
    path = Path(path)
    if path.exists():
        token = path.read_text().strip()
        if token:
            if path.stat().st_mode & 0o077:
                os.chmod(path, 0o600)
            return token
    token = secrets.token_hex(32)
    write_token(path, token)
    return token


def write_token(path: Path, token: str) -> None:
    """Write the token readable by its owner only, atomically (never a world-readable moment)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    try:
        os.write(fd, token.encode())
        os.fsync(fd)
    finally:
        os.close(fd)
    os.replace(tmp, path)


TOKEN_ENV = "SMOLFORGE_TOKEN"
TOKEN_FILE_ENV = "SMOLFORGE_TOKEN_FILE"


def read_token_file(path: str | Path) -> str:
    """The token in `path` (one line), or one message naming the file and the fix."""
    path = Path(path).expanduser()
    fix = "copy the coordinator's token file here (`smolforge coordinator start` prints where it is)"
    try:
        token = path.read_text(encoding="utf-8").strip()
    except OSError as err:
        raise SmolforgeError(f"cannot read the token file: {err.strerror}", where=str(path), fix=fix) from err
    except UnicodeDecodeError as err:
        raise SmolforgeError("the token file is not text", where=str(path), fix=fix) from err
    if not token:
        raise SmolforgeError("the token file is empty", where=str(path), fix=fix)
    return token


def resolve_token(token: str | None = None, token_file: str | Path | None = None,
                  state_dir: str | Path | None = None) -> str | None:
    """Where a command finds the cluster token, first match wins: --token, --token-file,
    $SMOLFORGE_TOKEN, $SMOLFORGE_TOKEN_FILE, then the token file of a coordinator running from
    `state_dir` (this machine). None when there is none: the coordinator's refusal then says so."""
    if token:
        return token.strip()
    if token_file:
        return read_token_file(token_file)
    if os.environ.get(TOKEN_ENV, "").strip():
        return os.environ[TOKEN_ENV].strip()
    if os.environ.get(TOKEN_FILE_ENV, "").strip():
        return read_token_file(os.environ[TOKEN_FILE_ENV].strip())
    if state_dir is not None:
        local = Path(state_dir) / "token"
        if local.is_file():
            return read_token_file(local)
    return None


def check_token_format(token: str | None) -> str:
    token = (token or "").strip()
    if not token:
        raise SmolforgeError("no cluster token given",
                             fix="pass --token-file F (a copy of the coordinator's token file; `smolforge coordinator start` "
                                 "prints where it is) or set SMOLFORGE_TOKEN")
    if any(c.isspace() for c in token) or len(token) > 512:
        raise SmolforgeError("the token contains whitespace or is too long", fix="copy the token exactly as printed")
    return token


def tokens_match(given: str | None, expected: str) -> bool:
    return bool(given) and hmac.compare_digest(given.encode(), expected.encode())


def bearer_of(header: str | None) -> str | None:
    if not header:
        return None
    scheme, _, value = header.partition(" ")
    return value.strip() if scheme.lower() == "bearer" and value.strip() else None
