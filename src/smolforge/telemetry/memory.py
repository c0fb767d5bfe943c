"""How much memory this process has needed: its peak resident set, for run summaries."""

from __future__ import annotations

import os
import resource
import sys
from pathlib import Path


def peak_rss_mb() -> float:
    """The most resident memory this process has held so far, in MiB.

    On Linux its VmHWM, not `ru_maxrss`: the kernel carries ru_maxrss across fork and exec, so a
    process started by a big one (a subprocess of a test that built a model) would report its
    parent's memory at the fork as its own peak. Elsewhere ru_maxrss (macOS reports bytes)."""
    try:
        with open("/proc/self/status") as status:
            for line in status:
                if line.startswith("VmHWM:"):
                    return int(line.split()[1]) / 1024  # kB
    except (OSError, ValueError, IndexError):
        pass
    peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    return peak / (2**20 if sys.platform == "darwin" else 1024)


LIMIT_ENV = "SMOLFORGE_MEMORY_LIMIT_MB"  # `worker join --memory-limit`: set for every process of that node
CGROUP_ROOT = "/sys/fs/cgroup"


def memory_limit_bytes() -> int | None:
    """The node's memory limit (`worker join --memory-limit`, through its Ray node's environment), or None."""
    try:
        mb = float(os.environ.get(LIMIT_ENV, "") or "nan")
    except ValueError:
        return None
    return int(mb * 1e6) if mb > 0 else None


def own_cgroup(root: str | Path = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> Path | None:
    """This process's cgroup v2 directory (the `0::` line of /proc/self/cgroup), or None on cgroup v1."""
    try:
        line = next(ln for ln in Path(proc_cgroup).read_text().splitlines() if ln.startswith("0::"))
    except (OSError, StopIteration):
        return None
    return Path(root) / line[3:].lstrip("/")


def cgroup_room_bytes(root: str | Path = CGROUP_ROOT, proc_cgroup: str = "/proc/self/cgroup") -> int | None:
    """What this process's cgroup v2 (and each group above it) still lets it take: the smallest
    memory.max - memory.current on the way up; None outside cgroup v2 or with no memory.max set."""
    path, rooms = own_cgroup(root, proc_cgroup), []
    if path is None:
        return None
    for group in [path, *path.parents]:
        if not group.is_relative_to(root):
            break
        try:
            cap, used = (group / "memory.max").read_text().strip(), int((group / "memory.current").read_text())
        except (OSError, ValueError):
            continue
        if cap != "max":
            rooms.append(int(cap) - used)
    return max(0, min(rooms)) if rooms else None


def memory_room_bytes(available: int) -> int:
    """What this process may still take on its node: the machine's available memory, within the node's
    limit (less what this process already holds: a stage or rank planned here adds its weights to the
    runtime it has loaded) and within its cgroup's memory.max. Placement sizes stages with this."""
    import psutil

    room = [available]
    limit = memory_limit_bytes()
    if limit is not None:
        room.append(limit - psutil.Process().memory_info().rss)
    cgroup = cgroup_room_bytes()
    if cgroup is not None:
        room.append(cgroup)
    return max(0, min(room))


M_MMAP_THRESHOLD = -3  # glibc's mallopt parameter number (malloc.h)
MMAP_THRESHOLD_BYTES = 1 << 20


def return_freed_memory() -> bool:
    """Make glibc hand blocks of 1 MiB and more straight back to the system when they are freed.

    By default glibc raises its mmap threshold to the size of each large block freed (up to 32 MB),
    so later tensors of that size come from its heap, and a heap fragmented by many such blocks never
    shrinks: a process that gathers and frees weights block by block (FSDP) holds far more than it
    uses. Measured on a 100M-parameter full fine-tune with fsdp, 2 ranks: a rank's training peak RSS
    2.5 GB by default, 1.66 GB with a fixed 1 MiB threshold (64 KiB: 1.61 GB, but 50% more CPU per
    step on small models; 1 MiB: about 5%). The price: every large tensor is a fresh mapping whose
    pages are faulted in each step, about 1.4x the CPU per step for fsdp on that model. So only fsdp,
    whose point is memory, asks for it; DDP's peak moves by 1% with it.
    False where there is no glibc (macOS, musl): nothing changes there.
    """
    if not sys.platform.startswith("linux"):
        return False
    import ctypes

    try:
        libc = ctypes.CDLL("libc.so.6")
        return bool(libc.mallopt(M_MMAP_THRESHOLD, MMAP_THRESHOLD_BYTES))
    except (OSError, AttributeError):
        return False
