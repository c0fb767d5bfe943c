"""`--strategy auto` (issue 45 item 4): the pure decision on tables of measurements, the name in the registry and
a job spec; the probe over a real gloo group on loopback (which picks ddp there) is
tests/test_diloco_strategy.py::test_auto_picks_ddp_on_loopback, in the ranks that module spawns already.

The decision is asserted, never a time: the tables give the measurements, and on loopback the assertion is
what the mechanism decided and why (its reason names the rule and the measured numbers).
"""

from __future__ import annotations

import sys

import pytest

from helpers import ROOT, run_gloo_ranks

from smolforge.parallel.auto_choice import (
    SPARSE_MIN_ROUNDS, Decision, LinkSample, Measured, codec_bytes, decide,
)

LLAMA_100M = 109_529_856  # llama-100m's parameters (its config on the meta device)
LORA_05B = 1_081_344  # trainable fp32 values of a LoRA r=8 on the Qwen2.5-0.5B twin (order of magnitude)
TINY = 870_000  # tiny-llama's parameters, about (3.48 MB in fp32: bench/scale_out.py --quick)


def measured(mbit: float, step_s: float, params: int = LLAMA_100M, trainable: int | None = None,
             world: int = 2, rtt_ms: float = 1.0, max_steps: int | None = 1000,
             cpu: dict[str, float] | None = None) -> Measured:
    links = tuple(LinkSample(a, b, mbit, rtt_ms / 1e3) for a in range(world) for b in range(world) if a != b)
    return Measured(world=world, links=links, step_s=step_s, params=params,
                    trainable_bytes=4 * (params if trainable is None else trainable), max_steps=max_steps,
                    sync_cpu_s=cpu or {})


# llama-100m's whole-model sync CPU work on one core of the dev box (`sync_cpu_seconds` at full size: int8 5.1 s,
# sparse 3.6 s; a real int8 sync waited ~10.8 s on a 1 Gbit/s link: BENCHMARKS.md, scale-out 2026-11-30)
# int4: int8's × 1.19, the ratio of the two measured after stop 58's cut (`sync_cpu_seconds` at 109.5 M values, one
# thread, two runs each: int4 1.57 and 1.60 s, int8 1.45 and 1.22 s; its nibbles cost a packing pass)
CPU_100M = {"int8": 5.1, "int4": 6.07, "sparse": 3.6}


