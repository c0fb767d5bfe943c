"""Teacher generation in llama.cpp (llama-cpp-python): a GGUF teacher on CPU kernels, quantized.

On a CPU, transformers' fp32 `generate` is the distillation's bottleneck; llama.cpp runs the same
model faster (issue 32 measured the library alone at 4.2x/5.5x at f16/q8_0; this backend at q8_0, store
writing included, 4.3-4.8x the hf teacher's best at 0.5B on two threads: BENCHMARKS.md, teacher
backends), with q8_0's weights about a quarter of fp32's. This backend writes the same records as `HFTeacher`, so the store, its shards and manifests, and every
student are unchanged:
- the model is a GGUF the user gives (`--teacher path/model.gguf`, an Ollama blob) or the HF
  teacher exported once per node and cached (`models.export.cache`, `--teacher-quant`);
- prompts are rendered and tokenized by an HF tokenizer (the HF teacher's own, or for a given
  GGUF the student's), so the ids are exactly what the `hf` backend writes. Before the first
  prompt the GGUF's vocabulary is compared with that tokenizer's, token string by token string:
  when they differ the GGUF's logits cannot train the student, and the run is refused: by `smolforge
  distill` before anything starts (a local GGUF, exit 2) and by the teacher before its first shard.
  (The `hf` backend's teacher of another tokenizer trains students on its text, sequence-level KD;
  a GGUF's text alone is no reason to run llama.cpp's logits, so there is no such fallback here);
- decoding runs up to `teacher_batch_size` sequences together in one llama.cpp context
  (`llamacpp_batch`: one pass over the weights per step for the group, which is what a CPU's decode
  is bound by), each with its KV cells, the prompts' shared prefix read once; after each pass the
  group's rows are one [n, V] view of llama.cpp's buffer, whose top-k, tail mass and truncation KL
  (`teacher_topk.topk_rows`, the same fp32 code as the HF teacher's) are taken at once and only
  those kept (not every row's V logits until the group ends: 2.5 GB for 16 x 256 tokens at V 152k),
  and each row gives its sequence's next token (greedy, or the run's temperature/top-p with its own
  seeded generator). With a batch of 1 it decodes one sequence at a time in `Llama`'s own context;
- `n_threads` is the task's CPUs, so parallel teacher tasks on a node do not oversubscribe it;
- each shard's manifest says so (`threads`) and names the GGUF (`gguf`: file, quantization and, for
  our own export, its check against the HF fp32 model: logits NMSE and greedy agreement).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from smolforge.data.encode import ensure_chat_template
from smolforge.train.rendering import render_prompt
from smolforge.distill.llamacpp_batch import BatchDecoder
from smolforge.distill.prompts import GenSettings, PromptItem
from smolforge.distill.store import TeacherRecord, tokenizer_hash
from smolforge.distill.teacher_topk import topk_rows
from smolforge.errors import SmolforgeError
from smolforge.models.export.cache import cached_gguf, check_quant, is_gguf
from smolforge.models.families import stop_ids
from smolforge.models.loading import load_tokenizer

INSTALL_FIX = "pip install 'smolforge[export]' (it builds llama.cpp, minutes), or use --teacher-backend hf"


# the export's checks a shard's manifest carries: logits NMSE, greedy agreement, and KL(HF fp32 || the GGUF)
# per position over the verified positions, what the quantization costs the teacher's distribution
VERIFY_KEYS = ("logits_nmse", "greedy_agreement", "prompts", "kl_vs_fp32", "kl_positions")

def gguf_tokens(llm) -> list[str]:
    """The GGUF's vocabulary, token strings by id, as llama.cpp holds it."""
    import llama_cpp

    vocab = llama_cpp.llama_model_get_vocab(llm.model)
    return [llama_cpp.llama_vocab_get_text(vocab, i).decode("utf-8", errors="replace") for i in range(llm.n_vocab())]


