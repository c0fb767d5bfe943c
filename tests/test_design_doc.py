"""docs/design.md stays true where a machine can check it.

Why: the design map lived outside the repository and drifted from the code (folders it did not know,
a helper it placed in a module that no longer held it). Now it lives with the code, and these checks
fail the CI tier when the code moves under it:
- every package under src/smolforge (a folder with an `__init__.py`, at any depth) is named, as
  `` `path/` ``, in the section "The layout as built";
- every name in the strategy registry (`smolforge.parallel.strategies.STRATEGIES`) appears in the doc;
- every repository path the doc names (a backticked `a/b.py` or `a/b/`) exists, relative to
  src/smolforge or to the repository root; the target section (what is not built yet) and the seed
  table (run output directories, not repository paths) are left out.
Pure file reading plus one registry import (it imports no strategy module): well under a second.
"""

from __future__ import annotations

import re
from pathlib import Path

from smolforge.parallel.strategies import STRATEGIES

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "design.md"
SRC = ROOT / "src" / "smolforge"
LAYOUT = "The layout as built"
UNCHECKED_PATHS = ("Target (issue 29, not yet built)", "Seed vocabulary → smolforge")
PATH = re.compile(r"`([\w.-]+(?:/[\w.-]+)*/?)`")  # placeholders (<name>), globs and URLs never match


def _sections() -> dict[str, str]:
    """The doc's `## ` sections by title (the text before the first one under "")."""
    parts = re.split(r"^## (.+)$", DOC.read_text(encoding="utf-8"), flags=re.MULTILINE)
    return {"": parts[0], **{title.strip(): body for title, body in zip(parts[1::2], parts[2::2])}}


def _packages() -> list[str]:
    return sorted(p.parent.relative_to(SRC).as_posix() for p in SRC.rglob("__init__.py")
                  if p.parent != SRC and "__pycache__" not in p.parts)


def test_every_package_is_in_the_layout_section():
    sections = _sections()
    assert LAYOUT in sections, f"docs/design.md has no '## {LAYOUT}' section (sections: {sorted(sections)})"
    missing = [pkg for pkg in _packages() if f"`{pkg}/`" not in sections[LAYOUT]]
    assert not missing, (f"docs/design.md, '## {LAYOUT}': no row for {missing}; add each as `path/` with its "
                         "line count (find src/smolforge/X -name '*.py' | xargs wc -l) and what it holds")


def test_every_strategy_is_named_in_the_doc():
    text = DOC.read_text(encoding="utf-8")
    missing = [name for name in STRATEGIES if f"`{name}`" not in text]
    assert not missing, (f"docs/design.md never names strategies {missing} (as `name`); add them to the "
                         "Strategy concept and, if the CLI lists them by hand, to 'The doors' (a)")


def test_every_path_the_doc_names_exists():
    sections = _sections()
    named = {m for title, body in sections.items() if title not in UNCHECKED_PATHS
             for m in PATH.findall(body) if "/" in m}
    assert len(named) > 20, f"the path pattern found only {sorted(named)}: has the doc's path style changed?"
    missing = sorted(p for p in named if not (SRC / p).exists() and not (ROOT / p).exists())
    assert not missing, (f"docs/design.md names paths that exist neither under src/smolforge nor at the repository "
                         f"root: {missing}; update the doc (or move a planned path under the target section)")
