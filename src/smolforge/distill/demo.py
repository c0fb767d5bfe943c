"""`smolforge demo`: teacher→student distillation end to end on the embedded default.

1. The student base is `tiny-llama` pretrained in-process on a generic corpus (prose with numbers,
   words and string facts, no chat turns: `data.synthetic.generic_corpus`), as a real student is a
   pretrained small model; the teacher is that base fully fine-tuned on every bundled training
   example. Both are cached under $SMOLFORGE_HOME/demo (keyed by their settings and library
   versions), so a second demo starts at step 2.
2. Two parallel teacher tasks answer the prompt pool (`bundled-prompts`: the 512 labelled prompts
   and 3,488 more without answers) into the top-k logit store (`teacher_outputs/`). A user has few
   labelled examples and many questions; the teacher turns the questions into training signal.
3. Two students of the pretrained base (every weight trained: `student_peft`) learn from it (forward
   KL to the top-k) as one data-parallel group (`--students-sync ddp`: each rank takes half of every
   step's rows), whose one model goes to `merged_model/final_adapter/`.
4. The baseline goes through the *same* pipeline on the 512 labelled examples' reference answers
   (the `reference` backend: text, no logits): two SFT students, same steps, same merge. So "KD vs
   SFT" is what a user gets from a teacher over fine-tuning on the answers they have.
5. Held-out exact-match accuracy and eval loss of the student base, the SFT student and the KD
   student, the share of the SFT student's gap to the teacher that KD closes, the store's
   bytes/token and the time of each stage.
"""

from __future__ import annotations

import hashlib
import json
import shutil
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from smolforge.config import DataSpec, PeftSpec, TrainConfig
from smolforge.distill.losses import KDConfig
from smolforge.distill.store import store_summary
from smolforge.distill.student import StudentConfig
from smolforge.models.loading import load_model, load_tokenizer
from smolforge.models.peft_methods import apply_peft, load_adapter
from smolforge.paths import atomic_write_json, home
from smolforge.rundir import RunDir, check_run_dir, claim_run_dir, remove_recorded
from smolforge.train.engine import evaluate, train
from smolforge.train.rendering import load_checked_splits

DEMO_STUDENT = "tiny-llama"  # the preset the student base is pretrained from (student_base)
DISTILL_REPLACES = ("distill", "sft-baseline", "demo_summary.json")  # what the distillation demo starts afresh


def check_demo_dir(out: str | Path, replaces: tuple[str, ...]) -> RunDir:
    """Whether a demo may start afresh in `out` (its outputs are a showcase, not a run to continue),
    replacing `replaces`: refused (exit 2), before anything runs or is deleted, when `out` holds another
    kind of run (its manifest says so: `rundir`), any of `replaces` that no earlier demo recorded, or any
    file without a manifest (a run from before manifests: the old demo mark proves nothing)."""
    return check_run_dir(out, "demo", replaces, unrecorded_ok=False)


def claim_demo_dir(out: str | Path, replaces: tuple[str, ...]) -> None:
    """check_demo_dir, then record the demo in `out`'s manifest and delete what an earlier demo wrote of
    `replaces` (only what its manifest records: a file a user added stays)."""
    remove_recorded(claim_run_dir(out, "demo", replaces, unrecorded_ok=False), replaces)


