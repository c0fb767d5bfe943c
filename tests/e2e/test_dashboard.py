"""The dashboard in a real headless Chromium (Debian `chromium`): nodes and jobs render.

The page is loaded as a user would open it, `/dashboard#token=…`; its script must call the API with
that token and fill the tables. Skipped only when /usr/bin/chromium is absent.
"""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

from localcluster import LocalCluster  # noqa: E402

CHROMIUM = "/usr/bin/chromium"

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600),
              pytest.mark.skipif(not os.path.exists(CHROMIUM),
                                 reason="/usr/bin/chromium is not installed (CI installs the Debian chromium package)")]


def dump_dom(url: str, profile: Path) -> str:
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", "--no-first-run", f"--user-data-dir={profile}",
           "--virtual-time-budget=8000", "--dump-dom", url]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=120).stdout


def test_dashboard_renders_nodes_and_jobs(tmp_path):
    with LocalCluster(tmp_path) as c:
        c.start_coordinator()
        c.add_worker("dash-w1")
        c.wait_nodes(["dash-w1"])
        client = c.client()
        job_id = client.submit_job({"kind": "data_parallel", "num_workers": 1, "name": "dash-job",
                                    "train": {"model": "tiny-llama", "data": {"path": "bundled", "max_samples": 32,
                                                                              "max_eval_samples": 4},
                                              "max_steps": 3, "batch_size": 2, "eval_accuracy": False}})
        client.wait_for_job(job_id, timeout=300)
        url = f"http://127.0.0.1:{c.port}/dashboard#token={c.token}"
        dom = ""
        for attempt in range(3):  # a loaded CI machine may need a second look
            dom = dump_dom(url, tmp_path / f"profile-{attempt}")
            if 'data-loaded="1"' in dom and "dash-w1" in dom and job_id in dom:
                break
            time.sleep(2)
        assert 'data-loaded="1"' in dom, dom[-3000:]
        assert 'data-node="dash-w1"' in dom and 'data-node="coordinator"' in dom
        assert f'data-job="{job_id}"' in dom and "completed" in dom
        assert '<td class="comm">0.0 MB / 0.0 s</td>' in dom, dom[-3000:]  # one rank: nothing sent, no wait
        # without the token the page holds nothing and asks for it
        bare = dump_dom(f"http://127.0.0.1:{c.port}/dashboard", tmp_path / "profile-bare")
        assert 'id="login" style="display: block;"' in bare and "dash-w1" not in bare
    shutil.rmtree(tmp_path / "profile-bare", ignore_errors=True)
