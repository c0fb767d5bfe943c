"""How the cluster commands show nodes, jobs and the status tree (rich tables and trees; user text
escaped, never read as markup): shared by `status`, `nodes`, `jobs` and `job show` (cli/cluster.py)."""

from __future__ import annotations

from smolforge.cli.common import fmt_eta


def usage_text(n: dict) -> str:
    u = n.get("usage") or {}
    if u.get("cpu_percent") is None:
        return "–"
    text = f"CPU {u['cpu_percent']:.0f}% · RAM {u.get('ram_percent', 0):.0f}%"
    for g in u.get("gpus") or []:
        text += f" · GPU{g['index']} {g['util_percent']}% {g['mem_used_gb']:.1f}/{g['mem_total_gb']:.0f} GB"
    return text


def models_text(n: dict, limit: int = 6) -> str:
    """The weights a node holds, then what its Ollama serves (`ollama: ...`): placement keeps them apart."""
    parts = []
    for prefix, models in (("", n.get("models") or []), ("ollama: ", n.get("ollama_models") or [])):
        if models:
            parts.append(prefix + ", ".join(models[:limit]) + (f" (+{len(models) - limit})" if len(models) > limit else ""))
    return "; ".join(parts) or "–"


def job_line(j: dict) -> str:
    pct = 100 * (j.get("progress") or 0)
    text = f"{j['id']} ({j['kind']}) {j['state']} {pct:.0f}%"
    if j.get("samples_total"):
        text += f" · {j['samples_done']}/{j['samples_total']} samples"
    if j.get("max_steps"):
        text += f" · step {j['step']}/{j['max_steps']}"
    if j.get("loss") is not None:
        text += f" · loss {j['loss']:.4f}"
    if j["state"] == "running":
        text += f" · ETA {fmt_eta(j.get('eta_s'))}"
    if j["state"] == "pending" and j.get("pending_reason"):
        text += f" · {j['pending_reason']}"
    return text


def comm_line(comm: dict) -> str:
    """A data-parallel job's communication per rank: bytes handed to collectives, time waiting in them."""
    sent = " / ".join(mb_text(b) for b in comm.get("bytes_sent_per_rank") or [])
    waits = " / ".join(f"{w:.1f} s" for w in comm.get("wait_s_per_rank") or [])
    text = f"communication (per rank, step {comm.get('step')}): sent {sent} · waiting {waits}"
    if (comm.get("plan") or {}).get("reason"):  # `--strategy auto`: what it chose and why
        text = f"auto chose {comm['plan']['reason']}\n" + text
    if comm.get("rounds") is not None:
        text += f" · {comm['rounds']} outer steps"
    if any(r is not None for r in comm.get("batch_rows_per_rank") or []):
        text += " · rows per step " + " / ".join(str(r) for r in comm["batch_rows_per_rank"]) + " (balanced)"
    per_rank = [m or {} for m in comm.get("metrics_per_rank") or []]
    if any(per_rank):  # the strategy's own numbers (a parameter server's: parts, waits, staleness, dropped)
        names = [k for k in per_rank[0] if isinstance(per_rank[0][k], (int, float))] if per_rank[0] else []
        text += "".join(f"\n  {name}: " + " / ".join(num_text(m.get(name)) for m in per_rank) for name in names)
    server = comm.get("server") or {}
    if server.get("max_step_s") is not None:
        text += (f"\n  parameter server: step {server.get('version')}, longest step {server['max_step_s']:.2f} s, "
                 f"stragglers {', '.join(map(str, server.get('stragglers') or [])) or 'none'}")
    return text


def num_text(v) -> str:
    return "–" if v is None else (f"{v:,.3g}" if isinstance(v, float) else f"{v:,}")


def mb_text(n: int | None) -> str:
    return "–" if n is None else f"{n / 1e6:,.1f} MB"


def add_row(table, *cells) -> None:
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
        add_row(t, n["name"], n["role"], n["state"], f"{n['cpus']:g}", f"{n['ram_gb']:.1f} GB", gpus, usage_text(n),
                  models_text(n, 10))
    return t


def jobs_table(jobs: list[dict]):
    from rich.table import Table

    t = Table(title=f"jobs ({len(jobs)})")
    for col in ("id", "name", "kind", "state", "priority", "progress", "samples", "loss", "ETA", "workers / waiting for"):
        t.add_column(col)
    for j in jobs:
        where = ", ".join(j.get("nodes") or []) or "–"
        if j["state"] == "pending" and j.get("pending_reason"):
            where = j["pending_reason"]  # why it is not running yet (the queue's reason)
        state = f"{j['state']} (damaged: {j['damaged']})" if j.get("damaged") else j["state"]  # `job delete` removes it
        add_row(t, j["id"], j["name"] if j["name"] != j["id"] else "", j["kind"], state,
                  (j.get("spec") or {}).get("priority", "normal"),
                  f"{100 * (j.get('progress') or 0):.0f}% ({j['step']}/{j['max_steps'] or '?'})",
                  f"{j['samples_done']}/{j['samples_total'] or '?'}",
                  "–" if j.get("loss") is None else f"{j['loss']:.4f}",
                  fmt_eta(j.get("eta_s")) if j["state"] == "running" else "–", where)
    return t


def status_tree(st: dict):
    from rich.markup import escape
    from rich.tree import Tree

    c = st["coordinator"]
    nodes = st["nodes"]
    root = Tree(escape(f"Coordinator {c.get('name')} · API {c.get('api')} · Ray {c.get('ray_address')}"
                       + (f" · up {fmt_eta(c.get('uptime_s'))}" if c.get("uptime_s") is not None else "")))
    workers = [n for n in nodes if n["role"] == "worker"]
    online = [n for n in workers if n["state"] == "online"]
    wt = root.add(f"Workers online: {len(online)}/{len([w for w in workers if w['state'] != 'dead'])}")
    for n in workers:
        if n["state"] == "dead":
            continue
        wt.add(escape(f"{n['name']} [{n['state']}]: {n['cpus']:g} CPUs, {n['ram_gb']:.1f} GB RAM, {n['gpus']:g} GPUs; "
                      f"{len(n.get('models') or [])} models · {usage_text(n)}"))
    jobs = st["jobs"]
    jt = root.add(f"Active jobs: {len(jobs)}")
    for j in jobs:
        node = jt.add(escape(job_line(j)))
        if j.get("nodes"):
            node.add(escape("workers: " + ", ".join(j["nodes"])))
    rt = root.add("Resources")
    for n in nodes:
        if n["state"] == "dead":
            continue
        tot, av = n.get("ray_resources") or {}, n.get("available") or {}
        line = f"{n['name']}: CPU {av.get('CPU', 0):g}/{tot.get('CPU', 0):g} free"
        if tot.get("GPU"):
            line += f", GPU {av.get('GPU', 0):g}/{tot.get('GPU', 0):g} free"
        if tot.get("memory"):
            line += f", memory {av.get('memory', 0) / 1e9:.1f}/{tot.get('memory', 0) / 1e9:.1f} GB"
        rt.add(escape(line + (" (takes no training work)" if n["role"] == "coordinator" else "")))
    return root
