"""Coordinator API latency with and without TLS, and a bounded load test, in one run.

Two coordinators are started on this machine one after the other (plain HTTP, then `--tls`), each
alone. For each:
- `GET /api/v1/status` on one kept-alive connection, and on a new connection per call (where TLS
  pays its handshake): p50 and p99;
- `POST /api/v1/jobs` (a 1-worker data-parallel job that waits for a worker, cancelled at once):
  p50 and p99 of the submit call;
- load: 200 authenticated status calls from 50 threads while 50 unauthenticated 10 MB posts arrive:
  p99 of those status calls, the 401 count, and the coordinator's RSS growth.
The plain coordinator is the baseline; TLS/plain ratios are printed.

    .venv/bin/python bench/api_latency.py [--calls 300]
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import httpx
import psutil
from launch_latency import cluster_env, spawn, wait_text  # bench/ is on sys.path when run as a script

MB = 2**20


def pct(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def start(tmp: Path, tls: bool, env: dict) -> tuple[subprocess.Popen, dict]:
    from smolforge.cluster.nodes.statedir import free_port

    state = tmp / ("tls" if tls else "plain")
    args = ["coordinator", "start", "--port", str(free_port()), "--ray-port", str(free_port()), "--state-dir",
            str(state), "--cpus", "0", "--object-store-mb", "100"] + (["--tls"] if tls else [])
    log = tmp / f"coord-{'tls' if tls else 'plain'}.log"
    proc = spawn(args, env, log)
    wait_text(proc, log, "Join workers with:")
    info = json.loads((state / "coordinator.json").read_text())
    info["token"] = (state / "token").read_text().strip()
    info["cert"] = str(state / "tls" / "cert.pem") if tls else None
    return proc, info


def client_kwargs(info: dict) -> dict:
    from smolforge.cluster.nodes.tls import trust_exactly

    kw = {"headers": {"Authorization": f"Bearer {info['token']}"}, "timeout": 30}
    if info["cert"]:
        kw["verify"] = trust_exactly(Path(info["cert"]).read_text())
    return kw


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return (time.perf_counter() - t0) * 1000


def unauth_post(host: str, port: int, tls_cert: str | None, size: int) -> int:
    """10 MB without a token: raw socket (TLS-wrapped for the TLS coordinator); returns the status."""
    import ssl

    s = socket.create_connection((host, port), timeout=30)
    if tls_cert:
        from smolforge.cluster.nodes.tls import trust_exactly

        s = trust_exactly(Path(tls_cert).read_text()).wrap_socket(s)
    s.sendall(f"POST /api/v1/jobs HTTP/1.1\r\nHost: {host}\r\nContent-Type: application/json\r\n"
              f"Content-Length: {size}\r\n\r\n".encode())
    try:
        chunk = b"1" * MB
        for _ in range(size // MB):
            s.sendall(chunk)
    except (BrokenPipeError, ConnectionResetError, ssl.SSLError):
        pass  # answered and closed without reading the rest
    try:
        data = s.recv(4096)
    except (ConnectionResetError, ssl.SSLError):
        data = b""
    s.close()
    return int(data.split()[1]) if data.startswith(b"HTTP/1.1 ") else 0


def measure(info: dict, pid: int, calls: int) -> dict:
    api = info["api"]
    kw = client_kwargs(info)
    out: dict = {}
    with httpx.Client(base_url=api, **kw) as c:
        for _ in range(20):
            c.get("/api/v1/status")  # warm
        kept = [timed(lambda: c.get("/api/v1/status").raise_for_status()) for _ in range(calls)]
    fresh = []
    for _ in range(max(50, calls // 3)):
        with httpx.Client(base_url=api, **kw) as c:
            fresh.append(timed(lambda: c.get("/api/v1/status").raise_for_status()))
    spec = {"kind": "data_parallel", "num_workers": 1, "max_retries": 0,
            "train": {"model": "tiny-llama", "data": {"path": "bundled"}, "max_steps": 5}}
    submits, codes = [], []
    with httpx.Client(base_url=api, **kw) as c:
        for _ in range(20):
            t0 = time.perf_counter()
            r = c.post("/api/v1/jobs", json=spec)
            submits.append((time.perf_counter() - t0) * 1000)
            codes.append(r.status_code)  # 400 when no node can run it: validated and placed all the same
            if r.status_code < 300:
                c.post(f"/api/v1/jobs/{r.json()['job_id']}/cancel")
    out["submit_status_codes"] = sorted(set(codes))
    for name, xs in (("status_keepalive", kept), ("status_new_connection", fresh), ("submit", submits)):
        out[name] = {"p50_ms": round(pct(xs, 0.5), 2), "p99_ms": round(pct(xs, 0.99), 2), "n": len(xs)}

    # load: 200 authenticated status calls (50 threads) while 50 unauthenticated 10 MB posts arrive
    proc = psutil.Process(pid)
    rss0 = proc.memory_info().rss
    peak = [rss0]
    stop = threading.Event()

    def watch():
        while not stop.is_set():
            peak[0] = max(peak[0], proc.memory_info().rss)
            time.sleep(0.05)

    threading.Thread(target=watch, daemon=True).start()
    host, port = api.split("://")[1].rsplit(":", 1)
    local = threading.local()

    def status_call() -> float:
        if not hasattr(local, "c"):
            local.c = httpx.Client(base_url=api, **kw)
        return timed(lambda: local.c.get("/api/v1/status").raise_for_status())

    with ThreadPoolExecutor(50) as pool, ThreadPoolExecutor(10) as attackers:
        bad = [attackers.submit(unauth_post, host, int(port), info["cert"], 10 * MB) for _ in range(50)]
        lat = list(pool.map(lambda _: status_call(), range(200)))
        codes = [f.result() for f in bad]
    stop.set()
    out["load"] = {"status_p50_ms": round(pct(lat, 0.5), 2), "status_p99_ms": round(pct(lat, 0.99), 2),
                   "unauthenticated_401": sum(c == 401 for c in codes), "unauthenticated_sent": len(codes),
                   "rss_before_mb": round(rss0 / MB, 1), "rss_peak_growth_mb": round((peak[0] - rss0) / MB, 1)}
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--calls", type=int, default=300)
    args = ap.parse_args()
    tmp = Path(tempfile.mkdtemp(prefix="sfa", dir="/tmp"))
    env = cluster_env(tmp)
    results = {}
    try:
        for tls in (False, True):
            proc, info = start(tmp, tls, env)
            try:
                results["tls" if tls else "plain"] = measure(info, proc.pid, args.calls)
            finally:
                proc.send_signal(signal.SIGTERM)  # it stops the Ray head it started
                try:
                    proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    os.killpg(proc.pid, signal.SIGKILL)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    p, t = results["plain"], results["tls"]
    results["tls_over_plain"] = {k: round(t[k]["p50_ms"] / p[k]["p50_ms"], 2)
                                 for k in ("status_keepalive", "status_new_connection", "submit")}
    print(json.dumps(results, indent=2))


if __name__ == "__main__":
    main()
