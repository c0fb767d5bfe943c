"""Teacher generation with transformers: batched, KV-cached `generate`, then top-k over the response.

Per prompt the teacher produces (a) response text for sequence-level KD and (b) for every response
token the top-k log-probabilities and the tail mass, for logit-level KD. Prompts are left-padded
so a whole batch decodes together with the KV cache; prompts are sorted by length first so little
compute goes to padding. The logits come from one extra teacher-forced forward pass over prompt
plus response (restricted to the response positions with `logits_to_keep`), which on a cached
model costs about one decode step per batch and keeps `generate` itself as fast as a plain call.
"""

from __future__ import annotations

import time
from dataclasses import asdict
from pathlib import Path
from typing import Any, Callable, Iterator

import numpy as np
import torch

from smolforge.config import DataSpec
from smolforge.data.collate import left_pad
from smolforge.data.encode import encode_example, ensure_chat_template
from smolforge.data.formats import Example
from smolforge.data.splits import read_spec
from smolforge.distill.planner import plan_shards
from smolforge.distill.prompts import GenSettings, PromptItem
from smolforge.distill.store import TeacherRecord, encode_shard, tokenizer_hash, write_shard_bytes
from smolforge.distill.teacher_topk import topk_from_logits, topk_rows, truncation_kl  # noqa: F401 (re-export)
from smolforge.errors import SmolforgeError
from smolforge.models.families import cut_at_stop, stop_ids
from smolforge.models.loading import load_model, load_tokenizer, pick_device
from smolforge.train.rendering import render_prompt, system_role


def prompts_from_dataset(dataset: str, max_samples: int | None = None, data_format: str = "auto") -> list[PromptItem]:
    """The training prompts of a dataset (JSONL or 'bundled'), in file order, with their answers where
    the records have them: a teacher needs prompts only ({"prompt": ...} lines, a chat ending on a user
    turn); only the `reference` backend and `--teacher-responses reference` need answers."""

    train, _eval, _fmt, _skipped = read_spec(DataSpec(path=dataset, format=data_format, max_samples=max_samples),
                                             prompts_only=True)
    with_tools = next((ex for ex in train if ex.tools), None)
    if with_tools is not None:  # a teacher's prompt would be rendered without them: refused, not dropped
        raise SmolforgeError("a record has tools, which distillation does not take yet (a teacher's prompt "
                             "is rendered without them)", where=with_tools.source,
                             fix="distill on records without `tools`, or fine-tune on them with `smolforge train`")
    items = [PromptItem(i, ex.prompt_messages, ex.answer) for i, ex in enumerate(train) if ex.messages]
    if not items:
        raise SmolforgeError(f"{dataset} has no prompt/response examples for a teacher to answer",
                             fix="use alpaca, chat or prompt/completion records (plain text has no prompts)")
    return items


def reference_ids(tokenizer, item: PromptItem) -> tuple[list[int], list[int]]:
    """(prompt ids, response ids up to and including its first stop token) of an item's reference answer: exactly
    the tokens plain SFT trains on, so KD on references and SFT see the same targets."""

    if item.answer is None:
        raise SmolforgeError(f"example {item.example_id} has no reference answer",
                             fix="reference responses need data with answers (prompt/completion, alpaca, chat)")
    ex = Example("reference", messages=list(item.prompt_messages) + [{"role": "assistant", "content": item.answer}])
    ids, labels = encode_example(tokenizer, ex, system_role(tokenizer))  # folded as SFT folds it
    first = next(i for i, x in enumerate(labels) if x != -100)
    response = ids[first:]
    # the template tail after the end of turn is re-added by students (student.template_tail_ids)
    return ids[:first], cut_at_stop(response, stop_ids(tokenizer))


