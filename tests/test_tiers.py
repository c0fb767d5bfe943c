"""The test tree's tier rules, checked on real pytest runs (subprocesses over this repository's tests).

- A missing dependency never gives a green CI: under CI=true, tests/test_export.py's llama.cpp test
  FAILS when llama_cpp cannot be imported, and says to install llama-cpp-python; without CI the same
  run skips with that message (tests/helpers.py, `require`). llama_cpp is hidden by a plugin that
  makes its import raise ImportError, as in a venv where the `smolforge[export]` build failed. The
  selected test calls `require` first, so the run stops before any training.
- The ci tier (`make test`, tests/conftest.py's --tier) leaves out the `bench` and `soak` tests that
  `--tier all` (`make test-all`) keeps.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap

import pytest

from helpers import ROOT, require

HIDE_LLAMA_CPP = textwrap.dedent('''
    """pytest plugin (-p hide_llama_cpp): `import llama_cpp` raises ImportError, as if not installed."""
    import sys


    class HideLlamaCpp:
        def find_spec(self, name, path=None, target=None):
            if name == "llama_cpp" or name.startswith("llama_cpp."):
                raise ImportError(f"{name} hidden by tests/test_tiers.py")
            return None


    sys.meta_path.insert(0, HideLlamaCpp())
    for _name in [m for m in sys.modules if m == "llama_cpp" or m.startswith("llama_cpp.")]:
        del sys.modules[_name]
''')
LLAMA_TEST = "tests/test_export.py::test_train_export_gguf_writes_a_verified_gguf"  # require() is its first line
BENCH_TEST = "tests/test_distill_kd_vs_sft.py::test_kd_beats_sft_over_seeds"  # marked bench


# Several pytest runs in ONE interpreter, one after another (`pytest.main` per run, each with its own
# environment changes): the interpreter's start and its imports (torch, through conftest.py) are paid once,
# not once a run; they were most of each run's seconds (this module: 40 s of the CI tier, two runs a test).
RUNS_IN_ONE = """
import json, os, sys
import pytest
for env, args in json.loads(sys.argv[1]):
    for key, value in env.items():
        os.environ.pop(key, None) if value is None else os.environ.__setitem__(key, value)
    code = pytest.main(["-p", "no:cacheprovider", *args])
    print(f"\\n{sys.argv[2]} {int(code)}", flush=True)