# (what, measurements, what decide takes, strategy, codec, H, fragments)
TABLE = [
    ("loopback, tiny model", measured(8000, 0.5, params=1_000_000), {}, "ddp", None, None, None),
    ("LoRA at 20 Mbit/s: the adapter's gradient fits", measured(20, 160.0, trainable=LORA_05B), {}, "ddp", None, None, None),
    ("100M full at 1 Gbit/s", measured(1000, 3.0), {}, "diloco", "sparse", 5, None),
    ("100M full at 20 Mbit/s", measured(20, 3.0), {}, "diloco", "sparse", 6, None),
    ("100M full at 20 Mbit/s, no sparse codec: streamed int8", measured(20, 3.0), {"has": frozenset({"fragments"})},
     "diloco", "int8", 20, 4),
    ("100M full at 20 Mbit/s, 200 steps: 33 rounds of sparse < 64, so int4, streamed at H 12 (int8's at 20)",
     measured(20, 3.0, max_steps=200), {}, "diloco", "int4", 12, 4),
    ("100M full at 1 Gbit/s, 200 steps: 40 rounds of sparse < 64, int8 fits at H 5", measured(1000, 3.0, max_steps=200),
     {}, "diloco", "int8", 5, None),
    ("the run's length unknown: counted as long, sparse", measured(20, 3.0, max_steps=None), {},
     "diloco", "sparse", 6, None),
    ("the quick bench's 12-step run: 2 rounds; the dense codecs over budget, capped at 6: int4 waits less",
     measured(20, 0.024, params=TINY, max_steps=12), {}, "diloco", "int4", 6, None),
    ("the same without int4: int8, capped at 6", measured(20, 0.024, params=TINY, max_steps=12),
     {"has": frozenset({"sparse", "fragments"})}, "diloco", "int8", 6, None),
    ("100M full at 20 Mbit/s, 100 steps (the bench's run): 16 rounds of sparse; int4 streamed at H 12, int8 at 20",
     measured(20, 3.0, max_steps=100), {}, "diloco", "int4", 12, 4),
    ("the same without fragments: blocking, H capped by the run", measured(20, 3.0, max_steps=200),
     {"has": frozenset()}, "diloco", "int8", 100, None),
    ("100M full at 1 Gbit/s, 200 steps, a sync's 5.1 s of CPU counted: int8 streamed at H 17 (blocking: 20), not 5",
     measured(1000, 3.0, max_steps=200, cpu=CPU_100M), {}, "diloco", "int8", 17, 4),
    ("stop 60's 1 Gbit/s bench: streamed int8 at H 8, where blocking needs H 9 for its transfer",
     measured(1257, 1.57, max_steps=100, rtt_ms=0.148, cpu={"int8": 0.665, "int4": 0.9}), {}, "diloco", "int8", 8, 4),
    ("the same without fragments: blocking int8 at H 9", measured(1257, 1.57, max_steps=100, rtt_ms=0.148,
     cpu={"int8": 0.665, "int4": 0.9}), {"has": frozenset({"sparse", "int4"})}, "diloco", "int8", 9, None),
    ("100M full at 20 Mbit/s, 1000 steps, with the CPU: sparse streamed at H 12, 83 rounds ≥ 64 (blocking: H 18, "
     "55 rounds)", measured(20, 3.0, max_steps=1000, cpu=CPU_100M), {}, "diloco", "sparse", 12, 4),
    ("three ranks, the slowest link counts", Measured(3, (LinkSample(0, 1, 1000, 1e-3), LinkSample(1, 2, 20, 1e-3),
                                                           LinkSample(0, 2, 1000, 1e-3)), 3.0, LLAMA_100M,
                                                      4 * LLAMA_100M, 1000), {}, "diloco", "sparse", 8, 4),
]


@pytest.mark.parametrize("what,m,kw,strategy,codec,h,fragments", TABLE, ids=[row[0] for row in TABLE])
def test_the_decision_on_a_table_of_measurements(what, m, kw, strategy, codec, h, fragments):
    from smolforge.parallel.strategies import strategy_class

    d = decide(m, **kw)
    assert (d.strategy, d.config.get("codec"), d.config.get("inner_steps"), d.config.get("fragments")) == \
        (strategy, codec, h, fragments), (what, d.reason)
    strategy_class(strategy).settings_dict(d.config)  # the plan is one the chosen strategy takes (resolve builds it)
    rounds = d.numbers.get("sparse_rounds")
    if codec == "sparse":  # enough rounds for its error feedback, or a run of unknown length
        assert rounds is None or rounds >= SPARSE_MIN_ROUNDS, d.reason
    elif codec in ("int8", "int4") and "sparse" in kw.get("has", {"sparse"}):  # sparse was there: too few rounds
        assert rounds < SPARSE_MIN_ROUNDS and f"{rounds} rounds < {SPARSE_MIN_ROUNDS}" in d.reason, d.reason
    assert f"{d.numbers['mbit_s']:g} Mbit/s" in d.reason and "10%" in d.reason, d.reason
    if strategy == "ddp":  # its per-step all-reduce is within 10 % of a step's compute
        assert d.numbers["ddp_comm_s"] <= 0.10 * m.step_s
    else:  # ddp would not fit; a sync's transfer is ≤ 10 % of H steps' compute unless capped or overlapped
        assert d.numbers["ddp_comm_s"] > 0.10 * m.step_s and "would be" in d.reason
        spent = d.numbers["sync_s"] + d.numbers["sync_cpu_s"]  # the transfer and the CPU work
        assert d.config.get("fragments") or spent <= 0.10 * h * m.step_s or "over budget" in d.reason
        if m.sync_cpu_s:  # said in the reason, counted in the budget
            assert f"{d.numbers['sync_cpu_s']:.3g} s of CPU" in d.reason, d.reason


