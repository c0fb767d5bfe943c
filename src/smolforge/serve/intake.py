"""From a request body to a checked request and its prompt's token ids, off the event loop.

Why a thread pool: parsing, the chat template and the tokenizer are CPU work that grows with the
prompt (a 1 MB prompt takes seconds to tokenize). Done inside an `async def` handler it stalls
every other request and `/health` for that long. `Lanes` runs it in bounded pools instead: bodies
over `LARGE_BODY_BYTES` go to their own small pool, so large prompts wait behind each other, never
in front of ordinary requests; the event loop only moves bytes. And a prompt that cannot fit the
context is refused before it is tokenized when its length in characters proves it (`char_bound`):
a 1 MB prompt to a 512-token model costs a comparison, not seconds of a core beside the engine.

Why the body is checked before `json.loads`: the parser recurses once per nesting level (a body of
100 000 `[` raises RecursionError inside it), so the depth is measured first on the raw bytes
(`http_limits.json_depth`, as the coordinator does). Then strict UTF-8, no `NaN`/`Infinity`, and
no lone UTF-16 surrogate (`"\\ud800"` decodes to a string no tokenizer can encode): each a 400
naming the problem, never a 500.
"""

from __future__ import annotations

import asyncio
import json
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any, Callable, TypeVar

from pydantic import BaseModel, ValidationError

from smolforge.http_limits import MAX_JSON_DEPTH, json_depth
from smolforge.serve.protocol import ApiError

LARGE_BODY_BYTES = int(os.environ.get("SMOLFORGE_SERVE_LARGE_BODY_BYTES", str(64 * 2**10)))
SMALL_WORKERS = int(os.environ.get("SMOLFORGE_SERVE_PREP_THREADS", "2"))
LARGE_WORKERS = int(os.environ.get("SMOLFORGE_SERVE_LARGE_PREP_THREADS", "1"))

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)


# Tokenizer parts that never remove characters (the bound below holds through them); NFC composes at
# most 3 characters into one (Hangul), hence the slack.
_KEEPING = {"NFC", "NFD", "NFKC", "NFKD", "Lowercase", "Prepend", "ByteLevel", "Metaspace", "Digits", "Punctuation",
            "UnicodeScripts", "Split", "Replace", "Sequence"}
_SLACK = 4


def char_bound(tokenizer: Any, max_positions: int) -> int | None:
    """The most characters a text of at most `max_positions` tokens can have, or None when this
    tokenizer could turn many characters into one token (then only tokenizing tells). A BPE token
    stands for at most its vocabulary entry's characters (a byte-level entry has one per byte); the
    bound needs every step before the model to keep characters, and unknown characters not fused."""
    try:
        spec = json.loads(tokenizer.backend_tokenizer.to_str())
        longest = max(len(t) for t in tokenizer.get_vocab())
    except Exception:  # noqa: BLE001 - not a fast tokenizer: no bound, tokenize
        return None
    model = spec.get("model") or {}
    if model.get("type") != "BPE" or (model.get("fuse_unk") and not model.get("byte_fallback")):
        return None
    if not (_keeps(spec.get("normalizer")) and _keeps(spec.get("pre_tokenizer"))):
        return None
    return _SLACK * longest * max_positions


def _keeps(step: dict | None) -> bool:
    """True when this normalizer or pre-tokenizer (as tokenizer.json writes it) removes no character."""
    if step is None:
        return True
    kind = step.get("type")
    if kind == "Sequence":
        return all(_keeps(s) for s in step.get("normalizers", step.get("pretokenizers", [])))
    if kind == "Replace":  # one character for one character or more: keeps
        return len((step.get("pattern") or {}).get("String") or "") == 1 and bool(step.get("content"))
    if kind == "Split":
        return step.get("behavior") != "Removed"
    return kind in _KEEPING


def _no_constants(name: str) -> Any:
    raise ValueError(f"{name} is not a JSON number")


