"""The parameter server's compressed pull (`parallel/strategies/ps_pull.py`), without Ray and without training:
two async-ps workers (the real `PSStrategy`, a small linear model each) take parts in turn from one server
in this thread, with seeded gradients; every claim's reply is recorded at the server. The cluster test of
the same path is tests/cluster/test_param_server.py's sparse sync-ps job."""

from __future__ import annotations

import threading

import pytest
import torch

from smolforge.parallel.codecs import CODECS, dequantize_int8, quantize_int8
from smolforge.parallel.strategies import STRATEGIES, make_strategy
from smolforge.parallel.strategies.ps_pull import pulled_bytes

ROUNDS = 10  # each worker takes this many parts; the job has more, so no claim waits for the other


def recording(name: str, config: dict, world: int = 2):
    """`name`'s server that keeps, for every claim that pulled: the member, the reply, the server's weights
    and the shadow before and after it."""

    class RecordingServer(STRATEGIES[name].Server):
        def exchange(self, member, wait_s=1.0, push=None, have=-1, pull_due=False):
            shadow = lambda: None if self.pulls.shadow is None else self.pulls.shadow.clone()  # noqa: E731
            with self.cond:
                before = shadow()
                out = super().exchange(member, wait_s, push, have, pull_due)
                if "pull" in out:
                    self.seen.append({"member": member, "have": have, "got": out["pull"], "flat": self.flat.clone(),
                                      "before": before, "after": shadow()})
                return out

    server = RecordingServer(STRATEGIES[name].Settings(**config).model_dump(), world)
    server.seen = []
    return server


def worker(name: str, config: dict, server, member: int):
    """(a worker of `name` against `server`, its model, its optimizer): a linear layer, the same on every member."""
    torch.manual_seed(0)  # the same initial weights: rank 0's seed the server, the others pull them
    model = torch.nn.Linear(48, 40)
    s = make_strategy(name, config)
    s.server, s.member, s.nominal_world = server, member, 2
    s.prepare(model, torch.device("cpu"))
    opt = s.make_optimizer([{"params": list(model.parameters()), "weight_decay": 0.0}], torch.optim.AdamW, lr=1e-2)
    return s, model, opt


def take_part(s, model, opt, gen: torch.Generator, held: dict, steps: int) -> bool:
    """One part: claim (pulling as the server says; the weights then held are kept by version), a seeded
    gradient, the push. False when every step is done."""
    step = s.next_step(0, steps)
    if step is None:
        return False
    held[s.version] = torch.cat([p.detach().reshape(-1) for p in model.parameters()]).clone()
    for p in model.parameters():
        p.grad = torch.randn(p.shape, generator=gen) * (1 + step)
    s.targets, s.step_total = 1.0, 2.0
    opt.step()
    return True


def run_async(config: dict):
    """async-ps, two workers taking parts in turn in this thread: (server, workers, weights held by version)."""
    server = recording("async-ps", config)
    workers, held, gen = [worker("async-ps", config, server, m) for m in (0, 1)], [{}, {}], torch.Generator().manual_seed(1)
    for _ in range(ROUNDS):  # the job has more parts: no claim waits for the other worker
        for member, (s, model, opt) in enumerate(workers):
            assert take_part(s, model, opt, gen, held[member], 1000)
    return server, [w[0] for w in workers], held


