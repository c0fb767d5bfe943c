"""`--to ollama`: a directory Ollama imports: model.gguf plus a Modelfile.

The Modelfile's TEMPLATE is Go text/template, not Jinja, so the tokenizer's chat template cannot
be copied: it is recognised instead. The template is rendered (with transformers' own Jinja
renderer) on a probe conversation and compared with each known format's rendering; the matching
format's Go template goes into the Modelfile. A template no known format reproduces is refused,
since a wrong TEMPLATE makes Ollama prompt the model in a format it never saw.

No Ollama server runs here: `ollama create` itself is untested; the TEMPLATE is checked by
rendering it with Go's text/template (tests/test_export.py).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from smolforge.errors import SmolforgeError

PROBE = [
    {"role": "system", "content": "You are terse."},
    {"role": "user", "content": "What is 2 + 3?"},
    {"role": "assistant", "content": "5"},
    {"role": "user", "content": "And 4 + 4?"},
]


@dataclass(frozen=True)
class ChatFormat:
    name: str
    render: Callable[[list[dict]], str]  # messages -> prompt text with the generation prompt
    go_template: str
    stops: tuple[str, ...]


def _chatml(messages: list[dict]) -> str:
    return "".join(f"<|im_start|>{m['role']}\n{m['content']}<|im_end|>\n" for m in messages) + "<|im_start|>assistant\n"


FORMATS = (
    ChatFormat(
        "chatml", _chatml,
        "{{- range .Messages }}<|im_start|>{{ .Role }}\n{{ .Content }}<|im_end|>\n{{ end }}<|im_start|>assistant\n",
        ("<|im_start|>", "<|im_end|>"),
    ),
)


def render_jinja(template: str, messages: list[dict]) -> str:
    """The tokenizer's chat template rendered as transformers renders it (add_generation_prompt on)."""
    from transformers.utils.chat_template_utils import render_jinja_template

    rendered, _ = render_jinja_template(conversations=[messages], chat_template=template, add_generation_prompt=True)
    return rendered[0]


def chat_format(template: str | None) -> ChatFormat:
    if not template:
        raise SmolforgeError("the tokenizer has no chat template, so the Modelfile would have no TEMPLATE",
                             fix="export --to gguf and write the Modelfile yourself, or add a chat template to the "
                                 "tokenizer (tokenizer.chat_template = ...; save_pretrained)")
    got = render_jinja(template, PROBE)
    for fmt in FORMATS:
        if fmt.render(PROBE) == got:
            return fmt
    raise SmolforgeError(f"the tokenizer's chat template matches none of the formats smolforge can write as an "
                         f"Ollama TEMPLATE ({', '.join(f.name for f in FORMATS)})",
                         fix="export --to gguf and write the Modelfile's TEMPLATE yourself")


def modelfile(template: str | None, gguf_name: str = "model.gguf") -> tuple[str, ChatFormat]:
    """The Modelfile text for a GGUF next to it, and the chat format it uses."""
    fmt = chat_format(template)
    lines = [f"FROM ./{gguf_name}", f'TEMPLATE """{fmt.go_template}"""']
    lines += [f'PARAMETER stop "{s}"' for s in fmt.stops]
    return "\n".join(lines) + "\n", fmt


def write_modelfile(out_dir: Path, template: str | None, gguf_name: str = "model.gguf") -> dict:
    text, fmt = modelfile(template, gguf_name)
    (out_dir / "Modelfile").write_text(text, encoding="utf-8")
    return {"modelfile": "Modelfile", "chat_format": fmt.name, "stops": list(fmt.stops)}


def create_command(name: str, out_dir: Path) -> str:
    return f"ollama create {name} -f {out_dir / 'Modelfile'}"
