"""The seed documents' command lines RUN, each as written (test_seed_lines.LINES, the one table: the
program and the model names changed to twins and presets, nothing else), through the CLI as users run
it, to the outcome this machine gives; what each line decided is read from what the run wrote (exit
code, the job's state and recorded settings in the embedded cluster's job store, the adapter file, the
`--json` outcome), not from the wording of logs. test_seed_lines.py reads the same lines into settings
with the work recorded; here the work is done.

Per line (OUTCOMES names each line's; a line added to the table without one fails here):
- `cuda`: the line names `--device cuda` (every SplitLearn line does). This machine has no CUDA GPU, so
  running the line as written ends at the one refusal it gives: exit 2, one `error:` naming --device
  cuda and a `fix:` (a GPU machine starts the trunk server / the client instead). That IS running it
  here. The wikitext client line is refused first for its dataset, not cached here (cached, it trains:
  test_hub_datasets.py).
- `unreachable`: `worker join --sollol-host 192.168.1.100 ...`: no smolforge coordinator is there; the
  line runs under a bound (JOIN_BOUND_S) and ends with one message, exit 2, no traceback. What answers at
  that address depends on the network: nothing (cannot reach the coordinator) or, in a sandbox whose
  network answers every address, an HTTP 404 (no smolforge coordinator is there); both carry a fix.
- `completes`: a `launch` line runs its job to completion on the embedded cluster (this machine), with
  its own epochs and batch size; the dataset files the line names are made under tmp_path, a few rows in
  the shape of the seed's file (chat with tools, alpaca); `bundled` is the generated task set, made small
  where the product keeps it ($SMOLFORGE_HOME/datasets). `--json` is added to read the outcome. The
  SmolCluster `--override` lines: the overridden value is in the job's recorded settings.
- `placement`: `--workers 3` asks for 3 ranks of 1 CPU; on a machine with fewer CPUs the embedded
  cluster refuses it before anything runs (exit 2, the fix names --workers); with 3 CPUs or more it
  completes.
- `refused`: the line's needle in the table (teacher_student with no smaller model of the teacher's
  family held: the embedded node's HF cache is empty here).

Soak tier: each `launch` line starts an embedded Ray cluster (about a minute each on a loaded 2-core box).
"""

from __future__ import annotations

import json
import os
import shlex
import sqlite3
import time
from pathlib import Path

import pytest
from typer.testing import CliRunner

from helpers import smolforge
from test_seed_lines import ENV, LINES

pytestmark = pytest.mark.soak

OUTCOMES = {
    "trunk-gpt2": "cuda", "trunk-qwen2": "cuda", "trunk-ex2-rank16": "cuda", "trunk-ex3-remote": "cuda",
    "client-gpt2-wikitext": "refused", "client-qwen2": "cuda", "client-ex1": "cuda", "client-ex2": "cuda",
    "client-ex3-remote": "cuda",
    "node-teacher": "unreachable", "node-remote": "unreachable",
    "launch-3-workers": "placement", "launch-lora-r": "completes", "launch-teacher-student": "refused",
    "override-learning-rate": "completes", "override-epochs": "completes",
}
CUDA = "--device cuda asked for, but no CUDA GPU is visible"
NO_COORDINATOR = ("cannot reach the coordinator at http://192.168.1.100:5000",  # nothing answers there
                  "http://192.168.1.100:5000: answered HTTP 404 to the coordinator's token check: no smolforge "
                  "coordinator is there")  # something else answers (a sandbox's network answers every address)
JOIN_BOUND_S = 90  # the join's probe waits 5 s; the rest is the interpreter starting on a loaded box
LAUNCH_BOUND_S = 420
SECONDS: dict[str, float] = {}  # line id -> seconds the line ran (printed at the module's end)

ROWS = {  # the shape of each seed file the lines name: a few rows of it
    "claude_ultimate_with_tools_621k.jsonl": lambda i: {"messages": [
        {"role": "system", "content": "You can call tools."},
        {"role": "user", "content": f"What is {i} plus {i}?"},
        {"role": "assistant", "content": f"{i} plus {i} is {2 * i}."}]},
    "code_alpaca_full.jsonl": lambda i: {"instruction": f"Write a function that returns {i}.", "input": "",
                                         "output": f"def f():\n    return {i}"},
}


def test_every_seed_line_has_an_outcome():
    assert sorted(OUTCOMES) == sorted(row[0] for row in LINES)


@pytest.fixture
def place(tmp_path, monkeypatch):
    """A home, a working dir and an empty HF cache of the test's own; the lines' dataset files in it."""
    home, hub = tmp_path / "home", tmp_path / "empty-hub"
    hub.mkdir()
    monkeypatch.chdir(tmp_path)
    for name, row in ROWS.items():
        path = tmp_path / "examples" / "datasets" / name
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text("".join(json.dumps(row(i)) + "\n" for i in range(12)))
    _small_bundled(home)
    return {"SMOLFORGE_HOME": str(home), "HF_HUB_CACHE": str(hub), "SMOLFORGE_COORDINATOR": "",
            "SMOLFORGE_RAY_ADDRESS": "", "SMOLFORGE_TOKEN": "", "RAY_TMPDIR": f"/tmp/sfsr{os.getpid()}",
            "HF_HUB_OFFLINE": "1", "TRANSFORMERS_OFFLINE": "1"}


