"""`distill.remotes.remotes()`: the Ray remote classes and functions, built once and shared by every job a
driver runs at once."""

from __future__ import annotations

import sys
import threading


def test_concurrent_first_calls_never_see_a_partial_table():
    """Several distillation jobs start at once in one driver (the demo runs four stages' jobs): every first
    caller of `remotes()` gets the whole table. It was filled key by key behind an `if not _REMOTES`, so a
    second caller could see it with "teacher" and not yet "broker" (CI, stop 58: the demo's teacher task
    failed with KeyError: 'broker'). Many rounds of many threads at a tiny switch interval, no clock."""
    from smolforge.cluster.workloads.distill import remotes as module

    old = sys.getswitchinterval()
    sys.setswitchinterval(1e-6)
    missing: list[str] = []
    try:
        for _ in range(30):
            module._REMOTES.clear()
            start = threading.Barrier(8)

            def first_call() -> None:
                start.wait()
                table = module.remotes()
                missing.extend(k for k in ("teacher", "broker", "student") if k not in table)

            threads = [threading.Thread(target=first_call) for _ in range(8)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(timeout=60)
    finally:
        sys.setswitchinterval(old)
        module._REMOTES.clear()
    assert not missing, f"{len(missing)} callers saw a partial table: {sorted(set(missing))}"
