"""`smolforge export`: a model and its adapters as an HF directory, a GGUF file or an Ollama model.

Runs on this machine by default; with --coordinator it is an `export` job on a node that holds the
model, and the result is downloaded into --output-dir. `train`, `launch` and `distill` call
`export_run` for their `--export` (one of `models.export.targets.RUN_TARGETS`).
"""

from __future__ import annotations

import sys
from pathlib import Path
from typing import Any, Optional

import typer

from smolforge.cli.common import cli_token, print_json, quiet_libraries, run_cli
from smolforge.distill.settings import AGGREGATE_METHODS
from smolforge.errors import SmolforgeError
from smolforge.models.export.targets import QUANTS, RUN_TARGETS, TARGETS


def _say(line: str) -> None:
    typer.echo(line, err=True)


def show(summary: dict, json_out: bool) -> None:
    if json_out:
        print_json(summary)
        return
    out = Path(summary["output_dir"])
    if "gguf" in summary:
        g = summary["gguf"]
        typer.echo(f"wrote {out / g['file']} ({g['bytes'] / 2**20:.1f} MiB, {g['quant']}, {g['arch']}, "
                   f"pre-tokenizer {g['pre_tokenizer']})")
    if "hf" in summary:
        typer.echo(f"wrote {out} (an HF model directory: AutoModelForCausalLM.from_pretrained('{out}'))")
    if summary.get("verify"):
        v = summary["verify"]
        ties = f" ({v['greedy_agreement_with_ties']:.1%} counting {v['near_ties']} near-tie(s))" if v["near_ties"] else ""
        typer.echo(f"verified in llama.cpp: logits NMSE {v['logits_nmse']:.2e}, greedy agreement "
                   f"{v['greedy_agreement']:.1%}{ties} on {v['prompts']} prompts, tokenization "
                   f"{'equal' if v['tokenization_equal'] else 'different'}")
    if "ollama" in summary:
        typer.echo(f"import it into Ollama with:\n  {summary['ollama']['create']}")


def check_run_export(target: str | None, method: str | None) -> None:
    """`--export` on train/launch/distill: refuse a target or an adapter kind that cannot export,
    before any training starts."""
    if target is None:
        return
    if target not in RUN_TARGETS:
        raise SmolforgeError(f"unknown --export {target!r}", fix=f"use one of {', '.join(RUN_TARGETS)}")
    from smolforge.models.peft import accepts, peft_method

    kind = peft_method(method) if method is not None else None
    if kind is not None and not accepts(kind, f"export:{target}"):
        refused = kind.refusal(f"export:{target}", where=f"--export {target} with --peft {method}",
                               adapter=f"<output-dir>/{method}_adapter")
        raise SmolforgeError(refused.what, where=refused.where, fix=f"drop --export; {refused.fix}")


def export_run(model: str, adapter_dir: str | Path, output_dir: str | Path, target: str) -> dict:
    """A finished run's adapter exported into `<output_dir>/export/` (verified)."""
    return _export_to(model, Path(adapter_dir), Path(output_dir) / "export", target)


def export_distill(summary: dict, output_dir: str | Path, target: str) -> dict:
    """`distill --export`: each student base's merged adapter exported into `<output_dir>/export/`
    (`export/<base>/` when there are several bases)."""
    out = Path(output_dir)
    merged = {base: rep for base, rep in (summary.get("merged") or {}).items() if rep.get("output")}
    if not merged:
        raise SmolforgeError("--export: the run merged no adapter to export",
                             fix=f"use --aggregate {' or '.join(AGGREGATE_METHODS)} (not none) with a mergeable --peft")
    done = {}
    for base, rep in merged.items():
        adapter = Path(rep["output"])
        if not adapter.is_dir():  # ran on a coordinator: the adapter was downloaded into merged_model/
            adapter = out / "merged_model" / adapter.name
        dest = out / "export" if len(merged) == 1 else out / "export" / _slug(base)
        done[base] = _export_to(base, adapter, dest, target)
    return done


def _slug(name: str) -> str:
    from smolforge.models.export.run import default_name

    return default_name(name, ())


def _export_to(model: str, adapter: Path, dest: Path, target: str) -> dict:
    from smolforge.models.export.run import export

    return export(model, target, dest, adapters=[str(adapter)], say=_say)


