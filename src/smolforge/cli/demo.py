"""`smolforge demo`: the main job end to end on the embedded default, with nothing to download."""

from __future__ import annotations

import time
from typing import Optional

import typer

from smolforge.cli.common import make_output_dir, print_json, quiet_libraries, run_cli
from smolforge.config import DataSpec, PeftSpec, TrainConfig
from smolforge.data.synthetic import BUNDLED_PROMPTS_N
from smolforge.errors import SmolforgeError

DEMO_MODEL = "tiny-llama"
SFT_REPLACES = ("checkpoints", "lora_adapter", "summary.json", "metrics.jsonl", "tensorboard")  # what the
# fine-tune demo starts afresh in its --output-dir (only as far as an earlier demo's manifest records them)


def sft_demo_config(output_dir: str, max_steps: int, seed: int, quiet: bool) -> TrainConfig:
    """A LoRA fine-tune sized to finish in about two minutes on a 2-core laptop."""
    return TrainConfig(
        model=DEMO_MODEL,
        data=DataSpec(path="bundled", max_length=64),
        peft=PeftSpec(method="lora", r=16, alpha=32, dropout=0.0),
        output_dir=output_dir, max_steps=max_steps, batch_size=32, lr=3e-3, warmup_steps=30,
        seed=seed, quiet=quiet, log_every=20,
        precision="fp32",  # "auto" picks bf16 by a timing probe: the demo's numbers would depend on load
    )


def run_sft_demo(output_dir: str = "outputs/demo", max_steps: int = 400, seed: int = 0, quiet: bool = False) -> dict:
    from smolforge.train.engine import build_model, evaluate, train
    from smolforge.train.rendering import load_checked_splits

    from smolforge.distill.demo import claim_demo_dir

    t0 = time.perf_counter()
    cfg = sft_demo_config(output_dir, max_steps, seed, quiet)
    claim_demo_dir(output_dir, SFT_REPLACES)  # a fresh start, but never over another run's checkpoints
    import torch

    torch.manual_seed(seed)
    tokenizer, model = build_model(cfg, torch.device("cpu"))
    splits = load_checked_splits(cfg.data, tokenizer)
    before = evaluate(model, tokenizer, splits, cfg, torch.device("cpu"))
    result = train(cfg, splits=splits, model=model, tokenizer=tokenizer, run_kind="demo")
    return {
        "model": DEMO_MODEL,
        "peft": "lora",
        "steps": result.steps,
        "before_accuracy": before.get("accuracy"),
        "after_accuracy": result.eval.get("accuracy"),
        "eval_loss_before": before.get("eval_loss"),
        "eval_loss_after": result.eval.get("eval_loss"),
        "adapter_dir": result.adapter_dir,
        "tokens_per_s": result.tokens_per_s,
        "seconds": time.perf_counter() - t0,
    }


def print_sft_table(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title=f"smolforge demo: LoRA fine-tune of {summary['model']} on the bundled tasks")
    table.add_column("held-out metric")
    table.add_column("before", justify="right")
    table.add_column("after", justify="right")
    table.add_row("exact-match accuracy", f"{summary['before_accuracy']:.1%}", f"{summary['after_accuracy']:.1%}")
    table.add_row("eval loss", f"{summary['eval_loss_before']:.3f}", f"{summary['eval_loss_after']:.3f}")
    con = Console()
    con.print(table)
    con.print(f"{summary['steps']} steps in {summary['seconds']:.0f} s · adapter: {summary['adapter_dir']}")


def prepare_output_dir(output_dir: str, replaces: tuple[str, ...]) -> None:
    """Before any model loads or cluster starts: a directory holding another run is refused (nothing
    deleted), one that cannot be made is one message."""
    from smolforge.distill.demo import check_demo_dir

    check_demo_dir(output_dir, replaces)
    make_output_dir(output_dir)


def distill_summary(output_dir: str, seed: int, quiet: bool, settings=None) -> dict:
    """The distillation demo's summary, with the plain fine-tune demo's keys mapped onto it."""
    from smolforge.distill.demo import run_demo
    from smolforge.orchestrator import Orchestrator

    t0 = time.perf_counter()
    with Orchestrator("teacher_student") as orch:  # the configured coordinator, else the embedded cluster
        # the demo's tasks are that backend's jobs, as a seed script's (`smolforge jobs`, the dashboard)
        summary = run_demo(quiet=quiet, output_dir=output_dir, seed=seed, settings=settings, orchestrator=orch)
    summary.setdefault("before_accuracy", summary.get("student_base_accuracy"))
    summary.setdefault("after_accuracy", summary.get("kd_accuracy"))
    summary.setdefault("eval_loss_before", summary.get("student_base_eval_loss"))
    summary.setdefault("eval_loss_after", summary.get("kd_eval_loss"))
    summary.setdefault("seconds", time.perf_counter() - t0)
    return summary


