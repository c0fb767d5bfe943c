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

from tiers import OFF_CI, TIERS, cap_timeouts, chosen_tier  # noqa: E402
from workunits import SHARED_CLUSTER_ORDER, end_after_last_user, work_unit  # noqa: E402

torch.set_num_threads(1)


def pytest_addoption(parser):
    parser.addoption(
        "--tier", choices=("auto", *TIERS), default=os.environ.get("SMOLFORGE_TEST_TIER", "auto"),
        help="ci: every test that is the only proof of a feature (`make test`, what CI runs); all: also "
             "`soak` (second instances of a recovery path, long runs) and `bench` (speed and quality "
             "claims), `make test-all`. auto (default): ci when pytest collects its testpaths with no -k "
             "or -m, all when you name files, folders or tests (`pytest tests/test_export.py` runs every "
             "test in it, `pytest -k kd_beats_sft` finds the bench test).")


def pytest_report_header(config):
    return f"smolforge test tier: {chosen_tier(config)} (--tier ci|all; markers {', '.join(OFF_CI)} are off the ci tier)"


def pytest_collection_modifyitems(config, items):
    """The one place that chooses the tiers: in `ci`, tests marked soak or bench are deselected.
    Then the order: alone, the users of the session's shared cluster run last, together
    (`shared_cluster_last`); under pytest-xdist (`make test` runs two processes), they run first
    (`work_units`), and `work_unit` says which tests share a process."""
    unique_node_ids(items)
    if chosen_tier(config) != "all":
        keep, drop = [], []
        for item in items:
            (drop if any(item.get_closest_marker(m) for m in OFF_CI) else keep).append(item)
        if drop:
            config.hook.pytest_deselected(items=drop)
            items[:] = keep
        cap_timeouts(items)
    if hasattr(config, "workerinput"):
        work_units(items)
    else:
        shared_cluster_last(items)


def unique_node_ids(items: list) -> None:
    """Every test its own node id. schemathesis names its cases by operation (`name`) but gives them
    all the test function's node id; pytest-xdist schedules by node id, so under `make test` all but
    one case per test silently did not run (13 of the fuzz module's 61). A case's id gets its name's
    `[METHOD /path]`; any other duplicate stops the run, naming it."""
    for item in items:
        if item.name != item.nodeid.rsplit("::", 1)[-1] and "[" in item.name and "[" not in item.nodeid:
            new = f"{item.nodeid.rsplit('::', 1)[0]}::{item.name}"
            if hasattr(item, "_id"):  # pytest 9 keeps a NodeId; older ones the string
                from _pytest.nodeid import coerce_node_id

                item._id = coerce_node_id(new)
            else:
                item._nodeid = new
    seen: dict[str, int] = {}
    for item in items:
        seen[item.nodeid] = seen.get(item.nodeid, 0) + 1
    dup = sorted(n for n, k in seen.items() if k > 1)
    if dup:
        raise pytest.UsageError(f"{len(dup)} node ids name several tests (pytest-xdist would run one of each): "
                                f"{dup[:5]}")


def shared_cluster_last(items: list) -> None:
    """Move the tests that use `shared_cluster` to the end, grouped by module in SHARED_CLUSTER_ORDER
    (stable otherwise): the cluster starts once for all of them, and stops as the session ends, right
    after its last user, instead of idling beside every other module."""
    def key(pair):
        index, item = pair
        if "shared_cluster" not in item.fixturenames:
            return (0, 0, index)
        module = item.module.__name__.rsplit(".", 1)[-1] if item.module else ""
        rank = SHARED_CLUSTER_ORDER.index(module) if module in SHARED_CLUSTER_ORDER else len(SHARED_CLUSTER_ORDER)
        return (1, rank, index)

    items[:] = [item for _, item in sorted(enumerate(items), key=key)]