def _via_job(spec: dict, out: Path, coordinator: str, token: Optional[str], timeout: float) -> dict:
    from smolforge.client import backend_for
    from smolforge.models.export.run import read_summary

    backend = backend_for(coordinator, token)
    job_id = backend.submit_job(spec)
    _say(f"submitted export job {job_id}")
    st = backend.wait_for_job(job_id, timeout=timeout)
    if st["state"] != "completed":
        raise SmolforgeError(f"export job {job_id} {st['state']}: {st.get('error') or st.get('message')}",
                             fix=f"see `smolforge job events {job_id}`")
    _download_export(backend, job_id, spec["to"], out)
    summary = read_summary(out)
    summary["output_dir"] = str(out)
    if "ollama" in summary:
        from smolforge.models.export.ollama import create_command

        summary["ollama"]["create"] = create_command(summary["name"], out)
    return summary


def _download_export(backend: Any, job_id: str, to: str, out: Path) -> None:
    """The job's export into `out` as a local export writes it: downloaded whole beside it, then swapped
    in replacing only an earlier export's files (`rundir.replace_with`: files a user added are kept)."""
    import shutil
    import tempfile

    from smolforge.models.export.run import check_output_dir
    from smolforge.rundir import replace_with

    run = check_output_dir(out)
    out.parent.mkdir(parents=True, exist_ok=True)
    scratch = Path(tempfile.mkdtemp(prefix=f".{out.name}.download-", dir=out.parent))
    try:
        backend.download_artifact(job_id, "export", to, scratch / "export")
        replace_with(run, scratch / "export")
    finally:
        shutil.rmtree(scratch, ignore_errors=True)


def register(app: typer.Typer) -> None:
    @app.command("export")
    @run_cli
    def export_cmd(
        model: str = typer.Option(..., help="base model: HF id, local dir, Ollama name or preset"),
        adapter: list[str] = typer.Option([], "--adapter", help="adapter directory to merge (repeat: merged in order)"),
        to: str = typer.Option(..., "--to", help=" | ".join(TARGETS)),
        output_dir: str = typer.Option(..., help="directory to write (an earlier export's files there are replaced; files you added are kept)"),
        quant: str = typer.Option("f16", help=f"GGUF weights: {' | '.join(QUANTS)}"),
        dtype: str = typer.Option("auto", "--dtype", help="--to hf: the dtype the merged weights are written in: "
                                  "auto (the checkpoint's own) | bf16 | fp16 | fp32 (GGUF: use --quant)"),
        name: Optional[str] = typer.Option(None, help="model name in the GGUF and for `ollama create`"),
        no_verify: bool = typer.Option(False, "--no-verify", help="skip the llama.cpp comparison"),
        coordinator: Optional[str] = typer.Option(None, help="run as an `export` job on the coordinator HOST:PORT's "
                                                  "nodes (one that holds the model) and download the result"),
        token_file: Optional[str] = typer.Option(None, help="with --coordinator: the cluster token file"),
        timeout: float = typer.Option(3600.0, help="with --coordinator: seconds to wait for the job"),
        json_out: bool = typer.Option(False, "--json", help="print the export summary as one JSON object"),
    ):
        """Merge adapters into a model and export it for Hugging Face, llama.cpp or Ollama.

        LoRA, IA3 and full fine-tunes merge; Houlsby adapters and prefix/prompt tuning cannot (serve them with --adapter instead). GGUF exports are checked in llama.cpp unless --no-verify.

        Example: smolforge export --model tiny-llama --adapter outputs/run/lora_adapter --to ollama --output-dir outputs/run/ollama

        Example: smolforge export --model tiny-llama --adapter outputs/run/lora_adapter --to hf --dtype bf16 --output-dir outputs/run/hf
        """
        from smolforge.models.export.run import check_export_dtype, check_output_dir

        if to not in TARGETS:
            raise SmolforgeError(f"unknown --to {to!r}", fix=f"use one of {', '.join(TARGETS)}")
        if quant not in QUANTS:
            raise SmolforgeError(f"unknown --quant {quant!r}", fix=f"use one of {', '.join(QUANTS)}")
        dtype = check_export_dtype(dtype, to)
        out = Path(output_dir).expanduser().resolve()
        check_output_dir(out)
        quiet_libraries()
        if coordinator:
            spec: dict[str, Any] = {"kind": "export", "model": model, "adapters": [str(Path(a).resolve()) for a in adapter],
                                    "to": to, "quant": quant, "model_name": name, "verify": not no_verify,
                                    "dtype": dtype}
            summary = _via_job(spec, out, coordinator, cli_token(None, token_file), timeout)
        else:
            from smolforge.models.export.run import export

            summary = export(model, to, out, adapters=adapter, quant=quant, name=name, verify=not no_verify,
                             dtype=dtype, say=(lambda line: None) if json_out else _say)
        show(summary, json_out)
        sys.stdout.flush()
