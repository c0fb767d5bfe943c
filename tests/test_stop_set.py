"""One stop set, asked by every path (issue 41, "End of turn").

A Phi-3-kind model ends its turn with `<|end|>`: in its generation config's eos list, not its tokenizer's
eos (`<|endoftext|>`). A short LoRA on identical chat rows makes the reduced Phi-3 twin really answer
"pong pong<|end|>" (greedy); every path must then give that text and stop at that token, since each asks
`families.stop_ids` (the generation config's eos ids, the tokenizer's eos, the template's end of turn):
`train`'s held-out accuracy, `smolforge generate`, `smolforge eval`, the hf and llamacpp teachers (the
store's response ends at `<|end|>`), serve's torch engine (one process and 2 stages) and its llama.cpp
engine, and the GGUF export (llama.cpp's EOT key). Before, generate ran on to the token cap, eval and
the held-out accuracy said 0 %, and the teachers wrote responses past the end of turn.

The other chat twins' stop sets are checked on the cheap paths without training: the model's head is
rigged to emit one id of its stop set first, and eval's answers, the hf teacher and the serve engine
must each stop right there, for every id of the set.
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from smolforge.models import families

pytestmark = pytest.mark.timeout(300)

PHI3 = "twin:phi-3-mini-4k-instruct"
ANSWER = "pong pong"
ROW = {"messages": [{"role": "user", "content": "ping"}, {"role": "assistant", "content": ANSWER}]}
END_OF_TURN = "<|end|>"


def _cli(argv: list[str]) -> tuple[int, str, str]:
    """The CLI in this process: (exit code, stdout, stderr); a traceback fails the test."""
    from typer.testing import CliRunner

    from smolforge.cli.main import app

    res = CliRunner().invoke(app, argv, env={"SMOLFORGE_COORDINATOR": "", "SMOLFORGE_TOKEN": None})
    if res.exit_code != 0:
        raise AssertionError(f"{argv[0]} exited {res.exit_code}: {res.exception!r}\n{res.output[-3000:]}")
    return res.exit_code, res.stdout, res.stderr


@pytest.fixture(scope="module")
def memorised(tmp_path_factory) -> SimpleNamespace:
    """The Phi-3 twin with a LoRA that memorised "pong pong<|end|>" (40 steps on 8 identical rows, ~7 s),
    and its merge as an HF directory (what a teacher or the llama.cpp engine loads)."""
    from smolforge.models.loading import load_tokenizer

    work = tmp_path_factory.mktemp("stop-set")
    data = work / "rows.jsonl"
    data.write_text("".join(json.dumps(ROW) + "\n" for _ in range(8)))
    _, out, _ = _cli(["train", "--model", PHI3, "--data", str(data), "--eval-data", str(data), "--peft", "lora",
                      "--max-steps", "40", "--batch-size", "4", "--max-length", "32", "--lr", "1e-2", "--seed", "0",
                      "--device", "cpu", "--precision", "fp32", "--num-threads", "1", "--no-tensorboard",
                      "--output-dir", str(work / "train"), "--json"])
    summary = json.loads(out)
    merged = work / "merged"
    _cli(["export", "--model", PHI3, "--adapter", summary["adapter_dir"], "--to", "hf", "--dtype", "fp32",
          "--output-dir", str(merged)])
    tok = load_tokenizer(PHI3)
    return SimpleNamespace(work=work, data=data, summary=summary, adapter=summary["adapter_dir"], merged=merged,
                           tok=tok, end=tok.convert_tokens_to_ids(END_OF_TURN),
                           answer_ids=tok(ANSWER, add_special_tokens=False)["input_ids"])


def _prompt_ids(tok) -> list[int]:
    from smolforge.data.encode import render

    return tok(render(tok, ROW["messages"][:1], add_generation_prompt=True), add_special_tokens=False)["input_ids"]


def _engine_done(model, prompts: list[list[int]], max_tokens: int = 12) -> list:
    """The serve engine's DoneEvent for each prompt (greedy, one batch)."""
    from smolforge.serve.batch import Request
    from smolforge.serve.engine import Engine
    from smolforge.serve.events import DoneEvent
    from smolforge.serve.sampling import SamplingParams

    done: dict[int, DoneEvent] = {}
    Engine(model).run_batch([Request(ids, SamplingParams(max_tokens=max_tokens, temperature=0),
                                     (lambda i: lambda e: done.__setitem__(i, e) if isinstance(e, DoneEvent) else None)(i))
                             for i, ids in enumerate(prompts)])
    return [done[i] for i in range(len(prompts))]


# ---------------------------------------------------------------------------------------------- Phi-3, memorised

