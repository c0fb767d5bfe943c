"""KD losses: top-k with tail against the full-vocabulary reference, temperatures, mixing, normalisation."""

from __future__ import annotations

import math

import pytest
import torch

from smolforge.distill.losses import (KDConfig, bucket_divergence, full_kd_loss_sum, mixed_loss,
                                      student_bucket_logprobs, teacher_bucket_logprobs, topk_kd_loss_sum)
from smolforge.distill.teacher import topk_from_logits
from smolforge.errors import SmolforgeError

V = 50


def _pair(n=6, seed=0):
    g = torch.Generator().manual_seed(seed)
    return torch.randn(n, V, generator=g) * 2, torch.randn(n, V, generator=g) * 2


@pytest.mark.parametrize("loss", ["forward_kl", "reverse_kl", "jsd"])
@pytest.mark.parametrize("temperature", [1.0, 2.0])
def test_topk_with_full_k_equals_full_vocab_loss(loss, temperature):
    student, teacher = _pair()
    cfg = KDConfig(loss=loss, temperature=temperature, beta=0.3)
    lp, idx, tail = topk_from_logits(teacher, V)
    got = topk_kd_loss_sum(student, lp, idx, tail, cfg)
    want = full_kd_loss_sum(student, teacher, cfg)
    assert torch.allclose(got, want, atol=1e-4, rtol=1e-4)


def test_tail_bucket_is_exact_grouping_at_t1():
    """At T=1 the bucket KL equals KL of the grouped distributions, computed by hand."""
    student, teacher = _pair(seed=1)
    k = 5
    lp, idx, tail = topk_from_logits(teacher, k)
    got = topk_kd_loss_sum(student, lp, idx, tail, KDConfig(loss="forward_kl"))
    p, q = teacher.softmax(-1), student.softmax(-1)
    want = 0.0
    for n in range(p.shape[0]):
        top = idx[n]
        pt, qt = p[n, top], q[n, top]
        pr, qr = 1 - pt.sum(), 1 - qt.sum()
        want += float((pt * (pt / qt).log()).sum() + pr * (pr / qr).log())
    assert got.item() == pytest.approx(want, rel=1e-4)
    # Grouping never increases KL: the bucket version lower-bounds the full one.
    assert got.item() <= full_kd_loss_sum(student, teacher, KDConfig()).item() + 1e-6


def test_identical_student_gives_zero_and_gradients_flow():
    _, teacher = _pair(seed=2)
    lp, idx, tail = topk_from_logits(teacher, 8)
    for loss in ("forward_kl", "reverse_kl", "jsd"):
        assert topk_kd_loss_sum(teacher, lp, idx, tail, KDConfig(loss=loss)).item() == pytest.approx(0, abs=1e-5)
    student = torch.zeros(6, V, requires_grad=True)
    topk_kd_loss_sum(student, lp, idx, tail, KDConfig(loss="jsd")).backward()
    assert student.grad is not None and student.grad.abs().sum() > 0


def test_jsd_limits_are_forward_and_reverse_kl():
    student, teacher = _pair(seed=3)
    s = torch.log_softmax(student, -1)
    t = torch.log_softmax(teacher, -1)
    fwd = bucket_divergence(s, t, "forward_kl")
    rev = bucket_divergence(s, t, "reverse_kl")
    assert torch.allclose(bucket_divergence(s, t, "jsd", beta=0.0), fwd)
    assert torch.allclose(bucket_divergence(s, t, "jsd", beta=1.0), rev)
    mid = bucket_divergence(s, t, "jsd", beta=0.5)
    assert (mid > 0).all() and (mid <= math.log(2) + 1e-6).all()  # JSD(0.5) is bounded by log 2


