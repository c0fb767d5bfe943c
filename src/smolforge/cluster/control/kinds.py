"""The job-kind registry: what each kind of job is, in one entry.

A kind is one spec (pydantic), one runner class, the spec fields that name local files (the client
uploads them to the coordinator before submitting, since workers share no filesystem with it), the
settings section `--set` routes unknown keys into, and its submit-time checks. `JobManager`,
`Client`, the embedded cluster and the CLI look kinds up here; none of them branches on a kind.

Adding a kind: write its spec and its runner (a `control.runner.JobRunner` that implements
`start_attempt` and `poll -> Outcome`, in its own package under `cluster/workloads/`), then add one
`JobKind` line to `KINDS`, naming the runner with `runner_at` (with `demand`: what the job holds
while it runs, which the queue in `JobManager` schedules by). Retries (`policy.FailurePolicy`) and
every state move come with the base runner; the queue, pause/resume/cancel and recovery with the
manager. The runner is handed the spec `parse` validated, never the raw dict.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable

from smolforge.cluster.control.placement import COORDINATOR, holds_anywhere, model_need, requirements_for
from smolforge.cluster.control.queue import Demand
from smolforge.cluster.nodes.ray_glue import Requirements
from smolforge.cluster.control.specs import (
    DataParallelJob, DistillJob, DistillTaskJob, ExportJob, ServeJob, from_seed_task, get_path, put_path,
)
from smolforge.cluster.control.specs import SplitJob
from smolforge.config import (
    EVAL_SPLIT_KEY, NAMED_DATASET_KEYS, Spec, apply_overrides, dataset_choice_problem, eval_split_problem, place_in, placed,
    validate,
)
from smolforge.data.synthetic import BUILTIN_DATASETS
from smolforge.errors import SmolforgeError, in_spec
from smolforge.distill.backends import teacher_backend
from smolforge.models.kinds import refuse_unused

if TYPE_CHECKING:
    from smolforge.cluster.control.artifacts import ArtifactStore


@dataclass(frozen=True)
class JobKind:
    name: str
    label: str  # how messages name it: "a {label} job"
    spec: type[Spec]
    runner: Callable[[], type]  # the runner class, imported when a job of the kind runs (Ray, torch)
    section: str | None  # the settings section: `--set` routes keys the job itself lacks into it (None: flat spec)
    uploads: tuple[str, ...] = ()  # dotted spec paths naming local files, uploaded before submit
    # those of `uploads` read before they are uploaded, by the one JSONL reader (`data.formats.read_examples`):
    # a held-out file's bad line is refused at its FILE:LINE where the spec is submitted, not by the run
    read_at_submit: tuple[str, ...] = ()
    # the one of `uploads` a dataset by name may stand for: its section takes `dataset_name`, ... (config.
    # NamedDataset), read into it at submit (`stage_spec`); `--set dataset_name=...` goes into that section.
    # A function of the spec where the kind's jobs differ in it (`by_stage`: a distill_task's stage)
    named: str | Callable[[dict[str, Any]], str | None] | None = None
    # the held-out file of `named`'s section that its `dataset_eval_split` is read into (train.data.eval_path);
    # a function of the spec as `named`
    named_eval: str | Callable[[dict[str, Any]], str | None] | None = None
    models: tuple[str, ...] = ()  # dotted spec paths naming models (a name, or a list of names)
    check: Callable[[Any], None] = field(default=lambda spec: None)  # deeper checks, before anything starts
    # the checks the submitting machine makes too (pure: no model, file or network), given the job and the
    # spec as submitted, whose `config.SpecFile` names a refused key's `file:line` (`check_fields`)
    check_here: Callable[[Any, dict[str, Any]], None] = field(default=lambda job, spec: None)
    check_capacity: bool = False  # fail at submit when the nodes cannot hold the job's workers
    joinable: bool = False  # `job join` lends it nodes
    # where a resumed job starts from, as a sentence: (the artifact store, job id) -> "step-40" / "the start"
    resumes_from: Callable[["ArtifactStore", str], str] = field(default=lambda artifacts, job_id: "the start")
    # what a job of the kind holds while it runs (spec, embedded?) -> Demand: the queue starts it when
    # that much is free, and a demand no set of nodes could ever hold fails at submit (check_capacity);
    # a job it answers None for asks for nothing, and never waits
    demand: Callable[[Any, bool], Demand | None] | None = None


WORKLOADS = "smolforge.cluster.workloads"


def runner_at(ref: str) -> Callable[[], type]:
    """The runner class named `module:Class`, imported when a job of the kind runs (Ray, torch).

    A kind's runner lives in its own package under `cluster/workloads/`, which imports this
    control plane; naming it by reference keeps the control plane from importing any workload
    (import-linter: control sits below workloads)."""

    def load() -> type:
        module, _, name = ref.partition(":")
        return getattr(importlib.import_module(module), name)

    return load


def check_at(ref: str) -> Callable[..., Any]:
    """A kind's submit-time check (or another of its answers: a students stage's ask) named `module:function`
    in its workload package (called with its own arguments), imported when first called (as `runner_at`, so
    the control plane imports no workload)."""
    load = runner_at(ref)
    return lambda *args: load()(*args)


_students_ask = check_at(f"{WORKLOADS}.distill.stage_args:students_ask")


def by_stage(files: dict[str, str]) -> Callable[[dict[str, Any]], str | None]:
    """A kind's `named` for jobs whose `stage` decides what a dataset by name stands for (a distill_task
    job: a teacher stage's prompts, a students stage's held-out set); None for a stage that reads none."""
    return lambda spec: files.get(str(spec.get("stage")))


def named_file(spec: dict[str, Any]) -> str | None:
    """The dotted spec path a dataset by name in SPEC (a dict) stands for (its kind's `named`), or None."""
    named = kind_of(spec).named
    return named(spec) if callable(named) else named


def named_eval_file(spec: dict[str, Any]) -> str | None:
    """The dotted spec path a dataset's eval split (`dataset_eval_split`) in SPEC stands for (its kind's
    `named_eval`: the held-out file beside `named_file`), or None where it has none."""
    named = kind_of(spec).named_eval
    return named(spec) if callable(named) else named


def _dp_demand(job: DataParallelJob, embedded: bool) -> Demand:
    """Its workers, plus the worker nodes lent with `job join` (the coordinator lends itself outside
    the worker pool)."""
    lent = [n for n in job.lent_nodes if n != COORDINATOR]
    return Demand(job.num_workers + len(lent), requirements_for(job, embedded))


def _distill_demand(job: DistillJob, embedded: bool) -> Demand:
    """One worker free to start on: a distill run spreads its teachers and students over every
    eligible worker itself, and waits there for the busy ones (its runner places them as they free)."""
    d = job.distill
    # a teacher lent the coordinator (--teacher-on-coordinator) needs no worker that holds its model,
    # nor one that travels (its runner brings it to the workers first: workloads/distill/travel.py)
    anywhere = teacher_backend(d.teacher_backend).loader.anywhere  # a model behind a URL: nothing to hold
    model = None if d.teacher_on_coordinator or anywhere else model_need(d.teacher, None, embedded)
    return Demand(1, Requirements(model=model, cpus=max(d.cpus_per_teacher, d.cpus_per_student)), noun="task")


def _distill_task_demand(job: DistillTaskJob, embedded: bool) -> Demand | None:
    """A teacher stage: one worker free to start on (its runner spreads its teachers as `distill` does; a
    teacher waiting for a CPU in Ray only waits). A students stage: its largest group's students, each at
    its CPUs per student, free at once (`stage_args.students_ask`: a ddp group's members start together or
    not at all, so a stage admitted into fewer CPUs would place a group that cannot start). Both hold a
    worker holding their model unless it travels. An aggregate stage merges on the coordinator: it asks
    for no worker, so it never waits in the queue (None)."""
    if job.stage == "aggregate":
        return None
    a = job.args
    model = a.get("model_path") if job.stage == "teacher" else a.get("base_model")
    model = model[0] if isinstance(model, list) and model else model
    if job.stage == "teacher" and a.get("teacher_on_coordinator"):
        model = None
    if job.stage == "teacher":
        tasks, cpus = 1, float(a.get("cpus_per_teacher") or 1.0)
    else:
        tasks, cpus = _students_ask(job)
    return Demand(tasks, Requirements(model=model_need(model, None, embedded) if isinstance(model, str) else None,
                                      cpus=cpus), noun="task")


def _serve_demand(job: ServeJob, embedded: bool) -> Demand:
    """One stage per node slot (auto: the plan may put the model on one node, so one); any worker when
    the model travels to the stages' nodes (`placement.model_travels`)."""
    model = model_need(job.model, None, embedded)
    return Demand(job.stages if isinstance(job.stages, int) else 1,
                  Requirements(model=model, cpus=job.cpus_per_stage, allowed_nodes=job.stage_nodes), noun="stage")


def _export_demand(job: ExportJob, embedded: bool) -> Demand:
    """One task on a node that holds the model, or any worker when the model travels (as its runner places it)."""
    return Demand(1, Requirements(model=model_need(job.model, job.require_model, embedded), cpus=job.cpus),
                  noun="task")


def split_trunk_requirements(job: SplitJob, embedded: bool) -> Requirements:
    """Where a split job's trunk may go (its runner places it by these, and the queue schedules by
    them): a worker holding the model (unless every node can build it), a GPU node first."""
    need_model = job.require_model if job.require_model is not None else not holds_anywhere(job.split.model, embedded)
    return Requirements(model=job.split.model if need_model else None, cpus=job.cpus, gpu=job.trunk_gpu,
                        allowed_nodes=job.trunk_nodes)


def _split_demand(job: SplitJob, embedded: bool) -> Demand:
    """The trunk: one worker slot (the client runs where `client_node` says, the coordinator's machine
    by default, outside the worker pool)."""
    return Demand(1, split_trunk_requirements(job, embedded), noun="trunk")


TRUNK_CHECKPOINTS = "trunk-checkpoints"  # a split job's trunk checkpoints in the artifact store (step-N)
CLIENT_CHECKPOINTS = "client-checkpoints"  # a split job's client checkpoints in the artifact store (step-N)


def _split_resumes_from(artifacts: "ArtifactStore", job_id: str) -> str:
    """The newest checkpoint step whose two halves the coordinator holds (trunk's and client's: a
    client placed again on another node fetches its half too); names are `step-N`."""
    shared = set(artifacts.list(job_id, TRUNK_CHECKPOINTS)) & set(artifacts.list(job_id, CLIENT_CHECKPOINTS))
    newest = max(shared, key=lambda name: int(name.rsplit("-", 1)[-1]), default=None)
    return f"the shared checkpoint {newest}" if newest else "the start"


def _dp_check(job: DataParallelJob) -> None:
    """A data-parallel job's settings its model kind cannot use (`refuse_unused`), named at `train.KEY`."""
    with in_spec("train"):
        refuse_unused(job.train, prefix="train.")


def _dp_resumes_from(artifacts: "ArtifactStore", job_id: str) -> str:
    return artifacts.latest_checkpoint(job_id) or "the start (no checkpoint yet)"


KINDS: dict[str, JobKind] = {k.name: k for k in (
    JobKind("data_parallel", "data-parallel", DataParallelJob, runner_at(f"{WORKLOADS}.data_parallel.runner:DPRunner"), section="train",
            uploads=("train.data.path", "train.data.eval_path"), named="train.data.path",
            named_eval="train.data.eval_path",
            models=("train.model",), check=_dp_check,
            check_capacity=True, joinable=True, resumes_from=_dp_resumes_from, demand=_dp_demand),
    JobKind("distill", "distillation", DistillJob, runner_at(f"{WORKLOADS}.distill.runner:DistillRunner"), section="distill",
            uploads=("distill.data", "distill.eval_data"), named="distill.data", named_eval="distill.eval_data",
            read_at_submit=("distill.eval_data",),
            models=("distill.teacher", "distill.students"),
            check=check_at(f"{WORKLOADS}.distill.run:check_job"),
            resumes_from=lambda artifacts, job_id: "its kept teacher shards and student checkpoints",
            demand=_distill_demand),
    JobKind("distill_task", "distillation task", DistillTaskJob,
            runner_at(f"{WORKLOADS}.distill.runner:DistillTaskRunner"), section="args",
            uploads=("args.dataset_path", "args.eval_data", "args.eval_path"), models=("args.model_path", "args.base_model"),
            named=by_stage({"teacher": "args.dataset_path", "students": "args.eval_data"}),
            named_eval=by_stage({"students": "args.eval_path"}),
            check=check_at(f"{WORKLOADS}.distill.stage_args:check_task_args"),
            check_here=check_at(f"{WORKLOADS}.distill.stage_args:check_arg_names"),
            resumes_from=lambda artifacts, job_id: "its kept teacher shards and student checkpoints",
            demand=_distill_task_demand),
    JobKind("serve", "serving", ServeJob, runner_at(f"{WORKLOADS}.serve.runner:ServeRunner"), section=None, models=("model",),
            resumes_from=lambda artifacts, job_id: "the start (stages load again)", demand=_serve_demand),
    JobKind("export", "export", ExportJob, runner_at(f"{WORKLOADS}.export.runner:ExportRunner"), section=None, models=("model",),
            resumes_from=lambda artifacts, job_id: "the start (the export runs again)", demand=_export_demand),
    JobKind("split", "split-learning", SplitJob, runner_at(f"{WORKLOADS}.split.runner:SplitRunner"), section="split",
            uploads=("split.dataset", "split.eval_dataset"), named="split.dataset", named_eval="split.eval_dataset",
            models=("split.model",),
            resumes_from=_split_resumes_from, demand=_split_demand),
)}


def kind_of(spec: dict[str, Any] | str) -> JobKind:
    name = spec if isinstance(spec, str) else spec.get("kind", "data_parallel")
    kind = KINDS.get(name)
    if kind is None:
        raise SmolforgeError(f"unknown job kind {name!r}", where="job spec", fix=f"use one of {', '.join(KINDS)}")
    return kind


def parse(spec: dict[str, Any]) -> Any:
    """The validated spec object of a job dict (every setting checked before anything starts)."""
    kind = kind_of(spec)
    job = validate(kind.spec, spec, where="job spec")
    kind.check(job)
    return job


def check_fields(spec: dict[str, Any]) -> None:
    """SPEC's fields checked against its kind's spec where it is submitted (the kind's deeper checks and
    the coordinator's own validation come later): a spec file's bad field is one message naming
    `file:line` (`config.SpecFile`), before anything is sent or a cluster starts; then the kind's own
    checks the submitting machine can make (`JobKind.check_here`: a distill_task's `args` keys, each at its
    line). SmolforgeError (exit 2)."""
    kind = kind_of(spec)
    kind.check_here(validate(kind.spec, spec, where="job spec"), spec)


def check_output_dir(job: Any, embedded: bool) -> None:
    """A job may name a directory to write into only on the embedded cluster (this machine): a
    coordinator never writes where a network peer tells it to."""
    out = getattr(job, "output_dir", None)
    if out is None:
        return
    if not embedded:
        raise SmolforgeError("output_dir is for the embedded cluster only: a coordinator keeps each run in its "
                             "state dir", where="job spec",
                             fix="drop output_dir; the client downloads the results (`smolforge distill "
                                 "--output-dir` does)")
    if not Path(out).is_absolute() or ".." in Path(out).parts:
        raise SmolforgeError(f"output_dir {out} must be an absolute path without '..'", where="job spec",
                             fix="give the absolute directory to write the run into")


def is_local_file(value: Any) -> bool:
    return bool(value) and value not in BUILTIN_DATASETS and not str(value).startswith("upload:")


def stage_spec(spec: dict, upload: Callable[[Path], str]) -> dict:
    """Replace the local files a job names by uploads (the workers share no filesystem with us); a
    dataset by name is read into its file first (`read_named`) and uploaded as any JSONL. A missing file
    is refused at its spec line; one of the kind's `read_at_submit` (a held-out file) is read first, a
    bad line refused at its FILE:LINE."""
    spec = read_named(spec)
    for dotted in kind_of(spec).uploads:
        value = get_path(spec, dotted)
        if not is_local_file(value):
            continue
        path = Path(str(value)).expanduser()
        if not path.is_file():
            raise SmolforgeError(f"dataset {value} does not exist",
                                 where=place_in(spec, tuple(dotted.split(".")), dotted),  # a file's: file:line
                                 fix="check the path, or name a dataset every node has: "
                                     f"{', '.join(BUILTIN_DATASETS)} ('bundled': the generated task set)")
        if dotted in kind_of(spec).read_at_submit:
            from smolforge.data.formats import read_examples

            read_examples(path, skip_hint=False)
        put_path(spec, dotted, upload(path))
    return spec


def read_named(spec: dict) -> dict:
    """A job spec (a dict, before validation) with its dataset by name (`dataset_name: N` [`dataset_config`,
    `dataset_split`, `dataset_column`] in the section of the kind's `named` file: `train.data`, `distill`,
    `split`) read into that file (`data.hub.resolve_in`: one JSONL file, written once), here, on the
    submitting machine; a name not cached, or given with a file too, is refused here, before anything is
    sent or starts (the rule of `config.NamedDataset`, which the spec's validation applies anyway). In
    place; returned."""
    spec = from_seed_task(spec)
    named = named_file(spec)
    where, _, key = (named or "").rpartition(".")
    section = get_path(spec, where) if named else None
    if not isinstance(section, dict):
        return spec
    problem = dataset_choice_problem(key, section.get(key), section, lambda k: f"{where}.{k}")
    # a refusal across the section's dataset keys names each given one (`fields`), at the first one's line
    given = lambda *keys: tuple((*where.split("."), k) for k in keys if section.get(k) is not None)  # noqa: E731
    if problem:
        raise placed(SmolforgeError(problem, where="job spec", fix=f"give one of {where}.{key} and {where}.dataset_name",
                                    fields=given(*NAMED_DATASET_KEYS[1:]) if section.get("dataset_name") is None
                                    else given(key, "dataset_name")), spec)
    eval_key = (named_eval_file(spec) or "").rpartition(".")[2] or None
    problem = eval_key and eval_split_problem(eval_key, section.get(eval_key), section.get("dataset_name"),
                                              section.get(EVAL_SPLIT_KEY), lambda k: f"{where}.{k}")
    if problem:
        raise placed(SmolforgeError(problem, where="job spec", fix=f"give one of {where}.{eval_key} and "
                                    f"{where}.{EVAL_SPLIT_KEY} (with {where}.dataset_name)",
                                    fields=given(EVAL_SPLIT_KEY, eval_key, "dataset_name")), spec)
    if section.get("dataset_name") is not None:
        from smolforge.data.hub import resolve_in

        put_path(spec, where, resolve_in(section, key, eval_key))
    return spec


def pin_local_models(spec: dict) -> dict:
    """Models named by a local directory, made absolute: on the embedded cluster (this machine) every
    task loads them in place, whatever its working directory."""
    def pinned(name: Any) -> Any:
        path = Path(str(name)).expanduser()
        return str(path.resolve()) if isinstance(name, str) and path.is_dir() else name

    for dotted in kind_of(spec).models:
        value = get_path(spec, dotted)
        if value is not None:
            put_path(spec, dotted, [pinned(v) for v in value] if isinstance(value, list) else pinned(value))
    return spec


def check_uploads(job: Any, has_upload: Callable[[str], bool]) -> None:
    """Every file the job names is an upload the coordinator holds (or 'bundled'), and no dataset by name
    is left unread (`stage_spec` reads it where the job is submitted: this side has no such cache)."""
    data = job.model_dump(mode="json")
    named = named_file(data)
    name = get_path(data, named.rpartition(".")[0] + ".dataset_name") if named else None
    if name is not None:
        raise SmolforgeError(f"{named.rpartition('.')[0]}.dataset_name {name!r} was not read into a file at submit",
                             where="job spec", fix="submit with `smolforge submit`/`launch` or smolforge.Client, "
                             "which read the dataset on the submitting machine and upload it")
    for dotted in kind_of(job.kind).uploads:
        value = get_path(data, dotted)
        if value is None or value in BUILTIN_DATASETS:
            continue
        if not str(value).startswith("upload:"):
            raise SmolforgeError(f"{dotted} {value!r} is a path on the submitting machine", where="job spec",
                                 fix="submit with `smolforge submit`/`launch` or smolforge.Client, which upload "
                                     "the file to the coordinator first")
        if not has_upload(str(value).split(":", 1)[1]):
            raise SmolforgeError(f"{dotted}: upload {str(value)[7:19]} is not on the coordinator",
                                 where="job spec", fix="upload the file again (Client.upload)")


def apply_job_overrides(data: dict, overrides: list[str]) -> dict:
    """`--set` for job specs: the job's own keys as they are; `training.x`, `train.x` and every other key
    go into the kind's settings section (`train:` or `distill:`), parsed by config.apply_overrides."""
    kind = kind_of(data)
    job_keys = set(kind.spec.model_fields)
    for item in overrides:
        if "=" not in item:
            raise SmolforgeError(f"--set {item!r} is not key=value", fix="write it as --set training.batch_size=16")
        key, _, raw = item.partition("=")
        parts = [p for p in key.strip().split(".") if p]
        if not parts:
            raise SmolforgeError(f"--set {item!r} has an empty key", fix="write it as --set max_steps=100")
        if kind.section is None:
            if parts[0] not in job_keys:
                raise SmolforgeError(f"--set {item!r}: a {kind.label} job has no setting {parts[0]!r}",
                                     fix=f"use one of {', '.join(sorted(job_keys - {'kind'}))}")
            apply_overrides(data, [".".join(parts) + "=" + raw], strip_training=False)
            continue
        named = named_file(data)
        if named and parts[-1] in (*NAMED_DATASET_KEYS, EVAL_SPLIT_KEY) and (
                len(parts) == 1 or len(parts) == 2 and parts[0] in ("training", "train", kind.section)):
            parts = [*named.rpartition(".")[0].split("."), parts[-1]]  # dataset_name=N: beside the data file
        if parts[0] in ("training", "train", kind.section):
            parts = parts[1:]
            target = data.setdefault(kind.section, {})
        elif parts[0] in job_keys:
            target = data
        else:
            target = data.setdefault(kind.section, {})
        if not parts:
            raise SmolforgeError(f"--set {item!r} names a section, not a setting", fix="e.g. --set train.lr=1e-4")
        if not isinstance(target, dict):
            raise SmolforgeError(f"--set {item!r}: {kind.section} is not a section", fix="check the key path")
        apply_overrides(target, [".".join(parts) + "=" + raw], strip_training=False)
    return data
