"""Cluster commands: coordinator, workers, watching and controlling jobs, launching training.

    smolforge coordinator start [--host --port --ray-port --state-dir]
    smolforge worker join HOST:PORT --token-file F [--name --models-dir --cpus --gpus --memory-limit]
    smolforge status | nodes | resources | jobs
    smolforge dashboard [--port]   (the embedded cluster's dashboard; a coordinator serves its own)
    smolforge job show|logs|pause|resume|cancel|delete|join|leave ID
    smolforge launch --model M --dataset D --workers N --mode data_parallel|teacher_student|hybrid [--student S ...]
    smolforge submit job.yaml [--set key=value]

Commands that talk to a coordinator find it from --coordinator/--token, then SMOLFORGE_COORDINATOR /
SMOLFORGE_TOKEN, then a coordinator running from the state dir (default $SMOLFORGE_HOME). `launch`
with none of those runs on an embedded cluster of this machine (same scheduler, same workers).
"""

from __future__ import annotations

import time
from typing import TYPE_CHECKING, Optional

import typer

from smolforge.cli import probe
from smolforge.cli.aliases import seed_command
from smolforge.cli.common import TOKEN_FILE_HELP, cli_token, console, print_json, run_cli
from smolforge.cli.follow import finish_job, wait_with_progress
from smolforge.cli.tables import add_row, comm_line, job_line, usage_text, jobs_table, nodes_table, status_tree

if TYPE_CHECKING:
    from smolforge.cluster.face import Backend

COORD_HELP = ("coordinator HOST:PORT or https://HOST:PORT (default: $SMOLFORGE_COORDINATOR or the one running from "
              "--state-dir; https needs $SMOLFORGE_TLS_FINGERPRINT unless it is that one)")
TOKEN_HELP = "cluster token (default: $SMOLFORGE_TOKEN or <state-dir>/token)"
STATE_HELP = "state directory (default: $SMOLFORGE_HOME, ~/.smolforge)"


def _backend(coordinator: str | None, token: str | None, state_dir: str | None, embedded_ok: bool = False) -> Backend:
    """The coordinator's `Client`, else (if allowed) the embedded cluster: `client.backend_for`."""
    from smolforge.client import backend_for

    return backend_for(coordinator, token, state_dir, embedded_ok=embedded_ok)


def finish_resumed(backend, st: dict, json_out: bool) -> None:
    """An embedded job resumed in this command has ended: its adapter goes where the command that
    launched it would have put it (`launch --output-dir`, default outputs/<job>); a job no command
    launched (the Python API) says where the adapter is in the store."""
    out = backend.output_dir_of(st["job_id"])
    finish_job(backend, st, str(out) if out else None, json_out)
    if out is None and st["state"] == "completed" and not json_out:
        where = backend.adapter_path(st["job_id"])
        typer.echo(f"adapter: {where} (in the embedded cluster's store)" if where else "the job kept no adapter")


def register(app: typer.Typer) -> None:
    coordinator_app = typer.Typer(help="Run the coordinator (Ray head + control service).", no_args_is_help=True)
    worker_app = typer.Typer(help="Join this machine to a cluster as a worker.", no_args_is_help=True)
    job_app = typer.Typer(help="Inspect and control one job.", no_args_is_help=True)
    app.add_typer(coordinator_app, name="coordinator")
    app.add_typer(worker_app, name="worker")
    app.add_typer(job_app, name="job")
    _register_nodes(coordinator_app, worker_app)
    probe.register(worker_app)
    _register_overview(app)
    _register_listings(app)
    _register_job_control(job_app)
    _register_job_membership(job_app)
    _register_job_views(job_app)


