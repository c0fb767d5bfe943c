"""The trunk server over real loopback gRPC: big payloads, malformed messages, retries, timeouts, two clients."""

from __future__ import annotations

import threading
import time

import grpc
import pytest
import torch

from smolforge.config import DataSpec
from smolforge.data import load_splits
from smolforge.models.loading import load_model, load_tokenizer
from smolforge.split.codec import decode, encode, encode_raw
from smolforge.split.partition import fingerprint, partition, positions_for
from smolforge.split.protocol import bearer, channel, pb, pb_grpc
from smolforge.split.server import ServeConfig, serve
from smolforge.split.trainer import SplitTrainConfig, train_split

TOKEN = "server-test-token"
MD = bearer(TOKEN)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = serve(ServeConfig(model="tiny-llama", split_point_1=1, split_point_2=3, lora_rank=4, lora_alpha=8,
                            lora_dropout=0.0, port=0, token=TOKEN, num_threads=1,
                            checkpoint_dir=str(tmp_path_factory.mktemp("ck"))))
    yield srv
    srv.stop(0)


@pytest.fixture(scope="module")
def stub(server):
    ch = channel("127.0.0.1", server.port)
    yield pb_grpc.TrunkStub(ch)
    ch.close()


@pytest.fixture(scope="module")
def fp():
    return fingerprint(load_model("tiny-llama"))


def open_session(stub, fp, name="s", codec="fp32", seed=0) -> str:
    req = pb.OpenSessionRequest(model_id="tiny-llama", model_fingerprint=fp, split_point_1=1, split_point_2=3,
                                codec=codec, session_name=name, seed=seed)
    return stub.OpenSession(req, metadata=MD, timeout=60).session_id


def forward_req(sid, hidden, step=1, micro=0, train=True, codec="fp32"):
    b, t = hidden.shape[:2]
    mask = torch.ones(b, t, dtype=torch.uint8)
    return pb.ForwardRequest(session_id=sid, step=step, micro_batch=micro, hidden=encode(hidden, codec),
                             attention_mask=encode_raw(mask), positions=encode_raw(positions_for(mask).to(torch.int32)),
                             train=train)


def code_of(call) -> grpc.StatusCode:
    with pytest.raises(grpc.RpcError) as err:
        call()
    return err.value.code()


def test_payload_over_4_mib_both_ways(stub, fp):
    sid = open_session(stub, fp, "big")
    hidden = torch.randn(20, 512, 128)  # 5.2 MB of fp32 each way, over gRPC's 4 MiB default
    req = forward_req(sid, hidden)
    assert req.ByteSize() > 4 * 1024 * 1024
    out = decode(stub.Forward(req, metadata=MD, timeout=120).hidden)
    # the server's trunk starts with LoRA B = 0, so it equals the plain trunk here
    trunk = partition(load_model("tiny-llama"), 1, 3, keep=("trunk",)).trunk
    mask = torch.ones(20, 512, dtype=torch.long)
    with torch.no_grad():
        want = trunk(hidden, mask, positions_for(mask))
    assert torch.allclose(out, want, atol=1e-5)
    grad = torch.randn_like(out)
    back = stub.Backward(pb.BackwardRequest(session_id=sid, step=1, micro_batch=0, grad=encode(grad),
                                            last_micro_batch=True), metadata=MD, timeout=120)
    assert decode(back.grad).shape == hidden.shape and back.ByteSize() > 4 * 1024 * 1024
    norms = list(back.trunk_grad_norms)  # (A, B) per LoRA layer; A's gradient is 0 while B is 0
    assert len(norms) == 28 and all(b > 0 for b in norms[1::2]) and not any(norms[0::2])


