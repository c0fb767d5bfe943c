"""Logs across jobs and nodes (issue 46 item 5): the level rule, the store's search, an old store's
migration, the API route and `smolforge logs` on a store. No Ray: the cluster's own run (a rank on w2
writing an ERROR line) is in tests/cluster/test_task_logs.py."""

from __future__ import annotations

import json
import logging
import sqlite3

import pytest

from smolforge.cluster.control.jobstore import JobStore
from smolforge.errors import SmolforgeError
from smolforge.telemetry.log_levels import level_name, line_level, parse_level, parse_since
from smolforge.telemetry.tasklog import TASK_LOGGER, LineBuffer, capture_output

NOW = 1_800_000_000.0


@pytest.mark.parametrize("line, level", [
    ("ERROR smolforge.task: rank 1 failed", "ERROR"),  # the tee's own format
    ("WARNING:root:disk almost full", "WARNING"),  # logging.basicConfig's
    ("2026-11-29 12:00:01,234 - trainer - CRITICAL - out of memory", "CRITICAL"),
    ("[2026-11-29 12:00:01] [DEBUG] batch 3", "DEBUG"),
    ("12:00:01 ERROR something broke", "ERROR"),
    ("ts=1 level=warn msg=slow", "WARNING"),  # logfmt
    ("E1129 12:00:01.123 42 store.cpp:10] connection refused", "ERROR"),  # glog (torch's C++ side)
    ("/x/y.py:12: UserWarning: TypedStorage is deprecated", "WARNING"),  # warnings.warn on stderr
    ("step 4/4: loss 2.31", "INFO"),
    ("the ERROR rate fell to 2 ERRORS", "INFO"),  # a level word in prose says nothing
    ("2 ERROR lines", "INFO"),
    ("Traceback (most recent call last):", "INFO"),  # no level word: stderr alone does not raise it
    ("100%|██████████| 8/8 [00:01<00:00]", "INFO"),
])
def test_a_line_says_its_level_or_is_info(line, level):
    assert line_level(line) == level


def test_level_and_since_words_and_their_refusals():
    assert [parse_level(w) for w in ("error", "WARN", "critical", "fatal", "10")] == [40, 30, 50, 50, 10]
    assert level_name(25) == "INFO" and level_name(5) == "DEBUG" and level_name(60) == "CRITICAL"
    assert parse_since("10m", NOW) == NOW - 600 and parse_since("2h", NOW) == NOW - 7200
    assert parse_since("1970-01-01T00:01:00", NOW) == 60.0 and parse_since("1970-01-01T01:00:00+01:00", NOW) == 0.0
    for bad, parse in (("LOUD", parse_level), ("ten minutes", lambda t: parse_since(t, NOW))):
        with pytest.raises(SmolforgeError) as err:
            parse(bad)
        assert err.value.where in ("level", "since") and err.value.fix


def test_the_tee_ships_each_lines_level():
    """A logging record's level goes with every line of it (its traceback too); a print's is what it says."""
    buf = LineBuffer("r1", "w2", secrets=[])
    with capture_output(buf):
        print("step 1: loss 2.0")
        print("WARNING: low memory")
        try:
            raise ValueError("boom")
        except ValueError:
            logging.getLogger(TASK_LOGGER).exception("rank 1 failed")
    got = [(r["level"], r["line"]) for r in buf.drain()]
    assert got[:3] == [("INFO", "step 1: loss 2.0"), ("WARNING", "WARNING: low memory"),
                       ("ERROR", "ERROR smolforge.task: rank 1 failed")]
    assert got[3:] and all(level == "ERROR" for level, _ in got[3:]) and got[-1][1] == "ValueError: boom"


@pytest.fixture
def store(tmp_path):
    """Two jobs on three nodes, the rows as the tee ships them (levels given, or left to the line)."""
    s = JobStore(tmp_path / "jobs.db")
    for job in ("job-aaa", "job-bbb"):
        s.create_job("data_parallel", {}, job_id=job)
    s.add_logs("job-aaa", [
        {"task": "r0", "node": "w1", "ts": NOW - 7200, "level": "INFO", "line": "a: old step"},
        {"task": "r1", "node": "w2", "ts": NOW - 30, "level": "ERROR", "line": "ERROR smolforge.task: a broke"},
        {"task": "r0", "node": "w1", "ts": NOW - 20, "line": "ERROR:root:a on w1"},  # level from the line
        {"task": "r1", "node": "w2", "ts": NOW - 10, "line": "a: Epoch 2 done"}])
    s.add_logs("job-bbb", [
        {"task": "r1", "node": "w2", "ts": NOW - 5, "level": "CRITICAL", "line": "b: Epoch 1 died"},
        {"task": "ps", "node": "coordinator", "ts": NOW - 4, "level": "WARNING", "line": "b: slow epoch"},
        {"task": "r1", "node": "w2", "ts": NOW - 3, "level": "DEBUG", "line": "b: epoch detail"}])
    return s


def lines(rows):
    return [r["line"] for r in rows]


