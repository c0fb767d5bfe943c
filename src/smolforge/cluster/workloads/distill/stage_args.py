"""What a `distill_task` job's `args` may name: its stage call's own keyword arguments, checked at submit.

Why: a stage's settings are the seeds' call's keyword arguments as they write them (`args`), free
form in the spec, so a misspelt one (`lerning_rate`) used to be Python's TypeError when the job
started, after it had waited in the queue for a node. The calls' signatures are the one list of what
each stage takes (no copy to drift): a key they do not name, one the job itself passes (where it
writes, the store it reads) or a missing required one is refused when the job is submitted, naming
the key and the ones the stage knows (`kinds.KINDS["distill_task"].check`). The keys and the values'
types are checked where the spec is submitted too (`check_arg_names`, the kind's `check_here`, pure),
so a spec file's bad `args.KEY` is named at that key's `file:line`.

Their values are checked at submit too, by the builders the job runs (`stage_call`, then
`plans.plan_teachers` / `plan_students`, or an aggregate's `AggregateSettings.checked`): a value of the
wrong type (`top_k: "many"`) or one the stage refuses (`kd_ratio: 2`, an unknown `kd_loss`, a TaskConfig
asking for RAM, an unknown merge `method`, a `density` of 0) is one message naming the argument before
any job exists, not the job's failure after its wait in the queue.
"""

from __future__ import annotations

import difflib
import inspect
from dataclasses import fields
from functools import cache
from typing import Any, Callable

from pydantic import TypeAdapter, ValidationError

from smolforge.cluster.control.kinds import named_file
from smolforge.cluster.workloads.distill.plans import StudentCall, TeacherCall, plan_students, plan_teachers
from smolforge.config import NAMED_DATASET_KEYS, place_in
from smolforge.distill.aggregate import AggregateSettings
from smolforge.distill.settings import check_shared_tokenizer, shared_tokenizer_needs
from smolforge.errors import SmolforgeError

