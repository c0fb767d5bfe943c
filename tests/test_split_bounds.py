"""The split trunk's bounds (issue 43, item 5), over real loopback gRPC: a sequence longer than the
model's context is refused before it is computed, on the training `Forward` as on generation; a
malformed tensor shape is INVALID_ARGUMENT; a second trunk on a used port exits 2 with "address
already in use" (no SO_REUSEPORT); a client says at once that the server cannot be reached."""

from __future__ import annotations

import socket

import grpc
import pytest
import torch

from smolforge.split.codec import encode, encode_raw
from smolforge.split.partition import fingerprint, positions_for
from smolforge.split.protocol import bearer, channel, pb, pb_grpc
from smolforge.split.server import ServeConfig, serve

TOKEN = "bounds-test-token"
MD = bearer(TOKEN)


def _cfg(port: int, tmp) -> ServeConfig:
    return ServeConfig(model="tiny-llama", split_point_1=1, split_point_2=3, lora_rank=4, lora_alpha=8,
                       lora_dropout=0.0, port=port, token=TOKEN, num_threads=1, checkpoint_dir=str(tmp))


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = serve(_cfg(0, tmp_path_factory.mktemp("ck")))
    yield srv
    srv.stop(0)


@pytest.fixture(scope="module")
def stub(server):
    ch = channel("127.0.0.1", server.port)
    yield pb_grpc.TrunkStub(ch)
    ch.close()


@pytest.fixture(scope="module")
def session(stub, server):
    from smolforge.models.loading import load_model

    req = pb.OpenSessionRequest(model_id="tiny-llama", model_fingerprint=fingerprint(load_model("tiny-llama")),
                                split_point_1=1, split_point_2=3, codec="fp32", session_name="bounds")
    return stub.OpenSession(req, metadata=MD, timeout=60).session_id


def _forward(sid: str, hidden: torch.Tensor, train: bool = True) -> pb.ForwardRequest:
    b, t = hidden.shape[:2]
    mask = torch.ones(b, t, dtype=torch.uint8)
    return pb.ForwardRequest(session_id=sid, step=1, micro_batch=0, hidden=encode(hidden, "fp32"), train=train,
                             attention_mask=encode_raw(mask), positions=encode_raw(positions_for(mask).to(torch.int32)))


def _status(call) -> tuple[grpc.StatusCode, str]:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code(), err.value.details()


@pytest.mark.parametrize("train", [True, False], ids=["training", "eval"])
def test_a_sequence_longer_than_the_context_is_refused_before_it_is_computed(server, stub, session, train):
    """tiny-llama's context is 512 positions: a Forward of 513 (training, as the review's 65,536 was) is
    INVALID_ARGUMENT naming the context, counted as refused, and the trunk computes nothing; so is a
    position at or past the context in a short sequence; 512 positions are computed."""
    context = server.service.max_positions
    assert context == 512
    before = dict(server.service.counts)
    code, details = _status(lambda: stub.Forward(_forward(session, torch.randn(1, context + 1, 128), train),
                                                 metadata=MD, timeout=60))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "longer than the model's context (512)" in details
    far = _forward(session, torch.randn(1, 4, 128), train)
    far.positions.CopyFrom(encode_raw(torch.tensor([[509, 510, 511, 512]], dtype=torch.int32)))
    code, details = _status(lambda: stub.Forward(far, metadata=MD, timeout=60))
    assert code == grpc.StatusCode.INVALID_ARGUMENT and "positions must be < 512" in details
    counts = server.service.counts
    assert counts["forwards"] == before.get("forwards", 0)  # nothing was computed
    assert counts["refused"] == before.get("refused", 0) + 2
    stub.Forward(_forward(session, torch.randn(1, context, 128), train=False), metadata=MD, timeout=60)
    assert counts["forwards"] == before.get("forwards", 0) + 1  # the whole context is served