def test_sparse_bytes_per_sync_are_under_2_percent_of_the_fp32_model():
    """The plan's bytes are the sparse codec's layout: per 4096-value chunk 64 uint16 indices, 64 2-bit values
    and one fp32 scale (148 bytes against 16,384 in fp32, 0.9 %); int8 is a byte per value plus its scales."""
    sparse = {"codec": "sparse", "chunk": 4096, "topk": 64}
    assert codec_bytes({**sparse, "bits": 2}, 4096 * 10) == 10 * (128 + 16 + 4)
    assert codec_bytes({**sparse, "bits": 4}, 4097) == 2 * (128 + 32 + 4)
    assert codec_bytes({"codec": "int8", "block": 256}, 512) == 512 + 8
    assert codec_bytes({"codec": "int4", "block": 256}, 513) == 3 * (128 + 4)  # the last block padded
    d = decide(measured(20, 3.0))
    assert d.numbers["bytes_per_sync"] == codec_bytes({**sparse, "bits": 2}, LLAMA_100M)
    assert d.numbers["sync_fraction_of_model"] <= 0.02


def test_the_same_link_picks_sparse_for_a_long_run_and_a_dense_codec_for_a_short_one():
    """Issue 45: the rule counts learning, not only bytes. At 20 Mbit/s llama-100m's sparse sync fits at H 6:
    1,000 steps are 166 rounds, enough for sparse's error feedback; 200 steps are 33, too few, so a dense codec
    (int4, streamed), at the longer H its larger sync needs. The reason says which rule applied."""
    long, short = decide(measured(20, 3.0, max_steps=1000)), decide(measured(20, 3.0, max_steps=200))
    assert (long.config["codec"], long.config["inner_steps"], long.numbers["rounds"]) == ("sparse", 6, 166)
    assert f"166 rounds ≥ {SPARSE_MIN_ROUNDS}: sparse sends" in long.reason, long.reason
    assert (short.config["codec"], short.numbers["sparse_rounds"]) == ("int4", 33), short.reason
    assert short.config["inner_steps"] > long.config["inner_steps"] and short.numbers["comm_fraction"] == 0
    assert f"33 rounds < {SPARSE_MIN_ROUNDS}: too few for sparse's error feedback at H=6" in short.reason
    assert short.numbers["bytes_per_sync"] == codec_bytes({"codec": "int4"}, LLAMA_100M)


def test_int4_where_its_half_of_the_bytes_shortens_h_int8_where_the_cpu_dominates():
    """The dense codec (issue 45, stop 59): at 20 Mbit/s the transfer dominates and int4's half of int8's bytes
    shortens H (streamed, τ 2 against 4); at 1 Gbit/s a sync is mostly CPU, int4's packing costs more of it,
    and int8 fits the shorter H. The reason says which and why."""
    slow = decide(measured(20, 3.0, max_steps=100))
    assert "int4, half int8's bytes, for H=12 against int8's H=20: int4 sends 56.5 MB" in slow.reason, slow.reason
    int4, int8 = codec_bytes({"codec": "int4"}, LLAMA_100M), codec_bytes({"codec": "int8"}, LLAMA_100M)
    assert slow.numbers["bytes_per_sync"] == int4 < int8 / 1.9
    fast = decide(measured(1000, 3.0, max_steps=200, cpu=CPU_100M))
    assert "int8, the less lossy (int4 would need H=21): int8 sends" in fast.reason, fast.reason
    # stop 60's 1 Gbit/s bench plan (step 1.57 s, int8 CPU 0.665 s): int4's halved transfer does not buy a
    # shorter H against its packing (streamed, the transfer is hidden), and the reason says so
    same = decide(measured(1257, 1.57, max_steps=100, rtt_ms=0.148, cpu={"int8": 0.665, "int4": 0.9}))
    assert (same.config["codec"], same.config["inner_steps"]) == ("int8", 8), same.reason
    assert "int8, the less lossy (int4 would not shorten H=8): int8 sends" in same.reason, same.reason
    assert "blocking would need H=9, so 4 streamed fragments, each sent behind τ=1 steps' compute (H=8)" \
        in same.reason, same.reason