def test_the_end_of_turn_is_not_the_tokenizers_eos(memorised):
    """The situation: `<|end|>` ends the turn, the generation config lists it, the tokenizer's eos is another."""
    tok = memorised.tok
    assert tok.eos_token == "<|endoftext|>" and memorised.end != tok.eos_token_id
    assert memorised.end in families.stop_ids(tok, memorised.merged)


def test_train_held_out_accuracy_counts_the_answer(memorised):
    assert memorised.summary["eval"]["accuracy"] == 1.0, memorised.summary["eval"]


def test_generate_stops_at_the_end_of_turn(memorised):
    _, out, _ = _cli(["generate", "--model", PHI3, "--adapter", memorised.adapter, "--prompt", "ping",
                      "--max-new-tokens", "12", "--device", "cpu"])
    assert out.strip() == ANSWER, out


def test_eval_accuracy_is_the_answers(memorised):
    _, out, _ = _cli(["eval", "--model", PHI3, "--adapter", memorised.adapter, "--data", str(memorised.data),
                      "--max-new-tokens", "12", "--device", "cpu", "--json"])
    report = json.loads(out)
    assert report["accuracy"] == 1.0 and report["examples"] == 8, report


def _store_responses(store: Path) -> list:
    from smolforge.distill.store import read_shard, ready_shards

    return [r for shard in ready_shards(store) for r in read_shard(store, shard).records]


def test_hf_teacher_writes_the_response_up_to_the_end_of_turn(memorised):
    from smolforge.distill.teacher import GenSettings, run_teacher_local

    store = memorised.work / "store-hf"
    run_teacher_local(str(memorised.merged), str(memorised.data), store, max_samples=2, device="cpu",
                      settings=GenSettings(max_new_tokens=12, top_k=4, batch_size=2))
    records = _store_responses(store)
    assert len(records) == 2
    for rec in records:
        assert list(rec.response_ids) == memorised.answer_ids + [memorised.end], rec.response_ids
        assert rec.response_text == ANSWER and len(rec.topk_indices) == len(rec.response_ids)


def test_serve_torch_engine_stops_at_the_end_of_turn(memorised):
    from smolforge.serve.model import ServedModel
    from smolforge.serve.stages import local_stages, staged_model

    single = ServedModel.load(PHI3, memorised.adapter, name="phi3", device="cpu")
    stages = staged_model(PHI3, local_stages(PHI3, [0, 1, 2], adapter=memorised.adapter))
    for model in (single, stages):
        (done,) = _engine_done(model, [_prompt_ids(memorised.tok)])
        assert (done.token_ids, done.text, done.finish_reason) == (memorised.answer_ids + [memorised.end], ANSWER,
                                                                   "stop"), done


@pytest.fixture(scope="module")
def gguf_file(memorised) -> Path:
    """The memorised model as a GGUF (f16; llama.cpp's check against HF skipped here: the soak test runs it)."""
    pytest.importorskip("llama_cpp")
    out = memorised.work / "gguf"
    _cli(["export", "--model", str(memorised.merged), "--to", "gguf", "--quant", "f16", "--no-verify",
          "--output-dir", str(out)])
    return out / "model.gguf"


def _llamacpp_cells(memorised, path: Path, engine, batch_size: int) -> None:
    """The GGUF's EOT key is `<|end|>`, which llama.cpp ends a generation on; the llama.cpp serve engine stops
    there; the llamacpp teacher (the GGUF file with the model's tokenizer; `batch_size` 1: one sequence at a
    time, else batched decoding) writes the response up to it."""
    from gguf import GGUFReader

    from smolforge.distill.teacher import GenSettings, run_teacher_local

    field = GGUFReader(str(path)).get_field("tokenizer.ggml.eot_token_id")
    assert field is not None and int(field.contents()) == memorised.end
    assert engine.lc.llama_vocab_is_eog(engine.lc.llama_model_get_vocab(engine._model), memorised.end)
    (done,) = _engine_done(engine, [_prompt_ids(memorised.tok)])
    assert (done.token_ids, done.text, done.finish_reason) == (memorised.answer_ids + [memorised.end], ANSWER,
                                                               "stop"), done
    store = memorised.work / f"store-llamacpp-{path.parent.name}"
    run_teacher_local(str(path), str(memorised.data), store, max_samples=2, backend="llamacpp",
                      settings=GenSettings(max_new_tokens=12, top_k=4, batch_size=batch_size),
                      tokenizer=str(memorised.merged), n_threads=1)
    records = _store_responses(store)
    assert len(records) == 2
    for rec in records:
        assert list(rec.response_ids) == memorised.answer_ids + [memorised.end], rec.response_ids


