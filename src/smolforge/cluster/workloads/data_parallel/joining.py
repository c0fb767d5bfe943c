"""`job join`: a node lent to a running data-parallel job, taken into its group.

The data-parallel runner's half that takes a node in (`DPRunner` inherits it, as it does `leaving.py`'s
`NodeLeaving`): a join is checked against the job's spec (the node can hold a rank, has not joined,
the global batch splits over the new world), queued, and taken in

- by the next placement, when no group runs yet (`_take_joins` folds it into the spec's `lent_nodes`);
- at the running group's next checkpoint (the next step without checkpoints), which stops and
  re-forms with it (a `Regroup`), for ddp, zero1, fsdp and pipeline;
- at once, as one more member placed beside the running group, which takes it in at its next outer
  step (`_admit`), for an elastic strategy (DiLoCo, the parameter servers' workers).
"""

from __future__ import annotations

from smolforge.cluster.control.placement import joiner_requirements, may_travel, requirements_for
from smolforge.cluster.control.specs import DataParallelJob
from smolforge.cluster.nodes import ray_glue
from smolforge.cluster.workloads.data_parallel.leaving import named
from smolforge.cluster.workloads.data_parallel.stage_parts import round_part
from smolforge.cluster.workloads.data_parallel.worker_group import WorkerGroup, rank_task
from smolforge.cluster.control.runner import Outcome, short_error
from smolforge.cluster.workloads.model_transfer import bring_model, job_report
from smolforge.errors import SmolforgeError
from smolforge.parallel.strategies import strategy_class