@dataclass
class DemoSettings:
    """Sized so the whole demo takes a few minutes on a 2-core laptop."""

    # The student base: tiny-llama pretrained on the generic corpus (cached; see student_base).
    pretrain_steps: int = 300
    pretrain_lr: float = 3e-3
    pretrain_batch: int = 32
    pretrain_length: int = 64
    teacher_base: str = "student"  # "student": the pretrained student base; else a preset name
    teacher_steps: int = 800
    teacher_lr: float = 3e-3
    teacher_batch: int = 32
    student_steps: int = 600
    student_batch: int = 32
    # The demo's students fine-tune every weight ("none"): at these steps they learn the teacher's
    # answers to the prompt pool better than LoRA students and faster (measured: BENCHMARKS.md).
    student_peft: str = "none"
    full_lr: float = 3e-3  # students that fine-tune every weight (peft "none")
    lora_lr: float = 2e-3  # LoRA students (the benchmark's LoRA arms)
    lora_r: int = 64
    lora_alpha: float = 128
    kd_loss: str = "forward_kl"
    beta: float = 0.5  # generalised JSD's β (kd_loss "jsd")
    kd_ratio: float = 1.0  # pure logit KD: measured better than mixing in CE on the teacher's tokens
    temperature: float = 1.0
    top_k: int = 32
    max_new_tokens: int = 12
    num_teachers: int = 2
    num_students: int = 2
    # "ddp": the students of an arm train as one data-parallel group and write one adapter; "average":
    # each trains on its own half of the shards and their adapters are averaged (which cost KD its
    # accuracy lead here: BENCHMARKS.md).
    students_sync: str = "ddp"
    num_shards: int = 16
    # The labelled examples (the first N of the bundled train split): what the SFT baseline trains on.
    distill_samples: int | None = 512
    # The prompts the teacher answers for the KD students: `bundled-prompts` is those same 512 prompts
    # and 3,488 more without answers (neither training nor held-out prompts). Distillation's input is
    # prompts, not labels, and a teacher pays where prompts outnumber answers: on the 512 labelled
    # prompts alone KD closes 6-16 % of the gap, on the pool most of it (BENCHMARKS.md).
    kd_data: str = "bundled-prompts"
    kd_samples: int | None = None  # the first N of kd_data (None: all)
    max_length: int = 64
    max_eval_samples: int = 200
    teacher_seed: int = 0


def _cache_dir() -> Path:
    import os

    # $SMOLFORGE_DEMO_CACHE lets tests keep the (deterministic) models across sessions.
    return Path(os.environ.get("SMOLFORGE_DEMO_CACHE") or home() / "demo")


def _key(what: str, fields: dict[str, Any]) -> str:
    import torch
    import transformers

    blob = json.dumps(fields, sort_keys=True)
    versions = f"{torch.__version__}/{transformers.__version__}/fp32"
    return hashlib.sha256((what + blob + versions).encode()).hexdigest()[:12]


def _cached_full_finetune(root: Path, cfg: TrainConfig) -> tuple[Path, dict[str, Any]]:
    """Train `cfg` (a full fine-tune) into root/none_adapter once; later calls load it. Deterministic:
    seeded, fp32, so the cache key (its settings and library versions) names the weights."""
    model_dir = root / "none_adapter"
    info = root / "model.json"
    if (model_dir / "config.json").exists() and info.exists():
        return model_dir, json.loads(info.read_text())
    if root.exists():
        shutil.rmtree(root)  # a run that died half-way: nothing in it is trusted
    result = train(cfg)
    out = {"eval": dict(result.eval), "steps": result.steps, "seconds": result.seconds}
    atomic_write_json(info, out)
    shutil.rmtree(root / "checkpoints", ignore_errors=True)  # the weights are in none_adapter/
    return model_dir, out


def student_base(s: DemoSettings, quiet: bool = True) -> tuple[Path, dict[str, Any]]:
    """The demo's student base: tiny-llama pretrained on the generic corpus (cached), as a real student
    (a pretrained 0.5B model) knows language and arithmetic but not the task's format.

    See `smolforge.data.synthetic.generic_corpus` for what it reads: prose with the skills, no chat turns."""
    from smolforge.data.synthetic import generic_corpus_path

    fields = {k: getattr(s, k) for k in ("pretrain_steps", "pretrain_lr", "pretrain_batch", "pretrain_length")}
    root = _cache_dir() / f"student-base-{_key(DEMO_STUDENT, fields)}"
    corpus = generic_corpus_path()
    cfg = TrainConfig(model=DEMO_STUDENT, data=DataSpec(path=str(corpus), format="text", packing=True,
                                                        max_length=s.pretrain_length, max_eval_samples=64,
                                                        eval_fraction=0.01),
                      peft=PeftSpec(method="none"), output_dir=str(root), max_steps=s.pretrain_steps,
                      batch_size=s.pretrain_batch, lr=s.pretrain_lr, warmup_steps=30, seed=0, precision="fp32",
                      quiet=quiet, tensorboard=False, log_every=50)
    return _cached_full_finetune(root, cfg)