# stage -> the callable whose keyword arguments its `args` are: the seeds' teacher and students calls'
# arguments (`plans.TeacherCall` / `StudentCall`, which the runner's session call builds its plan from);
# the aggregate stage's session call passes them on to smolforge.distill.aggregate's (`AggregateSettings`)
CALLS: dict[str, Callable[..., Any]] = {
    "teacher": TeacherCall,
    "students": StudentCall,
    "aggregate": AggregateSettings,
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
    """Refuse a DistillTaskJob whose `args` its stage's call would refuse; one message naming the key (the
    kind's check, where the job is created: `check_arg_names`, then the values as the builders see them)."""
    check_arg_names(job)
    args = _unnamed(job)
    _check_values(job.stage, job.mode, args, f"job spec (args of the {job.stage} stage)")
    _check_students_tokenizer(args)


def check_arg_names(job: Any, spec: dict[str, Any] | None = None) -> None:
    """Refuse a DistillTaskJob whose `args` name a key its stage's call does not take (or one the job passes
    itself), miss a required one, or give a value of the wrong type; one message naming `args.KEY`. Pure (no
    model, no file, no network): the submitting machine's check too (`kinds.check_fields`), where SPEC is
    the spec as submitted: read from a file (`config.SpecFile`), each refusal is at that key's `file:line`
    (a missing key: the `args` section's), else at the stage's args."""
    stage, args = job.stage, _unnamed(job)
    known = known_args(stage)
    default = f"job spec (args of the {stage} stage)"

    def where(key: str | None = None) -> str:
        return place_in(spec, ("args", key) if key else ("args",), default)

    for key in args:
        if key in OWNED[stage]:
            raise SmolforgeError(f"args.{key} is not for the job to give: the {stage} stage passes it itself",
                                 where=where(key), fix=f"drop it; the spec says it as {OWNED[stage][key]}")
        if key not in known:
            close = difflib.get_close_matches(key, known, n=1)
            raise SmolforgeError(f"args.{key} is not an argument of the {stage} stage"
                                 + (f" (did you mean {close[0]!r}?)" if close else ""),
                                 where=where(key), fix=f"use the call's keyword arguments: {', '.join(known)}")
    params = inspect.signature(CALLS[stage]).parameters
    missing = [n for n in known if params[n].default is inspect.Parameter.empty and n not in args]
    if missing:
        raise SmolforgeError(f"the {stage} stage needs args.{missing[0]}", where=where(),
                             fix=f"give {', '.join(f'args.{m}' for m in missing)} (the call's required arguments)")
    if stage in PLACEHOLDERS:
        stage_call(stage, args, place=where, **PLACEHOLDERS[stage])


def _unnamed(job: Any) -> dict[str, Any]:
    """The job's `args` with a dataset by name (`dataset_name`, ...: the spec's, read into the stage's file
    where the job is submitted, `kinds.read_named`) counted as that file; a coordinator refuses one left
    unread (`kinds.check_uploads`). As they are for a stage that reads no dataset."""
    named = named_file({"kind": job.kind, "stage": job.stage, "args": job.args})
    if named is None or job.args.get("dataset_name") is None:
        return job.args
    args = {k: v for k, v in job.args.items() if k not in NAMED_DATASET_KEYS}
    return {**args, named.rpartition(".")[2]: job.args["dataset_name"]}


# stage -> the placeholders for what the job passes itself (paths only: no builder reads them)
PLACEHOLDERS: dict[str, dict[str, str]] = {"teacher": {"output_dir": "."}, "students": {"teacher_outputs_dir": "."},
                                           "aggregate": {}}


@cache
def _adapter(stage: str) -> TypeAdapter:
    """The stage call's pydantic adapter, built once per stage (63 ms each: a refusal's naming tries the
    builder once per arg, each try validating anew)."""
    return TypeAdapter(CALLS[stage])


def stage_call(stage: str, args: dict[str, Any], place: Callable[[str], str] | None = None,
               **owned: Any) -> TeacherCall | StudentCall:
    """A teacher or students stage's call from a job's `args` and what the job passes itself (`owned`),
    its values' types checked by the call's own field types (pydantic, lax: JSON's numbers and strings
    as the fields take them; a TaskConfig's dict becomes a TaskConfig). SmolforgeError naming the first
    argument whose value has the wrong type, where `place(key)` says (default: the stage's args)."""
    call = CALLS[stage]
    try:
        return _adapter(stage).validate_python({**args, **owned})
    except ValidationError as err:
        first = err.errors()[0]
        key = ".".join(str(part) for part in first["loc"])
        wanted = call.__dataclass_fields__[str(first["loc"][0])].type  # type: ignore[attr-defined]
        raise SmolforgeError(f"args.{key}: {first['msg']} (got {first['input']!r})",
                             where=place(str(first["loc"][0])) if place else f"job spec (args of the {stage} stage)",
                             fix=f"give args.{first['loc'][0]} as the {stage} call takes it: {wanted}") from None


def typed_args(stage: str, args: dict[str, Any]) -> dict[str, Any]:
    """The job's `args` with their values as the call's fields hold them (what the stage runs with and
    what `check_task_args` checked at submit): those given, no defaults added."""
    call = stage_call(stage, args, **PLACEHOLDERS[stage])
    return {f.name: getattr(call, f.name) for f in fields(call) if f.name in args}


def students_ask(job: Any) -> tuple[int, float]:
    """What a students stage (a DistillTaskJob, checked at submit) asks of the job queue: (tasks, CPUs
    each). Its tasks are its largest group, as its plan forms them (`plan_students`: `sync.groups` over one
    base's students, each at the plan's CPUs per student), since a group's members start together or not at
    all: every student of a base for `ddp`, one for independent (`average`) students. The queue admits the
    stage when that many are free, so two stages' groups are not started into the same CPUs (kinds.py)."""
    plan = plan_students(stage_call("students", _unnamed(job), **PLACEHOLDERS["students"]), job.mode)
    groups = plan.sync.groups([f"student-{i}" for i in range(plan.num_students)])
    return max((len(g) for g in groups), default=1), plan.cpus


def _check_values(stage: str, mode: str, args: dict[str, Any], where: str) -> None:
    """A stage's `args` (a dataset by name counted as its file) as the builders the job runs check them
    (the `mode`'s own rules included), at submit; the builder's refusal, where: the args, naming the
    `args.KEY` it is about (`_refused_keys`; two that conflict: both) before the builder's words, and as its
    `fields` (a spec file's line: the first of them the file wrote, `config.placed`)."""
    call = stage_call(stage, args, **PLACEHOLDERS[stage])  # (a wrong type: its refusal names args.KEY)
    try:
        _build(call, mode)
    except SmolforgeError as err:
        refused = _refused_keys(stage, mode, args)
        keys = ", ".join(f"args.{key}" for key in refused)
        raise SmolforgeError(f"{keys}: {err.what}" if keys else err.what, fix=err.fix,
                             where=f"{where}, {err.where}" if err.where else where,
                             fields=tuple(("args", key) for key in refused)) from None  # its line: config.placed


def _build(call: TeacherCall | StudentCall | AggregateSettings, mode: str) -> None:
    """The builder the stage runs, on its call (`stage_call`; an aggregate's: its settings, AggregateSettings);
    SmolforgeError: a value it refuses."""
    if isinstance(call, TeacherCall):
        plan_teachers(call)
    elif isinstance(call, StudentCall):
        plan_students(call, mode)
    else:
        call.checked()


def _refused_keys(stage: str, mode: str, args: dict[str, Any]) -> list[str]:
    """The keys of `args` a builder's refusal is about: each one whose leaving out (its default in its
    place) makes the builder take the rest (both of two that conflict). Empty when none alone does."""
    out = []
    for key in args:
        try:
            _build(stage_call(stage, {k: v for k, v in args.items() if k != key}, **PLACEHOLDERS[stage]), mode)
        except SmolforgeError:
            continue
        out.append(key)
    return out


def _check_students_tokenizer(args: dict[str, Any]) -> None:
    """A students stage's on-policy steps need its teacher_model's tokenizer (when args name one: else
    the store's teacher, checked when the students load it): refused at submit, as `smolforge distill`,
    naming the args it is about."""
    teacher, on_policy = args.get("teacher_model"), args.get("on_policy_ratio") or 0.0
    if not teacher or not isinstance(on_policy, (int, float)):
        return
    bases = args.get("base_model")
    try:
        check_shared_tokenizer(teacher, [bases] if isinstance(bases, str) else list(bases or []),
                               shared_tokenizer_needs(float(on_policy)), names=("teacher_model", "base_model"))
    except SmolforgeError as err:  # its settings are the args' (on_policy_ratio, base_model, teacher_model)
        raise SmolforgeError(f"args.teacher_model, args.base_model: {err.what}",
                             where="job spec (args of the students stage)", fix=err.fix,
                             fields=tuple(("args", *f) for f in err.fields)) from None