def _malformed(sid: str) -> dict[str, pb.ForwardRequest]:
    good = torch.randn(2, 6, 128)
    cases = {}
    for name, shape in {"4-d hidden": [2, 6, 128, 1], "2-d hidden": [12, 128], "negative dim": [2, -6, 128],
                        "scalar": [], "zero rows": [0, 6, 128], "rows not the mask's": [1, 12, 128],
                        "2**80 elements": [2 ** 40, 2 ** 40, 128]}.items():
        cases[name] = _forward(sid, good)
        cases[name].hidden.shape[:] = shape
    for name, positions in {"3-d positions": torch.zeros(2, 6, 1), "1-d positions": torch.zeros(6)}.items():
        cases[name] = _forward(sid, good)
        cases[name].positions.CopyFrom(encode_raw(positions.to(torch.int32)))
    cases["3-d mask"] = _forward(sid, good)
    cases["3-d mask"].attention_mask.CopyFrom(encode_raw(torch.ones(2, 6, 1, dtype=torch.uint8)))
    return cases


def test_a_malformed_tensor_shape_is_invalid_argument(server, stub, session):
    """Every malformed shape of a Forward's tensors (and of a Backward's gradient) is INVALID_ARGUMENT,
    never INTERNAL, and the session goes on."""
    for name, req in _malformed(session).items():
        code, details = _status(lambda: stub.Forward(req, metadata=MD, timeout=60))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (name, code, details)
    out = stub.Forward(_forward(session, torch.randn(2, 6, 128)), metadata=MD, timeout=60)
    assert out.hidden.shape[:] == [2, 6, 128]
    for shape in ([2, 6, 128, 1], [2, -6, 128], [12, 128]):
        grad = encode(torch.randn(2, 6, 128))
        grad.shape[:] = shape
        req = pb.BackwardRequest(session_id=session, step=1, micro_batch=0, grad=grad, last_micro_batch=True)
        code, details = _status(lambda: stub.Backward(req, metadata=MD, timeout=60))
        assert code == grpc.StatusCode.INVALID_ARGUMENT, (shape, code, details)


def test_a_second_trunk_on_a_used_port_exits_2_with_address_already_in_use(server, tmp_path):
    """`split serve --port P` where a trunk listens: exit 2, one message (gRPC's SO_REUSEPORT would
    have let it start and take a share of the connections)."""
    from helpers import smolforge

    (tmp_path / "token").write_text(TOKEN)
    proc = smolforge("split", "serve", "--model", "tiny-llama", "--split-point-1", "1", "--split-point-2", "3",
                     "--port", str(server.port), "--token-file", str(tmp_path / "token"), timeout=120,
                     env={"SMOLFORGE_HOME": str(tmp_path / "home")})
    assert proc.returncode == 2, proc.stderr[-2000:]
    assert proc.stderr.startswith("error:") and "address already in use" in proc.stderr
    assert "fix:" in proc.stderr and "Traceback" not in proc.stderr


def test_the_client_says_at_once_that_the_server_cannot_be_reached(tmp_path):
    """A client to a closed port: its first line says the server cannot be reached and what it waits
    for, after the first failed call (not after retrying for reconnect_timeout); then the one error."""
    from smolforge.errors import SmolforgeError
    from smolforge.split.client import TrunkClient

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed once the block ends: nothing listens there
    lines: list[tuple[int, str]] = []
    client = TrunkClient("127.0.0.1", port, TOKEN, reconnect_timeout=1.0, rpc_timeout=5.0,
                         notify=lambda line: lines.append((client.retries, line)))
    try:
        with pytest.raises(SmolforgeError, match="cannot reach the trunk server"):
            client.info()
    finally:
        client.close()
    assert lines, "the client waited silently"
    retries, first = lines[0]
    assert retries == 1  # said on the first failed call
    assert first.startswith(f"cannot reach the trunk server at 127.0.0.1:{port} (UNAVAILABLE")
    assert "retrying Info for up to" in first and "smolforge split serve" in first