def test_search_across_jobs_by_node_level_text_and_time(store):
    assert lines(store.search_logs(node="w2", level="ERROR")) == ["ERROR smolforge.task: a broke", "b: Epoch 1 died"]
    assert {r["job_id"] for r in store.search_logs(node="w2", level="error")} == {"job-aaa", "job-bbb"}
    assert lines(store.search_logs(level="WARNING", job="job-b")) == ["b: Epoch 1 died", "b: slow epoch"]  # prefix
    assert lines(store.search_logs(grep="Epoch")) == ["a: Epoch 2 done", "b: Epoch 1 died"]  # case-sensitive
    assert lines(store.search_logs(grep="[Ee]poch \\d d", regex=True)) == ["a: Epoch 2 done", "b: Epoch 1 died"]
    assert lines(store.search_logs(since="1h", now=NOW, task="r0")) == ["ERROR:root:a on w1"]
    row = store.search_logs(node="coordinator")[0]
    assert row["level"] == "WARNING" and row["task"] == "ps" and row["ts"] == NOW - 4


def test_search_pages_newest_first_then_follows_by_id(store):
    newest = store.search_logs(limit=2)
    assert lines(newest) == ["b: slow epoch", "b: epoch detail"]  # the newest two, oldest first
    first = store.search_logs(since_id=0, limit=3)
    assert lines(first) == ["a: old step", "ERROR smolforge.task: a broke", "ERROR:root:a on w1"]
    assert lines(store.search_logs(since_id=first[-1]["id"], limit=2)) == ["a: Epoch 2 done", "b: Epoch 1 died"]
    assert len(store.search_logs(limit=10**9)) == 7  # bounded, never an error


def test_search_refuses_what_it_cannot_read(store):
    for kw, where in (({"level": "LOUD"}, "level"), ({"since": "yesterday"}, "since"),
                      ({"grep": "(unclosed", "regex": True}, "grep"),
                      ({"grep": "(?:a{1000}){1001}", "regex": True}, "grep")):  # compiling it unrolls a million
        with pytest.raises(SmolforgeError) as err:
            store.search_logs(**kw)
        assert err.value.where == where, kw
    with pytest.raises(SmolforgeError, match="no job"):
        store.search_logs(job="job-zzz")


def test_an_old_store_opens_with_its_lines_levelled(tmp_path):
    """A store written before lines had a level: the column is added, each old line levelled by its text."""
    path = tmp_path / "old.db"
    db = sqlite3.connect(path)
    db.executescript("CREATE TABLE logs (id INTEGER PRIMARY KEY AUTOINCREMENT, job_id TEXT NOT NULL, "
                     "task TEXT NOT NULL, node TEXT, ts REAL NOT NULL, line TEXT NOT NULL);"
                     "CREATE TABLE jobs (id TEXT PRIMARY KEY, name TEXT NOT NULL, kind TEXT NOT NULL, "
                     "state TEXT NOT NULL, spec TEXT NOT NULL, created REAL NOT NULL, updated REAL NOT NULL);")
    db.executemany("INSERT INTO logs (job_id, task, node, ts, line) VALUES (?,?,?,?,?)",
                   [("job-old", "r0", "w2", 1.0, "ERROR smolforge.task: old failure"), ("job-old", "r0", "w2", 2.0, "ok")])
    db.commit()
    db.close()
    store = JobStore(path)
    assert [(r["level"], r["line"]) for r in store.search_logs(node="w2")] == [
        ("ERROR", "ERROR smolforge.task: old failure"), ("INFO", "ok")]
    plan = " ".join(str(tuple(r)) for r in store._db().execute(
        "EXPLAIN QUERY PLAN SELECT id FROM logs WHERE node = 'w2' ORDER BY id DESC"))
    assert "logs_node" in plan, plan  # the cross-job indexes exist on a migrated store too
    plan = " ".join(str(tuple(r)) for r in store._db().execute(
        "EXPLAIN QUERY PLAN SELECT id FROM logs WHERE level IN (40, 50) ORDER BY id DESC"))
    assert "logs_level" in plan, plan
    JobStore(path)  # opening it again changes nothing


def test_api_route_filters_and_names_a_bad_param(store):
    from fastapi.testclient import TestClient

    from smolforge.cluster.api import create_app

    class Core:
        token, started, info = "tok", NOW, {}

    core = Core()
    core.store = store
    http = TestClient(create_app(core))
    auth = {"Authorization": "Bearer tok"}
    got = http.get("/api/v1/logs", params={"node": "w2", "level": "ERROR"}, headers=auth)
    assert got.status_code == 200 and lines(got.json()) == ["ERROR smolforge.task: a broke", "b: Epoch 1 died"]
    after = got.json()[0]["id"]
    got = http.get("/api/v1/logs", params={"grep": "Epoch", "after": after, "limit": 1}, headers=auth)
    assert lines(got.json()) == ["a: Epoch 2 done"]
    assert http.get("/api/v1/logs", headers={}).status_code == 401
    for params, where in (({"level": "LOUD"}, "query.level"), ({"since": "soon"}, "query.since"),
                          ({"limit": 0}, "query.limit"), ({"node": "w 2"}, "query.node")):
        bad = http.get("/api/v1/logs", params=params, headers=auth)
        assert bad.status_code == 400 and bad.json()["where"] == where, (params, bad.json())
    assert http.get("/api/v1/logs", params={"job": "job-zzz"}, headers=auth).status_code == 404