"""
END = "@@ pytest run ended, exit code"


def _runs(*runs: tuple[dict, list[str]], env: dict | None = None) -> list[tuple[int, str]]:
    """Each (environment changes, pytest args) run in turn in one interpreter in the repository root (a value
    None removes the variable): [(exit code, output)], one per run, in order."""
    base = {k: v for k, v in os.environ.items() if k not in ("CI", "SMOLFORGE_TEST_TIER", "PYTEST_ADDOPTS")}
    proc = subprocess.Popen([sys.executable, "-c", RUNS_IN_ONE, json.dumps(runs), END], cwd=ROOT,
                            env={**base, **(env or {})}, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        out, _ = proc.communicate(timeout=300)  # a guard against a hang only: each run takes seconds
    except subprocess.TimeoutExpired:
        proc.kill()
        raise AssertionError(f"pytest runs {runs} still running after 300 s:\n{proc.communicate()[0][-3000:]}") from None
    parts = out.split(END)
    assert proc.returncode == 0 and len(parts) == len(runs) + 1, f"exit {proc.returncode}:\n{out[-3000:]}"
    return [(int(parts[i + 1].split(None, 1)[0]), parts[i]) for i in range(len(runs))]


def _outcome(present: bool) -> BaseException | None:
    """What `require` raised: caught here, so that a wrong skip cannot skip this test itself."""
    try:
        require(present, "thing", "apt-get install thing")
    except (pytest.fail.Exception, pytest.skip.Exception) as err:
        return err
    return None


def test_require_fails_under_ci_and_skips_elsewhere(monkeypatch):
    monkeypatch.setenv("CI", "true")
    failed = _outcome(False)
    assert isinstance(failed, pytest.fail.Exception), f"{type(failed).__name__}: {failed}"
    assert "thing is missing; fix: apt-get install thing" in failed.msg and not failed.pytrace  # one message
    assert _outcome(True) is None  # present: nothing happens
    monkeypatch.delenv("CI")
    skipped = _outcome(False)
    assert isinstance(skipped, pytest.skip.Exception), f"{type(skipped).__name__}: {skipped}"
    assert "thing is missing; fix: apt-get install thing" in skipped.msg


def test_a_missing_llama_cpp_fails_under_ci_and_skips_without_it(tmp_path):
    (tmp_path / "hide_llama_cpp.py").write_text(HIDE_LLAMA_CPP)
    path = os.pathsep.join(p for p in (str(tmp_path), os.environ.get("PYTHONPATH")) if p)
    args = [LLAMA_TEST, "-p", "hide_llama_cpp", "-q", "-rfs"]
    (ci_rc, ci_out), (laptop_rc, laptop_out) = _runs(({"CI": "true"}, args), ({"CI": None}, args),
                                                     env={"PYTHONPATH": path})
    assert ci_rc == 1 and "1 failed" in ci_out, ci_out[-3000:]
    assert "llama-cpp-python" in ci_out and "hidden by tests/test_tiers.py" in ci_out, ci_out[-3000:]
    assert "CI=true" in ci_out and "Traceback" not in ci_out and "During handling" not in ci_out, ci_out[-3000:]
    assert laptop_rc == 0 and "1 skipped" in laptop_out, laptop_out[-3000:]
    assert "llama-cpp-python" in laptop_out, laptop_out[-3000:]


SOAK_TEST = "tests/test_gpu_proof.py::test_on_the_cpu_every_row_including_two_stages_on_the_embedded_cluster"


def test_the_ci_tier_leaves_out_bench_tests_that_all_keeps():
    """Over the modules that hold a bench test, a soak test and this one: the tier's choice is one hook over
    whatever was collected (`make test` collects every module, then deselects), so three modules show it
    without importing the whole tree twice (22 s of the CI run)."""
    files = sorted({t.split("::")[0] for t in (BENCH_TEST, SOAK_TEST, "tests/test_tiers.py")})
    tiers = ("ci", "all")
    listed = {}
    for tier, (rc, out) in zip(tiers, _runs(*[({}, ["--collect-only", "-q", "--tier", tier, *files]) for tier in tiers])):
        assert rc == 0, out[-3000:]
        listed[tier] = {line for line in out.splitlines() if "::" in line}
    assert "tests/test_tiers.py::test_the_ci_tier_leaves_out_bench_tests_that_all_keeps" in listed["ci"]
    assert BENCH_TEST in listed["all"], f"--tier all does not list {BENCH_TEST}"
    assert BENCH_TEST not in listed["ci"], f"--tier ci lists {BENCH_TEST}, marked bench (make test-all only)"
    assert SOAK_TEST in listed["all"] and SOAK_TEST not in listed["ci"], SOAK_TEST  # marked soak
    assert listed["ci"] < listed["all"], sorted(listed["ci"] - listed["all"])  # the ci tier only removes tests


@pytest.mark.timeout(900)
def test_the_ci_tier_bounds_every_test_below_what_its_module_allows(request):
    """A module's bound for its soak tests (here 900 s) does not reach the CI tier, where no test may
    take longer than CI_TEST_TIMEOUT_S (tests/tiers.py, `cap_timeouts`): a hang ends as a failure."""
    from tiers import CI_TEST_TIMEOUT_S, chosen_tier

    bound = request.node.get_closest_marker("timeout").args[0]
    assert bound == (CI_TEST_TIMEOUT_S if chosen_tier(request.config) == "ci" else 900)
