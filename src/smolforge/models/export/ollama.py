"""`--to ollama`: a directory Ollama imports: model.gguf plus a Modelfile.

The Modelfile's TEMPLATE is Go text/template, not Jinja, so the tokenizer's chat template cannot
be copied: it is recognised instead. The template is rendered (with transformers' own Jinja
renderer) on a probe conversation and compared with each known format's rendering; the matching
format's Go template goes into the Modelfile. A template no known format reproduces is refused,
since a wrong TEMPLATE makes Ollama prompt the model in a format it never saw.

No Ollama server runs here: `ollama create` itself is untested; the TEMPLATE is checked by
rendering it with Go's text/template (tests/test_export.py, tests/test_export_families.py) and
comparing it with the published Jinja templates (models/chat_templates.py).

Formats: ChatML (with the default system prompt its template adds, as Qwen2.5's does), Zephyr
(TinyLlama-Chat), Llama 3, Llama 3.2 and Phi-3 (the template llama.cpp's tests name Phi-3-mini,
which drops system messages). Jinja's `| trim` has no Go builtin: contents are passed as they are.

No frozen time. Llama 3.2's template writes "Today Date: <date_string>" (`strftime_now` at use, in
transformers) into its system header. A TEMPLATE cannot carry that date: rendered at export it tells
every later chat the export day. Its Go template leaves the line out, as Ollama's own library
template for llama3.2 does (its system header is "Cutting Knowledge Date: December 2023" and the
system prompt, no "Today Date"). Rendering it at use was not chosen: Ollama's `currentDate` exists
only since 0.11 (an older Ollama refuses the Modelfile) and writes 2026-11-29, not Llama's
"29 Nov 2026". The date the Jinja template is matched with is a fixed probe date (PROBE_DATE), so
an export does not depend on the day it runs. The GGUF keeps the Jinja template itself
(`tokenizer.chat_template`), whose date llama.cpp renders at use (its minja `strftime_now`, from
the time of the request).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from pathlib import Path
from typing import Callable, Sequence

from smolforge.errors import SmolforgeError
from smolforge.models.export.gguf_vocab import adds_bos

PROBE = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4 + 4?"},
]


@dataclass(frozen=True)
class Params:
    """What a format needs from the tokenizer: its BOS/EOS text, the system prompt its template adds
    when the conversation has none, and the date a dated template is matched with (never written
    into a TEMPLATE: see the module docstring)."""
    bos: str = ""
    eos: str = ""
    default_system: str | None = None
    date: str = ""


@dataclass(frozen=True)
class ChatFormat:
    name: str
    render: Callable[[list[dict], Params], str]  # messages -> prompt text with the generation prompt
    go: Callable[[Params], str]  # the Modelfile TEMPLATE (Go text/template over .Messages)
    stops: Callable[[Params], tuple[str, ...]]
    default_system: Callable[[str], str | None] = lambda rendered: None  # from a rendering without one


def _chatml(messages: list[dict], p: Params) -> str:
    head = "" if p.default_system is None or (messages and messages[0]["role"] == "system") \
        else f"<|im_start|>system\n{p.default_system}<|im_end|>\n"
    return head + "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) \
        + "<|im_start|>assistant\n"


def _chatml_go(p: Params) -> str:
    head = "" if p.default_system is None else (
        '{{- if or (not .Messages) (ne (index .Messages 0).Role "system") }}<|im_start|>system\n'
        f"{p.default_system}<|im_end|>\n{{{{ end }}}}")
    return head + ("{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}"
                   "<|im_start|>assistant\n")


def _chatml_default_system(rendered: str) -> str | None:
    head = "<|im_start|>system\n"
    return rendered[len(head): rendered.index("<|im_end|>")] if rendered.startswith(head) else None


def _zephyr(messages: list[dict], p: Params) -> str:
    return "".join(f"<|{m['role']}|>\n{m['content']}{p.eos}\n" for m in messages
                   if m["role"] in ("system", "user", "assistant")) + "<|assistant|>\n"


def _llama3(messages: list[dict], p: Params) -> str:
    return p.bos * bool(messages) + "".join(
        f"<|start_header_id|>{m['role']}<|end_header_id|>\n\n{m['content'].strip()}<|eot_id|>" for m in messages
    ) + "<|start_header_id|>assistant<|end_header_id|>\n\n"


_LLAMA32_SYSTEM = "<|start_header_id|>system<|end_header_id|>\n\nCutting Knowledge Date: December 2023\n"


def _llama32_head(p: Params) -> str:
    """The system header as the Jinja template renders it (dated: what the format is matched with)."""
    return f"{p.bos}{_LLAMA32_SYSTEM}Today Date: {p.date}\n\n"


def _llama32_go_head(p: Params) -> str:
    """The system header of the TEMPLATE: no date line, as Ollama's library template for llama3.2."""
    return f"{p.bos}{_LLAMA32_SYSTEM}\n"