class NodeJoining:
    """`DPRunner.take_in` and what it needs. Its methods use the runner's own attributes (spec, store,
    control, ctx, world, training, elastic, pending_joins, pending_leaves, left, members, joiners,
    server, _lock); `runner.py` imports this module, never the other way round."""

    def take_in(self, node: str) -> str:
        """Take `node` in: checked against the job's spec (it can hold a rank, has not joined, and the
        global batch splits over the new world), queued, and taken in at the returned moment."""
        spec = self.spec
        if node in self.pending_leaves:
            raise SmolforgeError(f"{named(node)} is leaving job {self.job_id}",
                                 fix=f"join it again once it has left (`member_left` in `smolforge job logs "
                                     f"{self.job_id}`)")
        worker = requirements_for(spec, self.ctx.embedded)
        ray_glue.check_placeable(joiner_requirements(spec, node, self.ctx.embedded, worker, only_there=True),
                                 ray_glue.nodes())
        with self._lock:
            if node in self.spec.lent_nodes or node in self.pending_joins:
                raise SmolforgeError(f"{node} already joined job {self.job_id}", fix="nothing to do")
            world = max(self.world, 1) + len(self.pending_joins) + 1
            # an elastic group splits each global batch among whoever is a member, evenly or not
            if spec.global_batch % world and not self.elastic:
                raise SmolforgeError(
                    f"the job's global batch ({spec.global_batch}) does not split over {world} workers",
                    fix=f"jobs that should take extra nodes need a global batch divisible by the new worker count "
                        f"(e.g. {world * max(1, spec.global_batch // world)})")
            self.pending_joins.append(node)
            self.left.discard(node)
            if self.training and not self.elastic:  # an elastic group takes it in where it runs
                self._ask_regroup()
            if not self.training:
                return "the placement of its group"
        if self.elastic:
            return "the group's next outer step (no restart)"
        return "the next checkpoint" if spec.train.save_every else "the next step"

    def _ask_regroup(self) -> None:
        """Have the running group stop at its next checkpoint (now, without checkpoints) and re-form.

        A join that arrives before a group is placed needs none of this: the next placement takes it
        in (`_take_joins`). One that arrives while a group is being placed is asked for once the group
        runs, so no join is lost however it races the placement.
        """
        self.control.set_regroup.remote(bool(self.spec.train.save_every))

    def _pop_joins(self) -> list[str]:
        with self._lock:
            joins, self.pending_joins = self.pending_joins, []
        return joins

    def _take_joins(self, why: str) -> None:
        """Fold the nodes that asked to join into the job's spec, so the next placement includes them."""
        joins = self._pop_joins()
        if not joins:
            return
        self._lend(joins)
        self.store.add_event(self.job_id, "regrouped", f"{', '.join(joins)} joined {why}", {"nodes": joins})

    def _lend(self, nodes: list[str]) -> None:
        """Nodes lent to the job, kept in its spec: a resumed job places them from the start."""
        self.spec = self.spec.model_copy(update={"lent_nodes": self.spec.lent_nodes + nodes})
        self.ctx.keep_spec(self.job_id, self.spec)

    def _model_travels(self) -> bool:
        """Is the job's model sent to placed nodes that lack it? Not when every node can build or read it
        (a preset, a local path on the embedded cluster) or the ranks download it (`require_model: false`)."""
        return may_travel(self.spec.train.model, self.spec.require_model, self.ctx.embedded)

    def _bring_model(self, placed: list[tuple[str, str]], task_id: str, world: int) -> Outcome | None:
        """The placed nodes ((node id, name) each) that lack the job's model fetch it before the ranks of a
        group of `world` start (`model_transfer`); None once each has it. Ranks that read only their stage
        (the pipeline) get the config part now and their stage's part once they have cut the model
        (`stage_parts`)."""
        spec = self.spec
        if not self._model_travels():
            return None
        return bring_model(job_report(self.store, self.job_id, task_id), spec.train.model, placed,
                           self.ctx.healthy_nodes(), stopping=lambda: bool(self.want),
                           part=round_part(strategy_class(spec.strategy).stage_parts, world))

    def _admit(self, spec: DataParallelJob, round_no: int, cfg: dict, first: int, world: int) -> list[tuple[int, object]]:
        """Place each node that asked to join as a new member of the running elastic group; returns
        (member id, ref) per member started. The group takes each in at its next outer step."""
        out = []
        for node in self._pop_joins():
            member = first + len(out)
            req = joiner_requirements(spec, node, self.ctx.embedded, requirements_for(spec, self.ctx.embedded))
            joiner = WorkerGroup(self.job_id, round_no, [req.bundle(self.ctx.healthy_nodes())], self.control,
                                 first_rank=member)
            try:
                info = joiner.start(min(60.0, spec.placement_timeout_s))[0]
            except Exception as err:
                joiner.release()
                msg = err.render() if isinstance(err, SmolforgeError) else short_error(err)
                self.store.add_event(self.job_id, "join_failed", f"{node} could not be placed to join: {msg}",
                                     {"node": node})
                continue
            # a node that lacks the model gets it before its rank starts (the group trains on meanwhile)
            moved = self._bring_model([(info["node_id"], info["node_name"])], f"{self.job_id}-g{round_no}-r{member}",
                                      world)
            if moved is not None:
                joiner.release()
                self.store.add_event(self.job_id, "join_failed", f"{node} could not be given the model: "
                                     f"{getattr(moved, 'reason', None) or getattr(moved, 'why', '')}", {"node": node})
                continue
            self.joiners.append(joiner)
            self.store.upsert_task(f"{self.job_id}-g{round_no}-r{member}", self.job_id, "dp_rank", "running",
                                   rank=member, attempt=round_no, node_id=info["node_id"],
                                   node_name=info["node_name"], pid=info["pid"], max_retries=spec.max_retries)
            # kept in the spec: a resumed job places it from the start
            self._lend([node])
            self.members[member] = node  # `job leave` of this node takes this member out
            self.store.add_event(self.job_id, "member_joining",
                                 f"{node} placed as member {member} on {info['node_name']}; the group takes it in at "
                                 "its next outer step", {"node": node, "member": member})
            ref = joiner.run(rank_task(spec, world, self._model_travels()), None, join_world=world,
                             server=self.server)[0]
            out.append((member, ref))
        return out
