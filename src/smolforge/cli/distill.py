"""`smolforge distill`: parallel teachers, streaming students, adapter aggregation, on the cluster."""

from __future__ import annotations

from typing import Optional

import typer

from smolforge.cli.common import peft_section, print_json, quiet_libraries, run_cli


def register(app: typer.Typer) -> None:
    @app.command()
    @run_cli
    def distill(
        teacher: str = typer.Option(..., help="teacher: HF id, local dir, Ollama name or preset"),
        student: list[str] = typer.Option(..., help="student base model; repeat for several bases (ensemble)"),
        data: str = typer.Option(..., help="JSONL with prompts (alpaca / chat / prompt-completion), or 'bundled'"),
        output_dir: str = typer.Option("outputs/distill", help="run dir: teacher_outputs/, output/, merged_model/"),
        num_teachers: Optional[int] = typer.Option(None, help="teacher tasks (default: one per node holding the teacher)"),
        num_students: int = typer.Option(2, help="students per base; they split the shards (hybrid)"),
        peft: str = typer.Option("lora", help="lora|prefix|prompt|ia3|adapter|none"),
        peft_config: Optional[str] = typer.Option(None, help='JSON, e.g. \'{"r": 8, "alpha": 16, "dropout": 0.05}\''),
        kd_loss: str = typer.Option("forward_kl", help="forward_kl|reverse_kl|jsd"),
        kd_ratio: float = typer.Option(0.5, help="weight of the KD term (the rest is CE on the teacher's tokens)"),
        temperature: float = typer.Option(1.0, help="KD softmax temperature"),
        beta: float = typer.Option(0.5, help="generalized JSD beta (with --kd-loss jsd)"),
        top_k: int = typer.Option(32, help="teacher logits kept per token"),
        no_compress: bool = typer.Option(False, "--no-compress", help="keep fp32 values in the store"),
        teacher_backend: str = typer.Option("hf", help="hf (transformers) or ollama (HTTP API)"),
        ollama_host: Optional[str] = typer.Option(None, help="Ollama URL (default $OLLAMA_HOST or 127.0.0.1:11434)"),
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
        lr: float = typer.Option(1e-3),
        save_every: int = typer.Option(50, help="student checkpoints every N steps (a student whose worker is "
                                       "lost restarts there; 0: none)"),
        max_length: int = typer.Option(256),
        aggregate: str = typer.Option("mean", help="mean|ties|none: merge the students into merged_model/final_adapter"),
        aggregate_rank: Optional[int] = typer.Option(None, help="LoRA rank of the merged adapter (default: the students')"),
        cpus_per_teacher: float = typer.Option(1.0),
        cpus_per_student: float = typer.Option(1.0),
        no_eval: bool = typer.Option(False, "--no-eval", help="skip held-out eval of the students"),
        seed: int = typer.Option(0),
        device: str = typer.Option("auto", help="auto|cpu|cuda"),
        mode: str = typer.Option("teacher_student", help="teacher_student or hybrid"),
        coordinator: Optional[str] = typer.Option(None, help="HOST:PORT (default: the configured one, else embedded)"),
        token: Optional[str] = typer.Option(None, help="cluster token (default $SMOLFORGE_TOKEN)"),
        json_out: bool = typer.Option(False, "--json", help="print the run summary as one JSON object"),
        quiet: bool = typer.Option(False, "--quiet", help="no progress bars"),
    ):
        """Distill a teacher into PEFT students: parallel teacher shards, streaming students, merged adapter.

        Example: smolforge distill --teacher small-llama --student tiny-llama --data bundled --max-samples 256 --max-steps 20
        """
        quiet_libraries()
        from smolforge.cluster.distill.run import run_distill
        from smolforge.distill.pipeline import DistillRun
        from smolforge.orchestrator import Orchestrator

        cfg = DistillRun(
            teacher=teacher, students=list(student), data=data, output_dir=output_dir, num_teachers=num_teachers,
            num_students=num_students, peft=peft,
            peft_config=peft_section(None, peft_config, None, None, None),
            kd_loss=kd_loss, kd_ratio=kd_ratio, temperature=temperature, beta=beta, top_k=top_k,
            compress_outputs=not no_compress, teacher_backend=teacher_backend, ollama_host=ollama_host,
            gen_temperature=gen_temperature, top_p=top_p, max_new_tokens=max_new_tokens,
            samples_per_prompt=samples_per_prompt, teacher_responses=teacher_responses, num_shards=num_shards, max_samples=max_samples, max_steps=max_steps,
            epochs=epochs, batch_size=batch_size, grad_accum=grad_accum, lr=lr, max_length=max_length, seed=seed,
            save_every=save_every, aggregate=aggregate, aggregate_rank=aggregate_rank, cpus_per_teacher=cpus_per_teacher,
            cpus_per_student=cpus_per_student, eval=not no_eval, device=device, mode=mode, coordinator=coordinator,
            token=token, quiet=quiet or json_out)
        with Orchestrator(cfg.mode, coordinator=cfg.coordinator, token=cfg.token) as orch:
            summary = run_distill(cfg, orch)
        if json_out:
            print_json({k: v for k, v in summary.items() if k != "events"})
            return
        _print_summary(summary)


def _print_summary(summary: dict) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console()
    store = summary["store"]
    con.print(f"teacher outputs: {store['shards']} shards, {store['response_tokens']:,} tokens, "
              f"{store['bytes_per_token']:.1f} bytes/token ({store['ratio_vs_fp16_full']:.2%} of fp16 full-vocab)")
    table = Table(title="students")
    for col in ("task", "node", "state", "eval loss", "accuracy", "output"):
        table.add_column(col)
    for s in summary["student_tasks"]:
        ev = s.get("eval") or {}
        table.add_row(s["task_id"], str(s.get("node")), s["state"],
                      f"{ev['eval_loss']:.3f}" if "eval_loss" in ev else "-",
                      f"{ev['accuracy']:.1%}" if "accuracy" in ev else "-", str(s.get("output_dir")))
    con.print(table)
    for base, rep in summary["merged"].items():
        con.print(f"merged ({base}): {rep.get('output', rep.get('skipped'))}")
    con.print(f"done in {summary['seconds']:.0f} s · summary: {summary['output_dir']}/distill_summary.json")
