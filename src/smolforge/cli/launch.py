"""Launching training: `smolforge launch` and `smolforge submit`, each following its job to the end.

    smolforge launch --model M --dataset D --workers N --mode data_parallel|teacher_student|hybrid [--student S ...]
    smolforge submit job.yaml [--set key=value]

With no coordinator configured, both run on an embedded cluster of this machine (same manager,
same workers); see smolforge.cli.cluster for how a coordinator is found.
"""

from __future__ import annotations

from pathlib import Path
from typing import Annotated, Any, Callable, Optional

import typer

from smolforge.cli.aliases import seed_command
from smolforge.cli.cluster import COORD_HELP, STATE_HELP, TOKEN_HELP, _backend
from smolforge.cli.common import (PRIORITY_HELP, TOKEN_FILE_HELP, cli_token, print_json, quiet_libraries,
                                  run_cli)
from smolforge.cli.follow import finish_job, refuse_used_download_dir, wait_with_progress
from smolforge.cli.export import check_run_export, export_run
from smolforge.cli.hubdata import (DatasetColumnOpt, DatasetConfigOpt, DatasetEvalSplitOpt, DatasetNameOpt,
                                   DatasetSplitOpt, EvalDataOpt, dataset_files, sets_a_dataset)
from smolforge.distill.kdconfig import KD_LOSSES
from smolforge.errors import SmolforgeError
from smolforge.models.dtypes import DTYPE_HELP
from smolforge.models.export.targets import RUN_TARGETS
from smolforge.models.peft_spec import METHODS as PEFT_METHODS

# `launch`'s options whose help runs over a line, named here so that its signature reads one line per
# option (their defaults stay there).
StrategyOpt = Annotated[Optional[str], typer.Option(help="data_parallel: how the ranks share learning: {strategies} "
    "(settings: --set strategy_config.KEY=VALUE)")]
StagesOpt = Annotated[Optional[int], typer.Option(help="model parallelism: split the model's layers into N stages, "
    "one per worker (the pipeline strategy; implies --mode model_parallel)")]
BalanceOpt = Annotated[str, typer.Option(help="data_parallel, synchronous strategies: rows per rank follow each "
    "rank's measured speed when speeds differ by >20% (auto), or equal (off)")]
ModeOpt = Annotated[str, typer.Option(help="data_parallel | model_parallel | teacher_student | hybrid "
    "| split (distillation: --model is the teacher, --student the student, --workers the "
    "students; split: a trunk server the coordinator places, the client where "
    "--client-node says)")]
SplitPoint1Opt = Annotated[Optional[int], typer.Option("--split-point-1", help="split: bottom = embeddings + "
    "layers [0, A), on the client")]
SplitPoint2Opt = Annotated[Optional[int], typer.Option("--split-point-2", help="split: trunk = layers [A, B), on "
    "a worker holding the model (a GPU first); top = the rest")]
ClientNodeOpt = Annotated[Optional[str], typer.Option("--client-node", help="split: where the client (the data, "
    "bottom and top) runs: @coordinator (default: the coordinator's "
    "machine; embedded: this one) or a worker's name")]
NumTeachersOpt = Annotated[Optional[int], typer.Option(help="teacher_student/hybrid: teacher tasks "
    "(default: one per node holding the teacher)")]
SaveEveryOpt = Annotated[Optional[int], typer.Option(help="checkpoint every N steps (recovery resumes there; default: a tenth "
    "of --max-steps within 10..200, 50 with --epochs; 0: none)")]
GpuOpt = Annotated[Optional[str], typer.Option(help="no|preferred|required (default no; --mode split: the trunk's "
    "node, default preferred)")]
OutputDirOpt = Annotated[Optional[str], typer.Option(help="where the final adapter is downloaded (default outputs/<job>); "
    "on the embedded cluster also where --tensorboard/--wandb write")]
TensorboardOpt = Annotated[bool, typer.Option("--tensorboard", help="TensorBoard event files, one run dir per rank "
    "(tensorboard/rank<R>) or student (tensorboard/student<N>), written by the "
    "coordinator in <state dir>/runs/<job>/ (distill: distill/<job>/); on the "
    "embedded cluster in --output-dir when given")]
