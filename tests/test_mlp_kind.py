"""A model that is not a language model through the same strategies (issue 46 item 6): `--model mlp` on
scikit-learn's handwritten digits (shipped with the package, no download), held-out accuracy >= 90 %.

ddp and diloco run here as two spawned gloo ranks (one pair of processes for both); zero1 the same way,
and the parameter servers (sync-ps, async-ps) in one process with a thread per worker, in soak.
What is asserted is what the mechanism decided: the held-out rows classified right, every rank's
evaluation the same, the steps taken, and the rows each step's loss was normalised by.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from helpers import run_gloo_ranks

pytestmark = pytest.mark.timeout(300)

STEPS, BATCH = 150, 32  # global rows per step; ~2.7 epochs of the 1438 training rows
DILOCO = {"inner_steps": 5, "outer_lr": 1.0, "outer_momentum": 0.5}


def mlp_cfg(out: Path, world: int = 1, **kw) -> dict:
    base = {"model": "mlp", "data": {"path": "digits"}, "output_dir": str(out), "max_steps": STEPS,
            "batch_size": BATCH // world, "lr": 1e-2, "seed": 3, "device": "cpu", "precision": "fp32",
            "num_threads": 1, "quiet": True, "tensorboard": False}  # peft: the default (a kind trains whole)
    base.update(kw)
    return base


def _ranks(rank: int, root: Path, names: list[str]) -> dict:
    """Each named strategy's run on this rank, in turn."""
    from smolforge.config import TrainConfig
    from smolforge.parallel.strategies import make_strategy
    from smolforge.train.engine import train

    got = {}
    for name in names:
        strategy = make_strategy(name, DILOCO if name == "diloco" else {})
        r = train(TrainConfig.model_validate(mlp_cfg(root / name, world=2)), strategy=strategy)
        got[name] = {"eval": r.eval, "steps": r.steps, "samples": r.samples, "last": r.last_step_loss,
                     "adapter": r.adapter_dir}
    return got


def _check(by_rank: dict, name: str) -> None:
    ev = [by_rank[r][name]["eval"] for r in (0, 1)]
    assert ev[0] == ev[1], ev  # every rank's evaluation is the sum over both ranks' shards
    assert ev[0]["accuracy"] >= 0.90, (name, ev[0])
    assert by_rank[0][name]["steps"] == STEPS and by_rank[0][name]["samples"] == STEPS * BATCH
    # a classifier's loss is normalised by rows: each rank's part of the last step is its BATCH // 2 rows
    assert [by_rank[r][name]["last"].tokens for r in (0, 1)] == [BATCH // 2] * 2
    assert (Path(by_rank[0][name]["adapter"]) / "model.safetensors").is_file()  # the whole module, written


def test_mlp_digits_under_ddp_and_diloco(tmp_path):
    by_rank, _ = run_gloo_ranks(_ranks, 2, tmp_path, ["ddp", "diloco"])
    for name in ("ddp", "diloco"):
        _check(by_rank, name)


def test_an_unknown_dataset_for_a_model_kind_fails_with_the_fix(tmp_path):
    from smolforge.config import TrainConfig
    from smolforge.errors import SmolforgeError
    from smolforge.train.engine import train

    with pytest.raises(SmolforgeError) as err:
        train(TrainConfig.model_validate(mlp_cfg(tmp_path / "r", data={"path": "no-such-set"})))
    assert "digits" in str(err.value.fix)


@pytest.mark.soak
def test_mlp_digits_under_zero1(tmp_path):
    by_rank, _ = run_gloo_ranks(_ranks, 2, tmp_path, ["zero1"])
    _check(by_rank, "zero1")


@pytest.mark.soak
@pytest.mark.parametrize("name,config", [("sync-ps", {}), ("async-ps", {"pull_every": 2})])
def test_mlp_digits_under_a_parameter_server(tmp_path, name, config):
    from smolforge.config import DataSpec, PeftSpec
    from test_ps_inprocess import run_ps

    results, server, _ = run_ps(tmp_path, name, config, global_batch=BATCH, model="mlp", data=DataSpec(path="digits"),
                                peft=PeftSpec(method="none"), max_steps=STEPS, lr=1e-2, warmup_steps=0)
    assert server.progress() == STEPS
    assert results[0].eval["accuracy"] >= 0.90, [r.eval for r in results]


def test_a_model_kind_is_built_from_code_on_every_node():
    """Placement treats `--model mlp` as held everywhere (like a preset), and the names check loads nothing."""
    from smolforge.models.names import built_from_code, check_local_model

    assert built_from_code("mlp") and check_local_model("mlp") is None
    assert not built_from_code("no-such-kind")


@pytest.mark.parametrize("flags,named", [
    (["--peft", "lora"], ["--peft/--lora-r/--lora-alpha (train.peft)"]),
    (["--max-length", "64", "--lora-r", "4"], ["--peft/--lora-r/--lora-alpha (train.peft)",
                                                "--max-length (train.data.max_length)"]),
])
def test_launch_refuses_the_settings_a_model_kind_cannot_use_by_name(tmp_path, flags, named):
    """`launch --model mlp --dataset digits --peft lora` was run with --peft silently ignored: the kind's
    declared capabilities (`ModelKind.adapters`, `.sequences`) refuse it at submit, before a cluster starts;
    the same launch without them passes the same check, and a language model keeps taking them."""
    from helpers import smolforge_here
    from smolforge.cluster.control.kinds import parse
    from smolforge.models.kinds import refuse_unused

    result = smolforge_here("launch", "--model", "mlp", "--dataset", "digits", *flags,
                            "--output-dir", str(tmp_path / "out"))
    err = result.stderr
    assert result.exit_code == 2 and err.count("error:") == 1 and "\n  fix: drop" in err, err
    assert all(n in err for n in named) and "Traceback" not in result.output, err
    spec = {"kind": "data_parallel", "train": {"model": "mlp", "data": {"path": "digits"}}}
    parse(spec)  # nothing given that the kind cannot use: no refusal
    parse({**spec, "train": {**spec["train"], "model": "tiny-llama", "peft": {"method": "lora"}}})
    from smolforge.config import TrainConfig

    refuse_unused(TrainConfig.model_validate({"model": "mlp", "data": {"path": "digits"},
                                              "output_dir": str(tmp_path / "o")}), prefix="")