def test_malformed_messages_get_error_statuses_and_the_server_stays_up(server, stub, fp):
    sid = open_session(stub, fp, "malformed")
    good = torch.randn(2, 6, 128)

    truncated = forward_req(sid, good)
    truncated.hidden.data = truncated.hidden.data[:-3]
    wrong_width = forward_req(sid, torch.randn(2, 6, 64))
    bad_mask = forward_req(sid, good)
    bad_mask.attention_mask.CopyFrom(encode_raw(torch.ones(3, 6, dtype=torch.uint8)))
    neg_pos = forward_req(sid, good)
    neg_pos.positions.CopyFrom(encode_raw(torch.full((2, 6), -1, dtype=torch.int32)))
    float_mask = forward_req(sid, good)
    float_mask.attention_mask.CopyFrom(encode(torch.ones(2, 6), "fp32"))
    bad_codec = forward_req(sid, good)
    bad_codec.hidden.codec = "gzip"
    for req in (truncated, wrong_width, bad_mask, neg_pos, float_mask, bad_codec):
        assert code_of(lambda: stub.Forward(req, metadata=MD, timeout=30)) == grpc.StatusCode.INVALID_ARGUMENT

    # bytes that are not a protobuf message at all
    raw = grpc.insecure_channel(f"127.0.0.1:{server.port}")
    garbage = raw.unary_unary("/smolforge.split.v1.Trunk/Forward")
    with pytest.raises(grpc.RpcError) as err:
        garbage(b"\xff\xfe not protobuf \x00" * 10, metadata=MD, timeout=30)
    assert err.value.code() != grpc.StatusCode.OK
    raw.close()

    # out-of-order step, unknown session, bad step values
    assert code_of(lambda: stub.Forward(forward_req(sid, good, step=5), metadata=MD, timeout=30)) == \
        grpc.StatusCode.FAILED_PRECONDITION
    assert code_of(lambda: stub.Forward(forward_req("nope", good), metadata=MD, timeout=30)) == \
        grpc.StatusCode.NOT_FOUND
    assert code_of(lambda: stub.Backward(pb.BackwardRequest(session_id=sid, step=1, micro_batch=9, grad=encode(good)),
                                         metadata=MD, timeout=30)) == grpc.StatusCode.FAILED_PRECONDITION

    # a valid forward, a backward with the wrong shape (error), then the right one (works)
    out = decode(stub.Forward(forward_req(sid, good), metadata=MD, timeout=30).hidden)
    wrong = pb.BackwardRequest(session_id=sid, step=1, micro_batch=0, grad=encode(torch.randn(2, 5, 128)))
    assert code_of(lambda: stub.Backward(wrong, metadata=MD, timeout=30)) == grpc.StatusCode.INVALID_ARGUMENT
    assert code_of(lambda: stub.Step(pb.StepRequest(session_id=sid, step=1, lr=1e-3, clip_coef=1.0), metadata=MD,
                                     timeout=30)) == grpc.StatusCode.FAILED_PRECONDITION  # backward still owed
    right = pb.BackwardRequest(session_id=sid, step=1, micro_batch=0, grad=encode(torch.ones_like(out)),
                               last_micro_batch=True)
    first = stub.Backward(right, metadata=MD, timeout=30)
    # a retried Backward (reply lost) returns the same answer and does not accumulate twice
    again = stub.Backward(right, metadata=MD, timeout=30)
    assert again.SerializeToString() == first.SerializeToString()
    for lr, coef in [(float("nan"), 1.0), (1e-3, 0.0), (1e-3, 2.0)]:
        assert code_of(lambda: stub.Step(pb.StepRequest(session_id=sid, step=1, lr=lr, clip_coef=coef), metadata=MD,
                                         timeout=30)) == grpc.StatusCode.INVALID_ARGUMENT
    assert stub.Step(pb.StepRequest(session_id=sid, step=1, lr=1e-3, clip_coef=1.0), metadata=MD, timeout=30).step == 1
    assert stub.Step(pb.StepRequest(session_id=sid, step=1, lr=1e-3, clip_coef=1.0), metadata=MD, timeout=30).step == 1

    assert stub.Health(pb.HealthRequest(), timeout=10).status == "ok"
    out2 = decode(stub.Forward(forward_req(sid, good, step=2), metadata=MD, timeout=30).hidden)
    assert not torch.equal(out, out2)  # the trunk's LoRA took a step


def test_eval_forward_keeps_no_graph(stub, fp):
    sid = open_session(stub, fp, "evalonly")
    for _ in range(3):
        stub.Forward(forward_req(sid, torch.randn(1, 4, 128), step=99, train=False), metadata=MD, timeout=30)
    # nothing is in flight, so a step may be taken at once
    assert stub.Step(pb.StepRequest(session_id=sid, step=1, lr=0.0, clip_coef=1.0), metadata=MD, timeout=30).step == 1


