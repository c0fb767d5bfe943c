"""A teacher behind any OpenAI-compatible endpoint (`--teacher-backend openai --teacher-url URL`): `smolforge
serve`, llama.cpp's `llama-server`, vLLM, LM Studio, Ollama's `/v1`.

What it asks: `POST {url}/completions` (the legacy completions API: the prompt as text, rendered with the
student's chat template, so the endpoint continues exactly what the student will be trained on), with
`max_tokens`, the run's temperature/top_p/seed and `logprobs: k`, for the answer's positions. With
`--teacher-responses reference` it sends the prompt and the reference answer (its end of turn included,
as plain SFT trains on it) with `echo: true`, `max_tokens: 0` and `logprobs: k`, and keeps the echoed
answer's positions (an endpoint that cannot echo
log-probabilities is a clear error: use `generate`).

What it writes: the same store as the other backends (`store.TeacherRecord`), in the student's ids, each
token the endpoint names mapped by `TokenMap`: by the endpoint's own `id` where it sends one (llama-server
does, for each token and alternative) and its vocabulary is the student's (the size it states at GET
/models, llama-server's `meta.n_vocab`, at least the tokenizer's; each id's piece checked against the
bytes or text sent with it; an id past the tokenizer's, a padding row of a model whose vocabulary is
padded, is a candidate dropped to the tail, counted in the manifest's `endpoint.padding_dropped`); else by the token's `bytes` (the chat shape), else by its text (every id's
text as it reads after another token, as an incremental detokenizer makes it; a text two ids share is the
id the tokenizer itself encodes it as). Ids are exact where bytes and text are not: a special token
(llama-server names the end of turn '' with no bytes) and a byte-fallback token `<0x6B>` beside the piece
"k". Where an answer carries ids that are not used (a smaller vocabulary, none stated, or one id whose
piece differs), the run says so once; the manifest says which way it mapped (`endpoint.by_ids`). A
response with any token that does not map, or whose mapped ids do not spell its text, is kept as text
only: students train on it sequence-level (the same fallback as a teacher of another tokenizer), and the
run says so once and counts it in each shard's manifest (`endpoint.text_only`). llama-server sends no
entry for a token whose text ends inside a UTF-8 character, and puts its bytes in front of the next
entry's (`TokenMap.held_back`): such an answer has no rows for those positions and is kept as text too
(`endpoint.held_back` of them); held back at the answer's end (cut by `max_tokens`), they are in its text
only, as U+FFFD: the answer keeps its rows, that unfinished character dropped from its text. A token that is part of a
character (a byte-level token of a multi-byte UTF-8 character) has no text of its own (U+FFFD, or
nothing): its id or bytes name it; where the endpoint sends text only (the legacy shape), such an answer
is text only too. k is what the endpoint gives: rows with fewer alternatives than asked are padded with
-inf (their mass is in the tail); the manifest says the most it gave (`endpoint.k`). Both response shapes
are read; the chat one (`content: [{token, bytes, logprob, top_logprobs: [...]}]`, which llama-server
sends for completions with an `id` in each entry, and `smolforge serve` sends beside the legacy keys)
first, else the legacy one (`tokens`, `top_logprobs` as {text: logprob}).

The key: `$OPENAI_API_KEY`, or the file `--teacher-key-file` names (read on the teacher's node, so the key
travels in no spec, argv or log); none: no Authorization header (a local server). Requests have bounded
timeouts; a 429 or 5xx, a timeout and a dropped connection are retried with exponential backoff (`RETRIES` times),
a 401/403 (the key) and a 404 (URL or model name) are one SmolforgeError with the fix (exit 2).

Ollama's `/v1` (read 2026-11-29 from its source and docs at ollama/ollama fb30760, 2026-08-21): its
documentation (docs.ollama.com/api/openai-compatibility) marks "Logprobs" as not supported on both
`/v1/chat/completions` and `/v1/completions`, and `echo` as not supported. Its code (since v0.12.11,
ollama#12899) passes `/v1/completions`' `logprobs: N` on as `top_logprobs` N but puts no `logprobs` in the
completion it answers (`openai.ToCompletion`), so this teacher keeps every Ollama `/v1` answer as text
(sequence-level KD), said once; only `/v1/chat/completions` answers them, in the chat shape (`token`,
`logprob`, `bytes`, `top_logprobs`, up to 20; no `id`). For logits from Ollama use `--teacher-backend
ollama` (its native API: `distill/ollama.py`).
"""

