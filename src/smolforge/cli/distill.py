"""`smolforge distill`: parallel teachers, streaming students, adapter aggregation, on the cluster.

It submits a `kind: distill` job, the same road as `launch --mode teacher_student|hybrid` and
`submit`: to the coordinator when one is configured (the merged adapter and the run summary are
downloaded into --output-dir), else to the embedded cluster of this machine, which writes the whole
run into --output-dir. Either way the job shows in `smolforge jobs`, and pauses, resumes and cancels.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

import typer

from smolforge.cli.common import (PRIORITY_HELP, TOKEN_FILE_HELP, RegistryHelp, cli_token, peft_section, print_json,
                                  quiet_libraries, run_cli)
from smolforge.cli.export import check_run_export, export_distill, show
from smolforge.cli.hubdata import (DatasetColumnOpt, DatasetConfigOpt, DatasetEvalSplitOpt, DatasetNameOpt, DatasetSplitOpt,
                                   EvalDataOpt, dataset_files)
from smolforge.distill.backends import backends_help
from smolforge.distill.kdconfig import KD_LOSSES
from smolforge.distill.settings import AGGREGATE_CHOICES, AGGREGATE_METHODS
from smolforge.errors import SmolforgeError
from smolforge.models.dtypes import DTYPE_HELP
from smolforge.models.export.cache import TEACHER_QUANTS
from smolforge.models.export.targets import RUN_TARGETS
from smolforge.models.peft_spec import METHODS as PEFT_METHODS


# `smolforge distill --help`: a module constant handed to app.command, so the command function stays short
DISTILL_HELP = """Distill a teacher into PEFT students: parallel teacher shards, streaming students, merged adapter.

Example: smolforge distill --teacher small-llama --student tiny-llama --data bundled --max-samples 256 --max-steps 20

Example: smolforge distill --teacher small-llama --student tiny-llama --data bundled --max-steps 20 --tensorboard  (then: tensorboard --logdir outputs/distill/tensorboard)