WandbOpt = Annotated[Optional[str], typer.Option("--wandb", metavar="PROJECT", help="one offline W&B run per rank/student next to the TensorBoard files "
    "(wandb/; the package's wandb extra; upload later with `wandb sync`)")]
ExportOpt = Annotated[Optional[str], typer.Option("--export", help=f"{'|'.join(RUN_TARGETS)}: export the final adapter, merged "
    "and verified, into <output-dir>/export/")]


LAUNCH_HELP = """Launch distributed training: data-parallel, or teacher→student distillation.

data_parallel: N ranks with DDP, rendezvous through Ray. teacher_student: --model is the
teacher, --student the student, --workers the number of students; hybrid: the same, with
teachers and the data-parallel students kept on separate nodes. `smolforge distill` has
every distillation setting.

With no coordinator given or running, it runs on an embedded cluster of this machine.

Example: smolforge launch --model tiny-llama --dataset data.jsonl --workers 2 --mode data_parallel --max-steps 100

Example: smolforge launch --model tiny-llama --dataset bundled --workers 2 --strategy zero1 --max-steps 100

Example: smolforge launch --model tiny-llama --dataset bundled --workers 2 --strategy diloco --set strategy_config.inner_steps=20 --set strategy_config.codec=int8

Example: smolforge launch --model tiny-llama --dataset bundled --workers 3 --strategy async-ps --set strategy_config.codec=int8

Example: smolforge launch --model tiny-llama --dataset bundled --workers 2 --strategy auto  (the ranks measure their links and step time, then run ddp or diloco; `job show` says which and why)

Example: smolforge launch --model mlp --dataset digits --workers 2 --strategy diloco --max-steps 150 --batch-size 16 --lr 1e-2  (not a language model: an MLP on scikit-learn's digits, held-out accuracy)

Example: smolforge launch --model tiny-llama --dataset bundled --stages 2 --max-steps 100 --set strategy_config.schedule=gpipe

Example: smolforge launch --model tiny-llama --dataset bundled --workers 1 --priority high --detach

Example: smolforge launch --mode hybrid --model small-llama --student tiny-llama --dataset bundled --workers 2 --max-steps 50

Example: smolforge launch --mode teacher_student --model small-llama --student tiny-llama --dataset prompts.jsonl --eval-data held_out.jsonl --max-steps 50  (the students evaluated on a held-out file, whole; read when submitted)

Example: smolforge launch --model tiny-llama --dataset bundled --workers 2 --max-steps 50 --tensorboard --wandb my-project --output-dir outputs/dp  (then: tensorboard --logdir outputs/dp/tensorboard)

Example: smolforge launch --model tiny-llama --dataset bundled --workers 2 --max-steps 50 --dtype bf16  (LoRA base in bf16)

Example: smolforge launch --mode split --model tiny-llama --dataset data.jsonl --split-point-1 1 --split-point-2 3 --max-steps 50

Example: smolforge launch --model tiny-llama --dataset-name wikitext --dataset-config wikitext-2-raw-v1 --dataset-eval-split validation --workers 2 --max-steps 50  (a Hugging Face dataset, read offline from the local cache at submit, uploaded as JSONL, its validation split held out; or --set dataset_name=wikitext)
"""  # `launch --help`: what it does and an example per kind of job


def register(app: typer.Typer) -> None:
    _register_launch(app)
    _register_submit(app)


