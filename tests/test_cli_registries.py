"""The CLI's choices are the registries' own: a strategy added to `STRATEGIES` (a new file, a plug-in)
shows in `launch --help` and in the strategies `distill --students-strategy` takes when its class says
it can, a misspelt name gets the closest registered one, and the other lists the help names (KD losses,
PEFT methods, export targets) are read from their registries. In this process, through typer's runner,
as tests/test_bad_input.py runs the CLI."""

from __future__ import annotations

import re

import pytest
from typer.testing import CliRunner

from smolforge.parallel.strategies import STRATEGIES
from smolforge.train.strategy import Strategy

LAUNCH = ["launch", "--model", "tiny-llama", "--dataset", "bundled"]
DISTILL = ["distill", "--teacher", "tiny-llama", "--student", "tiny-llama", "--data", "bundled"]


class Dummy(Strategy):
    """A strategy only this test knows: one class, registered by the fixture, nothing else edited."""

    name = "dummy"
    distill_students = True


@pytest.fixture
def dummy(monkeypatch):
    monkeypatch.setitem(STRATEGIES, "dummy", Dummy)  # removed again when the test ends
    return "dummy"


def _invoke(argv: list[str]):
    from smolforge.cli.main import app

    return CliRunner().invoke(app, argv, env={"SMOLFORGE_COORDINATOR": "", "SMOLFORGE_TOKEN": None, "COLUMNS": "250"})


def _help(argv: list[str]) -> str:
    """`smolforge ... --help` as one line: rich's table borders and wrapping taken out."""
    res = _invoke([*argv, "--help"])
    assert res.exit_code == 0, (res.exit_code, res.output[-2000:])
    return re.sub(r"[\s│]+", " ", res.stdout)


def _listed(names: list[str], default: str = "ddp") -> str:
    return " | ".join(f"{n} (default)" if n == default else n for n in names)


def test_a_registered_strategy_shows_in_launch_help(dummy):
    text = _help(["launch"])
    assert "dummy" in list(STRATEGIES)
    assert f"how the ranks share learning: {_listed(list(STRATEGIES))} (settings:" in text, text


def test_the_strategies_a_student_group_takes_are_the_capable_ones(dummy):
    """`distill --students-strategy`: the registry's strategies whose class says `distill_students`;
    a parameter server's and the pipeline's are not among them, the test's own strategy is."""
    capable = [name for name in STRATEGIES if STRATEGIES[name].distill_students]
    assert "dummy" in capable and not {"ssp", "sync-ps", "async-ps", "pipeline", "single"} & set(capable)
    assert f"--students-sync ddp: {_listed(capable)}" in _help(["distill"])
    for name in STRATEGIES:  # every capability is a typed class attribute every strategy answers
        cls = STRATEGIES[name]
        assert all(type(getattr(cls, cap)) is bool
                   for cap in ("needs_server", "uses_process_group", "elastic", "distill_students")), name


@pytest.mark.parametrize("argv", [[*LAUNCH, "--strategy", "dummy-typo"],
                                  [*DISTILL, "--students-sync", "ddp", "--students-strategy", "dummy-typo"]],
                         ids=["launch", "distill"])
def test_a_misspelt_strategy_is_one_message_with_the_closest_name(dummy, argv, tmp_path):
    res = _invoke([*argv, "--output-dir", str(tmp_path / "o")])
    err = res.stderr
    assert res.exit_code == 2 and isinstance(res.exception, SystemExit), (res.exception, res.output[-2000:])
    assert err.startswith("error:") and err.count("error:") == 1 and "Traceback" not in res.output
    assert "unknown strategy 'dummy-typo' (did you mean 'dummy'?)" in err and "\n  fix:" in err, err


def test_help_lists_the_other_registries():
    from smolforge.distill.kdconfig import KD_LOSSES
    from smolforge.models.export.targets import RUN_TARGETS, TARGETS
    from smolforge.models.peft_spec import METHODS

    launch = _help(["launch"])
    assert f"teacher_student/hybrid: {'|'.join(KD_LOSSES)}" in launch and f"{'|'.join(METHODS)} (default lora)" in launch
    assert f"{'|'.join(RUN_TARGETS)}: export the final adapter" in launch and "hf" not in RUN_TARGETS
    assert f"{' | '.join(TARGETS)}" in _help(["export"])


def test_aggregate_and_quant_choices_come_from_their_registries(tmp_path):
    """`distill --aggregate` and `export --quant`: the help names what `AGGREGATE_CHOICES`
    (distill/settings.py) and `QUANTS` (models/export/targets.py) hold, and a name outside them is one
    message naming them, before anything loads."""
    from smolforge.distill.settings import AGGREGATE_CHOICES
    from smolforge.models.export.targets import QUANTS

    assert f"{'|'.join(AGGREGATE_CHOICES)}: merge the students" in _help(["distill"])
    assert f"GGUF weights: {' | '.join(QUANTS)}" in _help(["export"])
    res = _invoke(["export", "--model", "tiny-llama", "--to", "gguf", "--quant", "q3_bogus",
                   "--output-dir", str(tmp_path / "o")])
    assert res.exit_code == 2 and "Traceback" not in res.output, res.output[-2000:]
    assert res.stderr.count("error:") == 1 and "unknown --quant 'q3_bogus'" in res.stderr, res.stderr
    assert f"use one of {', '.join(QUANTS)}" in res.stderr, res.stderr


def test_every_gguf_weight_type_has_its_verification_limits():
    """`--quant` reads `QUANTS`; verification needs each one's bounds (NMSE, greedy agreement), or an
    export of a new weight type would fail after writing with a KeyError."""
    from smolforge.models.export.targets import QUANTS
    from smolforge.models.export.verify import LIMITS

    assert set(QUANTS) == set(LIMITS), (QUANTS, sorted(LIMITS))
