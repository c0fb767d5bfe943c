"""One real `smolforge serve` process shared by the serve tests (the tiny-llama preset copied to a temp dir),
and the same model loaded in-process for tests that drive the app or the engine directly."""

from __future__ import annotations

import shutil
import subprocess
from pathlib import Path

import pytest

from servehelpers import start_server


@pytest.fixture(scope="session")
def model_copy(tiny_llama_dir, tmp_path_factory) -> Path:
    """The preset saved to a temp dir: served as a plain local directory, as a user's model would be."""
    dst = tmp_path_factory.mktemp("serve-model") / "tiny-llama"
    shutil.copytree(tiny_llama_dir, dst)
    return dst


@pytest.fixture(scope="session")
def server(model_copy, tmp_path_factory):
    srv = start_server(tmp_path_factory.mktemp("serve"), model_copy)
    try:
        yield srv
    finally:
        srv.proc.terminate()
        try:
            srv.proc.wait(timeout=20)
        except subprocess.TimeoutExpired:
            srv.proc.kill()
            srv.proc.wait(timeout=10)


@pytest.fixture(scope="session")
def served_tiny(model_copy):
    """The model of the `server` fixture, loaded here: in-process apps and engines share it (read-only)."""
    from smolforge.serve.model import ServedModel

    return ServedModel.load(str(model_copy), name="tiny", device="cpu")


@pytest.fixture(scope="session")
def lcpp_model(model_copy):
    """The llamacpp engine's model of the `served_tiny` checkpoint, from its f16 export (made once; loaded
    once for the llamacpp engine's and the penalties' tests). Skipped without llama-cpp-python."""
    from test_llamacpp_engine import require_llama_cpp

    require_llama_cpp()
    from smolforge.serve.engines import EngineSpec, load_engine

    loaded = load_engine("llamacpp", EngineSpec(model=str(model_copy), name="tiny", device="cpu", quant="f16",
                                                threads=1, max_batch=4))
    yield loaded.model
    loaded.model.close()
