"""Parameter-server strategies in one process: the server core in this process, each worker a thread
running the ordinary training engine against it. Fast checks of the policies (the cluster tests in
tests/cluster/test_param_server.py runs the same strategies as real processes with a Ray actor).

Rank 0 builds its model before the others start: its initial weights seed the server, the others
pull them (threads share torch's global RNG, so a concurrent build would draw other LoRA inits). Every
rank then waits at its first forward for all the others, so a rank that merely started late (its
model still loading) is never taken for a slow one.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import pytest
import torch

from smolforge.config import DataSpec, PeftSpec, TrainConfig
from smolforge.parallel.strategies import STRATEGIES, make_strategy
from smolforge.train.engine import TrainHooks, train

pytestmark = pytest.mark.timeout(300)


def cfg(out: Path, **kw) -> TrainConfig:
    base = dict(model="tiny-llama", data=DataSpec(path="bundled", max_length=48, max_eval_samples=16, max_samples=400),
                peft=PeftSpec(method="lora", r=4, alpha=8, dropout=0.0), output_dir=str(out), max_steps=12,
                batch_size=4, lr=5e-3, warmup_steps=2, quiet=True, tensorboard=False, eval_accuracy=False,
                num_threads=1, seed=3)
    base.update(kw)
    return TrainConfig(**base)


def run_ps(tmp: Path, name: str, config: dict, world: int = 2, global_batch: int = 4, slow: dict | None = None,
           server=None, pause_after: int | None = None, **kw):
    """Train `world` workers against one in-process server; returns (results by rank, server, strategies)."""
    cls = STRATEGIES[name]
    server = server or cls.Server(cls.Settings(**config).model_dump(), world)
    results, errors, strategies = [None] * world, [], [None] * world
    start_line = threading.Barrier(world)

    def worker(rank: int) -> None:
        try:
            s = make_strategy(name, config)
            s.server, s.member, s.nominal_world = server, rank, world
            strategies[rank] = s
            delay = (slow or {}).get(rank, 0.0)
            done, started = [0], [False]

            def before_forward(*_):
                if not started[0]:  # every rank in step before any trains: a late start is not a fast worker
                    started[0] = True
                    start_line.wait(timeout=120)
                if delay:
                    time.sleep(delay)

            hooks = TrainHooks(on_model=lambda m: m.register_forward_pre_hook(before_forward),
                               on_step=lambda info: done.__setitem__(0, info.step),
                               should_stop=(lambda: "pause" if done[0] >= pause_after else None)
                               if pause_after and rank == 0 else None)
            results[rank] = train(cfg(tmp / f"rank{rank}", batch_size=global_batch // world, **kw), hooks,
                                  strategy=s)
        except BaseException as err:  # noqa: BLE001 - reported by the test
            errors.append((rank, err))
            raise

    threads = [threading.Thread(target=worker, args=(r,), daemon=True) for r in range(world)]
    threads[0].start()
    deadline = time.time() + 120
    while not server.is_ready() and time.time() < deadline and not errors:
        time.sleep(0.05)
    for t in threads[1:]:
        t.start()
    for t in threads:
        t.join(timeout=240)
    assert not errors, errors
    assert all(not t.is_alive() for t in threads)
    return results, server, strategies


def adapter(result) -> dict[str, torch.Tensor]:
    from safetensors.torch import load_file

    return load_file(str(Path(result.adapter_dir) / "adapter_model.safetensors"))


def test_ssp_with_k0_is_the_single_process_run(tmp_path):
    single = train(cfg(tmp_path / "single", lr=1e-3))
    results, server, _ = run_ps(tmp_path / "ssp", "ssp", {"staleness_bound": 0}, lr=1e-3)
    assert results[0].steps == 12 and server.version == 12
    mine, ref = adapter(results[0]), adapter(single)
    for k in ref:
        torch.testing.assert_close(mine[k], ref[k], atol=1e-5, rtol=0)
    assert all(r.strategy_metrics["staleness_max"] == 0 for r in results)


def test_ssp_bounds_staleness_and_a_fast_worker_takes_more_parts(tmp_path):
    results, server, _ = run_ps(tmp_path, "ssp", {"staleness_bound": 2}, slow={1: 0.15}, max_steps=16)
    m = [r.strategy_metrics for r in results]
    assert server.version == 16 and sum(x["parts_done"] for x in m) == 32
    assert all(x["staleness_max"] <= 2 for x in m), m
    assert m[0]["parts_done"] > m[1]["parts_done"], m
    assert m[0]["claim_waits"] > 0, m  # the fast one waited for the slow one at the bound, without an error


def test_async_ps_applies_every_part_and_learns(tmp_path):
    results, server, _ = run_ps(tmp_path, "async-ps", {"codec": "int8", "pull_every": 2}, max_steps=20, lr=1e-2)
    assert server.progress() == 20 and server.applied == 40
    assert results[0].eval["eval_loss"] < 6.0
    m = [r.strategy_metrics for r in results]
    assert sum(x["parts_done"] for x in m) == 40


def test_sync_ps_polyak_average_follows_the_raw_weights(tmp_path):
    results, server, _ = run_ps(tmp_path, "sync-ps", {"polyak_decay": 0.5, "final": "polyak"}, max_steps=6)
    assert server.version == 6 and server.ema is not None
    assert not torch.equal(server.ema, server.flat)


def test_ssp_pause_then_resume_equals_uninterrupted(tmp_path):
    """Rank 0 pauses after 5 steps: the checkpoint holds the server's snapshot (weights, AdamW state, the
    step every part before which is applied); a new server resumes from it, and K = 0 ends exactly where an
    uninterrupted run does."""
    whole, _, _ = run_ps(tmp_path / "whole", "ssp", {"staleness_bound": 0}, lr=1e-3)
    first, server, _ = run_ps(tmp_path / "paused", "ssp", {"staleness_bound": 0}, lr=1e-3, pause_after=5)
    assert first[0].stopped == "pause" and first[0].checkpoint_dir and 3 <= server.version < 12
    again, _, _ = run_ps(tmp_path / "paused", "ssp", {"staleness_bound": 0}, lr=1e-3, resume=True)
    assert again[0].stopped is None and again[0].steps == 12
    mine, ref = adapter(again[0]), adapter(whole[0])
    for k in ref:
        torch.testing.assert_close(mine[k], ref[k], atol=1e-6, rtol=0)
