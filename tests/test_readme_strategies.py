"""README.md's strategy table says what the registry holds: one row per strategy of `STRATEGIES` (no
more, no fewer), and each row's "what it is" is the first line of the strategy's own docstring (its
class's, else its file's: `parallel/strategies/<name>.py`, `-` as `_`). The table is hand-written for
what the code cannot say (what a step sends, when to pick it, what was measured); this test is what
keeps it from going stale when a strategy is added, renamed or redescribed."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

from smolforge.parallel.strategies import STRATEGIES

README = Path(__file__).resolve().parents[1] / "README.md"
TABLE_AFTER = "Data-parallel strategies (`--strategy`"
ROW = re.compile(r"^\| `(?P<name>[a-z0-9-]+)`(?: \(default\))? \| (?P<what>(?:[^|\\]|\\.)+?) \|")


def summary(name: str) -> str:
    """A strategy's one line: its class's own docstring, else its file's module docstring."""
    cls = STRATEGIES[name]
    doc = cls.__dict__.get("__doc__") or importlib.import_module(
        f"smolforge.parallel.strategies.{name.replace('-', '_')}").__doc__ or ""
    return doc.strip().splitlines()[0] if doc.strip() else ""


def table_rows(text: str) -> dict[str, str]:
    """name -> "what it is" of the README's strategy table (the rows after its introduction)."""
    lines = text[text.index(TABLE_AFTER):].split("\n")
    start = next(i for i, line in enumerate(lines) if line.startswith("| strategy |"))
    rows = {}
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        match = ROW.match(line)
        assert match, f"README.md: a strategy row that does not start `| `name` | what it is |`: {line[:120]}"
        rows[match["name"]] = match["what"].replace("\\|", "|")
    return rows


def test_the_readme_table_lists_every_registered_strategy_and_no_other():
    rows = table_rows(README.read_text())
    missing, unknown = sorted(set(STRATEGIES) - set(rows)), sorted(set(rows) - set(STRATEGIES))
    assert not missing and not unknown, (
        f"README.md's strategy table and STRATEGIES differ: add a row for {missing}, remove {unknown} "
        f"(`| `name` | <its docstring's first line> | what each step sends | when to use it |`)")


def test_each_row_says_what_the_strategy_says_of_itself():
    rows = table_rows(README.read_text())
    wrong = {name: (rows[name], summary(name)) for name in rows if name in STRATEGIES and rows[name] != summary(name)}
    assert all(summary(name) for name in STRATEGIES), "every strategy has a docstring whose first line says what it is"
    assert not wrong, ("README.md's 'what it is' differs from the strategy's docstring (first line); make them "
                       f"agree (README, code): {wrong}")


def test_the_check_catches_a_missing_row_and_a_stale_line():
    """The parser itself, on the README as it would be with `ssp`'s row gone and `ddp`'s line stale."""
    text = README.read_text()
    ssp_row = next(line for line in text.split("\n") if line.startswith("| `ssp` |"))
    stale = text.replace(ssp_row + "\n", "").replace(summary("ddp"), "DDP: something else.")
    rows = table_rows(stale)
    assert "ssp" not in rows and rows["ddp"] == "DDP: something else." and len(rows) == len(STRATEGIES) - 1