def work_units(items: list) -> None:
    """Under pytest-xdist, the shared cluster's users first (in SHARED_CLUSTER_ORDER): theirs is the
    longest work unit (`work_unit`), and the other process takes the modules one by one meanwhile."""
    shared = [item for item in items if "shared_cluster" in item.fixturenames]
    shared_cluster_last(shared)
    items[:] = shared + [item for item in items if "shared_cluster" not in item.fixturenames]


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_teardown(item, nextitem):
    """After a test's own teardown (its module's fixtures included): the shared cluster ends once its last
    user is done (`end_after_last_user`), not with the session."""
    yield
    end_after_last_user(item, nextitem)


@pytest.hookimpl(optionalhook=True)  # a hook of pytest-xdist's (the `test` extra installs it)
def pytest_xdist_make_scheduler(config, log):
    """`make test` runs two pytest processes (`-n 2 --dist loadgroup`): the suite's time is process
    starts, and one core sat idle about 40 % of the time; the units are `work_unit`'s."""
    if config.getoption("dist") != "loadgroup":
        return None
    from xdist.scheduler import LoadScopeScheduling

    class WorkUnits(LoadScopeScheduling):
        def _split_scope(self, nodeid: str) -> str:
            return work_unit(nodeid)

    return WorkUnits(config, log)


def pytest_sessionfinish(session, exitstatus):
    """The session's home goes with it (every module's clusters and servers are stopped by now)."""
    if _MADE_HOME:
        import shutil

        shutil.rmtree(_MADE_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def shared_cluster(tmp_path_factory):
    """One real cluster for the modules of that topology (SHARED_CLUSTER_ORDER): a coordinator (1 CPU,
    takes no training work) and workers w1, w2 (1 CPU each); every node holds `tiny-copy` in its models
    dir. Starting one costs ~40 s on the 2-core machine; four modules used to start one each
    (the serve job's tests run on test_model_travel's cluster: their stages must not be planned on a
    coordinator that holds the model). A module takes it through `module_cluster`, which checks it is whole and ends what the module left running."""
    import shutil
    import sys
    from types import SimpleNamespace

    sys.path.insert(0, os.path.join(os.path.dirname(__file__), "cluster"))
    from localcluster import LocalCluster

    from smolforge.models.tiny import preset_dir

    base = tmp_path_factory.mktemp("shared-cluster")
    models = base / "models"
    shutil.copytree(preset_dir("tiny-llama"), models / "tiny-copy")
    cluster = LocalCluster(base)
    try:
        cluster.start_coordinator(models_dir=models)
        cluster.add_workers(["w1", "w2"], models_dir=models)
        cluster.wait_nodes(["coordinator", "w1", "w2"])
        yield SimpleNamespace(c=cluster, models=models, base=base)
    finally:
        cluster.close()


@pytest.fixture(scope="module")
def module_cluster(shared_cluster):
    """`shared_cluster` for one module: whole when the module starts (the module before it left every
    node online), and after it, no job of its still running (each is cancelled, bounded wait)."""
    c = shared_cluster.c
    c.wait_nodes(["coordinator", "w1", "w2"], timeout=120)
    yield shared_cluster
    end_jobs(c.client())


def end_jobs(client, timeout: float = 120) -> None:
    """Cancel every job not yet ended and wait until each has (a hang guard, not a timing)."""
    import time

    ended = ("completed", "failed", "cancelled")
    live = [j["id"] for j in client.list_jobs() if j["state"] not in ended]
    for job_id in live:
        client.cancel_job(job_id)
    deadline = time.time() + timeout
    while live and time.time() < deadline:
        live = [j for j in live if client.get_job_status(j)["state"] not in ended]
        time.sleep(0.3)
    assert not live, f"jobs not ended {timeout} s after their cancel: {live}"


@pytest.fixture(scope="session")
def tiny_llama_dir():
    from smolforge.models.tiny import preset_dir

    return preset_dir("tiny-llama")
