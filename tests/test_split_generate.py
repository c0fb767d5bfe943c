"""Inference through the split (`smolforge split generate`) against an in-process trunk server.

A few split-training steps first (enough to change the greedy reply, which then ends with EOS),
then: the split reply's greedy tokens equal HF `generate` on the merged model; the trunk forward
receives the whole prompt once and then one position per token (its KV cache at work) and the
cache is freed at the end, or after the idle bound (the client then replays its prefix on a new
generation); the new calls need the token; malformed steps are refused.
"""

from __future__ import annotations

import json

import grpc
import pytest
import torch
from typer.testing import CliRunner

from smolforge.config import DataSpec
from smolforge.data import load_splits
from smolforge.data.encode import render
from smolforge.models.loading import load_model, load_tokenizer
from smolforge.split.codec import encode, encode_raw
from smolforge.split.generate import SplitGenerateConfig, SplitGenerator, generate
from smolforge.split.merge import merge_run
from smolforge.split.protocol import bearer, channel, pb, pb_grpc
from smolforge.split.server import ServeConfig, serve
from smolforge.split.trainer import SplitTrainConfig, train_split

TOKEN = "generate-test-token"
PROMPT = "What is 2 + 3?"
NEW = 8


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    srv = serve(ServeConfig(model="tiny-llama", split_point_1=1, split_point_2=3, lora_rank=4, lora_alpha=8,
                            lora_dropout=0.0, port=0, token=TOKEN, num_threads=1,
                            checkpoint_dir=str(tmp_path_factory.mktemp("ck"))))
    yield srv
    srv.stop(0)


@pytest.fixture(scope="module")
def run(server, tmp_path_factory):
    """A short split run (its trunk LoRA trained on the server) and its merged model's greedy reply."""
    out = tmp_path_factory.mktemp("run")
    tok = load_tokenizer("tiny-llama")
    data = load_splits(DataSpec(path="bundled", max_samples=16, max_length=48, max_eval_samples=0), tok)
    cfg = SplitTrainConfig(model="tiny-llama", split_point_1=1, split_point_2=3, server_port=server.port, token=TOKEN,
                           lora_rank=4, lora_alpha=8, lora_dropout=0.0, batch_size=4, learning_rate=5e-3,
                           max_steps=3, max_eval_samples=0, output_dir=str(out), num_threads=1, quiet=True)
    train_split(cfg, splits=data, tokenizer=tok)
    enc = tok(render(tok, [{"role": "user", "content": PROMPT}], add_generation_prompt=True), return_tensors="pt",
              add_special_tokens=False)

    def greedy(model) -> list[int]:
        with torch.no_grad():
            return model.eval().generate(**enc, max_new_tokens=NEW, do_sample=False, pad_token_id=tok.pad_token_id,
                                         eos_token_id=tok.eos_token_id)[0, enc["input_ids"].shape[1]:].tolist()

    want = greedy(load_model(str(merge_run(out))))
    assert want != greedy(load_model("tiny-llama")), "training should change the reply: the LoRA must matter"
    assert len(want) >= 4, f"the merged model ended after {want}: the cache checks below need several tokens"
    return out, want, enc["input_ids"].shape[1]


def gen_cfg(server, out, **kw) -> SplitGenerateConfig:
    return SplitGenerateConfig(run_dir=str(out), prompt=PROMPT, server_port=server.port, token=TOKEN,
                               max_new_tokens=NEW, num_threads=1, **kw)


def test_split_generate_gives_the_merged_models_greedy_tokens_with_a_kv_cache_on_each_side(server, run):
    out, want, prompt_len = run
    gens = server.service.generations
    ended = len(gens.finished)
    result = generate(gen_cfg(server, out))
    assert result.token_ids == want
    eos = load_tokenizer("tiny-llama").eos_token_id
    assert result.stopped == ("eos" if want[-1] == eos else "max_new_tokens") and result.checkpoint_step == 3
    # the trunk got the prompt once, then one position per new token (the last token is not sent back)
    n = len(want)
    assert gens.active() == 0 and len(gens.finished) == ended + 1, "the generation should be closed and freed"
    record = gens.finished[-1]
    assert record.forward_positions == (prompt_len,) + (1,) * (n - 1), record
    assert result.client_forward_positions == list(record.forward_positions)
    assert result.trunk_cache_lengths == list(range(prompt_len, prompt_len + n))
    # freed at the end: the client closed it, nothing is left on the server
    assert record.ended == "closed" and record.cache_length == prompt_len + n - 1
    assert gens.active() == 0 and server.service.info_reply().active_generations == 0
    assert result.recoveries == 0


def test_an_idle_generation_is_freed_and_the_client_replays_its_prefix(server, run):
    out, want, prompt_len = run
    gens = server.service.generations
    freed: list[str] = []

    def idle_after_two(n: int, token) -> None:
        if n == 2:  # the client goes quiet past the server's idle bound
            for gen in gens.by_id.values():
                gen.last_seen -= gens.timeout + 1
            freed.extend(gens.reap())

    gen = SplitGenerator(gen_cfg(server, out))
    try:
        result = gen.reply(PROMPT, on_token=idle_after_two)
    finally:
        gen.close()
    assert len(freed) == 1 and gens.active() == 0, f"the idle bound should free the generation (freed {freed})"
    idle, replayed = gens.finished[-2], gens.finished[-1]
    assert idle.id == freed[0] and idle.ended == "idle" and idle.forward_positions == (prompt_len, 1)
    # the new generation took the prompt and the two tokens so far in one forward, then one per token
    assert replayed.ended == "closed" and replayed.forward_positions == (prompt_len + 2,) + (1,) * (len(want) - 3)
    assert result.recoveries == 1 and result.token_ids == want


