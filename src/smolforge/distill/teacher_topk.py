"""What a teacher keeps of its logits: per response token the top-k log-probabilities, their ids and
the tail mass, and what keeping only the top k loses (truncation KL). Computed in fp32 from full
logits rows, the same code for every backend that has them (`teacher.HFTeacher`,
`teacher_llamacpp.LlamaCppTeacher`), so their stores differ only by their logits.
"""

from __future__ import annotations

import math

import torch


def topk_from_logits(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """[N, V] logits → (top-k log-probs [N, k], indices [N, k], tail mass [N]) in fp32."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    k = min(k, logp.shape[-1])
    values, idx = logp.topk(k, dim=-1)
    if k < logp.shape[-1]:
        tail = torch.logsumexp(logp.scatter(-1, idx, -float("inf")), dim=-1).exp()
    else:
        tail = torch.zeros(logp.shape[0])
    return values, idx, tail


def truncation_kl(logits: torch.Tensor, idx: torch.Tensor, tail: torch.Tensor) -> torch.Tensor:
    """Per row KL(P ‖ P̃) in nats, [N]: P = softmax(logits) over the whole vocabulary, P̃ its exact
    top-k with the tail mass spread evenly over the other V - k ids (what the KD losses assume when
    they temper the tail). What keeping only the top k loses, whatever the store's codec; 0 when
    k ≥ V. Only the teacher can compute it (it has the full logits), so it travels on the record
    into the shard manifest's `reconstruction`."""
    logp = torch.log_softmax(logits.float(), dim=-1)
    n, v = logp.shape
    k = idx.shape[-1]
    if k >= v:
        return torch.zeros(n)
    plogp = (logp.exp() * logp).scatter(-1, idx, 0.0).nan_to_num(0.0)  # 0 · log 0 = 0
    t = tail.float().clamp_min(0.0)
    uniform = torch.where(t > 0, t * (t.clamp_min(1e-30).log() - math.log(v - k)), torch.zeros_like(t))
    return (plogp.sum(-1) - uniform).clamp_min(0.0)


def topk_rows(logits: torch.Tensor, k: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`topk_from_logits` and `truncation_kl` in one go: (top-k log-probs [N, k], indices [N, k], tail
    mass [N], truncation KL [N]), what every teacher keeps per response token.

    Why fused: at a real vocabulary (Qwen's 151,936) the two functions make about a dozen passes over
    each row (two log-softmaxes, a scatter into a copy, an exp, a product, nan_to_num), which on a CPU
    took as long as a quarter of a llama.cpp decode step. Here: one top-k on the raw logits, whose first
    value is the row's max, then one exp pass; the tail's mass and its Σ p·log p are sums over the
    exponentials with the top k zeroed (not 1 minus the head, which loses a small tail to rounding).
    Rows with -inf logits (0 · log 0) take the two-function path, which handles them."""
    x = logits.float()
    n, v = x.shape
    k = min(k, v)
    top, idx = x.topk(k, dim=-1)
    if k >= v:
        return top - torch.logsumexp(x, -1, keepdim=True), idx, torch.zeros(n), torch.zeros(n)
    y = x - top[:, :1]  # ≤ 0: log p + log Σ exp
    e = y.exp()
    e.scatter_(-1, idx, 0.0)
    tail_e = e.sum(-1)
    head_e = (top - top[:, :1]).exp().sum(-1)
    log_s = (tail_e + head_e).log()
    tail = tail_e / (tail_e + head_e)
    plogp = torch.einsum("ij,ij->i", e, y) / (tail_e + head_e) - tail * log_s  # Σ_tail p·log p
    if not bool(torch.isfinite(plogp).all()):
        values, idx, tail = topk_from_logits(logits, k)
        return values, idx, tail, truncation_kl(logits, idx, tail)
    t = tail.clamp_min(0.0)
    uniform = torch.where(t > 0, t * (t.clamp_min(1e-30).log() - math.log(v - k)), torch.zeros_like(t))
    return top - top[:, :1] - log_s[:, None], idx, tail, (plogp - uniform).clamp_min(0.0)
