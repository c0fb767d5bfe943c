"""TLS, simply: `coordinator start --tls` makes a certificate once and prints its fingerprint in the
join command; a worker that pins it joins over https (its heartbeats too), gets its own certificate
for Ray's TLS from the cluster's CA, and a data-parallel job runs over Ray's TLS; a worker pinning another fingerprint is refused before it sends the token; an https address is
never downgraded, and a plain-http client gets no answer from the TLS port."""

from __future__ import annotations

import json
import subprocess
import sys
import time

import pytest

from localcluster import LocalCluster
from smolforge.errors import SmolforgeError

pytestmark = [pytest.mark.timeout(600)]


def test_a_tls_cluster_pins_its_certificate(tmp_path):
    from smolforge.client import Client
    from smolforge.data.synthetic import generate

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(32, seed=2)))
    with LocalCluster(tmp_path) as c:
        c.start_coordinator(tls=True)
        fp = c.tls_fingerprint
        info = json.loads((c.state / "coordinator.json").read_text())
        assert fp and fp.startswith("sha256:") and info["api"] == f"https://127.0.0.1:{c.port}"
        assert f"smolforge worker join https://127.0.0.1:{c.port} --tls-fingerprint {fp}" in c.coordinator.output()
        key = c.state / "tls" / "key.pem"
        assert key.stat().st_mode & 0o777 == 0o600

        c.add_worker("w1")  # https + the pinned fingerprint
        nodes = c.wait_nodes(["coordinator", "w1"])  # "online" needs heartbeats: they came over TLS too
        assert all(n["usage"] for n in nodes if n["name"] == "w1")

        client = c.client()
        job = client.submit_job({"kind": "data_parallel", "num_workers": 1, "train": {
            "model": "tiny-llama", "data": {"path": str(data), "max_eval_samples": 4, "max_length": 48},
            "max_steps": 4, "batch_size": 2, "save_every": 2, "eval_accuracy": False}})
        deadline = time.time() + 300
        while (st := client.get_job_status(job))["state"] not in ("completed", "failed") and time.time() < deadline:
            time.sleep(0.5)
        assert st["state"] == "completed", st

        # Ray's own traffic is TLS too (mutual, each node's certificate signed by the cluster's CA):
        # its GCS answers no plaintext call, even one with the token
        import grpc

        with grpc.insecure_channel(f"127.0.0.1:{c.ray_port}") as channel:
            with pytest.raises(grpc.RpcError) as err:
                channel.unary_unary("/ray.rpc.NodeInfoGcsService/GetAllNodeInfo")(
                    b"", timeout=10, metadata=[("authorization", f"Bearer {c.token}")])
            assert err.value.code() == grpc.StatusCode.UNAVAILABLE
        assert (c.state / "tls" / "ray-ca.key").stat().st_mode & 0o777 == 0o600  # it never leaves
        assert (tmp_path / "node-w1" / "tls" / "ray-node.pem").is_file()  # w1 asked for its own
        assert c.api("POST", "/api/v1/ray-tls/certificate", json={"csr": "junk"}).status_code == 400
        assert c.api("POST", "/api/v1/ray-tls/certificate", token=None, json={"csr": "x"}).status_code == 401
        # a script's Ray driver (the seeds' orchestrator API) gets its own certificate the same way
        driver = subprocess.run(
            [sys.executable, "-c", "import ray; from smolforge import create_distributed_training as c; "
             "o = c(mode='data_parallel'); o.cluster; print('NODES', len(ray.nodes()))"],
            env={**c.env, "SMOLFORGE_COORDINATOR": c.hostport, "SMOLFORGE_TOKEN": c.token,
                 "SMOLFORGE_TLS_FINGERPRINT": fp, "SMOLFORGE_HOME": str(tmp_path / "driver-home")},
            capture_output=True, text=True, timeout=120)
        assert "NODES 2" in driver.stdout, driver.stdout[-1000:] + driver.stderr[-3000:]

        bad = c.add_worker("intruder", wait=False, tls_fingerprint="sha256:" + "0" * 64)
        bad.p.wait(timeout=120)  # a hang guard: the refusal is the exit code and the message
        assert bad.p.returncode == 2, bad.output()[-2000:]
        assert "not the pinned" in bad.output() and "no token was sent" in bad.output()

        with pytest.raises(SmolforgeError, match="fingerprint"):  # https without a pin: refused, not downgraded
            Client(f"https://127.0.0.1:{c.port}", token=c.token, state_dir=tmp_path / "elsewhere")
        with pytest.raises(SmolforgeError, match="cannot reach"):  # plain http to the TLS port gets nothing
            Client(f"127.0.0.1:{c.port}", token=c.token).status()
        local = Client(state_dir=c.state)  # this machine's coordinator: address, token and pin from its state dir
        assert local.base == info["api"] and local.status()["coordinator"]["name"] == "coordinator"
