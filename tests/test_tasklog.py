"""Task output for the coordinator (telemetry/tasklog.py) and its bound in the job store: no Ray."""

from __future__ import annotations

import logging
import sys

from smolforge.cluster.control.jobstore import JobStore
from smolforge.cluster.control.jobview import format_item, interleave
from smolforge.telemetry.tasklog import TASK_LOGGER, LineBuffer, capture_output


def test_buffer_keeps_the_newest_and_counts_what_it_dropped():
    buf = LineBuffer("r1", "w2", limit=3, secrets=[])
    for i in range(10):
        buf.add(f"line {i}", ts=100.0 + i)
    out = buf.drain()
    assert [r["line"] for r in out[1:]] == ["line 7", "line 8", "line 9"]
    assert out[0]["line"].startswith("[7 lines dropped")
    assert out[0]["ts"] == 107.0  # the marker sits where the gap is, before the kept lines
    assert all(r["task"] == "r1" and r["node"] == "w2" and r["type"] == "log" for r in out)
    assert buf.drain() == []  # the count starts again after a drain
    buf.add("again")
    assert [r["line"] for r in buf.drain()] == ["again"]


def test_buffer_masks_the_token_and_cuts_long_lines():
    buf = LineBuffer("r0", "w1", secrets=["s3cret-token"])
    buf.add("env SMOLFORGE_TOKEN=s3cret-token")
    buf.add("x" * 5000)
    first, long = buf.drain()
    assert first["line"] == "env SMOLFORGE_TOKEN=***"
    assert len(long["line"]) < 2100 and "3000 more characters cut" in long["line"]


def test_capture_tees_prints_and_logging_line_by_line(capsys):
    buf = LineBuffer("r0", "w1", secrets=[])
    before_out, before_handlers = sys.stdout, list(logging.getLogger().handlers)
    with capture_output(buf):
        print("hello", end="")
        print(" world")
        sys.stderr.write("warn 1\nwarn 2\npartial")
        logging.getLogger(TASK_LOGGER).info("step %d", 5)
        logging.getLogger("some.library").info("not shown: a library's INFO")
        sys.stdout.write("\rbar 0%\rbar 50%")  # a progress bar redrawn in place: what a terminal shows
        sys.stdout.write("\rbar 100%\r\n")
    lines = [r["line"] for r in buf.drain()]
    assert lines == ["hello world", "warn 1", "warn 2", "INFO smolforge.task: step 5", "bar 100%", "partial"]
    assert sys.stdout is before_out and logging.getLogger().handlers == before_handlers
    seen = capsys.readouterr()
    assert "hello world" in seen.out and "warn 2" in seen.err  # the original streams still get everything


def test_store_keeps_the_newest_lines_per_job(tmp_path):
    store = JobStore(tmp_path / "jobs.db")
    a = store.create_job("data_parallel", {}, job_id="job-a")
    b = store.create_job("data_parallel", {}, job_id="job-b")
    store.add_logs(b, [{"task": "r0", "node": "w1", "ts": 1.0, "line": "b's"}], keep=5)
    for i in range(4):
        store.add_logs(a, [{"task": f"r{j % 2}", "node": "w1", "ts": 10.0 + 3 * i + j, "line": f"{i}.{j}"}
                           for j in range(3)], keep=5)
    kept = store.logs(a)
    assert [r["line"] for r in kept] == ["2.1", "2.2", "3.0", "3.1", "3.2"]  # the newest 5 of 12
    assert [r["line"] for r in store.logs(b)] == ["b's"]  # another job's lines are not trimmed
    assert [r["line"] for r in store.logs(a, task="r1")] == ["2.1", "3.1"]
    assert [r["line"] for r in store.logs(a, since_id=kept[2]["id"])] == ["3.1", "3.2"]


def test_events_and_lines_interleave_by_time():
    events = [{"id": 1, "ts": 1.0, "kind": "state", "message": "running"},
              {"id": 2, "ts": 5.0, "kind": "state", "message": "completed"}]
    lines = [{"id": 7, "ts": 2.0, "task": "r1", "node": "w2", "line": "step 5"}]
    items = interleave(events, lines)
    assert [i["type"] for i in items] == ["event", "log", "event"]
    assert format_item(items[1]).endswith("[r1 w2] step 5")


def test_output_without_newlines_is_still_bounded(capsys):
    buf = LineBuffer("r0", "w1", limit=4, secrets=[])
    with capture_output(buf):
        for _ in range(10):
            sys.stdout.write("y" * 2500)  # never a newline: each write is a line of its own, cut
    out = buf.drain()
    assert out[0]["line"].startswith("[6 lines dropped") and len(out) == 5
    assert all(len(r["line"]) < 2100 for r in out)
    capsys.readouterr()