def test_a_factored_adapters_plan_of_few_rounds_damps_the_outer_momentum():
    """DiLoCo's outer momentum 0.9 overshoots a product of factors in a run of tens of rounds (auto's own int8
    plan for LoRA on the 0.5B twin at 20 Mbit/s went from eval 4.70 to 8.04; BENCHMARKS.md): a dense plan of
    under `SHORT_ROUNDS` rounds for a factored PEFT method (LoRA, Houlsby: `PeftMethodClass.factored`, asked
    by the probe) takes outer lr 1.0 and momentum 0.5 and says so. Full fine-tuning keeps the paper's step
    (llama-100m reached one node's loss 4 steps sooner with it, stop 60), as do a long run and sparse (no
    momentum, its own)."""
    from dataclasses import replace

    from smolforge.models.peft import peft_method
    from smolforge.parallel.auto_choice import SHORT_OUTER, SHORT_ROUNDS
    from smolforge.parallel.strategies import strategy_class

    assert [m for m in ("lora", "adapter", "ia3", "prefix", "prompt", "none") if peft_method(m).factored] == \
        ["lora", "adapter"]
    short = decide(replace(measured(20, 3.0, max_steps=200), factored=True))  # int4 streamed at H 12: 16 rounds
    assert short.config["codec"] == "int4" and {k: short.config[k] for k in SHORT_OUTER} == SHORT_OUTER
    assert ("; outer lr 1, momentum 0.5 for 16 rounds of a factored adapter (momentum 0.9 overshoots a product "
            "of factors in under 100)") in short.reason, short.reason
    settings = strategy_class("diloco").settings_dict(short.config)
    assert (settings["outer_lr"], settings["outer_momentum"]) == (1.0, 0.5)
    full = decide(measured(20, 3.0, max_steps=200))  # the same plan for full fine-tuning: the paper's step
    assert full.config["inner_steps"] == short.config["inner_steps"] and "outer_lr" not in full.config
    assert "momentum 0.5" not in full.reason
    long = decide(replace(measured(20, 3.0, max_steps=20 * SHORT_ROUNDS), factored=True), has=frozenset({"fragments"}))
    assert long.config["codec"] == "int8" and long.numbers["rounds"] == SHORT_ROUNDS  # 100 rounds of int8
    assert "outer_lr" not in long.config and "outer_momentum" not in long.config and "momentum 0.5" not in long.reason
    sparse = decide(replace(measured(20, 3.0, max_steps=1000), factored=True))
    assert sparse.config["codec"] == "sparse" and "outer_momentum" not in sparse.config


def test_the_plan_takes_the_all_gathers_rate_where_it_is_below_one_way():
    """A sync all-gathers, every link both ways at once: where the probe's all-gather (`gather_mbit_s`) is
    slower than the slowest link one way (20 Mbit/s netlab: 11.5-12.7 against 19.1, stop 61), the plan's
    transfer is timed at the all-gather's rate and the reason says both; a faster one changes nothing."""
    from dataclasses import replace

    one_way = decide(measured(20, 3.0, max_steps=100))
    both = decide(replace(measured(20, 3.0, max_steps=100), gather_mbit_s=10.0))
    assert (one_way.numbers["mbit_s"], both.numbers["mbit_s"]) == (20.0, 10.0)
    assert both.numbers["sync_s"] > 1.9 * one_way.numbers["sync_s"], (one_way.numbers, both.numbers)
    assert "slowest link 10 Mbit/s (20 one way, both ways at once in an all-gather)" in both.reason, both.reason
    faster = decide(replace(measured(20, 3.0, max_steps=100), gather_mbit_s=30.0))
    assert faster.config == one_way.config and "one way" not in faster.reason


def test_one_rank_shares_nothing_and_the_decision_is_deterministic():
    assert decide(measured(20, 1.0, world=1)).strategy == "single"
    m = measured(20, 3.0)
    assert decide(m) == decide(m) and isinstance(decide(m), Decision)


