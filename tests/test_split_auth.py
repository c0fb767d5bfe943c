"""Token auth, model/split-point checks at OpenSession, and TLS with a self-signed certificate."""

from __future__ import annotations

import datetime
import ipaddress

import grpc
import pytest

from smolforge.errors import SmolforgeError
from smolforge.split.client import TrunkCallError, TrunkClient
from smolforge.split.protocol import bearer, channel, pb, pb_grpc
from smolforge.split.server import ServeConfig, serve
from smolforge.split.trainer import SplitTrainConfig, train_split

TOKEN = "auth-test-token"


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = serve(ServeConfig(model="tiny-llama", split_point_1=1, split_point_2=3, lora_rank=2, port=0, token=TOKEN,
                            num_threads=1, checkpoint_dir=str(tmp_path_factory.mktemp("ck"))))
    yield srv
    srv.stop(0)


def stub_for(port: int):
    ch = channel("127.0.0.1", port)
    return ch, pb_grpc.TrunkStub(ch)


def open_request(**kw) -> pb.OpenSessionRequest:
    from smolforge.models.loading import load_model
    from smolforge.split.partition import fingerprint

    base = dict(model_id="tiny-llama", model_fingerprint=fingerprint(load_model("tiny-llama")), split_point_1=1,
                split_point_2=3, codec="fp32", session_name="auth-test", seed=0)
    base.update(kw)
    return pb.OpenSessionRequest(**base)


def test_no_token_and_wrong_token_are_unauthenticated(server):
    ch, stub = stub_for(server.port)
    with ch:
        for metadata in [(), bearer("wrong"), (("authorization", TOKEN),)]:  # missing, wrong, not "Bearer"
            for call, req in [(stub.Info, pb.InfoRequest()), (stub.OpenSession, open_request()),
                              (stub.Forward, pb.ForwardRequest())]:
                with pytest.raises(grpc.RpcError) as err:
                    call(req, metadata=metadata, timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED
                assert "token" in err.value.details()
        # Health is the one open call (liveness probes), and the right token opens the rest.
        assert stub.Health(pb.HealthRequest(), timeout=10).status == "ok"
        info = stub.Info(pb.InfoRequest(), metadata=bearer(TOKEN), timeout=10)
        assert (info.split_point_1, info.split_point_2, info.num_layers) == (1, 3, 4)


def test_client_error_names_the_fix(server):
    with TrunkClient("127.0.0.1", server.port, "nope") as client:
        with pytest.raises(TrunkCallError) as err:
            client.info()
    assert err.value.code == grpc.StatusCode.UNAUTHENTICATED
    assert "--token" in err.value.render()


def test_wrong_split_points_are_a_clear_error(server, tmp_path):
    ch, stub = stub_for(server.port)
    with ch:
        with pytest.raises(grpc.RpcError) as err:
            stub.OpenSession(open_request(split_point_1=2, split_point_2=3), metadata=bearer(TOKEN), timeout=30)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert "split points differ" in err.value.details() and "[1, 3)" in err.value.details()

    # the same through the trainer: a SmolforgeError (the CLI prints it, exit 2) naming both sides
    cfg = SplitTrainConfig(model="tiny-llama", split_point_1=2, split_point_2=3, server_port=server.port, token=TOKEN,
                           max_steps=1, max_train_samples=8, output_dir=str(tmp_path), quiet=True, num_threads=1)
    with pytest.raises(SmolforgeError, match=r"split points differ.*\[1, 3\).*\[2, 3\)"):
        train_split(cfg)


def test_other_model_and_bad_session_names_are_refused(server):
    ch, stub = stub_for(server.port)
    with ch:
        with pytest.raises(grpc.RpcError) as err:
            stub.OpenSession(open_request(model_fingerprint="0123456789abcdef", model_id="other"),
                             metadata=bearer(TOKEN), timeout=30)
        assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION and "model differs" in err.value.details()
        for name in ["../escape", "", "a/b"]:
            with pytest.raises(grpc.RpcError) as err:
                stub.OpenSession(open_request(session_name=name), metadata=bearer(TOKEN), timeout=30)
            assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        with pytest.raises(grpc.RpcError) as err:
            stub.OpenSession(open_request(codec="zstd"), metadata=bearer(TOKEN), timeout=30)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT


def test_server_refuses_to_start_without_a_token():
    with pytest.raises(SmolforgeError, match="needs a token"):
        serve(ServeConfig(model="tiny-llama", split_point_1=1, split_point_2=3, port=0))


def self_signed(tmp_path):
    from cryptography import x509
    from cryptography.hazmat.primitives import hashes, serialization
    from cryptography.hazmat.primitives.asymmetric import ec
    from cryptography.x509.oid import NameOID

    key = ec.generate_private_key(ec.SECP256R1())
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "localhost")])
    now = datetime.datetime.now(datetime.timezone.utc)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(x509.random_serial_number()).not_valid_before(now - datetime.timedelta(minutes=5))
            .not_valid_after(now + datetime.timedelta(days=1))
            .add_extension(x509.SubjectAlternativeName([x509.DNSName("localhost"),
                                                        x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]),
                           critical=False)
            .add_extension(x509.BasicConstraints(ca=True, path_length=None), critical=True)
            .sign(key, hashes.SHA256()))
    cert_path, key_path = tmp_path / "server.pem", tmp_path / "server.key"
    cert_path.write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    key_path.write_bytes(key.private_bytes(serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8,
                                           serialization.NoEncryption()))
    return str(cert_path), str(key_path)


