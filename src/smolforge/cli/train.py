"""`smolforge train`, `eval` and `generate`: the single-worker engine from the command line.

`smolforge train` is the one command that does not hand its spec to a backend: it is the laptop's
one-process path, so it runs the one driver (`smolforge.train.engine.train`, the same run a
data-parallel rank makes) in this process, with no Ray and no embedded cluster to start (seconds,
not the tens of seconds a cluster of one takes). A job that needs the queue, pause and resume from
another shell, or other machines is `smolforge launch` (`--workers 1` for one). docs/design.md
records this shortcut.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Optional

import typer

from smolforge.cli.export import check_run_export, export_run, show
from smolforge.cli.hubdata import (DatasetColumnOpt, DatasetConfigOpt, DatasetEvalSplitOpt, DatasetNameOpt,
                                   DatasetSplitOpt, EvalDataOpt, dataset_files)
from smolforge.cli.aliases import seed_command
from smolforge.cli.common import bounded, make_output_dir, peft_section, print_json, quiet_libraries, run_cli
from smolforge.config import EVAL_SPLIT_KEY, NAMED_DATASET_KEYS, TrainConfig, apply_overrides, load_yaml, put_path, validate
from smolforge.errors import SmolforgeError
from smolforge.models.dtypes import DTYPE_HELP, parse_dtype
from smolforge.models.export.targets import RUN_TARGETS
from smolforge.models.kinds import refuse_unused
from smolforge.models.peft_spec import METHODS as PEFT_METHODS

FLAG_KEYS = {
    "model": "model", "data": "data.path", "format": "data.format", "eval_data": "data.eval_path",
    "max_length": "data.max_length", "packing": "data.packing", "skip_bad_lines": "data.skip_bad_lines",
    "max_samples": "data.max_samples", "output_dir": "output_dir", "max_steps": "max_steps",
    "epochs": "epochs", "batch_size": "batch_size", "grad_accum": "grad_accum", "lr": "lr",
    "warmup_steps": "warmup_steps", "scheduler": "scheduler", "eval_every": "eval_every",
    "save_every": "save_every", "keep_last": "keep_last", "resume": "resume",
    "resume_new_data": "resume_new_data", "seed": "seed",
    "device": "device", "precision": "precision", "dtype": "dtype", "gradient_checkpointing": "gradient_checkpointing",
    "num_threads": "num_threads", "quiet": "quiet", "wandb": "wandb",
}


def build_train_config(config: Optional[Path], sets: list[str], flags: dict[str, Any], peft: dict[str, Any]) -> TrainConfig:
    """YAML file, then explicit flags, then --set overrides: later wins. A dataset by name (`data:
    {dataset_name: ...}` in the file, `--set dataset_name=...`) is read into data.path here, once the
    whole config is valid (`data.hub.resolved`); --data/--dataset-name (FLAGS' data) replace the file's."""
    data: dict[str, Any] = load_yaml(config) if config else {}
    if flags.get("data") is not None and isinstance(data.get("data"), dict):
        data["data"] = {k: v for k, v in data["data"].items() if k not in (*NAMED_DATASET_KEYS, EVAL_SPLIT_KEY)}
    for name, value in flags.items():
        if value is not None and value is not False:
            put_path(data, FLAG_KEYS[name], value, where=f"--{name.replace('_', '-')}")
    if peft:
        data.setdefault("peft", {}).update(peft)
    apply_overrides(data, [_data_key(item) for item in sets])
    missing = [k for k in ("model",) if k not in data]
    if not any(key in (data.get("data") or {}) for key in ("path", "dataset_name")):
        missing.append("data")
    if missing:
        raise SmolforgeError(f"missing {' and '.join('--' + m for m in missing)}",
                             fix="pass them as flags or in --config (e.g. --model tiny-llama --data bundled)")
    cfg = validate(TrainConfig, data, where=str(config) if config else "command line")
    if cfg.data.dataset_name is None:
        return cfg
    from smolforge.data.hub import resolved

    return cfg.model_copy(update={"data": resolved(cfg.data)})


def _data_key(item: str) -> str:
    """`--set dataset_name=wikitext` (or training.dataset_name=...) as the data section's key: data.dataset_name."""
    key, sep, value = item.partition("=")
    bare = key.strip().removeprefix("training.")
    return f"data.{bare}{sep}{value}" if sep and bare in (*NAMED_DATASET_KEYS, EVAL_SPLIT_KEY) else item


def check_model_and_data(cfg: TrainConfig):
    """Check the model path and read the data file before torch and transformers load (seconds) and
    a tokenizer does: a typo'd model directory or a bad data line fails at once. Returns what
    read_spec read, for the engine to use as it is."""
    from smolforge.data.splits import read_spec
    from smolforge.models.loading import resolve_model
    from smolforge.models import twins
    from smolforge.models.tiny import is_preset

    if twins.is_twin(cfg.model):  # built on first use, with torch: only the name is checked here
        twins.parse(cfg.model)
    elif not is_preset(cfg.model):  # a preset is built on first use, with torch: nothing to check here
        resolve_model(cfg.model)
    return read_spec(cfg.data)


def register(app: typer.Typer) -> None:
    _register_train(app)
    _register_eval(app)
    _register_generate(app)


def _register_train(app: typer.Typer) -> None:
    """`train`: fine-tune on this machine (the single-worker engine)."""

    @app.command(cls=seed_command("train"))
    @run_cli
    def train(
        model: Optional[str] = typer.Option(None, help="HF id, local dir, Ollama name or preset (tiny-llama)"),
        data: Optional[str] = typer.Option(None, help="JSONL file, or 'bundled' for the generated task set"),
        dataset_name: DatasetNameOpt = None,
        dataset_config: DatasetConfigOpt = None,
        dataset_split: DatasetSplitOpt = None,
        dataset_column: DatasetColumnOpt = None,
        format: Optional[str] = typer.Option(None, "--format", help="auto|alpaca|chat|prompt_completion|text"),
        eval_data: EvalDataOpt = None,
        dataset_eval_split: DatasetEvalSplitOpt = None,
        peft: Optional[str] = typer.Option(None, help=f"{'|'.join(PEFT_METHODS)} (default lora)"),
        peft_config: Optional[str] = typer.Option(None, help='JSON, e.g. \'{"r": 8, "alpha": 16, "dropout": 0.05}\''),
        lora_r: Optional[int] = typer.Option(None, help="LoRA rank"),
        lora_alpha: Optional[float] = typer.Option(None, help="LoRA alpha"),
        lora_dropout: Optional[float] = typer.Option(None, help="LoRA dropout"),
        output_dir: Optional[str] = typer.Option(None, help="where checkpoints, metrics and <peft>_adapter/ go"),
        max_steps: Optional[int] = typer.Option(None, help="optimizer steps (overrides --epochs)"),
        epochs: Optional[float] = typer.Option(None),
        batch_size: Optional[int] = typer.Option(None),
        grad_accum: Optional[int] = typer.Option(None, help="micro-batches per optimizer step"),
        lr: Optional[float] = typer.Option(None, help="learning rate (default: per --peft method, e.g. lora 5e-3, "
                                           "prompt 3e-2, none 1e-3)"),
        warmup_steps: Optional[int] = typer.Option(None),
        scheduler: Optional[str] = typer.Option(None, help="cosine|linear|constant"),
        max_length: Optional[int] = typer.Option(None, help="truncate sequences to this many tokens"),
        max_samples: Optional[int] = typer.Option(None, help="use only the first N training examples"),
        packing: bool = typer.Option(False, "--packing", help="pack examples into full-length sequences"),
        skip_bad_lines: bool = typer.Option(False, "--skip-bad-lines", help="skip malformed lines, report how many"),
        eval_every: Optional[int] = typer.Option(None, help="evaluate every N steps (0: at the end)"),
        save_every: Optional[int] = typer.Option(None, help="checkpoint every N steps (0: at the end)"),
        keep_last: Optional[int] = typer.Option(None, help="checkpoints to keep"),
        resume: bool = typer.Option(False, "--resume", help="continue from the newest valid checkpoint"),
        resume_new_data: bool = typer.Option(False, "--resume-new-data",
                                             help="with --resume: continue although the training data changed"),
        seed: Optional[int] = typer.Option(None),
        device: Optional[str] = typer.Option(None, help="auto|cpu|cuda"),
        precision: Optional[str] = typer.Option(None, help="autocast: auto|fp32|bf16|fp16"),
        dtype: Optional[str] = typer.Option(None, "--dtype", help=DTYPE_HELP + "; LoRA keeps its adapter in fp32"),
        gradient_checkpointing: bool = typer.Option(False, "--gradient-checkpointing"),
        num_threads: Optional[int] = typer.Option(None, help="torch threads (default: CPUs available)"),
        config: Optional[Path] = typer.Option(None, "--config", help="YAML file with any of these settings (a dataset by "
                                              "name: data: {dataset_name: wikitext, dataset_config: wikitext-2-raw-v1})"),
        set_: list[str] = typer.Option([], "--set", help="override a setting, e.g. --set training.batch_size=16 or "
                                       "--set dataset_name=wikitext"),
        tensorboard: Optional[bool] = typer.Option(None, "--tensorboard/--no-tensorboard",
                                                   help="TensorBoard event files in OUTPUT_DIR/tensorboard (default on)"),
        wandb: Optional[str] = typer.Option(None, "--wandb", metavar="PROJECT",
                                            help="also log to W&B, offline, in OUTPUT_DIR/wandb (the package's wandb extra)"),
        json_out: bool = typer.Option(False, "--json", help="print the run summary as one JSON object"),
        quiet: bool = typer.Option(False, "--quiet", help="no progress bar (for scripts)"),
        export: Optional[str] = typer.Option(None, "--export", help=f"{'|'.join(RUN_TARGETS)}: export the final adapter, merged "
                                             "and verified, into <output-dir>/export/"),
    ):
        """Fine-tune a model on one worker (LoRA by default).

        Example: smolforge train --model tiny-llama --data bundled --peft lora --max-steps 200 --output-dir outputs/run

        Example: smolforge train --model tiny-llama --data bundled --max-steps 50 --wandb my-project  (then: wandb sync outputs/run/wandb/offline-run-*)

        Example: smolforge train --model qwen2.5:0.5b --data bundled --dtype bf16  (frozen base in bf16: half the memory)

        Example: smolforge train --model tiny-llama --dataset-name tatsu-lab/alpaca --max-steps 50  (offline, from the HF cache)

        Example: smolforge train --model tiny-llama --dataset-name wikitext --dataset-config wikitext-2-raw-v1 --dataset-eval-split validation --max-steps 50
        """
        data, eval_data = dataset_files(locals(), "data", "--data", "eval_data")
        flags = {k: v for k, v in locals().items() if k in FLAG_KEYS}
        cfg = build_train_config(config, set_, flags, peft_section(peft, peft_config, lora_r, lora_alpha, lora_dropout))
        if tensorboard is not None:
            cfg = cfg.model_copy(update={"tensorboard": tensorboard})
        if json_out:
            cfg = cfg.model_copy(update={"quiet": True})
        refuse_unused(cfg, prefix="")  # a model kind's unused settings (--peft for --model mlp), by name
        check_run_export(export, cfg.peft.method)
        examples = check_model_and_data(cfg)
        make_output_dir(cfg.output_dir)
        quiet_libraries()
        from smolforge.train.engine import train as run_train

        result = run_train(cfg, examples=examples)  # here, no backend: the documented one-process shortcut
        exported = export_run(cfg.model, result.adapter_dir, cfg.output_dir, export) if export else None
        if json_out:
            print_json({**result.to_dict(), **({"export": exported} if exported else {})})
        else:
            typer.echo(f"adapter: {result.adapter_dir}")
            if exported:
                show(exported, False)
            tb = f"  (tensorboard --logdir {Path(cfg.output_dir) / 'tensorboard'})" if cfg.tensorboard is not False else ""
            typer.echo(f"metrics: {Path(cfg.output_dir) / 'metrics.jsonl'}{tb}")
            if cfg.wandb:
                typer.echo(f"wandb: offline run in {Path(cfg.output_dir) / 'wandb'} (upload: wandb sync <run dir>)")


def _register_eval(app: typer.Typer) -> None:
    """`eval`: held-out loss, perplexity and accuracy of a model (plus adapter)."""

    @app.command("eval")
    @run_cli
    def eval_cmd(
        model: str = typer.Option(..., help="base model: HF id, local dir, Ollama name or preset"),
        data: Optional[str] = typer.Option(None, help="JSONL file or 'bundled' (its held-out split)"),
        dataset_name: DatasetNameOpt = None,
        dataset_config: DatasetConfigOpt = None,
        dataset_split: DatasetSplitOpt = None,
        dataset_column: DatasetColumnOpt = None,
        dataset_eval_split: DatasetEvalSplitOpt = None,
        adapter: Optional[str] = typer.Option(None, help="a <peft>_adapter/ directory to apply"),
        format: str = typer.Option("auto", "--format"),
        max_length: int = typer.Option(256),
        batch_size: int = typer.Option(16),
        max_samples: Optional[int] = typer.Option(200, help="evaluate on at most N examples"),
        max_new_tokens: int = bounded(16, ge=1, help="for exact-match accuracy"),
        device: str = typer.Option("auto"),
        dtype: str = typer.Option("fp32", "--dtype", help=DTYPE_HELP),
        json_out: bool = typer.Option(False, "--json"),
    ):
        """Eval loss, perplexity and exact-match accuracy of a model (plus adapter) on held-out data.

        Example: smolforge eval --model tiny-llama --adapter outputs/run/lora_adapter --data bundled

        Example: smolforge eval --model tiny-llama --data bundled --dtype bf16 --json

        Example: smolforge eval --model tiny-llama --dataset-name wikitext --dataset-config wikitext-2-raw-v1 --dataset-split test  (offline, from the HF cache)

        Example: smolforge eval --model tiny-llama --dataset-name wikitext --dataset-config wikitext-2-raw-v1 --dataset-eval-split validation  (that split, whole, as train holds it out)
        """
        data, held_out = dataset_files(locals(), "data", "--data")
        if data is None:
            raise SmolforgeError("no dataset given", fix="pass --data FILE|bundled or --dataset-name NAME")
        dtype = parse_dtype(dtype)
        quiet_libraries()
        from smolforge.config import DataSpec
        from smolforge.models.loading import load_model, load_tokenizer, pick_device
        from smolforge.train.engine import evaluate
        from smolforge.train.rendering import load_checked_splits

        dev = pick_device(device)
        tok = load_tokenizer(model)
        net = load_model(model, device=dev, dtype=dtype)
        if adapter:
            from smolforge.models.peft_methods import load_adapter

            net = load_adapter(net, adapter).to(dev)
        # A file given to eval is all held-out data; 'bundled' has its own held-out split; a dataset's eval
        # split (--dataset-eval-split) is the held-out file, as train reads it.
        spec = DataSpec(path=data, format=format, max_length=max_length, max_eval_samples=max_samples,
                        eval_path=held_out or (None if data == "bundled" else data), max_samples=1)
        splits = load_checked_splits(spec, tok)
        cfg = TrainConfig(model=model, data=spec, batch_size=batch_size, max_new_tokens=max_new_tokens)
        metrics = evaluate(net, tok, splits, cfg, dev)
        metrics["examples"] = len(splits.eval)
        if json_out:
            print_json(metrics)
        else:
            for k, v in metrics.items():
                typer.echo(f"{k}: {v:.4f}" if isinstance(v, float) else f"{k}: {v}")


def _register_generate(app: typer.Typer) -> None:
    """`generate`: one reply from a model (plus adapter)."""

    @app.command()
    @run_cli
    def generate(
        model: str = typer.Option(..., help="HF id, local dir, Ollama name or preset"),
        prompt: str = typer.Option(..., help="the user message"),
        adapter: Optional[str] = typer.Option(None, help="a <peft>_adapter/ directory to apply"),
        max_new_tokens: int = bounded(64, ge=1),
        temperature: float = bounded(0.0, ge=0, help="0 = greedy"),
        raw: bool = typer.Option(False, "--raw", help="send the prompt as is, without the chat template"),
        device: str = typer.Option("auto"),
        dtype: str = typer.Option("fp32", "--dtype", help=DTYPE_HELP),
    ):
        """Generate a reply from a model (plus adapter).

        Example: smolforge generate --model tiny-llama --adapter outputs/run/lora_adapter --prompt "What is 2 + 3?"

        Example: smolforge generate --model tiny-llama --prompt "What is 2 + 3?" --dtype bf16
        """
        dtype = parse_dtype(dtype)
        quiet_libraries()
        from smolforge.data.encode import render
        from smolforge.models.families import cut_at_stop, stop_ids
        from smolforge.models.loading import load_model, load_tokenizer, pick_device

        dev = pick_device(device)
        tok = load_tokenizer(model)
        net = load_model(model, device=dev, dtype=dtype)
        if adapter:
            from smolforge.models.peft_methods import load_adapter

            net = load_adapter(net, adapter).to(dev)
        net.eval()
        stops = stop_ids(tok, net)  # every token that ends a generation (the family's one answer)
        text = prompt if raw else render(tok, [{"role": "user", "content": prompt}], add_generation_prompt=True)
        enc = tok(text, return_tensors="pt", add_special_tokens=raw).to(dev)
        import torch

        with torch.no_grad():
            out = net.generate(**enc, max_new_tokens=max_new_tokens, do_sample=temperature > 0,
                               temperature=temperature if temperature > 0 else None,
                               pad_token_id=tok.pad_token_id, eos_token_id=sorted(stops))
        typer.echo(tok.decode(cut_at_stop(out[0, enc["input_ids"].shape[1]:].tolist(), stops, keep=False),
                              skip_special_tokens=True))
