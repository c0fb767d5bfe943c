"""The `diloco` strategy without a cluster: two gloo ranks (spawned processes) against one process.

DiLoCo's ranks take H local AdamW steps each, then average their token-weighted pseudo-gradients and
take one outer (Nesterov SGD) step. Checked here: (a) with H = 1, outer SGD of lr 1 without momentum and
a linear inner optimizer the outer step is exactly one process's (DDP's) step; (b) with H = 4 each rank
sends, per outer step, exactly what the codec makes of one pseudo-gradient (fp32, or blockwise int8:
a code per value and a scale per block), about 1/H (1/4H) of DDP's gradients for the same steps, and
the loss still falls about as DDP's does; (c) a pause lands on an outer step, and ranks resuming from
its checkpoint with a fresh strategy, model and optimizer (the shared weights, the outer momentum and
each rank's own inner AdamW state come from the files) end with the weights of the uninterrupted run; (d)
with a lossy codec (int8, sparse; issue 45 item 6) each rank's error-feedback buffer is in the checkpoint,
so ranks resumed from a pause end bitwise equal to the undisturbed run. What needs real machines (a member
killed or joining mid-job) stays in tests/cluster/test_cluster.py.

The same two spawned ranks also resolve `--strategy auto` over their gloo group on loopback (issue 45 item 4,
`test_auto_picks_ddp_on_loopback`; the decision's tables are tests/test_auto_strategy.py): two process starts
and their imports less than a module each (they were 30 s and 48-75 s of the CI tier on the 2-core machine).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from helpers import adapter_weights, assert_same_weights, run_gloo_ranks, tiny_train_cfg, train_dict

pytestmark = pytest.mark.timeout(400)

H, STEPS = 4, 12  # three outer steps
LINEAR = dict(optimizer="sgd", lr=0.05, max_grad_norm=None, eval_every=0)  # (a): plain SGD, unclipped
PLAIN_OUTER = {"inner_steps": 1, "outer_lr": 1.0, "outer_momentum": 0.0}
# (b), (c): outer lr 1 and momentum 0.5 (Nesterov), as the cluster's comparison with DDP: with a few outer
# steps the paper's 0.7/0.9 (made for thousands) overshoots. Momentum > 0: a checkpoint carries its buffer.
OUTER = {"inner_steps": H, "outer_lr": 1.0, "outer_momentum": 0.5}
CONTROL = 1024  # bytes of a run's small collectives besides the (pseudo-)gradients: stop codes, eval sums
# (d): two outer steps of H = 2; the paused run stops on the outer step at 2, its resume takes the second
RH, RSTEPS = 2, 4
CODECS = {"int8": {"codec": "int8", "outer_lr": 1.0, "outer_momentum": 0.5},
          "sparse": {"codec": "sparse", "outer_lr": 1.0, "chunk": 1024, "topk": 16}}  # sparse: no momentum


def _cfg(root: Path, out: str, steps: int = STEPS, **kw) -> dict:
    """An eval on every outer step (the loss the tests follow), without generation (nothing here reads it);
    a checkpoint due at step 6, in the middle of a round (it must wait for the outer step at 8)."""
    return tiny_train_cfg(root, out, steps, **{"eval_every": H, "eval_accuracy": False, "save_every": 6, **kw})


def _runs(rank: int, root: Path) -> dict:
    """(a) H = 1 with SGD; (b) H = 4 with fp32 and with int8 pseudo-gradients; (c) the fp32 run again, paused,
    then resumed from its checkpoint by a fresh strategy, model and optimizer (nothing kept in memory)."""
    from smolforge.parallel.strategies import make_strategy

    out = {}
    out["h1"], _ = train_dict(_cfg(root, "h1", 6, **LINEAR), make_strategy("diloco", PLAIN_OUTER))
    for codec in ("fp32", "int8"):
        out[codec], seen = train_dict(_cfg(root, codec), make_strategy("diloco", {**OUTER, "codec": codec}))
        out[codec + "_evals"] = seen["evals"]
    out["paused"], _ = train_dict(_cfg(root, "paused"), make_strategy("diloco", OUTER), pause_after=5)
    out["resumed"], _ = train_dict({**_cfg(root, "paused"), "resume": True}, make_strategy("diloco", OUTER))
    out.update(_error_feedback_runs(root))
    out["auto"] = _resolve_on_loopback(rank)
    return {k: v.to_dict() if hasattr(v, "to_dict") else v for k, v in out.items()}


def _error_feedback_runs(root: Path) -> dict:
    """(d) Per lossy codec: the undisturbed run, the run paused after step 1 (it lands on the outer step at
    RH), and its resume by a fresh strategy, model and optimizer (nothing kept in memory)."""
    from smolforge.parallel.strategies import make_strategy

    def cfg(out: str) -> dict:
        return tiny_train_cfg(root, "ef-" + out, RSTEPS, eval_every=0, eval_accuracy=False, save_every=0)

    out = {}
    for name, settings in CODECS.items():  # their keys "<codec>_ef...": (b) has an "int8" run of its own
        def strategy():
            return make_strategy("diloco", {"inner_steps": RH, **settings})

        out[name + "_ef"], _ = train_dict(cfg(name), strategy())
        out[name + "_ef_paused"], _ = train_dict(cfg(name + "_p"), strategy(), pause_after=1)
        out[name + "_ef_resumed"], _ = train_dict({**cfg(name + "_p"), "resume": True}, strategy())
    return out


def _resolve_on_loopback(rank: int) -> dict:
    """`auto` resolved over the ranks' group (tiny-llama, LoRA), what it emitted, the plan it got."""
    from smolforge.config import TrainConfig
    from smolforge.parallel.auto_probe import resolve
    from smolforge.parallel.rank_task import RankPlan
    from smolforge.parallel.strategies import strategy_class

    events: list[dict] = []
    train = TrainConfig(model="tiny-llama", data={"path": "bundled"}, batch_size=8)  # 8 rows of 256 tokens
    plan = RankPlan(train=train, strategy="auto",
                    strategy_config=strategy_class("auto").settings_dict({"probe_mb": 1.0}))
    got = resolve(plan, 2, events.append if rank == 0 else None)
    return {"strategy": got.strategy, "config": got.strategy_config, "events": events}


