"""A distillation's typed plans (issue 42, item 2): the seeds' calls and a run's `DistillSettings` are
checked by one builder per side (`cluster/workloads/distill/plans.py`), so the same run asked both ways
gives equal `TeacherPlan` / `StudentPlan`; and the checks that build them have one caller each."""

from __future__ import annotations

import re
from dataclasses import replace
from pathlib import Path

from smolforge.cluster.control.specs import ResourceConfig, TaskConfig
from smolforge.cluster.workloads.distill.run import distill_plans
from smolforge.cluster.workloads.distill.session import DistillSession
from smolforge.distill.settings import DistillSettings

SRC = Path(__file__).resolve().parents[1] / "src" / "smolforge"

# one run, with settings off their defaults where the two spellings could drift apart
SETTINGS = dict(teacher="tiny-llama", students=["tiny-llama", "tiny-qwen2"], data="bundled", num_teachers=2,
                num_students=3, peft="lora", peft_config={"r": 4, "alpha": 8}, kd_loss="reverse_kl", kd_ratio=0.7,
                temperature=2.0, beta=0.3, on_policy_ratio=0.25, on_policy_temperature=0.9, on_policy_start=0.1,
                top_k=16, compress_outputs=False, gen_temperature=0.7, top_p=0.9, max_new_tokens=24,
                samples_per_prompt=2, teacher_batch_size=4, num_shards=6, max_samples=40, max_steps=30, epochs=2.0,
                batch_size=4, grad_accum=2, lr=1e-3, warmup_steps=3, save_every=50, replace_timeout_s=60.0,
                max_length=128, seed=7, split_shards=False, cpus_per_teacher=2.0, cpus_per_student=2.0,
                max_eval_samples=20, eval_max_new_tokens=8, device="cpu", teacher_dtype="bf16", student_dtype="fp16")


def _seed_calls(out: Path) -> tuple[dict, dict]:
    """The same run as a seed script writes it: the seeds' names, `lora_config`, a TaskConfig."""
    teacher = dict(model_path="tiny-llama", dataset_path="bundled", output_dir=out, num_teachers=2, batch_size=4,
                   compress_outputs=False, max_samples=40, top_k=16, temperature=0.7, top_p=0.9, max_new_tokens=24,
                   samples_per_prompt=2, num_shards=6, device="cpu", dtype="bf16", seed=7,
                   task_config=TaskConfig(resources=ResourceConfig(cpu_cores=2)))
    students = dict(base_model=["tiny-llama", "tiny-qwen2"], teacher_outputs_dir=out / "teacher_outputs",
                    num_students=3, lora_config={"r": 4, "alpha": 8}, output_dir=out, split_shards=False,
                    kd_loss="reverse_kl", kd_ratio=0.7, temperature=2.0, beta=0.3, max_steps=30, epochs=2.0,
                    batch_size=4, grad_accum=2, lr=1e-3, warmup_steps=3, max_length=128, seed=7,
                    eval_data="bundled", max_eval_samples=20, max_new_tokens=8, device="cpu",
                    replace_timeout_s=60.0, on_policy_ratio=0.25, on_policy_temperature=0.9, on_policy_start=0.1,
                    dtype="fp16", teacher_dtype="bf16",
                    task_config=TaskConfig(resources=ResourceConfig(cpu_cores=2), checkpointing=True))
    return teacher, students


def test_the_seeds_calls_and_a_runs_settings_give_equal_plans(tmp_path):
    """Both ways into a run ask one builder per side: the seeds' keyword arguments (through the
    session's own entry, as `Orchestrator` and a `distill_task` job use it) and `DistillSettings`
    (as `smolforge distill` uses it) give equal plans; one setting changed gives another plan."""
    out = tmp_path / "run"
    session = DistillSession(cluster=None, mode="teacher_student")
    teacher, students = _seed_calls(out)
    seeds = (session.teacher_plan(**teacher), session.student_plan(**students))
    cfg = DistillSettings(**SETTINGS)
    assert distill_plans(cfg, "teacher_student", out) == seeds
    assert seeds[1].cpus == 2.0 and seeds[1].save_every == 50 and seeds[1].peft.r == 4  # the seeds' spellings, resolved
    other = distill_plans(cfg.model_copy(update={"beta": 0.5}), "teacher_student", out)
    assert other[0] == seeds[0] and other[1] != seeds[1] and other[1] == replace(seeds[1], kd=replace(seeds[1].kd,
                                                                                                      beta=0.5))


def test_make_sync_and_check_run_have_one_caller_each():
    """The students' sync plug-in is decided by the plan's builder, a run's settings checked by the distill
    kind's check at submit: one call site each under src/ (a definition or a mention in text is not one)."""
    calls: dict[str, list[str]] = {"make_sync": [], "check_run": []}
    for path in sorted(SRC.rglob("*.py")):
        text = path.read_text()
        if not any(f"{name}(" in text for name in calls):
            continue
        for no, line in enumerate(text.splitlines(), 1):
            code = line.split("#", 1)[0]
            for name in calls:
                if re.search(rf"(?<![\w`]){name}\(", code) and not code.lstrip().startswith("def "):
                    calls[name].append(f"{path.relative_to(SRC)}:{no}")
    assert {name: len(sites) for name, sites in calls.items()} == {"make_sync": 1, "check_run": 1}, calls