def test_tls_with_a_self_signed_certificate(tmp_path):
    cert, key = self_signed(tmp_path)
    srv = serve(ServeConfig(model="tiny-llama", split_point_1=1, split_point_2=3, lora_rank=2, port=0, token=TOKEN,
                            tls_cert=cert, tls_key=key, num_threads=1, checkpoint_dir=str(tmp_path / "ck")))
    try:
        assert "TLS" in srv.describe()
        with TrunkClient("127.0.0.1", srv.port, TOKEN, tls_ca=cert) as client:
            assert client.info().num_layers == 4
        # a plaintext client cannot talk to it
        with TrunkClient("127.0.0.1", srv.port, TOKEN, reconnect_timeout=1.0) as plain:
            with pytest.raises(TrunkCallError, match="cannot reach"):
                plain.info()
        # a whole training step over TLS
        result = train_split(SplitTrainConfig(
            model="tiny-llama", split_point_1=1, split_point_2=3, server_port=srv.port, token=TOKEN, tls_ca=cert,
            max_steps=2, batch_size=2, max_train_samples=8, max_eval_samples=2, max_seq_length=48,
            output_dir=str(tmp_path / "run"), quiet=True, num_threads=1, lora_rank=2))
        assert result.steps == 2 and all(x == x for x in result.losses)
    finally:
        srv.stop(0)
    with pytest.raises(SmolforgeError, match="both a certificate and its key"):
        serve(ServeConfig(model="tiny-llama", split_point_1=1, split_point_2=3, port=0, token=TOKEN, tls_cert=cert))


def test_an_unauthenticated_300_mib_forward_is_refused_before_its_bytes_are_read(tmp_path):
    """The real `split serve` in its own process: a 300 MiB Forward without the token is refused
    and the server's memory stays flat (a unary handler would have read and parsed it all first).
    The server makes its own token: written 0600 for the clients, never printed."""
    import os
    import subprocess
    import sys
    import time

    import psutil

    from smolforge.cluster.nodes.statedir import free_port, port_open

    port = free_port()
    env = {**os.environ, "SMOLFORGE_HOME": str(tmp_path)}
    env.pop("SMOLFORGE_SPLIT_TOKEN", None)
    proc = subprocess.Popen([sys.executable, "-m", "smolforge.cli.main", "split", "serve", "--model", "tiny-llama",
                             "--split-point-1", "1", "--split-point-2", "3", "--port", str(port), "--num-threads", "1"],
                            env=env, stdout=subprocess.DEVNULL, stderr=open(tmp_path / "serve.log", "w"))
    try:
        deadline = time.time() + 120
        while not port_open("127.0.0.1", port, timeout=0.5):
            assert proc.poll() is None and time.time() < deadline, (tmp_path / "serve.log").read_text()[-2000:]
            time.sleep(0.3)
        token_file = tmp_path / "split" / "token"
        token = token_file.read_text()
        assert token_file.stat().st_mode & 0o777 == 0o600 and token not in (tmp_path / "serve.log").read_text()
        assert f"--token-file {token_file}" in (tmp_path / "serve.log").read_text()
        server = psutil.Process(proc.pid)
        ch, stub = stub_for(port)
        with ch:
            assert stub.Health(pb.HealthRequest(), timeout=10).status == "ok"
            before = server.memory_info().rss
            big = pb.ForwardRequest(session_id="x", hidden=pb.Tensor(codec="fp32", dtype="float32",
                                                                     data=b"\0" * (300 * 2**20)))
            for metadata in [(), bearer("wrong")]:
                with pytest.raises(grpc.RpcError) as err:
                    stub.Forward(big, metadata=metadata, timeout=60)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, err.value
            grown = (server.memory_info().rss - before) / 2**20
            assert grown < 50, f"the server grew by {grown:.0f} MiB on unauthenticated calls"
            assert stub.Info(pb.InfoRequest(), metadata=bearer(token), timeout=10).num_layers == 4  # still serving
    finally:
        proc.terminate()
        proc.wait(timeout=30)