from __future__ import annotations

import math
import os
import time
from pathlib import Path
from typing import Any

import numpy as np

from smolforge.data.encode import ensure_chat_template
from smolforge.distill.prompts import GenSettings, PromptItem
from smolforge.distill.store import TeacherRecord, tokenizer_hash
from smolforge.errors import SmolforgeError
from smolforge.models.families import turn_end_id
from smolforge.models.loading import load_tokenizer
from smolforge.models.token_bytes import is_byte_piece, vocab_bytes
from smolforge.train.rendering import render_prompt

MAX_TOP_LOGPROBS = 20  # what OpenAI's chat API, vLLM's default and `smolforge serve` allow
RETRIES = 4  # a 429/5xx, a timeout or a dropped connection: tried again after BACKOFF_S x 1, 2, 4, 8
BACKOFF_S = 0.5
TIMEOUT = (10.0, 300.0)  # connect, read (a long answer from a big model on a CPU)
KEY_ENV = "OPENAI_API_KEY"


def token_name(name: Any) -> tuple[Any, Any, Any]:
    """(text, bytes, id) of a token as an endpoint names it: its text alone (the legacy shape), (text, bytes)
    or (text, bytes, id) (the chat shape; llama-server adds each token's own `id`). Absent parts are None."""
    if isinstance(name, tuple):
        return (name + (None, None, None))[:3]
    return name, None, None


def _as_bytes(raw: Any) -> bytes | None:
    """An endpoint's `bytes` list as bytes, or None when it is not a list of byte values."""
    if isinstance(raw, list) and all(isinstance(b, int) and not isinstance(b, bool) and 0 <= b < 256 for b in raw):
        return bytes(raw)
    return None