def test_auto_is_a_registered_name_with_checked_settings_that_never_trains_itself():
    from smolforge.cluster.control.specs import DataParallelJob
    from smolforge.parallel.strategies import make_strategy, strategy_class

    cls = strategy_class("auto")
    assert cls.uses_process_group and not cls.needs_server and not cls.elastic
    train = {"model": "tiny-llama", "data": {"path": "bundled"}}
    assert DataParallelJob(train=train, strategy="auto", strategy_config={"budget": 0.05}).strategy == "auto"
    with pytest.raises(ValueError, match="strategy_config.budget"):
        DataParallelJob(train=train, strategy="auto", strategy_config={"budget": 2})
    with pytest.raises(RuntimeError, match="resolved by the ranks"):
        make_strategy("auto")


def test_a_diloco_checkpoints_optimizer_state_resumes_under_a_replicated_strategy():
    """A regroup measures and decides again, so auto can resume diloco's checkpoint (the inner optimizer's
    state, one part per rank) under ddp: every rank takes rank 0's part (found by tests/cluster/test_cluster.py::
    test_auto_decides_again_when_a_node_joins on a loaded box: round 1 diloco, round 2 ddp, `KeyError:
    'param_groups'`)."""
    import torch

    from smolforge.train.strategy import Strategy

    def stepped(seed: int) -> torch.optim.Optimizer:  # SGD with momentum: a state per parameter, no Adam start-up
        torch.manual_seed(seed)
        net = torch.nn.Linear(3, 2)
        opt = torch.optim.SGD(net.parameters(), lr=0.1, momentum=0.9)
        net(torch.randn(4, 3)).sum().backward()
        opt.step()
        return opt

    parts = [stepped(1).state_dict(), stepped(2).state_dict()]
    fresh = stepped(3)
    Strategy().load_optimizer_state(fresh, {"per_rank": parts})
    got = fresh.state_dict()["state"]
    assert len(got) == 2 and all(torch.equal(got[i]["momentum_buffer"], parts[0]["state"][i]["momentum_buffer"])
                                 for i in got)


def test_job_show_says_what_auto_chose():
    """The runner keeps rank 0's `strategy_plan` in the job's `comm` (`--json`: comm.plan); `job show` prints it."""
    from smolforge.cli.tables import comm_line

    d = decide(measured(20, 3.0))
    text = comm_line({"plan": d.to_dict(), "bytes_sent_per_rank": [1000], "wait_s_per_rank": [0.5], "step": 4})
    assert text.startswith(f"auto chose {d.reason}\n") and "communication (per rank, step 4)" in text
    assert "auto chose" not in comm_line({"bytes_sent_per_rank": [1000], "wait_s_per_rank": [0.5], "step": 4})


@pytest.mark.soak  # a real embedded cluster (Ray) and a 2-rank job: a minute or two on the 2-core machine
def test_a_launched_auto_job_runs_what_its_plan_says(tmp_path):
    """The real job path on loopback: `launch --strategy auto` on the embedded cluster; the ranks measure, rank 0's
    plan is the job's `strategy_plan` event and `comm.plan` (`job show --json`), and the job ran that strategy."""
    import json
    import os
    import tempfile

    from helpers import smolforge

    ray_tmp = tempfile.mkdtemp(prefix="sfa", dir="/tmp")
    env = {"RAY_TMPDIR": ray_tmp, "RAY_AUTH_MODE": "token", "RAY_USAGE_STATS_ENABLED": "0", "SMOLFORGE_COORDINATOR": "",
           "HF_HUB_OFFLINE": "1"}
    state = str(tmp_path / "state")
    run = smolforge("launch", "--model", "tiny-llama", "--dataset", "bundled", "--workers", "2", "--strategy", "auto",
                    "--max-steps", "6", "--max-length", "64", "--set", "data.max_eval_samples=4", "--set",
                    "eval_accuracy=false", "--state-dir", state, "--output-dir", str(tmp_path / "out"), "--json",
                    timeout=900, env={**os.environ, **env})
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    out = json.loads(run.stdout.strip().splitlines()[-1])
    assert out["state"] == "completed", out.get("error")
    shown = smolforge("job", "show", out["job_id"], "--json", "--state-dir", state, env={**os.environ, **env})
    plan = json.loads(shown.stdout)["comm"]["plan"]
    assert plan["strategy"] == out["strategy"] and plan["strategy"] in ("ddp", "diloco"), plan
    assert {(s["src"], s["dst"]) for s in plan["links"]} == {(0, 1), (1, 0)} and "10%" in plan["reason"]


