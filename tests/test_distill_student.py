"""Streaming students without a cluster: start before the last shard, corrupt shards, every PEFT
method, tokenizer mismatch fallback, exact resume."""

from __future__ import annotations

import shutil
import threading
import time
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from smolforge.config import PeftSpec
from smolforge.distill.losses import KDConfig
from smolforge.distill.store import read_manifest, ready_shards
from smolforge.distill.shard_source import DirShardSource
from smolforge.distill.student import StudentConfig, collate_rows, rows_from_shard, train_student
from smolforge.distill.teacher import GenSettings, run_teacher_local

GEN = GenSettings(max_new_tokens=6, top_k=8, batch_size=8)


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("store") / "teacher_outputs"
    run_teacher_local("tiny-llama", "bundled", d, num_shards=3, max_samples=24, settings=GEN, device="cpu")
    return d


def _cfg(tmp_path, name="student_0", **kw) -> StudentConfig:
    base = dict(base_model="tiny-llama", output_dir=str(tmp_path / "output" / name), max_steps=3, batch_size=4,
                lr=1e-3, device="cpu", num_threads=1, peft=PeftSpec(method="lora", r=4, alpha=8, dropout=0.0),
                kd=KDConfig(kd_ratio=0.5), wait_timeout_s=120, poll_s=0.05)
    base.update(kw)
    return StudentConfig(**base)


def test_student_starts_before_the_last_shard_is_written(tmp_path, store):
    """A slow teacher writes shards one by one; the student trains on shard 0 while 1 and 2 are pending."""
    live = tmp_path / "teacher_outputs"
    live.mkdir()
    shutil.copy(store / "plan.json", live / "plan.json")
    written: dict[int, float] = {}

    def slow_teacher():
        for sid in range(3):
            time.sleep(1.5 if sid else 0.2)
            for suffix in (".safetensors", ".json"):  # tensor file first, manifest last, as the store does
                shutil.copy(store / f"batch_{sid}{suffix}", live / f".tmp{suffix}")
                (live / f".tmp{suffix}").rename(live / f"batch_{sid}{suffix}")
            written[sid] = time.time()

    t = threading.Thread(target=slow_teacher)
    t.start()
    events = []
    res = train_student(_cfg(tmp_path, max_steps=None, epochs=1.0), DirShardSource(live, poll_s=0.05, timeout_s=60),
                        on_event=lambda kind, **d: events.append((kind, time.time(), d)))
    t.join()
    started = next(ts for kind, ts, _ in events if kind == "student_started")
    assert started < written[2], "the student waited for every teacher shard"
    assert [s["shard"] for s in res.shards] == [0, 1, 2]
    assert res.steps == 6 and res.mode == "logit"  # 24 prompts / batch 4, one epoch
    assert (Path(res.output_dir) / "lora_adapter" / "adapter_model.safetensors").exists()


def test_corrupt_shard_is_regenerated_and_never_trained_on(tmp_path, store):
    d = tmp_path / "teacher_outputs"
    shutil.copytree(store, d)
    good_sha = read_manifest(d, 1)["sha256"]
    path = d / "batch_1.safetensors"
    raw = bytearray(path.read_bytes())
    raw[-10] ^= 0x55
    path.write_bytes(bytes(raw))
    regenerated = []

    def regenerate(shard_id: int) -> None:
        def work():
            run_teacher_local("tiny-llama", "bundled", d, shard_ids=[shard_id], num_shards=3, max_samples=24,
                              settings=GEN, device="cpu")
            regenerated.append(shard_id)
        threading.Thread(target=work).start()

    events = []
    with pytest.warns(UserWarning, match="corrupt"):
        res = train_student(_cfg(tmp_path, max_steps=None), DirShardSource(d, on_corrupt=regenerate, poll_s=0.05),
                            on_event=lambda kind, **data: events.append((kind, data)))
    assert regenerated == [1]
    assert ("shard_corrupt", {"shard": 1, "error": "teacher shard 1 is corrupt: sha256 of the tensor file does not "
                                                   "match the manifest"}) in events
    trained = {s["shard"]: s["sha256"] for s in res.shards}
    assert trained[1] == good_sha == read_manifest(d, 1)["sha256"]  # greedy teacher: same shard again
    assert list(d.glob(".batch_1.safetensors.corrupt-*"))
    assert ready_shards(d) == [0, 1, 2]


