"""Held-out loss, perplexity and exact-match accuracy."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F

from smolforge.data.collate import collate
from smolforge.data.encode import IGNORE, prompt_text
from smolforge.data.formats import Example
from smolforge.models.peft_methods import virtual_token_offset


def token_loss_sum(logits: torch.Tensor, labels: torch.Tensor) -> tuple[torch.Tensor, int]:
    """Summed next-token cross-entropy over target tokens, and how many there were.

    Position t predicts token t+1: the labels move left (the last position has no target) rather
    than the logits, so contiguous logits go in as a view. Slicing them (`logits[:, :-1]`) copied the
    largest activation of a small model (batch x length x vocab) on the way in, and once more for its
    gradient on the way back."""
    targets = torch.full_like(labels, IGNORE)
    targets[:, :-1] = labels[:, 1:]
    loss = F.cross_entropy(logits.float().reshape(-1, logits.size(-1)), targets.reshape(-1),
                           ignore_index=IGNORE, reduction="sum")
    return loss, int((targets != IGNORE).sum())


@torch.no_grad()
def eval_loss_sums(model, rows, pad_id: int, batch_size: int, device) -> tuple[float, int]:
    """(sum of token losses, token count) so ranks can add theirs before dividing."""
    was_training = model.training
    model.eval()

    offset = virtual_token_offset(model)
    total, count = 0.0, 0
    for i in range(0, len(rows), batch_size):
        batch = {k: v.to(device) for k, v in collate(rows[i:i + batch_size], pad_id).items()}
        logits = model(input_ids=batch["input_ids"], attention_mask=batch["attention_mask"]).logits
        s, n = token_loss_sum(logits[:, offset:], batch["labels"])
        total += float(s)
        count += n
    model.train(was_training)
    return total, count


def perplexity(loss: float) -> float:
    return math.exp(min(loss, 50.0))


def normalise_answer(text: str) -> str:
    return " ".join(text.strip().split())


@torch.no_grad()
def generate_answers(model, tokenizer, examples: list[Example], max_new_tokens: int = 16,
                     batch_size: int = 32, device="cpu") -> list[str]:
    """Greedy answers, batched with left padding (right padding would put pads before new tokens).

    Generation stops at any id of the model's stop set (`families.stop_ids`: the generation config's
    eos ids, the tokenizer's eos and the chat template's end of turn), and each answer is cut before its
    first stop id, so an answer that ended its turn (Phi-3's `<|end|>`) scores as the text before it."""
    from smolforge.models.families import cut_at_stop, stop_ids

    stops = stop_ids(tokenizer, model)
    was_training = model.training
    model.eval()
    old_side = tokenizer.padding_side
    tokenizer.padding_side = "left"
    outputs: list[str] = []
    try:
        for i in range(0, len(examples), batch_size):
            prompts = [prompt_text(tokenizer, ex) for ex in examples[i:i + batch_size]]
            enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(device)
            gen = model.generate(**enc, max_new_tokens=max_new_tokens, do_sample=False,
                                 pad_token_id=tokenizer.pad_token_id, eos_token_id=sorted(stops))
            new = [cut_at_stop(row, stops, keep=False) for row in gen[:, enc["input_ids"].shape[1]:].tolist()]
            outputs += tokenizer.batch_decode(new, skip_special_tokens=True)
    finally:
        tokenizer.padding_side = old_side
        model.train(was_training)
    return outputs


def exact_match_counts(model, tokenizer, examples: list[Example], max_new_tokens: int = 16,
                       batch_size: int = 32, device="cpu") -> tuple[int, int]:
    """(correct, total) over examples that have a reference answer."""
    usable = [ex for ex in examples if ex.answer is not None]
    if not usable:
        return 0, 0
    answers = generate_answers(model, tokenizer, usable, max_new_tokens, batch_size, device)
    correct = sum(normalise_answer(a) == normalise_answer(ex.answer) for a, ex in zip(answers, usable))
    return correct, len(usable)