def read_json(raw: bytes) -> dict[str, Any]:
    """The body as a JSON object, or an ApiError 400 (`invalid_json`) saying what is wrong with it."""
    if json_depth(raw) > MAX_JSON_DEPTH:
        raise ApiError(400, f"the request body nests arrays and objects more than {MAX_JSON_DEPTH} levels deep",
                       code="invalid_json")
    try:
        data = json.loads(raw.decode("utf-8"), parse_constant=_no_constants)
    except UnicodeDecodeError as err:
        raise ApiError(400, f"the request body is not UTF-8: {err.reason} at byte {err.start}",
                       code="invalid_json") from None
    except (ValueError, RecursionError) as err:  # JSONDecodeError, NaN, 5000 digits, brackets that never close
        raise ApiError(400, f"the request body is not valid JSON: {err}", code="invalid_json") from None
    if not isinstance(data, dict):
        raise ApiError(400, "the request body must be a JSON object", code="invalid_json")
    where = lone_surrogate(data)
    if where is not None:
        raise ApiError(400, f"{where or 'the body'}: holds a lone UTF-16 surrogate (such as \\ud800), which is "
                            "not text: send valid Unicode", param=where or None, code="invalid_value")
    return data


def lone_surrogate(data: Any) -> str | None:
    """The dotted path of the first string (or key) holding a lone surrogate, or None. The JSON parser
    joins valid pairs into one character, so any surrogate left is a lone one."""
    stack: list[tuple[str, Any]] = [("", data)]
    while stack:
        path, value = stack.pop()
        if isinstance(value, str):
            if not _encodable(value):
                return path
        elif isinstance(value, dict):
            for k, v in value.items():
                here = f"{path}.{k}" if path else str(k)
                if not _encodable(k):
                    return path or ""
                stack.append((here, v))
        elif isinstance(value, list):
            stack.extend((f"{path}.{i}", v) for i, v in enumerate(value))
    return None


def _encodable(text: str) -> bool:
    try:
        text.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return True


_TYPE_TAGS = {"str", "int", "float", "bool", "list", "dict", "none"}


def validate(model: type[M], data: dict[str, Any]) -> M:
    """`model` from the parsed body; the most telling problem as a 400 naming its field. For a field
    of several types (`stop`: a string or a list) pydantic reports each branch; a branch of the
    input's own type says more than "should be a valid string"."""
    try:
        return model.model_validate(data)
    except ValidationError as err:
        errors = sorted(err.errors(), key=lambda e: e["type"].endswith("_type"))
        first = errors[0]
        where = ".".join(str(p) for p in first["loc"] if not _is_type_tag(p))
        if first["type"] == "extra_forbidden":  # refused, not dropped: a typo is no silent default
            raise ApiError(400, f"{where}: unknown field: smolforge serve refuses the fields it does not know "
                                "rather than ignore them (see /openapi.json)", param=where, code="unknown_parameter") \
                from None
        raise ApiError(400, f"{where}: {first['msg']}", param=where or None, code="invalid_value") from None


def _is_type_tag(part: Any) -> bool:
    """A union branch's name in an error's location (`constrained-str`, `list[int]`), not a field."""
    return isinstance(part, str) and (part in _TYPE_TAGS or "[" in part or "-" in part)


@dataclass
class Lanes:
    """Two bounded thread pools for the CPU work of requests: ordinary bodies, and large ones."""

    small_workers: int = SMALL_WORKERS
    large_workers: int = LARGE_WORKERS
    large_bytes: int = LARGE_BODY_BYTES

    def __post_init__(self) -> None:
        self.small = ThreadPoolExecutor(max(1, self.small_workers), thread_name_prefix="serve-intake")
        self.large = ThreadPoolExecutor(max(1, self.large_workers), thread_name_prefix="serve-intake-large")

    async def run(self, size: int, fn: Callable[..., T], *args: Any) -> T:
        """`fn(*args)` in the lane for a body of `size` bytes; its exception is raised here."""
        pool = self.large if size > self.large_bytes else self.small
        return await asyncio.get_running_loop().run_in_executor(pool, fn, *args)

    def close(self) -> None:
        self.small.shutdown(wait=False, cancel_futures=True)
        self.large.shutdown(wait=False, cancel_futures=True)
