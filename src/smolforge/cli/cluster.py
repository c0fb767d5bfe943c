"""Cluster commands: coordinator, workers, watching and controlling jobs, launching training.

    smolforge coordinator start [--host --port --ray-port --state-dir]
    smolforge worker join HOST:PORT --token T [--name --models-dir --cpus --gpus --memory]
    smolforge status | nodes | resources | jobs
    smolforge job show|logs|pause|resume|cancel|join ID
    smolforge launch --model M --dataset D --workers N --mode data_parallel|teacher_student|hybrid [--student S ...]
    smolforge submit job.yaml [--set key=value]

Commands that talk to a coordinator find it from --coordinator/--token, then SMOLFORGE_COORDINATOR /
SMOLFORGE_TOKEN, then a coordinator running from the state dir (default $SMOLFORGE_HOME). `launch`
with none of those runs on an embedded cluster of this machine (same scheduler, same workers).
"""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any, Callable, Optional

import typer

from smolforge.cli.common import print_json, run_cli
from smolforge.errors import SmolforgeError

COORD_HELP = "coordinator HOST:PORT (default: $SMOLFORGE_COORDINATOR or the one running from --state-dir)"
TOKEN_HELP = "cluster token (default: $SMOLFORGE_TOKEN or <state-dir>/token)"
STATE_HELP = "state directory (default: $SMOLFORGE_HOME, ~/.smolforge)"


def _console():
    import sys

    from rich.console import Console

    # Piped output (scripts, tests) gets wide lines instead of an 80-column wrap.
    return Console(highlight=False, width=None if sys.stdout.isatty() else 200)


def _backend(coordinator: str | None, token: str | None, state_dir: str | None, embedded_ok: bool = False):
    from smolforge.client import backend_for

    return backend_for(coordinator, token, state_dir, embedded_ok=embedded_ok)


def _fmt_eta(s: float | None) -> str:
    if s is None:
        return "–"
    s = int(max(0, round(s)))
    h, rem = divmod(s, 3600)
    m, sec = divmod(rem, 60)
    return f"{h}:{m:02d}:{sec:02d}" if h else f"{m}:{sec:02d}"


def _usage(n: dict) -> str:
    u = n.get("usage") or {}
    if u.get("cpu_percent") is None:
        return "–"
    text = f"CPU {u['cpu_percent']:.0f}% · RAM {u.get('ram_percent', 0):.0f}%"
    for g in u.get("gpus") or []:
        text += f" · GPU{g['index']} {g['util_percent']}% {g['mem_used_gb']:.1f}/{g['mem_total_gb']:.0f} GB"
    return text


def _models(n: dict, limit: int = 6) -> str:
    models = n.get("models") or []
    if not models:
        return "–"
    return ", ".join(models[:limit]) + (f" (+{len(models) - limit})" if len(models) > limit else "")


def _job_line(j: dict) -> str:
    pct = 100 * (j.get("progress") or 0)
    text = f"{j['id']} ({j['kind']}) {j['state']} {pct:.0f}%"
    if j.get("samples_total"):
        text += f" · {j['samples_done']}/{j['samples_total']} samples"
    if j.get("max_steps"):
        text += f" · step {j['step']}/{j['max_steps']}"
    if j.get("loss") is not None:
        text += f" · loss {j['loss']:.4f}"
    if j["state"] == "running":
        text += f" · ETA {_fmt_eta(j.get('eta_s'))}"
    return text


def _add_row(table, *cells) -> None:
    """Cells hold user text (node, model and job names): never let rich read them as markup."""
    from rich.markup import escape

    table.add_row(*(escape(str(c)) for c in cells))


def nodes_table(nodes: list[dict]):
    from rich.table import Table

    t = Table(title=f"nodes ({sum(1 for n in nodes if n['state'] == 'online')} online)")
    for col in ("name", "role", "state", "CPUs", "RAM", "GPUs", "usage", "models"):
        t.add_column(col)
    for n in nodes:
        gpus = f"{n['gpus']:g}" + (f" × {n['gpu_type']}" if n.get("gpu_type") and n["gpus"] else "")
        _add_row(t, n["name"], n["role"], n["state"], f"{n['cpus']:g}", f"{n['ram_gb']:.1f} GB", gpus, _usage(n),
                  _models(n, 10))
    return t


