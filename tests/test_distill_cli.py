"""`smolforge distill` from the command line: help, bad input, and a small end-to-end run."""

from __future__ import annotations

import json
import os

import pytest

from helpers import last_json, smolforge


def test_help_has_an_example():
    proc = smolforge("distill", "--help")
    assert proc.returncode == 0
    assert "Example:" in proc.stdout and "--kd-loss" in proc.stdout and "--num-teachers" in proc.stdout


DISTILL = ["distill", "--teacher", "tiny-llama", "--student", "tiny-llama", "--data", "bundled"]
LAUNCH = ["launch", "--mode", "hybrid", "--model", "tiny-llama", "--dataset", "bundled"]


@pytest.mark.parametrize("command, args, message", [
    (DISTILL, ["--kd-loss", "kl"], "unknown KD loss"),
    (DISTILL, ["--peft-config", "{bad"], "--peft-config is not valid JSON"),
    (DISTILL, ["--peft-config", '{"rank": 0}'], "r: Input should be greater than or equal to 1"),
    (DISTILL, ["--aggregate", "linear"], "unknown --aggregate"),
    (DISTILL, ["--samples-per-prompt", "2"], "identical samples"),
    (DISTILL, ["--teacher-responses", "mine"], "unknown teacher responses"),
    (DISTILL, ["--output-dir", "a/../../b"], "contains '..'"),
    (LAUNCH, [], "--mode hybrid needs a student model"),
    (LAUNCH, ["--student", "tiny-llama", "--gpu", "required"], "--gpu applies to --mode data_parallel only"),
    (LAUNCH, ["--student", "tiny-llama", "--save-every", "-1"], "--save-every must be 0 or more"),
    (DISTILL, ["--save-every", "-5"], "--save-every must be 0 or more"),
    (LAUNCH, ["--student", "tiny-llama", "--set", "kd_loss=kl"], "unknown KD loss"),  # --set reaches distill.*
    (LAUNCH, ["--student", "tiny-llama", "--set", "wat=1"], "unknown distill setting(s) wat"),
    (LAUNCH, ["--student", "tiny-llama", "--kd-loss", "kl"], "unknown KD loss"),
    (DISTILL, ["--students-sync", "allreduce"], "students_sync: Input should be 'average' or 'ddp'"),
    (DISTILL, ["--students-strategy", "zero1"], "--students-strategy zero1 needs --students-sync ddp"),
    (DISTILL, ["--students-sync", "ddp", "--students-strategy", "dpp"], "unknown strategy 'dpp' (did you mean 'ddp'?)"),
    (DISTILL, ["--students-sync", "ddp", "--students-strategy", "async-ps"], "needs a parameter server"),
    # its stages need the same rows, a student group's ranks each take their own: the class says so
    (DISTILL, ["--students-sync", "ddp", "--students-strategy", "pipeline"], "pipeline cannot train a distill student"),
])
def test_bad_flags_fail_fast_with_exit_2(command, args, message, tmp_path):
    """In-process (the same typer app, the same checks and exit code, without a Python start per case);
    the next test runs one of them as a real `python -m` process."""
    from typer.testing import CliRunner

    from smolforge.cli.main import app

    res = CliRunner().invoke(app, [*command, "--output-dir", str(tmp_path / "o"), *args])
    assert res.exit_code == 2, (res.exit_code, res.stderr, res.exception)
    assert res.stderr.startswith("error:") and message in res.stderr and "Traceback" not in res.stderr
    assert not (tmp_path / "o").exists()  # refused before anything ran


TEACHER_STUDENT = ["launch", "--mode", "teacher_student", "--model", "tiny-llama", "--student", "tiny-llama",
                   "--dataset", "bundled"]


@pytest.mark.parametrize("command, no_eval", [(DISTILL, ["--no-eval"]), (TEACHER_STUDENT, ["--set", "eval=false"])],
                         ids=["distill", "launch teacher_student"])
