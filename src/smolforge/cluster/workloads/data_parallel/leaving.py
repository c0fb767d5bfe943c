"""`job leave`: a node lent to a running data-parallel job (`job join`) given back before the job ends.

The data-parallel runner's half that takes a lent node out again (`DPRunner` inherits it); the node
leaves at the job's next boundary, and the job never fails because it did:

- the node is dropped from the job's `lent_nodes` at once (kept in its spec), so a restart, a retry
  or a resume places without it, and a worker node given back is kept out of this job's placements
  from then on (its slots are its owner's again);
- an elastic group (DiLoCo, the parameter servers' workers) loses the members on that node as it
  loses a member that died: each leaves at its next boundary (DiLoCo: an outer step; a server's
  worker: a step; `rank.MemberLeaves`), tells the control actor, and the others go on, no restart;
- any other group (ddp, zero1, fsdp, pipeline; or an elastic one whose rank 0 is on the node) stops
  at its next checkpoint (the next step without checkpoints) and re-forms without it from there, as
  for a join;
- a node still waiting to join has its join withdrawn.

Each leave is one `member_left` event whose data says the node, the boundary and the step. Refused
with one message: a node not lent to the job, one already leaving, and the group's last member
(pause or cancel the job instead).
"""

from __future__ import annotations

import dataclasses
from typing import Any

from smolforge.cluster.control.placement import COORDINATOR
from smolforge.cluster.control.runner import ray_get
from smolforge.cluster.nodes import ray_glue
from smolforge.errors import SmolforgeError


def named(node: str) -> str:
    """A lent node as messages name it."""
    return "the coordinator" if node == COORDINATOR else node