def jobs_table(jobs: list[dict]):
    from rich.table import Table

    t = Table(title=f"jobs ({len(jobs)})")
    for col in ("id", "name", "kind", "state", "progress", "samples", "loss", "ETA", "workers"):
        t.add_column(col)
    for j in jobs:
        _add_row(t, j["id"], j["name"] if j["name"] != j["id"] else "", j["kind"], j["state"],
                  f"{100 * (j.get('progress') or 0):.0f}% ({j['step']}/{j['max_steps'] or '?'})",
                  f"{j['samples_done']}/{j['samples_total'] or '?'}",
                  "–" if j.get("loss") is None else f"{j['loss']:.4f}",
                  _fmt_eta(j.get("eta_s")) if j["state"] == "running" else "–", ", ".join(j.get("nodes") or []) or "–")
    return t


def status_tree(st: dict):
    from rich.markup import escape
    from rich.tree import Tree

    c = st["coordinator"]
    nodes = st["nodes"]
    root = Tree(escape(f"Coordinator {c.get('name')} · API {c.get('api')} · Ray {c.get('ray_address')}"
                       + (f" · up {_fmt_eta(c.get('uptime_s'))}" if c.get("uptime_s") is not None else "")))
    workers = [n for n in nodes if n["role"] == "worker"]
    online = [n for n in workers if n["state"] == "online"]
    wt = root.add(f"Workers online: {len(online)}/{len([w for w in workers if w['state'] != 'dead'])}")
    for n in workers:
        if n["state"] == "dead":
            continue
        wt.add(escape(f"{n['name']} [{n['state']}]: {n['cpus']:g} CPUs, {n['ram_gb']:.1f} GB RAM, {n['gpus']:g} GPUs; "
                      f"{len(n.get('models') or [])} models · {_usage(n)}"))
    jobs = st["jobs"]
    jt = root.add(f"Active jobs: {len(jobs)}")
    for j in jobs:
        node = jt.add(escape(_job_line(j)))
        if j.get("nodes"):
            node.add(escape("workers: " + ", ".join(j["nodes"])))
    rt = root.add("Resources")
    for n in nodes:
        if n["state"] == "dead":
            continue
        tot, av = n.get("resources") or {}, n.get("available") or {}
        line = f"{n['name']}: CPU {av.get('CPU', 0):g}/{tot.get('CPU', 0):g} free"
        if tot.get("GPU"):
            line += f", GPU {av.get('GPU', 0):g}/{tot.get('GPU', 0):g} free"
        if tot.get("memory"):
            line += f", memory {av.get('memory', 0) / 1e9:.1f}/{tot.get('memory', 0) / 1e9:.1f} GB"
        rt.add(escape(line + (" (takes no training work)" if n["role"] == "coordinator" else "")))
    return root


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
    t0, first = time.time(), None

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
        progress.update(task, total=total, completed=done, rate=rate, info=info)

    with progress:
        final = backend.wait_for_job(job_id, poll=poll, callback=update)
        update(final)
    return final


def finish_job(backend: Any, st: dict, output_dir: str | None, json_out: bool) -> None:
    job_id = st["job_id"]
    adapter = None
    if st["state"] == "completed" and output_dir:
        adapter = backend.download_adapter(job_id, output_dir)
    if json_out:
        print_json({**st, "adapter_dir": str(adapter) if adapter else None})
        if st["state"] == "failed":
            raise typer.Exit(1)
        return
    typer.echo(f"job {job_id}: {st['state']}" + (f" ({st['error']})" if st.get("error") else ""))
    res = st.get("result") or {}
    if res.get("eval"):
        typer.echo("eval: " + ", ".join(f"{k} {v:.4f}" for k, v in res["eval"].items()))
    if adapter:
        typer.echo(f"adapter: {adapter}")
    if st["state"] == "failed":
        raise typer.Exit(1)


