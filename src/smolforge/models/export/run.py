"""One export, start to finish: merge, write the target format, verify, swap the directory in.

`smolforge export`, the `export` job kind and `train/launch/distill --export` all call `export()`.
The output directory is built in a temp directory next to it and swapped in whole
(`rundir.replace_with`, over `paths.atomic_replace_dir`): a failed or refused export (verification
off, a crash) leaves what was there before; a re-export replaces only what the earlier export wrote
(its manifest), so files a user added there survive. It holds `export.json`, the summary this
function returns.
"""

from __future__ import annotations

import json
import re
import shutil
import tempfile
import time
from pathlib import Path
from typing import Callable

from smolforge.errors import SmolforgeError
from smolforge.models.export import gguf as gguf_format
from smolforge.models.export import hf as hf_format
from smolforge.models.export import ollama as ollama_format
from smolforge.models.export.merge import MergedModel
from smolforge.models.export.targets import QUANTS, TARGETS
from smolforge.paths import atomic_write_json
from smolforge.rundir import RunDir, check_run_dir, read_manifest, replace_with

SUMMARY = "export.json"
GGUF_NAME = "model.gguf"


def modelfile_stops(merged) -> list[str]:
    """The stop set's texts (`families.stop_texts`) besides the eos, which Ollama stops on by itself: the
    Modelfile's `PARAMETER stop` lines, as Ollama's own library Modelfiles list them (Phi-3: `<|end|>`)."""
    from transformers import AutoTokenizer

    from smolforge.models.families import stop_texts

    tok = AutoTokenizer.from_pretrained(str(merged.tokenizer_dir))
    return [t for t in stop_texts(tok, merged.base_dir) if t != tok.eos_token]


def model_dir(model: str) -> Path:
    """The base model as a local directory: a preset, a directory, or a hub id from the local cache."""
    from smolforge.models.loading import _hub_error, resolve_model

    resolved = resolve_model(model)
    if Path(resolved).is_dir():
        return Path(resolved)
    try:
        from huggingface_hub import snapshot_download

        return Path(snapshot_download(resolved, allow_patterns=["*.json", "*.safetensors", "*.jinja", "*.txt",
                                                                "*.model"]))
    except Exception as err:  # offline and not cached, unknown id, gated
        raise _hub_error(model, resolved, err) from err


def default_name(model: str, adapters) -> str:
    """The run's directory name for `<run>/lora_adapter`, else the adapter's or model's own name;
    lower-case letters, digits, '.', '-' and '_' only (what `ollama create` takes)."""
    if adapters:
        last = Path(str(adapters[-1])).resolve()
        raw = last.parent.name if last.name.endswith("_adapter") else last.name
    else:
        raw = Path(model.rstrip("/")).name.replace(":", "-")
    return re.sub(r"[^a-z0-9._-]+", "-", raw.lower()).strip("-._") or "model"


def check_output_dir(out: Path) -> RunDir:
    """Claimable by an export (`rundir`): new, empty, or an earlier export's (its manifest, or from before
    manifests its summary, whose `files` are what it wrote). A directory of another kind of run, or one
    that is neither empty nor an export's, is refused: it may hold someone's work. Nothing is deleted."""
    if out.is_dir() and read_manifest(out) is None and any(out.iterdir()) and not (out / SUMMARY).is_file():
        raise SmolforgeError(f"--output-dir {out} exists and is not an earlier export (no {SUMMARY} in it)",
                             fix="pass a new or empty directory; an earlier export's files are replaced "
                                 "(files you added there are kept)")
    return check_run_dir(out, "export", adopt=_legacy_files(out))


def _legacy_files(out: Path) -> list[str]:
    """What an export from before manifests wrote in `out` (its summary's `files`), else nothing."""
    if read_manifest(out) is not None or not (out / SUMMARY).is_file():
        return []
    try:
        files = json.loads((out / SUMMARY).read_text(encoding="utf-8")).get("files")
    except (ValueError, UnicodeDecodeError, AttributeError):
        return [SUMMARY]
    return [f for f in files if isinstance(f, str)] + [SUMMARY] if isinstance(files, list) else [SUMMARY]


