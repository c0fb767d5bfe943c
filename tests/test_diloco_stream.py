"""Streaming DiLoCo (fragments synced on a staggered schedule, each merged `overlap` steps after its send):
two gloo ranks (spawned processes), tiny-llama, 8 steps, H = 4.

Checked: (a) fragments 1, overlap 0 is bitwise the whole-model DiLoCo as it was before streaming (a frozen
copy of its outer step, `Before`); (b) two fragments with overlap 1 give the same weights, bitwise, whether
each transfer runs in a background thread on its own group or blocking at send time: the background
machinery changes no number; (c) a pause lands where no fragment is in flight, and ranks resumed from its
checkpoint (each rank's own weights and tokens since each fragment's send come from it) end with the
weights of the uninterrupted streamed run.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import adapter_weights, run_gloo_ranks, tiny_train_cfg, train_dict

pytestmark = pytest.mark.timeout(400)

H, STEPS = 4, 8
OUTER = {"inner_steps": H, "outer_lr": 1.0, "outer_momentum": 0.5}
STREAM = {**OUTER, "fragments": 2, "overlap": 1}  # fragment 1 sent at 2, 6 (merged 3, 7); fragment 0 at 4, 8


def _before():
    """DiLoCo's outer step as it was before fragments (main at 34efd3f), frozen here: one flat shared vector,
    one outer SGD, the whole model sent and merged every H steps."""
    from smolforge.parallel.strategies.diloco import DiLoCo

    class Before(DiLoCo):
        def wrap(self, model, device):
            out = super().wrap(model, device)
            with torch.no_grad():
                self.flat_shared = torch.nn.Parameter(self._flat(), requires_grad=False)
            self.flat_outer = torch.optim.SGD([self.flat_shared], lr=self.outer_lr, momentum=self.outer_momentum,
                                              nesterov=self.nesterov)
            self.steps_in, self.tokens_in = 0, 0.0
            return out

        def after_step(self, step, model, optimizer, *, targets=0.0):
            self.last_step, self.steps_in, self.tokens_in = step, self.steps_in + 1, self.tokens_in + targets
            if self.steps_in >= self.inner_steps:
                self._outer_before()

        def finish(self, model, optimizer):
            if self.steps_in:
                self._outer_before()

        @torch.no_grad()
        def _outer_before(self):
            weight = max(self.tokens_in, 1.0)
            total, avg = self._average((self.flat_shared - self._flat()) * weight, weight)
            self.flat_shared.grad = avg / total
            self.flat_outer.step()
            self.flat_shared.grad = None
            offset = 0
            for p in self.params:
                p.copy_(self.flat_shared[offset:offset + p.numel()].view_as(p).to(p.dtype))
                offset += p.numel()
            self.rounds, self.steps_in, self.tokens_in = self.rounds + 1, 0, 0.0

    return Before(**OUTER)


def _cfg(root: Path, out: str, **kw) -> dict:
    return tiny_train_cfg(root, out, STEPS, **{"eval_every": 0, "eval_accuracy": False, "save_every": 0,
                                               "max_new_tokens": 1, **kw})


def _runs(rank: int, root: Path) -> dict:
    from smolforge.parallel.strategies import make_strategy

    out = {"before": train_dict(_cfg(root, "before"), _before())[0],
           "plain": train_dict(_cfg(root, "plain"), make_strategy("diloco", OUTER))[0]}
    for name, background in (("streamed", True), ("blocking", False)):
        out[name] = train_dict(_cfg(root, name), make_strategy("diloco", {**STREAM, "background": background}))[0]
    for codec in ("fp32", "int8"):  # int8: each fragment's error-feedback residual goes into the checkpoint too
        tag, config = ("" if codec == "fp32" else "_" + codec), {**STREAM, "codec": codec}
        if codec != "fp32":
            out["streamed" + tag] = train_dict(_cfg(root, "streamed" + tag), make_strategy("diloco", config))[0]
        out["paused" + tag], _ = train_dict(_cfg(root, "paused" + tag), make_strategy("diloco", config), pause_after=5)
        out["resumed" + tag], _ = train_dict({**_cfg(root, "paused" + tag), "resume": True},
                                             make_strategy("diloco", config))
    return {k: v.to_dict() for k, v in out.items()}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    root = tmp_path_factory.mktemp("diloco-stream")
    preset_dir("tiny-llama")  # built here, not by two ranks at once inside their group
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in generate(40, seed=7)))
    ranks, _ = run_gloo_ranks(_runs, 2, root)
    return ranks


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_one_fragment_without_overlap_is_bitwise_the_diloco_before_streaming(runs):
    for r in (0, 1):
        plain, before = runs[r]["plain"], runs[r]["before"]
        assert plain["rounds"] == before["rounds"] == STEPS // H
        assert plain["strategy_metrics"] == {"fragment_syncs": STEPS // H, "background_syncs": 0}
        assert plain["comm_bytes_sent"] == before["comm_bytes_sent"]
    assert _same(adapter_weights(runs[0]["plain"]), adapter_weights(runs[0]["before"]))


def test_a_streamed_fragment_sync_gives_the_weights_of_a_blocking_one(runs):
    """The same schedule and overlap: the transfer in a background thread (its own group) or at send time,
    blocking, merged at the same step either way; and both differ from the whole-model sync (the schedule
    did change what is merged when)."""
    streamed, blocking = runs[0]["streamed"], runs[0]["blocking"]
    # fragment 1 at 2 and 6, fragment 0 at 4 and 8 (landed in finish), fragment 1's last 2 steps in finish
    assert streamed["strategy_metrics"] == {"fragment_syncs": 5, "background_syncs": 4}
    assert blocking["strategy_metrics"] == {"fragment_syncs": 5, "background_syncs": 0}
    assert streamed["comm_bytes_sent"] == blocking["comm_bytes_sent"]
    assert _same(adapter_weights(streamed), adapter_weights(blocking))
    assert not _same(adapter_weights(streamed), adapter_weights(runs[0]["plain"]))


@pytest.mark.parametrize("tag", ["", "_int8"])
def test_a_streamed_run_pauses_with_nothing_in_flight_and_resumes_exactly(runs, tag):
    """The pause asked after step 5 lands at 5 (fragment 0's flight merged there, fragment 1's not yet sent);
    the checkpoint holds each rank's own weights and tokens (int8: and every fragment's error-feedback
    residual); the resumed ranks end as the uninterrupted run, bitwise."""
    paused, resumed = runs[0]["paused" + tag], runs[0]["resumed" + tag]
    assert paused["stopped"] == "pause" and paused["steps"] == 5
    blob = torch.load(Path(paused["checkpoint_dir"]) / "optim.pt", map_location="cpu", weights_only=True)
    state = blob["strategy"]
    assert state["since"] == [1, 3] and len(state["local"]) == 2 and len(state["shared"]) == 2
    assert not torch.equal(state["local"][0], state["local"][1])  # the ranks' own weights differ mid-round
    assert resumed["steps"] == STEPS and resumed["stopped"] is None
    assert ("error_feedback" in state) == bool(tag)
    assert _same(adapter_weights(resumed), adapter_weights(runs[0]["streamed" + tag]))
