"""`smolforge logs`: what every job's tasks printed and logged, searched across jobs and nodes.

SmolCluster's Grafana/Loki view (`{host="w2"}`, `{level="ERROR"}`, `|= "Epoch"`) as one command over the
lines the coordinator keeps (`JobStore.search_logs`, `GET /api/v1/logs`), or the embedded cluster's.
"""

from __future__ import annotations

import json
import time
from typing import TYPE_CHECKING, Any, Optional

import typer

from smolforge.cli.common import TOKEN_FILE_HELP, cli_token, run_cli
from smolforge.errors import SmolforgeError
from smolforge.telemetry.log_levels import parse_level, parse_since

if TYPE_CHECKING:
    from smolforge.cluster.face import Backend

COORD_HELP = "coordinator HOST:PORT (default: $SMOLFORGE_COORDINATOR, or the one running from --state-dir)"
FOLLOW_POLL_S = 1.0


def _backend(coordinator: str | None, token: str | None, state_dir: str | None) -> Backend:
    """The coordinator's `Client`, else this machine's embedded cluster (`client.backend_for`)."""
    from smolforge.client import backend_for

    return backend_for(coordinator, token, state_dir, embedded_ok=True)


def register(app: typer.Typer) -> None:
    @app.command("logs")
    @run_cli
    def logs(
        job: Optional[str] = typer.Option(None, "--job", help="only this job's lines (id, unique prefix or name)"),
        node: Optional[str] = typer.Option(None, "--node", help="only lines from this node, as the cluster names "
                                           "it: w1, w2, coordinator (`smolforge nodes`)"),
        task: Optional[str] = typer.Option(None, "--task", help="only this task's lines: r0, r1, ps, teacher0, stage0"),
        level: Optional[str] = typer.Option(None, "--level", help="this level and above: DEBUG, INFO, WARNING, "
                                            "ERROR, CRITICAL"),
        grep: Optional[str] = typer.Option(None, "--grep", help="only lines containing this text (case-sensitive, "
                                           "like Loki's |=)"),
        regex: bool = typer.Option(False, "--regex", help="--grep is a regular expression, searched in each line"),
        since: Optional[str] = typer.Option(None, "--since", help="only lines from this time on: 30s, 10m, 2h, 1d, "
                                            "or an ISO time (UTC unless it carries an offset)"),
        follow: bool = typer.Option(False, "--follow", "-f", help="keep printing new matching lines (Ctrl-C ends)"),
        json_out: bool = typer.Option(False, "--json", help="one JSON object per line: id, job_id, task, node, ts, "
                                      "level, line"),
        limit: int = typer.Option(200, "--limit", min=1, max=5000, help="the newest this many matching lines"),
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help="cluster token (default: $SMOLFORGE_TOKEN or <state-dir>/token)"),
        token_file: Optional[str] = typer.Option(None, "--token-file", help=TOKEN_FILE_HELP),
        state_dir: Optional[str] = typer.Option(None, help="state directory (default: $SMOLFORGE_HOME, ~/.smolforge)"),
    ):
        """Search what the tasks of every job printed and logged, across jobs and nodes; oldest first,
        each line with its job, task, node and level: \\[job-1a2b r1 w2 ERROR].

        A line's level is its logging record's, else the level word it starts with, else INFO.

        Example: smolforge logs --level ERROR --node w2 --since 2h
        """
        if level is not None:
            parse_level(level, where="--level")  # refused here, before any coordinator is asked
        if since is not None:
            parse_since(since, time.time(), where="--since")
        backend = _backend(coordinator, cli_token(token, token_file), state_dir)
        try:
            _print_lines(backend, dict(job=job, node=node, task=task, level=level, grep=grep, regex=regex, since=since),
                         limit, follow, json_out)
        except SmolforgeError as err:  # the store's (or the API's `query.grep`) name for a filter: this command's flag
            name = (err.where or "").removeprefix("query.")
            if name not in ("grep", "level", "since"):
                raise
            raise SmolforgeError(err.what, where=f"--{name}", fix=err.fix) from None
        finally:
            backend.close()


def _print_lines(backend: Backend, filters: dict[str, Any], limit: int, follow: bool, json_out: bool) -> None:
    """The newest `limit` matching lines; with `follow`, then each new one as it is stored, a page at a time."""
    from smolforge.cluster.control.jobview import format_task_line  # the lines' one formatter, `job logs`' too

    rows = backend.search_logs(**filters, limit=limit)
    after = rows[-1]["id"] if rows else 0  # none yet: every later match is new, from the first line on
    while True:
        for row in rows:
            typer.echo(json.dumps(row, default=str) if json_out else format_task_line(row))
        if not follow:
            return
        if not rows:
            time.sleep(FOLLOW_POLL_S)
        rows = backend.search_logs(**filters, after=after, limit=limit)
        after = rows[-1]["id"] if rows else after