@pytest.fixture(scope="module")
def runs(tmp_path_factory) -> dict:
    """Every run, once for the module: the ranks' (by rank), and one process's with the global batch."""
    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    root = tmp_path_factory.mktemp("diloco")
    preset_dir("tiny-llama")  # built here, not by two ranks at once inside their group
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in generate(60, seed=7)))

    def one_process():  # the group's global batch (2 ranks x 1 row x 2 micro-batches): DDP's weights
        linear, _ = train_dict(_cfg(root, "one-h1", 6, batch_size=2, **LINEAR))
        adamw, seen = train_dict(_cfg(root, "one", batch_size=2))
        return {"h1": linear, "adamw": adamw, "adamw_evals": seen["evals"]}

    ranks, one = run_gloo_ranks(_runs, 2, root, meanwhile=one_process)
    return {"ranks": ranks, "one": one}


def test_one_inner_step_and_a_plain_outer_step_is_one_process_step(runs):
    """H = 1, outer SGD lr 1 without momentum, inner SGD, no clipping: the token-weighted average of the
    ranks' steps is the step one process takes with their whole batch (so DDP's)."""
    h1 = runs["ranks"][0]["h1"]
    assert h1["strategy"] == "diloco" and h1["steps"] == 6 and h1["rounds"] == 6
    assert_same_weights(adapter_weights(h1), adapter_weights(runs["one"]["h1"]), atol=1e-5, rtol=1e-4)


@pytest.mark.parametrize("codec", ["fp32", "int8"])
def test_h_inner_steps_send_one_coded_pseudo_gradient_per_outer_step(runs, codec):
    """Each rank sends per outer step what the codec makes of one pseudo-gradient of every trainable value
    (plus its token weight), and nothing else but a few scalars: DDP sends every gradient every step."""
    from smolforge.parallel.codecs import encode, payload_bytes

    one = runs["one"]["adamw"]
    n = one.trainable_params
    per_round = {"fp32": (n + 1) * 4,  # the pseudo-gradient and the token weight, one all-reduce
                 "int8": 8 + payload_bytes(encode(torch.zeros(n), "int8", 256))}[codec]  # fp64 weight, codes, scales
    ddp = STEPS * n * 4  # DDP's gradient all-reduces for the same steps (tests/test_zero1_strategy.py counts them)
    for r in (0, 1):
        res = runs["ranks"][r][codec]
        assert res["steps"] == STEPS and res["rounds"] == STEPS // H
        assert 0 <= res["comm_bytes_sent"] - res["rounds"] * per_round < CONTROL, (res["comm_bytes_sent"], per_round)
        # about 1/H of DDP's bytes; int8: a byte a value instead of four, and a 4-byte scale per 256 values
        share = 1 / H if codec == "fp32" else (1 + 4 / 256) / (4 * H)
        assert res["comm_bytes_sent"] <= share * ddp + CONTROL, (codec, res["comm_bytes_sent"], ddp)
    # the loss still falls, outer step after outer step, and ends near one process's (DDP's) at equal samples
    evals = [e["eval_loss"] for e in runs["ranks"][0][codec + "_evals"]]
    ref = [e["eval_loss"] for e in runs["one"]["adamw_evals"]]
    assert len(evals) == STEPS // H and evals == sorted(evals, reverse=True), evals
    assert evals[-1] <= 1.05 * ref[-1], (evals, ref)


