"""The teacher-output store: compact, checksummed shards that students can read while teachers write.

Why this shape:
- Full-vocabulary logits are what made the seeds' example 160 GB. A shard keeps, per response
  token, only the teacher's top-k log-probabilities, their vocabulary ids, and the probability mass
  outside the top k (the tail), which the KD losses need to stay a proper distribution. VERSION 2
  shards (codec "sorted-rice-q8", see `topk_codec`) store ids sorted and Rice-coded, log-probs as
  8-bit codes below the row's fp16 top one, and compress every stream with zlib: 84.0 bytes per
  response token for the whole shard (75.8 of them the top-k part) at k = 32, V = 32,000, against
  142.9 for VERSION 1 (fp16 values, ids bit-packed to ceil(log2 V) bits, fp16 tail), which readers
  still accept (measured on a synthetic Zipf teacher: `bench/distill_store.py`, BENCHMARKS.md).
  `compress=False` writes codec "plain": fp32 values, plain integer ids, fp32 tail.
- Each manifest records what the stored distribution costs in accuracy (`reconstruction`):
  KL(stored k+1 buckets ‖ the teacher's exact k+1 buckets), mean and max over every top-k row of
  the shard, and, when the teacher had the full logits, what top-k itself drops (truncation KL).
- Each shard is two files: `batch_N.safetensors` (tensors, no pickle) and `batch_N.json`, its
  manifest (tokenizer hash, k, dtypes, counts, sha256 of the tensor file). Both are written
  atomically and the manifest last, so a manifest on disk means a complete shard: a student can
  poll the directory and start on shard 0 while later shards are still being generated.
- Readers verify the checksum before parsing. A mismatch raises `CorruptShardError`, the shard is
  quarantined and regenerated; it is never trained on.
"""

from __future__ import annotations

import hashlib
import json
import math
import os
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from smolforge.distill import topk_codec
from smolforge.errors import SmolforgeError
from smolforge.paths import atomic_write_bytes, atomic_write_json

FORMAT = "smolforge-teacher-shard"
VERSION = 2
READABLE_VERSIONS = (1, 2)
PLAN_FILE = "plan.json"


class CorruptShardError(SmolforgeError):
    """A shard whose bytes do not match its manifest's checksum (or that cannot be parsed)."""

    def __init__(self, shard_id: int, what: str, where: str | None = None):
        self.shard_id = shard_id
        super().__init__(f"teacher shard {shard_id} is corrupt: {what}", where=where,
                         fix="the shard is quarantined and regenerated automatically; to force it, delete "
                             f"batch_{shard_id}.* and rerun the teacher for that shard")


def shard_stem(shard_id: int) -> str:
    return f"batch_{shard_id}"


def tokenizer_hash(tokenizer) -> str:
    """A hash of the vocabulary (token → id) and special tokens: equal hashes mean ids agree."""
    vocab = tokenizer.get_vocab()
    payload = json.dumps(sorted(vocab.items(), key=lambda kv: kv[1]), ensure_ascii=False)
    special = json.dumps([tokenizer.eos_token, tokenizer.pad_token, getattr(tokenizer, "bos_token", None)])
    return hashlib.sha256((payload + special).encode("utf-8")).hexdigest()[:16]


# ----------------------------------------------------------------------------------- index packing

def index_bits(vocab_size: int) -> int:
    return max(1, math.ceil(math.log2(max(vocab_size, 2))))


# VERSION 1 ids are fixed-width bit streams: the codec's own packer (bits ≥ 1 here).
pack_indices = topk_codec.pack_bits
unpack_indices = topk_codec.unpack_bits


# ------------------------------------------------------------------------------- safetensors bytes

_ST_DTYPES = {"float16": "F16", "float32": "F32", "float64": "F64", "uint8": "U8", "int8": "I8", "uint16": "U16",
              "int16": "I16", "uint32": "U32", "int32": "I32", "int64": "I64", "bool": "BOOL"}