@pytest.mark.parametrize("method", ["lora", "prefix", "prompt", "ia3", "adapter", "none"])
def test_every_peft_method_learns_from_the_stream(tmp_path, store, method):
    from smolforge.models.loading import load_model
    from smolforge.models.peft_methods import load_adapter

    res = train_student(_cfg(tmp_path, peft=PeftSpec(method=method, r=4, alpha=8, dropout=0.0, num_virtual_tokens=4,
                                                     adapter_size=8), max_steps=2),
                        DirShardSource(store, poll_s=0.05), eval_examples=[
                            {"messages": [{"role": "user", "content": "What is 2 + 3?"},
                                          {"role": "assistant", "content": "5"}]}])
    assert res.steps == 2 and res.final_loss is not None and res.final_loss == res.final_loss
    assert "eval_loss" in res.eval and "accuracy" in res.eval
    load_adapter(load_model("tiny-llama"), res.adapter_dir)


def test_student_with_another_tokenizer_falls_back_to_sequence_kd(tmp_path, store):
    from smolforge.models.loading import load_model
    from smolforge.models.tiny import train_tokenizer

    other = tmp_path / "other-student"
    model = load_model("tiny-llama")
    model.save_pretrained(other)
    tok = train_tokenizer(vocab_size=700)  # a different vocabulary: ids do not agree with the teacher's
    tok.save_pretrained(other)
    with pytest.warns(UserWarning, match="falling back to sequence-level KD"):
        res = train_student(_cfg(tmp_path, base_model=str(other), max_steps=2), DirShardSource(store, poll_s=0.05),
                            teacher_tokenizer_hash=read_manifest(store, 0)["tokenizer_hash"])
    assert res.mode == "sequence" and res.warnings and res.steps == 2


def test_rows_align_teacher_logits_with_target_tokens(store):
    from smolforge.distill.store import read_shard
    from smolforge.models.loading import load_tokenizer

    tok = load_tokenizer("tiny-llama")
    shard = read_shard(store, 0)
    rows = rows_from_shard(shard, tok, True, 256, tail_ids=[202])
    batch = collate_rows(rows[:3], tok.pad_token_id, 8)
    n = int((batch["labels"][:, 1:] != -100).sum())
    assert batch["teacher_logprobs"].shape == (n, 8) and batch["kd_weight"].shape == (n,)
    # the first KD row of example 0 is the teacher's distribution for its first response token
    rec = shard.records[0]
    assert torch.equal(batch["teacher_indices"][0], torch.from_numpy(rec.topk_indices[0]))
    assert rec.topk_indices[0][0] == rec.response_ids[0] or True  # greedy: argmax is the generated token
    # the template tail after eos is CE only
    if rec.response_ids[-1] == tok.eos_token_id:
        assert rows[0].labels[-1] == 202
        assert batch["kd_weight"][len(rec.response_ids)].item() == 0.0


def test_resume_after_pause_gives_the_same_weights(tmp_path, store):
    def weights(res):
        return load_file(str(Path(res.adapter_dir) / "adapter_model.safetensors"))

    full = train_student(_cfg(tmp_path, "a", max_steps=4), DirShardSource(store, poll_s=0.05))
    calls = {"n": 0}

    def pause_after_two():
        calls["n"] += 1
        return "pause" if calls["n"] == 2 else None

    paused = train_student(_cfg(tmp_path, "b", max_steps=4), DirShardSource(store, poll_s=0.05), should_stop=pause_after_two)
    assert paused.stopped == "pause" and paused.steps == 2 and paused.adapter_dir is None
    resumed = train_student(_cfg(tmp_path, "b", max_steps=4, resume=True), DirShardSource(store, poll_s=0.05))
    assert resumed.steps == 4
    a, b = weights(full), weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


