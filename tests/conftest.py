"""Shared test set-up: offline hub, a private SMOLFORGE_HOME per session, quiet transformers."""

from __future__ import annotations

import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
os.environ.setdefault("RAY_AUTH_MODE", "token")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
# precision "auto" on CPU measures bf16 against fp32; tests compare floats exactly, so pin fp32.
os.environ.setdefault("SMOLFORGE_CPU_BF16", "0")
_MADE_HOME = None
if "SMOLFORGE_HOME" not in os.environ or not os.environ.get("SMOLFORGE_KEEP_HOME"):
    # One home per test session: presets are built once, and nothing touches ~/.smolforge.
    os.environ["SMOLFORGE_HOME"] = _MADE_HOME = tempfile.mkdtemp(prefix="smolforge-test-home-")

import pytest  # noqa: E402
import torch  # noqa: E402

torch.set_num_threads(1)


def pytest_sessionfinish(session, exitstatus):
    """The session's home goes with it (every module's clusters and servers are stopped by now)."""
    if _MADE_HOME:
        import shutil

        shutil.rmtree(_MADE_HOME, ignore_errors=True)


@pytest.fixture(scope="session")
def tiny_llama_dir():
    from smolforge.models.tiny import preset_dir

    return preset_dir("tiny-llama")
