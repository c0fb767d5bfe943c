"""The test tree's own rule: every test module has a basename of its own.

Why: the test directories have no `__init__.py`, so pytest imports each module by its basename;
two `test_engine.py` in different folders make the whole collection fail ("import file mismatch")
on a clean clone, after passing in a checkout that happened to hold only one of them in its cache.
It caught us twice; this says which file to rename before CI does.
"""

from __future__ import annotations

from collections import defaultdict
from pathlib import Path

TESTS = Path(__file__).resolve().parent


def test_every_test_module_basename_is_unique():
    seen: dict[str, list[str]] = defaultdict(list)
    for path in TESTS.rglob("*.py"):
        if path.name != "conftest.py" and "__pycache__" not in path.parts:
            seen[path.name].append(str(path.relative_to(TESTS)))
    clashes = {name: paths for name, paths in seen.items() if len(paths) > 1}
    assert not clashes, f"rename one of each (pytest imports test modules by basename): {clashes}"
