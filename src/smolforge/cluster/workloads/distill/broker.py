"""The shard broker: a small Ray actor on the driver's node that says which shard goes to which student
and holds the students' events, progress, checkpoints and output lines until the driver drains them.

Its own module, importing nothing beyond the standard library: Ray's worker for the actor imports this
module only, so a broker starts in the time of a Python and Ray start, not of torch's and the training
stack's (`remotes.py`: 22.6 s against 3.7 s for `import ray` on the loaded 2-core machine, stop 54).
Every store of a run, and every `distill_task` job of a stage (teacher, students), starts one.
"""

from __future__ import annotations

import threading
import time
from typing import Any

MAX_BROKER_LINES = 20_000  # task lines a broker holds between two drains (it is drained every poll)
WAIT_CALL_S = 5.0  # the longest one ask of a student waits inside its broker for news (then it asks again)
BROKER_THREADS = 16  # the broker's concurrent calls: a student waits in one (each wait bounded by WAIT_CALL_S)


class _ShardBroker:
    """Ray actor: which shard goes to which student, plus the students' events and progress.

    It holds object refs (wrapped in lists so Ray does not resolve them), never shard bytes.
    """

    def __init__(self, plan: dict[str, Any]):
        self.plan = plan
        self.shards: dict[int, tuple[str, list]] = {}
        self.assigned: dict[int, list[int]] = {}
        self.delivered: dict[int, set[int]] = {}
        self.events: list[dict[str, Any]] = []
        self.corrupt: list[dict[str, Any]] = []
        self.progress: dict[int, dict[str, Any]] = {}
        self.stop: dict[int, str] = {}
        self.checkpoints: dict[int, dict[str, Any]] = {}
        self.failed: str | None = None
        self.lines: list[dict[str, Any]] = []  # what the students printed (telemetry.tasklog records)
        self.lines_dropped = 0
        self._news = threading.Condition()  # a shard added, a stop or failure, an assignment: waiters wake
        self.waiting = 0  # students waiting inside `_wait` now
        self.woken = 0  # waits that news ended (the rest ended at their bound)

    def _told(self) -> None:
        """Wake the students waiting for news (`wait_next`, `wait_get`)."""
        with self._news:
            self._news.notify_all()

    def get_plan(self) -> dict[str, Any]:
        return self.plan

    def update_plan(self, values: dict[str, Any]) -> None:
        self.plan.update(values)

    def add(self, shard_id: int, manifest_json: str, holder: list) -> None:
        with self._news:
            self.shards[int(shard_id)] = (manifest_json, holder)
            self._news.notify_all()

    def assign(self, rank: int, shard_ids: list[int]) -> None:
        with self._news:
            self.assigned[rank] = list(shard_ids)
            self.delivered.setdefault(rank, set())
            self._news.notify_all()

    def wait_next(self, rank: int, wait_s: float) -> dict[str, Any]:
        """`next`, held up to `wait_s` seconds (at most WAIT_CALL_S) until it is not "wait": a shard
        added, a stop asked or the store failed wakes it at once (the broker's push, no polling)."""
        return self._wait(lambda: self.next(rank), wait_s)

    def wait_get(self, rank: int, shard_id: int, wait_s: float) -> dict[str, Any]:
        """`get` of one shard, held as `wait_next` is."""
        return self._wait(lambda: self.get(rank, shard_id), wait_s)

    def _wait(self, ask, wait_s: float) -> dict[str, Any]:
        deadline = time.monotonic() + min(max(0.0, wait_s), WAIT_CALL_S)
        with self._news:
            while True:
                reply = ask()
                left = deadline - time.monotonic()
                if reply["kind"] != "wait" or left <= 0:
                    return reply
                self.waiting += 1
                try:
                    self.woken += bool(self._news.wait(left))
                finally:
                    self.waiting -= 1

    def next(self, rank: int) -> dict[str, Any]:
        if rank in self.stop:  # a student waiting for a shard hears a pause/cancel at once
            return {"kind": "stop", "what": self.stop[rank]}
        pending = [s for s in self.assigned.get(rank, []) if s not in self.delivered[rank]]
        if not pending:
            return {"kind": "done"}
        for sid in pending:
            if sid in self.shards:
                self.delivered[rank].add(sid)
                manifest_json, holder = self.shards[sid]
                return {"kind": "shard", "shard": sid, "manifest": manifest_json, "holder": holder}
        if self.failed:
            return {"kind": "failed", "error": self.failed}
        return {"kind": "wait"}

    def get(self, rank: int, shard_id: int) -> dict[str, Any]:
        if rank in self.stop:
            return {"kind": "stop", "what": self.stop[rank]}
        if shard_id in self.shards:
            self.delivered.setdefault(rank, set()).add(shard_id)
            manifest_json, holder = self.shards[shard_id]
            return {"kind": "shard", "shard": shard_id, "manifest": manifest_json, "holder": holder}
        return {"kind": "failed", "error": self.failed} if self.failed else {"kind": "wait"}

    def report_corrupt(self, rank: int, shard_id: int, why: str) -> None:
        with self._news:  # (the shard's waiters wait on for the regenerated copy)
            self.shards.pop(shard_id, None)
            self.delivered.get(rank, set()).discard(shard_id)
        self.corrupt.append({"rank": rank, "shard": shard_id, "error": why, "at": time.time()})

    def record(self, rank: int, kind: str, data: dict[str, Any]) -> None:
        self.events.append({"rank": rank, "kind": kind, "data": data})

    def add_lines(self, lines: list[dict[str, Any]]) -> None:
        """A student's output lines; past MAX_BROKER_LINES undrained, the oldest go (counted)."""
        self.lines.extend(lines)
        over = len(self.lines) - MAX_BROKER_LINES
        if over > 0:
            del self.lines[:over]
            self.lines_dropped += over

    def set_progress(self, rank: int, info: dict[str, Any]) -> None:
        # Threaded actor: two reports in flight may land in either order; keep the newest step.
        if info.get("step", 0) >= self.progress.get(rank, {}).get("step", -1):
            self.progress[rank] = info

    def put_checkpoint(self, rank: int, shipped: dict[str, Any]) -> None:
        """A student's newest periodic checkpoint, held until the driver drains it to disk."""
        self.checkpoints[rank] = shipped

    def restart(self, rank: int) -> None:
        """The student of `rank` starts again (its worker died): every shard is its to ask for again."""
        with self._news:
            self.delivered[rank] = set()
            self.stop.pop(rank, None)
            self.progress.pop(rank, None)
            self._news.notify_all()

    def drain(self) -> dict[str, Any]:
        out = {"events": self.events, "corrupt": self.corrupt, "progress": dict(self.progress),
               "checkpoints": self.checkpoints, "lines": self.take_lines()}
        self.events, self.corrupt, self.checkpoints = [], [], {}
        return out

    def take_lines(self) -> list[dict[str, Any]]:
        """The students' lines since the last take, led by a count of those dropped meanwhile."""
        lines, dropped, self.lines, self.lines_dropped = self.lines, self.lines_dropped, [], 0
        if dropped:
            lines.insert(0, {"type": "log", "task": "broker", "node": None, "ts": lines[0]["ts"] if lines else time.time(),
                             "line": f"[{dropped} student lines dropped: the broker was not drained in time]"})
        return lines

    def request_stop(self, rank: int, what: str) -> None:
        with self._news:  # a student waiting for a shard hears it at once
            self.stop[rank] = what
            self._news.notify_all()

    def should_stop(self, rank: int) -> str | None:
        return self.stop.get(rank)

    def fail(self, why: str) -> None:
        with self._news:
            self.failed = why
            self._news.notify_all()

    def node(self) -> str:
        """The Ray node this broker runs on (the driver checks it is its own)."""
        import ray

        return ray.get_runtime_context().get_node_id()