class TokenMap:
    """An endpoint's token name (its text, its `bytes`, its own `id`) -> the tokenizer's id, exactly.

    By the endpoint's own ids first, where it sends them (llama-server: each candidate's `id`) and its
    vocabulary is this tokenizer's: the size it states (`use_ids`, llama-server's `meta.n_vocab` at GET
    /models: the model's embedding rows) at least `len(tokenizer)`, and each id below `len(tokenizer)`
    checked as it comes (its bytes, else its text, equal to this id's). Ids are exact where bytes and text
    are not: a byte-fallback token `<0x6B>` and the piece "k" are the same bytes, and a special token
    (`<|im_end|>`) is named by no text and no bytes. One id whose piece differs turns ids off for the rest
    of the run (`why_not` says why). An id at or past `len(tokenizer)` but below the stated size is a
    padding row (Qwen2.5: 151,936 rows, 151,665 tokens; the tokenizer is the one answer to how many real
    tokens there are, as the GGUF export writes the rows past it as unused `[PAD<i>]`): it names no token,
    so that candidate maps to None (its mass goes to the tail) and ids stay on; `padding` counts them.

    Else by bytes, where the endpoint sends each token's `bytes` (the chat shape: llama-server, Ollama,
    `smolforge serve`; `models.token_bytes.vocab_bytes`, the tokenizer's one answer): a byte of a
    multi-byte character, whose text is only U+FFFD or nothing, still names its id; bytes two ids share
    ("k" and <0x6B>) name the piece, as the tokenizer makes it.

    Else by text: each id's text is what it adds after an ordinary token (`decode([a, id])` minus
    `decode([a])`), which is how an incremental detokenizer (vLLM's, `smolforge serve`'s) names a token
    mid-text: a SentencePiece token's leading space kept, a byte-level token's bytes decoded. A text
    several ids share maps to the id the tokenizer encodes it as, if one."""

    def __init__(self, tokenizer: Any):
        self.tokenizer = tokenizer
        anchor = (tokenizer.encode("a", add_special_tokens=False) or [0])[-1]
        head = tokenizer.decode([anchor])
        texts = tokenizer.batch_decode([[anchor, i] for i in range(len(tokenizer))])
        self.texts = [full[len(head):] if full.startswith(head) else full for full in texts]
        self.ids: dict[str, list[int]] = {}
        for i, text in enumerate(self.texts):
            self.ids.setdefault(text, []).append(i)
        self.raw = vocab_bytes(tokenizer)
        # the tokenizer's special tokens, the added ones marked special included (`<|im_start|>` is one, though
        # not in `all_special_ids`): a GGUF holds them as CONTROL tokens, which llama-server names '' with no bytes
        decoder = getattr(tokenizer, "added_tokens_decoder", {}) or {}
        self.special = {int(i) for i, t in decoder.items() if getattr(t, "special", False)}
        self.special |= set(getattr(tokenizer, "all_special_ids", []) or [])
        self.by_bytes: dict[bytes, list[int]] = {}
        pieces = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
        for i, raw in enumerate(self.raw):
            if raw:
                self.by_bytes.setdefault(raw, []).append(i)
        for raw, ids in self.by_bytes.items():  # "k" and <0x6B>: the tokenizer makes the piece
            if len(ids) > 1:
                self.by_bytes[raw] = [i for i in ids if not is_byte_piece(pieces[i])] or ids
        self.by_id = False  # the endpoint's own ids are used (`use_ids`)
        self.why_not = "the endpoint's vocabulary was not checked"  # why they are not, while not
        self.saw_id = False  # some name carried an id
        self.n_vocab: int | None = None  # the size the endpoint states (`use_ids`), None: none stated
        self.padding = 0  # candidates named by a padding row's id, dropped (their mass is tail mass)

    def use_ids(self, n_vocab: Any) -> bool:
        """Map by the endpoint's own ids from now on iff `n_vocab` (the vocabulary size the endpoint states;
        None: it states none) is at least `len(tokenizer)`: the rows past it are padding (`is_padding`);
        each id's piece is still checked as it comes. Sets `why_not` when not."""
        n = len(self.tokenizer)
        stated = isinstance(n_vocab, int) and not isinstance(n_vocab, bool)
        self.n_vocab = n_vocab if stated else None
        if not stated:
            self.why_not = "the endpoint states no vocabulary size (GET /models: meta.n_vocab)"
        elif n_vocab < n:
            self.why_not = f"the endpoint's vocabulary has {n_vocab} tokens, fewer than the student's tokenizer's {n}"
        self.by_id = stated and n_vocab >= n
        return self.by_id

    def is_padding(self, tid: int) -> bool:
        """Whether id `tid` is one of the rows the endpoint's model has past this tokenizer's tokens (below
        the size it states): a padding row, which names no token."""
        return self.n_vocab is not None and len(self.texts) <= tid < self.n_vocab

    def same_piece(self, tid: int, text: Any, raw: Any) -> bool:
        """Whether id `tid` is, in this tokenizer, the piece the endpoint names by `text` and `raw` (bytes):
        the bytes equal where both sides know them; a special token (no bytes here, or an added token marked
        special: `<|im_start|>`) named by no bytes and no text or its own text; else the texts equal."""
        if not (isinstance(tid, int) and 0 <= tid < len(self.texts)):
            return False
        got, ours = _as_bytes(raw), self.raw[tid]
        if got and ours is not None:
            return got == ours
        if got == b"" and (ours is None or tid in self.special):
            return text in ("", None, self.texts[tid])
        return text == self.texts[tid]

    def held_back(self, name: Any) -> bool:
        """Whether `name` (text, bytes, id) is an entry that carries the bytes of tokens before it as well as
        its own: its bytes longer than id's own piece and ending with them. llama-server holds back a token
        whose text ends inside a UTF-8 character (a byte-level token of a multi-byte character), sends no
        entry for it, and puts its bytes in front of the next entry's (tools/server `process_token`, llama.cpp
        b6xxx-b7xxx): those positions' log-probabilities are not sent at all."""
        _text, raw, tid = token_name(name)
        got = _as_bytes(raw)
        ours = self.raw[tid] if isinstance(tid, int) and 0 <= tid < len(self.raw) else None
        return bool(got and ours and len(got) > len(ours) and got.endswith(ours))

    def __call__(self, name: Any) -> int | None:
        """The id `name` names, or None (no id, or several and the tokenizer picks none of them). `name`:
        the token's text, (text, bytes), or (text, bytes, id) (`token_name`)."""
        text, raw, tid = token_name(name)
        if isinstance(tid, int) and not isinstance(tid, bool):
            self.saw_id = True
            if self.held_back(name):  # tokens before it have no entries: the answer cannot keep its rows
                return None
            if self.by_id:
                if self.same_piece(tid, text, raw):
                    return tid
                if self.is_padding(tid):  # no token's: dropped, as an unmappable candidate; ids stay on
                    self.padding += 1
                    return None
                ours = self.texts[tid] if 0 <= tid < len(self.texts) else "no such id"
                self.by_id = False
                self.why_not = f"the endpoint's id {tid} is {text!r} {raw}, the student's tokenizer's {ours!r}"
        found = self.by_bytes.get(_as_bytes(raw) or b"")
        if found and len(found) == 1:
            return found[0]
        if not isinstance(text, str):
            return None
        found = self.ids.get(text)
        if found and len(found) == 1:
            return found[0]
        encoded = self.tokenizer.encode(text, add_special_tokens=False) if text else []
        return encoded[0] if len(encoded) == 1 and (not found or encoded[0] in found) else None