def train_teacher(s: DemoSettings, quiet: bool = True) -> tuple[Path, dict[str, Any]]:
    """The demo teacher (cached by its settings): (model dir, its held-out metrics).

    It knows the task: a full fine-tune on every bundled training example, from the same pretrained
    base as the students (`teacher_base: "student"`) or from a preset's random weights."""
    fields = {k: getattr(s, k) for k in ("teacher_steps", "teacher_lr", "teacher_batch", "max_length", "teacher_seed",
                                         "max_eval_samples")}  # its cached metrics are on that many examples
    if s.teacher_base == "student":
        base, _ = student_base(s, quiet)
        fields["base"] = base.parent.name
    else:
        base = s.teacher_base
    root = _cache_dir() / f"teacher-{_key(str(s.teacher_base), fields)}"
    cfg = TrainConfig(model=str(base), data=DataSpec(path="bundled", max_length=s.max_length,
                                                     max_eval_samples=s.max_eval_samples),
                      peft=PeftSpec(method="none"), output_dir=str(root), max_steps=s.teacher_steps,
                      batch_size=s.teacher_batch, lr=s.teacher_lr, warmup_steps=30, seed=s.teacher_seed,
                      precision="fp32",  # "auto" may pick bf16 by a timing probe: the teacher would vary by load
                      max_new_tokens=s.max_new_tokens, quiet=quiet, tensorboard=False, log_every=50)
    return _cached_full_finetune(root, cfg)


def evaluate_adapter(adapter: str | Path | None, s: DemoSettings, base: str | Path | None = None) -> dict[str, Any]:
    """Held-out eval loss and exact-match accuracy of the demo student base (plus an adapter)."""
    import torch

    base = str(base or student_base(s)[0])
    tok = load_tokenizer(base)
    model = load_model(base)
    if adapter is not None:
        model = load_adapter(model, adapter)
    spec = DataSpec(path="bundled", max_length=s.max_length, max_eval_samples=s.max_eval_samples, max_samples=1)
    cfg = TrainConfig(model=base, data=spec, batch_size=32, max_new_tokens=s.max_new_tokens)
    return evaluate(model, tok, load_checked_splits(spec, tok), cfg, torch.device("cpu"))


def _student_lr(s: DemoSettings, peft: str) -> float:
    return s.lora_lr if peft == "lora" else s.full_lr


@dataclass(frozen=True)
class StudentArm:
    """One demo student's departures from the demo's settings (None: the demo's value): its steps, KD
    mix and loss, PEFT (`"lora"` at `lora_lr` or `"none"`, a full fine-tune at `full_lr`), on-policy share
    and start, learning rate (the bench's arms, `bench/distill_kd_vs_sft.py`)."""

    steps: int | None = None
    kd_ratio: float | None = None
    peft: str | None = None
    on_policy_ratio: float = 0.0
    on_policy_start: float = 0.0
    kd_loss: str | None = None
    beta: float | None = None
    temperature: float | None = None
    lr: float | None = None


def local_student(s: DemoSettings, seed: int, output_dir: str | Path, arm: StudentArm = StudentArm(),
                  teacher: str | Path | None = None):
    """(StudentConfig, model) of one demo student trained in this process (the KD test and bench).

    The model is built here, under `seed`, by the caller's thread: torch's RNG (which initialises LoRA)
    is process-wide, so students meant to train side by side in threads are all built first.
    """
    import torch

    base = str(student_base(s)[0])
    steps, kd_ratio, lr, kd_loss = arm.steps, arm.kd_ratio, arm.lr, arm.kd_loss
    temperature, beta, on_policy_ratio, on_policy_start = arm.temperature, arm.beta, arm.on_policy_ratio, arm.on_policy_start
    peft = arm.peft or s.student_peft
    spec = (PeftSpec(method="lora", r=s.lora_r, alpha=s.lora_alpha, dropout=0.0) if peft == "lora"
            else PeftSpec(method=peft))
    cfg = StudentConfig(base_model=base, output_dir=str(output_dir), max_steps=steps or s.student_steps,
                        batch_size=s.student_batch, lr=lr or _student_lr(s, peft),
                        warmup_steps=30, max_length=s.max_length, seed=seed, device="cpu", num_threads=1,
                        eval_data="bundled", max_eval_samples=s.max_eval_samples, max_new_tokens=s.max_new_tokens,
                        precision="fp32", peft=spec, on_policy_ratio=on_policy_ratio, on_policy_start=on_policy_start,
                        teacher_model=str(teacher) if teacher else None,
                        kd=KDConfig(loss=kd_loss or s.kd_loss, kd_ratio=s.kd_ratio if kd_ratio is None else kd_ratio,
                                    temperature=s.temperature if temperature is None else temperature,
                                    beta=s.beta if beta is None else beta))
    torch.manual_seed(seed)
    return cfg, apply_peft(load_model(base), cfg.peft)


