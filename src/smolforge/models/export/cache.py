"""A node's GGUF exports of HF models, made once and reused: what a `llamacpp` teacher runs.

A teacher task on a node asks for (model, quant); the first one exports (`export.run.export`,
verified against the HF model like any `smolforge export`), every later one, and every later run,
finds the file. The key is the model directory's path and a fingerprint of its files (name, size,
mtime: a re-downloaded or retrained checkpoint is a new key, without reading gigabytes to hash
them), the quantization and CACHE_VERSION (bumped when the writer's output changes). Parallel
teacher tasks on one node wait on a file lock instead of exporting the same model twice.

Quantizations (TEACHER_QUANTS, one table): f16, bf16, q8_0 and f32 (unrounded) come from smolforge's own writer
(`gguf.py`, packed by the `gguf` package: `smolforge export --quant`'s `targets.QUANTS`) and are verified in
llama.cpp against the HF model; q4_k_m needs llama.cpp's
k-quant quantizer, which the `gguf` package does not have (it packs Q8_0, not Q4_K) but
llama-cpp-python exposes as `llama_cpp.llama_model_quantize`: the f16 export (cached too) is
quantized by it. That one is not held to verify.py's LIMITS (none is set for 4 bits); llama.cpp
itself picks a fallback type for rows whose width is not a multiple of 256.
"""

from __future__ import annotations

import fcntl
import hashlib
import json
import os
import shutil
import tempfile
from pathlib import Path
from typing import Callable

from smolforge.errors import SmolforgeError
from smolforge.models.export.targets import QUANTS
from smolforge.paths import atomic_write_json, home

CACHE_VERSION = 1
GGUF_NAME = "model.gguf"
LLAMA_QUANTIZED = {"q4_k_m": "LLAMA_FTYPE_MOSTLY_Q4_K_M"}  # made by llama.cpp's quantizer from the f16 export
# What the cache makes, one table (`--teacher-quant`, serve's `--quant`): the weight types smolforge's writer
# exports (`targets.QUANTS`, `smolforge export --quant`'s) and those llama.cpp's quantizer makes from its f16
TEACHER_QUANTS: tuple[str, ...] = (*QUANTS, *LLAMA_QUANTIZED)


def cache_root() -> Path:
    """Where a node keeps its exports ($SMOLFORGE_HOME/gguf)."""
    return home() / "gguf"


def is_gguf(model: str) -> bool:
    """Whether `model` names a GGUF file (by suffix, or by the file's magic bytes: an Ollama blob has no suffix)."""
    path = Path(model).expanduser()
    if model.lower().endswith(".gguf"):
        return True
    try:
        with open(path, "rb") as f:
            return path.is_file() and f.read(4) == b"GGUF"
    except OSError:
        return False


def fingerprint(model_dir: Path) -> str:
    """The files a GGUF is made from, by name, size and mtime (not content: see the module doc)."""
    files = sorted(p for p in model_dir.iterdir() if p.is_file() and not p.name.startswith("."))
    stats = [(p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in files]
    blob = json.dumps({"dir": str(model_dir.resolve()), "files": stats, "version": CACHE_VERSION})
    return hashlib.sha256(blob.encode("utf-8")).hexdigest()[:16]


def check_quant(quant: str, flag: str = "--teacher-quant") -> str:
    """QUANT if the cache makes it (`TEACHER_QUANTS`); else one message naming FLAG (exit 2)."""
    if quant not in TEACHER_QUANTS:
        raise SmolforgeError(f"unknown {flag} {quant!r}", where=flag,
                             fix=f"use one of {', '.join(TEACHER_QUANTS)} ({', '.join(LLAMA_QUANTIZED)} is made by "
                                 "llama.cpp's quantizer)")
    return quant


def cached_gguf(model: str, quant: str = "q8_0", *, threads: int | None = None,
                say: Callable[[str], None] = lambda line: None) -> Path:
    """The GGUF of `model` (HF id, directory or preset) at `quant`, exported on first use."""
    from smolforge.models.export.run import model_dir

    check_quant(quant)
    src = model_dir(model)
    slug = "".join(c if c.isalnum() or c in "._-" else "-" for c in src.name)[:40] or "model"
    final = cache_root() / f"{slug}-{fingerprint(src)}-{quant}"
    if (final / GGUF_NAME).is_file():
        return final / GGUF_NAME
    final.parent.mkdir(parents=True, exist_ok=True)
    with open(final.parent / f".{final.name}.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            if not (final / GGUF_NAME).is_file():  # another task on this node made it while we waited
                _make(model, quant, final, threads, say)
        finally:
            fcntl.flock(lock, fcntl.LOCK_UN)
    return final / GGUF_NAME


def _make(model: str, quant: str, final: Path, threads: int | None, say: Callable[[str], None]) -> None:
    from smolforge.models.export.run import export

    if quant not in LLAMA_QUANTIZED:
        say(f"exporting {model} to GGUF ({quant}) once for this node: {final}")
        export(model, "gguf", final, quant=quant, threads=threads, say=say)
        return
    f16 = cached_gguf(model, "f16", threads=threads, say=say)
    say(f"quantizing {f16.name} to {quant} with llama.cpp's quantizer: {final}")
    tmp = Path(tempfile.mkdtemp(prefix=f".{final.name}.", dir=final.parent))
    try:
        quantize(f16, tmp / GGUF_NAME, quant, threads)
        atomic_write_json(tmp / "export.json", {"to": "gguf", "model": model, "quant": quant, "from": str(f16),
                                                "quantizer": "llama_cpp.llama_model_quantize"})
        if final.exists():
            shutil.rmtree(final)
        os.rename(tmp, final)
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def quantize(src: Path, dst: Path, quant: str, threads: int | None = None) -> None:
    """llama.cpp's own quantizer (llama_model_quantize) on a GGUF file."""
    try:
        import llama_cpp
    except ImportError as err:
        raise SmolforgeError(f"--teacher-quant {quant} needs llama-cpp-python, which is not installed",
                             fix="pip install 'smolforge[export]' (it builds llama.cpp, minutes)") from err
    params = llama_cpp.llama_model_quantize_default_params()
    params.ftype = getattr(llama_cpp, LLAMA_QUANTIZED[quant])
    params.nthread = max(1, int(threads or 1))
    rc = llama_cpp.llama_model_quantize(str(src).encode("utf-8"), str(dst).encode("utf-8"), params)
    if rc != 0 or not dst.is_file():
        raise SmolforgeError(f"llama.cpp could not quantize {src} to {quant} (return code {rc})",
                             fix="use --teacher-quant q8_0 or f16 (smolforge's own writer)")