def safetensors_bytes(tensors: dict[str, np.ndarray], metadata: dict[str, str] | None = None) -> bytes:
    """The safetensors encoding with a canonical header (sorted keys, fixed layout).

    The library's own writer orders header keys as a hash map happens to, so equal tensors can
    give different bytes; a shard regenerated from the same prompts must have the same checksum.
    The result is plain safetensors (8-byte header length, JSON header, data), read by any loader.
    """
    header: dict[str, Any] = {}
    if metadata:
        header["__metadata__"] = {str(k): str(v) for k, v in sorted(metadata.items())}
    chunks, offset = [], 0
    for name in sorted(tensors):
        arr = np.ascontiguousarray(tensors[name])
        if arr.dtype.byteorder == ">":
            arr = arr.astype(arr.dtype.newbyteorder("<"))
        raw = arr.tobytes()
        header[name] = {"dtype": _ST_DTYPES[arr.dtype.name], "shape": list(arr.shape),
                        "data_offsets": [offset, offset + len(raw)]}
        chunks.append(raw)
        offset += len(raw)
    head = json.dumps(header, sort_keys=True, separators=(",", ":")).encode("utf-8")
    head += b" " * (-len(head) % 8)
    return len(head).to_bytes(8, "little") + head + b"".join(chunks)


# ----------------------------------------------------------------------------------------- records

@dataclass
class TeacherRecord:
    """One teacher sample: the prompt, the response it generated, and its top-k over that response.

    `topk_logprobs`/`topk_indices` are [len(response_ids), k] (row r is the teacher's distribution
    for response token r); `tail_mass` is [len(response_ids)]. All three are None when the
    backend gave text only (sequence-level KD). `truncation_kl` [len(response_ids)] is what top-k
    dropped per row (`topk_codec`'s definition), set by a teacher that saw the full logits; it goes
    into the manifest's summary, not into the shard.
    """

    example_id: int
    prompt_messages: list[dict[str, str]]
    prompt_ids: list[int]
    response_ids: list[int]
    response_text: str
    answer: str | None = None
    sample_id: int = 0
    topk_logprobs: np.ndarray | None = None
    topk_indices: np.ndarray | None = None
    tail_mass: np.ndarray | None = None
    truncation_kl: np.ndarray | None = None

    @property
    def has_topk(self) -> bool:
        return self.topk_logprobs is not None


@dataclass
class Shard:
    shard_id: int
    manifest: dict[str, Any]
    records: list[TeacherRecord]

    @property
    def num_tokens(self) -> int:
        return sum(len(r.response_ids) for r in self.records)


def _flat(seqs: list[list[int]], dtype) -> tuple[np.ndarray, np.ndarray]:
    offsets = np.zeros(len(seqs) + 1, dtype=np.int64)
    offsets[1:] = np.cumsum([len(s) for s in seqs]) if seqs else []
    flat = np.fromiter((t for s in seqs for t in s), dtype=dtype, count=int(offsets[-1]))
    return flat, offsets


