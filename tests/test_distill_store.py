"""The teacher-output store: exact round trips, bit-packed indices, checksums, bytes per token."""

from __future__ import annotations

import json

import numpy as np
import pytest

from smolforge.distill.store import (CorruptShardError, TeacherRecord, decode_shard, encode_shard, pack_indices,
                                     quarantine_shard, read_manifest, read_shard, ready_shards, store_summary,
                                     unpack_indices, write_shard)


def _records(n: int, vocab: int, k: int, seed: int = 0, fp16_exact: bool = True) -> list[TeacherRecord]:
    rng = np.random.default_rng(seed)
    out = []
    for i in range(n):
        length = int(rng.integers(1, 9))
        values = -np.abs(rng.normal(size=(length, k))).astype(np.float32) * 3
        if fp16_exact:
            values = values.astype(np.float16).astype(np.float32)
        tail = rng.uniform(0, 0.3, size=length).astype(np.float32)
        if fp16_exact:
            tail = tail.astype(np.float16).astype(np.float32)
        idx = np.stack([rng.choice(vocab, size=k, replace=False) for _ in range(length)]).astype(np.int64)
        out.append(TeacherRecord(
            example_id=i, prompt_messages=[{"role": "user", "content": f"q{i} ünïcode"}],
            prompt_ids=rng.integers(0, vocab, size=int(rng.integers(2, 6))).tolist(),
            response_ids=rng.integers(0, vocab, size=length).tolist(), response_text=f"a{i}", answer=str(i),
            topk_logprobs=values, topk_indices=idx, tail_mass=tail))
    out.append(TeacherRecord(example_id=n, prompt_messages=[{"role": "user", "content": "text only"}],
                             prompt_ids=[1, 2], response_ids=[3], response_text="x"))  # no logits
    return out


@pytest.mark.parametrize("vocab", [1024, 32000, 151936])
def test_bitpacking_round_trips(vocab):
    rng = np.random.default_rng(1)
    idx = rng.integers(0, vocab, size=999)
    idx[0], idx[1] = 0, vocab - 1
    bits = int(np.ceil(np.log2(vocab)))
    packed = pack_indices(idx, bits)
    assert packed.nbytes == int(np.ceil(999 * bits / 8))
    assert np.array_equal(unpack_indices(packed, bits, 999), idx)


@pytest.mark.parametrize("compress", [True, False])
def test_round_trip_is_exact(tmp_path, compress):
    recs = _records(7, vocab=32000, k=16, fp16_exact=compress)
    manifest = write_shard(tmp_path, 3, recs, vocab_size=32000, k=16, tok_hash="abc", compress=compress)
    assert manifest["values_dtype"] == ("float16" if compress else "float32")
    assert manifest["index_encoding"]["kind"] == ("bitpack" if compress else "plain")
    shard = read_shard(tmp_path, 3)
    assert len(shard.records) == len(recs)
    for a, b in zip(recs, shard.records):
        assert (a.example_id, a.prompt_ids, a.response_ids, a.response_text, a.answer, a.prompt_messages) == (
            b.example_id, b.prompt_ids, b.response_ids, b.response_text, b.answer, b.prompt_messages)
        assert a.has_topk == b.has_topk
        if a.has_topk:
            assert np.array_equal(a.topk_indices, b.topk_indices)
            assert np.array_equal(a.topk_logprobs, b.topk_logprobs.astype(np.float32))
            assert np.array_equal(a.tail_mass, b.tail_mass.astype(np.float32))
    m = read_manifest(tmp_path, 3)
    assert m["tokenizer_hash"] == "abc" and m["k"] == 16 and m["num_examples"] == 8
    assert m["num_response_tokens"] == sum(len(r.response_ids) for r in recs)


def test_corruption_is_caught_by_the_checksum(tmp_path):
    write_shard(tmp_path, 0, _records(3, 1024, 8), vocab_size=1024, k=8, tok_hash="h")
    path = tmp_path / "batch_0.safetensors"
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0xFF
    path.write_bytes(bytes(data))
    with pytest.raises(CorruptShardError, match="sha256"):
        read_shard(tmp_path, 0)
    quarantine_shard(tmp_path, 0)
    assert ready_shards(tmp_path) == []
    assert list(tmp_path.glob(".batch_0.*corrupt*"))


def test_manifest_written_last_marks_complete_shards(tmp_path):
    write_shard(tmp_path, 0, _records(2, 1024, 4), vocab_size=1024, k=4, tok_hash="h")
    (tmp_path / "batch_1.safetensors").write_bytes(b"half written")  # no manifest yet
    assert ready_shards(tmp_path) == [0]
    # a manifest whose tensor file differs in length is refused too
    m = json.loads((tmp_path / "batch_0.json").read_text())
    data = (tmp_path / "batch_0.safetensors").read_bytes()
    with pytest.raises(CorruptShardError):
        decode_shard(m, data[:-1])


def test_bytes_per_token_goal_for_32k_vocab_at_k32(tmp_path):
    """≤ 1/100 of fp16 full-vocabulary logits (64,000 bytes/token at V=32k)."""
    recs = _records(40, vocab=32000, k=32)
    data, manifest = encode_shard(0, recs, vocab_size=32000, k=32, tok_hash="h", compress=True)
    full = 2 * 32000
    assert manifest["topk_bytes_per_token"] <= 32 * 2 + 32 * 15 / 8 + 2 + 1e-9  # fp16 + 15-bit indices + tail
    assert manifest["bytes_per_token"] <= full / 100
    write_shard(tmp_path, 0, recs, vocab_size=32000, k=32, tok_hash="h")
    summary = store_summary(tmp_path)
    assert summary["ratio_vs_fp16_full"] <= 0.01
    _, plain = encode_shard(0, recs, vocab_size=32000, k=32, tok_hash="h", compress=False)
    assert plain["bytes"] > manifest["bytes"]


def test_encoding_is_canonical_and_plain_safetensors():
    """Same records → same bytes (a regenerated shard has the same checksum), readable by safetensors."""
    from safetensors.numpy import load

    recs = _records(5, 1024, 8)
    a, ma = encode_shard(0, recs, vocab_size=1024, k=8, tok_hash="h")
    b, mb = encode_shard(0, _records(5, 1024, 8), vocab_size=1024, k=8, tok_hash="h")
    assert a == b and ma["sha256"] == mb["sha256"]
    loaded = load(a)
    assert loaded["topk_values"].dtype == np.float16 and loaded["example_ids"].tolist() == [0, 1, 2, 3, 4, 5]