def test_cli_logs_on_a_store(store, tmp_path, monkeypatch):
    """`smolforge logs` on the embedded cluster's store: the filters, --json, and a bad --level (exit 2)."""
    from typer.testing import CliRunner

    from smolforge.cli import logs as logs_cli
    from smolforge.cli.main import app

    monkeypatch.setattr(logs_cli, "_backend", lambda *a, **k: Facade(store))
    run = CliRunner().invoke(app, ["logs", "--level", "ERROR", "--node", "w2"])
    assert run.exit_code == 0, run.output
    assert [ln.split("] ", 1)[1] for ln in run.output.splitlines()] == ["ERROR smolforge.task: a broke",
                                                                     "b: Epoch 1 died"]
    assert "[job-aaa r1 w2 ERROR]" in run.output.splitlines()[0]
    run = CliRunner().invoke(app, ["logs", "--grep", "slow", "--json"])
    assert [json.loads(ln)["node"] for ln in run.output.splitlines()] == ["coordinator"]
    for flag, value in (("--level", "LOUD"), ("--since", "soon"), ("--grep", "a{99999999}")):
        bad = CliRunner().invoke(app, ["logs", flag, value, "--regex"])
        assert bad.exit_code == 2 and f"error: {flag}: " in bad.output and "fix:" in bad.output, bad.output


def test_cli_follow_prints_each_new_line_once(store, monkeypatch):
    """--follow: the newest lines, then only what came after the last one shown (a line stored between two
    polls is printed once), until Ctrl-C (exit 130)."""
    from typer.testing import CliRunner

    from smolforge.cli import logs as logs_cli
    from smolforge.cli.main import app

    facade, calls = Facade(store), []

    def search(**kw):
        calls.append(kw.get("after"))
        if len(calls) == 2:  # a line arrives between the first and the second poll
            store.add_logs("job-bbb", [{"task": "r1", "node": "w2", "ts": NOW, "line": "ERROR: b again"}])
        if len(calls) == 4:
            raise KeyboardInterrupt
        return Facade.search_logs(facade, **kw)

    monkeypatch.setattr(facade, "search_logs", search)
    monkeypatch.setattr(logs_cli, "_backend", lambda *a, **k: facade)
    monkeypatch.setattr(logs_cli, "FOLLOW_POLL_S", 0.0)
    run = CliRunner().invoke(app, ["logs", "--node", "w2", "--level", "ERROR", "--follow"])
    assert run.exit_code == 130
    assert [ln.split("] ", 1)[1] for ln in run.output.splitlines() if "] " in ln] == [
        "ERROR smolforge.task: a broke", "b: Epoch 1 died", "ERROR: b again"]
    assert calls[0] is None and None not in calls[1:]  # the newest first, then only after the last id shown


def test_job_logs_prints_each_lines_level_as_logs_does(store, monkeypatch):
    """`smolforge job logs JOB` prints a task's line as `smolforge logs` does, by the one formatter
    (`jobview.format_task_line`: the same line, less the job id a one-job view needs not), its level
    included; --json carries each line's `level`."""
    from typer.testing import CliRunner

    from smolforge.cli import cluster as cluster_cli
    from smolforge.cli import logs as logs_cli
    from smolforge.cli.main import app

    monkeypatch.setattr(cluster_cli, "_backend", lambda *a, **k: Facade(store))
    monkeypatch.setattr(logs_cli, "_backend", lambda *a, **k: Facade(store))
    shown = CliRunner().invoke(app, ["job", "logs", "job-aaa"])
    assert shown.exit_code == 0, shown.output
    searched = CliRunner().invoke(app, ["logs", "--job", "job-aaa", "--grep", "broke"]).output.strip()
    broke = [ln for ln in shown.output.splitlines() if "broke" in ln]
    assert broke == [searched.replace("[job-aaa ", "[")] and "[r1 w2 ERROR] ERROR smolforge.task: a broke" in broke[0]
    as_json = CliRunner().invoke(app, ["job", "logs", "job-aaa", "--json"]).output.splitlines()
    assert [(r["task"], r["level"]) for r in map(json.loads, as_json) if r["type"] == "log"] == [
        ("r0", "INFO"), ("r1", "ERROR"), ("r0", "ERROR"), ("r1", "INFO")]


class Facade:
    """The Backend methods `smolforge logs` and `smolforge job logs` call, on a store (as EmbeddedCluster does)."""

    def __init__(self, store: JobStore):
        self.store = store

    def job_events(self, job_id: str, since: int = 0):
        return self.store.events(job_id, since_id=since)

    def task_logs(self, job_id: str, since: int = 0, task: str | None = None):
        return self.store.logs(job_id, since_id=since, task=task)

    def search_logs(self, **kw):
        kw["since_id"] = kw.pop("after", None)
        return self.store.search_logs(**kw)

    def close(self):
        pass
