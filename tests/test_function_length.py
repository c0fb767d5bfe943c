"""The house rule "no function over 100 lines" (issue 29, item 6), kept by a machine: every function
and method under `src/smolforge/`, outside `cli/` (a command's signature is its flags, one per line),
is at most 100 lines from its `def` to its last line (nested functions count inside their parent,
and on their own). A long function is split by what its pieces do, not by line count.

`STILL_LONG` names the files whose functions may still break the rule while a change splits them. A
file goes from the list once nothing in it is too long (a file kept after that fails, so the list
stays true).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "smolforge"
MAX_LINES = 100
EXEMPT_DIRS = ("cli",)  # relative to src/smolforge
# file relative to src/smolforge: the change that is splitting its long functions. Empty since every
# split of issue 29 landed (`DPRunner._run`, the rank's `_train`, `engine.train`, `train_student`, this
# stop's `create_app`, `create_student_tasks`, `run_distill`); a file goes here only with a reason.
STILL_LONG: dict[str, str] = {}


def _functions(tree: ast.AST, prefix: str = ""):
    """(qualified name, lines) of every function in `tree`, methods as `Class.name`, nested as `outer.inner`."""
    for node in ast.iter_child_nodes(tree):
        if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            yield prefix + node.name, node.end_lineno - node.lineno + 1
            yield from _functions(node, f"{prefix}{node.name}.")
        elif isinstance(node, ast.ClassDef):
            yield from _functions(node, f"{prefix}{node.name}.")
        else:
            yield from _functions(node, prefix)


def long_functions(root: Path = SRC, limit: int = MAX_LINES) -> dict[tuple[str, str], int]:
    """Every function over `limit` lines under `root` outside EXEMPT_DIRS: (file, name) -> lines."""
    found = {}
    for path in sorted(root.rglob("*.py")):
        rel = path.relative_to(root).as_posix()
        if rel.split("/", 1)[0] in EXEMPT_DIRS:
            continue
        for name, lines in _functions(ast.parse(path.read_text(), filename=str(path))):
            if lines > limit:
                found[(rel, name)] = lines
    return found


def test_no_function_is_over_100_lines_outside_cli():
    new = sorted(f"{rel}: {name} ({lines} lines)" for (rel, name), lines in long_functions().items()
                 if rel not in STILL_LONG)
    assert not new, f"functions over {MAX_LINES} lines (split each by what its pieces do): {new}"


def test_the_list_of_long_functions_names_only_long_ones():
    """A file whose long functions were all split goes from STILL_LONG, so the list stays true."""
    still = {rel for rel, _name in long_functions()}
    done = sorted(rel for rel in STILL_LONG if rel not in still)
    assert not done, f"nothing in these is over {MAX_LINES} lines now: remove them from STILL_LONG: {done}"


def test_the_scan_sees_methods_nested_functions_and_the_limit(tmp_path):
    """The scanner itself: a 101-line method and a nested function are found, a 100-line one is not."""
    body = "\n".join(f"        x{i} = {i}" for i in range(99))
    (tmp_path / "mod.py").write_text(f"class K:\n    def long(self):\n{body}\n        return 1\n\n"
                                     f"    def ok(self):\n{body}\n\n"
                                     "def outer():\n    def inner():\n" + body +
                                     "\n        return 2\n    return inner\n")
    (tmp_path / "cli").mkdir()
    (tmp_path / "cli" / "cmd.py").write_text(f"def flags():\n{body}\n    return 0\n".replace("        ", "    "))
    found = long_functions(tmp_path)
    assert found == {("mod.py", "K.long"): 101, ("mod.py", "outer"): 103, ("mod.py", "outer.inner"): 101}, found
