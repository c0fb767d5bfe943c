"""A node's memory limit (`worker join --memory-limit`) as placement sees it, in one process.

The cluster proof (a model no capped worker holds alone, served and trained in 2 stages) is
tests/cluster/test_memory_cap.py; these check the pieces it rests on: the room a process has under
the limit, the cgroup v2 cap (on a fake cgroup tree: this machine's is v1), the planner's refusal
naming the limit, and how `job show` prints peak RSS per rank and per stage.
"""

from __future__ import annotations

import os
from pathlib import Path

import psutil
import pytest

from smolforge.errors import SmolforgeError
from smolforge.telemetry.memory import LIMIT_ENV, cgroup_room_bytes, memory_room_bytes, peak_rss_mb


def test_the_room_under_a_limit_is_the_limit_less_what_the_process_holds(monkeypatch):
    from smolforge.models.stage_costs import measure_node

    rss = psutil.Process().memory_info().rss
    monkeypatch.setenv(LIMIT_ENV, f"{(rss + 300e6) / 1e6:.0f}")
    room = memory_room_bytes(10**13)
    assert 200e6 < room <= 300e6 + 1e6, room  # what it holds now counts against the limit
    assert memory_room_bytes(50_000_000) == 50_000_000  # the machine's available memory, when that is less
    node = measure_node("n", seconds=0.01)
    assert node.limit_bytes == int(round((rss + 300e6) / 1e6) * 1e6) and node.free_memory_bytes <= 300e6 + 1e6, node
    monkeypatch.delenv(LIMIT_ENV)
    assert measure_node("n", seconds=0.01).limit_bytes is None


def test_peak_rss_is_this_process_own_not_its_parent_at_the_fork():
    """VmHWM, not ru_maxrss: a child of a big process would otherwise report the parent's memory."""
    import subprocess
    import sys

    ballast = bytearray(300 * 2**20)  # 300 MiB held here while the child starts
    ballast[::4096] = b"x" * len(ballast[::4096])
    child = subprocess.run([sys.executable, "-c", "from smolforge.telemetry.memory import peak_rss_mb; "
                            "print(peak_rss_mb())"], capture_output=True, text=True, check=True)
    assert float(child.stdout) < 200, (child.stdout, peak_rss_mb())
    del ballast


def fake_cgroup(tmp_path: Path, controllers: str = "cpu memory") -> tuple[Path, Path]:
    """A cgroup v2 tree like the kernel's: root/workers (this process's group), and /proc/self/cgroup."""
    root = tmp_path / "cgroup"
    group = root / "workers"
    group.mkdir(parents=True)
    (root / "cgroup.controllers").write_text(controllers + "\n")
    (group / "cgroup.subtree_control").write_text("\n")
    proc = tmp_path / "proc-self-cgroup"
    proc.write_text("0::/workers\n")
    return root, proc


def test_a_limit_becomes_memory_max_of_a_child_group_this_process_moves_into(tmp_path):
    from smolforge.cluster.nodes.memcap import apply_memory_cap

    root, proc = fake_cgroup(tmp_path)
    cap = apply_memory_cap(2_000_000_000, "w1", root=root, proc_cgroup=str(proc))
    assert cap.group == root / "workers" / f"smolforge-w1-{os.getpid()}", cap.why
    assert (cap.group / "memory.max").read_text() == "2000000000\n"
    assert (cap.group / "cgroup.procs").read_text() == f"{os.getpid()}\n"  # its children inherit the group
    assert (root / "workers" / "cgroup.subtree_control").read_text() == "+memory\n"
    assert "enforced by cgroup v2 memory.max" in cap.describe() and "2.00 GB" in cap.describe()
    # the room a process has is memory.max less memory.current, the tightest group on the way up
    (cap.group / "memory.current").write_text("1500000000\n")
    (proc).write_text(f"0::/workers/{cap.group.name}\n")
    assert cgroup_room_bytes(root, str(proc)) == 500_000_000


@pytest.mark.parametrize("controllers,why", [(None, "no cgroup v2"), ("cpu io", "no memory controller")])
def test_without_cgroup_v2_memory_the_limit_is_placement_only_and_says_why(tmp_path, controllers, why):
    from smolforge.cluster.nodes.memcap import apply_memory_cap

    root, proc = fake_cgroup(tmp_path, controllers or "")
    if controllers is None:
        (root / "cgroup.controllers").unlink()
    cap = apply_memory_cap(10**9, "w1", root=root, proc_cgroup=str(proc))
    assert cap.group is None and why in cap.why
    assert cap.describe().startswith("memory limit 1.00 GB: enforced by placement only (") and why in cap.describe()


def test_the_planner_refuses_a_model_no_capped_node_holds_naming_the_limit():
    from smolforge.cluster.control.stage_plan import ModelInfo, NodeCapacity, plan_serving

    info = ModelInfo(model_type="llama", layer_bytes=(400_000_000,) * 4, layer_flops=(1e9,) * 4, embed_bytes=50_000_000,
                     head_bytes=50_000_000, head_flops=1e8, hidden_size=1024, dtype_bytes=4, tied_bytes=50_000_000)
    capped = [NodeCapacity(f"w{i}", throughput=1e10, free_memory_bytes=1_100_000_000, limit_bytes=1_400_000_000)
              for i in (1, 2)]
    plan, hosts = plan_serving(info, capped, 2)  # in 2 stages it fits: 0.86 GB x 1.2 headroom each
    assert hosts == ["w1", "w2"] or hosts == ["w2", "w1"]
    with pytest.raises(SmolforgeError) as err:
        plan_serving(info, capped, 1)
    what = err.value.what
    assert "does not fit in 1 stage: it needs 2.0 GB (weights x 1.2 headroom)" in what, what
    assert "the most free on one node is 1.1 GB on w1: 880.0 MB missing" in what, what
    assert "weights are 1.6 GB in 32-bit" in what and "memory limit (worker join --memory-limit) is w1 1.4 GB" in what


def test_worker_join_refuses_a_memory_limit_below_a_tenth_of_a_gb():
    from smolforge.cluster.nodes.worker import WorkerOptions

    with pytest.raises(SmolforgeError, match="--memory-limit 0.05 is below 0.1"):
        WorkerOptions(coordinator="127.0.0.1:1", memory_gb=0.05).check()


def test_job_show_prints_peak_rss_per_rank_and_per_stage():
    from smolforge.cluster.control.jobview import memory_lines

    ranks = {"result": {"peak_rss_mb_per_rank": [812.4, 790.0], "nodes": ["w1", "w2"]}}
    assert memory_lines(ranks) == ["peak RSS: rank 0 812 MB on w1, rank 1 790 MB on w2"]
    stages = {"result": {"stages": [{"stage": 0, "node": "w1", "peak_rss_mb": 900.2, "memory_limit_mb": 1100.0},
                                    {"stage": 1, "node": "w2", "peak_rss_mb": None, "memory_limit_mb": None}]}}
    assert memory_lines(stages) == ["peak RSS: stage 0 900 MB on w1 (limit 1100 MB), stage 1 ? on w2"]
    assert memory_lines({"result": None}) == [] and memory_lines({"result": {"peak_rss_mb_per_rank": [None]}}) == []