def _register_launch(app: typer.Typer) -> None:
    """`launch`: every option of a data-parallel, model-parallel or distill job, as flags."""

    @app.command(cls=seed_command("launch"), help=LAUNCH_HELP)
    @run_cli
    def launch(
        model: str = typer.Option(..., help="HF id, local dir, Ollama name or preset (tiny-llama)"),
        dataset: Optional[str] = typer.Option(None, help="JSONL file (uploaded to the coordinator), or 'bundled'"),
        dataset_name: DatasetNameOpt = None,
        dataset_config: DatasetConfigOpt = None,
        dataset_split: DatasetSplitOpt = None,
        dataset_column: DatasetColumnOpt = None,
        dataset_eval_split: DatasetEvalSplitOpt = None,
        eval_data: EvalDataOpt = None,
        workers: Optional[int] = typer.Option(None, help="ranks (default 2; with --stages, the stage count)"),
        strategy: StrategyOpt = None,
        stages: StagesOpt = None,
        balance: BalanceOpt = "auto",
        mode: ModeOpt = "data_parallel",
        split_point_1: SplitPoint1Opt = None,
        split_point_2: SplitPoint2Opt = None,
        client_node: ClientNodeOpt = None,
        student: list[str] = typer.Option([], help="teacher_student/hybrid: student base model (repeatable)"),
        kd_loss: str = typer.Option("forward_kl", help=f"teacher_student/hybrid: {'|'.join(KD_LOSSES)}"),
        kd_ratio: float = typer.Option(0.5, help="teacher_student/hybrid: weight of the KD term"),
        temperature: float = typer.Option(1.0, help="teacher_student/hybrid: KD temperature"),
        top_k: int = typer.Option(32, help="teacher_student/hybrid: teacher logits kept per token"),
        num_teachers: NumTeachersOpt = None,
        teacher_backend: Optional[str] = typer.Option(None, help="teacher_student/hybrid: how the teacher runs "
                                                      "(default hf; `smolforge distill --help` lists them)"),
        teacher_url: Optional[str] = typer.Option(None, help="--teacher-backend openai: the endpoint's base URL "
                                                  "(e.g. http://host:8000/v1); --model: the name it serves"),
        teacher_key_file: Optional[str] = typer.Option(None, help="--teacher-backend openai: a file holding the "
                                                       "API key (default: $OPENAI_API_KEY; never on argv)"),
        epochs: Optional[float] = typer.Option(None),
        batch_size: int = typer.Option(4, help="per worker; the global batch is batch size x workers"),
        max_length: Optional[int] = typer.Option(None, help="truncate sequences to this many tokens"),
        max_steps: Optional[int] = typer.Option(None, help="optimizer steps (overrides --epochs)"),
        lr: Optional[float] = typer.Option(None),
        peft: Optional[str] = typer.Option(None, help=f"{'|'.join(PEFT_METHODS)} (default lora)"),
        lora_r: Optional[int] = typer.Option(None, help="LoRA rank"),
        lora_alpha: Optional[float] = typer.Option(None, help="LoRA alpha"),
        save_every: SaveEveryOpt = None,
        seed: Optional[int] = typer.Option(None),
        dtype: Optional[str] = typer.Option(None, "--dtype", help=DTYPE_HELP + " (distillation: teacher and students)"),
        cpus_per_worker: float = typer.Option(1.0, help="CPUs (and torch threads) per rank"),
        gpu: GpuOpt = None,
        max_retries: int = typer.Option(2, help="worker failures to survive"),
        name: Optional[str] = typer.Option(None, help="a name for the job"),
        priority: str = typer.Option("normal", help=PRIORITY_HELP),
        output_dir: OutputDirOpt = None,
        tensorboard: TensorboardOpt = False,
        wandb: WandbOpt = None,
        set_: list[str] = typer.Option([], "--set", help="override any setting, e.g. --set training.warmup_steps=10"),
        detach: bool = typer.Option(False, "--detach", help="submit and return (coordinator only)"),
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP + "; none: embedded cluster"),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        token_file: Optional[str] = typer.Option(None, "--token-file", help=TOKEN_FILE_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
        json_out: bool = typer.Option(False, "--json", help="print the final status as JSON"),
        export: ExportOpt = None,
    ):
        # held_out: --eval-data's file, or --dataset-eval-split's
        dataset, held_out = dataset_files(locals(), "dataset", "--dataset", "eval_data")
        if dataset is None and not sets_a_dataset(set_):
            raise SmolforgeError("no dataset given", fix="pass --dataset FILE|bundled or --dataset-name NAME")
        flags = dict(locals())  # every option by name, as given
        after = _export_after(flags)
        if mode not in ("teacher_student", "hybrid"):
            _only_distill({f"--{k.replace('_', '-')}": flags[k] for k in _TEACHER_FLAGS}, mode)
        if mode == "split":
            _launch_split_flags(flags, after)
            return
        _not_for({"--split-point-1": split_point_1, "--split-point-2": split_point_2, "--client-node": client_node})
        if mode in ("teacher_student", "hybrid"):
            _launch_distill_flags(flags, after)
        else:
            _launch_data_parallel_flags(flags, after)


