"""How a job reads to a person or a script: the compact status and one event line."""

from __future__ import annotations

import time
from typing import Any

_FINAL = ("completed", "failed", "cancelled")
_ENDED = _FINAL + ("paused",)  # a job that runs no more (paused: until resumed)


def job_status(job: dict) -> dict:
    """The compact status the seeds' monitor callbacks expect."""
    return {
        "job_id": job["id"], "name": job.get("name"), "kind": job.get("kind"), "state": job["state"],
        "progress": job.get("progress", 0.0),
        "step": job.get("step"), "max_steps": job.get("max_steps"), "samples_done": job.get("samples_done"),
        "samples_total": job.get("samples_total"), "eta_s": job.get("eta_s"), "loss": job.get("loss"),
        "node": ", ".join(job.get("nodes") or []) or None, "nodes": job.get("nodes") or [],
        "world_size": job.get("world_size"), "attempts": job.get("attempts"), "error": job.get("error"),
        "result": job.get("result"), "comm": job.get("comm"),
        "priority": (job.get("spec") or {}).get("priority", "normal"), "pending_reason": job.get("pending_reason"),
        **({"damaged": job["damaged"]} if job.get("damaged") else {}),  # a stored row that cannot be shown whole
    }


def job_task_status(job: dict[str, Any], row_id: str) -> dict[str, Any]:
    """One task of a job as the seeds' callbacks read it: the job's status, with the task's state, node
    and error from its row (a task not started yet is pending; a completed job's tasks all completed)."""
    row = next((t for t in job.get("tasks", []) if t["id"] == row_id), None)
    state, job_state = job["state"], job["state"]
    if job_state != "completed" and row is not None:
        if row["state"] in _FINAL:
            state = row["state"]
        elif job_state not in _ENDED:
            state = "running" if row["state"] == "running" else "pending"
    elif job_state != "completed" and job_state not in _ENDED:
        state = "pending"
    node = (row or {}).get("node_name")
    return {**job, "task_id": row_id, "job_state": job_state, "state": state,
            "progress": 1.0 if state == "completed" else job.get("progress") or 0.0,
            "node": node or job.get("node"), "nodes": [node] if node else job.get("nodes", []),
            "error": (row or {}).get("error") or job.get("error")}


def memory_lines(job: dict) -> list[str]:
    """Peak RSS per rank (a data-parallel job's result) or per stage (a serve job's), with where it ran
    and, for a stage, its node's memory limit: what `job show` prints under the job's line."""
    res = job.get("result") or {}
    if res.get("stages"):
        return ["peak RSS: " + ", ".join(
            f"stage {s['stage']} {_mb(s.get('peak_rss_mb'))} on {s.get('node') or '?'}"
            + (f" (limit {_mb(s['memory_limit_mb'])})" if s.get("memory_limit_mb") else "") for s in res["stages"])]
    peaks = res.get("peak_rss_mb_per_rank") or []
    if not any(p is not None for p in peaks):
        return []
    nodes = res.get("nodes") or []
    return ["peak RSS: " + ", ".join(f"rank {r} {_mb(p)}" + (f" on {nodes[r]}" if r < len(nodes) and nodes[r] else "")
                                     for r, p in enumerate(peaks))]


def _mb(value) -> str:
    return "?" if value is None else f"{float(value):.0f} MB"


STAMP = "%m-%d %H:%M:%S"  # a log line's (and an event's) local time, as `smolforge logs` and `job logs` print it


def format_event(e: dict) -> str:
    """One job event: `11-29 12:00:01 [placed] rank 0 on w1`."""
    ts = time.strftime(STAMP, time.localtime(e["ts"]))
    return f"{ts} [{e['kind']}] {e['message']}"


def format_task_line(line: dict) -> str:
    """One line a task printed, prefixed with whose, where and how loud: `11-29 12:00:01 [job-1a2b r1 w2
    ERROR] text`. The one formatter of `smolforge logs` (rows name their job) and `smolforge job logs`
    (one job's rows: no job id); a part the row lacks is left out."""
    ts = time.strftime(STAMP, time.localtime(line["ts"]))
    who = " ".join(str(part) for part in (line.get("job_id"), line.get("task"), line.get("node"), line.get("level"))
                   if part)
    return f"{ts} [{who}] {line['line']}"


def interleave(events: list[dict], lines: list[dict]) -> list[dict]:
    """Events and task lines as one stream ordered by time, each tagged `type` event or log (for --json)."""
    tagged = [{"type": "event", **e} for e in events] + [{"type": "log", **ln} for ln in lines]
    return sorted(tagged, key=lambda item: item["ts"])  # stable: each source keeps its own order on ties


def format_item(item: dict) -> str:
    return format_task_line(item) if item["type"] == "log" else format_event(item)