@dataclass
class GGUFVocab:
    """What decides whether a GGUF's ids are a tokenizer's: its token strings, which of them are unused
    padding rows, and its end-of-sequence id."""

    tokens: list[str]
    unused: set[int]
    eos: int | None

    @classmethod
    def of_llama(cls, llm) -> GGUFVocab:
        """As llama.cpp loaded it (the teacher's own model)."""
        import llama_cpp

        vocab = llama_cpp.llama_model_get_vocab(llm.model)
        tokens = gguf_tokens(llm)
        unused = {i for i in range(len(tokens)) if llama_cpp.llama_vocab_get_attr(vocab, i) & llama_cpp.LLAMA_TOKEN_ATTR_UNUSED}
        return cls(tokens, unused, int(llm.token_eos()))

    @classmethod
    def of_file(cls, path: str | Path) -> GGUFVocab:
        """From the file's metadata alone, without loading the model (the CLI's check: quick and silent)."""
        from gguf import GGUFReader, TokenType

        reader = GGUFReader(str(path))
        tokens = [str(t) for t in reader.get_field("tokenizer.ggml.tokens").contents()]
        kinds = reader.get_field("tokenizer.ggml.token_type")
        unused = {i for i, k in enumerate(kinds.contents() if kinds else []) if k == TokenType.UNUSED}
        eos = reader.get_field("tokenizer.ggml.eos_token_id")
        return cls(tokens, unused, int(eos.contents()) if eos else None)


def stops_of(tokenizer_name: str, tokenizer) -> frozenset[int]:
    """`families.stop_ids` for the HF model `tokenizer_name` names: its generation config read from its
    directory (no weights loaded); the tokenizer's own answer when the model has no local directory."""
    from smolforge.models.export.run import model_dir

    try:
        source = model_dir(tokenizer_name)
    except SmolforgeError:
        source = None
    return stop_ids(tokenizer, source)


def vocab_mismatch(gguf: GGUFVocab, tokenizer, stops: frozenset[int] | None = None) -> str | None:
    """Why the GGUF's ids are not `tokenizer`'s (None: they are): every token string of the tokenizer
    at its id, no real token past the tokenizer's last id (only the unused rows a vocabulary is padded
    with), and an end-of-sequence token that ends a generation for the tokenizer's model (one of `stops`,
    the model's stop set; default: `families.stop_ids(tokenizer)`): the conditions under which the store's
    tokenizer hash may be the tokenizer's."""
    tokens = gguf.tokens
    want = tokenizer.convert_ids_to_tokens(list(range(len(tokenizer))))
    if len(tokens) < len(want):
        return f"the GGUF has {len(tokens)} tokens, the tokenizer {len(want)}"
    for i, (got, exp) in enumerate(zip(tokens, want)):
        if exp is not None and got != exp:
            return f"token {i} is {got!r} in the GGUF but {exp!r} in the tokenizer"
    extra = [i for i in range(len(want), len(tokens)) if i not in gguf.unused]
    if extra:
        return (f"the GGUF has {len(extra)} tokens past the tokenizer's {len(want)} (id {extra[0]}: "
                f"{tokens[extra[0]]!r})")
    stops = stop_ids(tokenizer) if stops is None else stops
    if tokenizer.eos_token_id is not None and gguf.eos not in stops:
        return (f"end-of-sequence id {gguf.eos} in the GGUF, which does not end a generation for the tokenizer "
                f"(its stop ids: {sorted(stops)})")
    return None


MISMATCH_FIX = ("give a GGUF of a model with the student's tokenizer (`smolforge export --to gguf` makes one), or "
               "name the HF teacher with --teacher-backend hf (a teacher with another tokenizer then trains the "
               "student on its text: sequence-level KD)")


def mismatch_message(gguf: str, tokenizer: str, why: str) -> str:
    return (f"teacher GGUF {gguf} has another vocabulary than the student's tokenizer {tokenizer} ({why}): its "
            "logits cannot train that student")


def check_gguf_vocab(path: str | Path, tokenizer_name: str) -> None:
    """Refuse, before anything runs, a given GGUF whose vocabulary is not the student's tokenizer's (the
    CLI's check, from the file's metadata; the teacher checks again where it runs, before its first shard)."""
    tokenizer = load_tokenizer(tokenizer_name)
    why = vocab_mismatch(GGUFVocab.of_file(path), tokenizer, stops_of(tokenizer_name, tokenizer))
    if why is not None:
        raise SmolforgeError(mismatch_message(Path(path).name, tokenizer_name, why), where="--teacher", fix=MISMATCH_FIX)


