"""`worker join --memory-limit GB`: the worker's process tree under a cgroup v2 `memory.max`, where the machine allows it.

Why: the limit is what placement and the stage planner count for the node (`telemetry.memory`), but a
count is a promise. Where the kernel can enforce it, the worker moves itself into a child cgroup
with `memory.max` = the limit before it starts its Ray node, so the Ray node and every stage or rank
it runs inherit the cap: a process that outgrows it is stopped by the kernel on this node only,
never by the machine's OOM killer elsewhere. Where it cannot (cgroup v1, no memory controller, no
right to create a group), the limit is enforced by placement alone and the worker says so.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path

from smolforge.telemetry.memory import CGROUP_ROOT, own_cgroup


@dataclass
class MemoryCap:
    """Where the cap landed: `group` when the kernel enforces it, else `why` it does not."""

    limit_bytes: int
    group: Path | None = None
    parent: Path | None = None
    why: str = ""

    def describe(self) -> str:
        size = f"{self.limit_bytes / 1e9:.2f} GB"
        if self.group is not None:
            return f"memory limit {size}: enforced by cgroup v2 memory.max ({self.group})"
        return f"memory limit {size}: enforced by placement only ({self.why})"

    def release(self) -> None:
        """This process back to its parent group and the child removed (best effort: at exit)."""
        if self.group is None or self.parent is None:
            return
        try:
            (self.parent / "cgroup.procs").write_text(f"{os.getpid()}\n")
            self.group.rmdir()
        except OSError:
            pass  # a Ray process still in it: the kernel removes nothing; the empty group stays harmless


def apply_memory_cap(limit_bytes: int, name: str, root: str | Path = CGROUP_ROOT,
                     proc_cgroup: str = "/proc/self/cgroup") -> MemoryCap:
    """Put this process (and so whatever it starts later) under `memory.max` = `limit_bytes` in a child
    cgroup of its own; the answer says where, or why not."""
    root = Path(root)
    cap = MemoryCap(limit_bytes)
    try:
        controllers = (root / "cgroup.controllers").read_text().split()
    except OSError:
        cap.why = f"no cgroup v2 at {root}"
        return cap
    parent = own_cgroup(root, proc_cgroup)
    if "memory" not in controllers or parent is None:
        cap.why = "cgroup v2 has no memory controller here"
        return cap
    group = parent / f"smolforge-{name}-{os.getpid()}"
    try:
        if "memory" not in (parent / "cgroup.subtree_control").read_text().split():
            (parent / "cgroup.subtree_control").write_text("+memory\n")
        group.mkdir(exist_ok=True)
        (group / "memory.max").write_text(f"{int(limit_bytes)}\n")
        if (group / "memory.swap.max").exists():
            (group / "memory.swap.max").write_text("0\n")  # the cap means RAM: no spilling past it to swap
        (group / "cgroup.procs").write_text(f"{os.getpid()}\n")
    except OSError as err:
        cap.why = f"cannot create a memory cgroup under {parent}: {err.strerror or err}"
        try:
            group.rmdir()
        except OSError:
            pass
        return cap
    cap.group, cap.parent = group, parent
    return cap
