"""Knowledge-distillation losses over a stored top-k teacher distribution.

The store keeps only the teacher's k most likely tokens per position plus the probability mass of
everything else (the "tail"). The losses therefore compare distributions over k + 1 buckets: the k
teacher tokens, and one bucket for the rest of the vocabulary. The student's tail bucket is its
exact mass outside those k tokens (a masked logsumexp, not `1 - sum`, so tiny tails keep their
gradient). By the grouping property of KL divergence the bucket KL is a lower bound of the full
KL that becomes exact as the tail mass goes to zero.

Temperature: the student is tempered exactly (softmax of logits / T). The teacher's top-k
log-probabilities are tempered exactly too; its tail is tempered under the assumption that the
tail mass is spread evenly over the V - k tokens outside the top k (exact at T = 1). As in Hinton
et al. the KD term is scaled by T^2 so its gradient does not shrink with T.

Normalisation: every function returns *sums* over target tokens; the caller divides by the
number of target tokens in the whole accumulation window (see `mixed_loss`), so a batch with more
tokens does not count less, and accumulation gives the same gradient as one big batch.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F

from smolforge.distill.kdconfig import KD_LOSSES, KDConfig  # noqa: F401 (KDConfig: re-exported)
from smolforge.errors import SmolforgeError

# Teacher buckets are floored at this probability: reverse KL and JSD need log p to be finite.
_MIN_LOGP = math.log(1e-10)


def teacher_bucket_logprobs(topk_logprobs: torch.Tensor, tail_mass: torch.Tensor, vocab_size: int,
                            temperature: float = 1.0) -> torch.Tensor:
    """[N, k] top-k log-probs and [N] tail mass → [N, k+1] tempered, normalised bucket log-probs (k if k ≥ V)."""
    lp = topk_logprobs.float()
    k = lp.shape[-1]
    tail = tail_mass.float().clamp_min(0.0)
    log_tail = torch.where(tail > 0, torch.log(tail.clamp_min(1e-30)), torch.full_like(tail, -math.inf))
    rest = max(vocab_size - k, 1)
    if temperature != 1.0:
        lp = lp / temperature
        # Uniform-tail assumption: each of the `rest` tokens has mass tail/rest, tempered separately.
        log_tail = log_tail / temperature + (1.0 - 1.0 / temperature) * math.log(rest)
    # k ≥ V: there is no tail, and an empty bucket would only add log 0 terms.
    buckets = lp if vocab_size <= k else torch.cat([lp, log_tail.unsqueeze(-1)], dim=-1)
    buckets = torch.log_softmax(buckets, dim=-1)  # also absorbs fp16 rounding of the stored values
    return buckets.clamp_min(_MIN_LOGP)


def student_bucket_logprobs(student_logits: torch.Tensor, topk_indices: torch.Tensor,
                            temperature: float = 1.0) -> torch.Tensor:
    """[N, V] student logits and [N, k] teacher indices → [N, k+1] tempered bucket log-probs (k if k ≥ V)."""
    logits = student_logits.float()
    if temperature != 1.0:
        logits = logits / temperature
    logz = torch.logsumexp(logits, dim=-1, keepdim=True)
    top = logits.gather(-1, topk_indices) - logz
    if topk_indices.shape[-1] >= logits.shape[-1]:
        return top
    masked = logits.scatter(-1, topk_indices, -math.inf)
    tail = torch.logsumexp(masked, dim=-1, keepdim=True) - logz
    return torch.cat([top, tail], dim=-1)


def _kl(log_p: torch.Tensor, log_q: torch.Tensor) -> torch.Tensor:
    """KL(p ‖ q) per row, with 0·log 0 = 0."""
    p = log_p.exp()
    terms = torch.where(p > 0, p * (log_p - log_q), torch.zeros_like(p))
    return terms.sum(-1)


def bucket_divergence(student_lp: torch.Tensor, teacher_lp: torch.Tensor, loss: str = "forward_kl",
                      beta: float = 0.5) -> torch.Tensor:
    """Per-row divergence between teacher and student bucket distributions."""
    if loss == "forward_kl" or (loss == "jsd" and beta == 0.0):
        return _kl(teacher_lp, student_lp)
    if loss == "reverse_kl" or (loss == "jsd" and beta == 1.0):
        return _kl(student_lp, teacher_lp)
    if loss == "jsd":
        # Generalized JSD (Agarwal et al., GKD): β·KL(p ‖ m) + (1-β)·KL(q ‖ m), m = βp + (1-β)q.
        mix = torch.logsumexp(torch.stack([teacher_lp + math.log(beta), student_lp + math.log(1 - beta)]), dim=0)
        return beta * _kl(teacher_lp, mix) + (1 - beta) * _kl(student_lp, mix)
    raise SmolforgeError(f"unknown KD loss {loss!r}", fix=f"use one of {', '.join(KD_LOSSES)}")


def topk_kd_loss_sum(student_logits: torch.Tensor, topk_logprobs: torch.Tensor, topk_indices: torch.Tensor,
                     tail_mass: torch.Tensor, cfg: KDConfig, weights: torch.Tensor | None = None) -> torch.Tensor:
    """Sum over rows of T²·D(teacher ‖ student) for [N, V] student logits and [N, k] teacher rows.

    `weights` ([N], 0/1) switches rows off, e.g. tokens whose teacher gave no logits.
    """
    vocab = student_logits.shape[-1]
    idx = topk_indices.long().clamp(0, vocab - 1)
    t_lp = teacher_bucket_logprobs(topk_logprobs, tail_mass, vocab, cfg.temperature)
    s_lp = student_bucket_logprobs(student_logits, idx, cfg.temperature)
    per_row = bucket_divergence(s_lp, t_lp, cfg.loss, cfg.beta) * (cfg.temperature ** 2)
    if weights is not None:
        per_row = per_row * weights.to(per_row.dtype)
    return per_row.sum()


def full_kd_loss_sum(student_logits: torch.Tensor, teacher_logits: torch.Tensor, cfg: KDConfig) -> torch.Tensor:
    """The same divergence over the full vocabulary: the reference the top-k version approximates."""
    s = torch.log_softmax(student_logits.float() / cfg.temperature, dim=-1)
    t = torch.log_softmax(teacher_logits.float() / cfg.temperature, dim=-1).clamp_min(_MIN_LOGP)
    return (bucket_divergence(s, t, cfg.loss, cfg.beta) * cfg.temperature ** 2).sum()


@dataclass
class LossParts:
    loss: torch.Tensor  # what to call backward() on: already divided by the window's token count
    kd_sum: float
    ce_sum: float
    tokens: int
    kd_tokens: int


def mixed_loss(student_logits: torch.Tensor, batch: dict[str, torch.Tensor], cfg: KDConfig,
               normalizer: int | float) -> LossParts:
    """kd_ratio·KD + (1-kd_ratio)·CE, summed over the batch's target tokens, divided by `normalizer`.

    `batch` holds `labels` [B, L] (-100 where no loss) and, when the teacher gave logits,
    `teacher_logprobs` [N, k], `teacher_indices` [N, k], `teacher_tail` [N] and `kd_weight` [N],
    where row n is the n-th target token in row-major order of `labels[:, 1:] != -100`. Tokens
    with kd_weight 0 (no teacher logits) get plain CE, so their loss is never silently dropped.
    `normalizer` is the number of target tokens in the whole gradient-accumulation window.
    """
    labels = batch["labels"]
    shift_logits = student_logits[:, :-1, :]
    shift_labels = labels[:, 1:]
    mask = shift_labels != -100
    rows = shift_logits[mask]  # [N, V]
    targets = shift_labels[mask]
    n = int(targets.numel())
    ce_rows = F.cross_entropy(rows.float(), targets, reduction="none") if n else rows.new_zeros(0)
    # An on-policy batch (the student's own samples, distill/on_policy.py) trains on the divergence only:
    # cross-entropy on the student's samples would be self-training, not distillation.
    kd_ratio = 1.0 if "on_policy" in batch else cfg.kd_ratio
    have_kd = "teacher_logprobs" in batch and kd_ratio > 0 and n > 0
    if have_kd:
        w = batch.get("kd_weight")
        w = torch.ones(n, device=rows.device) if w is None else w.to(rows.device).float()
        if batch["teacher_logprobs"].shape[0] != n:
            raise SmolforgeError(
                f"teacher rows ({batch['teacher_logprobs'].shape[0]}) do not match the student's target tokens ({n})",
                fix="the shard and the student tokenizer disagree; regenerate the teacher outputs for this student")
        kd_sum = topk_kd_loss_sum(rows, batch["teacher_logprobs"].to(rows.device), batch["teacher_indices"].to(rows.device),
                                  batch["teacher_tail"].to(rows.device), cfg, weights=w)
        ce_weight = (1.0 - kd_ratio) * w + (1.0 - w)  # rows without teacher logits: full CE
        ce_sum = (ce_rows * ce_weight).sum()
        total = kd_ratio * kd_sum + ce_sum
        kd_tokens = int(w.sum().item())
    else:
        kd_sum = rows.new_zeros(())
        ce_sum = ce_rows.sum()
        total = ce_sum
        kd_tokens = 0
    return LossParts(loss=total / max(float(normalizer), 1.0), kd_sum=float(kd_sum.detach()),
                     ce_sum=float(ce_rows.sum().detach()) if n else 0.0, tokens=n, kd_tokens=kd_tokens)