def _small_bundled(home: Path) -> None:
    """`--dataset bundled` as the product writes it once (data.synthetic.bundled_paths), 16 + 4 rows:
    a 1-epoch line is 2 steps of 2 ranks x 4, not 475."""
    from smolforge.data.synthetic import generate

    root = home / "datasets" / "bundled-4000-200-1234"
    root.mkdir(parents=True)
    rows = generate(20, 1234)
    (root / "train.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[:16]))
    (root / "eval.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows[16:]))


@pytest.mark.parametrize("ident,line,means", LINES, ids=[row[0] for row in LINES])
def test_a_seed_line_runs_as_written(ident, line, means, place, tmp_path, request):
    outcome = OUTCOMES[ident]
    if outcome == "placement" and len(os.sched_getaffinity(0)) >= 3:
        outcome = "completes"
    start = time.perf_counter()
    try:
        if outcome == "completes":
            _completes(line, means, place, tmp_path)
        elif outcome == "placement":
            _refused(_run(line, place, LAUNCH_BOUND_S), "the job needs 3 workers with 1 CPU")
            assert not _jobs(place), "a refused placement submitted a job"
        elif outcome == "unreachable":
            _refused(_run(line, place, JOIN_BOUND_S), *NO_COORDINATOR, either=True)
        else:
            result = CliRunner().invoke(_app(), shlex.split(line), env={**ENV, **place})
            _refused(result, CUDA if outcome == "cuda" else means)
            if outcome == "cuda":
                assert "--device cpu" in result.stderr.split("fix:")[1], result.stderr  # the fix: what to pass here
    finally:
        SECONDS[ident] = time.perf_counter() - start


def _app():
    from smolforge.cli.main import app

    return app


def _run(line: str, env: dict, bound: float):
    """The line through `python -m smolforge.cli.main`, bounded; a Result-like (exit_code, stderr, output)."""
    proc = smolforge(*shlex.split(line), timeout=bound, env=env)
    proc.exit_code, proc.output = proc.returncode, proc.stdout + proc.stderr
    return proc


def _refused(result, *needles: str, either: bool = False) -> None:
    """Exit 2, one `error:` with a `fix:`, no traceback, and the needle(s) in it."""
    err = result.stderr
    found = any(n in err for n in needles) if either else all(n in err for n in needles)
    assert result.exit_code == 2 and found, (result.exit_code, result.output[-3000:])
    assert err.count("error:") == 1 and "fix:" in err and "Traceback" not in result.output, err[-3000:]


def _completes(line: str, means: dict, env: dict, tmp_path: Path) -> None:
    """The job ran to completion; the job store recorded the settings the line means; the adapter came back."""
    proc = _run(line + " --json", env, LAUNCH_BOUND_S)
    assert proc.returncode == 0, (proc.returncode, proc.output[-4000:])
    status = json.loads(proc.stdout.strip().splitlines()[-1])
    assert status["state"] == "completed" and status["steps"] >= 1, status
    (job,) = _jobs(env)
    assert job["state"] == "completed" and job["id"] == status["job_id"], job
    sent = {key: value for key, value in means.items() if key != "train.data.path"}
    assert {key: _at(job["spec"], key) for key in sent} == sent, job["spec"]
    if "train.data.path" in means:  # the named file, uploaded at submit: the job holds its upload
        assert _at(job["spec"], "train.data.path").startswith("upload:"), job["spec"]
    adapter = Path(status["adapter_dir"])
    assert (adapter / "adapter_model.safetensors").exists(), status
    if "train.peft.r" in means:  # the rank the line asked for is the adapter's
        assert json.loads((adapter / "adapter_config.json").read_text())["r"] == means["train.peft.r"]
    assert Path(status["adapter_dir"]).resolve().is_relative_to(tmp_path.resolve()), status["adapter_dir"]


def _jobs(env: dict) -> list[dict]:
    """The embedded cluster's job store, as it was left: each job's id, state and recorded spec."""
    path = Path(env["SMOLFORGE_HOME"]) / "embedded" / "jobs.db"
    if not path.exists():
        return []
    with sqlite3.connect(path) as db:
        rows = db.execute("SELECT id, state, spec FROM jobs").fetchall()
    return [{"id": i, "state": s, "spec": json.loads(spec)} for i, s, spec in rows]


def _at(spec: dict, key: str):
    for part in key.split("."):
        spec = spec[part]
    return spec


def teardown_module(module):
    print("\nseed line seconds:\n" + "\n".join(f"  {k:28s} {OUTCOMES[k]:12s} {v:7.1f}" for k, v in SECONDS.items()))