def _register_nodes(coordinator_app: typer.Typer, worker_app: typer.Typer) -> None:
    """`coordinator start` and `worker join`: the commands that make this machine part of a cluster."""

    @coordinator_app.command("start")
    @run_cli
    def coordinator_start(
        host: str = typer.Option("127.0.0.1", help="address to listen on (0.0.0.0 for the LAN)"),
        port: int = typer.Option(5000, help="API / dashboard port"),
        ray_port: int = typer.Option(6379, help="Ray head (GCS) port"),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        name: str = typer.Option("coordinator", help="this node's name in the cluster"),
        cpus: Optional[int] = typer.Option(None, help="CPUs this node can lend to jobs (`job join`); default: all"),
        models_dir: Optional[str] = typer.Option(None, help="a folder of models this node holds"),
        object_store_mb: Optional[int] = typer.Option(None, help="Ray object store size on this node"),
        tls: bool = typer.Option(False, "--tls", help="serve the API over HTTPS with a self-signed certificate "
                                 "made once into the state dir; the join command carries its fingerprint"),
        tls_cert: Optional[str] = typer.Option(None, help="your own PEM certificate for --tls (with --tls-key)"),
        tls_key: Optional[str] = typer.Option(None, help="the PEM private key of --tls-cert"),
    ):
        """Start the coordinator: a Ray head with token auth, the REST API, /metrics and /dashboard.

        It prints the `smolforge worker join …` command to run on other machines. The coordinator node
        takes no training work unless you lend it to a job (`smolforge job join ID`).

        Example: smolforge coordinator start --host 0.0.0.0 --port 5000 --tls
        """
        from smolforge.cluster.coordinator import Coordinator, CoordinatorOptions
        from smolforge.cluster.face import check_node_name

        check_node_name(name)
        coord = Coordinator(CoordinatorOptions(host=host, port=port, ray_port=ray_port, state_dir=state_dir, name=name,
                                               cpus=cpus, models_dir=models_dir, object_store_mb=object_store_mb,
                                               tls=tls, tls_cert=tls_cert, tls_key=tls_key))
        try:
            coord.setup()
        except BaseException:
            coord.shutdown()
            raise
        coord.serve(announce=lambda text: typer.echo(text, err=False) or __import__("sys").stdout.flush())

    @worker_app.command("join", cls=seed_command("worker join"))
    @run_cli
    def worker_join(
        coordinator: str = typer.Argument(..., help="the coordinator's HOST:PORT, or https://HOST:PORT"),
        token: Optional[str] = typer.Option(None, help="the cluster token ($SMOLFORGE_TOKEN)"),
        token_file: Optional[str] = typer.Option(None, "--token-file", help=TOKEN_FILE_HELP),
        name: Optional[str] = typer.Option(None, help="node name (default: host name)"),
        models_dir: Optional[str] = typer.Option(None, help="a folder of models (each with config.json)"),
        cpus: Optional[int] = typer.Option(None, help="CPUs to lend (default: all)"),
        gpus: Optional[int] = typer.Option(None, help="GPUs to lend (default: all found)"),
        memory: Optional[float] = typer.Option(None, "--memory-limit", "--memory",
                                               help="this node's memory, GB (default: all): placement and the "
                                                    "stage planner count no more, and where cgroup v2 allows it "
                                                    "the kernel caps the worker's processes at it (memory.max)"),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        object_store_mb: Optional[int] = typer.Option(None, help="Ray object store size on this node"),
        no_hf_cache: bool = typer.Option(False, "--no-hf-cache", help="do not advertise models from the HF cache"),
        no_rejoin: bool = typer.Option(False, "--no-rejoin", help="exit when the cluster goes away"),
        tls_fingerprint: Optional[str] = typer.Option(None, help="the coordinator's certificate fingerprint for an "
                                                      "https:// address (printed by `coordinator start --tls`; "
                                                      "default $SMOLFORGE_TLS_FINGERPRINT)"),
    ):
        """Join a cluster: this machine's CPUs, RAM, GPUs and models become available to jobs.

        The token is checked first: a wrong or missing one exits within seconds with
        `coordinator rejected the token`. Stays in the foreground; Ctrl-C leaves the cluster.

        Example: smolforge worker join 192.168.1.10:5000 --token-file ~/smolforge-token --name student-cpu-01 --models-dir ~/models
        """
        import sys

        from smolforge.cluster.face import WorkerNode, WorkerOptions

        node = WorkerNode(WorkerOptions(coordinator=coordinator, token=cli_token(token, token_file), name=name, models_dir=models_dir,
                                        cpus=cpus, gpus=gpus, memory_gb=memory, state_dir=state_dir,
                                        object_store_mb=object_store_mb, rejoin=not no_rejoin,
                                        tls_fingerprint=tls_fingerprint,
                                        scan_hf_cache=not no_hf_cache),
                          announce=lambda text: (typer.echo(text), sys.stdout.flush()))
        code = node.run()
        raise typer.Exit(code)

    @worker_app.command("rescan")
    @run_cli
    def worker_rescan(
        state_dir: Optional[str] = typer.Option(None, help="the state dir the worker was joined with "
                                                "(default $SMOLFORGE_HOME)"),
    ):
        """Ask the worker running on this machine to read its models again (--models-dir, HF cache, Ollama).

        A model copied in after `worker join` is then advertised without a re-join: the worker
        re-registers with the cluster as soon as it runs no task. It also does so on its own every
        $SMOLFORGE_RESCAN_S seconds (30; 0 turns the timer off). Prints the worker's answer.

        Example: smolforge worker rescan --state-dir ~/.smolforge-worker
        """
        from smolforge.cluster.face import request_rescan

        typer.echo(request_rescan(state_dir))


