"""`smolforge worker probe`: what this machine would report on joining, without joining.

The counterpart of LlamaForge's `llamaforge_node.py --no-register`: the same inventory `worker join`
advertises (`discover`: CPUs, RAM, GPUs, the models it holds per backend), read with the same flags,
printed, and nothing started, nothing asked of a coordinator.
"""

from __future__ import annotations

from typing import Any, Optional

import typer

from smolforge.cli.aliases import seed_command
from smolforge.cli.common import print_json, run_cli


def inventory_report(inv: Any, by_backend: dict[str, list[str]]) -> dict[str, Any]:
    """The inventory as `--json` prints it: name, cpus, ram_gb, gpus [{index, name, memory_gb}], models
    {backend: [names, aliases included]} and the line `worker join` would print on registering."""
    return {"name": inv.name, "cpus": inv.cpus, "ram_gb": inv.ram_gb,
            "gpus": [{"index": g.index, "name": g.name, "memory_gb": g.memory_gb} for g in inv.gpus],
            "models": by_backend, "line": f"Would register as {inv.name}: {inv.summary()}"}


def register(worker_app: typer.Typer) -> None:
    """Add `probe` to the `worker` group."""

    @worker_app.command("probe", cls=seed_command("worker probe"))
    @run_cli
    def worker_probe(
        name: Optional[str] = typer.Option(None, help="node name (default: host name)"),
        models_dir: Optional[str] = typer.Option(None, help="a folder of models (each with config.json)"),
        cpus: Optional[int] = typer.Option(None, help="CPUs to lend (default: all)"),
        gpus: Optional[int] = typer.Option(None, help="GPUs to lend (default: all found)"),
        memory: Optional[float] = typer.Option(None, "--memory-limit", "--memory", help="this node's memory, GB"),
        no_hf_cache: bool = typer.Option(False, "--no-hf-cache", help="leave out the models in the HF cache"),
        json_out: bool = typer.Option(False, "--json", help="print the report as JSON"),
    ):
        """Show what `worker join` would report for this machine (CPUs, RAM, GPUs, models per backend),
        without joining: nothing starts and no coordinator is asked.

        Example: smolforge worker probe --models-dir ~/models --json
        """
        from smolforge.cluster import face

        face.check_models_dir(models_dir)
        inv = face.discover(name, models_dir=models_dir, cpus=cpus, gpus=gpus, memory_gb=memory,
                            scan_cache=not no_hf_cache)
        report = inventory_report(inv, face.by_backend(inv.models))
        if json_out:
            print_json(report)
            return
        typer.echo(report["line"])
        for gpu in report["gpus"]:
            typer.echo(f"  GPU {gpu['index']}: {gpu['name']}, {gpu['memory_gb']:.1f} GB")
        for backend, names in report["models"].items():
            typer.echo(f"  models ({backend}): {', '.join(names) if names else 'none'}")
