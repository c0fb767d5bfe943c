"""Which TCP sockets a process tree listens on, read from /proc (Linux), for the "listen where told" tests.

A socket is matched to its process through the inode in /proc/PID/fd; the tree is every process whose
parent chain reaches one of the given roots (Ray's gcs_server, raylet and core workers are descendants
of the `ray start --block` we spawn).
"""

from __future__ import annotations

import ipaddress
import os
import threading
from dataclasses import dataclass
from pathlib import Path

LISTEN = "0A"


@dataclass(frozen=True)
class Listener:
    pid: int
    name: str
    ip: str
    port: int

    @property
    def loopback(self) -> bool:
        ip = ipaddress.ip_address(self.ip)
        return (getattr(ip, "ipv4_mapped", None) or ip).is_loopback  # ::ffff:127.0.0.1 is loopback too


def _parents() -> dict[int, int]:
    out = {}
    for d in Path("/proc").iterdir():
        if d.name.isdigit():
            try:
                stat = (d / "stat").read_text()
                out[int(d.name)] = int(stat.rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                pass
    return out


def process_tree(roots: list[int]) -> set[int]:
    parents = _parents()
    tree = {r for r in roots if r in parents}
    grew = True
    while grew:
        grew = False
        for pid, ppid in parents.items():
            if ppid in tree and pid not in tree:
                tree.add(pid)
                grew = True
    return tree


def _decode(hexaddr: str) -> tuple[str, int]:
    addr, port = hexaddr.split(":")
    raw = bytes.fromhex(addr)
    if len(raw) == 4:
        ip = str(ipaddress.IPv4Address(raw[::-1]))
    else:  # four little-endian 32-bit words
        ip = str(ipaddress.IPv6Address(b"".join(raw[i:i + 4][::-1] for i in range(0, 16, 4))))
    return ip, int(port, 16)


def _listening_inodes() -> dict[int, tuple[str, int]]:
    out = {}
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        try:
            lines = Path(table).read_text().splitlines()[1:]
        except OSError:
            continue
        for line in lines:
            f = line.split()
            if f[3] == LISTEN:
                out[int(f[9])] = _decode(f[1])
    return out


def listeners(roots: list[int]) -> list[Listener]:
    inodes = _listening_inodes()
    found = []
    for pid in sorted(process_tree(roots)):
        try:
            name = Path(f"/proc/{pid}/comm").read_text().strip()
            fds = os.listdir(f"/proc/{pid}/fd")
        except OSError:
            continue
        for fd in fds:
            try:
                target = os.readlink(f"/proc/{pid}/fd/{fd}")
            except OSError:
                continue
            if target.startswith("socket:[") and (ino := int(target[8:-1])) in inodes:
                found.append(Listener(pid, name, *inodes[ino]))
    return sorted(set(found), key=lambda x: (x.pid, x.port))


class ListenerSampler:
    """Collects `listeners(roots)` every `every_s` in a thread, for processes that come and go."""

    def __init__(self, roots: list[int], every_s: float = 0.3):
        self.roots, self.every_s = roots, every_s
        self.seen: set[Listener] = set()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    def start(self) -> "ListenerSampler":
        self._thread.start()
        return self

    def _run(self) -> None:
        while not self._stop.is_set():
            self.seen.update(listeners(self.roots))
            self._stop.wait(self.every_s)

    def stop(self) -> set[Listener]:
        self._stop.set()
        self._thread.join(timeout=10)
        return self.seen