def test_gguf_llamacpp_engine_and_teacher_stop_where_hf_stops(memorised, gguf_file, monkeypatch):
    from smolforge.models.export import cache
    from smolforge.serve.llamacpp import load_llamacpp

    with monkeypatch.context() as patch:  # only while the engine loads: a module imported now would keep it
        patch.setattr(cache, "cached_gguf", lambda model, quant, **kw: gguf_file)  # the export made above
        engine = load_llamacpp(str(memorised.merged), name="phi3", quant="f16", n_threads=1, max_batch=1)
    _llamacpp_cells(memorised, gguf_file, engine, batch_size=2)


@pytest.mark.soak
def test_verified_gguf_export_stops_where_hf_stops(memorised):
    """The same through the node's cached, llama.cpp-verified export (what `serve --engine llamacpp` loads)."""
    pytest.importorskip("llama_cpp")
    from smolforge.models.export.cache import cached_gguf
    from smolforge.serve.llamacpp import load_llamacpp

    path = cached_gguf(str(memorised.merged), "f16", threads=1)
    engine = load_llamacpp(str(memorised.merged), name="phi3", quant="f16", n_threads=1, max_batch=1)
    _llamacpp_cells(memorised, path, engine, batch_size=1)


# ---------------------------------------------------------------------------------------------- split generate

SPLIT_TOKEN = "stop-set-token"


@pytest.fixture(scope="module")
def split_server(tmp_path_factory):
    from smolforge.split.server import ServeConfig, serve

    srv = serve(ServeConfig(model=PHI3, split_point_1=1, split_point_2=2, lora_rank=4, lora_alpha=8, lora_dropout=0.0,
                            port=0, token=SPLIT_TOKEN, num_threads=1,
                            checkpoint_dir=str(tmp_path_factory.mktemp("split-ck"))))
    yield srv
    srv.stop(0)


def _split_run(server, data: Path, out: Path, steps: int):
    """A split run on the Phi-3 twin (bottom and top here, the trunk on `server`) and its generator."""
    from smolforge.config import DataSpec
    from smolforge.data import load_splits
    from smolforge.models.loading import load_tokenizer
    from smolforge.split.generate import SplitGenerateConfig, SplitGenerator
    from smolforge.split.trainer import SplitTrainConfig, train_split

    tok = load_tokenizer(PHI3)
    cfg = SplitTrainConfig(model=PHI3, split_point_1=1, split_point_2=2, server_port=server.port, token=SPLIT_TOKEN,
                           lora_rank=4, lora_alpha=8, lora_dropout=0.0, batch_size=4, learning_rate=1e-2,
                           warmup_steps=0, max_steps=steps, max_eval_samples=0, output_dir=str(out), num_threads=1,
                           quiet=True, seed=0)
    train_split(cfg, splits=load_splits(DataSpec(path=str(data), max_length=32, max_eval_samples=0), tok), tokenizer=tok)
    return SplitGenerator(SplitGenerateConfig(run_dir=str(out), prompt="ping", server_port=server.port, token=SPLIT_TOKEN,
                                              max_new_tokens=12, num_threads=1), tokenizer=tok)


def test_split_generate_stops_at_every_stop_id(memorised, split_server):
    """`split generate` (its top part here decides the tokens) ends a reply at any id of the stop set: the top's
    head rigged to emit each id first, the reply is that id alone, stopped as "eos"."""
    gen = _split_run(split_server, memorised.data, memorised.work / "split-1", steps=1)
    try:
        for token in sorted(families.stop_ids(memorised.tok, memorised.merged)):
            head = next(m for n, m in gen.top.named_modules() if n.endswith("lm_head"))
            handle = head.register_forward_hook(lambda module, args, out, t=token: out.index_add(
                -1, torch.tensor([t]), torch.full((*out.shape[:-1], 1), 1e4, dtype=out.dtype)))
            try:
                res = gen.reply("ping")
            finally:
                handle.remove()
            assert (res.token_ids, res.text, res.stopped) == ([token], "", "eos"), (token, res)
    finally:
        gen.close()


@pytest.mark.soak
def test_split_generate_gives_the_memorised_answer(memorised, split_server):
    """A split run that memorised the answer (40 steps): `split generate` replies with it and stops at `<|end|>`."""
    gen = _split_run(split_server, memorised.data, memorised.work / "split-40", steps=40)
    try:
        res = gen.reply("ping")
    finally:
        gen.close()
    assert (res.text, res.token_ids, res.stopped) == (ANSWER, memorised.answer_ids + [memorised.end], "eos"), res


