"""The parameter servers' codecs, server and workers' error feedback without a model: what a server applies
is exactly what the workers sent, a payload costs what its codec says, and the residuals a checkpoint keeps
are each worker's before its first push at or past the step it resumes from."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from smolforge.parallel.codecs import ErrorFeedback, make_codec, payload_bytes
from smolforge.parallel.strategies import STRATEGIES
from smolforge.parallel.strategies.ps_feedback import FeedbackMarks
from smolforge.parallel.strategies.sync_ps import SyncPSServer

NUMEL, SPARSE = 3000, {"codec": "sparse", "chunk": 256, "topk": 8, "bits": 2}  # 12 chunks, the last padded


class Recording(SyncPSServer):
    """sync-ps's server keeping every gradient it applies."""

    def _apply(self, grad: torch.Tensor, lr: float, max_norm: float | None) -> None:
        self.applied_grads = [*getattr(self, "applied_grads", []), grad.clone()]
        super()._apply(grad, lr, max_norm)


def server(config: dict, world: int = 2, start: int = 0, state: dict | None = None) -> Recording:
    """A sync-ps server of one flat weight (zeros) and plain SGD at lr 1: a step subtracts the gradient."""
    core = Recording(STRATEGIES["sync-ps"].Settings(deadline_s=60.0, **config).model_dump(), world)
    core.setup({"names": ["w"], "shapes": [(NUMEL,)], "weights": {"w": np.zeros(NUMEL, np.float32)},
                "groups": [{"names": ["w"], "weight_decay": 0.0}], "optimizer": "SGD", "defaults": {"lr": 1.0},
                "start": start, "steps": 4, "state": state})
    return core


def one_step(core: Recording, streams: list[ErrorFeedback], gen: torch.Generator, marks=None) -> list[dict]:
    """Every member claims its part of the open step and pushes a random gradient through its stream."""
    payloads = []
    for member, stream in enumerate(streams):
        got = core.claim(member, wait_s=5.0, have=core.version)
        if marks is not None:
            marks[member].before_push(got["step"])
        payloads.append(stream.encode(torch.randn(NUMEL, generator=gen)))
        reply = core.push(member, got["step"], got["part"], core.version, payloads[-1], 0.5, 1.0, None)
        assert reply["accepted"], reply
    return payloads


def test_sparse_pushes_aggregate_exactly_what_was_sent_and_cost_what_they_claim():
    """Two workers push sparse (top 8 of 256 at 2 bits) with error feedback kept on each: every step the
    server applies exactly the sum of the decoded parts (bitwise, nothing re-quantised: the codec's own
    `aggregate` too), each payload's bytes are `nbytes` (3.4 % of fp32 here), and over the run what
    arrived plus each worker's residual is what the workers computed."""
    core, gen = server(SPARSE), torch.Generator().manual_seed(0)
    coder = make_codec(**{"name": "sparse", **SPARSE})
    streams = [ErrorFeedback(coder) for _ in range(2)]
    sent, computed = torch.zeros(NUMEL), torch.zeros(NUMEL)
    for step in range(4):
        state = gen.get_state()
        payloads = one_step(core, streams, gen)
        gen.set_state(state)
        computed += sum(torch.randn(NUMEL, generator=gen) for _ in streams)
        applied = core.applied_grads[step]
        assert torch.equal(applied, coder.decode(payloads[0], NUMEL) + coder.decode(payloads[1], NUMEL))
        assert torch.equal(applied, coder.aggregate(payloads, [1.0, 1.0], NUMEL))
        assert all(payload_bytes(p) == coder.nbytes(NUMEL) == 12 * (2 * 8 + 4) + 24 for p in payloads)
        sent += applied
    assert core.version == 4
    torch.testing.assert_close(sent + streams[0].residual + streams[1].residual, computed, atol=1e-4, rtol=0)
    assert (applied != 0).sum() <= 2 * 12 * 8  # only what was sent moved the weights