def read_key(key_file: str | None) -> str | None:
    """The API key: the file's first line, else $OPENAI_API_KEY, else None. Never logged."""
    if key_file:
        path = Path(key_file).expanduser()
        try:
            key = path.read_text(encoding="utf-8").strip()
        except OSError as err:
            raise SmolforgeError(f"cannot read the key file {key_file}: {err.strerror}", where="--teacher-key-file",
                                 fix="give a readable file holding the endpoint's API key (on the teacher's node)",
                                 field=("teacher_key_file",)) from None
        if not key:
            raise SmolforgeError(f"the key file {key_file} is empty", where="--teacher-key-file",
                                 fix="write the API key into it, or drop --teacher-key-file", field=("teacher_key_file",))
        return key
    return os.environ.get(KEY_ENV) or None


def positions(logprobs: Any) -> list[tuple[Any, list[tuple[Any, float]]]] | None:
    """(token name, [(alternative's name, logprob), ...]) per position, from either response shape (a
    name: the text in the legacy shape, (text, bytes, id) in the chat one: `token_name`); None when the
    answer carries no log-probabilities."""
    if not isinstance(logprobs, dict):
        return None
    content = logprobs.get("content")
    if isinstance(content, list):  # the chat shape (llama-server's completions too): tokens with their bytes
        return [((e.get("token"), e.get("bytes"), e.get("id")),
                 [((a.get("token"), a.get("bytes"), a.get("id")), a.get("logprob")) for a in e.get("top_logprobs")
                  or [] if isinstance(a, dict)] or [((e.get("token"), e.get("bytes"), e.get("id")), e.get("logprob"))])
                for e in content if isinstance(e, dict)]
    tokens, tops = logprobs.get("tokens"), logprobs.get("top_logprobs")
    if not isinstance(tokens, list) or not isinstance(tops, list) or len(tokens) != len(tops):
        return None
    return [(t, list(top.items()) if isinstance(top, dict) else []) for t, top in zip(tokens, tops)]