def student_kwargs(s: DemoSettings, seed: int) -> dict[str, Any]:
    # ddp: the students are one data-parallel group, so `student_batch` is the group's global batch,
    # split over the ranks, and the run equals one student with that batch (the bench's numbers).
    per_rank = s.student_batch // s.num_students if s.students_sync == "ddp" else s.student_batch
    lora = {"r": s.lora_r, "alpha": s.lora_alpha, "dropout": 0.0} if s.student_peft == "lora" else {}
    return dict(num_students=s.num_students, peft_type=s.student_peft, students_sync=s.students_sync,
                peft_config=lora, max_steps=s.student_steps,
                batch_size=per_rank, lr=_student_lr(s, s.student_peft), warmup_steps=30, max_length=s.max_length,
                seed=seed,
                kd_loss=s.kd_loss, kd_ratio=s.kd_ratio, temperature=s.temperature, device="cpu")


def run_demo(quiet: bool = False, output_dir: str | Path | None = None, seed: int = 0,
             settings: DemoSettings | None = None, *, orchestrator: Any) -> dict[str, Any]:
    """Run the demo's tasks through `orchestrator` (the seeds' `smolforge.Orchestrator`, whose calls are
    `distill_task` jobs on its backend: they show in `smolforge jobs` and the dashboard like any run, and
    write where the calls say); returns teacher/base/SFT/KD metrics, store bytes/token and stage times.
    SmolforgeError when a task fails or runs past 30 minutes."""
    s = settings or DemoSettings()
    out = Path(output_dir or "outputs/demo")
    kd_dir, sft_dir = (out / name for name in DISTILL_REPLACES[:2])
    claim_demo_dir(out, DISTILL_REPLACES)
    stages: dict[str, float] = {}
    t_all = time.time()
    say = (lambda msg: None) if quiet else _say

    say("1/5 the student base (tiny-llama pretrained on a generic corpus) and the teacher (that base fully "
        "fine-tuned on the bundled task), each trained once and cached")
    t = time.time()
    base_dir, _ = student_base(s, quiet=quiet)
    stages["student_base"] = time.time() - t
    t = time.time()
    teacher_dir, teacher_info = train_teacher(s, quiet=quiet)
    stages["teacher_training"] = time.time() - t

    orch = orchestrator
    say(f"2/5 {s.num_teachers} parallel teacher tasks write the top-k logit store")
    t = time.time()
    common = dict(max_new_tokens=s.max_new_tokens, top_k=s.top_k, batch_size=64, num_shards=s.num_shards, device="cpu")
    teachers = orch.create_parallel_teacher_tasks(str(teacher_dir), s.kd_data, kd_dir, num_teachers=s.num_teachers,
                                                  max_samples=s.kd_samples, **common)
    reference = orch.create_parallel_teacher_tasks(str(base_dir), "bundled", sft_dir, num_teachers=1,
                                                   backend="reference", max_samples=s.distill_samples, **common)
    say(f"3/5 {s.num_students} KD students learn from the store; the SFT baseline runs the same pipeline")
    kd_students = orch.create_student_tasks(str(base_dir), kd_dir / "teacher_outputs", **student_kwargs(s, seed))
    sft_students = orch.create_student_tasks(str(base_dir), sft_dir / "teacher_outputs", **student_kwargs(s, seed))
    orch.wait_distill(teachers + reference, timeout=1800)
    stages["teacher_shards"] = time.time() - t
    t_students = time.time()
    orch.wait_distill(kd_students + sft_students, timeout=1800)
    stages["students"] = time.time() - t_students

    say("4/5 each arm's adapter into merged_model/ (ddp: one group's adapter, copied; average: exact mean of "
        "the LoRA updates → rank r)")
    t = time.time()
    kd_merge = orch.aggregate_student_outputs(kd_students, kd_dir / "merged_model")
    sft_merge = orch.aggregate_student_outputs(sft_students, sft_dir / "merged_model")
    stages["aggregation"] = time.time() - t

    say("5/5 held-out evaluation")
    t = time.time()
    base = evaluate_adapter(None, s, base_dir)
    sft = evaluate_adapter(sft_merge["output"], s, base_dir)
    kd = evaluate_adapter(kd_merge["output"], s, base_dir)
    stages["evaluation"] = time.time() - t

    store = store_summary(kd_dir / "teacher_outputs")
    stages["total"] = time.time() - t_all
    summary = {
        "teacher_accuracy": teacher_info["eval"].get("accuracy"),
        "gap_closed": gap_closed(teacher_info["eval"].get("accuracy"), sft.get("accuracy"), kd.get("accuracy")),
        "teacher_eval_loss": teacher_info["eval"].get("eval_loss"),
        "student_base_accuracy": base.get("accuracy"),
        "student_base_eval_loss": base.get("eval_loss"),
        "sft_accuracy": sft.get("accuracy"),
        "kd_accuracy": kd.get("accuracy"),
        "sft_eval_loss": sft.get("eval_loss"),
        "kd_eval_loss": kd.get("eval_loss"),
        "store_bytes_per_token": store["bytes_per_token"],
        "store_fp16_full_vocab_bytes_per_token": store["fp16_full_vocab_bytes_per_token"],
        "store_reconstruction_kl": store["reconstruction_kl_mean"],
        "stage_seconds": {k: round(v, 1) for k, v in stages.items()},
        "student_steps": s.student_steps,
        "student_peft": s.student_peft,
        "kd_prompts": store["examples"],
        "sft_examples": store_summary(sft_dir / "teacher_outputs")["examples"],
        "seed": seed,
        "teacher_dir": str(teacher_dir),
        "student_base_dir": str(base_dir),
        "kd_adapter": kd_merge["output"],
        "sft_adapter": sft_merge["output"],
        "settings": asdict(s),
    }
    atomic_write_json(out / "demo_summary.json", summary)
    return summary


