"""Teacher backends: batched HF generation with top-k, and the Ollama HTTP backend."""

from __future__ import annotations

import json
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import numpy as np
import pytest
import torch

from smolforge.distill.store import read_shard, ready_shards, StorePlan
from smolforge.distill.teacher import (GenSettings, HFTeacher, PromptItem, prompts_from_dataset, run_teacher_local,
                                       topk_from_logits, truncation_kl)
from smolforge.errors import SmolforgeError


@pytest.fixture(scope="module")
def teacher():
    return HFTeacher("tiny-llama", device="cpu")


@pytest.fixture(scope="module")
def items():
    return prompts_from_dataset("bundled", max_samples=10)


def test_batched_left_padded_generation_matches_one_by_one(teacher, items):
    recs = teacher.generate(items, GenSettings(max_new_tokens=6, top_k=8, batch_size=4))
    assert [r.example_id for r in recs] == [it.example_id for it in items]
    for r in recs[:5]:
        ids = torch.tensor([r.prompt_ids])
        out = teacher.model.generate(ids, max_new_tokens=6, do_sample=False, pad_token_id=teacher.pad_id,
                                     eos_token_id=teacher.eos_id)
        alone = out[0, ids.shape[1]:].tolist()
        assert alone[:len(r.response_ids)] == r.response_ids
        # top-k equals the unpadded teacher-forced forward pass over the response
        with torch.no_grad():
            logits = teacher.model(torch.tensor([r.prompt_ids + r.response_ids])).logits[0, len(r.prompt_ids) - 1:-1]
        lp = torch.log_softmax(logits, -1)
        v, i = lp.topk(8, -1)
        assert np.allclose(v.numpy(), r.topk_logprobs, atol=1e-4)
        assert np.array_equal(i.numpy(), r.topk_indices)
        tail = 1 - np.exp(r.topk_logprobs).sum(-1)
        assert np.allclose(tail, r.tail_mass, atol=1e-5)


def test_reference_responses_are_scored_teacher_forced(teacher, items):
    """responses="reference": the dataset's answers (exactly the SFT targets), with the teacher's
    top-k of each answer token from a batched, left-padded pass equal to the unpadded one."""
    from smolforge.distill.teacher import ReferenceTeacher

    s = GenSettings(top_k=8, batch_size=4, responses="reference")
    recs = teacher.generate(items, s)
    refs = ReferenceTeacher("tiny-llama").generate(items, s)
    assert [r.example_id for r in recs] == [it.example_id for it in items]
    for r, ref in zip(recs, refs):
        assert r.response_ids == ref.response_ids and r.prompt_ids == ref.prompt_ids and r.response_ids
        assert r.response_text == ref.answer and r.response_ids[-1] == teacher.eos_id
        with torch.no_grad():
            logits = teacher.model(torch.tensor([r.prompt_ids + r.response_ids])).logits[0, len(r.prompt_ids) - 1:-1]
        v, i = torch.log_softmax(logits, -1).topk(8, -1)
        assert r.topk_logprobs.shape == (len(r.response_ids), 8)
        assert np.allclose(v.numpy(), r.topk_logprobs, atol=1e-4)
        assert np.array_equal(i.numpy(), r.topk_indices)
    with pytest.raises(SmolforgeError, match="identical samples"):
        GenSettings(responses="reference", samples_per_prompt=2, temperature=1.0).check()
    with pytest.raises(SmolforgeError, match="unknown teacher responses"):
        GenSettings(responses="teacher").check()
    with pytest.raises(SmolforgeError, match="no reference answer"):
        teacher.generate([PromptItem(0, [{"role": "user", "content": "hi"}])], s)


def test_sampling_settings(teacher, items):
    s = GenSettings(temperature=0.9, top_p=0.9, max_new_tokens=5, samples_per_prompt=3, top_k=4, batch_size=8)
    recs = teacher.generate(items[:3], s)
    assert len(recs) == 9
    assert [(r.example_id, r.sample_id) for r in recs] == [(e.example_id, j) for e in items[:3] for j in range(3)]
    assert all(1 <= len(r.response_ids) <= 5 and r.topk_logprobs.shape == (len(r.response_ids), 4) for r in recs)
    with pytest.raises(SmolforgeError, match="identical samples"):
        teacher.generate(items[:1], GenSettings(samples_per_prompt=2))


def test_local_teacher_writes_shards_with_plan(tmp_path):
    manifests = run_teacher_local("tiny-llama", "bundled", tmp_path, num_shards=3, max_samples=9,
                                  settings=GenSettings(max_new_tokens=4, top_k=8), device="cpu")
    assert ready_shards(tmp_path) == [0, 1, 2]
    plan = StorePlan.read(tmp_path)
    assert plan.num_shards == 3 and plan.shards == [[0, 3], [3, 6], [6, 9]]
    shard = read_shard(tmp_path, 1)
    assert [r.example_id for r in shard.records] == [3, 4, 5]
    assert manifests[0]["teacher"] == "tiny-llama" and manifests[0]["has_logits"]
    rec = manifests[0]["reconstruction"]  # the codec's error on every row, top-k's own from the full logits
    assert rec["rows"] == rec["truncation_rows"] == manifests[0]["num_topk_rows"] > 0
    assert 0 <= rec["kl_mean"] <= rec["kl_max"] < 1e-3 and rec["truncation_kl_mean"] > 0