def refuse_status(resp: Any, where: str, url: str) -> None:
    """Nothing for a 200; else one SmolforgeError (exit 2) with the fix: 401/403 the key, 404 the URL or
    model, anything else the endpoint's own words. Its `fields` (DistillSettings' keys, a spec's line:
    `config.placed`): the key's file, then the URL; the URL, then the teacher; the URL."""
    status, said = resp.status_code, resp.text[:200]
    if status in (401, 403):
        raise SmolforgeError(f"the teacher endpoint refused the key ({status}): {said}", where="--teacher-url",
                             fix=f"set ${KEY_ENV} or --teacher-key-file to a key the endpoint accepts",
                             fields=(("teacher_key_file",), ("teacher_url",)))
    if status == 404:
        raise SmolforgeError(f"the teacher endpoint answered 404 at {where}: {said}", where="--teacher-url",
                             fix=f"give the base URL ending in /v1, and --teacher as the model name it serves "
                                 f"(GET {url}/models lists them)", fields=(("teacher_url",), ("teacher",)))
    if status != 200:
        raise SmolforgeError(f"the teacher endpoint answered {status}: {said}", where="--teacher-url",
                             fix="check the endpoint's log; --top-k above what it allows (often 20, OpenAI 5) "
                                 "is a common cause", field=("teacher_url",))


def probe(url: str, model: str, key_file: str | None) -> None:
    """At submit, before anything starts: the endpoint answers `GET {url}/models` with this key, and serves
    `model` where it lists its models. A SmolforgeError (exit 2) for an unreachable URL, a refused key, or a
    model it does not list, naming the settings it is about (DistillSettings' teacher_url, teacher_key_file,
    teacher: its `fields`). Asked from the submitting machine (the teachers ask from their nodes)."""
    import httpx

    key = read_key(key_file)
    where = f"{url.rstrip('/')}/models"
    try:
        resp = httpx.get(where, headers={"Authorization": f"Bearer {key}"} if key else {},
                         timeout=httpx.Timeout(30.0, connect=TIMEOUT[0]))
    except httpx.HTTPError as err:
        raise SmolforgeError(f"cannot reach the teacher endpoint {where}: {type(err).__name__}", where="--teacher-url",
                             fix="check the URL (the base ending in /v1) and that the server is running",
                             field=("teacher_url",)) from None
    refuse_status(resp, where, url.rstrip("/"))
    try:
        served = [m.get("id") for m in resp.json().get("data") or [] if isinstance(m, dict)]
    except (ValueError, AttributeError):
        served = []
    if served and model not in served:
        raise SmolforgeError(f"the teacher endpoint does not serve {model!r} (it serves {', '.join(map(str, served[:8]))})",
                             where="--teacher", fix="give --teacher as one of the names it serves",
                             fields=(("teacher",), ("teacher_url",)))


