"""The coordinator's first dashboard page: nodes and jobs with progress, refreshed every 2 s.

One static HTML file with inline script and no external assets (home clusters are often offline).
The page holds no data itself; it reads the token from the URL fragment (`#token=…`, which the
browser never sends to the server) or a login box, keeps it in sessionStorage, and calls the API
with `Authorization: Bearer`.
"""

from __future__ import annotations

from functools import lru_cache
from pathlib import Path


@lru_cache(maxsize=1)
def page() -> str:
    return (Path(__file__).with_name("index.html")).read_text(encoding="utf-8")
