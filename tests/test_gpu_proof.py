"""`bench/gpu_proof.py` (issue 31, item 4) is runnable the moment a GPU is: CI has none, so it checks the
script on the CPU at a tiny size (`--device cpu --tiny`) and that without CUDA it refuses with one line."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest

from helpers import ROOT

SCRIPT = ROOT / "bench" / "gpu_proof.py"


def run(*args: str, timeout: float = 600) -> subprocess.CompletedProcess:
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "OMP_NUM_THREADS": "1"}
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, timeout=timeout,
                          env=env, cwd=ROOT)


def rows_of(stdout: str) -> dict[str, list[str]]:
    """The markdown table's data rows, by their first cell's first word(s)."""
    cells = [[c.strip() for c in line.strip("|").split("|")] for line in stdout.splitlines()
             if line.startswith("| ") and not line.startswith("| what")]
    return {c[0]: c[1:] for c in cells}


def test_without_cuda_it_exits_2_with_one_line():
    import torch

    if torch.cuda.is_available():
        pytest.skip("this machine has CUDA: the script would run for real")
    r = run(timeout=120)
    assert r.returncode == 2, r.stdout + r.stderr
    assert r.stderr.strip() == ("gpu_proof: no CUDA device here; run it on a GPU machine, or pass --device cpu "
                                "to check it on the CPU"), r.stderr
    assert r.stdout == "" and "Traceback" not in r.stderr


@pytest.mark.soak  # CI budget (stop 55): a benchmark's own table; its refusal without CUDA stays in CI
def test_on_the_cpu_at_a_tiny_size_it_prints_the_table():
    """Training bf16 vs fp32, the teacher writing a store, serve vs HF generate: one row each, with
    numbers and a ratio. (The staged row starts an embedded cluster: the soak test below runs it.)"""
    r = run("--device", "cpu", "--tiny", "--rows", "train,teacher,serve")
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    assert "model small-llama on cpu (tiny check)" in r.stdout, r.stdout
    rows = rows_of(r.stdout)
    assert [k.split(",")[0] for k in rows] == ["train 1 rank", "teacher (hf) writing a store", "serve"], rows
    for what, (measured, baseline, ratio, _note) in rows.items():
        assert measured.endswith("tok/s") and baseline.endswith("tok/s"), (what, measured, baseline)
        assert float(ratio) > 0, (what, ratio)


@pytest.mark.soak
def test_on_the_cpu_every_row_including_two_stages_on_the_embedded_cluster():
    r = run("--device", "cpu", "--tiny", timeout=900)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-3000:]
    rows = rows_of(r.stdout)
    staged = next(v for k, v in rows.items() if k.startswith("serve --stages 2 on the embedded cluster's cpu node"))
    assert float(staged[2]) > 0 and "both stages on this node's device" in staged[3], staged
    assert len(rows) == 4, rows