def trained_context(path: Path) -> int | None:
    """The model's own context length from the GGUF's metadata (None when it does not say): a larger
    llama.cpp context only costs KV-cache memory (and llama.cpp warns about it)."""
    try:
        from gguf import GGUFReader

        reader = GGUFReader(str(path))
        arch = reader.get_field("general.architecture").contents()
        return int(reader.get_field(f"{arch}.context_length").contents())
    except Exception:  # an unreadable key is llama.cpp's to report when it loads the file
        return None


def gguf_summary(path: Path, quant: str | None) -> dict:
    """What each shard's manifest says of the GGUF: its file and quantization and, for our own export,
    the export's check against the HF fp32 model (logits NMSE, greedy agreement): what the
    quantization cost, measured once per node."""
    out: dict = {"file": path.name, "bytes": path.stat().st_size, "quant": quant or "given"}
    summary = path.parent / "export.json"
    if quant is not None and summary.is_file():
        import json

        report = json.loads(summary.read_text(encoding="utf-8"))
        verify = report.get("verify") or {}
        out.update(quantizer=report.get("quantizer", "smolforge"),
                   verify={k: verify[k] for k in VERIFY_KEYS if k in verify} or None)
    return out


def require_llama_cpp() -> None:
    """Before any export: without llama-cpp-python there is nothing to run the GGUF in."""
    try:
        import llama_cpp  # noqa: F401
    except ImportError as err:
        raise SmolforgeError("--teacher-backend llamacpp needs llama-cpp-python, which is not installed",
                             fix=INSTALL_FIX) from err


def load_gguf(path: Path, n_threads: int, n_ctx: int):
    require_llama_cpp()
    from llama_cpp import Llama

    n_ctx = min(n_ctx, trained_context(path) or n_ctx)
    try:
        return Llama(model_path=str(path), n_ctx=n_ctx, n_batch=min(512, n_ctx), logits_all=False, verbose=False,
                     n_gpu_layers=0, n_threads=n_threads, n_threads_batch=n_threads)
    except (ValueError, RuntimeError) as err:
        raise SmolforgeError(f"llama.cpp cannot load {path}: {err}",
                             fix="pass a GGUF file llama.cpp reads (e.g. from `smolforge export --to gguf`)") from err