def test_sampling_is_seeded(server, run):
    out, _, _ = run
    draws = [generate(gen_cfg(server, out, temperature=1.5, seed=seed)).token_ids for seed in (1, 1)]
    assert draws[0] == draws[1] and len(draws[0]) >= 1, draws
    assert server.service.generations.active() == 0


def test_the_generation_calls_need_the_token(server):
    ch = channel("127.0.0.1", server.port)
    stub = pb_grpc.TrunkStub(ch)
    with ch:
        for call, req in [(stub.OpenGeneration, pb.OpenGenerationRequest(max_positions=8)),
                          (stub.GenerateStep, pb.GenerateStepRequest(generation_id="x")),
                          (stub.CloseGeneration, pb.CloseGenerationRequest(generation_id="x"))]:
            for metadata in [(), bearer("wrong")]:
                with pytest.raises(grpc.RpcError) as err:
                    call(req, metadata=metadata, timeout=10)
                assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED, call


def test_malformed_generation_calls_are_refused_and_a_retried_step_is_answered_again(server, run):
    out, _, _ = run
    gen = SplitGenerator(gen_cfg(server, out))
    md = bearer(TOKEN)
    stub = gen.client.stub

    def code_of(call, req) -> grpc.StatusCode:
        with pytest.raises(grpc.RpcError) as err:
            call(req, metadata=md, timeout=30)
        return err.value.code()

    try:
        gid = gen._open(6)
        bad = gen.open_request(6)
        del bad.trunk_lora[0]
        assert code_of(stub.OpenGeneration, bad) == grpc.StatusCode.INVALID_ARGUMENT

        def step(past: int, width: int, mask_width: int | None = None) -> pb.GenerateStepRequest:
            mask = torch.ones(1, mask_width or past + width, dtype=torch.uint8)
            pos = torch.arange(past, past + width, dtype=torch.int32)[None]
            return pb.GenerateStepRequest(generation_id=gid, past_length=past,
                                          hidden=encode(torch.randn(1, width, 128)),
                                          attention_mask=encode_raw(mask), positions=encode_raw(pos))

        assert code_of(stub.GenerateStep, step(0, 3, mask_width=2)) == grpc.StatusCode.INVALID_ARGUMENT
        assert code_of(stub.GenerateStep, step(0, 7)) == grpc.StatusCode.INVALID_ARGUMENT  # over max_positions
        assert code_of(stub.GenerateStep, step(2, 1)) == grpc.StatusCode.FAILED_PRECONDITION  # out of order
        first = step(0, 3)
        reply = stub.GenerateStep(first, metadata=md, timeout=30)
        again = stub.GenerateStep(first, metadata=md, timeout=30)  # its reply was lost: the same answer
        assert again.SerializeToString() == reply.SerializeToString() and reply.cache_length == 3
        assert stub.GenerateStep(step(3, 1), metadata=md, timeout=30).cache_length == 4
        closed = stub.CloseGeneration(pb.CloseGenerationRequest(generation_id=gid), metadata=md, timeout=30)
        assert closed.closed and closed.cache_length == 4 and closed.steps == 2
        assert code_of(stub.GenerateStep, step(4, 1)) == grpc.StatusCode.NOT_FOUND
    finally:
        gen.close()


def test_cli_split_generate_prints_json(server, run):
    from smolforge.cli.main import app

    out, want, _ = run
    res = CliRunner().invoke(app, ["split", "generate", "--server", f"127.0.0.1:{server.port}", "--run-dir", str(out),
                                   "--prompt", PROMPT, "--max-new-tokens", "4", "--num-threads", "1", "--json"],
                             env={"SMOLFORGE_SPLIT_TOKEN": TOKEN})
    assert res.exit_code == 0, res.output
    body = json.loads(res.stdout)
    assert body["token_ids"] == want[:4] and body["stopped"] == "max_new_tokens" and isinstance(body["text"], str)
    helped = CliRunner().invoke(app, ["split", "generate", "--help"], env={"COLUMNS": "200"})
    assert helped.exit_code == 0 and "Example: smolforge split generate --server" in helped.stdout, helped.stdout


@pytest.mark.parametrize("args,needle", [
    (["--server", "127.0.0.1", "--run-dir", "{t}"], "is not HOST:PORT"),
    (["--server", "127.0.0.1:70000", "--run-dir", "{t}"], "is not HOST:PORT"),
    (["--server", "127.0.0.1:50051", "--run-dir", "{t}"], "holds no split-training checkpoint"),
    (["--server", "127.0.0.1:50051", "--run-dir", "{t}", "--temperature", "-1"], "temperature"),
    (["--server", "127.0.0.1:50051", "--run-dir", "{t}", "--max-new-tokens", "0"], "--max-new-tokens 0 is below 1"),
], ids=["no-port", "port-range", "not-a-run", "temperature", "max-new-tokens"])
def test_cli_split_generate_bad_input_is_one_message_and_exit_2(tmp_path, args, needle):
    from smolforge.cli.main import app

    argv = ["split", "generate", "--prompt", PROMPT] + [a.replace("{t}", str(tmp_path)) for a in args]
    res = CliRunner().invoke(app, argv, env={"SMOLFORGE_SPLIT_TOKEN": TOKEN})
    err = res.stderr
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), res.output
    assert err.startswith("error:") and err.count("error:") == 1 and needle in err and "\n  fix:" in err, err
    assert "Traceback" not in res.output and len(err.splitlines()) <= 6, err