def test_a_batch_is_padded_to_its_longest_row_in_expectation():
    """`padded_width`: the exact expected width of a batch drawn without replacement (what collate pads to)."""
    from smolforge.parallel.auto_probe import padded_width

    # pairs of [1, 2, 3, 4]: their longest rows are 2, 3, 4, 3, 4, 4 -> 20 / 6
    assert padded_width([4, 1, 3, 2], 2) == pytest.approx(20 / 6)
    assert padded_width([4, 1, 3, 2], 1) == pytest.approx(2.5)  # one row: the mean
    assert padded_width([4, 1, 3, 2], 9) == 4  # the batch takes every row: the longest
    with pytest.raises(ValueError, match="rows and a batch"):
        padded_width([], 2)


def test_the_step_estimate_counts_the_datas_tokens_not_max_length(tmp_path):
    """auto's step compute is estimated for the tokens a batch of the run's own data has: llama-100m at
    max_length 256 was planned for 2,048 tokens a step of 8 short rows, a step 23× too long (BENCHMARKS.md,
    scale-out 2026-11-30). With packing, and for data it cannot read, the bound, said so."""
    import json

    from smolforge.config import TrainConfig
    from smolforge.data.synthetic import generate
    from smolforge.parallel.auto_probe import SAMPLE_ROWS, step_tokens

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(300, seed=11)))

    def cfg(**data_kw):
        return TrainConfig(model="tiny-llama", batch_size=8, grad_accum=2, peft={"method": "none"},
                           data={"path": str(data), "max_length": 256, **data_kw})

    tokens, source = step_tokens(cfg())
    assert 8 * 2 * 8 < tokens < 8 * 2 * 64, (tokens, source)  # rows of tens of tokens, far under 256
    assert f"from {SAMPLE_ROWS} rows of the data" in source, source
    assert step_tokens(cfg(packing=True)) == (8 * 2 * 256, "packed: 256 tokens a row")
    gone = cfg()
    gone.data.path = str(tmp_path / "missing.jsonl")
    tokens, source = step_tokens(gone)
    assert tokens == 8 * 2 * 256 and source.startswith("max_length 256 (the data was not read here"), source


def test_a_syncs_cpu_work_is_timed_for_every_codec_auto_plans_with():
    """`sync_cpu_seconds` runs a diloco sync's CPU path (pseudo-gradient, codec with error feedback, the world's
    parts summed, the outer step) for each codec `decide` plans with; what it returns is a duration, so only
    that it is one is asserted here (the table above asserts what the decision does with it)."""
    import math

    from smolforge.parallel.auto_choice import PLANNED_CODECS
    from smolforge.parallel.auto_probe import SYNC_CODECS, sync_cpu_seconds

    assert sorted(SYNC_CODECS) == sorted(PLANNED_CODECS)  # each codec decide plans with has its CPU work measured
    for codec in SYNC_CODECS:
        s = sync_cpu_seconds(codec, values=1 << 16, world=2, sample=1 << 16)
        assert s > 0 and math.isfinite(s), (codec, s)


def _measure_rank(rank: int, data: str) -> dict:
    """One rank of `test_every_rank_states_the_same_step_estimate`: rank 1's copy of the data is missing."""
    from smolforge.config import TrainConfig
    from smolforge.parallel.auto_probe import measure

    path = data if rank == 0 else data + ".not-on-this-node"
    cfg = TrainConfig(model="tiny-llama", batch_size=8, peft={"method": "none"}, max_steps=100,
                      data={"path": path, "max_length": 256})
    m = measure(cfg, 0.05, 2)
    return {"step_s": m.step_s, "tokens": m.step_tokens, "from": m.tokens_from, "step_from": m.step_from}