def test_pause_lands_on_an_outer_step_and_a_resumed_run_ends_as_the_uninterrupted_one(runs):
    """The pause asked for after step 5 (and a checkpoint due at 6) waits for the outer step at 8; the
    checkpoint holds the shared weights, the outer momentum and each rank's own inner AdamW state; ranks
    resumed from it (a fresh strategy, model and optimizer each) end with the uninterrupted run's weights."""
    from smolforge.train.checkpoint import list_checkpoints

    paused, whole, resumed = runs["ranks"][0]["paused"], runs["ranks"][0]["fp32"], runs["ranks"][0]["resumed"]
    # the checkpoint due at step 6 (save_every) waited for the outer step too
    assert [c.name for c in list_checkpoints(whole["output_dir"])] == [f"step-{2 * H}", f"step-{STEPS}"]
    assert paused["stopped"] == "pause" and paused["steps"] == 2 * H
    assert Path(paused["checkpoint_dir"]).name == f"step-{2 * H}"
    blob = torch.load(Path(paused["checkpoint_dir"]) / "optim.pt", map_location="cpu", weights_only=True)
    assert blob["strategy"]["rounds"] == 2 and "outer_momentum_buffer" in blob["strategy"]
    parts = blob["optimizer"]["per_rank"]  # each rank's own AdamW: they saw different rows
    assert len(parts) == 2 and not torch.equal(parts[0]["state"][0]["exp_avg"], parts[1]["state"][0]["exp_avg"])
    assert resumed["data"]["resumed_from"].endswith(f"step-{2 * H}") and resumed["stopped"] is None
    assert resumed["steps"] == STEPS and resumed["rounds"] == STEPS // H
    assert_same_weights(adapter_weights(resumed), adapter_weights(whole), atol=1e-6)


@pytest.mark.parametrize("codec", list(CODECS))
def test_a_resumed_run_with_error_feedback_is_bitwise_the_undisturbed_one(runs, codec):
    """(d) The paused run's checkpoint holds each rank's own error-feedback buffer; without it the resumed
    run's next message lacks what the earlier ones could not carry, and its weights differ."""
    from smolforge.parallel.codecs import make_codec

    ranks = runs["ranks"]
    paused, resumed, whole = (ranks[0][codec + s] for s in ("_ef_paused", "_ef_resumed", "_ef"))
    assert paused["stopped"] == "pause" and paused["steps"] == RH
    # the checkpoint holds each rank's own buffer (they saw different rows: different residuals)
    blob = torch.load(Path(paused["checkpoint_dir"]) / "optim.pt", map_location="cpu", weights_only=True)
    errors = blob["strategy"]["error_feedback"]
    assert len(errors) == 2 and not torch.equal(errors[0], errors[1]) and float(errors[0].abs().max()) > 0
    assert resumed["data"]["resumed_from"].endswith(f"step-{RH}") and resumed["steps"] == RSTEPS
    a, b = adapter_weights(resumed), adapter_weights(whole)
    assert a.keys() == b.keys() and a
    assert all(torch.equal(a[k], b[k]) for k in a), [k for k in a if not torch.equal(a[k], b[k])][:3]
    # what each rank sent per outer step is the codec's formula (plus its fp64 token weight), and a few control scalars
    per_round = 8 + make_codec(**{"name": codec, **CODECS[codec]}).nbytes(whole["trainable_params"])
    assert 0 <= whole["comm_bytes_sent"] - (RSTEPS // RH) * per_round < CONTROL, (whole["comm_bytes_sent"], per_round)
    assert resumed["final_loss"] == whole["final_loss"]
    assert ranks[1][codec + "_ef_resumed"]["final_loss"] == ranks[1][codec + "_ef"]["final_loss"]


def test_auto_picks_ddp_on_loopback(runs):
    """Two gloo ranks on 127.0.0.1 measure both directions and their compute and pick ddp; only rank 0 states
    it (one `strategy_plan` event whose reason gives the rule and the measured numbers)."""
    got = {r: runs["ranks"][r]["auto"] for r in (0, 1)}
    assert got[0]["strategy"] == got[1]["strategy"] == "ddp", got[0]["events"]
    assert got[0]["config"] == got[1]["config"] == {}
    (event,) = got[0]["events"]
    assert not got[1]["events"]
    data = event["data"]
    assert event["kind"] == "strategy_plan" and data["strategy"] == "ddp"
    assert {(s["src"], s["dst"]) for s in data["links"]} == {(0, 1), (1, 0)}
    assert "within 10%" in data["reason"] and "Mbit/s" in data["reason"], data["reason"]
    assert data["numbers"]["ddp_comm_s"] <= 0.10 * data["numbers"]["step_s"]
