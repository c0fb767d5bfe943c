"""What a `distill_task` job's `args` may name: its stage call's own keyword arguments, checked at submit.

Why: a stage's settings are the seeds' call's keyword arguments as they write them (`args`), free
form in the spec, so a misspelt one (`lerning_rate`) used to be Python's TypeError when the job
started, after it had waited in the queue for a node. The calls' signatures are the one list of what
each stage takes (no copy to drift): a key they do not name, one the job itself passes (where it
writes, the store it reads) or a missing required one is refused when the job is submitted, naming
the key and the ones the stage knows (`kinds.KINDS["distill_task"].check`).
"""

from __future__ import annotations

import difflib
import inspect
from typing import Any, Callable

from smolforge.cluster.control.kinds import named_file
from smolforge.cluster.workloads.distill.plans import StudentCall, TeacherCall
from smolforge.config import NAMED_DATASET_KEYS
from smolforge.distill.aggregate import aggregate_student_outputs
from smolforge.distill.settings import check_shared_tokenizer, shared_tokenizer_needs
from smolforge.errors import SmolforgeError

# stage -> the callable whose keyword arguments its `args` are: the seeds' teacher and students calls'
# arguments (`plans.TeacherCall` / `StudentCall`, which the runner's session call builds its plan from);
# the aggregate stage's session call passes them on to smolforge.distill.aggregate's
CALLS: dict[str, Callable[..., Any]] = {
    "teacher": TeacherCall,
    "students": StudentCall,
    "aggregate": aggregate_student_outputs,
}
# stage -> {argument the runner passes itself: where the spec says it instead}
OWNED: dict[str, dict[str, str]] = {
    "teacher": {"output_dir": "the job's run dir (output_dir at the spec's top level, embedded cluster only)"},
    "students": {"teacher_outputs_dir": "teacher_job (or, embedded, store_dir) at the spec's top level",
                 "output_dir": "the job's run dir (output_dir at the spec's top level, embedded cluster only)",
                 "resume": "nothing: a stage that runs again always resumes its students"},
    "aggregate": {"student_output_dirs": "student_tasks (or, embedded, student_dirs) at the spec's top level",
                  "output_path": "the job's run dir (output_dir at the spec's top level, embedded cluster only)"},
}


def known_args(stage: str) -> list[str]:
    """The keyword arguments a stage's `args` may give, in the call's order."""
    params = inspect.signature(CALLS[stage]).parameters.values()
    return [p.name for p in params if p.name != "self" and p.name not in OWNED[stage]
            and p.kind not in (p.VAR_POSITIONAL, p.VAR_KEYWORD)]


def check_task_args(job: Any) -> None:
    """Refuse a DistillTaskJob whose `args` its stage's call would refuse; one message naming the key."""
    stage, args = job.stage, _unnamed(job)
    known = known_args(stage)
    where = f"job spec (args of the {stage} stage)"
    for key in args:
        if key in OWNED[stage]:
            raise SmolforgeError(f"args.{key} is not for the job to give: the {stage} stage passes it itself",
                                 where=where, fix=f"drop it; the spec says it as {OWNED[stage][key]}")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise SmolforgeError(f"args.{key} is not an argument of the {stage} stage"
                                 + (f" (did you mean {close[0]!r}?)" if close else ""),
                                 where=where, fix=f"use the call's keyword arguments: {', '.join(known)}")
    params = inspect.signature(CALLS[stage]).parameters
    missing = [n for n in known if params[n].default is inspect.Parameter.empty and n not in args]
    if missing:
        raise SmolforgeError(f"the {stage} stage needs args.{missing[0]}", where=where,
                             fix=f"give {', '.join(f'args.{m}' for m in missing)} (the call's required arguments)")
    _check_students_tokenizer(args)


def _unnamed(job: Any) -> dict[str, Any]:
    """The job's `args` with a dataset by name (`dataset_name`, ...: the spec's, read into the stage's file
    where the job is submitted, `kinds.read_named`) counted as that file; a coordinator refuses one left
    unread (`kinds.check_uploads`). As they are for a stage that reads no dataset."""
    named = named_file({"kind": job.kind, "stage": job.stage, "args": job.args})
    if named is None or job.args.get("dataset_name") is None:
        return job.args
    args = {k: v for k, v in job.args.items() if k not in NAMED_DATASET_KEYS}
    return {**args, named.rpartition(".")[2]: job.args["dataset_name"]}


def _check_students_tokenizer(args: dict[str, Any]) -> None:
    """A students stage's on-policy steps need its teacher_model's tokenizer (when args name one: else
    the store's teacher, checked when the students load it): refused at submit, as `smolforge distill`."""
    teacher, on_policy = args.get("teacher_model"), args.get("on_policy_ratio") or 0.0
    if not teacher or not isinstance(on_policy, (int, float)):
        return
    bases = args.get("base_model")
    check_shared_tokenizer(teacher, [bases] if isinstance(bases, str) else list(bases or []),
                           shared_tokenizer_needs(float(on_policy)))
