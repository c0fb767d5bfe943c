"""`--teacher-backend llamacpp`: the teacher as a GGUF in llama.cpp, writing the `hf` teacher's store.

tiny-llama is exported to GGUF once per module, through the node cache the backend uses
(`models.export.cache`, verified against HF by the export). On a handful of prompts and a few tokens:
- the store it writes validates with the store's reader (checksums, manifest counts, the tokenizer
  hash of the HF tokenizer) and every row's top-1 id is the greedy token the text was made of;
- at f16 its responses, top-1 ids and log-probabilities are the HF fp32 teacher's (logprobs within
  2e-2 nats: f16 rounding moves them by ~7e-3; logits one position off were 0.54 nats off);
- a GGUF with another vocabulary than the student's tokenizer is refused: by `smolforge distill`
  (exit 2, before anything starts) and by the teacher where it runs, before its first shard;
- sampling follows the run's temperature, top-p and seed, and each sample of a prompt restarts from
  the prompt's KV cache (every stored row equals a fresh teacher-forced pass);
- q4_k_m comes from llama.cpp's own quantizer (llama_model_quantize), smaller than the f16 file;
  llama.cpp's `n_threads` is the teacher's;
- (soak, `make test-all`: 40-75 s here) `smolforge distill --teacher-backend llamacpp` runs end to end on
  the embedded cluster, its teacher task's llama.cpp threads its CPUs (the manifest's `threads`).
Without llama-cpp-python these tests skip, or fail under CI (CI=true): see helpers.require.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import numpy as np
import pytest

from helpers import last_json, require_module, smolforge
from smolforge.distill.prompts import GenSettings

pytestmark = pytest.mark.timeout(600)

GEN = GenSettings(max_new_tokens=8, top_k=8)


def require_llama_cpp() -> None:
    """The only proof of the llamacpp teacher: under CI a missing llama-cpp-python fails, never skips."""
    __tracebackhide__ = True
    require_module("llama_cpp", "llama-cpp-python (smolforge[export])",
                   "make install (pip install -e '.[export]' with the Makefile's CMAKE_ARGS; builds llama.cpp)")


@pytest.fixture(scope="module")
def gguf_f16() -> Path:
    require_llama_cpp()
    from smolforge.models.export.cache import cached_gguf

    return cached_gguf("tiny-llama", "f16")


@pytest.fixture(scope="module")
def items():
    from smolforge.distill.teacher import prompts_from_dataset

    return prompts_from_dataset("bundled", max_samples=6)


def test_the_store_validates_and_its_top1_ids_are_the_greedy_text(gguf_f16, tmp_path):
    from smolforge.distill.shard_source import DirShardSource
    from smolforge.distill.store import StorePlan, read_shard, store_summary, tokenizer_hash
    from smolforge.distill.student import train_student
    from smolforge.distill.teacher import run_teacher_local
    from smolforge.models.loading import load_tokenizer

    out = tmp_path / "teacher_outputs"
    manifests = run_teacher_local("tiny-llama", "bundled", out, num_shards=2, max_samples=6, settings=GEN,
                                  backend="llamacpp", quant="f16", n_threads=1)
    tok = load_tokenizer("tiny-llama")
    assert [m["shard"] for m in manifests] == [0, 1] and StorePlan.read(out).num_examples == 6
    tokens = 0
    for sid in (0, 1):
        shard = read_shard(out, sid)  # checksum verified, then parsed
        m = shard.manifest
        assert m["backend"] == "llamacpp" and m["tokenizer_hash"] == tokenizer_hash(tok) and m["k"] == 8
        assert m["codec"]["name"] == "sorted-rice-q8" and m["has_logits"] and m["threads"] == 1
        assert m["gguf"]["quant"] == "f16" and m["gguf"]["verify"]["logits_nmse"] < 1e-4  # the export's check
        # what the format costs the teacher, measured against HF fp32 at the export's verified positions
        assert m["gguf"]["verify"]["kl_positions"] > 0 and 0 <= m["gguf"]["verify"]["kl_vs_fp32"] < 1e-3, m["gguf"]
        assert m["num_examples"] == len(shard.records) == 3 and m["num_topk_rows"] == m["num_response_tokens"]
        for rec in shard.records:
            assert rec.has_topk and rec.topk_indices.shape == (len(rec.response_ids), 8)
            assert rec.topk_indices[:, 0].tolist() == rec.response_ids  # greedy: the top-1 of every row
            assert rec.response_text == tok.decode(rec.response_ids, skip_special_tokens=True)
            assert np.all(rec.tail_mass >= 0) and np.all(rec.tail_mass < 1)
            tokens += len(rec.response_ids)
    summary = store_summary(out)
    assert summary["response_tokens"] == tokens > 0
    assert summary["truncation_kl_mean"] is not None and summary["reconstruction_kl_mean"] < 1e-2
    res = train_student(_student_cfg("tiny-llama", tmp_path / "student"), DirShardSource(out, poll_s=0.05),
                        teacher_tokenizer_hash=tokenizer_hash(tok))
    assert res.mode == "logit" and res.steps == 2 and res.final_loss == res.final_loss  # trained on the logits


def _student_cfg(base: str, out: Path):
    from smolforge.config import PeftSpec
    from smolforge.distill.losses import KDConfig
    from smolforge.distill.student import StudentConfig

    return StudentConfig(base_model=base, output_dir=str(out), max_steps=2, batch_size=2, lr=1e-3, device="cpu",
                         num_threads=1, peft=PeftSpec(method="lora", r=4, alpha=8, dropout=0.0),
                         kd=KDConfig(kd_ratio=0.5), wait_timeout_s=120, poll_s=0.05)


def test_f16_logprobs_are_the_hf_fp32_teachers(gguf_f16, items):
    from smolforge.distill.teacher import HFTeacher
    from smolforge.distill.teacher_llamacpp import LlamaCppTeacher

    cpp = LlamaCppTeacher("tiny-llama", quant="f16")
    assert cpp.gguf_path == gguf_f16  # the cached export, not a second one
    got = cpp.generate(items, GEN)
    want = HFTeacher("tiny-llama", device="cpu").generate(items, GEN)
    top1 = same = rows = 0
    for a, b in zip(got, want, strict=True):
        assert a.prompt_ids == b.prompt_ids and a.response_ids == b.response_ids, a.example_id
        top1 += int((a.topk_indices[:, 0] == b.topk_indices[:, 0]).sum())
        rows += len(a.response_ids)
        for r in range(len(a.response_ids)):  # log-probs of the ids both top-k rows hold
            cpp_row = dict(zip(a.topk_indices[r].tolist(), a.topk_logprobs[r].tolist()))
            hf_row = dict(zip(b.topk_indices[r].tolist(), b.topk_logprobs[r].tolist()))
            common = cpp_row.keys() & hf_row.keys()
            same += len(common)
            assert max(abs(cpp_row[i] - hf_row[i]) for i in common) < 2e-2, (a.example_id, r)
        assert np.abs(a.tail_mass - b.tail_mass).max() < 1e-2
    assert rows > 0 and top1 / rows >= 0.99, f"top-1 ids agree at {top1}/{rows} positions"
    assert same / (rows * GEN.top_k) >= 0.95, f"top-k ids shared: {same}/{rows * GEN.top_k}"


def test_a_gguf_with_another_vocabulary_is_refused_before_anything_runs(gguf_f16, tmp_path):
    """Its logits cannot train the student: refused by `smolforge distill` before anything starts (exit
    2, the reason, what to do), and by the teacher where it runs, before its first shard."""
    from typer.testing import CliRunner

    from smolforge.cli.main import app
    from smolforge.distill.teacher import run_teacher_local
    from smolforge.errors import SmolforgeError
    from smolforge.models.loading import load_model
    from smolforge.models.tiny import train_tokenizer

    other = tmp_path / "other-student"
    load_model("tiny-llama").save_pretrained(other)
    train_tokenizer(vocab_size=700).save_pretrained(other)  # another vocabulary: the GGUF's ids are not its
    res = CliRunner().invoke(app, ["distill", "--teacher", str(gguf_f16), "--student", str(other), "--data", "bundled",
                                   "--teacher-backend", "llamacpp", "--output-dir", str(tmp_path / "o")])
    assert res.exit_code == 2, (res.exit_code, res.stderr, res.exception)
    assert res.stderr.startswith("error:") and "another vocabulary" in res.stderr and "Traceback" not in res.stderr
    assert "--teacher-backend hf" in res.stderr and not (tmp_path / "o").exists()
    out = tmp_path / "teacher_outputs"
    with pytest.raises(SmolforgeError, match="another vocabulary .*tokens past the tokenizer"):
        run_teacher_local(str(gguf_f16), "bundled", out, num_shards=1, max_samples=4, settings=GEN,
                          backend="llamacpp", tokenizer=str(other))
    assert not list(out.glob("batch_*"))
    # the student's own tokenizer (the GGUF was exported from tiny-llama): no refusal
    ok = CliRunner().invoke(app, ["distill", "--teacher", str(gguf_f16), "--student", "tiny-llama", "--data", "bundled",
                                  "--teacher-backend", "llamacpp", "--kd-loss", "nope", "--output-dir", str(tmp_path / "o")])
    assert ok.exit_code == 2 and "unknown KD loss" in ok.stderr and "vocabulary" not in ok.stderr


def test_sampling_follows_the_runs_settings_and_rewinds_to_the_prompt(gguf_f16, items):
    """Temperature + top-p sample, seeded (the same records twice); every sample of a prompt starts from
    the prompt's KV cache: each row equals a fresh teacher-forced pass over prompt + response so far."""
    import torch

    from smolforge.distill.teacher_llamacpp import LlamaCppTeacher, pick_token
    from smolforge.distill.teacher_topk import topk_from_logits

    teacher = LlamaCppTeacher("tiny-llama", quant="f16")
    s = GenSettings(temperature=1.0, top_p=0.95, samples_per_prompt=3, max_new_tokens=6, top_k=8, seed=7)
    a, b = teacher.generate(items[:2], s), teacher.generate(items[:2], s)
    assert [r.response_ids for r in a] == [r.response_ids for r in b]
    assert [(r.example_id, r.sample_id) for r in a] == [(it.example_id, k) for it in items[:2] for k in range(3)]
    assert len({tuple(r.response_ids) for r in a}) > 2  # sampled, not greedy
    for rec in a:
        for n in range(len(rec.response_ids)):
            teacher.llm.reset()
            teacher.llm.eval(rec.prompt_ids + rec.response_ids[:n])
            values, idx, _ = topk_from_logits(torch.from_numpy(teacher._last_logits())[None], 8)
            fresh = dict(zip(idx[0].tolist(), values[0].tolist()))  # near-ties may swap places: ids and values
            kept = dict(zip(rec.topk_indices[n].tolist(), rec.topk_logprobs[n].tolist()))
            common = fresh.keys() & kept.keys()
            assert len(common) >= 6, (rec.example_id, rec.sample_id, n, sorted(fresh), sorted(kept))
            assert max(abs(fresh[i] - kept[i]) for i in common) < 1e-2, (rec.example_id, rec.sample_id, n)
    rng = np.random.default_rng(0)
    peaked = np.array([5.0, 0.0, 0.0, 0.0], np.float32)  # p(0) = 0.95: top_p 0.9 keeps only id 0
    assert {pick_token(peaked, 1.0, 0.9, rng) for _ in range(50)} == {0}
    assert len({pick_token(peaked, 5.0, 1.0, rng) for _ in range(50)}) > 1


