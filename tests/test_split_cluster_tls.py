"""A split job's trunk on a `--tls` cluster, in-process and without Ray: the trunk serves gRPC over TLS
with its node's certificate (the one the cluster's CA signed for Ray's own TLS, named by the node's
Ray environment), the job's client trusts exactly that CA and keeps the token check. A relay between
them records the bytes: the token and gRPC's plaintext preface never cross it, and without TLS they
would (the same relay, the same calls, a plaintext trunk). A client without the CA, or with another
CA, does not get through."""

from __future__ import annotations

import socket
import threading

import pytest

from smolforge.cluster.control.kinds import parse
from smolforge.cluster.nodes import ray_tls
from smolforge.cluster.workloads.split.client_side import FollowingTrunkClient
from smolforge.cluster.workloads.split.trunk import serve_config
from smolforge.errors import SmolforgeError
from smolforge.split.client import TrunkCallError, TrunkClient
from smolforge.split.server import serve
from smolforge.split.trainer import SplitTrainConfig, SplitTrainer

TOKEN = "tls-job-token-0123456789"
PREFACE = b"PRI * HTTP/2.0"  # what every plaintext HTTP/2 (gRPC) connection starts with
JOB = {"kind": "split", "split": {"model": "tiny-llama", "split_point_1": 1, "split_point_2": 3, "lora_rank": 2}}


class Relay:
    """A TCP relay on loopback that records every byte each way (a capture of the wire)."""

    def __init__(self, port: int):
        self.target = ("127.0.0.1", port)
        self.up, self.down = bytearray(), bytearray()
        self.sock = socket.create_server(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        threading.Thread(target=self._accept, daemon=True).start()

    def _accept(self) -> None:
        while True:
            try:
                conn, _ = self.sock.accept()
            except OSError:
                return
            server = socket.create_connection(self.target, timeout=30)
            for src, dst, buf in ((conn, server, self.up), (server, conn, self.down)):
                threading.Thread(target=self._pump, args=(src, dst, buf), daemon=True).start()

    @staticmethod
    def _pump(src: socket.socket, dst: socket.socket, buf: bytearray) -> None:
        try:
            while data := src.recv(65536):
                buf += data
                dst.sendall(data)
        except OSError:
            pass
        finally:
            for s in (src, dst):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def close(self) -> None:
        self.sock.close()


@pytest.fixture
def node_env(tmp_path, monkeypatch):
    """This machine as a node of a `--tls` cluster: the cluster's CA, and a node certificate it signed
    for 127.0.0.1, named in the environment as `worker join` names them for Ray."""
    ca_cert, ca_key = ray_tls.ensure_ca(tmp_path / "coordinator-tls")
    key_pem, csr = ray_tls.make_request(["127.0.0.1"])
    env = ray_tls.write_node_files(tmp_path / "node-tls", key_pem, ray_tls.sign_request(csr, ca_cert, ca_key),
                                   ca_cert.read_text())
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    return env


def _trunk(tmp_path, tls: bool):
    return serve(serve_config(parse(JOB), "tiny-llama", TOKEN, "127.0.0.1", "cpu", tmp_path / f"trunk-{tls}", tls))


@pytest.mark.timeout(300)
def test_on_a_tls_cluster_the_trunk_serves_tls_and_the_client_trains_trusting_the_cluster_ca(tmp_path, node_env):
    cert, key, ca = ray_tls.node_files_from_env()
    assert (cert, key, ca) == (node_env["RAY_TLS_SERVER_CERT"], node_env["RAY_TLS_SERVER_KEY"],
                               node_env["RAY_TLS_CA_CERT"])
    srv = _trunk(tmp_path, tls=True)
    relay = Relay(srv.port)
    try:
        assert srv.tls and "TLS" in srv.describe()
        # the job's client, as ClientActor makes it on a TLS cluster: a few steps through the relay
        client = FollowingTrunkClient(lambda: ("127.0.0.1", relay.port), TOKEN, rpc_timeout=120, patience_s=60,
                                      tls_ca=ca)
        cfg = SplitTrainConfig(model="tiny-llama", split_point_1=1, split_point_2=3, lora_rank=2, token=TOKEN,
                               max_steps=2, batch_size=2, max_train_samples=8, max_eval_samples=2,
                               max_seq_length=48, output_dir=str(tmp_path / "client"), quiet=True, num_threads=1)
        trainer = SplitTrainer(cfg, client=client)
        try:
            result = trainer.train()
        finally:
            trainer.close()
        assert client.tls and result.steps == 2 and all(x == x for x in result.losses)
        assert client.bytes_sent > 10_000  # hidden states went through the relay...
        wire = bytes(relay.up) + bytes(relay.down)
        assert len(relay.up) >= client.bytes_sent and relay.up[:1] == b"\x16"  # ...as TLS records (a handshake first)
        assert TOKEN.encode() not in wire and PREFACE not in wire and b"authorization" not in wire
        # the token check stays: the cluster's CA without the job's token is refused
        with TrunkClient("127.0.0.1", srv.port, "not-the-job-token", tls_ca=ca, reconnect_timeout=1.0) as wrong:
            with pytest.raises(TrunkCallError, match="UNAUTHENTICATED"):
                wrong.info()
        # a client without the CA (plaintext), or trusting another CA, does not get through
        other_ca, _ = ray_tls.ensure_ca(tmp_path / "another-cluster")
        for tls_ca in (None, str(other_ca)):
            with TrunkClient("127.0.0.1", srv.port, TOKEN, tls_ca=tls_ca, reconnect_timeout=1.0) as outsider:
                with pytest.raises(TrunkCallError, match="cannot reach the trunk server") as err:
                    outsider.info(retry=False)
                assert "--tls-ca" in err.value.render()
    finally:
        relay.close()
        srv.stop(0)


@pytest.mark.timeout(300)
def test_the_relay_would_see_a_plaintext_trunk(tmp_path):
    """The capture's own check: without TLS the same calls put the token and the preface on the wire."""
    srv = _trunk(tmp_path, tls=False)
    relay = Relay(srv.port)
    try:
        assert not srv.tls
        with TrunkClient("127.0.0.1", relay.port, TOKEN) as client:
            assert client.info().num_layers == 4
        wire = bytes(relay.up)
        assert wire.startswith(PREFACE) and TOKEN.encode() in wire
    finally:
        relay.close()
        srv.stop(0)


def test_node_tls_files_come_from_the_node_environment(tmp_path):
    env = {"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": "c.pem", "RAY_TLS_SERVER_KEY": "k.pem", "RAY_TLS_CA_CERT": "ca.pem"}
    assert ray_tls.node_files_from_env(env) == ("c.pem", "k.pem", "ca.pem")
    assert ray_tls.node_files_from_env({}) is None and ray_tls.node_files_from_env({"RAY_USE_TLS": "0"}) is None
    with pytest.raises(SmolforgeError, match="does not run Ray with TLS"):
        ray_tls.node_files_from_env({}, required=True)
    with pytest.raises(SmolforgeError, match="certificate, key or CA is not named"):
        ray_tls.node_files_from_env({"RAY_USE_TLS": "1", "RAY_TLS_SERVER_CERT": "c.pem"})
