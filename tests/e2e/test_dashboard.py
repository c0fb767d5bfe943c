"""The dashboard driven for real in headless Chromium (Debian `chromium`, through Playwright).

The session's shared cluster (a coordinator and two workers, tests/conftest.py) and one 2-worker data-parallel job for the whole module,
used by the tests in file order: the overview lists nodes and the job; the job page draws curves
whose points are the job's own metrics (read from the charts' series data, checked against
/api/v1/jobs/{id}/metrics); its buttons pause, resume and cancel the job (the job's state read back
through the API; cancel only once its confirmation dialog is accepted).

The page is opened as a user would, `/dashboard#token=…`: its script must call the API with that
token. Screenshots of each step are saved as test artifacts under `test-artifacts/dashboard/` at the
repository root (git-ignored; CI keeps them). Without /usr/bin/chromium it skips, or fails under CI
(CI=true; helpers.require).
"""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "cluster"))

from helpers import CHROMIUM, require_chromium  # noqa: E402

ARTIFACTS = Path(__file__).resolve().parents[2] / "test-artifacts" / "dashboard"
STEPS = 40  # held after step 8, and after step 12 once resumed: still running whenever a button is pressed
WAIT_MS = 60_000

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module", autouse=True)
def chromium() -> str:
    """At test time, not a module-level skipif: under CI (CI=true) a missing browser fails (helpers.require)."""
    return require_chromium()


def wait_state(client, job_id: str, states: tuple[str, ...], timeout: float = 120) -> dict:
    deadline = time.time() + timeout
    st = {}
    while time.time() < deadline:
        st = client.get_job_status(job_id)
        if st["state"] in states:
            return st
        time.sleep(0.3)
    raise AssertionError(f"job {job_id} did not reach {states}: {st}")


def hold(base: Path, step: int) -> list[Path]:
    """Ranks on w1 and w2 hold after `step` until released (fault `hold-step`, train/faults.py): the
    job is surely running when a button is pressed, without a job made long enough to be."""
    files = [base / f"node-{n}" / "node" / "fault-hold-step" for n in ("w1", "w2")]
    for f in files:
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(str(step))
    return files


@pytest.fixture(scope="module")
def world(module_cluster):
    """The session's shared cluster (a coordinator and workers w1, w2; tests/conftest.py) and one job,
    held after step 8 (two evaluations and checkpoints drawn by then)."""
    c = module_cluster.c
    client = c.client()
    files = hold(module_cluster.base, 8)
    try:
        job_id = client.submit_job({
            "kind": "data_parallel", "num_workers": 2, "name": "dash-job",
            "train": {"model": "tiny-llama", "data": {"path": "bundled", "max_samples": 32, "max_eval_samples": 4},
                      "max_steps": STEPS, "batch_size": 2, "eval_accuracy": False, "log_every": 1,
                      "eval_every": 4, "save_every": 4}})
        deadline = time.time() + 300
        while time.time() < deadline:  # both ranks held after step 8: curves, evaluations, checkpoints
            if sum(e["kind"] == "held" for e in client.job_events(job_id)) >= 2:
                break
            assert client.get_job_status(job_id)["state"] in ("pending", "running"), client.job_logs(job_id)
            time.sleep(0.5)
        yield {"c": c, "client": client, "job": job_id, "base": module_cluster.base}
    finally:
        for f in files:
            f.unlink(missing_ok=True)


@pytest.fixture(scope="module")
def page(world):
    from playwright.sync_api import sync_playwright

    ARTIFACTS.mkdir(parents=True, exist_ok=True)
    with sync_playwright() as pw:
        browser = pw.chromium.launch(executable_path=CHROMIUM, headless=True, args=[
            "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--disable-component-update",
            "--disable-sync", "--no-first-run"])
        try:
            pg = browser.new_page(viewport={"width": 1300, "height": 1000})
            pg.set_default_timeout(WAIT_MS)
            pg.goto(f"http://127.0.0.1:{world['c'].port}/dashboard#token={world['c'].token}")
            yield pg
        finally:
            browser.close()


