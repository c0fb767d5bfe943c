"""The coordinator's state directory: one place for everything that must survive a restart.

Layout (all under `--state-dir`, default `$SMOLFORGE_HOME`):
    token               the cluster token (mode 0600): Ray token auth and the API bearer token
    coordinator.json    where the running coordinator listens (API host/port, Ray address, PIDs)
    jobs.db             the SQLite job store (WAL)
    artifacts/          checkpoints, adapters, uploaded datasets

Worker nodes keep their own copy of the token in their own state dir (`node-token`), also 0600.
"""

from __future__ import annotations

import json
import socket
from dataclasses import dataclass
from pathlib import Path

from smolforge.errors import SmolforgeError
from smolforge.paths import atomic_write_json, home, private_dir

RAY_WORKER_PORTS = range(10002, 20000)  # Ray's default --min/--max-worker-port: its worker processes bind these


@dataclass(frozen=True)
class StateDir:
    root: Path

    @classmethod
    def at(cls, path: str | Path | None = None) -> "StateDir":
        root = Path(path).expanduser().resolve() if path else home().resolve()
        created = not root.exists()
        root.mkdir(mode=0o700, parents=True, exist_ok=True)
        if created or path is None:  # ours: private; a dir the user named that existed keeps its mode
            private_dir(root)
        private_dir(root / "logs")
        return cls(root)

    @property
    def token_path(self) -> Path:
        return self.root / "token"

    @property
    def node_token_path(self) -> Path:
        return self.root / "node-token"

    @property
    def db_path(self) -> Path:
        return self.root / "jobs.db"

    @property
    def artifacts(self) -> Path:
        return self.root / "artifacts"

    @property
    def coordinator_file(self) -> Path:
        return self.root / "coordinator.json"

    @property
    def node_dir(self) -> Path:
        """Scratch space for training tasks on this machine (per-job output dirs)."""
        return self.root / "node"

    def read_coordinator(self) -> dict | None:
        try:
            return json.loads(self.coordinator_file.read_text())
        except (OSError, ValueError):
            return None

    def write_coordinator(self, info: dict) -> None:
        atomic_write_json(self.coordinator_file, info)


def port_open(host: str, port: int, timeout: float = 1.0) -> bool:
    """True when something accepts TCP connections at host:port (no data is sent)."""
    try:
        with socket.create_connection((host, int(port)), timeout=timeout):
            return True
    except OSError:
        return False


def check_port(port: int, flag: str = "--port", *, zero_picks: bool = False) -> int:
    """A port number from the command line, checked before anything starts (out of range, bind()
    raised OverflowError, after a Ray head was already up); with `zero_picks`, 0 means "pick one"."""
    low = 0 if zero_picks else 1
    if not low <= port <= 65535:
        raise SmolforgeError(f"{flag} {port} is not a port number", where=flag,
                             fix=f"use a port from {low} to 65535" + (" (0 picks a free one)" if zero_picks else ""))
    return port


def check_ray_port(port: int, flag: str = "--ray-port") -> int:
    """A Ray head's GCS port: a port number outside the range where Ray starts its workers (inside it,
    `ray start` died with its own stack, or a worker took the port later)."""
    check_port(port, flag)
    if port in RAY_WORKER_PORTS:
        raise SmolforgeError(f"{flag} {port} is inside Ray's worker-port range "
                             f"({RAY_WORKER_PORTS.start}-{RAY_WORKER_PORTS.stop - 1}), where Ray starts its workers",
                             where=flag, fix=f"pick a port outside {RAY_WORKER_PORTS.start}-{RAY_WORKER_PORTS.stop - 1}, "
                                             "e.g. --ray-port 6379 (the default)")
    return port


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to 0, read it, close)."""
    return free_ports(1, host)[0]


# Ports we hand out come from here: below Linux's ephemeral range (32768-60999, where every outgoing
# connection takes its local port, so a port read off `bind(0)` can be taken by the next connect before
# our server binds it: seen in CI as "address already in use") and above Ray's worker ports (10002-19999).
PICK_PORTS = range(20000, 32768)


def free_ports(n: int, host: str = "127.0.0.1", exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """`n` distinct ports that were free a moment ago, none of them in `exclude`, from PICK_PORTS.

    The sockets stay bound until all are picked, so no port comes back twice; `exclude` holds ports
    already promised to another component but not bound yet (a Ray head's GCS port: picking it
    again for the client server made `ray start` refuse, seen in CI).
    """
    import random

    socks: list[socket.socket] = []
    ports: list[int] = []
    candidates = random.sample(PICK_PORTS, len(PICK_PORTS))
    try:
        for port in candidates:
            if len(ports) == n:
                break
            if port in exclude:
                continue
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                s.bind((host, port))
            except OSError:
                s.close()
                continue
            socks.append(s)
            ports.append(port)
    finally:
        for s in socks:
            s.close()
    if len(ports) < n:
        raise OSError(f"no {n} free ports on {host} in {PICK_PORTS.start}-{PICK_PORTS.stop - 1}")
    return ports