def test_q4_k_m_is_made_by_llama_cpps_quantizer(gguf_f16, items):
    from smolforge.distill.teacher_llamacpp import LlamaCppTeacher

    teacher = LlamaCppTeacher("tiny-llama", quant="q4_k_m", n_threads=2)
    path = teacher.gguf_path
    assert path != gguf_f16 and path.stat().st_size < gguf_f16.stat().st_size
    assert teacher.llm.metadata["general.file_type"] == "15"  # LLAMA_FTYPE_MOSTLY_Q4_K_M
    assert json.loads((path.parent / "export.json").read_text())["quantizer"] == "llama_cpp.llama_model_quantize"
    assert teacher.llm.context_params.n_threads == 2 and teacher.llm.context_params.n_threads_batch == 2
    recs = teacher.generate(items[:2], GEN)
    assert all(r.has_topk and r.topk_indices[:, 0].tolist() == r.response_ids for r in recs)


@pytest.mark.parametrize("args, message", [
    (["--teacher-quant", "q3"], "unknown --teacher-quant 'q3'"),
    (["--teacher-responses", "reference"], "the llamacpp backend generates its own"),
])
def test_bad_llamacpp_flags_fail_fast_with_exit_2(args, message, tmp_path):
    from typer.testing import CliRunner

    from smolforge.cli.main import app

    res = CliRunner().invoke(app, ["distill", "--teacher", "tiny-llama", "--student", "tiny-llama", "--data", "bundled",
                                   "--teacher-backend", "llamacpp", "--output-dir", str(tmp_path / "o"), *args])
    assert res.exit_code == 2, (res.exit_code, res.stderr, res.exception)
    assert res.stderr.startswith("error:") and message in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "o").exists()


