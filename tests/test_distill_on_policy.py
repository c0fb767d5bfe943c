"""On-policy distillation (GKD): student samples scored by the teacher, divergence only, deterministic steps."""

from __future__ import annotations

import pytest

from smolforge.config import PeftSpec
from smolforge.distill.losses import KDConfig
from smolforge.distill.on_policy import OnPolicySettings, is_on_policy_step
from smolforge.distill.shard_source import DirShardSource
from smolforge.distill.student import StudentConfig, train_student
from smolforge.distill.teacher import GenSettings, run_teacher_local
from smolforge.errors import SmolforgeError


@pytest.fixture(scope="module")
def store(tmp_path_factory):
    d = tmp_path_factory.mktemp("store") / "teacher_outputs"
    run_teacher_local("tiny-llama", "bundled", d, num_shards=2, max_samples=16,
                      settings=GenSettings(max_new_tokens=6, top_k=8, batch_size=8), device="cpu")
    return d


def _cfg(tmp_path, **kw) -> StudentConfig:
    base = dict(base_model="tiny-llama", output_dir=str(tmp_path / "student_0"), max_steps=3, batch_size=4,
                lr=1e-3, device="cpu", num_threads=1, peft=PeftSpec(method="lora", r=4, alpha=8, dropout=0.0),
                kd=KDConfig(loss="jsd", beta=0.5, kd_ratio=0.5), wait_timeout_s=60, poll_s=0.05,
                max_new_tokens=6, precision="fp32")
    base.update(kw)
    return StudentConfig(**base)


def test_on_policy_steps_are_a_fixed_fraction():
    picks = [is_on_policy_step(0.3, seed=1, step=s) for s in range(2000)]
    assert picks == [is_on_policy_step(0.3, seed=1, step=s) for s in range(2000)]  # resumable: a function of (seed, step)
    assert 0.25 < sum(picks) / len(picks) < 0.35
    assert not any(is_on_policy_step(0.0, 1, s) for s in range(50))
    assert all(is_on_policy_step(1.0, 1, s) for s in range(50))
    assert not any(is_on_policy_step(1.0, 1, s, first=10) for s in range(10))  # GKD's off-policy warm start
    assert all(is_on_policy_step(1.0, 1, s, first=10) for s in range(10, 50))
    with pytest.raises(SmolforgeError):
        OnPolicySettings(ratio=1.5)


def test_student_trains_on_its_own_samples_scored_by_the_teacher(tmp_path, store):
    """Teacher and student are the same model at step 0 (LoRA starts at zero), so if the teacher scores
    exactly the student's sampled tokens, at the positions that predict them, the first step's
    divergence is zero; any misalignment (an off-by-one, the prompt/response boundary) makes it large."""
    losses = []
    res = train_student(_cfg(tmp_path, on_policy_ratio=1.0, teacher_model="tiny-llama"), DirShardSource(store),
                        on_step=lambda info: losses.append(info["loss"]))
    assert res.on_policy_steps == 3 and res.adapter_dir
    assert abs(losses[0]) < 1e-4, losses
    # Off-policy on the same store, the loss at step 0 is the CE half of the mix: clearly non-zero.
    off = []
    train_student(_cfg(tmp_path / "off", max_steps=1), DirShardSource(store), on_step=lambda i: off.append(i["loss"]))
    assert off[0] > 0.5, off


def test_on_policy_needs_a_teacher_with_the_students_tokenizer(tmp_path, store):
    import shutil

    from smolforge.models.loading import load_tokenizer, resolve_model

    other = tmp_path / "other-teacher"
    shutil.copytree(resolve_model("tiny-llama"), other)
    tok = load_tokenizer(str(other))
    tok.add_tokens(["<|extra|>"])  # one more token: another vocabulary, so ids no longer agree
    tok.save_pretrained(other)
    with pytest.raises(SmolforgeError, match="share a tokenizer"):
        train_student(_cfg(tmp_path, on_policy_ratio=1.0, teacher_model=str(other), max_steps=1),
                      DirShardSource(store))
