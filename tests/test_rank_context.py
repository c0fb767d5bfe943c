"""A strategy is made from a typed `RankContext` and nothing sets its attributes afterwards; a round's
`RankPlan` carries the strategy's settings as checked at submit, defaults filled in (issue 42, item 2).

Without a cluster or a process group: a parameter server's worker and a DiLoCo member are made before
any group exists, so their context is all they know of their rank.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from smolforge.parallel.strategies import make_strategy, strategy_class
from smolforge.train.rank_context import RankContext

SRC = Path(__file__).resolve().parents[1] / "src" / "smolforge"
STRATEGY_HOMES = ("parallel/strategies/", "train/strategy.py")  # a strategy's own code sets its own state


class StubServer:
    """Stands for the job's parameter server; never called here."""


def test_a_strategy_reads_its_rank_from_its_context():
    server, membership = StubServer(), object()
    worker = make_strategy("sync-ps", {"pull_every": 2}, RankContext(world=3, member=2, server=server))
    assert (worker.rank, worker.world, worker.server, worker.pull_every) == (2, 3, server, 2)
    member = make_strategy("diloco", {"inner_steps": 2}, RankContext(world=4, member=1, membership=membership,
                                                                     balance="auto"))
    assert (member.rank, member.world, member.membership, member.balance) == (1, 4, membership, "auto")
    alone = make_strategy("single")
    assert (alone.rank, alone.world, alone.balance, alone.model_part) == (0, 1, "off", None)
    with pytest.raises(ValueError, match="world >= 1"):
        RankContext(world=0)


def _sets_from_outside(path: Path) -> list[str]:
    """`x.strategy.attr = ...` or `strategy.attr = ...` outside a strategy's own methods: 'line: target'."""
    found, text = [], path.read_text()
    if "strategy." not in text:  # nothing to find: not parsed (the scan stays cheap)
        return found
    for node in ast.walk(ast.parse(text)):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] if isinstance(
            node, (ast.AugAssign, ast.AnnAssign)) else []
        for t in (e for target in targets for e in (target.elts if isinstance(target, ast.Tuple) else [target])):
            if not isinstance(t, ast.Attribute):
                continue
            owner = t.value
            name = owner.attr if isinstance(owner, ast.Attribute) else getattr(owner, "id", "")
            if name == "strategy" or name.endswith("_strategy"):
                found.append(f"{node.lineno}: {ast.unparse(t)}")
    return found


def test_nothing_sets_a_strategys_attributes_from_outside():
    """The rank glue, the engine and the driver hand a strategy its facts at construction (`RankContext`)
    or as arguments (the run's config, the spool directory, the step's loss tokens), never by assignment."""
    found = {rel: hits for path in sorted(SRC.rglob("*.py"))
             if not (rel := path.relative_to(SRC).as_posix()).startswith(STRATEGY_HOMES)
             and (hits := _sets_from_outside(path))}
    assert not found, f"set on a strategy after it was made (give it in its RankContext instead): {found}"


def test_a_round_plan_carries_the_settings_checked_at_submit_with_their_defaults():
    from smolforge.cluster.control.specs import DataParallelJob
    from smolforge.cluster.workloads.data_parallel.worker_group import rank_task

    train = {"model": "tiny-llama", "data": {"path": "bundled"}, "batch_size": 2}
    job = DataParallelJob.model_validate({"train": train, "num_workers": 2, "strategy": "sync-ps",
                                          "strategy_config": {"pull_every": 3}})
    plan = rank_task(job, 2)
    defaults = strategy_class("sync-ps").Settings().model_dump()
    assert plan.strategy_config == {**defaults, "pull_every": 3} and plan.strategy_class.needs_server
    assert plan.train.batch_size == 2 and plan.balance == job.balance
    assert rank_task(DataParallelJob.model_validate({"train": job.train.model_dump()}), 2).strategy_config == {}
