"""One face over both backends (issue 42, item 3): `Client` and `EmbeddedCluster` implement the
`cluster.face.Backend` protocol, method for method and signature for signature; the callers of jobs
(`cli/`, `orchestrator.py`) never ask which backend they hold; and the import-linter contract that
keeps them off `cluster/workloads/` and `cluster/nodes/` is a real check.

No cluster, no Ray started: the classes are compared as written, one instance of each is built
without connecting (a Client makes no request until a call; the embedded cluster starts Ray on
first use only).
"""

from __future__ import annotations

import ast
import inspect
import os
import shutil
from pathlib import Path

import pytest

from smolforge.client import Client
from smolforge.cluster.embedded import EmbeddedCluster
from smolforge.cluster.face import Backend
from test_layers import ROOT, _lint, linter  # noqa: F401  (the fixture, used by name)

SRC = ROOT / "src" / "smolforge"
CALLERS = [*sorted((SRC / "cli").glob("*.py")), SRC / "orchestrator.py"]


def _members() -> tuple[list[str], list[str]]:
    """The protocol's methods and its data attributes, by name."""
    methods = [n for n, v in vars(Backend).items() if inspect.isfunction(v) and (not n.startswith("_") or n in
                                                                               ("__enter__", "__exit__"))]
    return methods, list(Backend.__annotations__)


def _shape(fn) -> list[tuple[str, str, object]]:
    """A method's parameters as (name, kind, default): what a caller relies on."""
    return [(p.name, p.kind.name, p.default) for p in inspect.signature(fn).parameters.values()]


def _annotations(fn) -> dict[str, str]:
    """Its annotations as written (the modules use postponed evaluation: strings), quotes removed."""
    return {k: str(v).strip("'\"") for k, v in inspect.get_annotations(fn).items()}


@pytest.mark.parametrize("cls", [Client, EmbeddedCluster], ids=lambda c: c.__name__)
def test_each_backend_has_every_method_of_the_protocol_with_its_signature(cls):
    methods, _ = _members()
    assert len(methods) >= 25, methods  # the shared surface, not an empty protocol
    for name in methods:
        assert hasattr(cls, name), f"{cls.__name__} lacks Backend.{name}"
        ours, want = getattr(cls, name), getattr(Backend, name)
        assert _shape(ours) == _shape(want), f"{cls.__name__}.{name}{inspect.signature(ours)} != {inspect.signature(want)}"
        have = _annotations(ours)  # an annotation the class writes is the protocol's (one it leaves out is Any)
        assert {k: v for k, v in have.items() if k in _annotations(want)} == {
            k: v for k, v in _annotations(want).items() if k in have}, f"{cls.__name__}.{name}"


def test_an_instance_of_each_backend_is_a_backend(tmp_path):
    """Data attributes too (`runs_in_process`, `base`), on instances built without a cluster."""
    client = Client("127.0.0.1", 9, token="t")
    embedded = EmbeddedCluster(state_dir=tmp_path / "embedded")
    try:
        _, data = _members()
        assert set(data) == {"runs_in_process", "base"}
        for backend in (client, embedded):
            assert isinstance(backend, Backend), type(backend).__name__
        assert (client.runs_in_process, embedded.runs_in_process) == (False, True)
        assert embedded.base == "embedded" and client.base == "http://127.0.0.1:9"
        assert embedded._handle is None  # comparing started nothing
    finally:
        client.close()
        embedded.close()


def _asks_which_backend(node: ast.AST) -> bool:
    """`getattr(x, ...)` / `hasattr(x, ...)` where x is `backend` or `<obj>.backend`."""
    if not (isinstance(node, ast.Call) and isinstance(node.func, ast.Name) and node.func.id in ("getattr", "hasattr")
            and node.args):
        return False
    target = node.args[0]
    return (isinstance(target, ast.Name) and target.id == "backend") or (
        isinstance(target, ast.Attribute) and target.attr == "backend")


def test_no_caller_of_jobs_asks_which_backend_it_holds():
    """Both backends have every method: `cli/` and the Orchestrator call them, they never probe for one."""
    found = [f"{path.relative_to(SRC)}:{node.lineno}" for path in CALLERS
             for node in ast.walk(ast.parse(path.read_text())) if _asks_which_backend(node)]
    assert found == []


@pytest.mark.parametrize("module, bad_import", [
    ("cli/demo.py", "def _late():\n    from smolforge.cluster.workloads.distill import session  # noqa\n"),
    ("orchestrator.py", "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                        "    from smolforge.cluster.nodes.ray_glue import ClusterHandle  # noqa\n"),
])
def test_a_caller_of_jobs_importing_workloads_or_nodes_breaks_the_face_contract(linter, tmp_path, module, bad_import):
    """On a copy of the tree: a function-level import and a type-checking one each break it."""
    src = tmp_path / "src"
    shutil.copytree(SRC, src / "smolforge", ignore=shutil.ignore_patterns("__pycache__", "_generated"))
    target = src / "smolforge" / module
    target.write_text(target.read_text() + "\n\n" + bad_import + "\n")
    proc = _lint(src, ROOT / ".importlinter")
    broken = [line for line in proc.stdout.splitlines() if "BROKEN" in line]
    assert proc.returncode != 0 and broken, proc.stdout[-3000:]
    assert all("face" in line for line in broken), broken  # only the face contract, which names it


def test_a_client_joins_its_coordinator_s_ray_cluster_as_a_driver(monkeypatch):
    """`Client.ray_cluster`: the address the coordinator gives, its token, and the TLS environment first."""
    from smolforge.cluster.nodes import ray_glue

    client = Client("127.0.0.1", 9, token="t")
    joined: list[tuple] = []
    monkeypatch.setenv("SMOLFORGE_TEST_RAY_TLS", "0")  # restored after the test: ray_cluster updates os.environ
    monkeypatch.setattr(client, "check_token", lambda: {"ray_address": "10.0.0.1:6379", "ray_tls": True})
    monkeypatch.setattr(client, "ray_tls_env", lambda: {"SMOLFORGE_TEST_RAY_TLS": "1"})
    monkeypatch.setattr(ray_glue, "connect", lambda address, token=None: joined.append(
        (address, token, os.environ["SMOLFORGE_TEST_RAY_TLS"])) or "handle")
    try:
        assert client.ray_cluster() == "handle"
    finally:
        client.close()
    assert joined == [("10.0.0.1:6379", "t", "1")]


def test_the_orchestrator_s_cluster_is_its_backend_s_or_the_bare_handle_it_holds():
    """A Backend's `ray_cluster()` (jobs go through it); a bare Ray handle's holder: that handle (tasks in process)."""
    from types import SimpleNamespace

    from smolforge.orchestrator import Orchestrator

    handle, joined = object(), object()
    bare = Orchestrator("teacher_student", backend=SimpleNamespace(handle=handle, close=lambda: None))
    jobs = Orchestrator("teacher_student", backend=SimpleNamespace(
        runs_in_process=False, submit_job=lambda spec: "job-1", ray_cluster=lambda: joined, close=lambda: None))
    assert (bare._as_jobs, jobs._as_jobs) == (False, True)
    assert (bare.cluster, jobs.cluster) == (handle, joined)
