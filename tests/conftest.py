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
if "SMOLFORGE_HOME" not in os.environ or not os.environ.get("SMOLFORGE_KEEP_HOME"):
    # One home per test session: presets are built once, and nothing touches ~/.smolforge.
    os.environ["SMOLFORGE_HOME"] = tempfile.mkdtemp(prefix="smolforge-test-home-")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


@pytest.fixture(scope="session")
def tiny_llama_dir():
    from smolforge.models.tiny import preset_dir

    return preset_dir("tiny-llama")


# Longest modules first (seconds on a 2-core machine, from `--durations=0`). `make test` runs two
# pytest-xdist workers that each take whole modules (`--dist loadfile`), the next one when they
# finish: started early, a long module overlaps the many short ones; started last, it runs alone
# and the suite waits for it. Only the order changes, never what runs.
LONGEST_FIRST = [
    "cluster/test_cluster.py",  # ~800
    "cluster/test_param_server.py",  # ~420
    "test_distill_kd_vs_sft.py",  # ~100-300
    "cluster/test_distill_cluster.py",  # ~180
    "test_distill_cli.py",
    "test_cli.py",
    "cluster/test_distill_node_loss.py",
    "cluster/test_embedded_recovery.py",
    "cluster/test_netlab.py",
    "test_bad_input.py",
    "test_engine.py",
]


def pytest_collection_modifyitems(session, config, items):
    from pathlib import Path

    here = Path(__file__).resolve().parent
    rank = {name: i for i, name in enumerate(LONGEST_FIRST)}

    def key(item) -> int:
        try:
            return rank.get(Path(str(item.fspath)).resolve().relative_to(here).as_posix(), len(rank))
        except ValueError:
            return len(rank)

    items.sort(key=key)  # stable: each module keeps its own order
