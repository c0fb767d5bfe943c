"""`--teacher-backend openai`: a teacher behind an OpenAI-compatible endpoint (issue 46 item 4).

Against the real `smolforge serve` of tiny-llama these serve tests share (loopback, one thread; here so
that it starts no second server), the same model the `hf` teacher loads:
- the store it writes validates, its tokens are the student's ids, and a student trains from it on the
  logits (a few steps);
- greedy, its answers are the hf teacher's and its top-k ids are the hf teacher's at >= 99 % of positions;
- a wrong key (401) and a URL where nothing listens are each one SmolforgeError with its fix (exit 2);
- a token text that no student id spells keeps that answer as text (sequence-level KD), said once;
- the endpoint's own token ids decide where it sends them and its vocabulary is the student's (a byte-
  fallback token and the piece of the same bytes, the end of turn named by no text); else bytes/text, said;
- what llama-server sends (seen from it): a control token named '' with no bytes, only its id, and an
  entry that carries the bytes of tokens it held back inside a UTF-8 character (their positions not sent);
- (soak, test_teacher_openai_topk.py) the same against `smolforge serve` and llama.cpp's `llama-server`
  over hundreds of positions, exact on fp32/f32 and counting near-ties on f16.
"""

from __future__ import annotations

import os
from pathlib import Path

import numpy as np
import pytest

from smolforge.distill.prompts import GenSettings
from smolforge.errors import SmolforgeError

from servehelpers import free_port

pytestmark = pytest.mark.timeout(300)

K = 8
GEN = GenSettings(max_new_tokens=8, top_k=K)


@pytest.fixture
def served(server):
    """The serve tests' one `smolforge serve` of tiny-llama (tests/serve/conftest.py): no second server."""
    return server


def _student_cfg(out: Path):
    from smolforge.config import PeftSpec
    from smolforge.distill.losses import KDConfig
    from smolforge.distill.student import StudentConfig

    return StudentConfig(base_model="tiny-llama", output_dir=str(out), max_steps=2, batch_size=2, lr=1e-3,
                         device="cpu", num_threads=1, peft=PeftSpec(method="lora", r=4, alpha=8, dropout=0.0),
                         kd=KDConfig(kd_ratio=0.5), wait_timeout_s=120, poll_s=0.05)


def test_the_endpoint_teacher_writes_the_hf_teachers_store_and_a_student_trains_from_it(served, tmp_path, monkeypatch):
    from smolforge.distill.shard_source import DirShardSource
    from smolforge.distill.store import read_shard, tokenizer_hash
    from smolforge.distill.student import train_student
    from smolforge.distill.teacher import HFTeacher, prompts_from_dataset, run_teacher_local
    from smolforge.models.loading import load_tokenizer

    monkeypatch.setenv("OPENAI_API_KEY", served.token)
    out = tmp_path / "teacher_outputs"
    manifests = run_teacher_local(served.model, "bundled", out, num_shards=1, max_samples=6, settings=GEN,
                                  backend="openai", teacher_url=f"{served.base}/v1", tokenizer="tiny-llama")
    tok = load_tokenizer("tiny-llama")
    m = manifests[0]
    assert m["backend"] == "openai" and m["tokenizer_hash"] == tokenizer_hash(tok) and m["k"] == K
    got = read_shard(out, 0).records  # checksum verified, then parsed
    want = HFTeacher("tiny-llama", device="cpu").generate(prompts_from_dataset("bundled", max_samples=6), GEN)
    # a token that is part of a character (its text alone U+FFFD) is named by its `bytes`: no answer is text only
    assert m["endpoint"]["k"] == K and m["endpoint"]["text_only"] == 0, m["endpoint"]
    same, partial, total = _topk_agreement(got, want, tok)
    for g, w in zip(got, want):
        # the store keeps log-probs as fp16 (spacing 1/256 between 4 and 8): relative tolerance as well
        assert np.allclose(g.topk_logprobs[:, 0], w.topk_logprobs[:len(g.response_ids), 0], atol=1e-3, rtol=1e-3)
    print(f"top-{K} ids equal the hf teacher's at {same}/{total} positions raw ({partial} rows hold a byte token)")
    assert total >= 16 and partial >= 1 and same >= 0.99 * total, (same, partial, total)
    res = train_student(_student_cfg(tmp_path / "student"), DirShardSource(out, poll_s=0.05),
                        teacher_tokenizer_hash=tokenizer_hash(tok))
    assert res.mode == "logit" and res.steps == 2  # trained on the endpoint's logits