def test_temperature_softens_the_teacher_and_is_exact_for_a_uniform_tail():
    _, teacher = _pair(seed=4)
    lp, idx, tail = topk_from_logits(teacher, 4)
    sharp = teacher_bucket_logprobs(lp, tail, V, 1.0).exp()
    soft = teacher_bucket_logprobs(lp, tail, V, 4.0).exp()
    assert torch.allclose(sharp.sum(-1), torch.ones(6), atol=1e-5)
    assert torch.allclose(soft.sum(-1), torch.ones(6), atol=1e-5)
    assert (soft[:, 0] < sharp[:, 0]).all()  # the teacher's favourite token loses mass when tempered
    # When the tail really is uniform, the tempered tail bucket equals the full tempered softmax's.
    flat = torch.full((6, V), -1.0)
    flat[:, :4] = torch.tensor([3.0, 2.0, 1.5, 0.5])
    lp, idx, tail = topk_from_logits(flat, 4)
    for T in (0.5, 2.0, 4.0):
        want = torch.softmax(flat / T, -1)
        got = teacher_bucket_logprobs(lp, tail, V, T).exp()
        assert torch.allclose(got[:, :4], want.gather(1, idx), atol=1e-5)
        assert torch.allclose(got[:, 4], 1 - want.gather(1, idx).sum(-1), atol=1e-5)
    # student bucket probabilities are a distribution too
    s = student_bucket_logprobs(torch.randn(6, V), idx, 3.0).exp()
    assert torch.allclose(s.sum(-1), torch.ones(6), atol=1e-5)
    # the T² factor: loss at T equals T² times the plain divergence of the tempered buckets
    student = torch.randn(6, V)
    cfg = KDConfig(temperature=2.0)
    plain = bucket_divergence(student_bucket_logprobs(student, idx, 2.0), teacher_bucket_logprobs(lp, tail, V, 2.0)).sum()
    assert topk_kd_loss_sum(student, lp, idx, tail, cfg).item() == pytest.approx(4 * plain.item(), rel=1e-5)


def _batch(seed=0, B=3, L=7, k=6):
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(B, L, V, generator=g)
    labels = torch.randint(0, V, (B, L), generator=g)
    labels[:, :3] = -100
    labels[1, 5:] = -100
    n = int((labels[:, 1:] != -100).sum())
    t_logits = torch.randn(n, V, generator=g)
    lp, idx, tail = topk_from_logits(t_logits, k)
    return logits, {"labels": labels, "teacher_logprobs": lp, "teacher_indices": idx, "teacher_tail": tail,
                    "kd_weight": torch.ones(n)}, n


def test_kd_ratio_mixes_ce_and_kd():
    logits, batch, n = _batch()
    ce_only = mixed_loss(logits, batch, KDConfig(kd_ratio=0.0), n)
    ref = torch.nn.functional.cross_entropy(logits[:, :-1].reshape(-1, V), batch["labels"][:, 1:].reshape(-1),
                                            ignore_index=-100)
    assert ce_only.loss.item() == pytest.approx(ref.item(), rel=1e-5)
    kd_only = mixed_loss(logits, batch, KDConfig(kd_ratio=1.0), n)
    half = mixed_loss(logits, batch, KDConfig(kd_ratio=0.5), n)
    assert half.loss.item() == pytest.approx(0.5 * ce_only.loss.item() + 0.5 * kd_only.loss.item(), rel=1e-5)
    # rows without teacher logits fall back to full CE
    nokd = dict(batch, kd_weight=torch.zeros(n))
    assert mixed_loss(logits, nokd, KDConfig(kd_ratio=1.0), n).loss.item() == pytest.approx(ce_only.loss.item(), rel=1e-5)


def test_normalised_by_target_tokens_across_accumulation():
    """Two micro-batches divided by the window's token count sum to the loss of the whole batch."""
    logits, batch, n = _batch(seed=5)
    cfg = KDConfig(kd_ratio=0.7, loss="jsd")
    whole = mixed_loss(logits, batch, cfg, n).loss
    n0 = int((batch["labels"][:1, 1:] != -100).sum())
    first = {"labels": batch["labels"][:1], "teacher_logprobs": batch["teacher_logprobs"][:n0],
             "teacher_indices": batch["teacher_indices"][:n0], "teacher_tail": batch["teacher_tail"][:n0],
             "kd_weight": batch["kd_weight"][:n0]}
    rest = {"labels": batch["labels"][1:], "teacher_logprobs": batch["teacher_logprobs"][n0:],
            "teacher_indices": batch["teacher_indices"][n0:], "teacher_tail": batch["teacher_tail"][n0:],
            "kd_weight": batch["kd_weight"][n0:]}
    parts = mixed_loss(logits[:1], first, cfg, n).loss + mixed_loss(logits[1:], rest, cfg, n).loss
    assert parts.item() == pytest.approx(whole.item(), rel=1e-5)
    assert n0 != n - n0  # unequal micro-batches: a per-micro mean would differ


def test_bad_settings_are_refused():
    with pytest.raises(SmolforgeError, match="unknown KD loss"):
        KDConfig(loss="kl")
    with pytest.raises(SmolforgeError, match="temperature"):
        KDConfig(temperature=0)
    with pytest.raises(SmolforgeError, match="kd_ratio"):
        KDConfig(kd_ratio=1.5)
    logits, batch, n = _batch()
    with pytest.raises(SmolforgeError, match="do not match"):
        mixed_loss(logits, dict(batch, teacher_logprobs=batch["teacher_logprobs"][:-1]), KDConfig(), n)
