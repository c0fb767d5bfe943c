"""Shared test set-up: offline hub, a private SMOLFORGE_HOME per session, quiet transformers."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# precision "auto" on CPU measures bf16 against fp32; tests compare floats exactly, so pin fp32.
os.environ.setdefault("SMOLFORGE_CPU_BF16", "0")
_MADE_HOME = None
if "SMOLFORGE_HOME" not in os.environ or not os.environ.get("SMOLFORGE_KEEP_HOME"):
    # One home per test session: presets are built once, and nothing touches ~/.smolforge.
    os.environ["SMOLFORGE_HOME"] = _MADE_HOME = tempfile.mkdtemp(prefix="smolforge-test-home-")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


TIERS = ("ci", "all")
OFF_CI = ("soak", "bench")  # markers whose tests run in `make test-all` only


def pytest_addoption(parser):
    parser.addoption(
        "--tier", choices=("auto", *TIERS), default=os.environ.get("SMOLFORGE_TEST_TIER", "auto"),
        help="ci: every test that is the only proof of a feature (`make test`, what CI runs); all: also "
             "`soak` (second instances of a recovery path, long runs) and `bench` (speed and quality "
             "claims), `make test-all`. auto (default): ci when pytest collects its testpaths with no -k "
             "or -m, all when you name files, folders or tests (`pytest tests/test_export.py` runs every "
             "test in it, `pytest -k kd_beats_sft` finds the bench test).")


def chosen_tier(config) -> str:
    """The tier this run selects: named, or `ci` when pytest collects its testpaths with nothing chosen
    (no files, -k or -m): a person who names a test wants it run, whatever its tier."""
    tier = config.getoption("--tier")
    if tier != "auto":
        return tier
    chose = config.getoption("keyword") or config.getoption("markexpr")
    return "ci" if config.args_source == pytest.Config.ArgsSource.TESTPATHS and not chose else "all"


def pytest_report_header(config):
    return f"smolforge test tier: {chosen_tier(config)} (--tier ci|all; markers {', '.join(OFF_CI)} are off the ci tier)"


def pytest_collection_modifyitems(config, items):
    """The one place that chooses the tiers: in `ci`, tests marked soak or bench are deselected."""
    if chosen_tier(config) == "all":
        return
    keep, drop = [], []
    for item in items:
        (drop if any(item.get_closest_marker(m) for m in OFF_CI) else keep).append(item)
    if drop:
        config.hook.pytest_deselected(items=drop)
        items[:] = keep


def pytest_sessionfinish(session, exitstatus):
    """The session's home goes with it (every module's clusters and servers are stopped by now)."""
    if _MADE_HOME:
        import shutil

        shutil.rmtree(_MADE_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_llama_dir():
    from smolforge.models.tiny import preset_dir

    return preset_dir("tiny-llama")
