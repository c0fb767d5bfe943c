"""How a job reads to a person or a script: the compact status and one event line."""

from __future__ import annotations

import time


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
    }


def format_event(e: dict) -> str:
    ts = time.strftime("%H:%M:%S", time.localtime(e["ts"]))
    return f"{ts} [{e['kind']}] {e['message']}"
