"""models/families: the one answer each path asks (issue 41).

Sections are by part of the issue; each part's tests stay in its own section.
"""

from __future__ import annotations

import pytest

from smolforge.models import families

# ============================================================================ stop set (issue 41, part A: stops)
# `families.stop_ids(tokenizer, source)`: the generation config's eos ids, the tokenizer's eos and the chat
# template's end of turn, checked against each twin's published files.

STOP_SETS = {
    "phi-3-mini-4k-instruct": ["<|endoftext|>", "<|assistant|>", "<|end|>"],
    "llama-3.2-1b-instruct": ["<|end_of_text|>", "<|eom_id|>", "<|eot_id|>"],
    "qwen2.5-0.5b-instruct": ["<|endoftext|>", "<|im_end|>"],
    "smollm2-360m-instruct": ["<|im_end|>"],
    "tinyllama-1.1b-chat-v1.0": ["</s>"],
    "gpt2": ["<|endoftext|>"],
}
STOP_IDS = {
    "phi-3-mini-4k-instruct": [32000, 32001, 32007],
    "llama-3.2-1b-instruct": [128001, 128008, 128009],
    "qwen2.5-0.5b-instruct": [151643, 151645],
    "smollm2-360m-instruct": [2],
    "tinyllama-1.1b-chat-v1.0": [2],
    "gpt2": [50256],
}
# The token a chat answer ends with (`turn_end_id`): the template's end of turn, else eos.
TURN_ENDS = {"phi-3-mini-4k-instruct": "<|end|>", "llama-3.2-1b-instruct": "<|eot_id|>",
             "qwen2.5-0.5b-instruct": "<|im_end|>", "smollm2-360m-instruct": "<|im_end|>",
             "tinyllama-1.1b-chat-v1.0": "</s>", "gpt2": "<|endoftext|>"}


@pytest.mark.parametrize("family", sorted(STOP_SETS))
def test_stop_set_per_twin(family):
    from smolforge.models.loading import load_tokenizer, resolve_model

    name = f"twin:{family}"
    tok, path = load_tokenizer(name), resolve_model(name)
    assert sorted(families.stop_ids(tok, path)) == STOP_IDS[family]
    assert families.stop_texts(tok, path) == STOP_SETS[family]
    assert tok.convert_ids_to_tokens(families.turn_end_id(tok)) == TURN_ENDS[family]


def test_cut_at_stop():
    assert families.cut_at_stop([5, 6, 9, 7, 9], {9, 7}) == [5, 6, 9]
    assert families.cut_at_stop([5, 6, 9, 7], {9, 7}, keep=False) == [5, 6]
    assert families.cut_at_stop([5, 6], {9}) == [5, 6] and families.cut_at_stop([], {9}) == []