class NodeLeaving:
    """`DPRunner.leave` and what it needs; state is set up by `init_leaving` (in DPRunner.__init__).
    Its methods use the runner's own attributes (spec, store, control, round, members, _lock); `runner.py`
    imports this module, never the other way round (no import cycle)."""

    def init_leaving(self) -> None:
        self.pending_leaves: list[str] = []  # lent nodes given back, taken out at the group's next boundary
        self.members: dict[int, str] = {}  # the running round's members: id -> node ('@coordinator' if lent so)
        self.leaving: dict[int, str] = {}  # elastic members asked to leave at their next boundary -> node
        self.left: set[str] = set()  # worker nodes given back: this job's placements keep off them

    # -- the request, from the API thread ---------------------------------------------------------

    def leave(self, node: str) -> str:
        """Give `node` back: checked, dropped from the job's spec, and taken out at the returned moment."""
        with self._lock:
            if node in self.pending_joins:  # never placed: its join is withdrawn
                self.pending_joins.remove(node)
                self.left_event(node, f"{named(node)} left before it joined (its join is withdrawn)",
                                "before it joined", None)
                return "once: its join is withdrawn"
            self._check_leave(node)
            members = sorted(m for m, n in list(self.members.items()) if n == node) if self.training else []
            self.pending_leaves.append(node)
            self.spec = self.spec.model_copy(update={"lent_nodes": [n for n in self.spec.lent_nodes if n != node]})
            self.ctx.keep_spec(self.job_id, self.spec)  # a restart or resume places without it
            if node != COORDINATOR:
                self.left.add(node)
            if not self.training:
                return "the placement of its group"
            if self.elastic and members and 0 not in members:
                self._ask_to_leave(node, members)
                return ("its next outer step (the others go on, no restart)" if self.server is None
                        else "its next step (the others go on, no restart)")
            self._ask_regroup()
        return "the next checkpoint" if self.spec.train.save_every else "the next step"

    def _check_leave(self, node: str) -> None:
        """One message for a leave that cannot be: not lent, already leaving, the last member."""
        job = self.job_id
        if node in self.pending_leaves:
            raise SmolforgeError(f"{named(node)} is already leaving job {job}",
                                 fix=f"nothing to do: `member_left` in `smolforge job logs {job}` says when it has")
        if node not in self.spec.lent_nodes:
            lent = ", ".join(named(n) for n in self.spec.lent_nodes) or "none"
            raise SmolforgeError(f"{named(node)} is not a node lent to job {job} (lent: {lent})", where="--node",
                                 fix=f"name a node lent with `smolforge job join {job}`; the job's own workers "
                                     "stay until it ends, is paused or is cancelled")
        members = list(self.members.values()) if self.training else []
        if members and all(n == node for n in members):
            raise SmolforgeError(f"{named(node)} runs job {job}'s last member: the job cannot go on without it",
                                 fix=f"pause the job (`smolforge job pause {job}`) or cancel it "
                                     f"(`smolforge job cancel {job}`) instead")

    def _ask_to_leave(self, node: str, members: list[int]) -> None:
        """Elastic members leave at their own next boundary; one still waiting at the door (a joiner the
        group has not taken in) is let go at once, as a lost member is."""
        self.leaving.update({m: node for m in members})
        self.control.set_leaving.remote(sorted(self.leaving))
        if self.server is None and self.round is not None:
            taken = set(ray_get(self.control.taken_in.remote()) or [])
            for m in members:
                if m >= len(self.round.refs) and m not in taken:
                    self.control.member_left.remote(m)

    # -- what the runner thread records -----------------------------------------------------------

    def left_event(self, node: str, message: str, boundary: str, step: int | None, **data) -> None:
        """The one event a leave makes, whichever way it went: its data says the node, the boundary and the step."""
        self.store.add_event(self.job_id, "member_left", message,
                             {"node": node, "boundary": boundary, "step": step, **data})

    def take_leaves(self, boundary: str, step: int | None, message: str) -> bool:
        """The leaves asked for, done at `boundary` (`message`: what that means, after the node's name);
        returns whether there were any."""
        with self._lock:
            nodes, self.pending_leaves = self.pending_leaves, []
            self.leaving = {}
        for node in nodes:
            self.left_event(node, f"{named(node)} left {message}", boundary, step)
        return bool(nodes)

    def member_gone(self, r: Any, rank: int, err: BaseException) -> None:
        """An elastic member asked to leave has left (or was let go waiting to join): the control actor
        and the server hear it as they do of a lost member; the task is released, not failed."""
        from smolforge.cluster.workloads.data_parallel.rank import MemberLeaves

        with self._lock:
            node = self.leaving.pop(rank)
            self.members.pop(rank, None)
            if node not in self.leaving.values() and node in self.pending_leaves:
                self.pending_leaves.remove(node)  # its last member went: nothing left to take out
        ray_get(self.control.member_left.remote(rank))
        if self.server is not None:
            self.server.member_left.remote(rank)  # its unfinished parts go to the others
        cause = err if isinstance(err, MemberLeaves) else getattr(err, "cause", None)
        step, boundary = ((cause.step, cause.boundary) if isinstance(cause, MemberLeaves)
                          else (None, "before it was taken in"))
        info = next((m.info for g in [r.group, *self.joiners] for m in g.members if m.rank == rank), {})
        tid = f"{self.job_id}-g{r.no}-r{rank}"
        self.store.upsert_task(tid, self.job_id, "dp_rank", "released")
        where = f"after step {step}, its next {boundary}" if step is not None else boundary
        self.left_event(node, f"member {rank} on {info.get('node_name')} ({named(node)}) left the group {where}, "
                              "as asked; the others go on without it, no restart", boundary, step,
                        rank=rank, node_name=info.get("node_name"))

    def without_left(self, req: ray_glue.Requirements,
                     nodes: list[ray_glue.NodeInfo]) -> ray_glue.Requirements:
        """`req` kept off the worker nodes given back (a name that matches no node when none is left)."""
        if not self.left or req.on_coordinator:
            return req
        keep = [n.name for n in req.candidates(nodes) if n.name not in self.left]
        return dataclasses.replace(req, allowed_nodes=keep or ["-"])