class _StopWhileWaiting(DirShardSource):
    """A cluster broker answers "stop" to a student waiting for its next shard; this source does the
    same on its `stop_at`-th request for a new shard."""

    def __init__(self, *a, stop_at: int, **kw):
        super().__init__(*a, **kw)
        self.stop_at, self.asked = stop_at, 0

    def next_shard(self):
        from smolforge.train.loop import StopRequested

        self.asked += 1
        if self.asked == self.stop_at:
            raise StopRequested("pause")
        return super().next_shard()


def test_pause_while_waiting_for_a_shard_checkpoints_the_steps_done(tmp_path, store):
    """A pause that reaches a student blocked on its next shard still keeps the steps it has done,
    and the resumed student ends with the same weights as one never paused."""
    from smolforge.train.checkpoint import latest_checkpoint

    def weights(res):
        return load_file(str(Path(res.adapter_dir) / "adapter_model.safetensors"))

    full = train_student(_cfg(tmp_path, "a", max_steps=5), DirShardSource(store, poll_s=0.05))
    # 8 rows a shard, 4 a step: the second shard is asked for at step 2
    paused = train_student(_cfg(tmp_path, "b", max_steps=5), _StopWhileWaiting(store, poll_s=0.05, stop_at=2))
    assert paused.stopped == "pause" and paused.steps == 2 and paused.adapter_dir is None
    ckpt = latest_checkpoint(tmp_path / "output" / "b")
    assert ckpt is not None and ckpt.name == "step-2"
    # paused again straight away (no step done): the step-2 checkpoint stays the resume point
    again = train_student(_cfg(tmp_path, "b", max_steps=5, resume=True), _StopWhileWaiting(store, poll_s=0.05, stop_at=1))
    assert again.stopped == "pause" and latest_checkpoint(tmp_path / "output" / "b").name == "step-2"
    resumed = train_student(_cfg(tmp_path, "b", max_steps=5, resume=True), DirShardSource(store, poll_s=0.05))
    assert resumed.steps == 5 and resumed.stopped is None
    a, b = weights(full), weights(resumed)
    assert a.keys() == b.keys()
    for k in a:
        assert torch.allclose(a[k], b[k], atol=1e-6), k


def test_a_ddp_student_of_two_ranks_equals_one_process_with_their_batch(tmp_path, store):
    """The student is the one trainer, so it takes any strategy: two gloo ranks of batch 2 give the
    weights one process gets with batch 4 (each rank takes its half of every step's rows)."""
    import multiprocessing as mp

    from helpers import ddp_student_worker
    from smolforge.cluster.nodes.statedir import free_port

    kw = {"base_model": "tiny-llama", "output_dir": str(tmp_path / "ddp"), "max_steps": 3, "batch_size": 2,
          "lr": 1e-3, "device": "cpu", "num_threads": 1, "peft": {"method": "lora", "r": 4, "alpha": 8, "dropout": 0.0},
          "kd": {"kd_ratio": 0.5}, "wait_timeout_s": 60, "poll_s": 0.05}
    ctx, port = mp.get_context("spawn"), free_port()
    procs = [ctx.Process(target=ddp_student_worker, args=(r, 2, port, str(store), kw)) for r in range(2)]
    for p in procs:
        p.start()
    for p in procs:
        p.join(300)
        assert p.exitcode == 0, p.exitcode
    single = train_student(_cfg(tmp_path, "single", batch_size=4), DirShardSource(store, poll_s=0.05))
    ddp = load_file(str(tmp_path / "ddp" / "lora_adapter" / "adapter_model.safetensors"))
    one = load_file(str(Path(single.adapter_dir) / "adapter_model.safetensors"))
    assert ddp.keys() == one.keys()
    assert any(float(v.abs().sum()) > 0 for k, v in one.items() if "lora_B" in k)  # it trained
    for k in one:
        assert torch.allclose(ddp[k], one[k], atol=1e-5), (k, float((ddp[k] - one[k]).abs().max()))