def test_f32_is_a_teacher_quant_and_reaches_the_export(tmp_path, monkeypatch):
    """`--teacher-quant f32` (the unrounded GGUF `export --quant f32` writes): the GGUF weight types are one
    table for export and teacher (`cache.TEACHER_QUANTS` holds `targets.QUANTS`); the flag passes the submit's
    check, and the llamacpp backend's teacher asks the node's cache, which asks the export, for f32 (the export
    stood in: no llama.cpp run)."""
    require_llama_cpp()
    from typer.testing import CliRunner

    from smolforge.cli import distill as distill_cli
    from smolforge.cli.main import app
    from smolforge.distill.backends import teacher_backend
    from smolforge.distill.settings import DistillSettings, check_run
    from smolforge.models.export import cache, run, targets

    assert set(targets.QUANTS) <= set(cache.TEACHER_QUANTS)
    sent: list = []
    monkeypatch.setattr(distill_cli, "run_distill_job", lambda spec, *_, **__: sent.append(spec) or {})
    monkeypatch.setattr(distill_cli, "_export_and_show", lambda *_: None)
    res = CliRunner().invoke(app, ["distill", "--teacher", "tiny-llama", "--student", "tiny-llama", "--data", "bundled",
                                   "--teacher-backend", "llamacpp", "--teacher-quant", "f32"])
    assert res.exit_code == 0 and sent[0]["distill"]["teacher_quant"] == "f32", (res.stderr, res.exception)
    check_run(DistillSettings(**sent[0]["distill"]))  # the submit's check of the settings (the backend's: the quant)
    asked: list = []

    def export(model, to, out, *, quant, **_):  # the export's call, recorded; nothing written
        asked.append((model, to, quant))
        raise RuntimeError("stood in")

    monkeypatch.setattr(run, "export", export)
    monkeypatch.setattr(cache, "cache_root", lambda: tmp_path / "gguf")  # not a file an earlier run cached
    with pytest.raises(RuntimeError, match="stood in"):
        teacher_backend("llamacpp").build("tiny-llama", quant="f32")
    assert asked == [("tiny-llama", "gguf", "f32")]