def test_reference_answers_are_scored_by_echo_as_the_hf_teacher_scores_them(served, monkeypatch):
    """`--teacher-responses reference`: the prompt and the reference answer sent with `echo`, `max_tokens` 0;
    the answer's positions are the hf teacher's ids (end of turn included), their top-k its top-k."""
    from dataclasses import replace

    from smolforge.distill.teacher import HFTeacher, prompts_from_dataset

    monkeypatch.setenv("OPENAI_API_KEY", served.token)
    items, ref = prompts_from_dataset("bundled", max_samples=4), replace(GEN, responses="reference", batch_size=1)
    teacher = _teacher(f"{served.base}/v1")
    got, want = teacher.generate(items, ref), HFTeacher("tiny-llama", device="cpu").generate(items, ref)
    same, total = 0, 0
    for g, w in zip(got, want):
        assert (g.prompt_ids, g.response_ids) == (w.prompt_ids, w.response_ids) and g.has_topk
        for row_g, lp_g, row_w in zip(g.topk_indices, g.topk_logprobs, w.topk_indices):
            given = {i for i, lp in zip(row_g.tolist(), lp_g.tolist()) if lp > -60000}
            same += given == set(row_w.tolist())  # raw: `content` names every alternative by its bytes
            total += 1
    assert teacher.text_only == 0 and total >= 16 and same >= 0.99 * total, (same, total)


def _topk_agreement(got: list, want: list, tok) -> tuple[int, int, int]:
    """(positions whose top-k id set equals the hf teacher's, of them rows holding a byte token, positions),
    raw: every id, the bytes of a character's pieces included. Asserts the greedy answers are the hf
    teacher's and each answer token is in its own row."""
    same = total = partial = 0
    for g, w in zip(got, want):
        assert g.prompt_ids == w.prompt_ids and g.has_topk
        assert g.response_text == w.response_text  # greedy: the hf teacher's answer
        assert g.response_ids == w.response_ids[:len(g.response_ids)]
        assert all(t in row for t, row in zip(g.response_ids, g.topk_indices.tolist()))  # each token in its row
        for row_g, lp_g, row_w in zip(g.topk_indices, g.topk_logprobs, w.topk_indices):
            given = {i for i, lp in zip(row_g.tolist(), lp_g.tolist()) if lp > -60000}
            same += given == set(row_w.tolist())
            partial += any("\ufffd" in tok.decode([i]) for i in row_w.tolist())
            total += 1
    return same, partial, total


def _teacher(url: str, **kw):
    from smolforge.distill.teacher_openai import OpenAITeacher

    return OpenAITeacher("tiny", url=url, tokenizer="tiny-llama", say=kw.pop("say", print), **kw)


def _distill_cli(tmp_path, url: str, *extra: str, teacher: str = "tiny"):
    """`smolforge distill` with the endpoint teacher, in this process: refused at submit or not at all."""
    from helpers import smolforge_here

    return smolforge_here("distill", "--teacher", teacher, "--teacher-backend", "openai", "--teacher-url", url,
                          "--student", "tiny-llama", "--data", "bundled", "--max-steps", "1",
                          "--output-dir", str(tmp_path / "run"), *extra)


def _one_message(result, needle: str) -> str:
    err = result.stderr
    assert result.exit_code == 2 and err.count("error:") == 1 and "\n  fix:" in err and needle in err, err
    assert "Traceback" not in result.output
    return err


def test_a_wrong_key_and_an_unreachable_url_are_one_message_each(served, tmp_path, monkeypatch):
    """At submit (`OpenAIBackend.check` probes GET /models: nothing starts) and where the teacher runs."""
    from smolforge.distill.teacher import prompts_from_dataset

    monkeypatch.delenv("OPENAI_API_KEY", raising=False)
    key = tmp_path / "key"
    key.write_text("not-the-token\n")
    err = _one_message(_distill_cli(tmp_path, f"{served.base}/v1", "--teacher-key-file", str(key)),
                       "refused the key (401)")
    assert "not-the-token" not in err and "--teacher-key-file" in err  # the key is never repeated
    _one_message(_distill_cli(tmp_path, f"http://127.0.0.1:{free_port()}/v1"), "cannot reach the teacher endpoint")
    monkeypatch.setenv("OPENAI_API_KEY", served.token)
    _one_message(_distill_cli(tmp_path, f"{served.base}/v1", teacher="no-such-model"),  # the key is good now
                 "does not serve 'no-such-model' (it serves tiny)")
    items = prompts_from_dataset("bundled", max_samples=1)
    with pytest.raises(SmolforgeError) as caught:  # the teacher itself, on its node
        _teacher(f"{served.base}/v1", key_file=str(key)).generate(items, GEN)
    assert caught.value.exit_code == 2 and "refused the key (401)" in caught.value.what


