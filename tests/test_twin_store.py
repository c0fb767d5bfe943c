"""The teacher store at the vocabularies people run (issue 30, item 4): Qwen2.5's 151,936 tokens.

The reduced Qwen2.5-0.5B-Instruct twin (published vocabulary, tied embeddings, qkv bias, GQA; two
narrow layers, random weights) is the teacher: its outputs go through the store's codec and come
back with the same id set per row (ids need 18 bits at this vocabulary), log-probs within the codec's
bound, and the whole shard at most 100 bytes per response token at k = 32. The full-size twin's number
is in BENCHMARKS.md ("Teacher store"); the size of a shard is what the codec decided, not a clock.
"""

from __future__ import annotations

import numpy as np
import pytest

from smolforge.distill.prompts import GenSettings, PromptItem
from smolforge.distill.store import encode_shard, index_bits, read_shard, store_summary, write_shard_bytes
from smolforge.distill.teacher import make_teacher

QWEN = "twin:qwen2.5-0.5b-instruct"
VOCAB = 151_936


@pytest.fixture(scope="module")
def twin_records():
    teacher = make_teacher(QWEN, "hf", device="cpu")
    prompts = [PromptItem(i, [{"role": "user", "content": f"What is {i} plus {2 * i + 3}? Answer briefly."}],
                          answer=str(3 * i + 3)) for i in range(6)]
    records = teacher.generate(prompts, GenSettings(max_new_tokens=24, top_k=32, batch_size=6))
    return teacher, records


def _by_id(values: np.ndarray, ids: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    order = np.argsort(ids, axis=1)
    return np.take_along_axis(values, order, 1), np.take_along_axis(ids, order, 1)


def test_the_twin_teacher_has_the_published_vocabulary(twin_records):
    teacher, records = twin_records
    assert teacher.vocab_size == VOCAB and index_bits(VOCAB) == 18
    assert all(r.has_topk and r.topk_indices.shape[1] == 32 for r in records)
    assert max(int(r.topk_indices.max()) for r in records) < VOCAB


def test_codec_round_trip_and_bytes_per_token_at_151936(twin_records, tmp_path):
    teacher, records = twin_records
    data, manifest = encode_shard(0, records, vocab_size=teacher.vocab_size, k=32, tok_hash=teacher.tok_hash)
    assert manifest["vocab_size"] == VOCAB and manifest["k"] == 32
    assert manifest["bytes_per_token"] <= 100, manifest["bytes_per_token"]
    write_shard_bytes(tmp_path, manifest, data)
    shard = read_shard(tmp_path, 0)
    assert store_summary(tmp_path)["bytes_per_token"] == manifest["bytes_per_token"]
    for a, b in zip(records, shard.records):
        assert (a.prompt_ids, a.response_ids) == (b.prompt_ids, b.response_ids)
        va, ia = _by_id(a.topk_logprobs, a.topk_indices)
        vb, ib = _by_id(b.topk_logprobs, b.topk_indices)
        assert np.array_equal(ia, ib), "an id changed on the way through the store"
        top, span = va.max(1, keepdims=True), va.max(1, keepdims=True) - va.min(1, keepdims=True)
        assert np.all(np.abs(va - vb) <= span / 510 + (np.abs(top) + span) * 2.0 ** -11 + 1e-6)
        # greedy decoding: each response token is the teacher's top-1 at its row
        assert np.array_equal(a.topk_indices[np.arange(len(a.response_ids)), a.topk_logprobs.argmax(1)],
                              np.asarray(a.response_ids))
