"""`smolforge dashboard`: the coordinator's API and dashboard for the embedded cluster, on loopback.

No second server: the embedded cluster's store, artifacts and job manager are wrapped in the same
CoordinatorCore the coordinator builds, and `cluster.api.create_app` serves them. A node monitor
starts a node agent on the in-process Ray cluster, so the page shows this machine's CPU, RAM and GPU
use live, as it does for a real cluster's nodes.

Only 127.0.0.1: an embedded cluster is this machine's alone. The token is the embedded state dir's
(`$SMOLFORGE_HOME/embedded/token`, made 0600 the first time); like every command it is never printed
nor put in argv: the announcement names the file, and the page takes it from its login box or from a
`#token=` fragment the user builds (a browser never sends a fragment to the server).

Jobs resumed from the page run in this process (as `job resume` runs them in its command); Ctrl-C
stops them, and the next embedded command finds them interrupted (paused) and resumable.
"""

from __future__ import annotations

import signal
import threading
import time
from typing import Callable

from smolforge import __version__
from smolforge.auth import load_or_create_token
from smolforge.cluster.coordinator import CoordinatorCore
from smolforge.cluster.embedded import EmbeddedCluster
from smolforge.cluster.nodes.node_agent import NodeMonitor
from smolforge.cluster.nodes.statedir import StateDir, check_port, free_port, port_open
from smolforge.errors import SmolforgeError
from smolforge.net import bind_refusal

HOST = "127.0.0.1"


def check_no_coordinator() -> None:
    """A coordinator running from $SMOLFORGE_HOME already serves the dashboard for its cluster."""
    info = StateDir.at(None).read_coordinator()
    if info and port_open(info.get("host_for_clients", HOST), int(info.get("port", 0)), 0.5):
        api = info.get("api") or f"http://{info.get('host_for_clients', HOST)}:{info['port']}"
        raise SmolforgeError(f"a coordinator is running ({api}); it serves the dashboard of its cluster",
                             fix=f"open {api}/dashboard (the token is in {StateDir.at(None).token_path}), "
                                 "or stop the coordinator to watch the embedded cluster")


def embedded_core(cluster: EmbeddedCluster, api: str) -> CoordinatorCore:
    """The embedded cluster as the API sees a coordinator: same store, artifacts and manager."""
    import ray

    cluster.handle  # noqa: B018  (Ray up first: the monitor and the page's node table read it)
    token = load_or_create_token(cluster.state.token_path)
    monitor = NodeMonitor(api, token, store=None)  # node joins of a local cluster are not job history
    info = {"name": "embedded", "api": api, "host": HOST, "host_for_clients": HOST, "ray_address": "local",
            "version": __version__, "node_id": ray.get_runtime_context().get_node_id(), "ray_tls": False}
    return CoordinatorCore(cluster.state, token, cluster.store, cluster.artifacts, cluster.manager, monitor, info)


def serve(port: int, announce: Callable[[str], None] = print, num_cpus: int | None = None,
          stop: threading.Event | None = None) -> None:
    """Serve until SIGINT/SIGTERM (or `stop` is set); then stop the monitor, the jobs and Ray."""
    import uvicorn

    from smolforge.cluster.api import create_app
    from smolforge.http_limits import server_config

    check_port(port, "--port", zero_picks=True)  # before the cluster starts, not at bind()
    check_no_coordinator()
    port = port or free_port(HOST)
    refused = bind_refusal(HOST, port)
    if refused is not None:
        raise refused
    cluster = EmbeddedCluster(num_cpus=num_cpus)
    core = None
    try:
        url = f"http://{HOST}:{port}"
        core = embedded_core(cluster, url)
        server = uvicorn.Server(server_config(create_app(core), HOST, port, log_level="warning", access_log=False,
                                              lifespan="off"))
        server.install_signal_handlers = lambda: None  # ours below: the same stop for both signals

        def _stop(signum, frame):
            server.should_exit = True

        if threading.current_thread() is threading.main_thread():
            signal.signal(signal.SIGINT, _stop)
            signal.signal(signal.SIGTERM, _stop)

        def _announce():
            while not server.started and not server.should_exit:
                time.sleep(0.05)
            if server.started:
                interrupted = f"\n  paused (interrupted) jobs: {', '.join(cluster.interrupted)}" if cluster.interrupted else ""
                announce(f"smolforge dashboard for the embedded cluster (this machine), Ctrl-C stops it\n"
                         f"  open: {url}/dashboard  (127.0.0.1 only)\n"
                         f"  token: in {cluster.state.token_path} (mode 0600): paste it in the page's login box, or "
                         f"open {url}/dashboard#token=$(cat {cluster.state.token_path}){interrupted}")
            while stop is not None and not server.should_exit:  # a caller in another thread ends it
                if stop.wait(0.2):
                    server.should_exit = True

        core.monitor.start()
        threading.Thread(target=_announce, daemon=True, name="dashboard-announce").start()
        server.run()
    finally:
        if core is not None:
            core.monitor.stop()
        cluster.close()