def test_overview_lists_nodes_and_the_job(world, page):
    job_id = world["job"]
    page.wait_for_selector('body[data-loaded="1"]')
    page.wait_for_selector(f'tr[data-job="{job_id}"]')
    page.wait_for_function("() => /%/.test(document.querySelector('tr[data-node=\"w1\"] td.usage')?.textContent)")
    assert "#token=" not in page.url  # the page takes the token out of the address bar
    for node in ("coordinator", "w1", "w2"):
        assert page.locator(f'tr[data-node="{node}"]').count() == 1
    assert "CPU" in page.locator('tr[data-node="w1"] td.usage').inner_text()
    assert page.locator('tr[data-node="w1"] td.gpu-usage').inner_text() == "–"  # no GPU here
    assert "running" in page.locator(f'tr[data-job="{job_id}"]').inner_text()
    page.screenshot(path=str(ARTIFACTS / "overview.png"), full_page=True)
    # what this machine cannot produce, drawn from a doctored /status: a GPU in a heartbeat, and a
    # queued job's reason (Playwright answers the page's request with the real response, edited)
    def doctored(route):
        body = route.fetch().json()
        for n in body["nodes"]:
            if n["name"] == "w2":
                n["usage"]["gpus"] = [{"index": 0, "util_percent": 87.0, "mem_used_gb": 3.14, "mem_total_gb": 24.0}]
        for j in body["jobs"] + body["recent_jobs"]:
            j["pending_reason"] = "waiting for 2 free workers"
        route.fulfill(json=body)

    page.route("**/api/v1/status", doctored)
    try:
        page.wait_for_function("() => /GPU0/.test(document.querySelector('tr[data-node=\"w2\"] td.gpu-usage').textContent)")
        assert page.locator('tr[data-node="w2"] td.gpu-usage').inner_text() == "GPU0 87% · 3.1/24 GB"
        assert page.locator(f'tr[data-job="{job_id}"] .reason').inner_text() == "waiting for 2 free workers"
    finally:
        page.unroute("**/api/v1/status")
    # without the token the page holds nothing and asks for it
    bare = page.context.browser.new_page()
    try:
        bare.goto(f"http://127.0.0.1:{world['c'].port}/dashboard")
        bare.wait_for_selector("#login", state="visible")
        assert bare.locator("tr[data-node]").count() == 0
        # an in-page navigation to an address with the token (a pasted link): taken, and gone from the
        # address bar at once, the page it names kept (issue 43: it stayed in the address bar)
        bare.evaluate(f"location.hash = 'token={world['c'].token}&job={job_id}'")
        bare.wait_for_function("() => !location.hash.includes('token=')")
        assert "token=" not in bare.url and bare.url.endswith(f"#job={job_id}"), bare.url
        assert world["c"].token not in bare.evaluate("location.href")
    finally:
        bare.close()
    # the page shell: only its own scripts run, it talks only to its origin, and no other site may frame it
    import urllib.request

    with urllib.request.urlopen(f"http://127.0.0.1:{world['c'].port}/dashboard", timeout=30) as resp:
        csp = resp.headers["Content-Security-Policy"]
        assert resp.headers["X-Frame-Options"] == "DENY" and resp.headers["Referrer-Policy"] == "no-referrer"
    assert "frame-ancestors 'none'" in csp and "script-src 'self'" in csp and "connect-src 'self'" in csp, csp


def test_log_view_filters_by_node_level_job_and_text(world, page):
    """The overview's log view (GET /api/v1/logs): the held job's lines from w2 that contain a text, each
    shown once and all of them; at ERROR, none (the job logged none)."""
    job_id, client = world["job"], world["client"]
    page.wait_for_selector('body[data-loaded="1"]')
    page.select_option("#log-node", "w2")  # (the choices are the nodes and jobs the page lists)
    page.select_option("#log-job", job_id)
    page.fill("#log-text", "smolforge.task: rank")
    page.wait_for_function("() => /node=w2.*job=.*grep=/.test(document.body.dataset.logs || '')"
                           " && document.querySelectorAll('#logs li').length > 0")
    shown = page.locator("#logs li").evaluate_all(
        "els => els.map(e => [e.dataset.node, e.dataset.job, e.dataset.level, e.textContent])")
    wanted = [r["line"] for r in client.search_logs(node="w2", job=job_id, grep="smolforge.task: rank")]
    assert {(n, j) for n, j, _, _ in shown} == {("w2", job_id)}, shown
    assert [text.split("] ", 1)[1] for _, _, _, text in shown] == wanted, (shown, wanted)  # held: no new lines
    page.screenshot(path=str(ARTIFACTS / "logs.png"), full_page=True)
    page.select_option("#log-level", "ERROR")
    page.wait_for_function("() => /level=ERROR/.test(document.body.dataset.logs || '')")
    assert page.locator("#logs li").count() == 0
    for select in ("#log-node", "#log-job", "#log-level"):
        page.select_option(select, "")
    page.fill("#log-text", "")


def chart_series(page) -> dict[str, dict]:
    """Every chart's series as uPlot holds them: {chart: {label: {step: value}}}."""
    return page.evaluate("""() => {
        const out = {};
        for (const [key, u] of Object.entries(window.smolforgeCharts)) {
            out[key] = {};
            u.series.slice(1).forEach((s, i) => {
                const pts = {};
                u.data[0].forEach((x, j) => { if (u.data[i + 1][j] !== null) pts[x] = u.data[i + 1][j]; });
                out[key][s.label] = pts;
            });
        }
        return out;
    }""")


