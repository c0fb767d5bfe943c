"""Following a job to its end from the terminal: a progress bar with rate and ETA, then the outcome."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable

import typer

from smolforge.cli.common import print_json
from smolforge.errors import SmolforgeError


def wait_with_progress(backend: Any, job_id: str, quiet: bool, poll: float = 1.0) -> dict:
    """Follow a job to its end with a rich bar (samples, rate, ETA); returns the final status."""
    if quiet:
        return backend.wait_for_job(job_id, poll=poll)
    from rich.console import Console
    from rich.progress import (BarColumn, MofNCompleteColumn, Progress, TaskProgressColumn, TextColumn,
                               TimeElapsedColumn, TimeRemainingColumn)

    progress = Progress(TextColumn("[bold]{task.description}"), BarColumn(), MofNCompleteColumn(),
                        TaskProgressColumn(), TextColumn("{task.fields[rate]}"), TimeElapsedColumn(),
                        TextColumn("eta"), TimeRemainingColumn(), TextColumn("{task.fields[info]}"),
                        console=Console(stderr=True), refresh_per_second=4)
    task = progress.add_task(job_id, total=None, rate="", info="starting")
    first = None
    seen: dict = {"id": 0, "line": ""}

    def update(st: dict) -> None:
        nonlocal first
        total = st.get("samples_total") or None
        done = st.get("samples_done") or 0
        if done and first is None:
            first = (time.time(), done)
        rate = ""
        if first and done > first[1]:
            rate = f"{(done - first[1]) / max(1e-6, time.time() - first[0]):.1f} samples/s"
        info = st["state"]
        if st.get("loss") is not None:
            info += f" · loss {st['loss']:.4f}"
        if st.get("nodes"):
            info += f" · {len(st['nodes'])} workers"
        if not done and st["state"] == "running" and model_transfer_line(backend, job_id, seen):
            info += f" · {seen['line']}"
        progress.update(task, total=total, completed=done, rate=rate, info=info)

    with progress:
        final = backend.wait_for_job(job_id, poll=poll, callback=update)
        update(final)
    return final


def model_transfer_line(backend: Any, job_id: str, seen: dict) -> str:
    """The newest `model_transfer` event's message (workers fetching the job's model before its ranks
    start: bytes, pieces, rate), from the events after `seen["id"]`; kept in `seen["line"]`."""
    try:
        events = backend.job_events(job_id, seen["id"])
    except SmolforgeError:
        return seen["line"]  # the coordinator is busy: the bar keeps what it showed
    for e in events:
        seen["id"] = max(seen["id"], int(e["id"]))
        if e["kind"] == "model_transfer":
            seen["line"] = e["message"]
    return seen["line"]


HEADLINE = ("strategy", "workers", "steps", "samples", "final_loss", "eval_loss", "comm_bytes_sent_per_rank",
            "peak_rss_mb_per_rank", "optimizer_state_bytes_per_rank", "seconds", "rounds", "comm_wait_s_per_rank",
            "batch_rows_per_rank")


def finish_job(backend: Any, st: dict, output_dir: str | None, json_out: bool,
               after: Callable[[Path], dict] | None = None, held_out: str | None = None) -> None:
    """Download the finished job's adapter and report; `after(adapter_dir)` (launch --export) runs on
    the downloaded adapter and its result is reported as `export`. HELD_OUT (the held-out file as the
    user named it: `--eval-data`, a dataset's eval split; a coordinator's spec holds only its upload) is
    named beside the eval: `eval_data` in the JSON, "over FILE" in the eval line."""
    job_id = st["job_id"]
    adapter = extra = None
    if st["state"] == "completed" and output_dir:
        adapter = backend.download_adapter(job_id, output_dir)
        if after is not None:
            extra = after(Path(adapter))
    if json_out:
        res = st.get("result") or {}
        headline = {k: res[k] for k in HEADLINE if k in res}  # what scripts and benchmarks read first
        print_json({**headline, **st, "adapter_dir": str(adapter) if adapter else None,
                    **({"eval_data": held_out} if held_out else {}), **({"export": extra} if extra else {})})
        if st["state"] == "failed":
            raise typer.Exit(1)
        return
    typer.echo(f"job {job_id}: {st['state']}" + (f" ({st['error']})" if st.get("error") else ""))
    res = st.get("result") or {}
    if res.get("eval"):
        typer.echo(eval_line(res["eval"], held_out))
    if adapter:
        typer.echo(f"adapter: {adapter}")
    if extra:
        from smolforge.cli.export import show

        show(extra, False)
    if st["state"] == "failed":
        raise typer.Exit(1)


def eval_line(scores: dict[str, Any], held_out: str | None) -> str:
    """'eval: eval_loss 2.1043, accuracy 0.2000 over FILE (5 examples)': a job result's eval SCORES
    (floats; `examples`, the count of held-out examples scored, an int) and the held-out file they are over."""
    line = "eval: " + ", ".join(f"{k} {v:.4f}" for k, v in scores.items() if k != "examples")
    if held_out:
        line += f" over {held_out}"
    if scores.get("examples") is not None:
        line += f" ({scores['examples']} examples)"
    return line


def refuse_used_download_dir(output_dir: str | None) -> None:
    """Before a job is submitted: an --output-dir that already holds an adapter would refuse the
    final download (after all the work); say so now, when nothing has started."""
    if not output_dir:
        return
    used = sorted(p.name for p in Path(output_dir).glob("*_adapter") if p.is_dir() and any(p.iterdir()))
    if used:
        raise SmolforgeError(f"--output-dir already holds {', '.join(used)} from an earlier run", where=output_dir,
                             fix="pick another --output-dir, or move that away (nothing was submitted)")