Example (the seeds' hybrid: teacher on the coordinator, two students as one DDP group on the workers): smolforge distill --teacher small-llama --student tiny-llama --data bundled --mode hybrid --teacher-on-coordinator --students-sync ddp --num-students 2

Example (an ensemble of two student bases on one teacher's outputs): smolforge distill --teacher small-llama --student tiny-llama --student tiny-qwen2 --data bundled --max-steps 20

Example (a bf16 teacher, half its fp32 memory; students' base bf16, adapters fp32): smolforge distill --teacher small-llama --student tiny-llama --data bundled --max-steps 20 --teacher-dtype bf16 --student-dtype bf16

Example (a CPU teacher in llama.cpp: exported once per node to a q8_0 GGUF, or give one with --teacher model.gguf): smolforge distill --teacher small-llama --student tiny-llama --data bundled --max-steps 20 --teacher-backend llamacpp --teacher-quant q8_0

Example (prompts from a Hugging Face dataset, read offline from the local cache): smolforge distill --teacher small-llama --student tiny-llama --dataset-name tatsu-lab/alpaca --max-samples 256 --max-steps 20

Example (the students evaluated on a held-out file, whole): smolforge distill --teacher small-llama --student tiny-llama --data prompts.jsonl --eval-data held_out.jsonl --max-steps 20

Example (the students evaluated on the dataset's validation split): smolforge distill --teacher small-llama --student tiny-llama --dataset-name wikitext --dataset-config wikitext-2-raw-v1 --dataset-eval-split validation --max-steps 20
"""


def register(app: typer.Typer) -> None:
    @app.command(cls=RegistryHelp, help=DISTILL_HELP)
    @run_cli
    def distill(
        teacher: str = typer.Option(..., help="teacher: HF id, local dir, Ollama name or preset"),
        student: list[str] = typer.Option(..., help="student base model; repeat for several bases (ensemble)"),
        data: Optional[str] = typer.Option(None, help="JSONL with prompts (alpaca / chat / prompt-completion; answers "
                                           "optional), 'bundled', or 'bundled-prompts' (questions without answers)"),
        dataset_name: DatasetNameOpt = None,
        dataset_config: DatasetConfigOpt = None,
        dataset_split: DatasetSplitOpt = None,
        dataset_column: DatasetColumnOpt = None,
        dataset_eval_split: DatasetEvalSplitOpt = None,
        eval_data: EvalDataOpt = None,
        output_dir: str = typer.Option("outputs/distill", help="run dir: teacher_outputs/, output/, merged_model/"),
        num_teachers: Optional[int] = typer.Option(None, help="teacher tasks (default: one per node holding the teacher)"),
        num_students: int = typer.Option(2, help="students per base; they split the shards (hybrid)"),
        peft: str = typer.Option("lora", help="|".join(PEFT_METHODS)),
        peft_config: Optional[str] = typer.Option(None, help='JSON, e.g. \'{"r": 8, "alpha": 16, "dropout": 0.05}\''),
        kd_loss: str = typer.Option("forward_kl", help="|".join(KD_LOSSES)),
        kd_ratio: float = typer.Option(0.5, help="weight of the KD term (the rest is CE on the teacher's tokens)"),
        temperature: float = typer.Option(1.0, help="KD softmax temperature"),
        beta: float = typer.Option(0.5, help="generalized JSD beta (with --kd-loss jsd)"),
        on_policy_ratio: float = typer.Option(0.0, help="fraction of student steps on the student's own samples, "
                                              "scored by the teacher (on-policy distillation, GKD; hf teacher)"),
        on_policy_start: float = typer.Option(0.0, help="fraction of the student steps before the first "
                                              "on-policy one (GKD starts from a student that knows the format)"),
        top_k: int = typer.Option(32, help="teacher logits kept per token"),
        no_compress: bool = typer.Option(False, "--no-compress", help="keep fp32 values in the store"),
        teacher_backend: str = typer.Option("hf", help=backends_help()),
        teacher_quant: str = typer.Option("q8_0", help=f"llamacpp: the HF teacher's GGUF weights, "
                                          f"{'|'.join(TEACHER_QUANTS)} (f32: unrounded; q4_k_m by llama.cpp's quantizer)"),
        ollama_host: Optional[str] = typer.Option(None, help="Ollama URL (default $OLLAMA_HOST or 127.0.0.1:11434)"),
        teacher_url: Optional[str] = typer.Option(None, help="openai: the endpoint's base URL, e.g. http://host:8000/v1 "
                                                  "(--teacher: the model name it serves)"),
        teacher_key_file: Optional[str] = typer.Option(None, help="openai: a file holding the endpoint's API key, read "
                                                       "where the teacher runs (default: $OPENAI_API_KEY; never on argv)"),
        gen_temperature: float = typer.Option(0.0, help="teacher sampling temperature (0: greedy)"),
        top_p: float = typer.Option(1.0, help="teacher nucleus sampling"),
        max_new_tokens: int = typer.Option(32, help="teacher response length"),
        samples_per_prompt: int = typer.Option(1, help="teacher responses per prompt (needs --gen-temperature > 0)"),
        teacher_responses: str = typer.Option("generate", help="generate: the teacher answers; reference: it scores "
                                              "the dataset's answers (KD on ground truth, hf backend)"),
        num_shards: Optional[int] = typer.Option(None, help="teacher-output shards (default: ~64 prompts each)"),
        max_samples: Optional[int] = typer.Option(None, help="use only the first N prompts"),
        max_steps: Optional[int] = typer.Option(None, help="optimizer steps per student (default: --epochs)"),
        epochs: float = typer.Option(1.0, help="passes over each student's shards"),
        batch_size: int = typer.Option(8),
        grad_accum: int = typer.Option(1),
        lr: Optional[float] = typer.Option(None, help="student learning rate (default: per --peft method, e.g. lora 5e-3, prompt 3e-2)"),
        save_every: int = typer.Option(50, help="student checkpoints every N steps (a student whose worker is "
                                       "lost restarts there; 0: none)"),
        max_length: int = typer.Option(256),
        aggregate: str = typer.Option("mean", help=f"{'|'.join(AGGREGATE_CHOICES)}: merge the students into merged_model/final_adapter"),
        aggregate_rank: Optional[int] = typer.Option(None, help="LoRA rank of the merged adapter (default: the students')"),
        cpus_per_teacher: float = typer.Option(1.0),
        cpus_per_student: float = typer.Option(1.0),
        no_eval: bool = typer.Option(False, "--no-eval", help="skip held-out eval of the students"),
        seed: int = typer.Option(0),
        device: str = typer.Option("auto", help="auto|cpu|cuda"),
        teacher_dtype: str = typer.Option("fp32", "--teacher-dtype", help="the teacher's " + DTYPE_HELP),
        student_dtype: str = typer.Option("fp32", "--student-dtype", help="the students' base " + DTYPE_HELP
                                          + "; a LoRA adapter stays fp32"),
        mode: str = typer.Option("teacher_student", help="teacher_student or hybrid"),
        students_sync: str = typer.Option("average", help="average: the students of a base train apart on their "
                                          "own shards and their adapters are averaged; ddp: they train as one "
                                          "data-parallel group over every shard and write one adapter (student_0)"),
        students_strategy: Optional[str] = typer.Option(None, help="the group's strategy with --students-sync ddp: "
                                                        "{student_strategies}"),
        teacher_on_coordinator: bool = typer.Option(False, "--teacher-on-coordinator",
                                                    help="run the teachers on the coordinator node (lent for it), "
                                                    "the students on the workers"),
        priority: str = typer.Option("normal", help=PRIORITY_HELP),
        coordinator: Optional[str] = typer.Option(None, help="HOST:PORT (default: the configured one, else embedded)"),
        token: Optional[str] = typer.Option(None, help="cluster token (default $SMOLFORGE_TOKEN)"),
        token_file: Optional[str] = typer.Option(None, "--token-file", help=TOKEN_FILE_HELP),
        resume: bool = typer.Option(False, "--resume", help="continue the students of an earlier run in --output-dir "
                                    "from their checkpoints (without it such a dir is refused; teacher shards are always reused)"),
        tensorboard: bool = typer.Option(False, "--tensorboard", help="TensorBoard event files per student: "
                                         "OUTPUT_DIR/tensorboard/student<N> (with a coordinator: its state dir, "
                                         "distill/<job>/tensorboard)"),
        wandb: Optional[str] = typer.Option(None, "--wandb", metavar="PROJECT",
                                            help="one offline W&B run per student, in the same place's wandb/ "
                                            "(the package's wandb extra)"),
        json_out: bool = typer.Option(False, "--json", help="print the run summary as one JSON object"),
        quiet: bool = typer.Option(False, "--quiet", help="no progress bars"),
        export: Optional[str] = typer.Option(None, "--export", help=f"{'|'.join(RUN_TARGETS)}: export the merged adapter (each "
                                             "student base's), verified, into <output-dir>/export/"),
    ):
        _run_command(dict(locals()))


def _run_command(o: dict[str, Any]) -> None:
    """What `smolforge distill` does with its options: check, build the job spec, run it, export and show."""
    o["data"], o["eval_data"] = dataset_files(o, "data", "--data", "eval_data")  # or --dataset-eval-split's file
    if o["data"] is None:
        raise SmolforgeError("no dataset given", fix="pass --data FILE|bundled|bundled-prompts or --dataset-name NAME")
    distill = _distill_section(o)
    check_run_export(o["export"], o["peft"])
    if o["export"] and o["aggregate"] == "none":
        raise SmolforgeError("--export needs a merged adapter, but --aggregate none merges none",
                             fix=f"use --aggregate {' or '.join(AGGREGATE_METHODS)}, or export one student's adapter "
                                 "with `smolforge export`")
    spec = {"kind": "distill", "mode": o["mode"], "priority": o["priority"], "distill": distill,
            "tensorboard": o["tensorboard"], "wandb": o["wandb"]}
    summary = run_distill_job(spec, o["output_dir"], resume=o["resume"], coordinator=o["coordinator"],
                              token=cli_token(o["token"], o["token_file"]), quiet=o["quiet"] or o["json_out"])
    # the held-out set the students' eval loss is over, as the user named it (None: a split of the data)
    summary["eval_data"] = o["eval_data"]
    _export_and_show(summary, o["output_dir"], o["export"], o["json_out"])


def _distill_section(o: dict[str, Any]) -> dict[str, Any]:
    """The job spec's `distill:` section from `smolforge distill`'s flags (by name, as given)."""
    return {
        "teacher": o["teacher"], "students": list(o["student"]), "data": o["data"], "num_teachers": o["num_teachers"],
        "num_students": o["num_students"], "peft": o["peft"], "peft_config": peft_section(None, o["peft_config"], None, None, None),
        "kd_loss": o["kd_loss"], "kd_ratio": o["kd_ratio"], "temperature": o["temperature"], "beta": o["beta"], "top_k": o["top_k"],
        "on_policy_ratio": o["on_policy_ratio"], "on_policy_start": o["on_policy_start"],
        "compress_outputs": not o["no_compress"], "teacher_backend": o["teacher_backend"],
        "teacher_quant": o["teacher_quant"], "ollama_host": o["ollama_host"],
        "teacher_url": o["teacher_url"], "teacher_key_file": o["teacher_key_file"],
        "gen_temperature": o["gen_temperature"], "top_p": o["top_p"], "max_new_tokens": o["max_new_tokens"],
        "samples_per_prompt": o["samples_per_prompt"], "teacher_responses": o["teacher_responses"], "num_shards": o["num_shards"],
        "max_samples": o["max_samples"], "max_steps": o["max_steps"], "epochs": o["epochs"], "batch_size": o["batch_size"],
        "grad_accum": o["grad_accum"], "lr": o["lr"], "max_length": o["max_length"], "seed": o["seed"], "save_every": o["save_every"],
        "aggregate": o["aggregate"], "aggregate_rank": o["aggregate_rank"], "cpus_per_teacher": o["cpus_per_teacher"],
        "cpus_per_student": o["cpus_per_student"], "eval": not o["no_eval"], "device": o["device"],
        "teacher_dtype": o["teacher_dtype"], "student_dtype": o["student_dtype"],
        "students_sync": o["students_sync"], "students_strategy": o["students_strategy"],
        "teacher_on_coordinator": o["teacher_on_coordinator"], "eval_data": o["eval_data"]}


def _export_and_show(summary: dict[str, Any], output_dir: str, export: str | None, json_out: bool) -> None:
    """The finished run: its merged adapters exported when --export asks, then its summary (a table, or JSON)."""
    if export:
        summary["export"] = export_distill(summary, output_dir, export)
    if json_out:
        print_json({k: v for k, v in summary.items() if k != "events"})
        return
    _print_summary(summary)
    for exported in (summary.get("export") or {}).values():
        show(exported, False)


def run_distill_job(spec: dict[str, Any], output_dir: str, *, resume: bool, coordinator: str | None,
                    token: str | None, quiet: bool) -> dict[str, Any]:
    """Check, submit and follow a distill job; returns the run summary, read from --output-dir."""
    from smolforge.cli.follow import finish_job, wait_with_progress
    from smolforge.cli.launch import fetch_distill_summary
    from smolforge.client import backend_for
    from smolforge.cluster.control.kinds import KINDS
    from smolforge.cluster.control.specs import DistillJob
    from smolforge.config import validate
    from smolforge.distill.settings import check_output_flag, refuse_used_run_dir

    out = Path(output_dir)
    check_output_flag(output_dir)
    # the submit's own check (the kind's), before any cluster starts
    KINDS["distill"].check(validate(DistillJob, {**spec, "output_dir": output_dir}, where="distill"))
    refuse_used_run_dir(out, resume)
    quiet_libraries()  # transformers (seconds): only once the flags are known to be good
    backend = backend_for(coordinator, token, None, embedded_ok=True)
    embedded = backend.runs_in_process
    try:
        if embedded:  # the job runs on this machine: it writes the run where the user said
            spec = {**spec, "output_dir": str(out.resolve())}
        job_id = backend.submit_job(spec)
        if not quiet:
            typer.echo(f"submitted {job_id} (distill" + (", embedded cluster" if embedded else "") + ")", err=True)
        st = wait_with_progress(backend, job_id, quiet)
        if st["state"] != "completed":
            finish_job(backend, st, None, False)  # says why; exits 1 when it failed
            raise typer.Exit(1)
        if not embedded:
            if any(a["kind"] == "adapter" for a in backend.list_artifacts(job_id)):  # none with --aggregate none
                # refuse_used_run_dir already guarded this run dir (or --resume asked to continue it)
                backend.download_adapter(job_id, out / "merged_model", overwrite=True)
            fetch_distill_summary(backend, job_id, out)
        return json.loads((out / "distill_summary.json").read_text())
    finally:
        backend.close()


def _print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    store = summary["store"]
    con.print(f"teacher outputs: {store['shards']} shards, {store['response_tokens']:,} tokens, "
              f"{store['bytes_per_token']:.1f} bytes/token ({store['ratio_vs_fp16_full']:.2%} of fp16 full-vocab)"
              + _kl_note(store))
    table = Table(title=f"students ({summary.get('students_sync', 'average')})")
    for col in ("task", "base", "node", "state", "steps", "loss", "kd", "eval loss", "accuracy", "output"):
        table.add_column(col)
    nodes = {s["task_id"]: s.get("node") for s in summary["student_tasks"]}
    for s in summary.get("per_student") or []:
        ev = s.get("eval") or {}
        group = s.get("group")
        output = s.get("output_dir") or (f"(rank {group['rank']} of {group['members'][0]}'s group)" if group else "-")
        table.add_row(s["task_id"], s["base"], str(nodes.get(s["task_id"])), s["state"], str(s.get("steps") or 0),
                      f"{s['loss']:.4f}" if s.get("loss") is not None else "-", str(s.get("kd") or "-"),
                      f"{ev['eval_loss']:.3f}" if "eval_loss" in ev else "-",
                      f"{ev['accuracy']:.1%}" if "accuracy" in ev else "-", str(output))
    con.print(table)
    if summary.get("eval_data"):
        con.print(f"eval: over {summary['eval_data']}")
    for base, rep in summary["merged"].items():
        how = f" ({rep['merge']})" if rep.get("merge") else ""
        con.print(f"merged ({base}){how}: {rep.get('output', rep.get('skipped'))}")
    con.print(f"done in {summary['seconds']:.0f} s · summary: {summary['output_dir']}/distill_summary.json")


def _kl_note(store: dict) -> str:
    """'; stored vs exact KL …' when the shards recorded their reconstruction error (VERSION 2)."""
    if store.get("reconstruction_kl_mean") is None:
        return ""
    note = f"; stored vs exact top-k KL {store['reconstruction_kl_mean']:.1e} nats/token"
    if store.get("truncation_kl_mean") is not None:
        note += f", top-k truncation KL {store['truncation_kl_mean']:.1e}"
    return note