def _register_submit(app: typer.Typer) -> None:
    """`submit`: a job file as it is (with --set overrides)."""

    @app.command(cls=seed_command("submit"))
    @run_cli
    def submit(
        job_file: Path = typer.Argument(..., help="a job YAML: kind data_parallel (num_workers, train: {...}), distill (mode, distill: {...}) "
                                   "or split (client_node, split: {...})"),
        set_: list[str] = typer.Option([], "--set", help="override a setting, e.g. --set num_workers=3"),
        priority: Optional[str] = typer.Option(None, help=PRIORITY_HELP + " (default: the file's, else normal)"),
        wait: bool = typer.Option(False, "--wait", help="follow the job to its end"),
        output_dir: Optional[str] = typer.Option(None, help="with --wait: where the adapter is downloaded"),
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP + "; none: embedded cluster (implies --wait)"),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        token_file: Optional[str] = typer.Option(None, "--token-file", help=TOKEN_FILE_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
        json_out: bool = typer.Option(False, "--json"),
    ):
        """Submit a job file. Local dataset paths are uploaded to the coordinator first; a dataset by name
        (`dataset_name: wikitext` [`dataset_config`, `dataset_split`, `dataset_column`] beside the data file's
        key: in train.data, distill or split) is read offline from the local HF cache here and uploaded as JSONL.

        Example: smolforge submit job.yaml --set train.max_steps=200 --wait

        Example: smolforge submit job.yaml --priority high

        Example: smolforge submit job.yaml --set dataset_name=wikitext --set dataset_config=wikitext-2-raw-v1
        """
        refuse_used_download_dir(output_dir)
        backend = _backend(coordinator, cli_token(token, token_file), state_dir, embedded_ok=True)
        embedded = backend.runs_in_process
        try:
            job_id = backend.submit_job(job_file, [*set_, *([f"priority={priority}"] if priority else [])])
            if embedded:  # as launch: `job resume` downloads where this command would have
                backend.remember_output_dir(job_id, output_dir or f"outputs/{job_id}")
            if not (wait or embedded):
                if json_out:
                    print_json({"job_id": job_id})
                else:
                    typer.echo(job_id)
                return
            st = wait_with_progress(backend, job_id, quiet or json_out)
            finish_job(backend, st, output_dir or f"outputs/{job_id}", json_out)
        finally:
            backend.close()


def _export_after(o: dict[str, Any]) -> Callable[[Path], dict] | None:
    """`launch --export`, checked before anything starts: what exports the adapter once the job is done."""
    export, mode, student = o["export"], o["mode"], o["student"]
    check_run_export(export, o["peft"] or "lora")
    if export and mode in ("teacher_student", "hybrid") and not student:
        raise SmolforgeError("--export needs the student named: give --student (without it the student is "
                             "picked when the job is planned)", fix="add --student NAME, or drop --export")
    if export and mode in ("teacher_student", "hybrid") and len(set(student)) > 1:
        raise SmolforgeError("--export with several student bases: use `smolforge distill --export`, which "
                             "exports each base's adapter", fix="give one --student, or drop --export")
    export_model = (student[0] if student else o["model"]) if mode in ("teacher_student", "hybrid") else o["model"]
    return (lambda adapter: export_run(export_model, adapter, adapter.parent, export)) if export else None


# `launch` flags that `_launch_distill` takes as they are
_DISTILL_FLAGS = ("epochs", "batch_size", "max_length", "max_steps", "lr", "dtype", "peft", "lora_r", "lora_alpha",
                  "seed", "cpus_per_worker", "output_dir", "kd_loss", "kd_ratio", "temperature", "top_k",
                  "num_teachers", "coordinator", "state_dir", "quiet", "json_out", "tensorboard", "wandb", "name",
                  "priority", "detach", "save_every", "teacher_backend", "teacher_url", "teacher_key_file")
_TEACHER_FLAGS = ("teacher_backend", "teacher_url", "teacher_key_file")  # distillation modes only


def _launch_distill_flags(o: dict[str, Any], after: Callable[[Path], dict] | None) -> None:
    """`launch --mode teacher_student|hybrid`: --model is the teacher, --workers the students."""
    workers = 2 if o["workers"] is None else o["workers"]
    if o["stages"] is not None or o["strategy"] is not None:
        raise SmolforgeError(f"--{'stages' if o['stages'] is not None else 'strategy'} applies to --mode "
                             "data_parallel or model_parallel", fix=f"drop it, or pick another --mode than {o['mode']}")
    _launch_distill(mode=o["mode"], teacher=o["model"], students=o["student"], dataset=o["dataset"],
                    eval_data=o["held_out"], workers=workers,
                    token=cli_token(o["token"], o["token_file"]), sets=o["set_"],
                    unsupported={"--gpu": None if o["gpu"] in (None, "no") else o["gpu"]}, after=after,
                    **{key: o[key] for key in _DISTILL_FLAGS})