def test_a_teacher_answers_prompts_that_have_no_answers(tmp_path):
    """Distillation needs prompts, not labels: {"prompt"} lines, alpaca without "output" and a chat
    ending on a user turn are a teacher's input; the reference backend, which needs answers, refuses."""
    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps({"prompt": f"Reverse the word: {w}"}) + "\n" for w in ("abc", "bad", "cab"))
                    + json.dumps({"prompt": "Uppercase: ab", "completion": "AB"}) + "\n")
    items = prompts_from_dataset(str(data))  # one of the four is the held-out split (eval_fraction)
    asked = {i.prompt_messages[-1]["content"]: i.answer for i in items}
    assert len(items) == 3 and all(len(i.prompt_messages) == 1 for i in items)
    assert {p: a for p, a in asked.items() if a is not None} in ({}, {"Uppercase: ab": "AB"})
    assert {p for p, a in asked.items() if a is None} <= {"Reverse the word: abc", "Reverse the word: bad",
                                                            "Reverse the word: cab"}
    chat = tmp_path / "chat.jsonl"
    chat.write_text(json.dumps({"messages": [{"role": "system", "content": "Be brief."},
                                             {"role": "user", "content": "What is 2 + 3?"}]}) + "\n")
    assert prompts_from_dataset(str(chat))[0].prompt_messages[-1] == {"role": "user", "content": "What is 2 + 3?"}
    alpaca = tmp_path / "alpaca.jsonl"
    alpaca.write_text(json.dumps({"instruction": "Uppercase:", "input": "ab"}) + "\n")
    assert prompts_from_dataset(str(alpaca))[0].prompt_messages == [{"role": "user", "content": "Uppercase:\n\nab"}]
    manifests = run_teacher_local("tiny-llama", str(data), tmp_path / "store", max_samples=4,
                                  settings=GenSettings(max_new_tokens=3, top_k=4), device="cpu")
    assert [r.example_id for r in read_shard(tmp_path / "store", 0).records] == [0, 1, 2]
    assert manifests[0]["has_logits"]
    only = tmp_path / "only.jsonl"
    only.write_text(json.dumps({"prompt": "Reverse the word: abc"}) + "\n")
    with pytest.raises(SmolforgeError, match="has no reference answer"):
        run_teacher_local("tiny-llama", str(only), tmp_path / "ref", backend="reference", device="cpu")
    with pytest.raises(SmolforgeError, match="no assistant turn"):  # training still needs answers
        from smolforge.data.formats import read_examples
        read_examples(data.parent / "chat.jsonl")


def test_truncation_kl_is_the_full_kl_against_top_k_plus_even_tail():
    logits = torch.randn(5, 50) * 2
    values, idx, tail = topk_from_logits(logits, 8)
    p = torch.softmax(logits.double(), -1)
    approx = (tail.double() / 42)[:, None].expand(5, 50).clone()
    approx.scatter_(-1, idx, values.double().exp())
    want = (p * (p.log() - approx.log())).sum(-1)
    assert torch.allclose(truncation_kl(logits, idx, tail).double(), want, atol=1e-5)
    assert torch.equal(truncation_kl(logits, logits.topk(50).indices, torch.zeros(5)), torch.zeros(5))


def test_the_fused_topk_rows_are_the_two_functions():
    """`topk_rows` (what both teachers run, one top-k and one exp pass) gives `topk_from_logits` and
    `truncation_kl`'s numbers: at a real vocabulary's width, with a peaked row (tail ~1e-9, which
    1 - head would lose), a row with -inf logits (0 log 0) and k ≥ V."""
    from smolforge.distill.teacher_topk import topk_rows

    logits = torch.randn(6, 151_936) * 2
    logits[1, 7] = 40.0  # peaked: tail ~5e-12
    with_inf = logits.clone()
    with_inf[2, :100] = -float("inf")
    for rows, k in ((logits, 32), (with_inf, 32), (logits[:, -20:], 32)):
        values, idx, tail, kl = topk_rows(rows, k)
        want_v, want_i, want_t = topk_from_logits(rows, k)
        assert torch.equal(idx, want_i)
        assert torch.allclose(values, want_v, atol=1e-5)
        assert torch.allclose(tail, want_t, rtol=1e-4, atol=0)
        assert torch.allclose(kl, truncation_kl(rows, want_i, want_t), rtol=1e-3, atol=1e-9)


# --------------------------------------------------------------------------------------- Ollama