def _llama32(messages: list[dict], p: Params) -> str:
    system = messages[0]["content"].strip() if messages and messages[0]["role"] == "system" else ""
    rest = messages[1:] if messages and messages[0]["role"] == "system" else messages
    return _llama32_head(p) + system + "<|eot_id|>" + _llama3(rest, Params())


def _phi3(messages: list[dict], p: Params) -> str:
    turns = {"user": "<|user|>\n{}<|end|>\n<|assistant|>\n", "assistant": "{}<|end|>\n"}
    return p.bos + "".join(turns[m["role"]].format(m["content"]) for m in messages if m["role"] in turns)


_LLAMA3_TURN = "<|start_header_id|>{{ .Role }}<|end_header_id|>\n\n{{ .Content }}<|eot_id|>"
_LLAMA3_PROMPT = "<|start_header_id|>assistant<|end_header_id|>\n\n"
_FIRST_IS_SYSTEM = '(and .Messages (eq (index .Messages 0).Role "system"))'

FORMATS = (
    ChatFormat("chatml", _chatml, _chatml_go, lambda p: ("<|im_start|>", "<|im_end|>"), _chatml_default_system),
    ChatFormat(
        "zephyr", _zephyr,
        lambda p: ('{{- range .Messages }}{{ if or (eq .Role "system") (eq .Role "user") (eq .Role "assistant") }}'
                   f"<|{{{{ .Role }}}}|>\n{{{{ .Content }}}}{p.eos}\n{{{{ end }}}}{{{{ end }}}}<|assistant|>\n"),
        lambda p: tuple(s for s in (p.eos, "<|user|>", "<|system|>") if s)),
    ChatFormat(
        "llama3", _llama3,
        lambda p: f"{{{{- range $i, $m := .Messages }}}}{{{{ if eq $i 0 }}}}{p.bos}{{{{ end }}}}{_LLAMA3_TURN}"
                  f"{{{{ end }}}}{_LLAMA3_PROMPT}",
        lambda p: ("<|eot_id|>", "<|start_header_id|>")),
    ChatFormat(
        "llama3.2", _llama32,
        lambda p: (_llama32_go_head(p) + f"{{{{ if {_FIRST_IS_SYSTEM} }}}}"
                   "{{ (index .Messages 0).Content }}{{ end }}"
                   "<|eot_id|>{{- range $i, $m := .Messages }}{{ if not (and (eq $i 0) (eq .Role \"system\")) }}"
                   f"{_LLAMA3_TURN}{{{{ end }}}}{{{{ end }}}}{_LLAMA3_PROMPT}"),
        lambda p: ("<|eot_id|>", "<|start_header_id|>")),
    ChatFormat(
        "phi3", _phi3,
        lambda p: (f"{p.bos}{{{{- range .Messages }}}}"
                   '{{ if eq .Role "user" }}<|user|>\n{{ .Content }}<|end|>\n'
                   "<|assistant|>\n{{ else if eq .Role \"assistant\" }}{{ .Content }}<|end|>\n{{ end }}{{ end }}"),
        lambda p: ("<|end|>", "<|user|>", "<|assistant|>")),
)


