"""The layering contract (`.importlinter`) holds, and it is a real check: one wrong import breaks it.

The contracts: cli -> (orchestrator, client) -> cluster -> (distill, parallel, split, pipeline) ->
train -> (models, data) -> leaves (config, paths, telemetry, net, auth, gate; errors); only cluster/
and the worker glue in parallel/ import Ray; no import cycles between siblings at any depth, imports
inside functions included (grimp reads them all).
"""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LINT = Path(sys.executable).with_name("lint-imports")


def _lint(src: Path, config: Path) -> subprocess.CompletedProcess:
    env = {"PATH": "/usr/bin:/bin", "PYTHONPATH": str(src), "HOME": str(src.parent)}
    return subprocess.run([str(LINT), "--config", str(config), "--no-cache", "--no-logo"], cwd=src.parent, env=env,
                          capture_output=True, text=True, timeout=300)


@pytest.fixture(scope="module")
def linter():
    if not LINT.exists():
        pytest.fail(f"{LINT} is missing: `make install` installs import-linter (the test extra)")
    return LINT


def test_the_layer_contracts_hold(linter):
    proc = _lint(ROOT / "src", ROOT / ".importlinter")
    assert proc.returncode == 0, proc.stdout[-6000:] + proc.stderr[-2000:]
    assert "0 broken" in proc.stdout


@pytest.mark.parametrize("module, bad_import, contract", [
    ("train/checkpoint.py", "from smolforge.cluster import states  # noqa", "Layers"),
    ("models/registry.py", "import ray  # noqa", "Ray only"),
    ("data/formats.py", "def _late():\n    from smolforge.train import schedule  # noqa\n", "Layers"),
    ("serve/engine.py", "from smolforge.cluster import states  # noqa", "Layers"),
    ("serve/api.py", "import ray  # noqa", "Ray only"),
    ("gate.py", "from smolforge.cluster import states  # noqa", "Layers"),
])
def test_a_wrong_import_breaks_the_contract(linter, tmp_path, module, bad_import, contract):
    """The same check on a copy of the tree with one bad import added (inside a function, too)."""
    src = tmp_path / "src"
    shutil.copytree(ROOT / "src" / "smolforge", src / "smolforge",
                    ignore=shutil.ignore_patterns("__pycache__", "_generated"))
    target = src / "smolforge" / module
    target.write_text(target.read_text() + "\n\n" + bad_import + "\n")
    proc = _lint(src, ROOT / ".importlinter")
    assert proc.returncode != 0, proc.stdout[-3000:]
    assert "BROKEN" in proc.stdout
    broken = [line for line in proc.stdout.splitlines() if "BROKEN" in line]
    assert any(contract in line for line in broken), proc.stdout[-3000:]
    assert module.replace("/", ".").removesuffix(".py") in proc.stdout


def test_collectives_live_in_parallel_only():
    """The training loop talks to its peers through a Strategy: no torch.distributed outside parallel/.

    (import-linter cannot forbid a submodule of an external package, so this reads the source.)
    """
    import ast

    offenders = []
    for path in (ROOT / "src" / "smolforge").rglob("*.py"):
        if "parallel" in path.relative_to(ROOT / "src" / "smolforge").parts:
            continue
        for node in ast.walk(ast.parse(path.read_text())):
            names = [a.name for a in node.names] if isinstance(node, ast.Import) else \
                [node.module or ""] if isinstance(node, ast.ImportFrom) else []
            if any(n.startswith(("torch.distributed", "torch.nn.parallel")) for n in names):
                offenders.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not offenders, offenders


def test_no_collective_unpickles_what_a_peer_sent():
    """torch.distributed's `*_object*` collectives pickle on the sender and unpickle on the receiver: a peer's
    bytes would be executed. Ranks exchange tensors only (numbers as float64: `auto_probe.gather_numbers`;
    names as fixed-width bytes: `pipeline`). Reads the source: a call of any such function fails here."""
    import ast

    forbidden = {"all_gather_object", "gather_object", "broadcast_object_list", "scatter_object_list",
                 "send_object_list", "recv_object_list"}
    offenders = []
    for path in (ROOT / "src" / "smolforge").rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.Call):
                name = getattr(node.func, "attr", None) or getattr(node.func, "id", None)
                if name in forbidden:
                    offenders.append(f"{path.relative_to(ROOT)}:{node.lineno} {name}")
    assert not offenders, offenders
