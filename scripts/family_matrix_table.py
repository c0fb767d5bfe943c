"""Render the families × features matrix (tests/test_family_matrix.py's outcomes) as the README table.

Why a script and not a hand-written table: the README's "Model families" section must say what the
tests found, so it is generated from test-artifacts/family-matrix.json, which the matrix test writes,
and a test checks the README still equals the rendering.

    python scripts/family_matrix_table.py          # print the table
    python scripts/family_matrix_table.py --write  # replace it in README.md
"""

from __future__ import annotations

import json
import re
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
ARTIFACT = ROOT / "test-artifacts" / "family-matrix.json"
README = ROOT / "README.md"
CELLS = ("train", "ddp-2-ranks", "split", "serve", "serve-2-stages", "distill", "distill-cross", "export-hf",
         "export-gguf", "export-ollama")
HEADERS = ("LoRA train", "2-rank ddp", "split learning", "serve", "serve in 2 stages", "distill (same family)",
           "distill (other family: text only)", "export hf", "export gguf (f16)", "export ollama")
OK = "✔"
ERROR = "error: "  # an outcome that is neither OK nor a refusal (the test fails on it)
START, END = "<!-- family-matrix:start -->", "<!-- family-matrix:end -->"
# A measured number (12, 5.26e-06, 98.4%) in a refusal is shown as "…", and an aside in parentheses
# that holds one (a limit, a near-tie count, present or not) is left out: the README must not change
# with a float that another machine's thread count moves.
NUMBER = re.compile(r"(?<![\w.])\d[\d.,]*(?:e[-+]?\d+)?%?(?!\w)")
ASIDE = re.compile(r"\s*\((?:[^()]|\(s\))*\d(?:[^()]|\(s\))*\)")


def note(outcome: str) -> str:
    """A refusal as the table's note: one line, pipes escaped, measured numbers elided."""
    return NUMBER.sub("…", ASIDE.sub("", outcome)).replace("|", "\\|").replace("\n", " ").strip()


def _hf_ids() -> dict[str, str]:
    try:
        from smolforge.models.twins import FAMILIES
    except ImportError:  # rendering needs no torch; the names are only a nicety
        return {}
    return {f: fam.hf_id for f, fam in FAMILIES.items()}


def render(matrix: dict[str, dict[str, str]]) -> str:
    """The markdown table, refusals as numbered notes under it (a refusal is a sentence, not a cell)."""
    ids, notes = _hf_ids(), []
    lines = ["| twin | " + " | ".join(HEADERS) + " |", "|---" * (len(CELLS) + 1) + "|"]
    for family, row in matrix.items():
        cells = []
        for cell in CELLS:
            got = row[cell]
            if got != OK:
                notes.append(note(got))
            cells.append(OK if got == OK else f"✘ ({len(notes)})")
        name = f"`twin:{family}` ({ids[family]})" if family in ids else f"`twin:{family}`"
        lines.append(f"| {name} | " + " | ".join(cells) + " |")
    lines += [""] + [f"({i}) {n}  " for i, n in enumerate(notes, 1)]
    return "\n".join(lines).rstrip() + "\n"


def readme_table(readme: str) -> str:
    """What the README holds between the markers."""
    if START not in readme or END not in readme:
        raise SystemExit(f"README.md has no {START} ... {END} section")
    return readme.split(START, 1)[1].split(END, 1)[0].strip("\n") + "\n"


def main(argv: list[str]) -> int:
    if not ARTIFACT.is_file():
        print(f"no {ARTIFACT}: run `python -m pytest tests/test_family_matrix.py` first", file=sys.stderr)
        return 2
    table = render(json.loads(ARTIFACT.read_text(encoding="utf-8")))
    if "--write" not in argv:
        print(table, end="")
        return 0
    readme = README.read_text(encoding="utf-8")
    old = readme_table(readme)
    README.write_text(readme.replace(f"{START}\n{old}{END}", f"{START}\n{table}{END}", 1), encoding="utf-8")
    print(f"README.md: table {'unchanged' if old == table else 'updated'}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