def _gather_topk(records: list[TeacherRecord], k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Stack the top-k rows of every record that has them: ([rows, k] fp32, [rows, k] int64, [rows] fp32)."""
    with_topk = [r for r in records if r.has_topk]
    for r in with_topk:
        n = len(r.response_ids)
        if r.topk_logprobs.shape != (n, k) or r.topk_indices.shape != (n, k) or r.tail_mass.shape != (n,):
            raise ValueError(f"example {r.example_id}: top-k arrays must be [{n}, {k}] and tail [{n}]")
    if not with_topk:
        return np.zeros((0, k), np.float32), np.zeros((0, k), np.int64), np.zeros(0, np.float32)
    return (np.concatenate([np.asarray(r.topk_logprobs, np.float32) for r in with_topk]),
            np.concatenate([np.asarray(r.topk_indices, np.int64) for r in with_topk]),
            np.concatenate([np.asarray(r.tail_mass, np.float32) for r in with_topk]))


def _reconstruction(records: list[TeacherRecord], exact: tuple[np.ndarray, np.ndarray, np.ndarray],
                    stored_by_id: tuple[np.ndarray, np.ndarray]) -> dict[str, Any]:
    """The manifest's accuracy record: codec KL over every top-k row, truncation KL where known."""
    values, idx, tail = exact
    order = np.argsort(idx, axis=1, kind="stable")
    kl = topk_codec.bucket_kl(stored_by_id[0], stored_by_id[1], np.take_along_axis(values, order, axis=1), tail)
    out: dict[str, Any] = {
        "kl": "KL(stored k+1 buckets || teacher's exact k+1 buckets), nats per token, every top-k row",
        "kl_mean": float(kl.mean()) if kl.size else 0.0, "kl_max": float(kl.max()) if kl.size else 0.0,
        "rows": int(kl.size)}
    trunc = [np.asarray(r.truncation_kl, np.float64) for r in records if r.has_topk and r.truncation_kl is not None]
    if trunc:
        t = np.concatenate(trunc)
        out.update(truncation_kl="KL(full || top-k + tail spread evenly), nats per token: what top-k drops",
                   truncation_kl_mean=float(t.mean()) if t.size else 0.0,
                   truncation_kl_max=float(t.max()) if t.size else 0.0, truncation_rows=int(t.size))
    return out


def encode_shard(shard_id: int, records: list[TeacherRecord], *, vocab_size: int, k: int, tok_hash: str,
                 compress: bool = True, extra: dict[str, Any] | None = None) -> tuple[bytes, dict[str, Any]]:
    """Serialise records into (safetensors bytes, manifest), VERSION 2. Pure: no I/O, same records → same bytes.

    compress=True: codec "sorted-rice-q8" (`topk_codec`), every tensor compressed into a uint8
    blob (zlib) whose dtype and shape the safetensors metadata ("layout") records. compress=False: codec
    "plain", fp32 values and tail, plain integer ids, tensors as they are.
    """
    id_dtype = np.uint16 if vocab_size <= 65536 else np.int32
    prompt_flat, prompt_off = _flat([r.prompt_ids for r in records], id_dtype)
    resp_flat, resp_off = _flat([r.response_ids for r in records], id_dtype)
    values, idx, tail = _gather_topk(records, k)
    rows = values.shape[0]
    text_meta = [{"prompt_messages": r.prompt_messages, "response": r.response_text, "answer": r.answer}
                 for r in records]
    tensors = {
        "prompt_ids": prompt_flat, "prompt_offsets": prompt_off,
        "response_ids": resp_flat, "response_offsets": resp_off,
        "example_ids": np.array([r.example_id for r in records], dtype=np.int64),
        "sample_ids": np.array([r.sample_id for r in records], dtype=np.int32),
        "has_topk": np.array([r.has_topk for r in records], dtype=np.uint8),
        "text_json": np.frombuffer(json.dumps(text_meta, ensure_ascii=False).encode("utf-8"), dtype=np.uint8).copy(),
    }
    metadata = {"format": FORMAT, "version": str(VERSION)}
    if compress:
        coded = topk_codec.encode_rows(values, idx)
        rice_b = int(coded.pop("rice_b"))
        tail16 = tail.astype(np.float16)
        topk = {f"topk_{name}": arr for name, arr in coded.items()}
        topk["tail_mass"] = tail16
        codec = {"name": topk_codec.CODEC, "rice_b": rice_b, "compressor": topk_codec.COMPRESSOR}
        stored = (topk_codec.decode_rows(coded, rows, k, rice_b, rank_order=False)[0], tail16.astype(np.float32))
        tensors.update(topk)
        layout = {name: [np.dtype(arr.dtype).name, list(arr.shape)] for name, arr in sorted(tensors.items())}
        blobs = {name: np.frombuffer(topk_codec.compress_bytes(np.ascontiguousarray(arr).tobytes()), np.uint8)
                 for name, arr in tensors.items()}
        topk_bytes = sum(blobs[name].nbytes for name in topk)
        metadata["layout"] = json.dumps(layout, sort_keys=True, separators=(",", ":"))
        tensors = blobs
    else:
        topk = {"topk_values": values, "topk_indices": idx.astype(id_dtype), "tail_mass": tail}
        codec = {"name": "plain", "values_dtype": "float32", "ids_dtype": np.dtype(id_dtype).name}
        stored = (np.take_along_axis(values, np.argsort(idx, axis=1, kind="stable"), axis=1), tail)
        tensors.update(topk)
        topk_bytes = sum(arr.nbytes for arr in topk.values())
    data = safetensors_bytes(tensors, metadata=metadata)
    response_tokens = int(resp_off[-1])
    manifest = {
        "format": FORMAT, "version": VERSION, "codec": codec, "shard": shard_id,
        "file": f"{shard_stem(shard_id)}.safetensors",
        "sha256": hashlib.sha256(data).hexdigest(), "bytes": len(data),
        "tokenizer_hash": tok_hash, "vocab_size": int(vocab_size), "k": int(k),
        "ids_dtype": np.dtype(id_dtype).name, "compressed": bool(compress),
        "num_examples": len(records), "num_prompts": len({r.example_id for r in records}),
        "num_response_tokens": response_tokens, "num_topk_rows": rows,
        "topk_bytes": int(topk_bytes),
        "bytes_per_token": (len(data) / response_tokens) if response_tokens else 0.0,
        "topk_bytes_per_token": (topk_bytes / rows) if rows else 0.0,
        "reconstruction": _reconstruction(records, (values, idx, tail), stored),
        "created": time.time(),
    }
    if extra:
        manifest.update(extra)
    return data, manifest


def write_shard(out_dir: str | Path, shard_id: int, records: list[TeacherRecord], **kwargs) -> dict[str, Any]:
    """Encode and write a shard atomically: tensor file first, manifest last. Returns the manifest."""
    data, manifest = encode_shard(shard_id, records, **kwargs)
    write_shard_bytes(out_dir, manifest, data)
    return manifest


def write_shard_bytes(out_dir: str | Path, manifest: dict[str, Any], data: bytes) -> None:
    """Place an already encoded shard (e.g. received from a remote teacher) into a store directory."""
    out_dir = Path(out_dir)
    if hashlib.sha256(data).hexdigest() != manifest["sha256"]:
        raise CorruptShardError(int(manifest["shard"]), "bytes received do not match the teacher's checksum")
    stem = shard_stem(int(manifest["shard"]))
    atomic_write_bytes(out_dir / f"{stem}.safetensors", data)
    atomic_write_json(out_dir / f"{stem}.json", manifest)


def _topk_arrays(manifest: dict[str, Any], t: dict[str, np.ndarray]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """([rows, k] log-probs, [rows, k] int64 ids, [rows] tail) of a parsed shard, any readable version."""
    k, rows = int(manifest["k"]), int(manifest["num_topk_rows"])
    if int(manifest.get("version", 1)) == 1:  # VERSION 1: fp16 or fp32 values, ids bit-packed or plain
        enc = manifest["index_encoding"]
        if enc["kind"] == "bitpack":
            idx = unpack_indices(t["topk_indices"], int(enc["bits"]), rows * k).reshape(rows, k)
        else:
            idx = t["topk_indices"].astype(np.int64).reshape(rows, k)
        return t["topk_values"], idx, t["tail_mass"]
    codec = manifest["codec"]
    if codec["name"] == "plain":
        return t["topk_values"], t["topk_indices"].astype(np.int64).reshape(rows, k), t["tail_mass"]
    if codec["name"] == topk_codec.CODEC:
        coded = {name[len("topk_"):]: arr for name, arr in t.items() if name.startswith("topk_")}
        values, idx = topk_codec.decode_rows(coded, rows, k, int(codec["rice_b"]))
        return values, idx, t["tail_mass"].astype(np.float32)
    raise ValueError(f"unknown codec {codec['name']!r}")


def _parse_tensors(manifest: dict[str, Any], data: bytes) -> dict[str, np.ndarray]:
    """The shard's tensors, decompressed when the codec compressed them (their dtype and shape are
    in the safetensors metadata's "layout")."""
    from safetensors.numpy import load

    t = load(data)
    if int(manifest.get("version", 1)) == 1 or manifest["codec"]["name"] == "plain":
        return t
    head_len = int.from_bytes(data[:8], "little")
    layout = json.loads(json.loads(data[8:8 + head_len])["__metadata__"]["layout"])
    out = {}
    for name, (dtype, shape) in layout.items():
        raw = topk_codec.decompress_bytes(bytes(t[name]))
        out[name] = np.frombuffer(raw, dtype=np.dtype(dtype)).reshape(shape)
    return out


def decode_shard(manifest: dict[str, Any], data: bytes) -> Shard:
    """Verify the checksum, then parse (VERSION 1 or 2). Raises CorruptShardError on any mismatch."""
    shard_id = int(manifest.get("shard", -1))
    if manifest.get("format") != FORMAT:
        raise CorruptShardError(shard_id, f"manifest format is {manifest.get('format')!r}, not {FORMAT!r}")
    if manifest.get("version", 1) not in READABLE_VERSIONS:
        raise CorruptShardError(shard_id, f"format version {manifest.get('version')!r} is newer than this "
                                          f"smolforge reads ({', '.join(map(str, READABLE_VERSIONS))})")
    if len(data) != manifest.get("bytes") or hashlib.sha256(data).hexdigest() != manifest.get("sha256"):
        raise CorruptShardError(shard_id, "sha256 of the tensor file does not match the manifest")
    try:
        t = _parse_tensors(manifest, data)
        text_meta = json.loads(bytes(t["text_json"]).decode("utf-8"))
        values, idx, tail = _topk_arrays(manifest, t)
        records = []
        pos = 0
        for i, meta in enumerate(text_meta):
            p0, p1 = int(t["prompt_offsets"][i]), int(t["prompt_offsets"][i + 1])
            r0, r1 = int(t["response_offsets"][i]), int(t["response_offsets"][i + 1])
            rec = TeacherRecord(
                example_id=int(t["example_ids"][i]), sample_id=int(t["sample_ids"][i]),
                prompt_messages=meta["prompt_messages"], answer=meta.get("answer"),
                prompt_ids=t["prompt_ids"][p0:p1].astype(np.int64).tolist(),
                response_ids=t["response_ids"][r0:r1].astype(np.int64).tolist(),
                response_text=meta["response"],
            )
            if t["has_topk"][i]:
                n = r1 - r0
                rec.topk_logprobs = values[pos:pos + n]
                rec.topk_indices = idx[pos:pos + n]
                rec.tail_mass = tail[pos:pos + n]
                pos += n
            records.append(rec)
    except CorruptShardError:
        raise
    except Exception as err:  # a checksum collision is unrealistic; a format bug should still not crash training
        raise CorruptShardError(shard_id, f"cannot parse: {type(err).__name__}: {err}") from err
    return Shard(shard_id, manifest, records)


def manifest_path(out_dir: str | Path, shard_id: int) -> Path:
    return Path(out_dir) / f"{shard_stem(shard_id)}.json"


def read_manifest(out_dir: str | Path, shard_id: int) -> dict[str, Any] | None:
    path = manifest_path(out_dir, shard_id)
    try:
        return json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        return None
    except (json.JSONDecodeError, UnicodeDecodeError) as err:
        raise CorruptShardError(shard_id, f"manifest is not valid JSON ({err})", where=str(path)) from err


def read_shard_bytes(out_dir: str | Path, shard_id: int) -> tuple[dict[str, Any], bytes] | None:
    """(manifest, tensor bytes) of a complete shard, or None when it is not written yet."""
    manifest = read_manifest(out_dir, shard_id)
    if manifest is None:
        return None
    path = Path(out_dir) / manifest.get("file", f"{shard_stem(shard_id)}.safetensors")
    try:
        data = path.read_bytes()
    except FileNotFoundError as err:
        raise CorruptShardError(shard_id, "manifest present but tensor file missing", where=str(path)) from err
    return manifest, data


def read_shard(out_dir: str | Path, shard_id: int) -> Shard:
    got = read_shard_bytes(out_dir, shard_id)
    if got is None:
        raise SmolforgeError(f"teacher shard {shard_id} does not exist in {out_dir}",
                             fix="run the teacher first (smolforge distill does both)")
    return decode_shard(*got)


def quarantine_shard(out_dir: str | Path, shard_id: int) -> None:
    """Move a bad shard aside (manifest first, so readers stop seeing it) for later inspection."""
    out_dir = Path(out_dir)
    stem = shard_stem(shard_id)
    stamp = int(time.time() * 1000)
    for suffix in (".json", ".safetensors"):
        src = out_dir / f"{stem}{suffix}"
        if src.exists():
            os.replace(src, out_dir / f".{stem}{suffix}.corrupt-{stamp}")


def ready_shards(out_dir: str | Path) -> list[int]:
    """Shard ids whose manifest exists (written last, so the shard is complete)."""
    out_dir = Path(out_dir)
    ids = []
    if not out_dir.exists():
        return ids
    for p in out_dir.glob("batch_*.json"):
        try:
            ids.append(int(p.stem.split("_", 1)[1]))
        except ValueError:
            continue
    return sorted(ids)


# ---------------------------------------------------------------------------------------- plan file

@dataclass
class StorePlan:
    """What the store will hold when every teacher is done: lets students know when to stop waiting."""

    num_shards: int
    num_examples: int
    shard_size: int
    teacher: str
    dataset: str
    tokenizer_hash: str
    vocab_size: int
    k: int
    shards: list[list[int]] = field(default_factory=list)  # [start, end) example ranges per shard
    samples_per_prompt: int = 1
    # How the shards were made, so a missing or corrupt one is regenerated identically.
    generation: dict[str, Any] = field(default_factory=dict)
    compress: bool = True
    backend: str = "hf"

    def write(self, out_dir: str | Path) -> None:
        atomic_write_json(Path(out_dir) / PLAN_FILE, self.__dict__)

    @classmethod
    def read(cls, out_dir: str | Path) -> "StorePlan | None":
        path = Path(out_dir) / PLAN_FILE
        if not path.exists():
            return None
        return cls(**json.loads(path.read_text(encoding="utf-8")))


def store_summary(out_dir: str | Path) -> dict[str, Any]:
    """Totals over the shards on disk: bytes/token against an fp16 full-vocabulary store, and the
    stored distribution's error (each manifest's `reconstruction`, weighted by its rows; None when
    no shard recorded it, e.g. a VERSION 1 store)."""
    total_bytes = tokens = topk_bytes = rows = examples = 0
    vocab = k = 0
    kl_sum = kl_rows = trunc_sum = trunc_rows = 0.0
    kl_max = trunc_max = 0.0
    shards = ready_shards(out_dir)
    for sid in shards:
        m = read_manifest(out_dir, sid) or {}
        total_bytes += int(m.get("bytes", 0))
        tokens += int(m.get("num_response_tokens", 0))
        topk_bytes += int(m.get("topk_bytes", 0))
        rows += int(m.get("num_topk_rows", 0))
        examples += int(m.get("num_examples", 0))
        vocab, k = int(m.get("vocab_size", vocab)), int(m.get("k", k))
        rec = m.get("reconstruction") or {}
        kl_sum += rec.get("kl_mean", 0.0) * rec.get("rows", 0)
        kl_rows += rec.get("rows", 0)
        kl_max = max(kl_max, rec.get("kl_max", 0.0))
        trunc_sum += rec.get("truncation_kl_mean", 0.0) * rec.get("truncation_rows", 0)
        trunc_rows += rec.get("truncation_rows", 0)
        trunc_max = max(trunc_max, rec.get("truncation_kl_max", 0.0))
    full = 2 * vocab
    bpt = total_bytes / tokens if tokens else 0.0
    return {
        "shards": len(shards), "examples": examples, "bytes": total_bytes, "response_tokens": tokens, "vocab_size": vocab, "k": k,
        "bytes_per_token": bpt, "topk_bytes_per_token": topk_bytes / rows if rows else 0.0,
        "fp16_full_vocab_bytes_per_token": full, "ratio_vs_fp16_full": (bpt / full) if full else 0.0,
        "reconstruction_kl_mean": kl_sum / kl_rows if kl_rows else None,
        "reconstruction_kl_max": kl_max if kl_rows else None,
        "truncation_kl_mean": trunc_sum / trunc_rows if trunc_rows else None,
        "truncation_kl_max": trunc_max if trunc_rows else None,
    }
