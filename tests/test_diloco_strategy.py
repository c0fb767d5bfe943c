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

(e) Streaming DiLoCo (was tests/test_diloco_stream.py; its own docstring below, `_stream_runs`) and (f) mixed
speeds (`inner_steps_by_speed`, the gloo half of tests/test_diloco_speeds.py) run in the same ranks, each on
its own data dir (`stream/`, `speeds/`: the rows those modules had).

The same two spawned ranks also resolve `--strategy auto` over their gloo group on loopback (issue 45 item 4,
`test_auto_picks_ddp_on_loopback`; the decision's tables are tests/test_auto_strategy.py): two process starts
and their imports less than a module each (they were 30 s and 48-75 s of the CI tier on the 2-core machine;
stream and speeds: two more).
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
AGREE = 16  # bytes a round's agreement sends: the stop code and whether a joiner waits (int64 each, `DiLoCo.agree`)
# (d): two outer steps of H = 2; the paused run stops on the outer step at 2, its resume takes the second
RH, RSTEPS = 2, 4
CODECS = {"int8": {"codec": "int8", "outer_lr": 1.0, "outer_momentum": 0.5},
          "int4": {"codec": "int4", "outer_lr": 1.0, "outer_momentum": 0.5},
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
    out["stream"] = _stream_runs(rank, root / "stream")
    out["speeds"] = _speeds_run(rank, root / "speeds")
    out["agree"] = _agree_run(rank)
    return {k: v.to_dict() if hasattr(v, "to_dict") else v for k, v in out.items()}


def _agree_run(rank: int) -> dict:
    """(g) The strategy alone, streamed (`STREAM`: fragment 1 sent at 2 and 6, merged at 3 and 7; fragment 0
    at 4 and 8, merged at 5 and 9) with `merge: delta` on a 4x4 linear layer whose every weight each step moves
    by 0.01 on rank 0, 0.02 on rank 1: rank 1 alone asks to cancel after step 1. What `agree` returned at each
    step on this rank, the bytes it handed to collectives (and what one sync of each fragment sends), and how
    far fragment 1's weights were from its new shared weights right after its merge at step 3 (delta: that
    step's own move)."""
    from smolforge.parallel.strategies import make_strategy

    torch.manual_seed(0)
    model = torch.nn.Linear(4, 4)
    strategy = make_strategy("diloco", {**STREAM, "codec": "int8", "merge": "delta"})
    strategy.wrap(model, torch.device("cpu"))
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    agreed, past_shared = [], None
    for step in range(1, 10):
        with torch.no_grad():
            for p in model.parameters():
                p.add_(0.01 * (rank + 1))  # an inner step of sorts: the weights move
        strategy.after_step(step, model, opt, targets=1.0)
        agreed.append(strategy.agree(2 if (rank == 1 and step == 1) else 0, torch.device("cpu")))
        if step == 3:
            frag = strategy.frags[1]
            past_shared = (strategy._flat(frag) - frag.shared.detach()).tolist()
    strategy.finish(model, opt)
    return {"agreed": agreed, "bytes": strategy.bytes_sent, "syncs": strategy.syncs, "past_shared": past_shared,
            "rounds": strategy.rounds, "payloads": [8 + f.feedback.coder.nbytes(f.end - f.start) for f in strategy.frags]}


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
    # 8 rows of 256 tokens, packed (auto's step estimate counts the data's padded tokens: packed rows fill max_length)
    train = TrainConfig(model="tiny-llama", data={"path": "bundled", "packing": True}, batch_size=8)
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
    for sub in ("stream", "speeds"):  # (e), (f): the rows their modules had
        (root / sub).mkdir()
        (root / sub / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in generate(40, seed=7)))

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


def test_the_runs_last_checkpoint_sends_no_ranks_inner_state(runs):
    """After `finish` every rank holds the shared weights: the last checkpoint keeps rank 0's inner AdamW state
    only, marked `ended`, and nothing of another rank's crosses the link (gathering every rank's moments and
    residual took 9-15 minutes at 20 Mbit/s with llama-100m). The fp32 run checkpoints at 8 and at its end,
    the paused run at 8 only: rank 1 sent the same checkpoint bytes in both, but for the RNG states."""
    from smolforge.train.checkpoint import list_checkpoints

    for r in (0, 1):
        whole, paused = runs["ranks"][r]["fp32"], runs["ranks"][r]["paused"]
        # the RNG states (a CPU generator's is 5,056 bytes) against ~600 kB of a checkpoint at step 8
        extra = whole["checkpoint_bytes_sent"] - paused["checkpoint_bytes_sent"]
        assert 0 <= extra < paused["checkpoint_bytes_sent"] / 50, (extra, paused["checkpoint_bytes_sent"])
    last = list_checkpoints(runs["ranks"][0]["fp32"]["output_dir"])[-1]
    blob = torch.load(last / "optim.pt", map_location="cpu", weights_only=True)
    assert last.name == f"step-{STEPS}" and blob["strategy"]["ended"] is True
    assert len(blob["optimizer"]["per_rank"]) == 1 and "error_feedback" not in blob["strategy"]
    ef = list_checkpoints(runs["ranks"][0]["int8_ef"]["output_dir"])[-1]  # a lossy codec's: no buffers either
    assert "error_feedback" not in torch.load(ef / "optim.pt", map_location="cpu", weights_only=True)["strategy"]


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


# -- (e) Streaming DiLoCo (was tests/test_diloco_stream.py) ----------------------------------------
#
# Streaming DiLoCo (fragments synced on a staggered schedule, each merged `overlap` steps after its send):
# two gloo ranks (spawned processes), tiny-llama, 8 steps, H = 4.
#
# Checked: (a) fragments 1, overlap 0 is bitwise the whole-model DiLoCo as it was before streaming (a frozen
# copy of its outer step, `Before`); (b) two fragments with overlap 1 give the same weights, bitwise, whether
# each transfer runs in a background thread on its own group or blocking at send time: the background
# machinery changes no number; (c) a pause lands where no fragment is in flight, and ranks resumed from its
# checkpoint (each rank's own weights and tokens since each fragment's send come from it) end with the
# weights of the uninterrupted streamed run.

SH, SSTEPS = 4, 8
SOUTER = {"inner_steps": SH, "outer_lr": 1.0, "outer_momentum": 0.5}
STREAM = {**SOUTER, "fragments": 2, "overlap": 1}  # fragment 1 sent at 2, 6 (merged 3, 7); fragment 0 at 4, 8


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

        def _mean_before(self, delta, weight):  # `DiLoCo._average` as it was: whole tensors, encoded in flight
            import torch.distributed as dist

            from smolforge.parallel.codecs import pack_payload, unpack_payload

            coder = self.feedback.coder
            if coder.summable:
                packed = torch.cat([delta * weight, torch.tensor([weight])])
                self._count(packed)
                dist.all_reduce(packed)
                return packed[:-1] / packed[-1]
            every_w = [float(w) for w in self._gather(torch.tensor([weight], dtype=torch.float64))]
            payload = self.feedback.encode(delta)
            parts = [unpack_payload(b, payload) for b in self._gather(pack_payload(payload))]
            return coder.aggregate(parts, [w / sum(every_w) for w in every_w], delta.numel())

        @torch.no_grad()
        def _outer_before(self):
            weight = max(self.tokens_in, 1.0)
            self.flat_shared.grad = self._mean_before(self.flat_shared - self._flat(), weight)  # the weighted mean
            self.flat_outer.step()
            self.flat_shared.grad = None
            offset = 0
            for p in self.params:
                p.copy_(self.flat_shared[offset:offset + p.numel()].view_as(p).to(p.dtype))
                offset += p.numel()
            self.rounds, self.steps_in, self.tokens_in = self.rounds + 1, 0, 0.0
            self.round_ended = True  # `DiLoCo.agree` meets the others after this step, as it did

    return Before(**SOUTER)


def _stream_cfg(root: Path, out: str, **kw) -> dict:
    return tiny_train_cfg(root, out, SSTEPS, **{"eval_every": 0, "eval_accuracy": False, "save_every": 0,
                                                "max_new_tokens": 1, **kw})


def _stream_runs(rank: int, root: Path) -> dict:
    """(e) Streaming DiLoCo's runs, on `root`'s rows."""
    from smolforge.parallel.strategies import make_strategy

    out = {"before": train_dict(_stream_cfg(root, "before"), _before())[0],
           "plain": train_dict(_stream_cfg(root, "plain"), make_strategy("diloco", SOUTER))[0]}
    for name, background in (("streamed", True), ("blocking", False)):
        out[name] = train_dict(_stream_cfg(root, name), make_strategy("diloco", {**STREAM, "background": background}))[0]
    for codec in ("fp32", "int8"):  # int8: each fragment's error-feedback residual goes into the checkpoint too
        tag, config = ("" if codec == "fp32" else "_" + codec), {**STREAM, "codec": codec}
        if codec != "fp32":
            out["streamed" + tag] = train_dict(_stream_cfg(root, "streamed" + tag), make_strategy("diloco", config))[0]
        out["paused" + tag], _ = train_dict(_stream_cfg(root, "paused" + tag), make_strategy("diloco", config),
                                            pause_after=5)
        out["resumed" + tag], _ = train_dict({**_stream_cfg(root, "paused" + tag), "resume": True},
                                             make_strategy("diloco", config))
    return {k: v.to_dict() for k, v in out.items()}


def counts(run: dict) -> dict:
    """A run's sync counters (its strategy metrics less the seconds)."""
    return {k: v for k, v in run["strategy_metrics"].items() if not k.endswith("_s")}


def _same(a: dict, b: dict) -> bool:
    return a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)


