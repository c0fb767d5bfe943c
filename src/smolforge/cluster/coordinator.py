"""`smolforge coordinator start`: the Ray head plus the control service, on the user's main machine.

Start-up order, and why:
1. The token (created once, 0600) — Ray and the API both need it before anything listens.
2. The Ray head, as our own child (`ray start --head --block`). If a head from an earlier run of this
   coordinator is still up on the Ray port (the coordinator was killed, the head was not), we attach
   to it instead: the workers stay connected and nothing has to re-join.
   The head advertises the coordinator's CPUs but not the `smolforge-worker` resource, so training
   never lands here unless a job is explicitly lent this node (`smolforge job join`).
3. The job store, then the job manager recovers jobs that were running (from their last checkpoint).
4. The node monitor (agents, heartbeats) and the FastAPI service.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import sys
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from smolforge import __version__
from smolforge.cluster.nodes import ray_glue, ray_process, ray_tls
from smolforge.cluster.control.artifacts import ArtifactStore, upload_refs
from smolforge.auth import load_or_create_token
from smolforge.cluster.nodes.ray_auth import apply_ray_auth, ray_auth_env
from smolforge.cluster.nodes.discovery import check_models_dir, detect_cpus, detect_ram_gb, scan_hf_cache, scan_models_dir, with_aliases
from smolforge.cluster.control.jobstore import JobStore
from smolforge.cluster.nodes.statedir import StateDir, check_port, check_ray_port, port_open
from smolforge.cluster.nodes.tls import ensure_cert, fingerprint
from smolforge.errors import SmolforgeError
from smolforge.net import LOOPBACK, bind_refusal


def outward_ip() -> str:
    """The address other machines reach us at (no packet is sent)."""
    try:
        with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
            s.connect(("10.255.255.255", 1))
            return s.getsockname()[0]
    except OSError:
        return "127.0.0.1"


def _is_ray_start(pid: int) -> bool:
    try:
        cmd = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
    except OSError:
        return False
    return b"start" in cmd and b"--head" in cmd




@dataclass
class CoordinatorCore:
    state: StateDir
    token: str
    store: JobStore
    artifacts: ArtifactStore
    manager: Any
    monitor: Any
    info: dict[str, Any] = field(default_factory=dict)
    started: float = field(default_factory=time.time)

    def collect_uploads(self) -> list[str]:
        """Delete uploads that no pending, running or paused job names (after a grace period)."""
        live: set[str] = set()
        for job in self.store.list_jobs(states=("pending", "running", "paused"), limit=100_000):
            live |= upload_refs(job["spec"])
        return self.artifacts.gc_uploads(live)

    def public_info(self) -> dict[str, Any]:
        return {k: self.info[k] for k in ("name", "api", "ray_address", "ray_port", "version", "node_id", "ray_tls")
                if k in self.info} | {"uptime_s": round(time.time() - self.started, 1)}


@dataclass
class CoordinatorOptions:
    host: str = "127.0.0.1"
    port: int = 5000
    ray_port: int = 6379
    state_dir: str | None = None
    name: str = "coordinator"
    cpus: int | None = None
    models_dir: str | None = None
    object_store_mb: int | None = None
    tls: bool = False
    tls_cert: str | None = None  # with tls_key: the user's own certificate instead of a generated one
    tls_key: str | None = None

    def check(self) -> "CoordinatorOptions":
        """Numbers a bad flag would otherwise break only after the Ray head is up: checked first."""
        check_port(self.port, "--port")
        check_ray_port(self.ray_port, "--ray-port")
        if self.port == self.ray_port:
            raise SmolforgeError(f"--port and --ray-port are both {self.port}", fix="give them different ports")
        for flag, value, low in (("--cpus", self.cpus, 0), ("--object-store-mb", self.object_store_mb, 75)):
            if value is not None and value < low:
                raise SmolforgeError(f"{flag} {value} is below {low}", where=flag, fix=f"give {low} or more, or leave it out")
        return self


class Coordinator:
    def __init__(self, opts: CoordinatorOptions):
        self.opts = opts.check()
        self.state = StateDir.at(opts.state_dir)
        self.head_proc = None
        self.core: CoordinatorCore | None = None
        self.server = None
        self.attached = False

    # -- pieces ---------------------------------------------------------------------------------

    def _tls_files(self, client_host: str) -> tuple[tuple[str, str] | None, str | None]:
        """(cert, key) paths and the certificate's PEM when serving TLS; (None, None) otherwise."""
        o = self.opts
        if not (o.tls or o.tls_cert or o.tls_key):
            return None, None
        if bool(o.tls_cert) != bool(o.tls_key):
            raise SmolforgeError("--tls-cert and --tls-key go together", fix="give both, or neither (--tls makes one)")
        if o.tls_cert:
            cert, key = Path(o.tls_cert).expanduser(), Path(o.tls_key).expanduser()
            for p in (cert, key):
                if not p.is_file():
                    raise SmolforgeError("no such file", where=str(p), fix="give the PEM files of your certificate")
        else:
            cert, key = ensure_cert(self.state.root, [client_host, self._node_ip()])
        try:
            pem = cert.read_text()
            fingerprint(pem)
        except (OSError, ValueError, UnicodeDecodeError) as err:
            raise SmolforgeError(f"not a PEM certificate: {err}", where=str(cert), fix="give a PEM certificate") from err
        return (str(cert), str(key)), pem

    def _node_ip(self) -> str:
        h = self.opts.host
        if h in LOOPBACK:
            return "127.0.0.1"
        if h in ("0.0.0.0", "", "::"):
            return outward_ip()
        return h

    def _check_not_running(self) -> None:
        info = self.state.read_coordinator()
        if info and info.get("pid") and info.get("pid") != os.getpid():
            try:
                os.kill(int(info["pid"]), 0)
                alive = True
            except (ProcessLookupError, ValueError):
                alive = False
            except PermissionError:
                alive = True
            if alive and port_open(info.get("host_for_clients", "127.0.0.1"), int(info.get("port", 0)), 0.5):
                raise SmolforgeError(f"a coordinator (pid {info['pid']}) already runs from {self.state.root}",
                                     fix="use it, or stop it first (Ctrl-C in its terminal)")
        refused = bind_refusal(self.opts.host, self.opts.port)  # the OS's reason, never a guess
        if refused is not None:
            raise refused

    def _start_head(self, token_path: Path) -> None:
        ip = self._node_ip()
        if port_open(ip, self.opts.ray_port, 0.5):
            prev = self.state.read_coordinator() or {}
            if prev.get("ray_port") == self.opts.ray_port:
                self.attached = True  # our earlier head survived the coordinator: keep it and its workers
                self.head_pid = prev.get("head_pid")
                return
            raise SmolforgeError(f"Ray port {self.opts.ray_port} is taken by something this coordinator did not start",
                                 fix="pick another --ray-port")
        cpus = self.opts.cpus if self.opts.cpus is not None else detect_cpus()
        models = scan_hf_cache()
        models.update(scan_models_dir(Path(self.opts.models_dir) if self.opts.models_dir else None))
        resources = {ray_glue.HEAD_RESOURCE: 1000.0, **ray_glue.advertised_models(with_aliases(models))}
        labels = {ray_glue.NAME_LABEL: self.opts.name, ray_glue.ROLE_LABEL: "coordinator",
                  ray_glue.RAM_LABEL: f"{detect_ram_gb():.1f}"}
        env = {**os.environ, **ray_auth_env(token_path), "RAY_USAGE_STATS_ENABLED": "0",
               "SMOLFORGE_NODE_NAME": self.opts.name, "SMOLFORGE_NODE_DIR": str(self.state.node_dir),
               "SMOLFORGE_MODEL_PATHS": json.dumps(with_aliases(models)), **ray_process.metrics_port_env()}
        env.pop("RAY_AUTH_TOKEN", None)
        log = self.state.root / "logs" / "ray-head.log"
        # fresh ports each attempt: one picked free may be taken before Ray binds it, and Ray then exits
        self.head_proc = ray_process.start_head(
            lambda: ray_process.head_command(self.opts.ray_port, cpus=cpus, node_ip=ip, name=self.opts.name,
                                             resources=resources, labels=labels, temp_dir=os.environ.get("RAY_TMPDIR"),
                                             object_store_mb=self.opts.object_store_mb),
            ip, self.opts.ray_port, env, log, timeout=60)
        self.head_pid = self.head_proc.pid

    def _connect(self, token_path: Path) -> None:
        import ray

        addr = f"{self._node_ip()}:{self.opts.ray_port}"
        apply_ray_auth(token_path)
        deadline = time.time() + 60
        while True:
            try:
                ray_glue.connect(addr, state_dir=self.state.root)
                return
            except SmolforgeError:
                if time.time() > deadline:
                    raise
                if ray.is_initialized():
                    ray.shutdown()
                time.sleep(1)

    # -- lifecycle -------------------------------------------------------------------------------

    def setup(self) -> CoordinatorCore:
        from smolforge.cluster.control.manager import JobManager
        from smolforge.cluster.nodes.node_agent import NodeMonitor

        check_models_dir(self.opts.models_dir)
        self._check_not_running()
        ip = self._node_ip()
        client_host = ip if self.opts.host in ("0.0.0.0", "", "::") else self.opts.host
        self.tls_files, tls_pem = self._tls_files(client_host)  # bad TLS options fail before Ray starts
        token = load_or_create_token(self.state.token_path)
        if self.tls_files:  # Ray's own traffic encrypted too: this cluster's CA signs every node's certificate
            os.environ.update(ray_tls.issue_node_files(self.state.root / "tls", self.state.root / "tls" / "node",
                                                       ray_tls.machine_addresses()))
        self._start_head(self.state.token_path)
        self._connect(self.state.token_path)
        api = f"{'https' if self.tls_files else 'http'}://{client_host}:{self.opts.port}"
        store = JobStore(self.state.db_path)
        artifacts = ArtifactStore(self.state.artifacts)
        manager = JobManager(store, artifacts)
        monitor = NodeMonitor(api, token, store, ca_pem=tls_pem)
        import ray

        info = {"name": self.opts.name, "api": api, "host": self.opts.host, "host_for_clients": client_host,
                "port": self.opts.port, "ray_address": f"{ip}:{self.opts.ray_port}", "ray_port": self.opts.ray_port,
                "pid": os.getpid(), "head_pid": getattr(self, "head_pid", None), "version": __version__,
                "node_id": ray.get_runtime_context().get_node_id(), "state_dir": str(self.state.root),
                "attached": self.attached, "started": time.time(),
                "tls_fingerprint": fingerprint(tls_pem) if tls_pem else None, "ray_tls": bool(self.tls_files)}
        self.core = CoordinatorCore(self.state, token, store, artifacts, manager, monitor, info)
        artifacts.clean_upload_temps()  # half-written by a coordinator that was killed
        self.core.collect_uploads()
        return self.core

    def serve(self, ready: threading.Event | None = None, announce=print) -> None:
        """Run until SIGINT/SIGTERM; then stop the API, the monitor and (if we started it) the Ray head."""
        import uvicorn

        from smolforge.cluster.api import create_app
        from smolforge.http_limits import server_config

        core = self.core or self.setup()
        app = create_app(core)
        tls = dict(ssl_certfile=self.tls_files[0], ssl_keyfile=self.tls_files[1]) if self.tls_files else {}
        config = server_config(app, self.opts.host, self.opts.port, log_level="warning", access_log=False,
                               lifespan="off", **tls)
        self.server = uvicorn.Server(config)
        self.server.install_signal_handlers = lambda: None  # we handle signals ourselves

        def _stop(signum, frame):
            self.server.should_exit = True

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, _stop)
            signal.signal(signal.SIGTERM, _stop)
        core.monitor.start()
        resumed = core.manager.recover()

        def _announce():
            while not self.server.started and not self.server.should_exit:
                time.sleep(0.05)
            if not self.server.started:
                return
            self.state.write_coordinator(core.info)
            host = core.info["host_for_clients"]
            lines = [
                f"smolforge coordinator '{core.info['name']}' is up"
                + (" (re-attached to the running Ray head)" if self.attached else ""),
                f"  API:        {core.info['api']}   (Authorization: Bearer <token>)",
                f"  dashboard:  {core.info['api']}/dashboard#token=<token>",
                f"  Ray:        {core.info['ray_address']} (token auth on)",
                f"  state:      {self.state.root}",
                f"  token file: {self.state.token_path}",
            ]
            fp = core.info.get("tls_fingerprint")
            if fp:
                lines.append(f"  TLS:        certificate {fp} (clients pin it: --tls-fingerprint)")
            if resumed:
                lines.append(f"  resuming {len(resumed)} job(s): {', '.join(resumed)}")
            if host in LOOPBACK:
                lines.append("  (listening on 127.0.0.1: only this machine can join; use --host 0.0.0.0 for a LAN)")
            elif not fp:
                lines.append("  warning: plain HTTP: the token and job data cross this network in clear. Fine on a "
                             "network you trust (your home LAN); on a shared Wi-Fi, reach the coordinator through an "
                             "SSH tunnel or a VPN instead")
            lines.append("Join workers with:")
            # The token itself is never printed (terminals are logged and shared): the command names
            # the token file, which another machine needs a copy of.
            pin = f" --tls-fingerprint {fp}" if fp else ""
            lines.append(f"  smolforge worker join {core.info['api']}{pin} --token-file {self.state.token_path}")
            if host not in LOOPBACK:
                lines.append(f"  (on another machine, copy the token file there first, e.g. "
                             f"`scp {host}:{self.state.token_path} ~/smolforge-token`, and name that copy)")
            announce("\n".join(lines))
            if ready is not None:
                ready.set()

        threading.Thread(target=_announce, daemon=True).start()
        try:
            self.server.run()
        finally:
            self.shutdown()

    def shutdown(self) -> None:
        if self.core is not None:
            self.core.monitor.stop()
            self.core.manager.shutdown(timeout=5)
        import ray

        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:  # whatever Ray said, the head we started goes
            if self.head_proc is not None:
                ray_process.stop(self.head_proc, timeout=20)
                self.head_proc = None
            elif self.attached and getattr(self, "head_pid", None) and _is_ray_start(int(self.head_pid)):
                ray_process.stop(None, pid=int(self.head_pid), timeout=20)
        info = self.state.read_coordinator()
        if info and info.get("pid") == os.getpid():
            try:
                self.state.coordinator_file.unlink()
            except OSError:
                pass
        sys.stdout.flush()
