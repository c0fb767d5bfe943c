"""A student waits for its next shard inside the broker, woken by the broker's news (issue 42 item 2).

No sleep loop: `_ShardBroker.wait_next` holds one ask until a shard is added, a stop is asked or the
store fails (a `threading.Condition`), each ask bounded by WAIT_CALL_S; `BrokerShardSource` ends a wait
longer than its `timeout_s` in a SmolforgeError. The broker is the plain class here (no Ray).
"""

from __future__ import annotations

import threading
import time

import pytest

from smolforge.cluster.workloads.distill.remotes import WAIT_CALL_S, BrokerShardSource, _ShardBroker
from smolforge.errors import SmolforgeError


def waiting(broker: _ShardBroker, rank: int) -> tuple[threading.Thread, list]:
    """A student asking for its next shard, in a thread; its reply lands in the list."""
    got: list = []
    t = threading.Thread(target=lambda: got.append(broker.wait_next(rank, WAIT_CALL_S)), daemon=True)
    t.start()
    for _ in range(10_000):  # until it waits inside the broker
        if broker.waiting:
            break
        time.sleep(0.001)
    return t, got


@pytest.mark.parametrize("news, kind", [(lambda b: b.add(0, "{}", ["ref"]), "shard"),
                                         (lambda b: b.request_stop(0, "pause"), "stop"),
                                         (lambda b: b.fail("teacher gone"), "failed")])
def test_a_waiting_student_is_woken_by_the_brokers_news(news, kind):
    broker = _ShardBroker({"shards": [[0, 4]]})
    broker.assign(0, [0])
    t, got = waiting(broker, 0)
    news(broker)
    t.join(WAIT_CALL_S + 5)
    assert [r["kind"] for r in got] == [kind] and broker.woken == 1  # the news woke it, not its bound


def test_a_wait_is_bounded_and_the_source_ends_it_saying_why():
    broker = _ShardBroker({"shards": [[0, 4]]})
    broker.assign(0, [0])
    assert broker.wait_next(0, 0.0)["kind"] == "wait"  # nothing yet: answered, not held past its bound
    source = BrokerShardSource(broker=None, rank=0, timeout_s=0.0)
    source._call = lambda method, *args: getattr(broker, method)(*args)
    with pytest.raises(SmolforgeError, match="waited 0s for a teacher shard"):
        source.next_shard()