def _launch_data_parallel_flags(o: dict[str, Any], after: Callable[[Path], dict] | None) -> None:
    """`launch --mode data_parallel|model_parallel`: a data-parallel job spec from the flags, submitted and followed."""
    mode = o["mode"]
    if mode not in ("data_parallel", "model_parallel"):
        raise SmolforgeError(f"unknown --mode {mode!r}",
                             fix="use data_parallel, model_parallel, teacher_student, hybrid or split")
    if o["student"]:
        raise SmolforgeError("--student is for --mode teacher_student or hybrid",
                             fix="drop --student, or pick a distillation mode")
    workers, strategy = _model_parallel(mode, o["stages"], o["workers"], o["strategy"])
    kwargs: dict[str, Any] = dict(num_workers=workers, batch_size=o["batch_size"], max_retries=o["max_retries"],
                                  cpus_per_worker=o["cpus_per_worker"], name=o["name"], strategy=strategy,
                                  balance=o["balance"], tensorboard=o["tensorboard"], wandb=o["wandb"],
                                  priority=o["priority"])
    for key in ("epochs", "max_steps", "lr", "save_every", "seed", "max_length", "lora_r", "lora_alpha", "peft", "dtype"):
        if o[key] is not None:
            kwargs[key] = o[key]
    spec = _launch_spec(o["model"], o["dataset"], gpu=o["gpu"] or "no", sets=o["set_"], eval_path=o["held_out"], **kwargs)
    _submit_and_follow(spec, f"{workers} stages" if strategy == "pipeline" else f"{workers} workers",
                       coordinator=o["coordinator"], token=cli_token(o["token"], o["token_file"]),
                       state_dir=o["state_dir"], detach=o["detach"], quiet=o["quiet"], json_out=o["json_out"],
                       output_dir=o["output_dir"], after=after, held_out=o["held_out"])


def _not_for(given: dict[str, Any]) -> None:
    """Flags of --mode split given to another mode: one message naming them."""
    named = [flag for flag, value in given.items() if value is not None]
    if named:
        raise SmolforgeError(f"{', '.join(named)} appl{'y' if len(named) > 1 else 'ies'} to --mode split only",
                             fix=f"drop {'them' if len(named) > 1 else 'it'}, or use --mode split")


def _only_distill(given: dict[str, Any], mode: str) -> None:
    """Teacher flags given to a mode without a teacher: one message naming them."""
    named = [flag for flag, value in given.items() if value is not None]
    if named:
        raise SmolforgeError(f"{', '.join(named)} appl{'y' if len(named) > 1 else 'ies'} to --mode teacher_student "
                             f"or hybrid, not {mode}", fix=f"drop {'them' if len(named) > 1 else 'it'}, or pick a "
                                                           "distillation mode")


# `launch` flags a split job takes, and their names in `split:` (the seed's, as `smolforge split train` has them)
_SPLIT_FLAGS = {"batch_size": "batch_size", "max_steps": "max_steps", "epochs": "num_epochs", "lr": "learning_rate",
                "lora_r": "lora_rank", "lora_alpha": "lora_alpha", "max_length": "max_seq_length", "seed": "seed",
                "save_every": "save_interval"}