def test_vanished_client_session_is_freed_after_timeout(tmp_path, fp):
    srv = serve(ServeConfig(model="tiny-llama", split_point_1=1, split_point_2=3, lora_rank=2, port=0, token=TOKEN,
                            num_threads=1, session_timeout=0.6, checkpoint_dir=str(tmp_path)))
    ch = channel("127.0.0.1", srv.port)
    try:
        stub = pb_grpc.TrunkStub(ch)
        busy = open_session(stub, fp, "busy")
        gone = open_session(stub, fp, "gone")
        assert stub.Info(pb.InfoRequest(), metadata=MD, timeout=10).active_sessions == 2
        deadline = time.monotonic() + 2.0
        while time.monotonic() < deadline:  # the busy client keeps calling; the other went silent
            stub.Forward(forward_req(busy, torch.randn(1, 3, 128), train=False), metadata=MD, timeout=10)
            time.sleep(0.1)
        assert stub.Info(pb.InfoRequest(), metadata=MD, timeout=10).active_sessions == 1
        assert code_of(lambda: stub.Forward(forward_req(gone, torch.randn(1, 3, 128)), metadata=MD, timeout=10)) == \
            grpc.StatusCode.NOT_FOUND
        stub.Forward(forward_req(busy, torch.randn(1, 3, 128), train=False), metadata=MD, timeout=10)
    finally:
        ch.close()
        srv.stop(0)


def test_two_clients_hold_separate_sessions(server, tmp_path):
    """Two runs at once on one server give exactly what each gives alone."""
    tok = load_tokenizer("tiny-llama")
    data = load_splits(DataSpec(path="bundled", max_samples=24, max_length=48, max_eval_samples=4), tok)

    def cfg(seed, out):
        return SplitTrainConfig(model="tiny-llama", split_point_1=1, split_point_2=3, server_port=server.port,
                                token=TOKEN, lora_rank=4, lora_alpha=8, lora_dropout=0.0, batch_size=4, max_steps=4,
                                learning_rate=5e-3, output_dir=str(out), seed=seed, quiet=True, num_threads=1)

    alone = [train_split(cfg(seed, tmp_path / f"alone{seed}"), splits=data, tokenizer=tok).losses for seed in (1, 2)]
    results: dict[int, list[float]] = {}
    errors: list[BaseException] = []

    def run(seed):
        try:
            results[seed] = train_split(cfg(seed, tmp_path / f"together{seed}"), splits=data, tokenizer=tok).losses
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    threads = [threading.Thread(target=run, args=(seed,)) for seed in (1, 2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=300)
    assert not errors, errors
    assert results[1] == alone[0] and results[2] == alone[1]
    assert alone[0] != alone[1]


def test_frozen_trunk_without_lora(tmp_path):
    """`serve --no-lora`: the trunk only passes gradients through; bottom and top still train."""
    srv = serve(ServeConfig(model="tiny-llama", split_point_1=1, split_point_2=3, use_lora=False, port=0, token=TOKEN,
                            num_threads=1, checkpoint_dir=str(tmp_path / "ck")))
    try:
        tok = load_tokenizer("tiny-llama")
        data = load_splits(DataSpec(path="bundled", max_samples=16, max_length=48, max_eval_samples=4), tok)
        cfg = SplitTrainConfig(model="tiny-llama", split_point_1=1, split_point_2=3, server_port=srv.port, token=TOKEN,
                               lora_rank=2, batch_size=4, max_steps=2, learning_rate=1e-2, save_interval=1,
                               output_dir=str(tmp_path / "run"), quiet=True, num_threads=1)
        result = train_split(cfg, splits=data, tokenizer=tok)
        assert result.trunk_trainable_params == 0 and result.trainable_params > 0 and result.steps == 2
        resumed = train_split(cfg.model_copy(update={"max_steps": 3, "resume": True}), splits=data, tokenizer=tok)
        assert resumed.resumed_from == 2 and resumed.steps == 3
    finally:
        srv.stop(0)