def test_launch_takes_the_teacher_flags_in_its_distillation_modes_only(tmp_path):
    """`launch --mode teacher_student --teacher-backend openai --teacher-url URL` reaches the same submit check
    (an unreachable URL: exit 2, nothing started); in another mode the flags are refused by name."""
    from helpers import smolforge_here

    base = ["launch", "--model", "tiny", "--dataset", "bundled", "--output-dir", str(tmp_path / "out")]
    url = f"http://127.0.0.1:{free_port()}/v1"
    _one_message(smolforge_here(*base, "--mode", "teacher_student", "--student", "tiny-llama",
                                "--teacher-backend", "openai", "--teacher-url", url), "cannot reach the teacher endpoint")
    _one_message(smolforge_here(*base, "--teacher-url", url, "--teacher-key-file", "k"),
                 "--teacher-url, --teacher-key-file apply to --mode teacher_student or hybrid, not data_parallel")


def test_a_token_no_student_id_spells_keeps_the_answer_as_text(served):
    """The vocabulary check: one unmappable token and the answer is text only (sequence-level KD), said once."""
    from smolforge.distill.store import TeacherRecord

    said: list[str] = []
    teacher = _teacher(f"{served.base}/v1", say=said.append)
    ok = [(" is", [(" is", -0.1), ("?", -2.5)])]
    for pos in (ok, [*ok, ("\u2603\u2603-no-such-token", [])]):
        text = "".join(t for t, _ in pos)
        rec = TeacherRecord(example_id=0, prompt_messages=[], prompt_ids=[], response_ids=[], response_text=text)
        teacher._keep(rec, pos, K, text)
        assert rec.has_topk == (pos is ok)
        assert rec.response_ids == teacher.tokenizer(text, add_special_tokens=False)["input_ids"]
    assert teacher.text_only == 1 and len(said) == 1 and "sequence-level KD" in said[0]