def test_job_page_draws_the_jobs_curves(world, page):
    job_id = world["job"]
    page.click(f'tr[data-job="{job_id}"] a')
    page.wait_for_selector("body[data-job-loaded]")
    page.wait_for_function("() => window.smolforgeCharts.loss && window.smolforgeCharts.loss.data[0].length >= 3"
                           " && window.smolforgeCharts.comm_bytes_sent")
    charts = chart_series(page)
    rows = world["client"].job_metrics(job_id)
    by_name: dict[str, dict[int, float]] = {}
    for r in rows:
        by_name.setdefault(r["name"], {})[r["step"]] = r["value"]
    # one chart per base name, one line per rank; eval_loss drawn with the train loss
    assert {"loss", "lr", "tokens_per_s", "comm_bytes_sent"} <= set(charts), sorted(charts)
    assert {"loss", "eval_loss"} <= set(charts["loss"]), charts["loss"].keys()
    assert set(charts["comm_bytes_sent"]) == {"comm_bytes_sent.rank0", "comm_bytes_sent.rank1"}
    for chart, lines in charts.items():
        for name, points in lines.items():
            assert points, (chart, name)
            for step, value in points.items():  # every drawn point is the job's own number
                assert by_name[name][int(step)] == pytest.approx(value), (name, step)
    assert len(charts["loss"]["loss"]) >= 3
    tasks = page.locator("#tasks tbody tr")
    assert tasks.count() >= 2
    assert {"w1", "w2"} <= set(page.locator("#tasks tbody td:nth-child(4)").all_inner_texts())
    assert page.locator("#events li").count() > 0
    assert page.locator("#job-eta").inner_text() != ""
    page.screenshot(path=str(ARTIFACTS / "job-curves.png"), full_page=True)


def test_the_job_page_shows_its_jobs_lines_in_the_same_log_view(world, page):
    """On the job page (after the curves test opened it) the overview's log view shows that job's lines
    only: its job filter is the page's (the choice hidden), node/level/text filter as there."""
    job_id, client = world["job"], world["client"]
    page.wait_for_selector("body[data-job-loaded]")
    assert page.locator("#log-view").is_visible() and page.locator("#log-job-filter").is_hidden()
    page.select_option("#log-node", "w1")  # the choices: the nodes its tasks ran on
    page.fill("#log-text", "smolforge.task: rank")
    page.wait_for_function(f"() => (document.body.dataset.logs || '') === 'node=w1&job={job_id}&grep=smolforge.task%3A%20rank'"
                           " && document.querySelectorAll('#logs li').length > 0")
    shown = page.locator("#logs li").evaluate_all("els => els.map(e => [e.dataset.node, e.dataset.job, e.textContent])")
    wanted = [r["line"] for r in client.search_logs(node="w1", job=job_id, grep="smolforge.task: rank")]
    assert {(n, j) for n, j, _ in shown} == {("w1", job_id)}, shown
    assert [text.split("] ", 1)[1] for _, _, text in shown] == wanted, (shown, wanted)  # held: no new lines
    page.screenshot(path=str(ARTIFACTS / "job-logs.png"), full_page=True)
    page.select_option("#log-node", "")
    page.fill("#log-text", "")


def test_pause_and_resume_buttons(world, page):
    job_id, client = world["job"], world["client"]
    assert client.get_job_status(job_id)["state"] == "running"
    page.wait_for_selector("#btn-pause:enabled").click()
    st = wait_state(client, job_id, ("paused",))
    assert st["step"] < STEPS, st
    page.wait_for_selector("#job-state.paused")
    page.screenshot(path=str(ARTIFACTS / "job-paused.png"), full_page=True)
    hold(world["base"], 12)  # the resumed ranks (from step 8's checkpoint) hold again for the cancel test
    page.wait_for_selector("#btn-resume:enabled").click()
    wait_state(client, job_id, ("running",), timeout=180)
    page.wait_for_selector("#job-state.running")


def test_cancel_button_asks_first(world, page):
    job_id, client = world["job"], world["client"]
    asked: list[str] = []

    def decline(dialog):
        asked.append(dialog.message)
        dialog.dismiss()

    page.once("dialog", decline)
    page.wait_for_selector("#btn-cancel:enabled").click()
    time.sleep(1.0)
    assert asked and job_id in asked[0]
    assert client.get_job_status(job_id)["state"] == "running"  # declined: nothing happened

    page.once("dialog", lambda dialog: dialog.accept())
    page.click("#btn-cancel")
    wait_state(client, job_id, ("cancelled",))
    page.wait_for_selector("#job-state.cancelled")
    assert page.locator("#btn-cancel").is_disabled()
    page.screenshot(path=str(ARTIFACTS / "job-cancelled.png"), full_page=True)
