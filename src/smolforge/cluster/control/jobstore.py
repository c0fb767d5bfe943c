"""The job store: SQLite in WAL mode, so a coordinator restart loses nothing that was submitted.

Tables: jobs, tasks, events, metrics, logs (what the tasks print: see `add_logs`). Every state change of a job goes through `set_state`, which
checks the transition and writes an event in the same transaction, so the event log is the
complete history (pending → running → (paused ↔ running) → completed | failed | cancelled).

One connection per thread (SQLite objects are not shared across threads); WAL lets the API read
while a job runner writes.
"""

from __future__ import annotations

import json
import math
import re
import sqlite3
import threading
import time
import uuid
from contextlib import contextmanager
from pathlib import Path
from typing import Any, Iterator

from smolforge.cluster.control.states import FINAL, STATES, JobState  # noqa: F401  (FINAL: the stores' users)
from smolforge.errors import SmolforgeError
from smolforge.input_rules import escaped, first_problem, shown
from smolforge.paths import private_file
from smolforge.telemetry.log_levels import LEVELS, level_name, line_level, parse_level, parse_since

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    id TEXT PRIMARY KEY,
    name TEXT NOT NULL,
    kind TEXT NOT NULL,
    state TEXT NOT NULL,
    spec TEXT NOT NULL,
    created REAL NOT NULL,
    updated REAL NOT NULL,
    started REAL,
    finished REAL,
    step INTEGER DEFAULT 0,
    max_steps INTEGER DEFAULT 0,
    samples_done INTEGER DEFAULT 0,
    samples_total INTEGER DEFAULT 0,
    loss REAL,
    eta_s REAL,
    world_size INTEGER DEFAULT 0,
    nodes TEXT DEFAULT '[]',
    attempts INTEGER DEFAULT 0,
    error TEXT,
    result TEXT,
    comm TEXT,
    pending_reason TEXT
);
CREATE TABLE IF NOT EXISTS tasks (
    id TEXT PRIMARY KEY,
    job_id TEXT NOT NULL REFERENCES jobs(id),
    kind TEXT NOT NULL,
    rank INTEGER,
    attempt INTEGER DEFAULT 0,
    state TEXT NOT NULL,
    node_id TEXT,
    node_name TEXT,
    pid INTEGER,
    max_retries INTEGER DEFAULT 0,
    requirements TEXT,
    error TEXT,
    created REAL NOT NULL,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS tasks_job ON tasks(job_id);
CREATE TABLE IF NOT EXISTS events (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT,
    task_id TEXT,
    ts REAL NOT NULL,
    kind TEXT NOT NULL,
    message TEXT NOT NULL,
    data TEXT
);
CREATE INDEX IF NOT EXISTS events_job ON events(job_id, id);
CREATE TABLE IF NOT EXISTS metrics (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    step INTEGER NOT NULL,
    ts REAL NOT NULL,
    name TEXT NOT NULL,
    value REAL
);
CREATE INDEX IF NOT EXISTS metrics_job ON metrics(job_id, name, step);
CREATE TABLE IF NOT EXISTS logs (
    id INTEGER PRIMARY KEY AUTOINCREMENT,
    job_id TEXT NOT NULL,
    task TEXT NOT NULL,
    node TEXT,
    ts REAL NOT NULL,
    line TEXT NOT NULL,
    level INTEGER NOT NULL DEFAULT 20
);
CREATE INDEX IF NOT EXISTS logs_job ON logs(job_id, id);
CREATE INDEX IF NOT EXISTS logs_task ON logs(job_id, task, id);
"""

# The newest lines kept per job. About 100 bytes a line, so ~5 MB of SQLite per job at most: enough for
# every rank's output over thousands of steps, small enough that a chatty job cannot fill the
# coordinator's disk. Older lines stay in the nodes' own Ray logs (the tasks tee, see telemetry/tasklog).
MAX_LOG_LINES_PER_JOB = 50_000
MAX_LOG_ROWS = 5000  # the most lines one search answers (`search_logs`); follow with `since_id` for more
# The searches across jobs (`search_logs`): one node's lines newest first, and the rare levels (WARNING and
# above) without reading every INFO line, their node checked in the index (left to itself, SQLite reads
# all of a node's lines through logs_node rather than sort the few that match: 113 ms against 0.2 ms on
# 200k lines). Made after the `level` column exists (`_add_missing_columns`): a store written before it
# has the table without it. No index on ts: SQLite prefers reading ids newest first, whose order is the
# lines' time order as far as a search needs it.
LOG_INDEXES = ("CREATE INDEX IF NOT EXISTS logs_node ON logs(node, id)",
               "CREATE INDEX IF NOT EXISTS logs_level ON logs(level, node, id)")
SPARSE_LEVEL = LEVELS["WARNING"]  # from here up, lines are few: the level index finds them

JOB_PROGRESS_FIELDS = ("step", "max_steps", "samples_done", "samples_total", "loss", "eta_s", "world_size")


def new_job_id() -> str:
    return "job-" + uuid.uuid4().hex[:10]


class JobStore:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        # 0600 before SQLite opens it: its -wal and -shm files take the database file's mode.
        for p in (self.path, self.path.with_name(self.path.name + "-wal"), self.path.with_name(self.path.name + "-shm")):
            if p == self.path or p.exists():
                private_file(p)
        self._local = threading.local()
        self._write_lock = threading.RLock()
        with self._write_lock:
            self._db().executescript(SCHEMA)  # executescript manages its own transaction
            self._add_missing_columns()

    # -- plumbing -------------------------------------------------------------------------------

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = sqlite3.connect(self.path, timeout=30, isolation_level=None, check_same_thread=True)
            db.row_factory = sqlite3.Row
            # bytes that are not UTF-8 (a row written by hand) read as surrogates, which a row is then
            # shown damaged for (`_job_row`), instead of an OperationalError on every listing
            db.text_factory = lambda raw: raw.decode("utf-8", "surrogateescape")
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("PRAGMA synchronous=NORMAL")
            db.execute("PRAGMA foreign_keys=ON")
            self._local.db = db
        return db

    def _add_missing_columns(self) -> None:
        """A store written by an older smolforge lacks newer columns: add them (nothing else changes).
        Log lines stored before lines had a level get the one their text says (`line_level`), once."""
        db = self._db()
        have = {r["name"] for r in db.execute("PRAGMA table_info(jobs)").fetchall()}
        for column in ("comm", "pending_reason"):
            if column not in have:
                db.execute(f"ALTER TABLE jobs ADD COLUMN {column} TEXT")
        db.create_function("line_levelno", 1, lambda line: LEVELS[line_level(line or "")], deterministic=True)
        with self._tx():  # checked again inside: another process may have added it meanwhile
            if "level" not in {r["name"] for r in db.execute("PRAGMA table_info(logs)").fetchall()}:
                db.execute("ALTER TABLE logs ADD COLUMN level INTEGER NOT NULL DEFAULT 20")
                db.execute("UPDATE logs SET level = line_levelno(line)")
        for index in LOG_INDEXES:
            db.execute(index)

    @contextmanager
    def _tx(self) -> Iterator[sqlite3.Connection]:
        db = self._db()
        with self._write_lock:
            db.execute("BEGIN IMMEDIATE")
            try:
                yield db
            except BaseException:
                db.execute("ROLLBACK")
                raise
            db.execute("COMMIT")

    def close(self) -> None:
        db = getattr(self._local, "db", None)
        if db is not None:
            db.close()
            self._local.db = None

    @staticmethod
    def _job_row(row: sqlite3.Row | None) -> dict[str, Any] | None:
        """A job row as the API and the CLI show it; one that cannot be shown (a spec that is not JSON, text
        that is not UTF-8: written before the intake checked it, or by hand) comes back `damaged`."""
        if row is None:
            return None
        d = dict(row)
        try:
            d["spec"] = json.loads(d["spec"])
            d["nodes"] = json.loads(d["nodes"] or "[]")
            d["result"] = json.loads(d["result"]) if d["result"] else None
            d["comm"] = json.loads(d["comm"]) if d.get("comm") else None  # communication per rank (data-parallel)
            d["progress"] = ((d["step"] / d["max_steps"]) if d["max_steps"]
                             else (1.0 if d["state"] == "completed" else 0.0))
        except (ValueError, TypeError, ZeroDivisionError) as err:
            return JobStore._damaged(dict(row), f"a column is not readable ({type(err).__name__})")
        for key in JOB_PROGRESS_FIELDS:  # an infinite loss is a number JSON cannot carry: shown as unknown
            if isinstance(d[key], float) and not math.isfinite(d[key]):
                d[key] = None
        found = first_problem(d, numbers=False)
        return JobStore._damaged(dict(row), f"{found[0]} {found[1]}") if found else d

    @staticmethod
    def _damaged(d: dict[str, Any], why: str) -> dict[str, Any]:
        """A row that cannot be shown as it is: its text columns escaped, its JSON columns dropped, and
        `damaged` saying why. It lists, shows and can be deleted (`smolforge job delete ID`)."""
        out = {k: shown(v, 200) if isinstance(v, str) else v for k, v in d.items()}
        out.update(spec=None, nodes=[], result=None, comm=None, progress=0.0, damaged=shown(why, 300))
        if out["state"] not in STATES:
            out["state"] = "failed"
        return out

    # -- jobs -----------------------------------------------------------------------------------

    def create_job(self, kind: str, spec: dict[str, Any], name: str | None = None, job_id: str | None = None) -> str:
        job_id = job_id or new_job_id()
        now = time.time()
        with self._tx() as db:
            db.execute("INSERT INTO jobs (id, name, kind, state, spec, created, updated, pending_reason) "
                       "VALUES (?,?,?,?,?,?,?,?)", (job_id, name or job_id, kind, "pending", json.dumps(spec), now, now,
                                                    "queued"))
            self._event(db, job_id, None, "submitted", f"job {job_id} submitted ({kind})", {"name": name})
        return job_id

    def get_job(self, job_id: str) -> dict[str, Any]:
        """A job by its exact id, else its exact name, else a unique prefix of its id.

        Two matches are an error that lists them, never "the newest": `job cancel` must not guess.
        """
        db = self._db()
        row = db.execute("SELECT * FROM jobs WHERE id=?", (job_id,)).fetchone()
        if row is not None:
            return self._job_row(row)
        for what, sql in (("name", "SELECT * FROM jobs WHERE name=? ORDER BY created"),
                          ("id prefix", "SELECT * FROM jobs WHERE substr(id, 1, length(?1)) = ?1 ORDER BY created")):
            if what == "id prefix" and (not job_id or not all(c.isalnum() or c == "-" for c in job_id)):
                break  # ids are letters, digits and dashes: anything else matches no id
            rows = db.execute(sql, (job_id,)).fetchall()
            if len(rows) == 1:
                return self._job_row(rows[0])
            if len(rows) > 1:
                ids = ", ".join(r["id"] for r in rows[:6])
                raise SmolforgeError(f"{job_id!r} matches {len(rows)} jobs by {what}: {ids}",
                                     fix="use the full job id (`smolforge jobs` lists them)")
        raise SmolforgeError(f"no job {job_id!r}", fix="list jobs with `smolforge jobs`")

    def list_jobs(self, states: tuple[str, ...] | None = None, limit: int = 200) -> list[dict[str, Any]]:
        if states:
            q = f"SELECT * FROM jobs WHERE state IN ({','.join('?' * len(states))}) ORDER BY created DESC LIMIT ?"
            rows = self._db().execute(q, (*states, limit)).fetchall()
        else:
            rows = self._db().execute("SELECT * FROM jobs ORDER BY created DESC LIMIT ?", (limit,)).fetchall()
        return [self._job_row(r) for r in rows]

    def delete_job(self, job_id: str) -> None:
        """Remove a job and everything stored of it (tasks, events, metrics, log lines). The caller
        decides whether it may go (`JobManager.delete`: finished or damaged, never running)."""
        with self._tx() as db:
            for table in ("tasks", "events", "metrics", "logs"):
                db.execute(f"DELETE FROM {table} WHERE job_id=?", (job_id,))
            if db.execute("DELETE FROM jobs WHERE id=?", (job_id,)).rowcount == 0:
                raise SmolforgeError(f"no job {job_id!r}", fix="list jobs with `smolforge jobs`")

    def set_state(self, job_id: str, state: str, message: str = "", *, error: str | None = None,
                  result: dict | None = None, force: bool = False) -> str:
        """Move a job to `state` (checked against TRANSITIONS); returns the previous state."""
        if state not in STATES:
            raise ValueError(f"unknown state {state}")
        now = time.time()
        with self._tx() as db:
            row = db.execute("SELECT state, started FROM jobs WHERE id=?", (job_id,)).fetchone()
            if row is None:
                raise SmolforgeError(f"no job {job_id!r}", fix="list jobs with `smolforge jobs`")
            prev = row["state"]
            if prev == state:
                return prev
            if JobState(prev).final and force:
                return prev  # a final state stands: a cancelled job never ends as failed (JobState.settle)
            if not JobState(prev).can_become(state) and not force:
                raise SmolforgeError(f"job {job_id} is {prev}; it cannot become {state}",
                                     fix="see its state with `smolforge job show " + job_id + "`")
            sets = ["state=?", "updated=?"]
            args: list[Any] = [state, now]
            if state == "running" and row["started"] is None:
                sets.append("started=?")
                args.append(now)
            if state in FINAL:
                sets.append("finished=?")
                args.append(now)
            sets.append("pending_reason=?")  # why it waits: the queue's to say (JobManager.schedule)
            args.append("queued" if state == "pending" else None)
            if error is not None:
                sets.append("error=?")
                args.append(error)
            if result is not None:
                sets.append("result=?")
                args.append(json.dumps(result, default=str))
            db.execute(f"UPDATE jobs SET {', '.join(sets)} WHERE id=?", (*args, job_id))
            self._event(db, job_id, None, "state", message or f"{prev} → {state}",
                        {"from": prev, "to": state, **({"error": error} if error else {})})
        return prev

    def update_job(self, job_id: str, **fields: Any) -> None:
        allowed = set(JOB_PROGRESS_FIELDS) | {"nodes", "attempts", "error", "result", "spec", "comm", "pending_reason"}
        bad = set(fields) - allowed
        if bad:
            raise ValueError(f"cannot update {bad}")
        if not fields:
            return
        vals = []
        for k, v in fields.items():
            vals.append(json.dumps(v, default=str) if k in ("nodes", "result", "spec", "comm") and v is not None else v)
        with self._tx() as db:
            db.execute(f"UPDATE jobs SET {', '.join(f'{k}=?' for k in fields)}, updated=? WHERE id=?",
                       (*vals, time.time(), job_id))

    # -- tasks ----------------------------------------------------------------------------------

    def upsert_task(self, task_id: str, job_id: str, kind: str, state: str, **fields: Any) -> None:
        now = time.time()
        cols = {"rank", "attempt", "node_id", "node_name", "pid", "max_retries", "requirements", "error"}
        bad = set(fields) - cols
        if bad:
            raise ValueError(f"unknown task fields {bad}")
        if "requirements" in fields and not isinstance(fields["requirements"], (str, type(None))):
            fields["requirements"] = json.dumps(fields["requirements"])
        with self._tx() as db:
            exists = db.execute("SELECT 1 FROM tasks WHERE id=?", (task_id,)).fetchone()
            if exists:
                sets = ", ".join(f"{k}=?" for k in ("state", *fields, "updated"))
                db.execute(f"UPDATE tasks SET {sets} WHERE id=?", (state, *fields.values(), now, task_id))
            else:
                names = ["id", "job_id", "kind", "state", *fields, "created", "updated"]
                db.execute(f"INSERT INTO tasks ({', '.join(names)}) VALUES ({', '.join('?' * len(names))})",
                           (task_id, job_id, kind, state, *fields.values(), now, now))

    def stop_tasks(self, job_id: str, reason: str) -> int:
        """A job's tasks still marked placing or running when what ran them is gone (the embedded
        command was killed): `stopped`, so `job show` does not list dead ranks as running."""
        with self._tx() as db:
            return db.execute("UPDATE tasks SET state='stopped', error=COALESCE(error, ?), updated=? "
                              "WHERE job_id=? AND state IN ('placing', 'running')",
                              (reason, time.time(), job_id)).rowcount

    def busy_nodes(self) -> dict[str, list[str]]:
        """Node name -> the running jobs with a running task there (the queue's reasons name them)."""
        rows = self._db().execute(
            "SELECT DISTINCT t.node_name, t.job_id FROM tasks t JOIN jobs j ON j.id = t.job_id "
            "WHERE t.state = 'running' AND j.state = 'running' AND t.node_name IS NOT NULL").fetchall()
        out: dict[str, list[str]] = {}
        for r in rows:
            out.setdefault(r["node_name"], []).append(r["job_id"])
        return out

    def tasks(self, job_id: str) -> list[dict[str, Any]]:
        rows = self._db().execute("SELECT * FROM tasks WHERE job_id=? ORDER BY created, rank", (job_id,)).fetchall()
        out = []
        for r in rows:
            d = dict(r)
            d["requirements"] = json.loads(d["requirements"]) if d["requirements"] else None
            out.append(d)
        return out

    # -- events and metrics ---------------------------------------------------------------------

    @staticmethod
    def _event(db: sqlite3.Connection, job_id: str | None, task_id: str | None, kind: str, message: str,
               data: dict | None = None, ts: float | None = None) -> None:
        db.execute("INSERT INTO events (job_id, task_id, ts, kind, message, data) VALUES (?,?,?,?,?,?)",
                   (job_id, task_id, ts or time.time(), kind, message, json.dumps(data, default=str) if data else None))

    def add_event(self, job_id: str | None, kind: str, message: str, data: dict | None = None,
                  task_id: str | None = None, ts: float | None = None) -> None:
        with self._tx() as db:
            self._event(db, job_id, task_id, kind, message, data, ts)

    def events(self, job_id: str | None = None, since_id: int = 0, limit: int = 1000,
               kinds: tuple[str, ...] | None = None) -> list[dict[str, Any]]:
        q = "SELECT * FROM events WHERE id > ?"
        args: list[Any] = [since_id]
        if job_id is not None:
            q += " AND job_id=?"
            args.append(job_id)
        if kinds:
            q += f" AND kind IN ({','.join('?' * len(kinds))})"
            args.extend(kinds)
        q += " ORDER BY id LIMIT ?"
        args.append(limit)
        out = []
        for r in self._db().execute(q, args).fetchall():
            d = dict(r)
            try:
                d["data"] = json.loads(d["data"]) if d["data"] else None
            except ValueError:
                d["data"] = None
            out.append(escaped(d))  # an event of a job submitted before the intake checked its text
        return out

    def add_metrics(self, job_id: str, rows: list[tuple[int, str, float]], ts: float | None = None) -> None:
        if not rows:
            return
        now = ts or time.time()
        with self._tx() as db:
            db.executemany("INSERT INTO metrics (job_id, step, ts, name, value) VALUES (?,?,?,?,?)",
                           [(job_id, int(s), now, n, float(v)) for s, n, v in rows])

    def latest_metrics(self, job_id: str) -> dict[str, tuple[int, float]]:
        """Each series' newest row, name -> (step, value): what a Prometheus scrape exports."""
        # SQLite takes a bare column's value from the row that MAX() picked: the newest of each name
        rows = self._db().execute("SELECT name, step, value, MAX(id) FROM metrics WHERE job_id=? GROUP BY name",
                                  (job_id,)).fetchall()
        return {r[0]: (int(r[1]), r[2]) for r in rows if r[2] is not None}

    def add_logs(self, job_id: str, lines: list[dict[str, Any]], keep: int = MAX_LOG_LINES_PER_JOB) -> None:
        """Task output lines (`{"task", "node", "ts", "level", "line"}`), then the job's oldest beyond `keep`
        go. A line without a known `level` (a task of an older smolforge) gets the one its text says."""
        if not lines:
            return
        rows = []
        for r in lines:
            line = str(r["line"])
            level = LEVELS.get(str(r.get("level") or "").upper()) or LEVELS[line_level(line)]
            rows.append((job_id, str(r["task"]), r.get("node"), float(r.get("ts") or time.time()), line, level))
        with self._tx() as db:
            db.executemany("INSERT INTO logs (job_id, task, node, ts, line, level) VALUES (?,?,?,?,?,?)", rows)
            db.execute("DELETE FROM logs WHERE job_id=?1 AND id <= (SELECT id FROM logs WHERE job_id=?1 "
                       "ORDER BY id DESC LIMIT 1 OFFSET ?2)", (job_id, keep))

    def logs(self, job_id: str, since_id: int = 0, task: str | None = None, limit: int = 1000) -> list[dict[str, Any]]:
        """A job's task lines after `since_id`, oldest first (one task's with `task`)."""
        q = "SELECT id, task, node, ts, level, line FROM logs WHERE job_id=? AND id > ?"
        args: list[Any] = [job_id, since_id]
        if task is not None:
            q += " AND task=?"
            args.append(task)
        q += " ORDER BY id LIMIT ?"
        args.append(limit)
        return [self._log_row(r) for r in self._db().execute(q, args).fetchall()]

    def search_logs(self, job: str | None = None, node: str | None = None, task: str | None = None,
                    level: str | None = None, grep: str | None = None, regex: bool = False, since: str | None = None,
                    since_id: int | None = None, limit: int = 1000, now: float | None = None) -> list[dict[str, Any]]:
        """Task lines across jobs (`smolforge logs`, `GET /api/v1/logs`), oldest first, each
        `{"id", "job_id", "task", "node", "ts", "level", "line"}`.

        Filters, all optional and and-ed: `job` (an id, a unique prefix or a name: `get_job`), `node` (as
        the cluster names it: w2, coordinator), `task` (r0, ps, teacher0), `level` (that level and above:
        `ERROR`, `warn`...), `grep` (a substring, case-sensitive like Loki's `|=`; with `regex`, a pattern
        searched in the line), `since` (`10m`, `2h`, an ISO time: `log_levels.parse_since`, against `now`).
        Without `since_id`: the newest `limit` matching lines; with it: the first `limit` after that id
        (follow a search by passing the last id seen). `limit` is bounded to 1..MAX_LOG_ROWS.
        Errors: SmolforgeError naming the filter (`where`: level, since, grep), or an unknown job."""
        where, args = ["1=1"], []
        floor = None if level is None else parse_level(level)
        sparse = floor is not None and floor >= SPARSE_LEVEL  # then the level index leads (`+`: no other index)
        for column, value in (("job_id", self.get_job(job)["id"] if job else None), ("node", node), ("task", task)):
            if value is not None:
                where.append(f"{'+' if sparse else ''}{column} = ?")
                args.append(value)
        if floor is not None:
            if sparse:  # an IN list the level index serves (SQLite reads no index for >=)
                where.append(f"level IN ({', '.join(str(n) for n in LEVELS.values() if n >= floor)})")
            else:  # most lines: read in id order, the level checked on each (`+`: not through the index)
                where.append("+level >= ?")
                args.append(floor)
        if since is not None:
            where.append("ts >= ?")
            args.append(parse_since(since, time.time() if now is None else now))
        if grep is not None and not regex:
            where.append("instr(line, ?) > 0")
            args.append(grep)
        if since_id is not None:
            where.append("id > ?")
            args.append(int(since_id))
        limit = max(1, min(int(limit), MAX_LOG_ROWS))
        order = "ASC" if since_id is not None else "DESC"
        rows = self._db().execute(f"SELECT id, job_id, task, node, ts, level, line FROM logs WHERE "
                                  f"{' AND '.join(where)} ORDER BY id {order}{'' if regex else ' LIMIT ?'}",
                                  args if regex else [*args, limit])
        found = matching_lines(rows, grep if regex else None, limit)
        return [self._log_row(r) for r in (found if since_id is not None else reversed(found))]

    @staticmethod
    def _log_row(row: sqlite3.Row) -> dict[str, Any]:
        d = dict(row)
        d["level"] = level_name(int(d["level"] if d.get("level") is not None else 20))
        return escaped(d)

    def metrics(self, job_id: str, name: str | None = None) -> list[dict[str, Any]]:
        if name:
            rows = self._db().execute("SELECT step, ts, name, value FROM metrics WHERE job_id=? AND name=? ORDER BY step",
                                      (job_id, name)).fetchall()
        else:
            rows = self._db().execute("SELECT step, ts, name, value FROM metrics WHERE job_id=? ORDER BY step, name",
                                      (job_id,)).fetchall()
        return [dict(r) for r in rows]


REGEX_BUDGET_S = 2.0  # a `--regex` search's time on one request: a pattern that backtracks cannot hold a thread
# The library has no time limit on compiling, which unrolls counted repeats (`a{100000000}` never ends,
# `(?:a{1000}){1000}` takes seconds): a pattern is at most this long, its counts' product at most this.
MAX_PATTERN_CHARS, MAX_PATTERN_REPEATS = 200, 1000
_COUNTS = re.compile(r"\{\s*(\d*)\s*(?:,\s*(\d*)\s*)?\}")


def matching_lines(rows: Iterator[sqlite3.Row], pattern: str | None, limit: int) -> list[sqlite3.Row]:
    """The first `limit` rows whose line `pattern` (a regular expression, `regex` library syntax) finds;
    every row, up to `limit`, without one. A pattern that does not compile, or whose search over the rows
    takes past REGEX_BUDGET_S, is a SmolforgeError (`where` grep)."""
    if pattern is None:
        return [row for row, _ in zip(rows, range(limit))]
    import regex as re2  # the library's timeout bounds a pattern that backtracks (Python's re has none)

    repeats = math.prod(max(int(n or 0) for n in counts) or 1 for counts in _COUNTS.findall(pattern))
    if len(pattern) > MAX_PATTERN_CHARS or repeats > MAX_PATTERN_REPEATS:
        raise SmolforgeError(f"the pattern is too large to search with (over {MAX_PATTERN_CHARS} characters, or "
                             f"counted repeats {{n}} multiplying past {MAX_PATTERN_REPEATS})", where="grep",
                             fix="give a shorter pattern with smaller counts (`+`, `*` are not limited), or a plain "
                                 "text without --regex")
    try:
        compiled = re2.compile(pattern)
    except re2.error as err:
        raise SmolforgeError(f"{pattern!r} is not a regular expression ({err})", where="grep",
                             fix="fix the pattern, or search for the plain text without --regex") from None
    deadline, found = time.monotonic() + REGEX_BUDGET_S, []
    try:
        for row in rows:
            if time.monotonic() > deadline:
                raise TimeoutError
            if compiled.search(row["line"], timeout=max(0.001, deadline - time.monotonic())):
                found.append(row)
                if len(found) >= limit:
                    break
    except TimeoutError:
        raise SmolforgeError(f"the pattern {pattern!r} took over {REGEX_BUDGET_S:g} s", where="grep",
                             fix="narrow the search (--job, --node, --since, --level) or give a plain text "
                                 "without --regex") from None
    return found