def _launch_split_flags(o: dict[str, Any], after: Callable[[Path], dict] | None) -> None:
    """`launch --mode split`: a split job (the trunk placed by the coordinator, the client on
    --client-node) from the flags, submitted and followed; other modes' flags are one message."""
    from smolforge.cluster.control.kinds import apply_job_overrides

    given = [flag for flag, value in (("--workers", o["workers"]), ("--stages", o["stages"]),
                                      ("--strategy", o["strategy"]), ("--student", o["student"]),
                                      ("--num-teachers", o["num_teachers"]), ("--dtype", o["dtype"]),
                                      ("--tensorboard", o["tensorboard"]), ("--wandb", o["wandb"])) if value]
    from smolforge.models.peft import peft_method

    if o["peft"] is not None and not peft_method(o["peft"]).split_trains:
        given.append(f"--peft {o['peft']}")
    if given:
        raise SmolforgeError(f"{', '.join(given)} do{'es' if len(given) == 1 else ''} not apply to --mode split",
                             fix=f"drop {'it' if len(given) == 1 else 'them'}: split learning trains LoRA on all "
                                 "three parts (its other settings: "
                                 "--set split.KEY=VALUE, as `smolforge split train` names them)")
    if o["split_point_1"] is None or o["split_point_2"] is None:
        raise SmolforgeError("--mode split needs --split-point-1 and --split-point-2",
                             fix="e.g. --split-point-1 1 --split-point-2 3: the trunk is layers [1, 3)")
    split: dict[str, Any] = {"model": o["model"], "dataset": o["dataset"], "split_point_1": o["split_point_1"],
                             "split_point_2": o["split_point_2"]}
    if o["held_out"] is not None:
        split["eval_dataset"] = o["held_out"]
    split.update({key: o[flag] for flag, key in _SPLIT_FLAGS.items() if o[flag] is not None})
    spec: dict[str, Any] = {"kind": "split", "name": o["name"], "priority": o["priority"],
                            "max_retries": o["max_retries"], "cpus": o["cpus_per_worker"], "split": split}
    if o["client_node"] is not None:
        spec["client_node"] = o["client_node"]
    if o["gpu"] is not None:
        spec["trunk_gpu"] = o["gpu"]
    spec = apply_job_overrides(spec, o["set_"])
    _submit_and_follow(spec, f"split: trunk layers [{o['split_point_1']}, {o['split_point_2']})",
                       coordinator=o["coordinator"], token=cli_token(o["token"], o["token_file"]),
                       state_dir=o["state_dir"], detach=o["detach"], quiet=o["quiet"], json_out=o["json_out"],
                       output_dir=o["output_dir"], after=after, held_out=o["held_out"])


def _model_parallel(mode: str, stages: int | None, workers: int | None, strategy: str | None) -> tuple[int, str]:
    """(ranks, strategy) from --mode/--stages/--workers/--strategy: model parallelism is the pipeline
    strategy with one rank per stage; contradictions are one message each."""
    if strategy is not None:  # a name the registry lacks: its closest one and the registry's names
        from smolforge.parallel.strategies import check_name

        check_name(strategy, where="--strategy")
    if stages is not None and stages < 1:
        raise SmolforgeError(f"--stages {stages}: give 1 or more", fix="e.g. --stages 2")
    if stages is None and mode == "data_parallel":
        return (2 if workers is None else workers), (strategy or "ddp")
    if strategy not in (None, "pipeline"):
        raise SmolforgeError(f"--strategy {strategy} is data parallelism, but {'--stages' if stages else '--mode model_parallel'} "
                             "asks for model parallelism (the pipeline strategy)",
                             fix="drop --strategy, or drop --stages/--mode model_parallel")
    if stages is not None and workers is not None and workers != stages:
        raise SmolforgeError(f"--stages {stages} and --workers {workers} differ: a pipeline has one worker per stage",
                             fix="give only --stages")
    return (stages or workers or 2), "pipeline"