def test_one_fragment_without_overlap_is_bitwise_the_diloco_before_streaming(runs):
    runs = {r: runs["ranks"][r]["stream"] for r in (0, 1)}
    for r in (0, 1):
        plain, before = runs[r]["plain"], runs[r]["before"]
        assert plain["rounds"] == before["rounds"] == SSTEPS // SH
        assert counts(plain) == {"fragment_syncs": SSTEPS // SH, "background_syncs": 0}
        # a sync's seconds by kind: its own passes (cpu) and inside the collectives (transfer), both spent
        assert plain["strategy_metrics"]["sync_cpu_s"] > 0 and plain["strategy_metrics"]["sync_transfer_s"] > 0
        assert plain["comm_bytes_sent"] == before["comm_bytes_sent"]
    assert _same(adapter_weights(runs[0]["plain"]), adapter_weights(runs[0]["before"]))


def test_a_streamed_fragment_sync_gives_the_weights_of_a_blocking_one(runs):
    """The same schedule and overlap: the transfer in a background thread (its own group) or at send time,
    blocking, merged at the same step either way; and both differ from the whole-model sync (the schedule
    did change what is merged when)."""
    runs = {r: runs["ranks"][r]["stream"] for r in (0, 1)}
    streamed, blocking = runs[0]["streamed"], runs[0]["blocking"]
    # fragment 1 at 2 and 6, fragment 0 at 4 and 8 (landed in finish), fragment 1's last 2 steps in finish
    assert counts(streamed) == {"fragment_syncs": 5, "background_syncs": 4}
    assert counts(blocking) == {"fragment_syncs": 5, "background_syncs": 0}
    assert streamed["comm_bytes_sent"] == blocking["comm_bytes_sent"]
    assert _same(adapter_weights(streamed), adapter_weights(blocking))
    assert not _same(adapter_weights(streamed), adapter_weights(runs[0]["plain"]))


@pytest.mark.parametrize("tag", ["", "_int8"])
def test_a_streamed_run_pauses_with_nothing_in_flight_and_resumes_exactly(runs, tag):
    """The pause asked after step 5 is agreed at 5, where the ranks meet (the round's end: fragment 0 merged
    there; between rounds they share no collective), and lands there (nothing in flight: fragment 1 goes out
    at 6); the checkpoint holds each rank's own weights and tokens (int8: and every fragment's
    error-feedback residual); the resumed ranks end as the uninterrupted run, bitwise."""
    runs = {r: runs["ranks"][r]["stream"] for r in (0, 1)}
    paused, resumed = runs[0]["paused" + tag], runs[0]["resumed" + tag]
    assert paused["stopped"] == "pause" and paused["steps"] == 5
    blob = torch.load(Path(paused["checkpoint_dir"]) / "optim.pt", map_location="cpu", weights_only=True)
    state = blob["strategy"]
    assert state["since"] == [1, 3] and len(state["local"]) == 2 and len(state["shared"]) == 2
    assert not torch.equal(state["local"][0], state["local"][1])  # the ranks' own weights differ mid-round
    assert resumed["steps"] == SSTEPS and resumed["stopped"] is None
    assert ("error_feedback" in state) == bool(tag)
    assert _same(adapter_weights(resumed), adapter_weights(runs[0]["streamed" + tag]))


# -- (f) mixed speeds under DiLoCo, two gloo ranks (was tests/test_diloco_speeds.py's fixture) ----------

FH, FSTEPS = 4, 12
SPEED_SECONDS = [1.0, 3.0]  # injected seconds per inner step: rank 1 three times slower


def _speeds_run(rank: int, root: Path) -> dict:
    """(f) One rank of the mixed-speeds run, its step times injected (rank 1's 3x rank 0's)."""
    from smolforge.parallel.strategies import make_strategy

    s = make_strategy("diloco", {"inner_steps": FH, "outer_lr": 1.0, "outer_momentum": 0.5,
                                 "inner_steps_by_speed": True})
    s.observe = lambda rows, started, ended, targets=0.0: s.meter.add(rows, SPEED_SECONDS[rank])  # injected
    taken, weights = [], []
    rows_for, replan = s.rows_for, s._replan
    s.rows_for = lambda step, total: taken.append((step, *rows_for(step, total))) or taken[-1][1:]
    s._replan = lambda weight: weights.append(weight) or replan(weight)
    cfg = tiny_train_cfg(root, "speeds", FSTEPS, eval_every=0, eval_accuracy=False, save_every=0, max_new_tokens=1)
    result, seen = train_dict(cfg, s)
    return {"result": result.to_dict(), "taken": taken, "weights": weights, "notes": s.notes,
            "inner_steps": len(seen["steps"])}


def test_a_three_times_slower_rank_runs_a_third_of_the_inner_steps_weighted_by_tokens(runs):
    ranks = {r: runs["ranks"][r]["speeds"] for r in (0, 1)}
    plans = [n for n in ranks[0]["notes"] if n["kind"] == "diloco_plan"]
    assert [n["step"] for n in plans] == [4, 8, 12]  # one outer step per round, both ranks at the same step
    assert plans[0]["rates"][0] == pytest.approx(3 * plans[0]["rates"][1])
    assert [n["inner_steps"] for n in plans] == [[6, 2]] * 3  # decided at each outer step, from the rates
    # round 1 even (nothing measured yet), then 6 and 2: rank 1 a third of rank 0's inner steps
    assert ranks[0]["inner_steps"] == 4 + 6 + 6 and ranks[1]["inner_steps"] == 4 + 2 + 2
    # every part of every global step trained once, by one rank: the global batch is the same
    rows = sorted((step, first) for r in (0, 1) for step, first, _count in ranks[r]["taken"])
    assert rows == sorted((step, first) for step in range(FSTEPS) for first in (0, 2))
    # the average is token-weighted: the weights exchanged are the tokens each rank trained in the round
    for i, note in enumerate(plans):
        assert note["weights"] == [ranks[0]["weights"][i], ranks[1]["weights"][i]]
    assert all(n["weights"][0] > 2 * n["weights"][1] for n in plans[1:])
    for r in (0, 1):
        assert ranks[r]["result"]["steps"] == FSTEPS and ranks[r]["result"]["rounds"] == 3


@pytest.mark.parametrize("momentum,dampening,nesterov", [(0.9, 0.0, True), (0.5, 0.1, False), (0.0, 0.0, False)])
def test_the_outer_step_in_pieces_is_torchs_sgd_step(momentum, dampening, nesterov):
    """`outer_step` (cache-sized pieces, no whole-model temporaries) moves the shared weights and the
    momentum buffer to the bits torch's SGD does, step after step, over several pieces and a tail."""
    from smolforge.parallel.codecs import PIECE_VALUES
    from smolforge.parallel.strategies.diloco_stream import outer_step

    g = torch.Generator().manual_seed(3)
    start = torch.randn(PIECE_VALUES * 2 + 777, generator=g)
    mine, theirs = (torch.nn.Parameter(start.clone(), requires_grad=False) for _ in range(2))
    opts = [torch.optim.SGD([p], lr=0.7, momentum=momentum, dampening=dampening, nesterov=nesterov)
            for p in (mine, theirs)]
    for _ in range(3):
        grad = torch.randn(start.numel(), generator=g)
        outer_step(opts[0], mine, grad)
        theirs.grad = grad.clone()
        opts[1].step()
        theirs.grad = None
        assert torch.equal(mine, theirs)
        if momentum:
            assert torch.equal(opts[0].state[mine]["momentum_buffer"], opts[1].state[theirs]["momentum_buffer"])


def test_the_pseudo_gradient_read_in_pieces_is_the_one_made_whole():
    """A sync reads shared - local a piece at a time straight from the parameters (`fill_pseudo_gradient`, no
    whole-model buffer), across parameter ends, an empty parameter and a bf16 one: the same bits as
    `pseudo_gradient`; and the outer step fed a piece at a time equals the one fed the whole tensor."""
    from smolforge.parallel.codecs import PIECE_VALUES, spans
    from smolforge.parallel.strategies.diloco_stream import (fill_pseudo_gradient, make_fragments, outer_step,
                                                             pseudo_gradient)

    g = torch.Generator().manual_seed(3)
    sizes = [PIECE_VALUES + 7, 0, 300, PIECE_VALUES // 2 + 1, 5]
    params = [torch.nn.Parameter(torch.randn(n, generator=g)) for n in sizes]
    params[2] = torch.nn.Parameter(torch.randn(15, 20, generator=g).to(torch.bfloat16))
    frag = make_fragments(params, 1)[0]
    with torch.no_grad():
        for p in params:
            p.add_(torch.randn(p.shape, generator=g).to(p.dtype) * 1e-2)
    whole = pseudo_gradient(params, frag)
    fill, out = fill_pseudo_gradient(params, frag), torch.empty(whole.numel())
    for a, b in spans(whole.numel(), 256):
        fill(a, b, out[a:b])
    assert torch.equal(out, whole)
    shared = [torch.nn.Parameter(frag.shared.detach().clone()) for _ in range(2)]
    opts = [torch.optim.SGD([p], lr=0.7, momentum=0.9, nesterov=True) for p in shared]
    for _ in range(2):  # the second step has a momentum buffer
        outer_step(opts[0], shared[0], whole)
        outer_step(opts[1], shared[1], lambda a, b: whole[a:b].clone(), 256)
    assert torch.equal(shared[0], shared[1])


def test_a_stop_code_is_agreed_once_a_round_where_fragment_0_merges(runs):
    """(g) Streamed, a cancel asked on rank 1 alone after step 1 is held until the round's end, fragment 0's
    merge at step 5, and both ranks agree it there: the same step on each, and one agreement a round, not one
    at every fragment's send (stop 58-60: steps 2, 4, 6, 8 here), which tied streamed ranks together every
    H ÷ fragments steps. Every other byte is a fragment's sync: 3 of each (finish sends both once more)."""
    got = [runs["ranks"][r]["agree"] for r in (0, 1)]
    assert got[0]["agreed"] == got[1]["agreed"] == [0, 0, 0, 0, 2, 0, 0, 0, 0], got
    for g in got:
        assert g["syncs"] == 6 and g["rounds"] == 3, g  # fragment 0 merged at 5, 9 and in finish
        assert g["bytes"] == 3 * sum(g["payloads"]) + 2 * AGREE, g  # agreed at 5 and 9


def test_a_delta_merge_puts_the_steps_own_progress_on_the_new_global_weights(runs):
    """(g) `merge: delta`: right after fragment 1's merge (sent at step 2, merged at 3), each rank's weights are
    the new shared weights plus step 3's own move (0.01 on rank 0, 0.02 on rank 1), not Streaming DiLoCo's
    half-way mix of the two."""
    for r in (0, 1):
        gaps = runs["ranks"][r]["agree"]["past_shared"]
        assert gaps and all(abs(g - 0.01 * (r + 1)) < 1e-6 for g in gaps), (r, gaps)


def test_between_outer_steps_the_ranks_share_no_collective(runs):
    """Besides its pseudo-gradients a rank sends only one agreement at each outer step (a stop code and
    whether a joiner waits, 16 bytes: where the ranks meet anyway) and its evals' sums: no per-step
    collective, which made every inner step wait for the slower rank's (one a step before stop 58: 12
    codes here, not 3)."""
    n = runs["one"]["adamw"].trainable_params
    res = runs["ranks"][0]["fp32"]
    evals = len(runs["ranks"][0]["fp32_evals"])
    assert res["comm_bytes_sent"] - res["rounds"] * (n + 1) * 4 == res["rounds"] * AGREE + evals * 4 * 8, (res, evals)
