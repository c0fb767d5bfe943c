"""The test tiers: which one a run selects, and the CI tier's bound on one test (a plain module, not
conftest.py: see workunits.py for why)."""

from __future__ import annotations

import pytest

TIERS = ("ci", "all")
OFF_CI = ("soak", "bench")  # markers whose tests run in `make test-all` only


def chosen_tier(config) -> str:
    """The tier this run selects: named, or `ci` when pytest collects its testpaths with nothing chosen
    (no files, -k or -m): a person who names a test wants it run, whatever its tier."""
    tier = config.getoption("--tier")
    if tier != "auto":
        return tier
    chose = config.getoption("keyword") or config.getoption("markexpr")
    return "ci" if config.args_source == pytest.Config.ArgsSource.TESTPATHS and not chose else "all"


CI_TEST_TIMEOUT_S = 420  # the slowest CI-tier test takes ~120 s (a cluster's start, in setup) on the 2-core machine


def cap_timeouts(items: list) -> None:
    """In the CI tier no test may take longer than CI_TEST_TIMEOUT_S, whatever its module allows for the
    soak tests beside it: a hang then ends as that test's failure, with its stacks, within minutes. A
    CI run (stop 40's) was stopped at 90 min with its last three tests unfinished and nothing said."""
    for item in items:
        marker = item.get_closest_marker("timeout")
        allowed = marker.args[0] if marker and marker.args else None
        if allowed is None or allowed > CI_TEST_TIMEOUT_S:
            item.add_marker(pytest.mark.timeout(CI_TEST_TIMEOUT_S), append=False)