def register(app: typer.Typer) -> None:
    coordinator_app = typer.Typer(help="Run the coordinator (Ray head + control service).", no_args_is_help=True)
    worker_app = typer.Typer(help="Join this machine to a cluster as a worker.", no_args_is_help=True)
    job_app = typer.Typer(help="Inspect and control one job.", no_args_is_help=True)
    app.add_typer(coordinator_app, name="coordinator")
    app.add_typer(worker_app, name="worker")
    app.add_typer(job_app, name="job")

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
    ):
        """Start the coordinator: a Ray head with token auth, the REST API, /metrics and /dashboard.

        It prints the `smolforge worker join …` command to run on other machines. The coordinator node
        takes no training work unless you lend it to a job (`smolforge job join ID`).

        Example: smolforge coordinator start --host 0.0.0.0 --port 5000
        """
        from smolforge.cluster.coordinator import Coordinator, CoordinatorOptions
        from smolforge.cluster.discovery import check_node_name

        check_node_name(name)
        coord = Coordinator(CoordinatorOptions(host=host, port=port, ray_port=ray_port, state_dir=state_dir, name=name,
                                               cpus=cpus, models_dir=models_dir, object_store_mb=object_store_mb))
        try:
            coord.setup()
        except BaseException:
            coord.shutdown()
            raise
        coord.serve(announce=lambda text: typer.echo(text, err=False) or __import__("sys").stdout.flush())

    @worker_app.command("join")
    @run_cli
    def worker_join(
        coordinator: str = typer.Argument(..., help="the coordinator's HOST:PORT"),
        token: Optional[str] = typer.Option(None, help="the cluster token ($SMOLFORGE_TOKEN)"),
        name: Optional[str] = typer.Option(None, help="node name (default: host name)"),
        models_dir: Optional[str] = typer.Option(None, help="a folder of models (each with config.json)"),
        cpus: Optional[int] = typer.Option(None, help="CPUs to lend (default: all)"),
        gpus: Optional[int] = typer.Option(None, help="GPUs to lend (default: all found)"),
        memory: Optional[float] = typer.Option(None, help="RAM to advertise, GB (default: all)"),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        object_store_mb: Optional[int] = typer.Option(None, help="Ray object store size on this node"),
        no_hf_cache: bool = typer.Option(False, "--no-hf-cache", help="do not advertise models from the HF cache"),
        no_rejoin: bool = typer.Option(False, "--no-rejoin", help="exit when the cluster goes away"),
    ):
        """Join a cluster: this machine's CPUs, RAM, GPUs and models become available to jobs.

        The token is checked first: a wrong or missing one exits within seconds with
        `coordinator rejected the token`. Stays in the foreground; Ctrl-C leaves the cluster.

        Example: smolforge worker join 192.168.1.10:5000 --token T --name student-cpu-01 --models-dir ~/models
        """
        import sys

        from smolforge.cluster.worker import WorkerNode, WorkerOptions

        node = WorkerNode(WorkerOptions(coordinator=coordinator, token=token, name=name, models_dir=models_dir,
                                        cpus=cpus, gpus=gpus, memory_gb=memory, state_dir=state_dir,
                                        object_store_mb=object_store_mb, rejoin=not no_rejoin,
                                        scan_hf_cache=not no_hf_cache),
                          announce=lambda text: (typer.echo(text), sys.stdout.flush()))
        code = node.run()
        raise typer.Exit(code)

    @app.command()
    @run_cli
    def status(
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        json_out: bool = typer.Option(False, "--json", help="one JSON object"),
    ):
        """The cluster at a glance: coordinator, workers online, active jobs (progress, ETA), resources.

        Example: smolforge status --coordinator 192.168.1.10:5000 --token T
        """
        st = _backend(coordinator, token, state_dir).status()
        if json_out:
            print_json(st)
        else:
            _console().print(status_tree(st))

    @app.command()
    @run_cli
    def nodes(
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        json_out: bool = typer.Option(False, "--json", help="a JSON list"),
    ):
        """Every node: role, state (online/stale/dead), CPUs, RAM, GPUs, live usage and models.

        Example: smolforge nodes
        """
        data = _backend(coordinator, token, state_dir).list_nodes()
        if json_out:
            print_json(data)
        else:
            _console().print(nodes_table(data))

    @app.command()
    @run_cli
    def resources(
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        json_out: bool = typer.Option(False, "--json", help="a JSON list"),
    ):
        """Total and free resources per node (CPU, GPU, memory, models) and live usage.

        Example: smolforge resources
        """
        data = _backend(coordinator, token, state_dir).resources()
        if json_out:
            print_json(data)
            return
        from rich.table import Table

        t = Table(title="resources")
        for col in ("node", "role", "state", "CPU free/total", "GPU free/total", "memory free/total", "usage"):
            t.add_column(col)
        for r in data:
            tot, av = r["total"] or {}, r["available"] or {}
            _add_row(t, r["name"], r["role"], r["state"], f"{av.get('CPU', 0):g}/{tot.get('CPU', 0):g}",
                      f"{av.get('GPU', 0):g}/{tot.get('GPU', 0):g}",
                      f"{av.get('memory', 0) / 1e9:.1f}/{tot.get('memory', 0) / 1e9:.1f} GB", _usage(r))
        _console().print(t)

    @app.command()
    @run_cli
    def jobs(
        state: Optional[str] = typer.Option(None, help="only these states, e.g. running,paused"),
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        json_out: bool = typer.Option(False, "--json", help="a JSON list"),
    ):
        """Jobs with state, progress, samples, loss, ETA and their workers.

        Example: smolforge jobs --state running
        """
        data = _backend(coordinator, token, state_dir).list_jobs(state)
        if json_out:
            print_json(data)
        else:
            _console().print(jobs_table(data))

    def _job_cmd(action: str, doc: str):
        @run_cli
        def cmd(
            job_id: str = typer.Argument(..., help="job id (or a unique prefix, or its name)"),
            coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
            token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
            state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
            json_out: bool = typer.Option(False, "--json", help="print the job status as JSON"),
        ):
            backend = _backend(coordinator, token, state_dir)
            st = getattr(backend, f"{action}_job")(job_id)
            if json_out:
                print_json(st)
            else:
                typer.echo(f"job {st['job_id']}: {st['state']}")

        cmd.__doc__ = doc
        cmd.__name__ = f"job_{action}"
        return cmd

    job_app.command("pause")(_job_cmd("pause", "Pause a job: rank 0 checkpoints, then every worker is released.\n\n"
                                                "Example: smolforge job pause job-1a2b3c"))
    job_app.command("resume")(_job_cmd("resume", "Resume a paused job from its last checkpoint.\n\n"
                                                  "Example: smolforge job resume job-1a2b3c"))
    job_app.command("cancel")(_job_cmd("cancel", "Cancel a job: its workers are stopped and released at once.\n\n"
                                                  "Example: smolforge job cancel job-1a2b3c"))

    @job_app.command("join")
    @run_cli
    def job_join(
        job_id: str = typer.Argument(..., help="a running data-parallel job"),
        node: Optional[str] = typer.Option(None, help="a worker node to add (default: lend the coordinator node)"),
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        json_out: bool = typer.Option(False, "--json"),
    ):
        """Lend the coordinator node (or --node) to a running data-parallel job at its next checkpoint.

        The group stops at that checkpoint and re-forms with one more rank; the global batch stays the same.

        A job still being placed takes the node in its first group.

        A job that finishes before its next checkpoint ends without it (`join_dropped` in `job logs`).

        Example: smolforge job join job-1a2b3c
        """
        st = _backend(coordinator, token, state_dir).join_job(job_id, node)
        if json_out:
            print_json(st)
        else:
            typer.echo(f"job {st['job_id']}: {node or 'the coordinator'} joins at the next checkpoint")

    @job_app.command("show")
    @run_cli
    def job_show(
        job_id: str = typer.Argument(..., help="job id (or a unique prefix, or its name)"),
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        json_out: bool = typer.Option(False, "--json"),
    ):
        """A job's state, progress, workers, tasks, recent events and artifacts.

        Example: smolforge job show job-1a2b3c
        """
        backend = _backend(coordinator, token, state_dir)
        job = backend.get_job(job_id)
        arts = backend.list_artifacts(job["id"])
        if json_out:
            print_json({**job, "artifacts": arts})
            return
        con = _console()
        con.print(_job_line(job))
        con.print(f"workers: {', '.join(job.get('nodes') or []) or '–'} · failures survived: {job.get('attempts') or 0}")
        if job.get("error"):
            con.print(f"error: {job['error']}")
        from rich.table import Table

        t = Table(title="tasks")
        for col in ("task", "kind", "rank", "state", "node", "pid", "error"):
            t.add_column(col)
        for task in job.get("tasks", []):
            _add_row(t, task["id"], task["kind"], "" if task["rank"] is None else str(task["rank"]), task["state"],
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
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
    ):
        """The job's event log: state changes, placement, checkpoints, failures and recoveries.

        Example: smolforge job logs job-1a2b3c --follow
        """
        from smolforge.cluster.jobview import format_event

        backend = _backend(coordinator, token, state_dir)
        since = 0
        while True:
            events = backend.job_events(job_id, since)
            for e in events:
                typer.echo(format_event(e))
                since = e["id"]
            if not follow:
                return
            st = backend.get_job_status(job_id)
            if st["state"] in ("completed", "failed", "cancelled", "paused") and not events:
                return
            time.sleep(1)

    @app.command()
    @run_cli
    def launch(
        model: str = typer.Option(..., help="HF id, local dir, Ollama name or preset (tiny-llama)"),
        dataset: str = typer.Option(..., help="JSONL file (uploaded to the coordinator), or 'bundled'"),
        workers: int = typer.Option(2, help="data-parallel ranks"),
        mode: str = typer.Option("data_parallel", help="data_parallel | teacher_student | hybrid (distillation: "
                                 "--model is the teacher, --student the student, --workers the students)"),
        student: list[str] = typer.Option([], help="teacher_student/hybrid: student base model (repeatable)"),
        kd_loss: str = typer.Option("forward_kl", help="teacher_student/hybrid: forward_kl|reverse_kl|jsd"),
        kd_ratio: float = typer.Option(0.5, help="teacher_student/hybrid: weight of the KD term"),
        temperature: float = typer.Option(1.0, help="teacher_student/hybrid: KD temperature"),
        top_k: int = typer.Option(32, help="teacher_student/hybrid: teacher logits kept per token"),
        num_teachers: Optional[int] = typer.Option(None, help="teacher_student/hybrid: teacher tasks "
                                                   "(default: one per node holding the teacher)"),
        epochs: Optional[float] = typer.Option(None),
        batch_size: int = typer.Option(4, help="per worker; the global batch is batch size x workers"),
        max_length: Optional[int] = typer.Option(None, help="truncate sequences to this many tokens"),
        max_steps: Optional[int] = typer.Option(None, help="optimizer steps (overrides --epochs)"),
        lr: Optional[float] = typer.Option(None),
        peft: Optional[str] = typer.Option(None, help="lora|prefix|prompt|ia3|adapter|none (default lora)"),
        lora_r: Optional[int] = typer.Option(None, help="LoRA rank"),
        lora_alpha: Optional[float] = typer.Option(None, help="LoRA alpha"),
        save_every: Optional[int] = typer.Option(None, help="checkpoint every N steps (recovery resumes there)"),
        seed: Optional[int] = typer.Option(None),
        cpus_per_worker: float = typer.Option(1.0, help="CPUs (and torch threads) per rank"),
        gpu: str = typer.Option("no", help="no|preferred|required"),
        max_retries: int = typer.Option(2, help="worker failures to survive"),
        name: Optional[str] = typer.Option(None, help="a name for the job"),
        output_dir: Optional[str] = typer.Option(None, help="where the final adapter is downloaded (default outputs/<job>)"),
        set_: list[str] = typer.Option([], "--set", help="override any setting, e.g. --set training.warmup_steps=10"),
        detach: bool = typer.Option(False, "--detach", help="submit and return (coordinator only)"),
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP + "; none: embedded cluster"),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
        json_out: bool = typer.Option(False, "--json", help="print the final status as JSON"),
    ):
        """Launch distributed training: data-parallel, or teacher→student distillation.

        data_parallel: N ranks with DDP, rendezvous through Ray. teacher_student: --model is the
        teacher, --student the student, --workers the number of students; hybrid: the same, with
        teachers and the data-parallel students kept on separate nodes. `smolforge distill` has
        every distillation setting.

        With no coordinator given or running, it runs on an embedded cluster of this machine.

        Example: smolforge launch --model tiny-llama --dataset data.jsonl --workers 2 --mode data_parallel --max-steps 100

        Example: smolforge launch --mode hybrid --model small-llama --student tiny-llama --dataset bundled --workers 2 --max-steps 50
        """
        if mode in ("teacher_student", "hybrid"):
            _launch_distill(mode=mode, teacher=model, students=student, dataset=dataset, workers=workers,
                            epochs=epochs, batch_size=batch_size, max_length=max_length, max_steps=max_steps, lr=lr,
                            peft=peft, lora_r=lora_r, lora_alpha=lora_alpha, seed=seed,
                            cpus_per_worker=cpus_per_worker, output_dir=output_dir, kd_loss=kd_loss,
                            kd_ratio=kd_ratio, temperature=temperature, top_k=top_k, num_teachers=num_teachers,
                            coordinator=coordinator, token=token, state_dir=state_dir, quiet=quiet,
                            json_out=json_out,
                            name=name, sets=set_, detach=detach,
                            save_every=save_every, unsupported={"--gpu": None if gpu == "no" else gpu})
            return
        if mode != "data_parallel":
            raise SmolforgeError(f"unknown --mode {mode!r}", fix="use data_parallel, teacher_student or hybrid")
        if student:
            raise SmolforgeError("--student is for --mode teacher_student or hybrid",
                                 fix="drop --student, or pick a distillation mode")
        kwargs: dict[str, Any] = dict(num_workers=workers, batch_size=batch_size, max_retries=max_retries,
                                      cpus_per_worker=cpus_per_worker, name=name)
        for key, value in (("epochs", epochs), ("max_steps", max_steps), ("lr", lr), ("save_every", save_every),
                           ("seed", seed), ("max_length", max_length), ("lora_r", lora_r),
                           ("lora_alpha", lora_alpha), ("peft", peft)):
            if value is not None:
                kwargs[key] = value
        spec = _launch_spec(model, dataset, gpu=gpu, sets=set_, **kwargs)
        _submit_and_follow(spec, f"{workers} workers", coordinator=coordinator, token=token, state_dir=state_dir,
                           detach=detach, quiet=quiet, json_out=json_out, output_dir=output_dir)

    @app.command()
    @run_cli
    def submit(
        job_file: Path = typer.Argument(..., help="a job YAML: kind data_parallel (num_workers, train: {...}) or distill (mode, distill: {...})"),
        set_: list[str] = typer.Option([], "--set", help="override a setting, e.g. --set num_workers=3"),
        wait: bool = typer.Option(False, "--wait", help="follow the job to its end"),
        output_dir: Optional[str] = typer.Option(None, help="with --wait: where the adapter is downloaded"),
        coordinator: Optional[str] = typer.Option(None, help=COORD_HELP + "; none: embedded cluster (implies --wait)"),
        token: Optional[str] = typer.Option(None, help=TOKEN_HELP),
        state_dir: Optional[str] = typer.Option(None, help=STATE_HELP),
        quiet: bool = typer.Option(False, "--quiet", help="no progress bar"),
        json_out: bool = typer.Option(False, "--json"),
    ):
        """Submit a job file. Local dataset paths are uploaded to the coordinator first.

        Example: smolforge submit job.yaml --set train.max_steps=200 --wait
        """
        backend = _backend(coordinator, token, state_dir, embedded_ok=True)
        embedded = getattr(backend, "base", "") == "embedded"
        try:
            job_id = backend.submit_job(job_file, set_)
            if not (wait or embedded):
                if json_out:
                    print_json({"job_id": job_id})
                else:
                    typer.echo(job_id)
                return
            st = wait_with_progress(backend, job_id, quiet or json_out)
            finish_job(backend, st, output_dir or f"outputs/{job_id}", json_out)
        finally:
            close = getattr(backend, "close", None)
            if close:
                close()


