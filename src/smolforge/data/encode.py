"""Turn examples into token ids and labels: chat template, response-only loss, truncation, packing.

The chat template is rendered turn by turn and each piece tokenized on its own, so the boundary
between prompt and response is exact (tokenizing the whole string and searching for the response
breaks when BPE merges across the boundary).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from smolforge.data.formats import Example

IGNORE = -100
# Used when a tokenizer has no chat template (e.g. base GPT-2): plain and easy to read.
FALLBACK_TEMPLATE = (
    "{% for message in messages %}### {{ message['role'] }}:\n{{ message['content'] }}"
    "{% if message['role'] == 'assistant' %}{{ eos_token }}{% endif %}\n\n{% endfor %}"
    "{% if add_generation_prompt %}### assistant:\n{% endif %}"
)


def ensure_chat_template(tokenizer) -> None:
    if not getattr(tokenizer, "chat_template", None):
        tokenizer.chat_template = FALLBACK_TEMPLATE


def render(tokenizer, messages: list[dict[str, str]], add_generation_prompt: bool) -> str:
    ensure_chat_template(tokenizer)
    if not messages:
        return ""
    return tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=add_generation_prompt)


def prompt_text(tokenizer, example: Example) -> str:
    """What the model sees at generation time: the prompt turns plus the assistant header."""
    return render(tokenizer, example.prompt_messages, add_generation_prompt=True)


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"] if text else []


def encode_example(tokenizer, example: Example) -> tuple[list[int], list[int]]:
    """(input_ids, labels) with labels = IGNORE everywhere but assistant turns (or all, for text)."""
    if example.text is not None:
        ids = _ids(tokenizer, example.text)
        bos = tokenizer.bos_token_id
        if bos is not None and bos != tokenizer.eos_token_id:
            ids = [bos] + ids
        if tokenizer.eos_token_id is not None:
            ids = ids + [tokenizer.eos_token_id]
        return ids, list(ids)
    input_ids: list[int] = []
    labels: list[int] = []
    done = ""
    msgs = example.messages or []
    for i, message in enumerate(msgs):
        if message["role"] == "assistant":
            before = render(tokenizer, msgs[:i], add_generation_prompt=True)
            after = render(tokenizer, msgs[: i + 1], add_generation_prompt=False)
            if not (before.startswith(done) and after.startswith(before)):
                raise ValueError("chat template is not prefix-stable; cannot mask the prompt")
            head = _ids(tokenizer, before[len(done):])
            body = _ids(tokenizer, after[len(before):])
            input_ids += head + body
            labels += [IGNORE] * len(head) + body
        else:
            after = render(tokenizer, msgs[: i + 1], add_generation_prompt=False)
            if not after.startswith(done):
                raise ValueError("chat template is not prefix-stable; cannot mask the prompt")
            head = _ids(tokenizer, after[len(done):])
            input_ids += head
            labels += [IGNORE] * len(head)
        done = after
    return input_ids, labels


@dataclass
class EncodeStats:
    examples: int = 0
    truncated: int = 0
    dropped_no_target: int = 0
    tokens: int = 0
    target_tokens: int = 0
    sequences: int = 0
    notes: list[str] = field(default_factory=list)


def encode_all(tokenizer, examples: list[Example], max_length: int, packing: bool = False):
    """Encode, truncate to max_length (counted), drop examples left with no target, optionally pack."""
    stats = EncodeStats(examples=len(examples))
    rows: list[dict[str, list[int]]] = []
    for ex in examples:
        ids, labels = encode_example(tokenizer, ex)
        if len(ids) > max_length:
            stats.truncated += 1
            ids, labels = ids[:max_length], labels[:max_length]
        if all(x == IGNORE for x in labels[1:]):
            stats.dropped_no_target += 1
            continue
        rows.append({"input_ids": ids, "labels": labels})
    if packing:
        rows = pack(rows, max_length)
    stats.sequences = len(rows)
    stats.tokens = sum(len(r["input_ids"]) for r in rows)
    stats.target_tokens = sum(sum(1 for x in r["labels"][1:] if x != IGNORE) for r in rows)
    return rows, stats


def pack(rows: list[dict[str, list[int]]], max_length: int) -> list[dict[str, list[int]]]:
    """Concatenate examples into max_length blocks, so no compute goes to padding."""
    packed: list[dict[str, list[int]]] = []
    cur_ids: list[int] = []
    cur_labels: list[int] = []
    for r in rows:
        if cur_ids and len(cur_ids) + len(r["input_ids"]) > max_length:
            packed.append({"input_ids": cur_ids, "labels": cur_labels})
            cur_ids, cur_labels = [], []
        cur_ids = cur_ids + r["input_ids"]
        cur_labels = cur_labels + r["labels"]
    if cur_ids:
        packed.append({"input_ids": cur_ids, "labels": cur_labels})
    return packed