def _entry(text: str, logprob: float, alts: list[tuple[str, float]]):
    enc = lambda s: list(s.encode("utf-8"))  # noqa: E731
    return {"token": text, "logprob": logprob, "bytes": enc(text),
            "top_logprobs": [{"token": t, "logprob": lp, "bytes": enc(t)} for t, lp in alts]}


# Recorded from the protocol of Ollama ≥ 0.12.11 (`/api/chat`, stream false, logprobs + top_logprobs).
RECORDED = {
    "model": "qwen2.5:0.5b", "created_at": "2025-11-20T10:00:00.000Z",
    "message": {"role": "assistant", "content": "12"},
    "done": True, "done_reason": "stop", "total_duration": 81234567, "load_duration": 1234567,
    "prompt_eval_count": 31, "eval_count": 2, "eval_duration": 45678901,
    "logprobs": [_entry("1", -0.1, [("1", -0.1), ("2", -3.2), (" ", -4.0)]),
                 _entry("2", -0.2, [("2", -0.2), ("3", -1.9), ("1", -3.5)])],
}


class _Recorded(BaseHTTPRequestHandler):
    """Answers like `ollama serve` would, from a recording; Ollama itself cannot run on this machine."""

    requests: list = []
    with_logprobs = True

    def do_POST(self):  # noqa: N802
        body = json.loads(self.rfile.read(int(self.headers["Content-Length"])))
        type(self).requests.append((self.path, body))
        if body.get("model") != "qwen2.5:0.5b":
            self._send(404, {"error": f"model '{body.get('model')}' not found"})
            return
        answer = dict(RECORDED)
        if not (type(self).with_logprobs and body.get("logprobs")):
            answer.pop("logprobs")
        self._send(200, answer)

    def _send(self, code, obj):
        data = json.dumps(obj).encode()
        self.send_response(code)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture()
def ollama_server():
    _Recorded.requests = []
    _Recorded.with_logprobs = True
    server = ThreadingHTTPServer(("127.0.0.1", 0), _Recorded)
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{server.server_address[1]}"
    server.shutdown()
    server.server_close()


def test_ollama_backend_with_top_logprobs(ollama_server):
    """Against a recorded-protocol server (Ollama cannot run here): text plus mapped top logprobs."""
    from smolforge.distill.ollama import OllamaTeacher

    # tiny-llama's byte-level tokenizer stands in for qwen2.5's: digits are single tokens in both.
    t = OllamaTeacher("qwen2.5:0.5b", host=ollama_server, tokenizer_name="tiny-llama")
    item = PromptItem(0, [{"role": "user", "content": "What is 5 + 7?"}], "12")
    recs = t.generate([item], GenSettings(max_new_tokens=8, top_k=4, temperature=0.0))
    path, body = _Recorded.requests[0]
    assert path == "/api/chat" and body["logprobs"] is True and body["top_logprobs"] == 4
    assert body["options"]["num_predict"] == 8 and body["messages"] == item.prompt_messages
    (rec,) = recs
    tok = t.tokenizer
    assert rec.response_text == "12"
    assert rec.response_ids == tok("12", add_special_tokens=False)["input_ids"] + [tok.eos_token_id]
    assert rec.has_topk and rec.topk_logprobs.shape == (3, 4)
    one, two = tok.convert_tokens_to_ids("1"), tok.convert_tokens_to_ids("2")
    assert rec.topk_indices[0, 0] == one and rec.topk_indices[1, 0] == two
    assert rec.topk_logprobs[0, 0] == pytest.approx(-0.1)
    assert rec.tail_mass[0] == pytest.approx(1 - np.exp([-0.1, -3.2, -4.0]).sum(), abs=1e-6)
    assert len(set(rec.topk_indices[0].tolist())) == 4  # padding ids are distinct


def test_ollama_backend_text_only_and_errors(ollama_server):
    """Recorded-protocol server without logprobs (older Ollama): records are text-only."""
    from smolforge.distill.ollama import OllamaTeacher

    _Recorded.with_logprobs = False
    t = OllamaTeacher("qwen2.5:0.5b", host=ollama_server, tokenizer_name="tiny-llama")
    (rec,) = t.generate([PromptItem(0, [{"role": "user", "content": "5+7?"}])], GenSettings(top_k=4))
    assert rec.response_text == "12" and not rec.has_topk and rec.response_ids
    missing = OllamaTeacher("llama3.2:1b", host=ollama_server, tokenizer_name="tiny-llama")
    with pytest.raises(SmolforgeError, match="ollama pull"):
        missing.generate([PromptItem(0, [{"role": "user", "content": "hi"}])], GenSettings())
    dead = OllamaTeacher("qwen2.5:0.5b", host="http://127.0.0.1:9", tokenizer_name="tiny-llama")
    with pytest.raises(SmolforgeError, match="cannot reach Ollama"):
        dead.generate([PromptItem(0, [{"role": "user", "content": "hi"}])], GenSettings())
    with pytest.raises(SmolforgeError, match="cannot score given answers"):
        t.generate([PromptItem(0, [{"role": "user", "content": "5+7?"}], "12")], GenSettings(responses="reference"))