class HFTeacher:
    """A transformers causal LM used as a teacher. Loaded once per process, reused for every shard."""

    backend = "hf"

    def __init__(self, model: str, device: str = "auto", dtype: torch.dtype | str | None = None, model_obj=None,
                 tokenizer=None):
        """`dtype`: a torch dtype or a --dtype choice (auto|bf16|fp16|fp32; default fp32). Top-k rows
        are computed in fp32 from whatever dtype the logits come in (topk_rows)."""

        self.name = model
        self.device = pick_device(device)
        self.tokenizer = tokenizer or load_tokenizer(model)
        ensure_chat_template(self.tokenizer)
        self.model = model_obj if model_obj is not None else load_model(model, device=self.device, dtype=dtype)
        self.model.eval()
        self.vocab_size = int(self.model.get_output_embeddings().weight.shape[0])
        self.tok_hash = tokenizer_hash(self.tokenizer)
        self.stops = stop_ids(self.tokenizer, self.model)  # every token that ends a response
        self.eos_id = self.tokenizer.eos_token_id
        self.pad_id = self.tokenizer.pad_token_id if self.tokenizer.pad_token_id is not None else self.eos_id

    def prompt_ids(self, item: PromptItem) -> list[int]:
        text = render_prompt(self.tokenizer, item.prompt_messages)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    @torch.no_grad()
    def generate(self, items: list[PromptItem], settings: GenSettings) -> list[TeacherRecord]:
        """Answer every prompt; records come back in the order of `items` (samples adjacent)."""
        settings.check()
        if settings.responses == "reference":
            return self.score_references(items, settings)
        encoded = [(item, self.prompt_ids(item)) for item in items]
        order = sorted(range(len(encoded)), key=lambda i: len(encoded[i][1]))
        out: dict[int, list[TeacherRecord]] = {}
        for start in range(0, len(order), settings.batch_size):
            chunk = [encoded[i] for i in order[start:start + settings.batch_size]]
            for pos, recs in zip(order[start:start + settings.batch_size], self._generate_batch(chunk, settings)):
                out[pos] = recs
        return [r for i in range(len(encoded)) for r in out[i]]

    def _left_pad(self, seqs: list[list[int]]) -> tuple[torch.Tensor, torch.Tensor]:
        ids, mask = left_pad(seqs, self.pad_id)
        return ids.to(self.device), mask.to(self.device)

    def _generate_batch(self, chunk: list[tuple[PromptItem, list[int]]], s: GenSettings) -> list[list[TeacherRecord]]:
        input_ids, attention = self._left_pad([ids for _, ids in chunk])
        width = input_ids.shape[1]
        gen_kwargs: dict[str, Any] = dict(
            max_new_tokens=s.max_new_tokens, use_cache=True, pad_token_id=self.pad_id, eos_token_id=sorted(self.stops),
            num_return_sequences=s.samples_per_prompt,
        )
        if s.temperature > 0:
            gen_kwargs.update(do_sample=True, temperature=s.temperature, top_p=s.top_p, top_k=None)
            torch.manual_seed(s.seed)
        else:
            gen_kwargs.update(do_sample=False, temperature=None, top_p=None, top_k=None)
        seqs = self.model.generate(input_ids=input_ids, attention_mask=attention, **gen_kwargs)
        gen = seqs[:, width:]
        rows = gen.shape[0]
        # Response = generated tokens up to and including the first stop token.
        lengths = [len(cut_at_stop(gen[r].tolist(), self.stops)) for r in range(rows)]
        g = max(lengths) if lengths else 0
        prompt_mask = attention.repeat_interleave(s.samples_per_prompt, dim=0)
        gen_mask = (torch.arange(gen.shape[1], device=gen.device)[None, :] < torch.tensor(lengths, device=gen.device)[:, None]).long()
        full = torch.cat([seqs[:, :width], gen[:, :g]], dim=1)
        mask = torch.cat([prompt_mask, gen_mask[:, :g]], dim=1)
        records: list[list[TeacherRecord]] = [[] for _ in chunk]
        values = idx = tail = None
        if g > 0:
            logits = self._response_logits(full, mask, g)  # [rows, g, V]
            flat = logits.reshape(-1, logits.shape[-1])
            values, idx, tail, trunc = topk_rows(flat, s.top_k)
            trunc = trunc.view(rows, g).cpu()
            k = values.shape[-1]
            values, idx, tail = values.view(rows, g, k).cpu(), idx.view(rows, g, k).cpu(), tail.view(rows, g).cpu()
        for r in range(rows):
            item, ids = chunk[r // s.samples_per_prompt]
            n_resp = lengths[r]
            resp = gen[r, :n_resp].tolist()
            text = self.tokenizer.decode(resp, skip_special_tokens=True)
            rec = TeacherRecord(example_id=item.example_id, prompt_messages=item.prompt_messages, prompt_ids=list(ids),
                                response_ids=resp, response_text=text, answer=item.answer,
                                sample_id=r % s.samples_per_prompt)
            if values is not None:
                rec.topk_logprobs = values[r, :n_resp].numpy()
                rec.topk_indices = idx[r, :n_resp].numpy().astype(np.int64)
                rec.tail_mass = tail[r, :n_resp].numpy()
                rec.truncation_kl = trunc[r, :n_resp].numpy()
            else:
                rec.topk_logprobs = np.zeros((0, min(s.top_k, self.vocab_size)), np.float32)
                rec.topk_indices = np.zeros((0, min(s.top_k, self.vocab_size)), np.int64)
                rec.tail_mass = np.zeros(0, np.float32)
            records[r // s.samples_per_prompt].append(rec)
        return records

    @torch.no_grad()
    def score_references(self, items: list[PromptItem], settings: GenSettings) -> list[TeacherRecord]:
        """Top-k over the dataset's reference answers, teacher-forced: one forward pass per batch.

        Rows are left-padded so every sequence ends at the same column; row r's response logits are
        then the last len(response_r) of the kept positions.
        """
        encoded = [(item, *reference_ids(self.tokenizer, item)) for item in items]
        scored = self.score_ids([(prompt, resp) for _, prompt, resp in encoded], settings.top_k, settings.batch_size)
        return [TeacherRecord(example_id=item.example_id, prompt_messages=item.prompt_messages,
                              prompt_ids=list(prompt), response_ids=list(resp), response_text=item.answer or "",
                              answer=item.answer, topk_logprobs=values, topk_indices=idx, tail_mass=tail,
                              truncation_kl=trunc)
                for (item, prompt, resp), (values, idx, tail, trunc) in zip(encoded, scored)]

    @torch.no_grad()
    def score_ids(self, pairs: list[tuple[list[int], list[int]]], top_k: int,
                  batch_size: int = 64) -> list[tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]]:
        """Teacher-forced top-k over given responses: (log-probs [n, k], indices [n, k], tail [n], top-k
        truncation KL [n]) per (prompt ids, response ids) pair, in order. The reference backend scores the dataset's answers
        with it, and on-policy distillation the student's own samples."""
        order = sorted(range(len(pairs)), key=lambda i: len(pairs[i][0]) + len(pairs[i][1]))
        out: dict[int, tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]] = {}
        for start in range(0, len(order), batch_size):
            rows = order[start:start + batch_size]
            full, mask = self._left_pad([list(pairs[i][0]) + list(pairs[i][1]) for i in rows])
            g = max(len(pairs[i][1]) for i in rows)
            if g == 0:
                k = min(top_k, self.vocab_size)
                for i in rows:
                    out[i] = (np.zeros((0, k), np.float32), np.zeros((0, k), np.int64), np.zeros(0, np.float32),
                              np.zeros(0, np.float32))
                continue
            logits = self._response_logits(full, mask, g)  # [rows, g, V]
            flat = logits.reshape(-1, logits.shape[-1])
            values, idx, tail, trunc = topk_rows(flat, top_k)
            trunc = trunc.view(len(rows), g).cpu()
            k = values.shape[-1]
            values, idx, tail = values.view(len(rows), g, k).cpu(), idx.view(len(rows), g, k).cpu(), tail.view(len(rows), g).cpu()
            for r, i in enumerate(rows):
                n = len(pairs[i][1])
                out[i] = (values[r, g - n:].numpy(), idx[r, g - n:].numpy().astype(np.int64), tail[r, g - n:].numpy(),
                          trunc[r, g - n:].numpy())
        return [out[i] for i in range(len(pairs))]

    def _response_logits(self, full: torch.Tensor, mask: torch.Tensor, g: int) -> torch.Tensor:
        """Logits predicting each of the g response tokens: positions [L-g-1, L-2] of the full rows."""
        keep = g + 1
        position_ids = (mask.cumsum(-1) - 1).clamp_min(0)  # left padding: positions count real tokens only
        try:
            out = self.model(input_ids=full, attention_mask=mask, position_ids=position_ids, logits_to_keep=keep,
                             use_cache=False)
            logits = out.logits
        except TypeError:  # a model class without logits_to_keep
            logits = self.model(input_ids=full, attention_mask=mask, position_ids=position_ids, use_cache=False).logits
        return logits[:, -keep:-1, :]