def test_a_snapshot_keeps_each_workers_residual_before_its_first_push_at_the_resume_step():
    """Step 2 is open: member 1 pushed its part, member 0 has not. The snapshot resumes at step 2, so it keeps
    member 1's residual from *before* its step-2 push and member 0's current one, with the codec's settings;
    a server set up from that state hands each member its residual back with its first claim."""
    core, gen = server({"codec": "int8", "block": 64}), torch.Generator().manual_seed(1)
    streams = [ErrorFeedback("int8", block=64) for _ in range(2)]
    marks = [FeedbackMarks(s) for s in streams]
    for _ in range(2):
        one_step(core, streams, gen, marks)
    before = streams[1].residual.clone()
    got = core.claim(1, wait_s=5.0, have=core.version)
    marks[1].before_push(got["step"])
    core.push(1, got["step"], got["part"], core.version, streams[1].encode(torch.randn(NUMEL, generator=gen)),
              0.5, 1.0, None)
    assert not torch.equal(streams[1].residual, before)  # the step-2 push moved member 1's residual on
    core.put_feedback(1, 1, marks[1].table())  # its answer to the request the snapshot is about to raise
    snap = core.snapshot(0, marks[0].table(), wait_s=5.0)
    state = snap["state"]
    assert snap["resume_step"] == 2 and state["error_feedback_step"] == 2
    assert state["error_feedback_codec"] == {"codec": "int8", "block": 64} and state["error_feedback_world"] == 2
    assert np.array_equal(state["error_feedback"][0], streams[0].residual.numpy())
    assert np.array_equal(state["error_feedback"][1], before.numpy())
    again = server({"codec": "int8", "block": 64}, start=2, state=state)
    assert np.array_equal(again.claim(1, wait_s=5.0, have=-1)["feedback"], before.numpy())
    other = server({"codec": "int8", "block": 128}, start=2, state=state)
    assert "feedback" not in other.claim(1, wait_s=5.0, have=-1)  # other settings: the residuals start at zero
    # other settings: the pull's shadow (ps_pull.py) starts from the weights too, said beside it
    assert [n["kind"] for n in other.stats()["notes"]] == ["error_feedback_reset", "pull_shadow_reset"]


@pytest.mark.parametrize("name", ["sync-ps", "async-ps", "ssp", "diloco"])
def test_every_strategy_that_sends_through_a_codec_takes_every_codec_and_its_refusals(name):
    """One set of codec fields (`parallel/codec_settings.py`) for diloco and the parameter servers: each
    takes every registered codec (int4 too: the servers' list was fixed at four before), builds it with the
    settings given, and refuses what the codec itself refuses, in the codec's words."""
    from smolforge.parallel.codecs import CODECS

    for codec in CODECS:
        settings = STRATEGIES[name].Settings(codec=codec, block=128, chunk=1024, topk=16, bits=4).model_dump()
        assert make_codec(settings["codec"], **settings).settings()["codec"] == codec
    settings = STRATEGIES[name].Settings(codec="sparse", chunk=1024, topk=16, bits=4).model_dump()
    assert make_codec(settings["codec"], **settings).settings() == {"codec": "sparse", "chunk": 1024, "topk": 16,
                                                                    "bits": 4}
    with pytest.raises(ValueError, match="topk 128 is more than a chunk"):
        STRATEGIES[name].Settings(codec="sparse", chunk=64, topk=128)
    with pytest.raises(ValueError, match="int4 codec: block must be even"):
        STRATEGIES[name].Settings(codec="int4", block=129)
    with pytest.raises(ValueError, match="unknown codec 'int3'"):
        STRATEGIES[name].Settings(codec="int3")


def test_a_fixed_deadline_is_used_as_given_and_the_ceiling_bounds_only_the_adaptive_one():
    """`deadline_s` is "a fixed deadline per step": 120 s waits 120 s, though the adaptive deadline's ceiling
    `deadline_max_s` is 30 by default (it was clamped to 30: a loaded machine closed a step without a part
    in a test that asked for 120). Without it, a step waits the ceiling until four parts have arrived."""
    settings = STRATEGIES["sync-ps"].Settings
    fixed = SyncPSServer(settings(deadline_s=120.0).model_dump(), 2)
    adaptive = SyncPSServer(settings(deadline_max_s=7.0).model_dump(), 2)
    for core in (fixed, adaptive):
        core.setup({"names": ["w"], "shapes": [(4,)], "weights": {"w": np.zeros(4, np.float32)},
                    "groups": [{"names": ["w"], "weight_decay": 0.0}], "optimizer": "SGD", "defaults": {"lr": 1.0},
                    "start": 0, "steps": 1, "state": None})
    assert (fixed.deadline_len(), adaptive.deadline_len()) == (120.0, 7.0)
