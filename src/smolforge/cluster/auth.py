"""The cluster token: the shared helpers (now `smolforge.auth`) plus the Ray side of it.

The pure-Python helpers moved to `smolforge/auth.py` so services outside the cluster (`smolforge
serve`) use them without importing `smolforge.cluster`; they are re-exported here so every existing
`from smolforge.cluster.auth import ...` keeps working. What stays is what only the cluster needs:
handing the token to Ray (`RAY_AUTH_TOKEN_PATH`, a file, so it never shows in `ps`).
"""

from __future__ import annotations

import os
from pathlib import Path

from smolforge.auth import (
    TOKEN_ENV,
    TOKEN_FILE_ENV,
    bearer_of,
    check_token_format,
    load_or_create_token,
    read_token_file,
    resolve_token,
    tokens_match,
    write_token,
)

__all__ = ["TOKEN_ENV", "TOKEN_FILE_ENV", "apply_ray_auth", "bearer_of", "check_token_format", "load_or_create_token",
           "ray_auth_env", "read_token_file", "resolve_token", "tokens_match", "write_token"]


def ray_auth_env(token_path: Path) -> dict[str, str]:
    """Environment that turns on Ray token auth with the token in `token_path`."""
    return {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(Path(token_path).resolve())}


def apply_ray_auth(token_path: Path) -> None:
    """Turn on Ray token auth for this process (and children) before `ray.init`.

    Ray caches the token and its config on first use; reset both so a process that talks to two
    clusters in turn (the tests do) uses the right token each time.
    """
    os.environ.update(ray_auth_env(token_path))
    os.environ.pop("RAY_AUTH_TOKEN", None)
    try:
        from ray._raylet import AuthenticationTokenLoader, Config

        Config.initialize("")
        AuthenticationTokenLoader.instance().reset_cache()
    except (ImportError, AttributeError):  # a Ray without these hooks: the env alone is enough on first init
        pass