class ReferenceTeacher:
    """A "teacher" that answers with the dataset's reference answers: text and ids, no logits.

    Students fed from its store are plain SFT students that went through exactly the same
    pipeline (shards, split, steps, aggregation) as the distilled ones, which makes it the fair
    baseline for "does KD beat SFT?". `model` only supplies the tokenizer (use the student's).
    """

    backend = "reference"

    def __init__(self, model: str):
        self.name = model
        self.tokenizer = load_tokenizer(model)
        ensure_chat_template(self.tokenizer)
        self.vocab_size = len(self.tokenizer)
        self.tok_hash = tokenizer_hash(self.tokenizer)

    def generate(self, items: list[PromptItem], settings: GenSettings) -> list[TeacherRecord]:
        out = []
        for item in items:
            prompt, response = reference_ids(self.tokenizer, item)  # exactly the rows plain SFT trains on
            out.append(TeacherRecord(example_id=item.example_id, prompt_messages=item.prompt_messages,
                                     prompt_ids=prompt, response_ids=response, response_text=item.answer or "",
                                     answer=item.answer))
        return out


def make_teacher(model: str, backend: str = "hf", **kwargs):
    """The teacher object for a backend: 'hf' (transformers), 'llamacpp' (a GGUF in llama.cpp), 'ollama'
    (HTTP API) or 'reference' (`distill/backends.py`: each backend's class builds its teacher)."""
    from smolforge.distill.backends import teacher_backend

    return teacher_backend(backend).build(model, **kwargs)