class OpenAITeacher:
    """A model behind an OpenAI-compatible endpoint; `model` is the name the endpoint serves it under.
    `tokenizer`: the HF tokenizer whose ids the store uses (the student's)."""

    backend = "openai"
    probe = staticmethod(probe)  # the submit's check (`backends.OpenAIBackend.check`), asked of the class

    def __init__(self, model: str, *, url: str | None, tokenizer: str | None, key_file: str | None = None,
                 say: Any = print):
        if not url:
            raise SmolforgeError("--teacher-backend openai needs the endpoint's URL", where="--teacher-url",
                                 fix="add --teacher-url http://HOST:PORT/v1 (the base URL the OpenAI client takes)")
        if tokenizer is None:
            raise SmolforgeError(f"the endpoint teacher ({model}) needs the tokenizer whose ids the store uses",
                                 fix="name the student (smolforge distill passes the first --student)")
        self.name, self.url, self.say = model, url.rstrip("/"), say
        self._key = read_key(key_file)
        self.tokenizer = load_tokenizer(tokenizer)
        ensure_chat_template(self.tokenizer)
        self.vocab_size, self.tok_hash = len(self.tokenizer), tokenizer_hash(self.tokenizer)
        self.map = TokenMap(self.tokenizer)
        self.given_k = 0
        self.text_only = 0
        self.held_back = 0  # of them, answers with an entry holding earlier tokens' bytes (`TokenMap.held_back`)
        self._ids_checked = self._said_ids = self._said_padding = False
        self.manifest_extra: dict[str, Any] = {}

    # ---------------------------------------------------------------- HTTP
    def _stated_vocab(self) -> int | None:
        """The vocabulary size the endpoint states for this model at GET /models (llama-server:
        `data[i].meta.n_vocab`), or None: it states none, or the request fails (the completions that follow
        say why, if it matters)."""
        import httpx

        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        try:
            resp = httpx.get(f"{self.url}/models", headers=headers, timeout=httpx.Timeout(30.0, connect=TIMEOUT[0]))
            listed = resp.json().get("data") if resp.status_code == 200 else None
        except (httpx.HTTPError, ValueError, AttributeError):
            listed = None
        models = [m for m in listed if isinstance(m, dict)] if isinstance(listed, list) else []
        mine = [m for m in models if m.get("id") == self.name] or (models if len(models) == 1 else [])
        meta = mine[0].get("meta") if mine else None
        return meta.get("n_vocab") if isinstance(meta, dict) else None

    def _post(self, payload: dict[str, Any]) -> dict[str, Any]:
        """POST /completions; retried on 429/5xx, timeouts and dropped connections (not a refused one: nothing
        listens there); SmolforgeError for the rest."""
        import httpx

        headers = {"Authorization": f"Bearer {self._key}"} if self._key else {}
        where = f"{self.url}/completions"
        for attempt in range(RETRIES + 1):
            try:
                resp = httpx.post(where, json=payload, headers=headers, timeout=httpx.Timeout(TIMEOUT[1], connect=TIMEOUT[0]))
            except httpx.HTTPError as err:  # refused at once: nothing listens there, no point waiting
                if attempt < RETRIES and not isinstance(err, httpx.ConnectError):
                    time.sleep(BACKOFF_S * 2 ** attempt)
                    continue
                raise SmolforgeError(f"cannot reach the teacher endpoint {where}: {type(err).__name__}",
                                     where="--teacher-url", fix="check the URL (it ends in /v1) and that the "
                                     "server is running and reachable from the teacher's node") from None
            if resp.status_code == 429 or resp.status_code >= 500:
                if attempt < RETRIES:
                    time.sleep(BACKOFF_S * 2 ** attempt)
                    continue
            return self._answer(resp, where)
        raise AssertionError("unreachable")

    def _answer(self, resp: Any, where: str) -> dict[str, Any]:
        """The JSON object of a 200; one SmolforgeError naming the fix for anything else."""
        refuse_status(resp, where, self.url)
        try:
            data = resp.json()
            return data["choices"][0] | {"_usage": data.get("usage")}
        except (ValueError, KeyError, IndexError, TypeError):
            raise SmolforgeError(f"the teacher endpoint sent no completion: {resp.text[:200]!r}", where="--teacher-url",
                                 fix="check that the URL is an OpenAI-compatible /v1 base") from None

    # ---------------------------------------------------------------- rows
    def _rows(self, pos: list[tuple[Any, list[tuple[Any, float]]]], k: int) -> tuple[Any, Any]:
        """(ids, [n, k] log-probs, [n, k] ids, [n] tail mass) in the student's ids, or (None, bad text) when a
        token does not map."""
        ids, vals, idxs, tails = [], [], [], []
        for text, alts in pos:
            tid = self.map(text)
            if tid is None:
                return None, text
            row: dict[int, float] = {}
            # the k most likely as the endpoint named them (OpenAI's legacy shape adds the chosen token when
            # it is not among them: not a top-k entry), then mapped; a text no id names drops to the tail
            for alt, lp in sorted(((a, lp) for a, lp in alts if isinstance(lp, (int, float))), key=lambda a: -a[1])[:k]:
                aid = self.map(alt)
                if aid is not None and aid not in row:
                    row[aid] = float(lp)
            pairs = sorted(row.items(), key=lambda kv: -kv[1])
            self.given_k = max(self.given_k, len(pairs))
            mass = sum(math.exp(v) for _, v in pairs)
            used = {a for a, _ in pairs}
            filler = (i for i in range(self.vocab_size) if i not in used)  # distinct ids at -inf: tail mass
            pairs += [(next(filler), -math.inf) for _ in range(k - len(pairs))]
            ids.append(tid)
            vals.append([v for _, v in pairs])
            idxs.append([a for a, _ in pairs])
            tails.append(max(0.0, 1.0 - mass))
        return (ids, np.array(vals, np.float32).reshape(len(ids), k).clip(-65000.0),
                np.array(idxs, np.int64).reshape(len(ids), k), np.array(tails, np.float32)), None

    def _mapped(self, pos: list[tuple[Any, list[tuple[Any, float]]]] | None, k: int) -> tuple[Any, Any]:
        """`_rows` of an answer. An answer whose tokens carry ids that are not used (the vocabulary differs, or
        one id's piece did, mid-answer: mapped again) is mapped by bytes/text, said once."""
        if not pos:
            return None, None
        was, padding = self.map.by_id, self.map.padding
        got = self._rows(pos, k)
        if was and not self.map.by_id:
            self.map.padding = padding  # the answer's padding candidates were not dropped as such after all
            got = self._rows(pos, k)
        if self.map.saw_id and not self.map.by_id and not self._said_ids:
            self._said_ids = True
            self.say(f"teacher {self.name}: not mapped by the endpoint's token ids ({self.map.why_not}): "
                     "by their bytes and text instead")
        return got

    def _keep(self, rec: TeacherRecord, pos: list[tuple[Any, list[tuple[Any, float]]]] | None, k: int, text: str,
              expect: list[int] | None = None) -> None:
        """Put the answer's rows on `rec`, or keep it as text only (saying so the first time). `expect`: the
        ids the rows must be (a scored reference answer's); else the ids must spell `text`."""
        got, bad = self._mapped(pos, k)
        if got is not None and expect is not None and got[0] != expect:
            got, bad = None, f"ids {got[0][:6]}..., not the reference's {expect[:6]}..."
        spelled = self.tokenizer.decode(got[0], skip_special_tokens=True) if got is not None else text
        if expect is None and spelled != text and text.startswith(spelled) and not text[len(spelled):].strip("\ufffd"):
            rec.response_text = text = spelled  # the end held back inside a character (`TokenMap.held_back`): no
            # entries, its bytes in the text only (U+FFFD); an answer cut there keeps its rows, not that piece
        if expect is None and spelled != text:
            got, bad = None, f"ids that spell {spelled[:40]!r}, not the answer's text"
        if got is None:
            held = bad is not None and self.map.held_back(bad)
            if held:
                why = (f"the endpoint sent token {token_name(bad)[2]} with the bytes of tokens before it (held "
                       "back inside a UTF-8 character, as llama-server does) and no log-probabilities for those")
            else:
                why = f"token {bad!r} names no single token of the student's tokenizer" if bad is not None \
                    else "the endpoint sent no log-probabilities"
            if (self.held_back == 0) if held else (self.text_only == self.held_back):  # once for each reason
                self.say(f"teacher {self.name}: {why}: such answers train the student on their text "
                         "(sequence-level KD), not on logits")
            self.held_back += held
            self.text_only += 1
            rec.response_ids = expect if expect is not None else self.tokenizer(text, add_special_tokens=False)["input_ids"]
            return
        rec.response_ids, rec.topk_logprobs, rec.topk_indices, rec.tail_mass = got

    def _named_stop(self, pos: list | None, choice: dict[str, Any]) -> list | None:
        """An answer that stopped on a special token some endpoints name by no text (llama-server: '', no
        bytes): that last token is the end of turn the student must learn (`families.turn_end_id`)."""
        def empty(name: Any) -> bool:
            text, raw, tid = token_name(name)
            return text == "" and not raw and tid is None  # an id names it (`TokenMap`)

        end = turn_end_id(self.tokenizer)
        if not pos or choice.get("finish_reason") != "stop" or end is None or not empty(pos[-1][0]):
            return pos
        named = self.tokenizer.decode([end])
        return [*pos[:-1], (named, [(named if empty(a) else a, lp) for a, lp in pos[-1][1]])]

    def generate(self, items: list[PromptItem], settings: GenSettings) -> list[TeacherRecord]:
        """One completion per prompt and sample, in the order of `items` (samples adjacent)."""
        settings.check()
        k = min(settings.top_k, MAX_TOP_LOGPROBS, self.vocab_size)
        if not self._ids_checked:
            self._ids_checked = True
            self.map.use_ids(self._stated_vocab())
        records = []
        for item in items:
            prompt = render_prompt(self.tokenizer, item.prompt_messages)
            prompt_ids = self.tokenizer(prompt, add_special_tokens=False)["input_ids"]
            for sample in range(settings.samples_per_prompt):
                rec = TeacherRecord(example_id=item.example_id, prompt_messages=item.prompt_messages,
                                    prompt_ids=prompt_ids, response_ids=[], response_text="", answer=item.answer,
                                    sample_id=sample)
                if settings.responses == "reference":
                    self._score(rec, item, k)
                else:
                    choice = self._post({"model": self.name, "prompt": prompt, "max_tokens": settings.max_new_tokens,
                                         "temperature": settings.temperature, "top_p": settings.top_p,
                                         "seed": settings.seed + sample, "logprobs": k})
                    text = choice.get("text") if isinstance(choice.get("text"), str) else ""
                    rec.response_text = text
                    self._keep(rec, self._named_stop(positions(choice.get("logprobs")), choice), k, text)
                records.append(rec)
        self._say_padding()
        self.manifest_extra = {"endpoint": {"url": self.url, "k": self.given_k, "k_asked": k,
                                            "text_only": self.text_only, "held_back": self.held_back, "by_ids": self.map.by_id,
                                            "n_vocab": self.map.n_vocab, "padding_dropped": self.map.padding}}
        return records

    def _say_padding(self) -> None:
        """Once, when a candidate named a padding row (`TokenMap.is_padding`): what was done with it."""
        if self.map.padding and not self._said_padding:
            self._said_padding = True
            self.say(f"teacher {self.name}: the endpoint's model has {self.map.n_vocab} vocabulary rows, the "
                     f"student's tokenizer {self.vocab_size} tokens: candidates named by a row past the tokenizer "
                     "(padding) are dropped, their probability counted as tail mass (the count: the store "
                     "manifest's endpoint.padding_dropped)")

    def _score(self, rec: TeacherRecord, item: PromptItem, k: int) -> None:
        """The reference answer's positions (`teacher.reference_ids`: the ids plain SFT trains on, its end of
        turn included), echoed (`echo`, `max_tokens` 0): those whose text starts at or after the prompt's end."""
        from smolforge.distill.teacher import reference_ids

        prompt_ids, response_ids = reference_ids(self.tokenizer, item)
        prompt = self.tokenizer.decode(prompt_ids)
        choice = self._post({"model": self.name, "prompt": self.tokenizer.decode(prompt_ids + response_ids),
                             "max_tokens": 0, "echo": True, "logprobs": k, "temperature": 0})
        pos = positions(choice.get("logprobs"))
        if not pos:
            raise SmolforgeError(f"the endpoint did not echo the prompt's log-probabilities ({self.url})",
                                 where="--teacher-responses",
                                 fix="use --teacher-responses generate with this endpoint")
        start, at = len(pos), 0
        for i, (name, _) in enumerate(pos):
            if at >= len(prompt):
                start = i
                break
            text = token_name(name)[0]
            at += len(text) if isinstance(text, str) else 0
        rec.prompt_ids, rec.response_text = prompt_ids, self.tokenizer.decode(response_ids, skip_special_tokens=True)
        self._keep(rec, pos[start:], k, rec.response_text, expect=response_ids)
