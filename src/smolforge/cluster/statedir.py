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

from smolforge.paths import atomic_write_json, home, private_dir


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


def free_port(host: str = "127.0.0.1") -> int:
    """A port that was free a moment ago (bind to 0, read it, close)."""
    return free_ports(1, host)[0]


def free_ports(n: int, host: str = "127.0.0.1", exclude: set[int] | frozenset[int] = frozenset()) -> list[int]:
    """`n` distinct ports that were free a moment ago, none of them in `exclude`.

    The sockets stay bound until all are picked, so no port comes back twice; `exclude` holds ports
    already promised to another component but not bound yet (a Ray head's GCS port: picking it
    again for the client server made `ray start` refuse, seen in CI).
    """
    socks: list[socket.socket] = []
    ports: list[int] = []
    try:
        while len(ports) < n:
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            socks.append(s)
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((host, 0))
            port = s.getsockname()[1]
            if port not in exclude:
                ports.append(port)
    finally:
        for s in socks:
            s.close()
    return ports