def gap_closed(teacher: float | None, sft: float | None, kd: float | None) -> float | None:
    """The share of the SFT student's accuracy gap to the teacher that KD closes: (KD - SFT) / (teacher - SFT)."""
    if teacher is None or sft is None or kd is None or teacher <= sft:
        return None
    return (kd - sft) / (teacher - sft)


def _say(msg: str) -> None:
    from rich.console import Console

    Console(stderr=True).print(f"[bold cyan]demo[/] {msg}")


def print_demo_table(summary: dict[str, Any]) -> None:
    from rich.console import Console
    from rich.table import Table

    def pct(v):
        return "-" if v is None else f"{v:.1%}"

    def num(v):
        return "-" if v is None else f"{v:.3f}"

    settings = summary.get("settings") or {}
    kind = "LoRA students" if settings.get("student_peft") == "lora" else "a student"
    table = Table(title=f"smolforge demo: distilling a trained teacher into {kind} of a pretrained base "
                        "(bundled task, held out)")
    table.add_column("model")
    table.add_column("exact-match accuracy", justify="right")
    table.add_column("eval loss", justify="right")
    table.add_row("teacher (trained in-process)", pct(summary["teacher_accuracy"]), num(summary["teacher_eval_loss"]))
    table.add_row("student base (pretrained, before distillation)", pct(summary["student_base_accuracy"]), num(summary["student_base_eval_loss"]))
    how = (f"{summary['student_steps']} steps, {settings.get('num_students', 2)} data-parallel ranks"
           if settings.get("students_sync", "ddp") == "ddp" else f"{summary['student_steps']} steps × 2, merged")
    labelled, pool = settings.get("distill_samples") or "all", settings.get("kd_data", "bundled-prompts")
    table.add_row(f"student after SFT on {labelled} labelled examples ({how})", pct(summary["sft_accuracy"]),
                  num(summary["sft_eval_loss"]))
    table.add_row(f"student after KD on the teacher's answers to {pool} ({how})", pct(summary["kd_accuracy"]),
                  num(summary["kd_eval_loss"]))
    con = Console()
    con.print(table)
    if summary.get("gap_closed") is not None:
        con.print(f"KD closes {summary['gap_closed']:.0%} of the SFT student's accuracy gap to the teacher "
                  f"(same steps; {summary.get('kd_prompts', '?')} prompts answered by the teacher, "
                  f"{summary.get('sft_examples', '?')} labelled examples)")
    con.print(f"teacher-output store: {summary['store_bytes_per_token']:.1f} bytes/token "
              f"(fp16 full vocabulary: {summary['store_fp16_full_vocab_bytes_per_token']:,} bytes/token; "
              f"stored vs exact top-k KL {summary.get('store_reconstruction_kl') or 0:.1e} nats/token)")
    stages = Table(title="time per stage (s)")
    for k in summary["stage_seconds"]:
        stages.add_column(k.replace("_", " "), justify="right")
    stages.add_row(*[f"{v:.0f}" for v in summary["stage_seconds"].values()])
    con.print(stages)
    con.print(f"merged KD adapter: {summary['kd_adapter']}")