# ---------------------------------------------------------------------------------------------- every chat twin

CHAT_TWINS = ("phi-3-mini-4k-instruct", "llama-3.2-1b-instruct", "qwen2.5-0.5b-instruct", "smollm2-360m-instruct",
              "tinyllama-1.1b-chat-v1.0")


@pytest.fixture(scope="module", params=CHAT_TWINS)
def twin(request) -> SimpleNamespace:
    from smolforge.models.loading import load_model, load_tokenizer, resolve_model

    name = f"twin:{request.param}"
    tok, net = load_tokenizer(name), load_model(name, device="cpu").eval()
    return SimpleNamespace(name=name, tok=tok, net=net, stops=sorted(families.stop_ids(tok, resolve_model(name))))


def _rigged(net, token: int):
    """A forward hook making `token` every position's greedy choice (the handle removes it)."""
    def hook(module, args, out):
        out = out.clone()
        out[..., token] += 1e4
        return out

    return net.get_output_embeddings().register_forward_hook(hook)


def test_every_stop_id_ends_eval_teacher_and_serve(twin):
    """For each id of the twin's stop set, emitted first: eval's answer is empty, the hf teacher's response is
    that one id, and the serve engine stops after it."""
    from smolforge.data.formats import Example
    from smolforge.distill.teacher import GenSettings, HFTeacher, PromptItem
    from smolforge.serve.model import ServedModel
    from smolforge.train.evaluate import generate_answers

    teacher = HFTeacher(twin.name, device="cpu", model_obj=twin.net, tokenizer=twin.tok)
    served = ServedModel.wrap(twin.net, twin.tok, name=twin.name, device="cpu")
    item = PromptItem(0, ROW["messages"][:1], ANSWER)
    for token in twin.stops:
        handle = _rigged(twin.net, token)
        try:
            answers = generate_answers(twin.net, twin.tok, [Example("t", messages=ROW["messages"])],
                                       max_new_tokens=4)
            (rec,) = teacher.generate([item], GenSettings(max_new_tokens=4, top_k=2, batch_size=1))
            (done,) = _engine_done(served, [teacher.prompt_ids(item)], max_tokens=4)
        finally:
            handle.remove()
        assert answers == [""], (token, answers)
        assert list(rec.response_ids) == [token], (token, rec.response_ids)
        assert (done.token_ids, done.text, done.finish_reason) == ([token], "", "stop"), (token, done)


# ---------------------------------------------------------------------------------------------- export keys

class _Keys:
    """A GGUF writer's end-of-generation setters, recorded."""

    def __init__(self):
        self.got: dict[str, int] = {}

    def add_eot_token_id(self, tid: int) -> None:
        self.got["eot"] = tid

    def add_eom_token_id(self, tid: int) -> None:
        self.got["eom"] = tid


@pytest.mark.parametrize("family, keys, stops", [
    ("phi-3-mini-4k-instruct", {"eot": "<|end|>"}, ["<|end|>", "<|user|>", "<|assistant|>"]),
    ("llama-3.2-1b-instruct", {"eot": "<|eot_id|>", "eom": "<|eom_id|>"},
     ["<|eot_id|>", "<|start_header_id|>", "<|end_of_text|>", "<|eom_id|>"]),
    ("qwen2.5-0.5b-instruct", {"eot": "<|im_end|>"}, ["<|im_start|>", "<|im_end|>", "<|endoftext|>"]),
])
def test_gguf_end_of_turn_keys_and_modelfile_stops(family, keys, stops):
    """The GGUF's EOT/EOM keys and the Modelfile's `PARAMETER stop` lines come from the stop set: every stop
    text besides the eos (which Ollama stops on by itself) after the chat format's own."""
    from smolforge.models.export import ollama
    from smolforge.models.export.gguf import chat_template
    from smolforge.models.export.gguf_vocab import write_stops
    from smolforge.models.export.merge import MergedModel
    from smolforge.models.export.run import modelfile_stops
    from smolforge.models.loading import load_tokenizer, resolve_model

    name = f"twin:{family}"
    path, tok = Path(resolve_model(name)), load_tokenizer(name)
    writer = _Keys()
    write_stops(writer, path, path)
    assert writer.got == {k: tok.convert_tokens_to_ids(v) for k, v in keys.items()}
    text, chosen = ollama.modelfile(chat_template(path), ollama.tokens_of(path), stops=modelfile_stops(MergedModel(path)))
    assert chosen["stops"] == stops and [line for line in text.splitlines() if line.startswith("PARAMETER")] == [
        f'PARAMETER stop "{s}"' for s in stops]