def _launch_distill(*, mode: str, teacher: str, students: list[str], dataset: str, workers: int,
                    unsupported: dict[str, Any], **o: Any) -> None:
    """`launch --mode teacher_student|hybrid`: a distill job on the coordinator (or the embedded
    cluster): it shows in `smolforge jobs` and the dashboard, and pauses, resumes and cancels."""
    from smolforge.cli.common import quiet_libraries
    from smolforge.cluster.jobs import apply_job_overrides
    from smolforge.cluster.specs import DistillJob
    from smolforge.config import validate
    from smolforge.distill.pipeline import check_run

    if not students:
        raise SmolforgeError(f"--mode {mode} needs a student model",
                             fix="add --student NAME (e.g. --student tiny-llama); --model is the teacher")
    given = [flag for flag, value in unsupported.items() if value]
    if given:
        raise SmolforgeError(f"{', '.join(given)} appl{'y' if len(given) > 1 else 'ies'} to --mode data_parallel only",
                             fix="drop them, or use `smolforge distill` for the full set of distillation settings")
    quiet_libraries()
    distill: dict[str, Any] = {"teacher": teacher, "students": list(students), "data": dataset,
                               "num_students": workers, "peft": o["peft"] or "lora", "kd_loss": o["kd_loss"],
                               "kd_ratio": o["kd_ratio"], "temperature": o["temperature"], "top_k": o["top_k"],
                               "batch_size": o["batch_size"], "cpus_per_student": o["cpus_per_worker"]}
    peft_config = {k: v for k, v in (("r", o["lora_r"]), ("alpha", o["lora_alpha"])) if v is not None}
    if peft_config:
        distill["peft_config"] = peft_config
    for key in ("num_teachers", "max_steps", "lr", "max_length", "seed", "epochs", "save_every"):
        if o[key] is not None:
            distill[key] = o[key]
    if mode == "hybrid":
        distill["split_shards"] = True
    spec = apply_job_overrides({"kind": "distill", "name": o["name"], "mode": mode, "distill": distill}, o["sets"])
    check_run(validate(DistillJob, spec, where="launch").run_config("check"))  # before any cluster starts
    _submit_and_follow(spec, f"{mode}: {workers} students", coordinator=o["coordinator"], token=o["token"],
                       state_dir=o["state_dir"], detach=o["detach"], quiet=o["quiet"], json_out=o["json_out"],
                       output_dir=o["output_dir"], on_completed=_fetch_distill_summary)