@pytest.mark.soak  # the embedded cluster's and its task processes' starts: a minute or more here
def test_distill_with_an_endpoint_teacher_on_the_embedded_cluster(served, tmp_path):
    """`smolforge distill --teacher-backend openai`: through the job, the queue, the cluster and the teacher
    task (placed on any node: nothing to hold), the key from the file, the student trained on the logits."""
    import json

    from helpers import last_json, smolforge

    key = tmp_path / "key"
    key.write_text(served.token)
    out = tmp_path / "run"
    env = {"RAY_TMPDIR": f"/tmp/sfoa{os.getpid()}", "SMOLFORGE_COORDINATOR": "", "SMOLFORGE_RAY_ADDRESS": "",
           "OPENAI_API_KEY": ""}
    proc = smolforge("distill", "--teacher", served.model, "--teacher-backend", "openai",
                     "--teacher-url", f"{served.base}/v1", "--teacher-key-file", str(key),
                     "--student", "tiny-llama", "--data", "bundled", "--max-samples", "8", "--max-steps", "2",
                     "--batch-size", "4", "--max-new-tokens", "6", "--top-k", "8", "--num-students", "1",
                     "--no-eval", "--save-every", "0", "--output-dir", str(out), "--json", timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert served.token not in proc.stdout + proc.stderr  # the key is in no output
    summary = last_json(proc.stdout)
    assert [s["state"] for s in summary["student_tasks"]] == ["completed"]
    manifests = [json.loads(p.read_text()) for p in sorted((out / "teacher_outputs").glob("batch_*.json"))]
    assert manifests and all(m["backend"] == "openai" and m["endpoint"]["k"] == 8 for m in manifests)
    assert summary["per_student"][0]["kd"] == "logit", summary["per_student"][0]


def test_429_and_5xx_are_retried_with_backoff_then_the_answer_is_kept(monkeypatch):
    """A loopback endpoint that answers 429, then 503, then a completion: three requests, two waits doubling
    (the backoff asked of `time.sleep`), the third answer's rows kept; a 500 past the retries is one message."""
    import json
    import threading
    from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

    from smolforge.distill import teacher_openai
    from smolforge.distill.store import TeacherRecord

    answers = [(429, {}), (503, {}), (200, {"choices": [{"text": " is", "logprobs": {
        "tokens": [" is"], "token_logprobs": [-0.1], "top_logprobs": [{" is": -0.1, "?": -2.5}], "text_offset": [0]}}]})]
    seen: list[int] = []

    class Handler(BaseHTTPRequestHandler):
        def do_POST(self):  # noqa: N802
            self.rfile.read(int(self.headers["Content-Length"]))
            status, body = answers[min(len(seen), len(answers) - 1)]
            seen.append(status)
            data = json.dumps(body).encode()
            self.send_response(status)
            self.send_header("Content-Length", str(len(data)))
            self.end_headers()
            self.wfile.write(data)

        def log_message(self, *args):
            pass

    httpd = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    waits: list[float] = []
    monkeypatch.setattr(teacher_openai.time, "sleep", waits.append)
    try:
        teacher = _teacher(f"http://127.0.0.1:{httpd.server_port}/v1")
        choice = teacher._post({"model": "tiny", "prompt": "x"})
        rec = TeacherRecord(example_id=0, prompt_messages=[], prompt_ids=[], response_ids=[], response_text=" is")
        teacher._keep(rec, teacher_openai.positions(choice["logprobs"]), K, " is")
        assert seen == [429, 503, 200] and waits == [teacher_openai.BACKOFF_S, 2 * teacher_openai.BACKOFF_S]
        assert rec.has_topk and rec.response_ids == teacher.tokenizer(" is", add_special_tokens=False)["input_ids"]
        answers[:] = [(500, {"error": "boom"})]
        seen.clear()
        with pytest.raises(SmolforgeError, match="answered 500"):
            teacher._post({"model": "tiny", "prompt": "x"})
        assert len(seen) == teacher_openai.RETRIES + 1
    finally:
        httpd.shutdown()


def test_the_chat_shape_names_tokens_by_bytes_and_a_stop_by_no_text():
    """What llama-server sends for a completion's `logprobs` (seen from it serving tiny-llama's GGUF): the chat
    shape with each token's `bytes` (a byte of a multi-byte character: text U+FFFD, its byte still names its
    id), and a stop on the end of turn named '' with no bytes (kept as the end-of-turn id)."""
    from smolforge.distill import teacher_openai
    from smolforge.distill.store import TeacherRecord
    from smolforge.models.families import turn_end_id

    teacher = _teacher("http://127.0.0.1:9/v1")  # asked nothing: the answer is given
    alt = {"token": "\ufffd", "bytes": [0xE2], "logprob": -4.6}
    content = [{"token": "def", "bytes": [100, 101, 102], "logprob": -3.1,
                "top_logprobs": [{"token": "def", "bytes": [100, 101, 102], "logprob": -3.1}, alt]},
               {"token": "", "bytes": [], "logprob": -3.5, "top_logprobs": [{"token": "", "bytes": [], "logprob": -3.5}]}]
    choice = {"text": "def", "finish_reason": "stop", "logprobs": {"content": content}}
    rec = TeacherRecord(example_id=0, prompt_messages=[], prompt_ids=[], response_ids=[], response_text="def")
    teacher._keep(rec, teacher._named_stop(teacher_openai.positions(choice["logprobs"]), choice), K, "def")
    byte = teacher.map(("\ufffd", [0xE2]))
    assert byte is not None and teacher.map("\ufffd") is None  # the text alone names no id; the byte does
    end = turn_end_id(teacher.tokenizer)
    assert rec.has_topk and rec.response_ids == [teacher.map("def"), end] and teacher.text_only == 0
    assert rec.topk_indices[0, :2].tolist() == [teacher.map("def"), byte] and rec.topk_indices[1, 0] == end


@pytest.fixture(scope="module")
def byte_fallback():
    """A Llama-2-style tokenizer (SentencePiece pieces, <0xNN> byte fallback): "k" is both a piece and the
    byte token <0x6B>. Built from a vocabulary, no download."""
    from helpers import byte_fallback_tokenizer

    return byte_fallback_tokenizer(["\u2581", "k", "\u2581k", "ing"])


def test_the_endpoints_own_ids_decide_where_its_vocabulary_is_the_students(byte_fallback):
    """`TokenMap`: by bytes, <0x6B> and "k" are one name (the piece wins) and the end of turn named '' with no
    bytes is none; with the vocabulary stated equal, each id the endpoint sends is kept, its piece checked;
    a smaller size, or one id whose piece differs, and it is bytes/text again, with the reason."""
    from smolforge.distill.teacher_openai import TokenMap

    tok, v = byte_fallback
    piece, byte, eos = v["k"], v["<0x6B>"], v["</s>"]
    m = TokenMap(tok)
    assert m(("k", [0x6B], byte)) == piece and m(("", [], eos)) is None and m.saw_id and not m.by_id
    assert not m.use_ids(len(tok) - 1) and m(("k", [0x6B], byte)) == piece and str(len(tok) - 1) in m.why_not
    assert not m.use_ids(None) and "states no vocabulary size" in m.why_not
    assert m.use_ids(len(tok))
    assert [m(("k", [0x6B], byte)), m(("k", [0x6B], piece)), m(("", [], eos)), m("ing")] == [byte, piece, eos, v["ing"]]
    assert m(("k", [0x6B], eos)) == piece and not m.by_id and f"id {eos}" in m.why_not  # not eos's piece: off
    assert m(("k", [0x6B], byte)) == piece  # and off it stays


def test_an_end_of_turn_named_by_its_id_keeps_its_place_in_the_row(monkeypatch):
    """The llama-server rows that differed (issue 46): an alternative named '' with no bytes, only its `id`,
    is the end of turn, kept in the row where ids are used; where they are not (the endpoint states a smaller
    vocabulary than the tokenizer's) it drops to the tail, and the run says once why ids are not used."""
    from smolforge.distill import teacher_openai
    from smolforge.distill.store import TeacherRecord
    from smolforge.models.families import turn_end_id

    said: list[str] = []
    teacher = _teacher("http://127.0.0.1:9/v1", say=said.append)  # asked nothing: the answer is given
    end, is_ = turn_end_id(teacher.tokenizer), teacher.map(" is")
    alts = [{"id": is_, "token": " is", "bytes": list(b" is"), "logprob": -0.1},
            {"id": end, "token": "", "bytes": [], "logprob": -2.5}]
    content = [{"id": is_, "token": " is", "bytes": list(b" is"), "logprob": -0.1, "top_logprobs": alts}]
    rows = []
    for n_vocab in (teacher.vocab_size, teacher.vocab_size - 1):
        monkeypatch.setattr(teacher, "_stated_vocab", lambda n=n_vocab: n)
        teacher.map.use_ids(teacher._stated_vocab())
        rec = TeacherRecord(example_id=0, prompt_messages=[], prompt_ids=[], response_ids=[], response_text=" is")
        teacher._keep(rec, teacher_openai.positions({"content": content}), K, " is")
        rows.append([i for i, lp in zip(rec.topk_indices[0].tolist(), rec.topk_logprobs[0].tolist()) if lp > -60000])
    assert rows == [[is_, end], [is_]] and teacher.text_only == 0
    assert len(said) == 1 and "not mapped by the endpoint's token ids" in said[0] and "tokenizer" in said[0]


def test_a_vocabulary_padded_past_the_tokenizer_keeps_the_ids_and_drops_its_padding_rows(monkeypatch):
    """A model whose vocabulary is padded past its tokenizer (Qwen2.5: 151,936 rows, 151,665 tokens), served by
    llama-server, which states the rows (`meta.n_vocab`): the ids are used; an alternative named by a row past
    the tokenizer (a padding row) is dropped, its mass in the tail, and the ids stay on for the end of turn
    after it (named by its id alone); the count is in the manifest, said once."""
    import math

    from smolforge.distill.prompts import PromptItem
    from smolforge.models.families import turn_end_id

    said: list[str] = []
    teacher = _teacher("http://127.0.0.1:9/v1", say=said.append)  # asked nothing: the answers are given
    n, end, is_ = teacher.vocab_size, turn_end_id(teacher.tokenizer), teacher.map(" is")
    pad = {"id": n + 3, "token": f"[PAD{n + 3}]", "bytes": list(f"[PAD{n + 3}]".encode()), "logprob": -1.0}
    alts = [{"id": is_, "token": " is", "bytes": list(b" is"), "logprob": -0.1}, pad,
            {"id": end, "token": "", "bytes": [], "logprob": -2.5}]
    answer = {"text": " is", "finish_reason": "length", "logprobs": {"content": [
        {"id": is_, "token": " is", "bytes": list(b" is"), "logprob": -0.1, "top_logprobs": alts}]}}
    monkeypatch.setattr(teacher, "_stated_vocab", lambda: n + 64)
    monkeypatch.setattr(teacher, "_post", lambda payload: answer)
    recs = teacher.generate([PromptItem(0, [{"role": "user", "content": "q"}])] * 2, GEN)
    for rec in recs:
        kept = [i for i, lp in zip(rec.topk_indices[0].tolist(), rec.topk_logprobs[0].tolist()) if lp > -60000]
        assert rec.response_ids == [is_] and kept == [is_, end]
        assert math.isclose(float(rec.tail_mass[0]), 1 - math.exp(-0.1) - math.exp(-2.5), rel_tol=1e-5)
    assert teacher.map.by_id and teacher.text_only == 0
    assert teacher.manifest_extra["endpoint"] | {"url": None} == {
        "url": None, "k": 2, "k_asked": K, "text_only": 0, "held_back": 0, "by_ids": True, "n_vocab": n + 64, "padding_dropped": 2}
    assert len(said) == 1 and f"{n + 64} vocabulary rows" in said[0] and "tail mass" in said[0]


def test_a_control_token_named_by_its_id_alone_keeps_the_ids_on():
    """llama-server names every control token '' with no bytes (the GGUF's CONTROL type: an added token marked
    special), `<|im_start|>` as well, which transformers does not list in `all_special_ids`: its id is its
    name, and the ids stay on (they turned off at the first such candidate, 2026-11-30)."""
    teacher = _teacher("http://127.0.0.1:9/v1")  # asked nothing: the names are given
    m, tok = teacher.map, teacher.tokenizer
    start = tok.convert_tokens_to_ids("<|im_start|>")
    assert start not in tok.all_special_ids and m.use_ids(len(tok))
    assert m(("", [], start)) == start and m.by_id, m.why_not
    m(("", [], teacher.map(" is")))  # an ordinary token named by nothing is not its piece: ids off
    assert not m.by_id


def test_an_entry_holding_earlier_tokens_bytes_keeps_that_answer_as_text_and_the_ids_on(monkeypatch):
    """What llama-server sends after a token whose text ends inside a UTF-8 character: no entry for it, and
    the next entry's `token`/`bytes` hold its bytes too ('\ufffdolbs', [247, 111, 108, 98, 115] for id 787,
    whose piece is 'bs'). That answer has no rows for those positions: kept as text, counted as held back,
    said once; the ids stay on for the next answer, whose end of turn is named by its id alone. Held back
    at the end (cut by max_tokens), the bytes are in the text only (U+FFFD): the rows kept, that dropped."""
    from smolforge.distill.prompts import PromptItem
    from smolforge.models.families import turn_end_id

    said: list[str] = []
    teacher = _teacher("http://127.0.0.1:9/v1", say=said.append)
    is_, end = teacher.map(" is"), turn_end_id(teacher.tokenizer)

    def entry(tid: int, raw: bytes, lp: float) -> dict:
        return {"id": tid, "token": raw.decode(errors="replace"), "bytes": list(raw), "logprob": lp,
                "top_logprobs": [{"id": tid, "token": raw.decode(errors="replace"), "bytes": list(raw), "logprob": lp}]}

    merged = {"text": "\ufffd is", "finish_reason": "length",
              "logprobs": {"content": [entry(is_, b"\xf7ol is", -0.5)]}}
    plain = {"text": " is", "finish_reason": "stop",
             "logprobs": {"content": [entry(is_, b" is", -0.1), {**entry(end, b"", -0.2), "token": ""}]}}
    cut = {"text": " is\ufffd", "finish_reason": "length", "logprobs": {"content": [entry(is_, b" is", -0.1)]}}
    answers = iter([merged, plain, merged, cut])
    monkeypatch.setattr(teacher, "_stated_vocab", lambda: teacher.vocab_size)
    monkeypatch.setattr(teacher, "_post", lambda payload: next(answers))
    recs = teacher.generate([PromptItem(i, [{"role": "user", "content": "q"}]) for i in range(4)], GEN)
    assert [r.has_topk for r in recs] == [False, True, False, True] and recs[1].response_ids == [is_, end]
    assert (recs[3].response_ids, recs[3].response_text) == ([is_], " is")  # the unfinished character dropped
    assert teacher.map.by_id and teacher.map.held_back(("", list(b"\xf7ol is"), is_))
    ep = teacher.manifest_extra["endpoint"]
    assert (ep["text_only"], ep["held_back"], ep["by_ids"]) == (2, 2, True), ep
    assert len(said) == 1 and "held" in said[0] and "sequence-level KD" in said[0], said