class LlamaCppTeacher:
    """A GGUF teacher in llama.cpp. Loaded once per process, reused for every shard."""

    backend = "llamacpp"

    def __init__(self, model: str, *, tokenizer: str | None = None, quant: str = "q8_0", n_threads: int = 1,
                 n_ctx: int = 2048, say=lambda line: None):
        """`model`: a GGUF file, or an HF model (id, directory, preset) exported once per node at
        `quant`. `tokenizer`: for a GGUF file, the HF tokenizer whose ids the store uses (the student's);
        an HF model's export keeps the model's own (a student with another one falls back as with `hf`)."""
        check_quant(quant)
        require_llama_cpp()
        self.name, self.quant, self.n_threads = model, quant, max(1, int(n_threads))
        gguf_file = is_gguf(model)
        if gguf_file:
            path = Path(model).expanduser()
            if not path.is_file():
                raise SmolforgeError(f"GGUF file {model} does not exist", where="--teacher",
                                     fix="give the path of a .gguf file on the teacher's node")
            if tokenizer is None:
                raise SmolforgeError(f"a GGUF teacher ({model}) needs the HF tokenizer whose ids the store uses",
                                     fix="name the student's tokenizer (smolforge distill passes the first --student)")
        else:
            path = cached_gguf(model, quant, threads=self.n_threads, say=say)
        self.gguf_path = path
        self.manifest_extra = {"threads": self.n_threads, "gguf": gguf_summary(path, None if gguf_file else quant)}
        self.tokenizer_name = tokenizer if gguf_file else model
        self.tokenizer = load_tokenizer(self.tokenizer_name)
        ensure_chat_template(self.tokenizer)
        self.llm = load_gguf(path, self.n_threads, n_ctx)
        self.vocab_size = int(self.llm.n_vocab())
        self.stops = stops_of(self.tokenizer_name, self.tokenizer)  # every token that ends a response
        why = vocab_mismatch(GGUFVocab.of_llama(self.llm), self.tokenizer, self.stops)  # before the first shard
        if why is not None:
            self.close()
            raise SmolforgeError(mismatch_message(path.name, self.tokenizer_name, why), where="--teacher",
                                 fix=MISMATCH_FIX)
        self.tok_hash = tokenizer_hash(self.tokenizer)

    def prompt_ids(self, item: PromptItem) -> list[int]:
        """The `hf` backend's ids for the prompt (the GGUF's vocabulary is the tokenizer's: checked)."""
        text = render_prompt(self.tokenizer, item.prompt_messages)
        return self.tokenizer(text, add_special_tokens=False)["input_ids"]

    def decode(self, ids: list[int]) -> str:
        return self.tokenizer.decode(ids, skip_special_tokens=True)

    def generate(self, items: list[PromptItem], settings: GenSettings) -> list[TeacherRecord]:
        """Answer every prompt; records come back in the order of `items` (samples adjacent)."""
        settings.check()
        if settings.responses == "reference":
            raise SmolforgeError("the llamacpp backend does not score given answers",
                                 fix="use --teacher-responses generate with llamacpp, or the hf backend")
        prompts = [(item, self._fitting_ids(item, settings)) for item in items]
        if settings.batch_size > 1 and len(prompts) * settings.samples_per_prompt > 1:
            return self._generate_batched(prompts, settings)
        out = []
        for item, ids in prompts:
            self.llm.reset()
            self.llm.eval(ids)
            first = self._last_logits()
            for sample in range(settings.samples_per_prompt):
                rng = np.random.default_rng([settings.seed, item.example_id, sample])
                out.append(self._sample(item, ids, first, settings, rng, sample))
        return out

    def _fitting_ids(self, item: PromptItem, s: GenSettings) -> list[int]:
        ids = self.prompt_ids(item)
        if len(ids) + s.max_new_tokens > self.llm.n_ctx():
            raise SmolforgeError(f"example {item.example_id}: prompt ({len(ids)} tokens) + {s.max_new_tokens} "
                                 f"new tokens exceed the teacher's context of {self.llm.n_ctx()}",
                                 fix="shorten the prompts or --max-new-tokens")
        return ids

    def _generate_batched(self, prompts: list[tuple[PromptItem, list[int]]], s: GenSettings) -> list[TeacherRecord]:
        """Up to `s.batch_size` responses decoded together (`llamacpp_batch`): one pass over the weights
        per step for the whole group. Each sequence samples with its own seeded generator, as the
        one-at-a-time path does, so a response depends only on its prompt, sample and the logits."""
        seqs = [(item, ids, sample) for item, ids in prompts for sample in range(s.samples_per_prompt)]
        width = min(s.batch_size, len(seqs))
        n_ctx_seq = max(len(ids) for _, ids, _ in seqs) + s.max_new_tokens
        dec = self._batch_decoder(width, n_ctx_seq)
        out: list[TeacherRecord] = []
        for start in range(0, len(seqs), width):
            out.extend(self._decode_group(dec, seqs[start:start + width], s))
        return out

    def _batch_decoder(self, width: int, n_ctx_seq: int) -> BatchDecoder:
        """One decoder kept for the process, replaced only when a group needs more than it has."""
        dec = getattr(self, "_decoder", None)
        if dec is None or dec.n_seq < width or dec.n_ctx_seq < n_ctx_seq:
            if dec is not None:
                dec.close()
            dec = self._decoder = BatchDecoder(self.llm, width, max(n_ctx_seq, 256), self.n_threads)
        return dec

    def _decode_group(self, dec: BatchDecoder, group: list[tuple[PromptItem, list[int], int]],
                      s: GenSettings) -> list[TeacherRecord]:
        """The group's responses: after every pass, the rows' top-k (one `topk_rows` over the [n, V] view
        of llama.cpp's buffer: no copies, and only k numbers per row kept), then each one's next token."""
        dec.reset()
        rngs = [np.random.default_rng([s.seed, item.example_id, sample]) for item, _, sample in group]
        members, logits = list(range(len(group))), dec.prefill([ids for _, ids, _ in group])
        resp: list[list[int]] = [[] for _ in group]
        kept: list[list[tuple]] = [[] for _ in group]
        while True:
            stats = [t.numpy() for t in topk_rows(torch.from_numpy(logits), s.top_k)]
            feed: dict[int, tuple[int, int]] = {}
            for r, j in enumerate(members):
                kept[j].append(tuple(x[r] for x in stats))
                tok = pick_token(logits[r], s.temperature, s.top_p, rngs[j])
                resp[j].append(tok)
                if tok not in self.stops and len(resp[j]) < s.max_new_tokens:
                    feed[j] = (tok, len(group[j][1]) + len(resp[j]) - 1)
            if not feed:
                break
            members, logits = dec.step(feed)
        return [self._record(item, ids, resp[j], [np.stack(col) for col in zip(*kept[j])], sample)
                for j, (item, ids, sample) in enumerate(group)]

    def _last_logits(self) -> np.ndarray:
        """The logits after the last evaluated token (a copy: llama.cpp reuses the buffer)."""
        import llama_cpp

        ptr = llama_cpp.llama_get_logits_ith(self.llm.ctx, -1)
        return np.ctypeslib.as_array(ptr, shape=(self.vocab_size,)).astype(np.float32, copy=True)

    def _sample(self, item: PromptItem, ids: list[int], first: np.ndarray, s: GenSettings,
                rng: np.random.Generator, sample: int) -> TeacherRecord:
        """One response from the evaluated prompt (its KV cache is kept: later samples rewind to it)."""
        self.llm.n_tokens = len(ids)  # eval drops the cache past n_tokens: the next sample starts from the prompt
        rows, resp = [first], []
        while True:
            tok = pick_token(rows[-1], s.temperature, s.top_p, rng)
            resp.append(tok)
            if tok in self.stops or len(resp) >= s.max_new_tokens:
                break
            self.llm.eval([tok])
            rows.append(self._last_logits())
        stats = topk_rows(torch.from_numpy(np.stack(rows)), s.top_k)
        return self._record(item, ids, resp, [t.numpy() for t in stats], sample)

    def _record(self, item: PromptItem, ids: list[int], resp: list[int], stats: list[np.ndarray],
                sample: int) -> TeacherRecord:
        """A response and its rows' top-k log-probs, ids, tail mass and truncation KL (`topk_rows`: the
        HF teacher's fp32 code)."""
        values, idx, tail, trunc = stats
        return TeacherRecord(example_id=item.example_id, prompt_messages=item.prompt_messages, prompt_ids=list(ids),
                             response_ids=resp, response_text=self.decode(resp), answer=item.answer, sample_id=sample,
                             topk_logprobs=values, topk_indices=idx.astype(np.int64), tail_mass=tail,
                             truncation_kl=trunc)

    def close(self) -> None:
        if getattr(self, "_decoder", None) is not None:
            self._decoder.close()
            self._decoder = None
        close = getattr(self.llm, "close", None)
        if close is not None:
            close()


def pick_token(logits: np.ndarray, temperature: float, top_p: float, rng: np.random.Generator) -> int:
    """Greedy (temperature 0: the first argmax, as HF's) or temperature + nucleus sampling."""
    if temperature <= 0:
        return int(np.argmax(logits))
    z = logits.astype(np.float64) / temperature
    p = np.exp(z - z.max())
    p /= p.sum()
    if top_p < 1:
        order = np.argsort(-p, kind="stable")
        keep = np.cumsum(p[order]) - p[order] < top_p  # the smallest head whose mass reaches top_p
        mask = np.zeros_like(p, dtype=bool)
        mask[order[keep]] = True
        p = np.where(mask, p, 0.0)
        p /= p.sum()
    return int(rng.choice(len(p), p=p))