def _fetch_distill_summary(backend: Any, job_id: str, out: Path) -> None:
    """The run summary (store, tasks, events) next to the merged adapter, as `smolforge distill` writes it."""
    backend.download_artifact(job_id, "summary", "distill", out / "summary")
    (out / "summary" / "distill_summary.json").replace(out / "distill_summary.json")
    (out / "summary").rmdir()


def _submit_and_follow(spec: dict, what: str, *, coordinator: str | None, token: str | None, state_dir: str | None,
                       detach: bool, quiet: bool, json_out: bool, output_dir: str | None,
                       on_completed: Callable[[Any, str, Path], None] | None = None) -> None:
    """Submit a job (to the coordinator, or an embedded cluster of this machine), then follow it to
    its end and fetch its adapter into `output_dir` (default outputs/<job>)."""
    backend = _backend(coordinator, token, state_dir, embedded_ok=True)
    embedded = getattr(backend, "base", "") == "embedded"
    try:
        if detach and embedded:
            raise SmolforgeError("--detach needs a coordinator (the embedded cluster ends with this command)",
                                 fix="start one with `smolforge coordinator start`, or drop --detach")
        job_id = backend.submit_job(spec)
        if not json_out:
            typer.echo(f"submitted {job_id} ({what}" + (", embedded cluster" if embedded else "") + ")", err=True)
        if detach:
            typer.echo(job_id)
            return
        st = wait_with_progress(backend, job_id, quiet or json_out)
        out = output_dir or f"outputs/{job_id}"
        if on_completed is not None and st["state"] == "completed":
            on_completed(backend, job_id, Path(out))
        finish_job(backend, st, out, json_out)
    finally:
        close = getattr(backend, "close", None)
        if close:
            close()


def _launch_spec(model: str, dataset: str, *, gpu: str, sets: list[str], num_workers: int, batch_size: int,
                 max_retries: int, cpus_per_worker: float, name: str | None, **opts: Any) -> dict:
    from smolforge.cluster.jobs import apply_job_overrides

    train: dict[str, Any] = {"model": model, "data": {"path": dataset}, "batch_size": batch_size}
    if "max_length" in opts:
        train["data"]["max_length"] = opts.pop("max_length")
    peft: dict[str, Any] = {}
    for key, dest in (("peft", "method"), ("lora_r", "r"), ("lora_alpha", "alpha")):
        if key in opts:
            peft[dest] = opts.pop(key)
    if peft:
        train["peft"] = peft
    train.update(opts)
    spec = {"kind": "data_parallel", "name": name, "num_workers": num_workers, "cpus_per_worker": cpus_per_worker,
            "gpu": gpu, "max_retries": max_retries, "train": train}
    return apply_job_overrides(spec, sets)


if __name__ == "__main__":  # `python -m smolforge.cli.cluster ...` works without the root app
    _app = typer.Typer(add_completion=False, pretty_exceptions_enable=False, no_args_is_help=True)
    register(_app)
    _app()