def produce_shards(teacher, items: "list[PromptItem] | dict[int, PromptItem]", shard_ranges: dict[int, tuple[int, int]],
                   settings: GenSettings,
                   compress: bool = True, should_stop: Callable[[], bool] | None = None,
                   ) -> Iterator[tuple[dict[str, Any], bytes]]:
    """Generate each shard (a [start, end) range of `items`) and yield (manifest, safetensors bytes).

    `items` may be a list or a dict from dataset index to prompt (a remote teacher gets only its own).

    The caller decides where bytes go (a local store dir, the Ray object store), so the same
    generator serves the local pipeline and remote teacher tasks.
    """
    for shard_id, (start, end) in sorted(shard_ranges.items()):
        if should_stop and should_stop():
            return
        t0 = time.time()
        records = teacher.generate([items[i] for i in range(start, end)], settings)
        seconds = time.time() - t0
        with_k = [r for r in records if r.has_topk]
        k = with_k[0].topk_logprobs.shape[1] if with_k else min(settings.top_k, teacher.vocab_size)
        data, manifest = encode_shard(
            shard_id, records, vocab_size=teacher.vocab_size, k=k, tok_hash=teacher.tok_hash, compress=compress,
            extra={"teacher": teacher.name, "backend": teacher.backend, "example_range": [start, end],
                   "generation": asdict(settings), "seconds": seconds,
                   "has_logits": any(r.has_topk for r in records),
                   **getattr(teacher, "manifest_extra", {}),  # e.g. llamacpp: its threads and GGUF
                   "generated_tokens_per_s": sum(len(r.response_ids) for r in records) / max(seconds, 1e-9)})
        yield manifest, data


def run_teacher_local(model: str, dataset: str, output_dir: str | Path, *, shard_ids: list[int] | None = None,
                      num_shards: int = 1, max_samples: int | None = None, settings: GenSettings | None = None,
                      compress: bool = True, backend: str = "hf", device: str = "auto",
                      dtype: str = "fp32", **backend_kwargs: Any) -> list[dict[str, Any]]:
    """Single-process teacher: plan shards, generate them, write each into `output_dir` as it finishes.
    `backend_kwargs` go to `make_teacher` (e.g. llamacpp's tokenizer, quant, n_threads)."""

    settings = settings or GenSettings()
    items = prompts_from_dataset(dataset, max_samples)
    teacher = make_teacher(model, backend, device=device, dtype=dtype, **backend_kwargs)
    plan = plan_shards(len(items), num_shards=num_shards, teacher=model, dataset=dataset,
                       tokenizer_hash=teacher.tok_hash, vocab_size=teacher.vocab_size, k=settings.top_k)
    plan.write(output_dir)
    wanted = {i: tuple(plan.shards[i]) for i in (shard_ids if shard_ids is not None else range(plan.num_shards))}
    manifests = []
    for manifest, data in produce_shards(teacher, items, wanted, settings, compress=compress):
        write_shard_bytes(output_dir, manifest, data)
        manifests.append(manifest)
    return manifests