def test_every_rank_states_the_same_step_estimate(tmp_path):
    """The plan's numbers are the same on every rank: the slowest rank's step (timed on the run's model)
    and the tokens it was timed for, and how, as that rank said it (a rank that cannot read the data estimates max_length;
    before, each rank stated its own: the same plan, different numbers in its event). The preset is built
    before the group, as the rank glue does."""
    import json

    from smolforge.data.synthetic import generate
    from smolforge.models.tiny import preset_dir

    preset_dir("tiny-llama")
    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(300, seed=11)))
    got, _ = run_gloo_ranks(_measure_rank, 2, str(data), timeout=300)
    assert got[0] == got[1], got
    assert got[0]["tokens"] == 8 * 256 and got[0]["from"].startswith("max_length 256"), got[0]
    assert got[0]["step_from"] == "timed: a step of the run's model", got[0]  # training's own step, not FLOPs


def _scale_out():
    """bench/scale_out.py as a module (its pure parts), sys.path left as it was."""
    saved = list(sys.path)
    sys.path.insert(0, str(ROOT / "bench"))
    try:
        import scale_out
    finally:
        sys.path[:] = saved
    return scale_out


def test_an_extrapolated_baseline_takes_autos_run_where_auto_ran_that_plan():
    """bench/scale_out.py: ddp's few steps are an estimate; when auto chose ddp (its plan's strategy and config),
    auto's full run is ddp's measurement (auto_vs_best then 1.0, not the estimate's 0.91). A plan that differs
    keeps the estimate."""
    runs = {"auto": ("auto", {}), "ddp": ("ddp", {}), "diloco-int8": ("diloco", {"inner_steps": 10, "codec": "int8"})}

    def out(plan):
        return {"auto": {"seconds": 515.0, "target_step": 60, "seconds_with_evals": 530.0, "extrapolated": False,
                         "plan": plan},
                "ddp": {"seconds": None, "extrapolated": True, "target_step": None, "median_step_s": 7.8},
                "diloco-int8": {"seconds": 600.0, "extrapolated": False, "target_step": 70}}

    same = out({"strategy": "ddp", "config": {}})
    _scale_out().adopt_autos_run(same, runs)
    assert same["ddp"]["seconds"] == 515.0 and not same["ddp"]["extrapolated"] and same["ddp"]["target_step"] == 60
    other = out({"strategy": "diloco", "config": {"codec": "int8", "inner_steps": 5}})
    _scale_out().adopt_autos_run(other, runs)
    assert other["ddp"]["seconds"] is None and other["ddp"]["extrapolated"]


def test_the_time_to_a_target_leaves_the_evaluations_out():
    """bench/scale_out.py's figure: training seconds to the first eval at or under the target, every eval's
    own seconds (`eval_s`) taken out, so two cadences of the same training give the same time, and the
    wall time (evals in) is there too. Eval curves are (ts, step, loss, eval_s); the job's first step at 100 s:
    2 s of training per step, 2 s per eval."""
    scale_out = _scale_out()
    every5 = {"first_step_ts": 100.0, "evals": [(112.0, 5, 3.0, 2.0), (124.0, 10, 2.5, 2.0), (136.0, 15, 2.0, 2.0)]}
    every10 = {"first_step_ts": 100.0, "evals": [(122.0, 10, 2.5, 2.0), (144.0, 20, 1.8, 2.0)]}
    assert scale_out.time_to(every5, 2.5) == scale_out.time_to(every10, 2.5) == 20.0
    assert scale_out.time_to(every5, 2.5, with_evals=True) == 24.0
    assert scale_out.time_to(every5, 2.2) == 30.0 and scale_out.time_to(every10, 2.2) == 40.0  # the cadence's resolution
    assert scale_out.time_to(every5, 1.0) is None
