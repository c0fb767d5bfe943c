"""The cluster dashboard: nodes, jobs, and a page per job with its curves, tasks, events and controls.

One HTML shell (`index.html`), its script (`app.js`) and a vendored chart library (uPlot 1.6.32, MIT,
`vendor/`, from the npm registry's `uplot@1.6.32` tarball, sha512 KIMVnG68…TkyTxpiQIw==): no CDN,
because home clusters are often offline. The files hold no data; the page reads the token from the
URL fragment (`#token=…`, which the browser never sends to the server) or a login box, keeps it in
sessionStorage, and calls the API with `Authorization: Bearer`.

The static files are served by name from the fixed allow-list ASSETS, never by joining a URL path to
the filesystem: a request can only ever get one of these few files.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path

_HERE = Path(__file__).parent

# name in the URL (/dashboard/assets/<name>) -> (file in this package, media type)
ASSETS: dict[str, tuple[str, str]] = {
    "app.js": ("app.js", "text/javascript; charset=utf-8"),
    "uPlot.iife.min.js": ("vendor/uPlot.iife.min.js", "text/javascript; charset=utf-8"),
    "uPlot.min.css": ("vendor/uPlot.min.css", "text/css; charset=utf-8"),
    "uPlot.LICENSE": ("vendor/uPlot.LICENSE", "text/plain; charset=utf-8"),
}
ASSET_PREFIX = "/dashboard/assets/"


@lru_cache(maxsize=1)
def page() -> str:
    return (_HERE / "index.html").read_text(encoding="utf-8")


@lru_cache(maxsize=len(ASSETS))
def asset(name: str) -> tuple[bytes, str] | None:
    """(content, media type) of an allow-listed static file; None for any other name."""
    entry = ASSETS.get(name)
    if entry is None:
        return None
    return (_HERE / entry[0]).read_bytes(), entry[1]


def asset_paths() -> tuple[str, ...]:
    """The exact URL paths of the static files (open like the page shell: they carry no data)."""
    return tuple(ASSET_PREFIX + name for name in ASSETS)
