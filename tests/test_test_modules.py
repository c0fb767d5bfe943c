"""The test tree's own rules: every test module has a basename of its own; a soak marker's CI twin is in CI.

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


# -- no clocks in CI-tier assertions -----------------------------------------------------------------
#
# Why: on a shared, noisy 2-core machine a test that asserts a duration or a speed ratio fails for
# reasons that are not bugs (and a fast machine has broken others). Speed claims live in bench/ and
# BENCHMARKS.md; a CI-tier test asserts what the mechanism decided. A clock may appear in an assertion
# only as a hang guard: `assert time.time() < deadline` inside a polling loop, or an entry below that
# says why its bound is generous.

import ast  # noqa: E402

CLOCKS = {"time", "monotonic", "perf_counter", "process_time"}
OFF_CI_MARKERS = {"soak", "bench"}
# (module relative to tests/, function): why this clock assertion is a hang guard, not a speed claim.
ALLOWED_HANG_GUARDS: dict[tuple[str, str], str] = {
    ("test_distill_student.py", "test_student_starts_before_the_last_shard_is_written"):
        "an order of two events (the student's start, the last shard's write), not a duration",
    ("cluster/test_model_travel.py", "test_a_killed_stage_fails_its_stream_and_is_placed_again"):
        "a hang guard (120 s against the stage's failure in about a second): without it a stream that never "
        "ends would hold the test until the module's timeout",
}


def _is_clock_call(node: ast.AST) -> bool:
    return (isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr in CLOCKS
            and isinstance(node.func.value, ast.Name) and node.func.value.id == "time")


def _marked_off_ci(decorators: list[ast.expr]) -> bool:
    return any(isinstance(n, ast.Attribute) and n.attr in OFF_CI_MARKERS
               for d in decorators for n in ast.walk(d))


def _module_off_ci(tree: ast.Module) -> bool:
    for node in tree.body:
        if isinstance(node, ast.Assign) and any(isinstance(t, ast.Name) and t.id == "pytestmark" for t in node.targets):
            return _marked_off_ci([node.value])
    return False


def _clock_assertions(func: ast.FunctionDef) -> list[int]:
    """Lines of the assertions in `func` that compare a clock reading (or a name made from one) with
    anything but a `deadline`."""
    clock_names = {t.id for node in ast.walk(func) if isinstance(node, ast.Assign)
                   and any(_is_clock_call(n) for n in ast.walk(node.value))
                   for t in node.targets if isinstance(t, ast.Name)}

    def clocky(node: ast.AST) -> bool:
        """A clock reading in this expression's arithmetic (a clock passed into a call is an input)."""
        if _is_clock_call(node) or (isinstance(node, ast.Name) and node.id in clock_names):
            return True
        if isinstance(node, ast.Call):
            return False
        return any(clocky(child) for child in ast.iter_child_nodes(node))

    lines = []
    for node in ast.walk(func):
        if not isinstance(node, ast.Assert):
            continue
        for cmp in (n for n in ast.walk(node.test) if isinstance(n, ast.Compare)):
            sides = [cmp.left, *cmp.comparators]
            if not any(clocky(s) for s in sides):
                continue
            if any(isinstance(s, ast.Name) and "deadline" in s.id for s in sides):
                continue  # `time.time() < deadline`: the guard of a polling loop
            lines.append(node.lineno)
    return lines


