"""Where a student's teacher shards come from, and how it hears a stop while it waits for one.

`DirShardSource` reads a store directory (a local run, tests); on a cluster the student asks the
shard broker (smolforge.cluster.workloads.distill.remotes.BrokerShardSource). Both hand over verified shards.
"""

from __future__ import annotations

import time
import warnings
from pathlib import Path
from typing import Callable, Protocol

from smolforge.distill.store import (CorruptShardError, Shard, StorePlan, decode_shard, quarantine_shard,
                                     read_shard_bytes)
from smolforge.errors import SmolforgeError

EventFn = Callable[..., None]


class ShardSource(Protocol):
    """Where a student's shards come from: a local store dir or a cluster broker."""

    def expected_rows(self) -> int | None: ...

    def next_shard(self) -> Shard | None:
        """The next verified shard (blocking until one is ready), or None when all are done."""
        ...

    def get_shard(self, shard_id: int) -> Shard:
        """A specific shard again (after a resume), verified."""
        ...


class DirShardSource:
    """Shards from a store directory, taken in the order they become ready.

    A shard failing its checksum is quarantined and `on_corrupt(shard_id)` is called (the
    orchestrator regenerates it); the source then keeps waiting for the good copy.
    """

    def __init__(self, store_dir: str | Path, shard_ids: list[int] | None = None, *,
                 on_corrupt: Callable[[int], None] | None = None, on_event: EventFn | None = None,
                 poll_s: float = 0.2, timeout_s: float = 900.0, is_failed: Callable[[], str | None] | None = None):
        self.store_dir = Path(store_dir)
        self._ids = shard_ids
        self._pending: list[int] | None = None
        self.on_corrupt = on_corrupt
        self._own_events = on_event is not None
        self.on_event = on_event or (lambda *a, **k: None)
        self.poll_s, self.timeout_s = poll_s, timeout_s
        self.is_failed = is_failed

    def attach_events(self, emit: EventFn) -> None:
        """Report to the student's event sink unless the caller gave this source its own."""
        if not self._own_events:
            self.on_event = emit

    def _plan(self, wait: bool = True) -> StorePlan | None:
        deadline = time.time() + self.timeout_s
        while True:
            plan = StorePlan.read(self.store_dir)
            if plan is not None or not wait:
                return plan
            if time.time() > deadline:
                raise SmolforgeError(f"no teacher plan appeared in {self.store_dir} within {self.timeout_s:.0f}s",
                                     fix="start the teachers first, or check their logs")
            time.sleep(self.poll_s)

    def _pending_ids(self) -> list[int]:
        if self._pending is None:
            ids = self._ids if self._ids is not None else list(range(self._plan().num_shards))
            self._pending = list(ids)
        return self._pending

    def expected_rows(self) -> int | None:
        plan = self._plan()
        ids = self._ids if self._ids is not None else range(plan.num_shards)
        return sum(plan.shards[i][1] - plan.shards[i][0] for i in ids) * max(1, plan.samples_per_prompt)

    def _try(self, sid: int) -> Shard | None:
        try:
            got = read_shard_bytes(self.store_dir, sid)
            if got is None:
                return None
            return decode_shard(*got)
        except CorruptShardError as err:
            quarantine_shard(self.store_dir, sid)
            self.on_event("shard_corrupt", shard=sid, error=err.what)
            warnings.warn(f"{err.what}; quarantined, asking for it to be regenerated", stacklevel=2)
            if self.on_corrupt:
                self.on_corrupt(sid)
            return None

    def next_shard(self) -> Shard | None:
        pending = self._pending_ids()
        if not pending:
            return None
        deadline = time.time() + self.timeout_s
        while True:
            for sid in list(pending):
                shard = self._try(sid)
                if shard is not None:
                    pending.remove(sid)
                    return shard
            if self.is_failed and (why := self.is_failed()):
                raise SmolforgeError(f"teachers failed before shards {pending} were written: {why}",
                                     fix="check the teacher task's error in the event log")
            if time.time() > deadline:
                raise SmolforgeError(f"waited {self.timeout_s:.0f}s for teacher shards {pending} in {self.store_dir}",
                                     fix="check that the teacher tasks are running (smolforge status)")
            time.sleep(self.poll_s)

    def get_shard(self, shard_id: int) -> Shard:
        pending = self._pending_ids()
        if shard_id in pending:
            pending.remove(shard_id)
        deadline = time.time() + self.timeout_s
        while True:
            shard = self._try(shard_id)
            if shard is not None:
                return shard
            if time.time() > deadline:
                raise SmolforgeError(f"teacher shard {shard_id} is missing from {self.store_dir}",
                                     fix="regenerate it or start the student without --resume")
            time.sleep(self.poll_s)


class InOrderShardSource:
    """Another source's shards strictly in the order of `shard_ids`, waiting for each in turn.

    The ranks of a data-parallel student group each take their slice of every global step's rows of
    one stream, so that stream must be the same on every rank: a source that hands over shards as
    they become ready (either above, or the cluster broker) would give each rank its own order.
    """

    def __init__(self, source: ShardSource, shard_ids: list[int]):
        self.source, self.shard_ids = source, list(shard_ids)
        self._taken: set[int] = set()

    def attach_events(self, emit: EventFn) -> None:
        if hasattr(self.source, "attach_events"):
            self.source.attach_events(emit)

    def expected_rows(self) -> int | None:
        return self.source.expected_rows()

    def next_shard(self) -> Shard | None:
        for sid in self.shard_ids:
            if sid not in self._taken:
                return self.get_shard(sid)
        return None

    def get_shard(self, shard_id: int) -> Shard:
        """Also how a resumed rank replays its recorded order; those shards are not handed out again."""
        self._taken.add(shard_id)
        return self.source.get_shard(shard_id)