def test_a_gguf_file_is_held_by_the_embedded_clusters_node(gguf_f16):
    """The queue admits a distill job whose teacher is a GGUF file on this machine (it waited forever
    for a node advertising that path, when only a local directory counted as held)."""
    from smolforge.cluster.control.kinds import _distill_demand
    from smolforge.cluster.control.placement import holds_anywhere
    from smolforge.cluster.control.specs import DistillJob

    assert holds_anywhere(str(gguf_f16), embedded=True) and not holds_anywhere(str(gguf_f16), embedded=False)
    job = DistillJob.model_validate({"kind": "distill", "distill": {
        "teacher": str(gguf_f16), "students": ["tiny-llama"], "data": "bundled", "teacher_backend": "llamacpp"}})
    assert _distill_demand(job, embedded=True).req.model is None


@pytest.mark.soak  # a long run: 40-75 s here, mostly the embedded cluster's and its task processes' starts
def test_distill_with_a_llamacpp_teacher_on_the_embedded_cluster(gguf_f16, tmp_path):
    """A GGUF file as the teacher, through the job, the queue, the cluster and the teacher task (the
    student's tokenizer checked against it, the threads): two CPUs for the teacher task, and its
    llama.cpp threads (the manifest's `threads`) are those two."""
    from smolforge.distill.store import tokenizer_hash
    from smolforge.models.loading import load_tokenizer

    out = tmp_path / "run"
    env = {"RAY_TMPDIR": f"/tmp/sfdl{os.getpid()}", "SMOLFORGE_COORDINATOR": "", "SMOLFORGE_RAY_ADDRESS": ""}
    proc = smolforge("distill", "--teacher", str(gguf_f16), "--student", "tiny-llama", "--data", "bundled",
                     "--teacher-backend", "llamacpp", "--cpus-per-teacher", "2",
                     "--max-samples", "8", "--max-steps", "2", "--batch-size", "4", "--max-new-tokens", "6",
                     "--top-k", "8", "--num-students", "1", "--no-eval", "--save-every", "0",
                     "--output-dir", str(out), "--json", timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json(proc.stdout)
    assert [s["state"] for s in summary["student_tasks"]] == ["completed"]
    manifests = [json.loads(p.read_text()) for p in sorted((out / "teacher_outputs").glob("batch_*.json"))]
    assert manifests and all(m["backend"] == "llamacpp" and m["has_logits"] for m in manifests)
    assert [m["threads"] for m in manifests] == [2] * len(manifests)  # the task's CPUs, not llama.cpp's default
    assert {m["tokenizer_hash"] for m in manifests} == {tokenizer_hash(load_tokenizer("tiny-llama"))}
    assert summary["per_student"][0]["kd"] == "logit", summary["per_student"][0]  # the store's logits, not its text


def test_batched_decode_gives_the_one_at_a_time_records(gguf_f16, items):
    """A group of sequences in one llama.cpp context (teacher_batch_size > 1) writes what decoding them one
    at a time does: the same greedy responses, top-1 ids and log-probs, to the rounding another batch
    shape moves f16 kernels by. (Sampled draws are only as equal as the logits: on this random model's
    flat distributions that rounding moves a draw to a neighbouring id; the sampling test above checks
    every batched row against a fresh teacher-forced pass, and that a seed repeats its draws.)"""
    from smolforge.distill.teacher_llamacpp import LlamaCppTeacher

    teacher = LlamaCppTeacher("tiny-llama", quant="f16")
    one = teacher.generate(items[:5], GenSettings(max_new_tokens=8, top_k=8, batch_size=1))
    assert getattr(teacher, "_decoder", None) is None  # the one-at-a-time path
    many = teacher.generate(items[:5], GenSettings(max_new_tokens=8, top_k=8, batch_size=4))  # a group of 4, then 1
    assert teacher._decoder.n_seq == 4
    assert [r.response_ids for r in many] == [r.response_ids for r in one]
    for a, b in zip(many, one):
        assert (a.topk_indices[:, 0] == b.topk_indices[:, 0]).all()
        # 7e-3 seen (HF fp32 against f16 itself: 2e-2)
        np.testing.assert_allclose(a.topk_logprobs[:, 0], b.topk_logprobs[:, 0], atol=1e-2)


def test_batched_decode_shares_the_prefix_and_a_step_is_one_pass_whatever_sequences_run(gguf_f16, items):
    """`llamacpp_batch`: the prompts' shared prefix is read once and its KV cells shared with every sequence,
    and when a sequence ends (here sequence 1: the running ones, 0, 2 and 3, are not consecutive ids) its
    cells are freed, nobody moves, and each step is still one ubatch, one pass over the weights (one KV
    stream for all: a stream per sequence cut this step in two). What each decision leaves must be what one
    sequence decoded alone gives: the first rows, and every running sequence's next rows."""
    import llama_cpp
    import torch

    from helpers import llama_ubatch_counter
    from smolforge.distill.llamacpp_batch import BatchDecoder, shared_prefix
    from smolforge.distill.teacher_llamacpp import LlamaCppTeacher

    teacher = LlamaCppTeacher("tiny-llama", quant="f16")

    def alone(ids: list[int]) -> torch.Tensor:
        teacher.llm.reset()
        teacher.llm.eval(ids)
        return torch.log_softmax(torch.from_numpy(teacher._last_logits()), -1)

    def close(row, ids) -> None:
        want = alone(ids)
        got = torch.log_softmax(torch.from_numpy(np.array(row)), -1)
        assert int(got.argmax()) == int(want.argmax())
        assert float((got - want).abs().max()) < 2e-2  # f16 kernels at another batch shape: ~7e-3

    prompts = [teacher.prompt_ids(item) for item in items[:4]]
    assert shared_prefix(prompts) > 0  # the chat template's head
    seen, ubatches = llama_ubatch_counter()
    dec = BatchDecoder(teacher.llm, 4, 64, 1, cb_eval=seen)
    first = dec.prefill(prompts)
    for j, ids in enumerate(prompts):
        close(first[j], ids)
    held = {m: prompts[m] + [int(first[m].argmax())] for m in (0, 2, 3)}  # member 1 ends after its first row
    for _ in range(2):
        before = (dec.passes, ubatches[0])
        members, rows = dec.step({m: (ids[-1], len(ids) - 1) for m, ids in held.items()})
        assert (dec.passes - before[0], ubatches[0] - before[1]) == (1, 1)  # one llama_decode, one ubatch
        assert members == [0, 2, 3]  # rows in member order: nobody moved
        for r, m in enumerate(members):
            close(rows[r], held[m])
            held[m] = held[m] + [int(np.argmax(rows[r]))]
    assert llama_cpp.llama_memory_seq_pos_max(dec.context.mem, 1) == -1  # the finished sequence's cells freed
    dec.close()
    teacher.close()