def check_distill_sizes(smallest: int, kd_prompts: int, student_peft: str) -> None:
    """The distill demo's flags checked before anything heavy is imported (torch, the demo's module): a
    refusal costs an interpreter's start, not a training stack's import.

    Raises SmolforgeError (exit 2) for a size below 1 (`smallest`: the least of the size flags), more
    --kd-prompts than the bundled pool holds, or a --student-peft other than none or lora."""
    if smallest < 1:
        raise SmolforgeError("--pretrain-steps, --teacher-steps, --student-steps, --distill-samples, "
                             "--kd-prompts and --eval-samples must be ≥ 1",
                             fix="e.g. --student-steps 600 --distill-samples 512 --eval-samples 200")
    if kd_prompts > BUNDLED_PROMPTS_N:
        raise SmolforgeError(f"--kd-prompts {kd_prompts}: the demo's pool has {BUNDLED_PROMPTS_N:,} prompts",
                             fix=f"use --kd-prompts {BUNDLED_PROMPTS_N} or fewer")
    if student_peft not in ("none", "lora"):
        raise SmolforgeError(f"unknown --student-peft {student_peft!r}", fix="use none or lora")


def register(app: typer.Typer) -> None:
    @app.command()
    @run_cli
    def demo(
        workflow: str = typer.Option("distill", help="distill: teacher→student on the embedded cluster; "
                                     "sft: a plain LoRA fine-tune"),
        output_dir: str = typer.Option("outputs/demo", help="where the run's outputs go"),
        max_steps: int = typer.Option(400, help="training steps (sft workflow)"),
        pretrain_steps: int = typer.Option(300, help="distill: the student base's pretraining steps on the generic "
                                           "corpus (cached per value)"),
        teacher_steps: int = typer.Option(800, help="distill: the teacher's full fine-tune steps (cached per value)"),
        student_steps: int = typer.Option(600, help="distill: steps per student (KD and SFT alike)"),
        distill_samples: int = typer.Option(512, help="distill: labelled examples the SFT baseline trains on"),
        kd_prompts: int = typer.Option(BUNDLED_PROMPTS_N, help="distill: prompts of the pool (bundled-prompts) the teacher "
                                       "answers for the KD students, the labelled ones first"),
        student_peft: str = typer.Option("none", help="distill: the students' PEFT method (none = every weight; "
                                         "lora is the benchmark's other arm)"),
        eval_samples: int = typer.Option(200, help="distill: held-out examples each model is evaluated on (exact "
                                         "match and eval loss; the teacher's are cached per value)"),
        seed: int = typer.Option(0),
        json_out: bool = typer.Option(False, "--json", help="print the summary as one JSON object"),
        quiet: Optional[bool] = typer.Option(None, "--quiet", help="no progress bars"),
    ):
        """Distill a tiny teacher into a student on the bundled tasks, and compare with plain fine-tuning.

        Runs on the embedded default cluster (or the configured coordinator): a student base pretrained
        in-process on a generic corpus and a teacher fine-tuned from it (both cached); 2 parallel teacher
        tasks answer a pool of 4,000 prompts (`bundled-prompts`: the 512 labelled ones and 3,488 without
        answers) into the top-k logit store; 2 students train on it as one data-parallel group. The SFT
        baseline runs the same pipeline on the 512 labelled examples. Each stage is a job, as a seed
        script's tasks are (`smolforge jobs` lists them). Prints the share of the SFT student's gap to
        the teacher that KD closes.
        `--workflow sft` runs only a LoRA fine-tune with held-out accuracy before and after.

        Example: smolforge demo --json
        """
        quiet_libraries()
        be_quiet = bool(quiet) or json_out
        if workflow == "sft":
            if max_steps < 1:
                raise SmolforgeError(f"--max-steps {max_steps}: give 1 or more", fix="e.g. --max-steps 400")
            prepare_output_dir(output_dir, SFT_REPLACES)
            summary = run_sft_demo(output_dir, max_steps, seed, quiet=be_quiet)
            print_json(summary) if json_out else print_sft_table(summary)
        elif workflow == "distill":
            check_distill_sizes(min(pretrain_steps, teacher_steps, student_steps, distill_samples, kd_prompts,
                                    eval_samples), kd_prompts, student_peft)
            from smolforge.distill.demo import DISTILL_REPLACES, DemoSettings  # torch: after the checks

            settings = DemoSettings(pretrain_steps=pretrain_steps, teacher_steps=teacher_steps,
                                    student_steps=student_steps, distill_samples=distill_samples,
                                    student_peft=student_peft, kd_samples=kd_prompts, max_eval_samples=eval_samples)
            prepare_output_dir(output_dir, DISTILL_REPLACES)
            summary = distill_summary(output_dir, seed, be_quiet, settings)
            if json_out:
                print_json(summary)
            else:
                from smolforge.distill.demo import print_demo_table

                print_demo_table(summary)
        else:
            raise SmolforgeError(f"unknown --workflow {workflow!r}", fix="use --workflow distill or --workflow sft")
