"""Handing the cluster token to Ray: `RAY_AUTH_TOKEN_PATH`, a file, so the token never shows in `ps`.

The token itself (reading, writing, comparing) is `smolforge.auth`: services outside the cluster use
it without importing Ray.
"""

from __future__ import annotations

import os
from pathlib import Path


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
