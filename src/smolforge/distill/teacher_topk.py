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