def _register_overview(app: typer.Typer) -> None:
    """`dashboard` and `status`: the cluster at a glance, in a browser or a terminal."""

    @app.command()
    @run_cli
    def dashboard(
        port: int = typer.Option(5050, help="port on 127.0.0.1 (0 picks a free one)"),
        cpus: Optional[int] = typer.Option(None, help="CPUs the embedded cluster may use for jobs resumed here"),
    ):
        """Serve the dashboard (nodes, jobs, curves, pause/resume/cancel) for the embedded cluster.

        For jobs run without a coordinator (`smolforge train|launch|distill` on this machine). Listens on
        127.0.0.1 only and prints the URL to open, with the token in its #fragment. A running coordinator
        serves its own dashboard at http://HOST:PORT/dashboard instead. Ctrl-C stops it.

        Example: smolforge dashboard --port 5050
        """
        from smolforge.cluster.embedded_dashboard import serve

        serve(port, announce=lambda text: (typer.echo(text), __import__("sys").stdout.flush()), num_cpus=cpus)

    @app.command()
    @run_cli
    def status(
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        token_file: Optional[str] = typer.Option(None, "--token-file", help=TOKEN_FILE_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        json_out: bool = typer.Option(False, "--json", help="one JSON object"),
    ):
        """The cluster at a glance: coordinator, workers online, active jobs (progress, ETA), resources.

        Example: smolforge status --coordinator 192.168.1.10:5000 --token-file ~/smolforge-token
        """
        st = _backend(coordinator, cli_token(token, token_file), state_dir).status()
        if json_out:
            print_json(st)
        else:
            console().print(status_tree(st))


def _register_listings(app: typer.Typer) -> None:
    """`nodes`, `resources` and `jobs`: one table (or JSON list) each."""

    @app.command()
    @run_cli
    def nodes(
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        token_file: Optional[str] = typer.Option(None, "--token-file", help=TOKEN_FILE_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        json_out: bool = typer.Option(False, "--json", help="a JSON list"),
    ):
        """Every node: role, state (online/stale/dead), CPUs, RAM, GPUs, live usage and models.

        Example: smolforge nodes
        """
        data = _backend(coordinator, cli_token(token, token_file), state_dir).list_nodes()
        if json_out:
            print_json(data)
        else:
            console().print(nodes_table(data))

    @app.command()
    @run_cli
    def resources(
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        token_file: Optional[str] = typer.Option(None, "--token-file", help=TOKEN_FILE_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        json_out: bool = typer.Option(False, "--json", help="a JSON list"),
    ):
        """Total and free resources per node (CPU, GPU, memory, models) and live usage.

        Example: smolforge resources
        """
        data = _backend(coordinator, cli_token(token, token_file), state_dir).resources()
        if json_out:
            print_json(data)
            return
        from rich.table import Table

        t = Table(title="resources")
        for col in ("node", "role", "state", "CPU free/total", "GPU free/total", "memory free/total", "usage"):
            t.add_column(col)
        for r in data:
            tot, av = r["total"] or {}, r["available"] or {}
            add_row(t, r["name"], r["role"], r["state"], f"{av.get('CPU', 0):g}/{tot.get('CPU', 0):g}",
                      f"{av.get('GPU', 0):g}/{tot.get('GPU', 0):g}",
                      f"{av.get('memory', 0) / 1e9:.1f}/{tot.get('memory', 0) / 1e9:.1f} GB", usage_text(r))
        console().print(t)

    @app.command()
    @run_cli
    def jobs(
        state: Optional[str] = typer.Option(None, help="only these states, e.g. running,paused"),
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        token_file: Optional[str] = typer.Option(None, "--token-file", help=TOKEN_FILE_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        json_out: bool = typer.Option(False, "--json", help="a JSON list"),
    ):
        """Jobs with state, progress, samples, loss, ETA and their workers.

        Example: smolforge jobs --state running
        """
        data = _backend(coordinator, cli_token(token, token_file), state_dir, embedded_ok=True).list_jobs(state)
        if json_out:
            print_json(data)
        else:
            console().print(jobs_table(data))


def _register_job_control(job_app: typer.Typer) -> None:
    """`job pause|resume|cancel|delete`: the commands that change a job's course (or end its record)."""

    def _job_cmd(action: str, doc: str):
        @run_cli
        def cmd(
            job_id: str = typer.Argument(..., help="job id (or a unique prefix, or its name)"),
            coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
            token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
            token_file: Optional[str] = typer.Option(None, "--token-file", help=TOKEN_FILE_HELP),
            state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
            json_out: bool = typer.Option(False, "--json", help="print the job status as JSON"),
        ):
            backend = _backend(coordinator, cli_token(token, token_file), state_dir, embedded_ok=True)
            try:
                st = {"pause": backend.pause_job, "resume": backend.resume_job, "cancel": backend.cancel_job,
                      "delete": backend.delete_job}[action](job_id)
                if action == "resume" and backend.runs_in_process:  # the job runs in this command: follow it
                    finish_resumed(backend, wait_with_progress(backend, st["job_id"], quiet=json_out), json_out)
                    return
            finally:
                backend.close()
            if json_out:
                print_json(st)
            elif st.get("deleted"):
                typer.echo(f"job {st['job_id']}: deleted")
            else:
                typer.echo(f"job {st['job_id']}: {st['state']}" + (f" ({st['error']})" if st.get("error") else ""))

        cmd.__doc__ = doc
        cmd.__name__ = f"job_{action}"
        return cmd

    job_app.command("pause")(_job_cmd("pause", "Pause a job: rank 0 checkpoints, then every worker is released.\n\n"
                                                "Example: smolforge job pause job-1a2b3c"))
    job_app.command("resume")(_job_cmd("resume", "Resume a paused (or interrupted) job from its last checkpoint.\n\n"
                                                  "Without a coordinator the job runs in this command, which "
                                                  "follows it to its end (progress, ETA).\n\n"
                                                  "Example: smolforge job resume job-1a2b3c"))
    job_app.command("cancel")(_job_cmd("cancel", "Cancel a job: its workers are stopped and released at once.\n\n"
                                                  "Example: smolforge job cancel job-1a2b3c"))
    job_app.command("delete")(_job_cmd("delete", "Delete a finished job (or one listed as damaged) with its artifacts; "
                                                  "a running or paused job is refused: cancel it first.\n\n"
                                                  "Example: smolforge job delete job-1a2b3c"))


def _register_job_membership(job_app: typer.Typer) -> None:
    """`job join|leave`: a node lent to a running data-parallel job, and given back."""

    @job_app.command("join")
    @run_cli
    def job_join(
        job_id: str = typer.Argument(..., help="a running data-parallel job"),
        node: Optional[str] = typer.Option(None, help="a worker node to add (default: lend the coordinator node)"),
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        token_file: Optional[str] = typer.Option(None, "--token-file", help=TOKEN_FILE_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        json_out: bool = typer.Option(False, "--json"),
    ):
        """Lend the coordinator node (or --node) to a running data-parallel job at its next checkpoint.

        The group stops at that checkpoint and re-forms with one more rank; the global batch stays the same.

        A job still being placed takes the node in its first group.

        A job that finishes before its next checkpoint ends without it (`join_dropped` in `job logs`).

        Example: smolforge job join job-1a2b3c
        """
        st = _backend(coordinator, cli_token(token, token_file), state_dir, embedded_ok=True).join_job(job_id, node)
        if json_out:
            print_json(st)
        else:
            typer.echo(f"job {st['job_id']}: {node or 'the coordinator'} joins at the next checkpoint")

    @job_app.command("leave")
    @run_cli
    def job_leave(
        job_id: str = typer.Argument(..., help="a running data-parallel job"),
        node: Optional[str] = typer.Option(None, help="a worker node lent with `job join --node` (default: the "
                                                      "coordinator node)"),
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        token_file: Optional[str] = typer.Option(None, "--token-file", help=TOKEN_FILE_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        json_out: bool = typer.Option(False, "--json", help="print the job status as JSON"),
    ):
        """Give back the coordinator node (or --node), lent with `job join`, at the job's next boundary.

        A ddp, zero1, fsdp or pipeline group stops at its next checkpoint (the next step without checkpoints) and re-forms without the node from there.

        A diloco group, or a parameter server's workers, let the node's members go at their next outer step (or step), as they do a lost member, and go on without a restart.

        The global batch stays the same and the job goes on to its end; `member_left` in `job logs` says where the node left.

        Only a node lent to the job can leave, and never the job's last member: pause or cancel the job instead.

        Example: smolforge job leave job-1a2b3c --node w3
        """
        st = _backend(coordinator, cli_token(token, token_file), state_dir, embedded_ok=True).leave_job(job_id, node)
        if json_out:
            print_json(st)
        else:
            typer.echo(f"job {st['job_id']}: {node or 'the coordinator'} leaves at the job's next boundary "
                       f"(`smolforge job logs {st['job_id']}` says when)")


def _register_job_views(job_app: typer.Typer) -> None:
    """`job show` and `job logs`: what one job is doing and has said."""

    @job_app.command("show")
    @run_cli
    def job_show(
        job_id: str = typer.Argument(..., help="job id (or a unique prefix, or its name)"),
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        token_file: Optional[str] = typer.Option(None, "--token-file", help=TOKEN_FILE_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        json_out: bool = typer.Option(False, "--json"),
    ):
        """A job's state, progress, workers, tasks, recent events and artifacts.

        Example: smolforge job show job-1a2b3c
        """
        backend = _backend(coordinator, cli_token(token, token_file), state_dir, embedded_ok=True)
        job = backend.get_job(job_id)
        arts = backend.list_artifacts(job["id"])
        if json_out:
            print_json({**job, "artifacts": arts})
            return
        con = console()
        con.print(job_line(job))
        con.print(f"workers: {', '.join(job.get('nodes') or []) or '–'} · failures survived: {job.get('attempts') or 0}")
        if job.get("error"):
            con.print(f"error: {job['error']}")
        if job.get("comm"):
            con.print(comm_line(job["comm"]), markup=False)
        from smolforge.cluster.control.jobview import memory_lines

        for line in memory_lines(job):  # peak RSS per rank or stage
            con.print(line, markup=False)
        from rich.table import Table

        t = Table(title="tasks")
        for col in ("task", "kind", "rank", "state", "node", "pid", "error"):
            t.add_column(col)
        for task in job.get("tasks", []):
            add_row(t, task["id"], task["kind"], "" if task["rank"] is None else str(task["rank"]), task["state"],
                      task.get("node_name") or "", str(task.get("pid") or ""), (task.get("error") or "")[:80])
        con.print(t)
        for line in backend.job_logs(job["id"])[-10:]:
            con.print(line, markup=False)
        for a in arts:
            con.print(f"artifact {a['kind']}/{a['name']}: {len(a['files'])} files, {a['bytes']:,} bytes")

    @job_app.command("logs")
    @run_cli
    def job_logs(
        job_id: str = typer.Argument(..., help="job id (or a unique prefix, or its name)"),
        follow: bool = typer.Option(False, "--follow", "-f", help="keep printing until the job ends"),
        task: Optional[str] = typer.Option(None, "--task", help="only this task's lines: r0, r1 (data-parallel "
                                           "ranks), teacher0, student1, stage0, ps"),
        json_out: bool = typer.Option(False, "--json", help="one JSON object per line: type event or log"),
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        token_file: Optional[str] = typer.Option(None, "--token-file", help=TOKEN_FILE_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
    ):
        """The job's log: its events (state changes, placement, checkpoints, failures) and what its
        tasks printed, interleaved by time; a task's line starts with its task, node and level, as
        `smolforge logs` prints it: \\[r1 w2 ERROR]. With --json each line's object carries its `level` too.

        Example: smolforge job logs job-1a2b3c --follow --task r1
        """
        import json

        from smolforge.cluster.control.jobview import format_item, interleave

        backend = _backend(coordinator, cli_token(token, token_file), state_dir, embedded_ok=True)
        since_event = since_line = 0
        while True:
            # the state before the reads: a job that was final then has written all it will write
            final = follow and backend.get_job_status(job_id)["state"] in ("completed", "failed", "cancelled", "paused")
            events = [] if task else backend.job_events(job_id, since_event)
            lines = backend.task_logs(job_id, since_line, task)
            since_event = events[-1]["id"] if events else since_event
            since_line = lines[-1]["id"] if lines else since_line
            for item in interleave(events, lines):
                typer.echo(json.dumps(item, default=str) if json_out else format_item(item))
            if events or lines:
                continue  # a page at a time until nothing is left
            if not follow or final:
                return
            time.sleep(1)