def _launch_distill(*, mode: str, teacher: str, students: list[str], dataset: str, eval_data: str | None,
                    workers: int, unsupported: dict[str, Any], **o: Any) -> None:
    """`launch --mode teacher_student|hybrid`: a distill job on the coordinator (or the embedded
    cluster): it shows in `smolforge jobs` and the dashboard, and pauses, resumes and cancels."""
    from smolforge.cluster.control.kinds import KINDS, apply_job_overrides, read_named
    from smolforge.cluster.control.specs import DistillJob
    from smolforge.config import validate

    if not students:  # the seeds name none: the teacher family's smallest model a node holds
        students = [_default_student(teacher, mode, o["coordinator"], o["token"], o["state_dir"])]
    given = [flag for flag, value in unsupported.items() if value]
    if given:
        raise SmolforgeError(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --mode data_parallel only",
                             fix="drop them, or use `smolforge distill` for the full set of distillation settings")
    distill: dict[str, Any] = {"teacher": teacher, "students": list(students), "data": dataset,
                               "num_students": workers, "peft": o["peft"] or "lora", "kd_loss": o["kd_loss"],
                               "kd_ratio": o["kd_ratio"], "temperature": o["temperature"], "top_k": o["top_k"],
                               "batch_size": o["batch_size"], "cpus_per_student": o["cpus_per_worker"]}
    peft_config = {k: v for k, v in (("r", o["lora_r"]), ("alpha", o["lora_alpha"])) if v is not None}
    if peft_config:
        distill["peft_config"] = peft_config
    for key in ("num_teachers", "max_steps", "lr", "max_length", "seed", "epochs", "save_every", *_TEACHER_FLAGS):
        if o[key] is not None:
            distill[key] = o[key]
    if o["dtype"] is not None:  # one --dtype for both here; `smolforge distill` sets them apart
        distill["teacher_dtype"] = distill["student_dtype"] = o["dtype"]
    if mode == "hybrid":
        distill["split_shards"] = True
    if eval_data is not None:
        distill["eval_data"] = eval_data
    spec = apply_job_overrides({"kind": "distill", "name": o["name"], "priority": o["priority"], "mode": mode,
                                "distill": distill, "tensorboard": o["tensorboard"], "wandb": o["wandb"]}, o["sets"])
    spec = read_named(spec)  # --set dataset_name=...: read here, once
    KINDS["distill"].check(validate(DistillJob, spec, where="launch"))  # the submit's own check, before any cluster starts
    quiet_libraries()  # transformers (seconds): only once the settings are known to be good
    _submit_and_follow(spec, f"{mode}: {workers} students", coordinator=o["coordinator"], token=o["token"],
                       state_dir=o["state_dir"], detach=o["detach"], quiet=o["quiet"], json_out=o["json_out"],
                       output_dir=o["output_dir"], on_completed=fetch_distill_summary, after=o.get("after"),
                       held_out=eval_data)


def _default_student(teacher: str, mode: str, coordinator: str | None, token: str | None,
                     state_dir: str | None) -> str:
    """`--mode teacher_student|hybrid` without --student: the smallest model of the teacher's family that a
    node holds (the coordinator's nodes; embedded: this machine's models), said as the plan's first line;
    none is one message naming --student."""
    from smolforge.client import backend_for
    from smolforge.models.default_student import default_student

    try:
        backend = backend_for(coordinator, token, state_dir, embedded_ok=False)
    except SmolforgeError:  # no coordinator: the embedded cluster is this machine
        from smolforge.cluster import face

        held = {name: where for name, where in face.discover_models(None, use_ollama=False).items()
                if not where.startswith("alias:")}
    else:
        with backend:
            held = {m: None for n in backend.list_nodes() if n.get("state") != "dead" for m in n.get("models") or []}
    found = default_student(teacher, held)
    if found is None:
        raise SmolforgeError(f"--mode {mode} needs a student model, and no node holds a smaller model of the "
                             f"family of {teacher}", fix="add --student NAME (e.g. --student tiny-llama); --model is the teacher")
    name, size, teacher_size = found
    typer.echo(f"plan: student {name} ({size / 1e6:.2f}M parameters), the smallest model of the teacher's family a "
               f"node holds (teacher {teacher}: {teacher_size / 1e6:.2f}M); --student picks another", err=True)
    return name


def fetch_distill_summary(backend: Any, job_id: str, out: Path) -> None:
    """The run summary (store, tasks, events) next to the merged adapter, as `smolforge distill` writes it."""
    backend.download_artifact(job_id, "summary", "distill", out / "summary", overwrite=True)  # moved out below
    (out / "summary" / "distill_summary.json").replace(out / "distill_summary.json")
    (out / "summary").rmdir()


