"""Teacher backend for a model served by Ollama, through its HTTP API (`/api/chat`).

Ollama gives text, and since v0.12.11 per-token `logprobs` with up to 20 `top_logprobs` when asked.
Text always makes a record for sequence-level KD. Logits are kept only when the server sent top
logprobs *and* we have the model's HF tokenizer (from the Ollama→HF alias table) to turn token
strings back into vocabulary ids; otherwise the record is text-only and students train on the
text. Tokens are mapped through their raw `bytes` (byte-level BPE spells bytes with GPT-2's
printable alphabet), falling back to encoding the token text, and a response whose tokens do not
all map is kept as text only rather than trained on misaligned logits.

The response JSON is parsed field by field from plain JSON (never unpickled).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from smolforge.data.encode import ensure_chat_template
from smolforge.train.rendering import prompt_messages, render_prompt
from smolforge.distill.prompts import GenSettings, PromptItem
from smolforge.distill.store import TeacherRecord, tokenizer_hash
from smolforge.errors import SmolforgeError
from smolforge.models.families import stop_ids, turn_end_id
from smolforge.models.loading import load_tokenizer
from smolforge.models.token_bytes import byte_alphabet

DEFAULT_HOST = "http://127.0.0.1:11434"
MAX_TOP_LOGPROBS = 20


class OllamaTeacher:
    """Talks to `ollama serve`; `model` is the Ollama name (e.g. qwen2.5:7b)."""

    backend = "ollama"

    def __init__(self, model: str, host: str | None = None, tokenizer_name: str | None = None, timeout_s: float = 300.0,
                 tokenizer=None):
        import os

        self.name = model
        self.host = (host or os.environ.get("OLLAMA_HOST") or DEFAULT_HOST).rstrip("/")
        if not self.host.startswith("http"):
            self.host = "http://" + self.host
        self.timeout_s = timeout_s
        self.tokenizer = tokenizer
        if self.tokenizer is None:
            self.tokenizer = self._try_tokenizer(tokenizer_name or model)
        if self.tokenizer is not None:
            ensure_chat_template(self.tokenizer)
            self.vocab_size = len(self.tokenizer)
            self.tok_hash = tokenizer_hash(self.tokenizer)
            self._vocab = self.tokenizer.get_vocab()
        else:
            self.vocab_size, self.tok_hash, self._vocab = 0, "ollama-text-only", {}

    @staticmethod
    def _try_tokenizer(name: str):
        try:
            return load_tokenizer(name)
        except SmolforgeError:
            return None  # text-only: students fall back to sequence-level KD

    def _post(self, path: str, payload: dict[str, Any]) -> dict[str, Any]:
        import httpx

        try:
            resp = httpx.post(self.host + path, json=payload, timeout=self.timeout_s)
        except httpx.HTTPError as err:
            raise SmolforgeError(f"cannot reach Ollama at {self.host}: {err}",
                                 fix="start it with `ollama serve` (or set OLLAMA_HOST) on the teacher node") from err
        if resp.status_code == 404:
            raise SmolforgeError(f"Ollama at {self.host} does not have model {self.name!r}",
                                 fix=f"run `ollama pull {self.name}` on that node")
        if resp.status_code != 200:
            raise SmolforgeError(f"Ollama answered {resp.status_code}: {resp.text[:200]}", fix="check the Ollama server log")
        try:
            data = resp.json()
        except ValueError as err:
            raise SmolforgeError(f"Ollama sent a non-JSON answer: {resp.text[:200]!r}", fix="check the server version") from err
        if not isinstance(data, dict):
            raise SmolforgeError("Ollama sent an unexpected answer (not a JSON object)", fix="check the server version")
        return data

    def _token_id(self, entry: dict[str, Any]) -> int | None:
        raw = entry.get("bytes")
        if isinstance(raw, list) and raw and all(isinstance(b, int) and 0 <= b < 256 for b in raw):
            alpha = byte_alphabet()
            spelled = "".join(alpha[b] for b in raw)
            if spelled in self._vocab:
                return self._vocab[spelled]
        text = entry.get("token")
        if isinstance(text, str) and text in self._vocab:
            return self._vocab[text]
        if isinstance(text, str) and text:
            ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
            if len(ids) == 1:
                return ids[0]
        return None

    def _logits(self, logprobs: list[dict[str, Any]], k: int):
        """(response ids, [n, k] top-k log-probs, [n, k] ids, [n] tail) or None when tokens do not map."""
        ids, vals, idxs, tails = [], [], [], []
        for entry in logprobs:
            tid = self._token_id(entry)
            if tid is None:
                return None
            top = entry.get("top_logprobs") or [{"token": entry.get("token"), "bytes": entry.get("bytes"),
                                                  "logprob": entry.get("logprob")}]
            row: dict[int, float] = {}
            for alt in top:
                aid = self._token_id(alt)
                lp = alt.get("logprob")
                if aid is None or not isinstance(lp, (int, float)) or aid in row:
                    continue
                row[aid] = float(lp)
            if not row:
                return None
            pairs = sorted(row.items(), key=lambda kv: -kv[1])[:k]
            mass = sum(math.exp(v) for _, v in pairs)
            # Pad to k with distinct unused ids at -inf: their mass stays in the tail bucket.
            used = {a for a, _ in pairs}
            filler = (i for i in range(self.vocab_size) if i not in used)
            while len(pairs) < k:
                pairs.append((next(filler), -math.inf))
            ids.append(tid)
            vals.append([v for _, v in pairs])
            idxs.append([a for a, _ in pairs])
            tails.append(max(0.0, 1.0 - mass))
        if not ids:
            return None
        return (ids, np.array(vals, dtype=np.float32).clip(-65000.0), np.array(idxs, dtype=np.int64),
                np.array(tails, dtype=np.float32))

    def generate(self, items: list[PromptItem], settings: GenSettings) -> list[TeacherRecord]:
        settings.check()
        if settings.responses == "reference":
            raise SmolforgeError("the ollama backend cannot score given answers (its API returns logprobs of "
                                 "generated tokens only)",
                                 fix="use --teacher-responses generate with ollama, or the hf backend")
        k = min(settings.top_k, MAX_TOP_LOGPROBS)
        want_logits = self.tokenizer is not None
        records = []
        for item in items:
            for sample in range(settings.samples_per_prompt):
                options = {"temperature": settings.temperature, "top_p": settings.top_p,
                           "num_predict": settings.max_new_tokens, "seed": settings.seed + sample}
                payload: dict[str, Any] = {"model": self.name, "messages": prompt_messages(self.tokenizer, item.prompt_messages), "stream": False,
                                           "options": options}
                if want_logits:
                    payload.update(logprobs=True, top_logprobs=k)
                data = self._post("/api/chat", payload)
                message = data.get("message") or {}
                text = message.get("content") if isinstance(message, dict) else None
                if not isinstance(text, str):
                    raise SmolforgeError("Ollama's answer has no message.content", fix="check the server version")
                prompt_ids: list[int] = []
                response_ids: list[int] = []
                rec = TeacherRecord(example_id=item.example_id, prompt_messages=item.prompt_messages, prompt_ids=[],
                                    response_ids=[], response_text=text, answer=item.answer, sample_id=sample)
                if want_logits:
                    prompt_ids = self.tokenizer(render_prompt(self.tokenizer, item.prompt_messages),
                                                add_special_tokens=False)["input_ids"]
                    got = self._logits(data.get("logprobs") or [], k) if isinstance(data.get("logprobs"), list) else None
                    if got is not None:
                        response_ids, vals, idxs, tails = got
                        eos = turn_end_id(self.tokenizer)  # the token a chat answer ends with
                        if data.get("done_reason") == "stop" and eos is not None \
                                and response_ids[-1] not in stop_ids(self.tokenizer):
                            # Ollama does not report the stop token; the student must still learn to stop.
                            response_ids = response_ids + [eos]
                            vals = np.concatenate([vals, np.array([[0.0] + [-65000.0] * (k - 1)], np.float32)])
                            idxs = np.concatenate([idxs, np.array([[eos] + [i for i in range(k) if i != eos][:k - 1]])])
                            tails = np.concatenate([tails, np.zeros(1, np.float32)])
                        rec.topk_logprobs, rec.topk_indices, rec.tail_mass = vals, idxs, tails
                    else:
                        response_ids = self.tokenizer(text, add_special_tokens=False)["input_ids"]
                    rec.prompt_ids, rec.response_ids = prompt_ids, response_ids
                records.append(rec)
        return records