def run_sync(config: dict, steps: int = 6):
    """sync-ps, two workers in threads, every step waiting for both parts: (server, workers, weights held)."""
    config = {**config, "deadline_s": 120.0, "deadline_max_s": 120.0}  # no step closes without a part
    server = recording("sync-ps", config)
    workers, held, errors = [worker("sync-ps", config, server, m) for m in (0, 1)], [{}, {}], []

    def loop(member: int) -> None:
        try:
            gen = torch.Generator().manual_seed(10 + member)
            while take_part(*workers[member], gen, held[member], steps):
                pass
        except BaseException as err:  # noqa: BLE001 - reported below
            errors.append(err)

    workers[0][0]._start(0, steps)  # rank 0 sets the server up before rank 1 asks
    threads = [threading.Thread(target=loop, args=(m,), daemon=True) for m in (0, 1)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(timeout=120)
    assert not errors and not any(t.is_alive() for t in threads), errors
    return server, [w[0] for w in workers], held


@pytest.mark.parametrize("codec", [{"codec": "int8", "block": 64}, {"codec": "int4", "block": 64},
                                   {"codec": "sparse", "chunk": 256, "topk": 16, "bits": 2}])
def test_a_compressed_pull_costs_what_the_codec_claims_within_its_bound(codec):
    """Each pull brings the worker from its version to the server's: a keyframe (fp32: the first pull) or the
    deltas the server encoded since, each exactly the codec's `nbytes` (and the worker counts what came).
    What a worker then holds is the server's shadow, bitwise, and off the server's weights by no more than
    the codec's bound on that version's delta."""
    server, workers, held = run_async({**codec, "pull_every": 1})
    coder, numel = server.coder, int(server.flat.numel())
    assert len(server.seen) == 2 * ROUNDS and server.pulls.n["pull_keyframes"] == 2  # each worker's first pull
    for rec in server.seen:
        got = rec["got"]
        want = 4 * numel if "values" in got else len(got["deltas"]) * coder.nbytes(numel)
        assert pulled_bytes(got) == want, rec
    assert server.pulls.n["pull_deltas"] == 2 * ROUNDS - 2
    assert sum(w.bytes_pulled for w in workers) == server.pulls.n["pull_bytes"] == sum(
        pulled_bytes(r["got"]) for r in server.seen)
    # async, in turn: after the first, each pull brings two deltas (the other worker's part came in between)
    assert [len(r["got"]["deltas"]) for r in server.seen if "deltas" in r["got"]] == [1] + [2] * (2 * ROUNDS - 3)
    assert server.pulls.n["pull_bytes"] < 0.6 * 2 * ROUNDS * 4 * numel  # what fp32 pulls cost (int8: 2 x 1/4)
    checked = 0
    for rec in server.seen:  # what the worker then held is the shadow after the pull
        mine = held[rec["member"]][rec["got"]["version"]]
        assert torch.equal(mine, rec["after"])
        if "deltas" not in rec["got"] or not rec["got"]["deltas"] or rec["before"] is None:
            continue
        residual = (rec["flat"] - rec["after"]).abs()
        delta = rec["flat"] - rec["before"]  # what this claim's new delta had to carry (older ones were sent)
        assert not torch.equal(rec["before"], rec["after"])  # each claim here found a new version: one encode
        assert residual.max() > 0  # lossy: the workers' weights are not the server's
        assert (residual <= bound(codec, delta) + 1e-7).all(), (residual.max(), bound(codec, delta).max())
        checked += 1
    assert checked == 2 * ROUNDS - 2


@pytest.mark.parametrize("codec", [{"codec": "int8", "block": 64}, {"codec": "sparse", "chunk": 256, "topk": 16, "bits": 4}])
def test_sync_ps_workers_pull_one_delta_a_step_and_hold_the_same_weights_bitwise(codec):
    """sync-ps: both workers pull every step's weights, each pull one delta of the codec's bytes (the first a
    keyframe); at every version both hold the same fp32 tensor, bitwise, which is not the server's (lossy)."""
    server, workers, held = run_sync(codec)
    numel, nbytes = int(server.flat.numel()), server.coder.nbytes(int(server.flat.numel()))
    assert server.version == 6 and sorted(held[0]) == sorted(held[1]) == list(range(6))
    for version in range(6):
        assert torch.equal(held[0][version], held[1][version]), version
    assert all(not torch.equal(r["after"], r["flat"]) for r in server.seen if r["got"]["version"] > 0)
    assert [len(r["got"].get("deltas", [])) for r in server.seen] == [0, 0] + [1] * 10
    assert [w.bytes_pulled for w in workers] == [4 * numel + 5 * nbytes] * 2


def bound(codec: dict, delta: torch.Tensor) -> torch.Tensor:
    """The per-value bound on |server - worker| after a pull whose delta was `delta` (ps_pull's docstring)."""
    size = codec.get("block") or codec["chunk"]
    pad = (-delta.numel()) % size
    absmax = torch.nn.functional.pad(delta.abs(), (0, pad)).view(-1, size).amax(dim=1, keepdim=True)
    qmax = getattr(CODECS[codec["codec"]], "qmax", None)  # blockwise codecs: half a step; sparse: the absmax
    per = absmax if qmax is None else absmax / (2 * qmax)
    return per.expand(-1, size).reshape(-1)[:delta.numel()]


def test_full_pulls_and_fp32_send_the_servers_weights():
    """`pull: full` (and any fp32 job) pulls the server's weights themselves: every pull a keyframe equal to
    them, 4 bytes a value."""
    server, workers, _ = run_async({"codec": "int8", "pull": "full"})
    numel = int(server.flat.numel())
    assert server.pulls.n["pull_deltas"] == 0 and server.pulls.n["pull_keyframes"] == 2 * ROUNDS
    assert all(torch.equal(torch.from_numpy(r["got"]["values"]), r["flat"]) for r in server.seen)
    assert sum(w.bytes_pulled for w in workers) == 2 * ROUNDS * 4 * numel


def test_int8_bound_is_half_a_step():
    """The bound the test above asserts is the codec's own: int8's round-trip error is at most half a step."""
    x = torch.randn(1000)
    codes, scales = quantize_int8(x, 64)
    err = (dequantize_int8(codes, scales, 1000) - x).abs()
    assert (err <= bound({"codec": "int8", "block": 64}, x) + 1e-7).all()