def test_a_bad_held_out_file_is_refused_at_its_line_before_anything_runs(command, no_eval, tmp_path, monkeypatch):
    """`--eval-data FILE` (distill, and launch's distillation modes) is read where the job is submitted,
    by the one JSONL reader: a bad line is refused at FILE:LINE (no --skip-bad-lines offered: distill has
    none), a missing file names the flag's spec field, and --no-eval (launch: `--set eval=false`) beside
    it is a contradiction; exit 2, nothing written, no cluster started (in-process)."""
    from typer.testing import CliRunner

    import smolforge.cluster.embedded as embedded
    from smolforge.cli.main import app

    monkeypatch.setattr(embedded.EmbeddedCluster, "handle", property(lambda self: pytest.fail("started a cluster")))

    bad = tmp_path / "held.jsonl"
    bad.write_text('{"prompt": "1+1=", "completion": "2"}\n\n{"prompt": "2+2=", \n')
    for flags, said in ((["--eval-data", str(bad)], f"error: {bad}:3: malformed JSON"),
                        (["--eval-data", str(tmp_path / "none.jsonl")], "error: distill.eval_data: held-out file"),
                        (["--eval-data", "bundled", *no_eval], "error: --eval-data names a held-out file, but --no-eval")):
        res = CliRunner().invoke(app, [*command, "--output-dir", str(tmp_path / "o"), *flags])
        assert res.exit_code == 2, (res.exit_code, res.stderr, res.exception)
        assert res.stderr.startswith(said) and "fix:" in res.stderr and "skip-bad-lines" not in res.stderr, res.stderr
        assert not (tmp_path / "o").exists()


def test_the_eval_line_names_the_held_out_file_and_the_examples_scored():
    """A launched job's text outcome (`follow.finish_job`): its eval scores, over the held-out file the user
    named (`--eval-data`), and the count of examples each student scored (a distill job's result)."""
    from smolforge.cli.follow import eval_line

    assert eval_line({"eval_loss": 2.0, "accuracy": 0.25, "examples": 5}, "held.jsonl") == \
        "eval: eval_loss 2.0000, accuracy 0.2500 over held.jsonl (5 examples)"
    assert eval_line({"eval_loss": 2.0}, None) == "eval: eval_loss 2.0000"


def test_settings_that_need_one_vocabulary_are_refused_at_submit_with_another_tokenizer(tmp_path):
    """On-policy steps (the teacher scores the student's own ids) and reference responses (the teacher's
    log-probs are all it makes) need the teacher's and the student's ids to agree. A teacher of another
    family (the GPT-2 twin's tokenizer against the presets') is refused by `smolforge distill`, by a
    `distill` job spec and by a seeds' students stage naming its teacher: exit 2, one message, before any
    teacher work (nothing written). Read from the tokenizers' files; one vocabulary passes the same check."""
    from typer.testing import CliRunner

    from smolforge.cli.main import app
    from smolforge.cluster.control.kinds import parse
    from smolforge.distill.settings import DistillSettings, check_run
    from smolforge.errors import SmolforgeError
    from smolforge.models.loading import resolve_model

    for model in ("twin:gpt2", "tiny-llama", "tiny-qwen2"):
        resolve_model(model)  # built once per session, as a user's models are on disk (no build output below)
    other = ["distill", "--teacher", "twin:gpt2", "--student", "tiny-llama", "--data", "bundled"]
    for flags, what in ((["--on-policy-ratio", "0.5"], "--on-policy-ratio 0.5"),
                        (["--teacher-responses", "reference"], "--teacher-responses reference")):
        res = CliRunner().invoke(app, [*other, "--output-dir", str(tmp_path / "o"), *flags])
        assert res.exit_code == 2, (res.exit_code, res.stderr, res.exception)
        assert res.stderr.startswith("error:") and "Traceback" not in res.stderr, res.stderr
        assert "different tokenizers" in res.stderr and what in res.stderr and "fix:" in res.stderr
        assert not (tmp_path / "o").exists()  # no store, no run dir: refused before the teacher stage
    settings = {"teacher": "twin:gpt2", "students": ["tiny-llama"], "data": "bundled", "on_policy_ratio": 0.5}
    with pytest.raises(SmolforgeError, match="different tokenizers"):
        parse({"kind": "distill", "distill": settings})
    with pytest.raises(SmolforgeError, match="different tokenizers"):
        parse({"kind": "distill_task", "stage": "students", "store_dir": str(tmp_path / "store"),
               "args": {"base_model": "tiny-llama", "teacher_model": "twin:gpt2", "on_policy_ratio": 0.5}})
    check_run(DistillSettings(**{**settings, "teacher": "tiny-qwen2"}))  # the presets share one tokenizer
    check_run(DistillSettings(**{**settings, "on_policy_ratio": 0.0}))  # sequence-level KD works across them