def reference_model(merged: MergedModel):
    """The HF model with its adapters applied by peft (unmerged): what the GGUF must reproduce."""
    from smolforge.models.loading import load_model, load_tokenizer
    from smolforge.models.peft_methods import load_adapter, merge_adapter

    net = load_model(str(merged.base_dir))
    for i, adapter in enumerate(merged.adapters):
        net = load_adapter(net, adapter.path)
        if i < len(merged.adapters) - 1:
            net = merge_adapter(net)
    return net.eval(), load_tokenizer(str(merged.tokenizer_dir))


def export(model: str, to: str, output_dir: str | Path, *, adapters: list[str] | tuple[str, ...] = (),
           quant: str = "f16", name: str | None = None, verify: bool = True, threads: int | None = None,
           dtype: str = "auto", say: Callable[[str], None] = lambda line: None) -> dict:
    """Export `model` (+ `adapters`, merged in order) as `to` into `output_dir`; the summary dict.

    `dtype` is the dtype `--to hf` writes (auto: the checkpoint's own); a GGUF's is `quant`, and
    its verification reference stays fp32 (a bf16 reference would hide the GGUF's own error)."""
    if to not in TARGETS:
        raise SmolforgeError(f"unknown --to {to!r}", fix=f"use one of {', '.join(TARGETS)}")
    dtype = check_export_dtype(dtype, to)
    if quant not in QUANTS:
        raise SmolforgeError(f"unknown --quant {quant!r}", fix=f"use one of {', '.join(QUANTS)}")
    out = Path(output_dir).expanduser().resolve()
    run = check_output_dir(out)
    t0 = time.time()
    merged = MergedModel(model_dir(model), list(adapters), model)
    name = name or default_name(model, adapters)
    template = gguf_format.chat_template(merged.tokenizer_dir)
    tokens = ollama_format.tokens_of(merged.tokenizer_dir)
    if to == "ollama":
        ollama_format.chat_format(template, tokens)  # refuse an untranslatable template before any work
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{out.name}.export-", dir=out.parent))
    summary: dict = {"to": to, "model": model, "adapters": [str(a) for a in adapters], "name": name,
                     "output_dir": str(out)}
    if merged.untie is not None:  # an adapter on the tied head or embedding: written untied
        say(merged.untie.message())
        summary["untied"] = list(merged.untie.changed)
    try:
        if to == "hf":
            say(f"merging into an HF directory ({len(merged.adapters)} adapter(s))")
            summary["hf"] = hf_format.write_hf(merged, tmp, dtype)
            summary["dtype"] = dtype
        else:
            say(f"writing {GGUF_NAME} ({quant})")
            summary["gguf"] = gguf_format.write_gguf(merged, tmp / GGUF_NAME, quant, name)
            summary["quant"] = quant
            if verify:
                say("verifying in llama.cpp")
                net, tok = reference_model(merged)
                from smolforge.models.export.verify import verify_gguf

                report = verify_gguf(tmp / GGUF_NAME, net, tok, quant, threads=threads)
                del net
                summary["verify"] = report.to_dict()
                say(report.line())
                if not report.ok:
                    raise SmolforgeError(f"the GGUF does not reproduce the model: {report.line()}",
                                         fix="report it with the model's config.json; --no-verify writes it anyway")
            if to == "ollama":
                summary["ollama"] = ollama_format.write_modelfile(tmp, template, tokens, GGUF_NAME,
                                                                  modelfile_stops(merged))
                summary["ollama"]["create"] = ollama_format.create_command(name, out)
        summary["seconds"] = round(time.time() - t0, 2)
        summary["files"] = sorted(p.name for p in tmp.iterdir()) + [SUMMARY]
        atomic_write_json(tmp / SUMMARY, summary)
        replace_with(run, tmp)  # only an earlier export's files go; the user's are carried over
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)
    return summary


def check_export_dtype(dtype: str | None, to: str) -> str:
    """--dtype for an export: a choice (default auto, the checkpoint's own), and only for --to hf."""
    from smolforge.models.dtypes import parse_dtype

    dtype = parse_dtype(dtype or "auto")
    if dtype != "auto" and to != "hf":
        raise SmolforgeError(f"--dtype {dtype} applies to --to hf; a {to} export's weights dtype is --quant",
                             where="--dtype", fix=f"use --quant {'|'.join(QUANTS)} for GGUF/Ollama, or drop --dtype")
    return dtype


def read_summary(output_dir: str | Path) -> dict:
    return json.loads((Path(output_dir) / SUMMARY).read_text(encoding="utf-8"))
