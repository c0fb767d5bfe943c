"""Issue 46 item 7: `smolforge worker probe` (what `worker join` would advertise, without joining) and
`Orchestrator.monitor_tasks(ids)` without a callback (the seeds' progress lines)."""

from __future__ import annotations

import json

from typer.testing import CliRunner

from smolforge.orchestrator import Orchestrator

ENV = {"SMOLFORGE_COORDINATOR": "", "SMOLFORGE_TOKEN": None}


def test_worker_probe_reports_what_join_would_advertise_without_joining(tmp_path, monkeypatch):
    """The report is `discover`'s inventory with the join's flags, models per backend; no Ray node,
    no coordinator (the WorkerNode that joins is never built)."""
    import smolforge.cluster.face as face
    from smolforge.cli.main import app
    from smolforge.cli.probe import inventory_report

    (tmp_path / "my-model").mkdir()
    (tmp_path / "my-model" / "config.json").write_text("{}")
    monkeypatch.setattr(face, "WorkerNode", lambda *a, **k: (_ for _ in ()).throw(AssertionError("joined")))
    flags = ["--name", "student-cpu-01", "--cpus", "3", "--memory", "2.5", "--models-dir", str(tmp_path),
             "--no-hf-cache"]
    result = CliRunner().invoke(app, ["worker", "probe", *flags, "--json"], env=ENV)
    assert result.exit_code == 0, result.output
    report = json.loads(result.stdout)
    inv = face.discover("student-cpu-01", models_dir=str(tmp_path), cpus=3, memory_gb=2.5, scan_cache=False)
    assert report == json.loads(json.dumps(inventory_report(inv, face.by_backend(inv.models))))
    assert (report["name"], report["cpus"], report["ram_gb"]) == ("student-cpu-01", 3, 2.5)
    assert "my-model" in report["models"]["hf"]
    assert report["line"] == "Would register as student-cpu-01: 3 CPUs, 2.5 GB RAM, 0 GPUs; 1 models" or report["gpus"]
    text = CliRunner().invoke(app, ["worker", "probe", *flags], env=ENV)
    assert text.exit_code == 0 and report["line"] in text.stdout and "models (hf): my-model" in text.stdout


class Steps:
    """A backend whose one job goes pending -> running on w1 (50%) -> completed, one poll each."""

    runs_in_process = False

    def __init__(self, states):
        self.states = list(states)

    def get_job_status(self, job_id: str) -> dict:
        state, node, progress = self.states.pop(0) if len(self.states) > 1 else self.states[0]
        return {"job_id": job_id, "state": state, "node": node, "nodes": [node] if node else [], "progress": progress,
                "error": "out of memory on w1\ntraceback…" if state == "failed" else None, "tasks": []}


def test_monitor_tasks_without_a_callback_prints_the_seeds_lines(capsys):
    orch = Orchestrator("teacher_student", backend=Steps([("pending", None, 0.0), ("running", "w1", 0.0),
                                                          ("running", "w1", 0.5), ("running", "w1", 0.5),
                                                          ("completed", "w1", 1.0)]))
    final = orch.monitor_tasks(["job-00000000aa"], poll=0)
    assert final["job-00000000aa"]["state"] == "completed"
    lines = capsys.readouterr().out.splitlines()
    assert lines == ["[⠋] Task job-00000000aa - PENDING", "[⠙] Task job-00000000aa - RUNNING (w1)",
                     "[⠹] Task job-00000000aa - RUNNING (w1) 50%", "[✓] Task job-00000000aa - COMPLETED",
                     "[✓] All tasks completed"]
    failing = Orchestrator("teacher_student", backend=Steps([("failed", "w1", 0.2)]))
    failing.monitor_tasks(["job-00000000bb"], poll=0)
    assert capsys.readouterr().out.splitlines() == ["[✗] Task job-00000000bb - FAILED: out of memory on w1",
                                                    "[✗] 1 of 1 tasks did not complete"]
