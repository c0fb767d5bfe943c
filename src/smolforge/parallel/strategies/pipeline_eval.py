"""Evaluation through a pipeline's stages, for the pipeline strategy (`pipeline.py`): forward only.

Why: a pipeline exists because no rank holds the whole model, so evaluation must not gather it (every
stage's weights on every rank while it lasts) either. Every rank runs every eval row through its stage,
batch by batch in the same order, the hidden states going forward over each cut as in training (plain
sends: no schedule, no backward). The last stage computes the loss sums; for accuracy it picks each
greedy token and broadcasts it, so every stage decodes the same next token with its own KV cache (its
layers' slots only). The numbers are broadcast from the last rank: every rank returns the same ones,
already the whole evaluation's (nothing to reduce).

Greedy decoding follows HF `generate` (what one process's evaluation runs): left-padded prompts, the
positions HF builds for them, a row that produced a stop token (`families.stop_ids`) gets the pad token after it,
and decoding stops when every row has ended or after `max_new_tokens`.
"""

from __future__ import annotations

from typing import Any, Callable, Collection

import torch
import torch.distributed as dist

from smolforge.data.collate import collate
from smolforge.data.encode import prompt_text
from smolforge.models.families import cut_at_stop, stop_ids
from smolforge.models.partition import Stage, generation_positions, positions_for
from smolforge.train.evaluate import normalise_answer, token_loss_sum


class StageEval:
    """This rank's part of an evaluation: its stage, between the previous rank and the next."""

    def __init__(self, stage: Stage, rank: int, world: int, device: torch.device, hidden_size: int,
                 hidden_dtype: torch.dtype, count: Callable[[torch.Tensor], None] = lambda t: None):
        self.stage, self.rank, self.world, self.device = stage, rank, world, device
        self.hidden_size, self.hidden_dtype, self.count = hidden_size, hidden_dtype, count
        self.last = rank == world - 1

    def _through(self, ids: torch.Tensor, mask: torch.Tensor, positions: torch.Tensor, cache=None):
        """`ids` (every rank has them; the first stage reads them) through this stage: the logits on the last
        stage, None on the others (their hidden states went to the next rank)."""
        x = ids
        if self.rank > 0:
            x = torch.empty((*ids.shape, self.hidden_size), dtype=self.hidden_dtype, device=self.device)
            dist.recv(x, src=self.rank - 1)
        out = self.stage(x, mask, positions, cache)
        if self.last:
            return out
        out = out.to(self.hidden_dtype).contiguous()
        self.count(out)
        dist.send(out, dst=self.rank + 1)
        return None

    def loss_sums(self, rows: list, pad_id: int, batch_size: int) -> tuple[float, int]:
        """(sum of token losses, target tokens) over `rows` on the last stage; (0, 0) elsewhere."""
        total, count = 0.0, 0
        for i in range(0, len(rows), batch_size):
            batch = {k: v.to(self.device) for k, v in collate(rows[i:i + batch_size], pad_id).items()}
            mask = batch["attention_mask"]
            logits = self._through(batch["input_ids"], mask, positions_for(mask))
            if logits is not None:
                s, n = token_loss_sum(logits, batch["labels"])
                total += float(s)
                count += n
        return total, count

    def greedy(self, ids: torch.Tensor, mask: torch.Tensor, max_new_tokens: int, stops: Collection[int],
               pad_id: int) -> torch.Tensor:
        """The new tokens [rows, <= max_new_tokens] HF's greedy `generate` gives for left-padded `ids` [rows, T],
        on every rank; a row ends at any id of `stops` (the model's stop set, `families.stop_ids`)."""
        cache = self.stage.new_cache()
        stop = torch.tensor(sorted(stops), dtype=torch.long, device=self.device)
        rows = ids.shape[0]
        done = torch.zeros(rows, dtype=torch.bool, device=self.device)
        x, positions, new = ids, generation_positions(mask), []
        for _ in range(max_new_tokens):
            logits = self._through(x, mask, positions, cache)
            token = (logits[:, -1].float().argmax(-1) if logits is not None
                     else torch.empty(rows, dtype=torch.long, device=self.device))
            dist.broadcast(token, src=self.world - 1)
            token = torch.where(done, torch.full_like(token, pad_id), token)
            new.append(token)
            done |= torch.isin(token, stop)
            if bool(done.all()):
                break
            x = token[:, None]
            mask = torch.cat([mask, mask.new_ones(rows, 1)], dim=1)
            positions = generation_positions(mask)[:, -1:]
        return torch.stack(new, dim=1) if new else ids.new_zeros(rows, 0)

    def exact_match(self, tokenizer: Any, examples: list, max_new_tokens: int, batch_size: int) -> tuple[int, int]:
        """(correct, total) over the examples with a reference answer, as `train.evaluate.exact_match_counts`."""
        usable = [ex for ex in examples if ex.answer is not None]
        stops = stop_ids(tokenizer, self.stage)
        old_side, tokenizer.padding_side = tokenizer.padding_side, "left"
        answers: list[str] = []
        try:
            for i in range(0, len(usable), batch_size):
                prompts = [prompt_text(tokenizer, ex) for ex in usable[i:i + batch_size]]
                enc = tokenizer(prompts, return_tensors="pt", padding=True, add_special_tokens=False).to(self.device)
                new = self.greedy(enc["input_ids"], enc["attention_mask"], max_new_tokens, stops,
                                  tokenizer.pad_token_id)
                answers += tokenizer.batch_decode([cut_at_stop(row, stops, keep=False) for row in new.tolist()],
                                                  skip_special_tokens=True)
        finally:
            tokenizer.padding_side = old_side
        correct = sum(normalise_answer(a) == normalise_answer(ex.answer) for a, ex in zip(answers, usable))
        return correct, len(usable)

    def shared(self, values: list[float]) -> list[float]:
        """The last rank's numbers on every rank."""
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.broadcast(t, src=self.world - 1)
        return [float(v) for v in t.tolist()]