def _submit_and_follow(spec: dict, what: str, *, coordinator: str | None, token: str | None, state_dir: str | None,
                       detach: bool, quiet: bool, json_out: bool, output_dir: str | None,
                       on_completed: Callable[[Any, str, Path], None] | None = None,
                       after: Callable[[Path], dict] | None = None, held_out: str | None = None) -> None:
    """Submit a job (to the coordinator, or an embedded cluster of this machine), then follow it to
    its end and fetch its adapter into `output_dir` (default outputs/<job>); the outcome names HELD_OUT
    (`finish_job`). The spec is checked first: a bad setting is a message in a second, not after an
    embedded cluster has started."""
    from smolforge.cluster.control.kinds import parse, read_named

    parse(read_named(spec))  # a dataset by name (--set dataset_name=...) read here, once
    refuse_used_download_dir(output_dir)
    if after is not None and detach:
        raise SmolforgeError("--export needs the run's end: it cannot go with --detach",
                             fix="drop --detach, or export later with `smolforge export`")
    backend = _backend(coordinator, token, state_dir, embedded_ok=True)
    embedded = backend.runs_in_process
    try:
        if detach and embedded:
            raise SmolforgeError("--detach needs a coordinator (the embedded cluster ends with this command)",
                                 fix="start one with `smolforge coordinator start`, or drop --detach")
        if embedded and output_dir and monitored(spec):  # the job runs here: its monitoring files go there too
            spec = {**spec, "output_dir": str(Path(output_dir).resolve())}
        job_id = backend.submit_job(spec)
        out = output_dir or f"outputs/{job_id}"
        if embedded:  # `job resume` of this job, if this command dies, downloads there too
            backend.remember_output_dir(job_id, out)
        if not json_out:
            typer.echo(f"submitted {job_id} ({what}" + (", embedded cluster" if embedded else "") + ")", err=True)
        if detach:
            typer.echo(job_id)
            return
        st = wait_with_progress(backend, job_id, quiet or json_out)
        if on_completed is not None and st["state"] == "completed":
            on_completed(backend, job_id, Path(out))
        if not json_out:
            say_monitoring(backend, job_id, embedded)
        finish_job(backend, st, out, json_out, after=after, held_out=held_out)
    finally:
        backend.close()


def say_monitoring(backend: Any, job_id: str, embedded: bool) -> None:
    """Where the job's TensorBoard / W&B files are (the runner's `monitoring` event says), if it wrote any."""
    for e in backend.job_events(job_id):
        if e["kind"] == "monitoring" and e.get("data"):
            root = Path(e["data"]["root"])
            where = "" if embedded else " (on the coordinator's machine)"
            if e["data"].get("tensorboard"):
                typer.echo(f"tensorboard: tensorboard --logdir {root / 'tensorboard'}{where}", err=True)
            if e["data"].get("wandb"):
                typer.echo(f"wandb: offline runs in {root / 'wandb'}{where} (upload: wandb sync <run dir>)", err=True)
            return


def monitored(spec: dict) -> bool:
    """Whether a data-parallel job spec asks for TensorBoard or W&B files (a distill job keeps them in
    its run dir, like the rest of its run)."""
    train = spec.get("train") if spec.get("kind", "data_parallel") == "data_parallel" else None
    return bool(train and (train.get("tensorboard") or train.get("wandb")))


def _launch_spec(model: str, dataset: str, *, gpu: str, sets: list[str], num_workers: int, batch_size: int,
                 max_retries: int, cpus_per_worker: float, name: str | None, priority: str = "normal",
                 eval_path: str | None = None, **opts: Any) -> dict:
    from smolforge.cluster.control.kinds import apply_job_overrides

    strategy = opts.pop("strategy", "ddp")
    balance = opts.pop("balance", "auto")
    train: dict[str, Any] = {"model": model, "data": {"path": dataset}, "batch_size": batch_size,
                             "tensorboard": bool(opts.pop("tensorboard", False))}
    if opts.get("wandb"):
        train["wandb"] = opts.pop("wandb")
    opts.pop("wandb", None)
    if "max_length" in opts:
        train["data"]["max_length"] = opts.pop("max_length")
    if eval_path is not None:
        train["data"]["eval_path"] = eval_path
    peft: dict[str, Any] = {}
    for key, dest in (("peft", "method"), ("lora_r", "r"), ("lora_alpha", "alpha")):
        if key in opts:
            peft[dest] = opts.pop(key)
    if peft:
        train["peft"] = peft
    train.update(opts)  # no save_every given: the job spec gives the one default (specs.default_save_every)
    spec = {"kind": "data_parallel", "name": name, "priority": priority, "num_workers": num_workers, "cpus_per_worker": cpus_per_worker,
            "gpu": gpu, "max_retries": max_retries, "strategy": strategy, "balance": balance, "train": train}
    return apply_job_overrides(spec, sets)
