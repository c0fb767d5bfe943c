"""On-policy distillation (GKD, Agarwal et al. 2024): some student steps train on the student's own samples.

Off-policy KD trains the student on the teacher's responses; at generation time the student then
conditions on its own earlier tokens, which it never trained on (exposure bias). On-policy
distillation closes that gap: for a fraction λ of the steps (`on_policy_ratio`) the student samples
a response to each prompt of its batch, the teacher scores those tokens (teacher-forced, top-k, the
same `HFTeacher.score_ids` that scores reference answers for the store), and the loss is the
divergence between the two distributions on the student's own tokens (generalised JSD(β) as in
GKD: `KDConfig(loss="jsd", beta=...)`), with no cross-entropy on the student's samples (training on
one's own samples with CE is self-training, not distillation).

Which steps are on-policy is a pure function of (seed, step), and the samples are drawn under a
(seed, step, rank)-seeded generator, so a resumed student makes exactly the batches it would have
made, and the process-wide RNG (LoRA init of students built beside it) is untouched.
"""

from __future__ import annotations

import random
from dataclasses import dataclass

import numpy as np
import torch

from smolforge.data.collate import left_pad
from smolforge.data.encode import IGNORE
from smolforge.distill.rows import Row
from smolforge.errors import SmolforgeError
from smolforge.models.families import cut_at_stop, stop_ids



@dataclass
class OnPolicySettings:
    ratio: float = 0.0  # fraction of student steps that use the student's own samples (λ)
    temperature: float = 1.0  # the student's sampling temperature (GKD samples at 1)
    max_new_tokens: int = 16
    top_k: int = 32  # teacher log-probs kept per sampled token, as in the store

    def __post_init__(self) -> None:
        if not 0.0 <= self.ratio <= 1.0:
            raise SmolforgeError(f"on-policy ratio must be in [0, 1], got {self.ratio}",
                                 fix="use e.g. --on-policy-ratio 0.5")
        if not self.temperature > 0:
            raise SmolforgeError(f"on-policy sampling temperature must be > 0, got {self.temperature}",
                                 fix="use e.g. 1.0")


def is_on_policy_step(ratio: float, seed: int, step: int, first: int = 0) -> bool:
    """Whether global step `step` uses student samples: none before step `first` (GKD starts from a
    student that already answers in the task's format), then a fixed draw per (seed, step), the same
    on every rank."""
    if ratio <= 0.0 or step < first:
        return False
    if ratio >= 1.0:
        return True
    return random.Random(seed * 1_000_003 + step).random() < ratio


def prompt_of(row) -> list[int]:
    """A stored row's prompt: the ids before its first target token."""
    n = next((i for i, x in enumerate(row.labels) if x != IGNORE), len(row.labels))
    return list(row.input_ids[:n])


class OnPolicySampler:
    """Replaces a batch's responses with the student's samples, scored by an in-process teacher.

    `teacher` is an `HFTeacher` (loaded once in the student's process: on a cluster, the student's
    worker loads it where the student runs); it must share the student's tokenizer, since the
    divergence compares distributions over the same ids.
    """

    def __init__(self, settings: OnPolicySettings, teacher, tokenizer, seed: int = 0):
        self.s = settings
        self.teacher = teacher
        self.tokenizer = tokenizer
        self.seed = seed
        self.eos_id = tokenizer.eos_token_id
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.sampled_tokens = 0

    @torch.no_grad()
    def sample(self, model, prompts: list[list[int]], device: torch.device, step: int, rank: int = 0) -> list[list[int]]:
        """The student's sampled responses (ids up to and including their first stop token, `families.stop_ids`)
        for left-padded prompts."""
        stops = stop_ids(self.tokenizer, model)
        ids, mask = left_pad(prompts, self.pad_id)
        width = ids.shape[1]
        was_training = model.training
        model.eval()
        try:
            with torch.random.fork_rng(devices=[device] if device.type == "cuda" else []):
                torch.manual_seed((self.seed * 1_000_003 + step) * 1009 + rank)
                out = model.generate(input_ids=ids.to(device), attention_mask=mask.to(device), do_sample=True,
                                     temperature=self.s.temperature, top_p=1.0, top_k=0,
                                     max_new_tokens=self.s.max_new_tokens, pad_token_id=self.pad_id,
                                     eos_token_id=sorted(stops), use_cache=True)
        finally:
            model.train(was_training)
        gen = out[:, width:].tolist()
        return [cut_at_stop(toks, stops) for toks in gen]

    def rewrite(self, rows: list[Row], model, device: torch.device, step: int, rank: int = 0) -> list[Row]:
        """Rows with the same prompts, the student's samples as responses and the teacher's top-k over them."""
        prompts = [prompt_of(r) for r in rows]
        responses = self.sample(model, prompts, device, step, rank)
        keep = [i for i, resp in enumerate(responses) if resp]
        scored = self.teacher.score_ids([(prompts[i], responses[i]) for i in keep], self.s.top_k)
        out = []
        for i, (lp, ix, tail, _truncation) in zip(keep, scored):
            p, resp = prompts[i], responses[i]
            out.append(Row(p + resp, [IGNORE] * len(p) + resp, topk_logprobs=np.asarray(lp, np.float32),
                           topk_indices=np.asarray(ix, np.int64), tail=np.asarray(tail, np.float32)))
            self.sampled_tokens += len(resp)
        return out or rows  # every sample empty (cannot happen with max_new_tokens ≥ 1): keep the stored rows