def render_jinja(template: str, messages: list[dict], tokens: dict | None = None) -> str:
    """The tokenizer's chat template rendered as transformers renders it (add_generation_prompt on);
    `tokens` are the template variables apply_chat_template passes (bos_token, eos_token, ...)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template, add_generation_prompt=True,
                                        **(tokens or {}))
    return rendered[0]


PROBE_DATE = "26 Jul 2024"  # the date Llama 3.x's template falls back to without strftime_now


def template_vars(bos: str | None, eos: str | None, date: str | None = None, adds_bos: bool = False) -> dict:
    """The variables the template is rendered with to recognise its format. `date_string`: the date a
    dated template (Llama 3.2's) is matched with, PROBE_DATE unless given, never the clock: no
    TEMPLATE carries it. `add_bos_token`: llama.cpp adds the BOS itself, so a TEMPLATE must not write
    it too (a doubled BOS degrades the model)."""
    return {"bos_token": bos or "", "eos_token": eos or "", "date_string": date or PROBE_DATE,
            "add_bos_token": adds_bos}


def chat_format(template: str | None, tokens: dict | None = None) -> tuple[ChatFormat, Params]:
    """The known format the tokenizer's chat template renders like, with and without a system
    prompt, and the parameters (BOS/EOS text, default system prompt, date) that make it so."""
    if not template:
        raise SmolforgeError("the tokenizer has no chat template, so the Modelfile would have no TEMPLATE",
                             fix="export --to gguf and write the Modelfile yourself, or add a chat template to the "
                                 "tokenizer (tokenizer.chat_template = ...; save_pretrained)")
    tokens = tokens or template_vars(None, None)
    try:
        got, got_bare = render_jinja(template, PROBE, tokens), render_jinja(template, PROBE[1:], tokens)
    except Exception as err:  # the template raises (e.g. "System role not supported"), or does not parse
        raise SmolforgeError(f"the tokenizer's chat template does not render a conversation with a system prompt "
                             f"({type(err).__name__}: {err})",
                             fix="export --to gguf and write the Modelfile yourself") from err
    for fmt in FORMATS:
        params = Params(tokens["bos_token"], tokens["eos_token"], fmt.default_system(got_bare), tokens["date_string"])
        if fmt.render(PROBE, params) == got and fmt.render(PROBE[1:], params) == got_bare:
            if any("{{" in (v or "") for v in (params.bos, params.eos, params.default_system)):
                break  # literal text Go would read as an action
            return fmt, params
    raise SmolforgeError(f"the tokenizer's chat template matches none of the formats smolforge can write as an "
                         f"Ollama TEMPLATE ({', '.join(f.name for f in FORMATS)})",
                         fix="export --to gguf and write the Modelfile's TEMPLATE yourself")


def tokens_of(tok_dir: Path) -> dict:
    """The template variables for the tokenizer in `tok_dir` (its BOS/EOS text, the probe date)."""
    import json

    path = tok_dir / "tokenizer_config.json"
    tc = json.loads(path.read_text(encoding="utf-8")) if path.is_file() else {}
    text = {k: (v.get("content") if isinstance(v, dict) else v)
            for k, v in tc.items() if k in ("bos_token", "eos_token")}
    return template_vars(text.get("bos_token"), text.get("eos_token"), adds_bos=adds_bos(tc))


def modelfile(template: str | None, tokens: dict | None = None, gguf_name: str = "model.gguf",
              stops: Sequence[str] = ()) -> tuple[str, dict]:
    """The Modelfile text for a GGUF next to it, and what it chose (for the export summary). `stops`: the
    model's stop texts besides its eos (`families.stop_texts`), each a `PARAMETER stop` after the format's own."""
    fmt, params = chat_format(template, tokens)
    stops = tuple(dict.fromkeys((*fmt.stops(params), *stops)))
    go = fmt.go(replace(params, bos="") if (tokens or {}).get("add_bos_token") else params)
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{go}"""'] + [f'PARAMETER stop "{s}"' for s in stops]
    return "\n".join(lines) + "\n", {"chat_format": fmt.name, "stops": list(stops)}


def write_modelfile(out_dir: Path, template: str | None, tokens: dict | None = None,
                    gguf_name: str = "model.gguf", stops: Sequence[str] = ()) -> dict:
    text, chosen = modelfile(template, tokens, gguf_name, stops)
    (out_dir / "Modelfile").write_text(text, encoding="utf-8")
    return {"modelfile": "Modelfile", **chosen}


def create_command(name: str, out_dir: Path) -> str:
    return f"ollama create {name} -f {out_dir / 'Modelfile'}"
