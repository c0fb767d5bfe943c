"""Which tests share a pytest process, in what order the shared cluster's users run, and when it ends.

A plain module, not conftest.py: tests/serve has a conftest.py of its own, and under pytest-xdist a
process that ran the serve tests holds *that* one as `conftest`, so `from conftest import` in a test
would find the wrong file.
"""

from __future__ import annotations

# The modules that share one coordinator + two workers (`shared_cluster`), in the order they run:
# test_cluster last, because its failure tests kill a worker (w2, replaced by w3) and the coordinator;
# test_split_job kills a worker too, and joins it again under its name before it ends.
SHARED_CLUSTER_ORDER = ("test_task_logs", "test_monitoring", "test_queue", "test_seeds_api", "test_kind_retries",
                        "test_dashboard", "test_split_job", "test_cluster")
# Session fixtures that end right after their last user, not when the session ends (`end_after_last_user`).
END_AFTER_LAST_USER = ("shared_cluster",)


def work_unit(nodeid: str) -> str:
    """The unit of work one pytest-xdist process takes whole, from a test's id: its module (its
    module-scoped fixtures start once), every test under tests/serve/ (they share one session
    `server`), or every module of SHARED_CLUSTER_ORDER (one cluster). From the id alone, because
    the scheduler sees ids, not items (and xdist's own `xdist_group` no longer reaches it under
    pytest 9, which ignores the id suffix xdist sets)."""
    path = nodeid.split("::")[0]
    if path.rsplit("/", 1)[-1].removesuffix(".py") in SHARED_CLUSTER_ORDER:
        return "shared-cluster"
    return "tests/serve" if path.startswith("tests/serve/") else path


def end_after_last_user(item, nextitem) -> None:
    """After `item`'s teardown: each session fixture of END_AFTER_LAST_USER that `item` used and `nextitem`
    (None: the last test) does not use ends now. Under pytest-xdist the shared cluster's users run first in
    one process (tests/conftest.py, `work_units`), which then takes other modules for the rest of the run:
    the cluster (a coordinator and two workers, each with its Ray processes) idled beside them on the two
    cores until the session ended. Its users are contiguous, so none comes later; one that did would start
    it again (pytest runs a finished fixture anew)."""
    for name in END_AFTER_LAST_USER:
        if name in item.fixturenames and (nextitem is None or name not in nextitem.fixturenames):
            for fixturedef in item._fixtureinfo.name2fixturedefs.get(name, ()):
                fixturedef.finish(item._request)