def clock_assertions_in_ci_tier() -> dict[str, list[int]]:
    found: dict[str, list[int]] = {}
    for path in sorted(TESTS.rglob("test_*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        if _module_off_ci(tree):
            continue
        rel = str(path.relative_to(TESTS))
        for func in (n for n in ast.walk(tree) if isinstance(n, (ast.FunctionDef, ast.AsyncFunctionDef))):
            if _marked_off_ci(func.decorator_list) or (rel, func.name) in ALLOWED_HANG_GUARDS:
                continue
            for line in _clock_assertions(func):
                found.setdefault(f"{rel}::{func.name}", []).append(line)
    return found


def test_no_ci_tier_test_asserts_a_duration():
    found = clock_assertions_in_ci_tier()
    assert not found, ("these CI-tier assertions compare a clock: assert what the mechanism decided (a "
                       "counter, an event), move the speed claim to bench/ (marker `bench`), or, for a "
                       f"generous hang guard, add it to ALLOWED_HANG_GUARDS with the reason: {found}")


def test_the_clock_scan_sees_a_duration_and_spares_a_deadline():
    tree = ast.parse("def f():\n t0 = time.time()\n work()\n assert time.time() - t0 < 10\n"
                     "def g():\n deadline = time.time() + 60\n while time.time() < deadline:\n  pass\n"
                     " assert time.time() < deadline, 'hung'\n")
    f, g = tree.body
    assert _clock_assertions(f) == [4] and _clock_assertions(g) == []


# -- work units under pytest-xdist -------------------------------------------------------------------
#
# Why: `make test` runs two pytest processes, and each takes whole work units (tests/workunits.py
# `work_unit`). A module that uses the session's shared cluster but is not in SHARED_CLUSTER_ORDER
# would be its own unit: the other process would start a second cluster (it happened, with xdist's
# own groups, which pytest 9 no longer honours).

def test_every_user_of_the_shared_cluster_is_in_its_work_unit():
    from workunits import SHARED_CLUSTER_ORDER, work_unit

    users = sorted(str(p.relative_to(TESTS.parent)) for p in TESTS.rglob("test_*.py")
                   if "__pycache__" not in p.parts and p.name != Path(__file__).name
                   and any(f in p.read_text() for f in ("shared_cluster", "module_cluster")))
    assert users, "no module uses the shared cluster: the scan is broken"
    assert {work_unit(f"{u}::test_x") for u in users} == {"shared-cluster"}, users
    assert {p.rsplit("/", 1)[-1].removesuffix(".py") for p in users} == set(SHARED_CLUSTER_ORDER), users
    # tests/serve shares one session server; any other module is its own unit
    assert work_unit("tests/serve/test_api.py::test_x") == work_unit("tests/serve/test_load.py::test_y[1]")
    assert work_unit("tests/cluster/test_tls.py::test_x") == "tests/cluster/test_tls.py"


# -- the shared cluster ends after its last user ---------------------------------------------------------
#
# Why: under pytest-xdist the process that runs the shared cluster's users first then takes other modules
# for the rest of the run, and a session fixture only ends with the session: the cluster (coordinator, two
# workers, their Ray processes) idled beside every later module on the two cores (tests/workunits.py,
# `end_after_last_user`).

HOOK_CONFTEST = '''
import sys
from pathlib import Path

import pytest

sys.path.insert(0, {tests!r})
from workunits import end_after_last_user  # noqa: E402

LOG = Path(__file__).parent / "log.txt"


def say(what):
    with LOG.open("a") as f:
        f.write(what + "\\n")


@pytest.fixture(scope="session")
def shared_cluster():
    say("start")
    yield
    say("end")


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):  # tests/conftest.py's hook, as written there
    yield
    end_after_last_user(item, nextitem)
'''


def test_the_shared_cluster_ends_after_its_last_user_and_a_later_one_starts_it_again(tmp_path):
    """A real pytest run (one process, the modules in the order given): the session fixture ends right
    after test_a's last test, before test_b runs; test_c, a later user, starts it anew."""
    import os
    import subprocess
    import sys

    (tmp_path / "conftest.py").write_text(HOOK_CONFTEST.format(tests=str(TESTS)))
    use = "from conftest import say\n\n\ndef test_{n}(shared_cluster):\n    say('{m} {n}')\n"
    (tmp_path / "test_a.py").write_text(use.format(m="a", n=1) + "\n\n" + use.format(m="a", n=2))
    (tmp_path / "test_b.py").write_text("from conftest import say\n\n\ndef test_b():\n    say('b')\n")
    (tmp_path / "test_c.py").write_text(use.format(m="c", n=1))
    proc = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:xdist",
                           "test_a.py", "test_b.py", "test_c.py"], cwd=tmp_path, capture_output=True, text=True,
                          timeout=120, env={**os.environ, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1"})  # seconds, not 15
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert (tmp_path / "log.txt").read_text().split("\n")[:-1] == [
        "start", "a 1", "a 2", "end", "b", "start", "c 1", "end"], proc.stdout


def _soak_status() -> tuple[dict[str, bool], list[tuple[str, int, str]]]:
    """Every test function's name -> whether it is soak (its own `@pytest.mark.soak` or its module's
    `pytestmark`), and every `@pytest.mark.soak  # …` line's (file, line, comment)."""
    import ast

    soak: dict[str, bool] = {}
    comments: list[tuple[str, int, str]] = []
    for path in TESTS.rglob("test_*.py"):
        text = path.read_text()
        module_soak = any("pytestmark" in line and "mark.soak" in line for line in text.splitlines())
        for node in ast.walk(ast.parse(text)):
            if isinstance(node, ast.FunctionDef) and node.name.startswith("test_"):
                own = any("soak" in ast.unparse(d) for d in node.decorator_list)
                soak[node.name] = soak.get(node.name, False) or own or module_soak
        for no, line in enumerate(text.splitlines(), 1):
            if line.strip().startswith("@pytest.mark.soak") and "#" in line:
                comments.append((str(path.relative_to(TESTS.parent)), no, line.split("#", 1)[1]))
    return soak, comments


def test_a_soak_markers_ci_twin_is_a_ci_test():
    """A soak test's marker may name the test that proves the same claim in CI (`# … in CI: test_x`): that
    test exists and is not soak itself. Stop 55 moved a CI test to soak that another soak marker named as
    its CI twin, leaving the claim with no CI proof; the module's soak run found it, this finds it first."""
    import re

    soak, comments = _soak_status()
    wrong = []
    for where, no, comment in comments:
        for name in re.findall(r"\b(test_[A-Za-z0-9_]+\*?)(?![\w.])", comment):
            named = [t for t in soak if t.startswith(name[:-1])] if name.endswith("*") else [name] * (name in soak)
            if not named:
                wrong.append(f"{where}:{no} names {name}, which is no test")
            elif all(soak[t] for t in named):
                wrong.append(f"{where}:{no} names {name} as its CI twin, but it is soak too")
    assert not wrong, "\n".join(wrong)