def test_a_bad_flag_fails_fast_in_a_real_process(tmp_path):
    proc = smolforge(*DISTILL, "--output-dir", str(tmp_path / "o"), "--kd-loss", "kl", timeout=60)
    assert proc.returncode == 2, proc.stderr
    assert proc.stderr.startswith("error:") and "unknown KD loss" in proc.stderr and "Traceback" not in proc.stderr


def test_distill_end_to_end_on_the_embedded_cluster(tmp_path):
    out = tmp_path / "run"
    env = {"RAY_TMPDIR": f"/tmp/sfdc{os.getpid()}", "SMOLFORGE_COORDINATOR": "", "SMOLFORGE_RAY_ADDRESS": ""}
    # A teacher needs prompts, not answers: half the lines have none (uploaded, split, answered, scored
    # on the held-out lines that have answers).
    from smolforge.data.synthetic import generate

    data = tmp_path / "prompts.jsonl"
    data.write_text("".join(json.dumps(r if i % 2 else {"prompt": r["prompt"]}) + "\n"
                            for i, r in enumerate(generate(60, seed=11))))
    held = tmp_path / "held.jsonl"  # --eval-data: the students' eval is over these 5, whole (not a split of --data)
    held.write_text("".join(json.dumps(r) + "\n" for r in generate(5, seed=12)))
    proc = smolforge("distill", "--teacher", "tiny-llama", "--student", "tiny-llama", "--data", str(data),
                     "--eval-data", str(held),
                     "--max-samples", "32", "--max-steps", "3", "--batch-size", "4", "--max-new-tokens", "6",
                     "--top-k", "8", "--num-students", "2", "--peft-config", '{"r": 4, "lora_alpha": 8}',
                     "--save-every", "1", "--output-dir", str(out), "--tensorboard", "--json", timeout=600, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = last_json(proc.stdout)
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator

    for i in range(2):  # --tensorboard: one run dir per student, in the run dir
        acc = EventAccumulator(str(out / "tensorboard" / f"student{i}"))
        acc.Reload()
        assert acc.Scalars("train/loss") and all(e.step <= 3 for e in acc.Scalars("train/loss"))
    assert summary["store"]["shards"] >= 2 and summary["store"]["bytes_per_token"] > 0
    assert [s["state"] for s in summary["student_tasks"]] == ["completed", "completed"]
    assert summary["eval_data"] == str(held)
    for student in summary["per_student"]:  # each student's eval loss is over the held-out file's 5 examples
        assert student["eval"]["examples"] == 5 and student["eval"]["eval_loss"] > 0, student
    assert (out / "teacher_outputs" / "batch_0.safetensors").exists()
    for i in range(2):
        assert (out / "output" / f"student_{i}" / "lora_adapter" / "adapter_model.safetensors").exists()
    assert (out / "merged_model" / "final_adapter" / "adapter_config.json").exists()
    assert json.loads((out / "merged_model" / "final_adapter" / "adapter_config.json").read_text())["r"] == 4
    assert (out / "distill_summary.json").exists()
    # It ran as a distill job of the embedded cluster (the road of `launch` and `submit`), writing here.
    jobs = last_json(smolforge("jobs", "--json", env=env, check=True).stdout)
    mine = [j for j in jobs if j["kind"] == "distill" and (j.get("spec") or {}).get("output_dir") == str(out)]
    assert mine and mine[0]["state"] == "completed", jobs
    # What the teacher and the students printed reached the job's log, each line with its task's label.
    logs = [json.loads(ln) for ln in smolforge("job", "logs", mine[0]["id"], "--json", env=env,
                                               check=True).stdout.splitlines()]
    lines = [i for i in logs if i["type"] == "log"]
    assert any(i["task"].startswith("teacher-") and "shard 0 done" in i["line"] for i in lines), logs
    for student in ("student-0", "student-1"):
        assert any(i["task"] == student and f"{student} step 3/3" in i["line"] and i["node"] for i in lines), logs
    # A rerun into the same dir is refused and deletes nothing: the students' checkpoints stay.
    kept = sorted(out.glob("output/student_*/checkpoints/step-*"))
    assert kept
    again = smolforge(*DISTILL, "--max-samples", "32", "--max-steps", "3", "--output-dir", str(out), env=env)
    assert again.returncode == 2 and "holds student checkpoints" in again.stderr and "--resume" in again.stderr
    assert sorted(out.glob("output/student_*/checkpoints/step-*")) == kept


def test_launch_hybrid_keeps_teachers_and_students_apart(tmp_path):
    """`launch --mode hybrid` on the embedded (one-node) cluster, as a distill job: the students never
    run beside a teacher, so they queue, take the node when the teacher is done, and split the shards;
    the merged adapter and the run summary come back into --output-dir. `--eval-data`: each student is
    evaluated on the held-out file, whole; --json names the file and the count of examples scored."""
    out = tmp_path / "run"
    env = {"RAY_TMPDIR": f"/tmp/sfdh{os.getpid()}", "SMOLFORGE_COORDINATOR": "", "SMOLFORGE_RAY_ADDRESS": ""}
    from smolforge.data.synthetic import generate

    data = tmp_path / "data.jsonl"
    data.write_text("".join(json.dumps(r) + "\n" for r in generate(48, seed=3)))
    held = tmp_path / "held.jsonl"
    held.write_text("".join(json.dumps(r) + "\n" for r in generate(3, seed=4)))
    proc = smolforge("launch", "--mode", "hybrid", "--model", "tiny-llama", "--student", "tiny-llama",
                     "--dataset", str(data), "--eval-data", str(held), "--workers", "2", "--max-steps", "2", "--batch-size", "4",
                     "--lora-r", "4", "--top-k", "8", "--output-dir", str(out), "--json", timeout=600, env=env)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "distill_summary.json").read_text())
    assert [s["state"] for s in summary["student_tasks"]] == ["completed", "completed"]
    shards = [set(s["shards"]) for s in summary["student_tasks"]]
    assert not shards[0] & shards[1] and len(shards[0] | shards[1]) == summary["store"]["shards"]
    ev = summary["events"]
    last_teacher = max(e["ts"] for e in ev if e["kind"] == "teacher_finished")
    assert any(e["kind"] == "student_queued" for e in ev)
    assert all(e["ts"] >= last_teacher for e in ev if e["kind"] == "student_submitted"), ev
    status = last_json(proc.stdout)  # it ran as a job of the embedded cluster, like a data-parallel launch
    assert status["kind"] == "distill" and status["state"] == "completed", status
    assert status["result"]["store"]["shards"] == summary["store"]["shards"] and "eval_loss" in status["result"]["eval"]
    assert status["eval_data"] == str(held) and status["result"]["eval"]["examples"] == 3, status
    assert status["adapter_dir"] == str(out / "final_adapter")
    assert (out / "final_adapter" / "adapter_config.json").exists()
