"""Load one stage of a model and nothing else: built on the meta device, its tensors read by key.

Why: a stage exists so that a model too big for one machine can be served by several. Loading the
whole model and then cutting it (what `cut` does to a model in memory) needs the whole model on every
stage's machine for a moment, so a model that fits no single machine would fail on all of them.
Here the model is constructed on the meta device (shapes, no storage), cut to the stage's layers,
and only the stage's modules get storage; each of their tensors is read from the checkpoint's
safetensors by its HF name (one tensor in memory beyond the stage at a time), with the adapters
merged into that one tensor as the export does (`models/export/merge.py`). The first stage reads
the embeddings, the last the final norm and the head; a tied head reads the embedding matrix (and
gets its own copy, with the head's delta, when an adapter changes it: `models/tied.py`).

Buffers that are not in a checkpoint (the rotary embedding's inverse frequencies) are rebuilt from
the config on the stage's device. What cannot merge tensor by tensor (Houlsby adapters, prefix and
prompt tuning) is the caller's to load the old way (`mergeable`).

A pipeline-training rank needs more than its stage's modules: the optimizer's integer ids and the
checkpoints are keyed by the whole model's parameters, and PEFT wraps the whole model. So it takes
the whole model as a skeleton (`skeleton`: on the meta device) and `materialize` gives storage, read
by key, only to the parameters its stage holds; every other one gets a tensor with no elements (its
number of dimensions kept), so the model moves, wraps and counts like a loaded one.
"""

from __future__ import annotations

from pathlib import Path
from typing import Sequence

import torch

from smolforge.errors import SmolforgeError
from smolforge.models.partition import Stage, arch_of, check_bounds

TIED_SOURCES = ("model.embed_tokens.weight", "transformer.wte.weight")  # where a tied head's weight lives


def mergeable(adapters: Sequence[str | Path]) -> bool:
    """True when every adapter folds into the weights tensor by tensor (LoRA, IA3, a full fine-tune)."""
    from smolforge.models.peft import peft_method
    from smolforge.models.peft_methods import adapter_method

    return all(peft_method(adapter_method(Path(a))).merges for a in adapters)


def _checkpoint_key(hf_name: str, available: set[str], tied: bool) -> str:
    if hf_name in available:
        return hf_name
    if tied and hf_name.endswith("lm_head.weight"):
        for key in TIED_SOURCES:
            if key in available:
                return key
    raise SmolforgeError(f"the checkpoint has no tensor {hf_name}", where=hf_name,
                         fix="re-save the model with save_pretrained (safetensors) from the transformers version "
                             "it was trained with")


def _meta_model(config, dtype: torch.dtype):
    from transformers import AutoModelForCausalLM

    with torch.device("meta"):
        return AutoModelForCausalLM.from_config(config, dtype=dtype)


def _generation_config(base_dir: Path, net):
    """The checkpoint's generation_config.json (Llama 3's list of eos ids lives only there), else the config's."""
    from transformers import GenerationConfig

    try:
        return GenerationConfig.from_pretrained(base_dir)
    except OSError:
        return net.generation_config


def skeleton(model: str, *, device: torch.device | str = "cpu", dtype: str | torch.dtype = "fp32",
             training: bool = False):
    """The whole model on the meta device (shapes, no storage), its checkpoint, and the dtype it will hold.

    Its generation config is the checkpoint's, as `from_pretrained` would set it."""
    from transformers import AutoConfig

    from smolforge.models.dtypes import pick_dtype
    from smolforge.models.export.merge import MergedModel
    from smolforge.models.export.run import model_dir

    merged = MergedModel(model_dir(model))
    config = AutoConfig.from_pretrained(merged.base_dir)
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else pick_dtype(dtype, str(merged.base_dir),
                                                                          torch.device(device), training=training)
    arch_of(config)  # an unsupported family is refused before anything is built
    net = _meta_model(config, torch_dtype)
    net.generation_config = _generation_config(merged.base_dir, net)
    return net, merged, torch_dtype


def _fill(param: torch.nn.Parameter, value: torch.Tensor) -> None:
    """A meta parameter given `value` in place: the same Python object (a tied pair stays one), now with storage."""
    torch.utils.swap_tensors(param, torch.nn.Parameter(value, requires_grad=param.requires_grad))


def materialize(net, keep: set[int], merged, device: torch.device | str, dtype: torch.dtype) -> dict:
    """The parameters whose id is in `keep` read by key from `merged` onto `device`; the others emptied.

    Parameters keep their identity (a tied pair stays one `Parameter`); buffers not in a checkpoint
    (rotary frequencies) are rebuilt from the config. Returns what was read, as `load_stage` does."""
    dev = torch.device(device)
    available = set(merged.shapes())
    tied = bool(getattr(net.config, "tie_word_embeddings", False))
    read = {"tensors": 0, "elements": 0, "bytes": 0}
    with torch.no_grad():
        for name, param in net.named_parameters():  # a tied matrix once, under the embedding's name
            if id(param) not in keep:
                _fill(param, torch.empty((0,) * param.ndim, dtype=param.dtype, device=dev))
                continue
            value = merged.tensor(_checkpoint_key(name, available, tied))
            _fill(param, value.to(dev, param.dtype if param.dtype.is_floating_point else value.dtype))
            read["tensors"] += 1
            read["elements"] += value.numel()
            read["bytes"] += value.numel() * value.element_size()
            del value
    for module in net.modules():
        if hasattr(module, "inv_freq") and getattr(module, "config", None) is not None:
            fresh = type(module)(config=module.config)  # rotary embeddings: in no checkpoint
            for key, buf in fresh.named_buffers(recurse=False):
                setattr(module, key, buf.to(dev))
    left = [n for n, t in [*net.named_parameters(), *net.named_buffers()] if t.is_meta]
    if left:
        raise SmolforgeError(f"{left[0]} has no value after loading a stage ({len(left)} such tensors)",
                             where=str(merged.base_dir),
                             fix="this model's family is not supported for stage loading; use the ddp strategy")
    return read


def load_stage(model: str, bounds: Sequence[int], index: int, *, adapters: Sequence[str | Path] = (),
               device: torch.device | str = "cpu", dtype: str | torch.dtype = "fp32") -> tuple[Stage, dict]:
    """Stage `index` of `model` cut at `bounds`, holding only its own tensors, in `dtype` on `device`.

    Returns the stage and what was read from the checkpoint ({"tensors", "elements", "bytes"}, bytes as
    stored there): the proof that nothing else was."""
    from transformers import AutoConfig

    from smolforge.models.dtypes import pick_dtype
    from smolforge.models.export.merge import MergedModel
    from smolforge.models.export.run import model_dir

    dev = torch.device(device)
    merged = MergedModel(model_dir(model), list(adapters))
    config = AutoConfig.from_pretrained(merged.base_dir)
    if merged.untie is not None:  # an adapter on a tied head: the merged model is untied (models/tied.py)
        config.tie_word_embeddings = False
    torch_dtype = dtype if isinstance(dtype, torch.dtype) else pick_dtype(dtype, str(merged.base_dir), dev)
    arch = arch_of(config)
    check_bounds(list(bounds), arch.num_layers)
    if not 0 <= index < len(bounds) - 1:
        raise SmolforgeError(f"stage {index} does not exist: the bounds {list(bounds)} make {len(bounds) - 1} stages",
                             fix="pick a stage index from 0 to the number of stages minus one")
    net = _meta_model(config, torch_dtype)
    stage = Stage(net, bounds[index], bounds[index + 1], embeddings=index == 0, head=index == len(bounds) - 2)
    stage.generation_config = _generation_config(merged.base_dir, net)  # its eos ids end a request
    del net  # the stage holds its own modules; the rest never had storage
    stage.to_empty(device=dev)
    available = set(merged.shapes())
    tied = stage.tied = bool(getattr(config, "tie_word_embeddings", False))
    read = {"tensors": 0, "elements": 0, "bytes": 0}
    with torch.no_grad():
        for local, param in stage.state_dict(keep_vars=True).items():
            # merged in the stage's dtype: rounded once (a bf16 checkpoint served in fp32 keeps its delta)
            value = merged.tensor(_checkpoint_key(stage.hf_name(local), available, tied),
                                  param.dtype if param.dtype.is_floating_point else None, count=read)
            param.copy_(value.to(param.dtype))
            del value
    if stage.tied and stage.has_embeddings and stage.has_head:
        stage.lm_head.weight = stage.embed.weight  # to_empty gave the tied pair two storages: one again
    if getattr(stage, "rotary_emb", None) is not None:  # in no checkpoint: rebuilt from the config, where it runs
        stage.rotary_emb = type(stage.rotary_emb)(config=config).to(dev)
    return stage.eval(), read


WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".bin.index.json", ".pt", ".pth", ".gguf")


def stage_keys(model_dir: str | Path, bounds: Sequence[int], index: int) -> list[str]:
    """The checkpoint keys stage `index` of the model at `model_dir` reads (`load_stage`'s selection:
    its layers, the embeddings on the first stage, the final norm and head on the last, a tied head's
    embedding matrix there too), from the config and the safetensors headers: nothing loaded."""
    from transformers import AutoConfig

    from smolforge.models.export.merge import MergedModel

    merged = MergedModel(model_dir)
    config = AutoConfig.from_pretrained(merged.base_dir)
    check_bounds(list(bounds), arch_of(config).num_layers)
    if not 0 <= index < len(bounds) - 1:
        raise SmolforgeError(f"stage {index} does not exist: the bounds {list(bounds)} make {len(bounds) - 1} stages",
                             fix="pick a stage index from 0 to the number of stages minus one")
    net = _meta_model(config, torch.float32)
    stage = Stage(net, bounds[index], bounds[index + 1], embeddings=index == 0, head=index == len(bounds) - 2)
    available, tied = set(merged.shapes()), bool(getattr(config, "tie_word_embeddings", False))
    return sorted({_checkpoint_key(stage.hf_name(local), available, tied) for local in stage.state_dict(keep_vars=True)})


def write_stage_part(model_dir: str | Path, bounds: Sequence[int], index: int | None, out: str | Path) -> Path:
    """A model directory holding only what stage `index` loads: every file but the weights (config,
    generation config, tokenizer), and one `model.safetensors` with only the stage's tensors, as the
    checkpoint stores them. What a stage's node receives instead of the whole model (models that
    travel), and what `load_stage` reads from there as from the whole checkpoint. `index` None: no
    tensor at all (an empty `model.safetensors`): the config part a pipeline rank builds its skeleton
    and plans its cut with before it knows its stage (`skeleton` opens it as a model)."""
    import shutil

    from safetensors.torch import save_file

    from smolforge.models.export.merge import MergedModel

    src, out = Path(model_dir), Path(out)
    out.mkdir(parents=True, exist_ok=True)
    for path in sorted(src.iterdir()):
        if path.is_file() and not path.name.endswith(WEIGHT_SUFFIXES) and not path.name.startswith("."):
            shutil.copyfile(path, out / path.name)
    merged = MergedModel(src)
    keys = stage_keys(src, bounds, index) if index is not None else []
    save_file({key: merged.tensor(key).contiguous() for key in keys}, str(out / "model.safetensors"),
              metadata={"format": "pt"})
    return out


def part_tensors(part_dir: str | Path):
    """The tensors of a stage's part (`write_stage_part`), to `materialize` from: only the part's own
    safetensors file is ever opened."""
    from smolforge.models.export.merge import MergedModel

    return MergedModel(part_dir)


def checkpoint_fingerprint(net, merged, dtype: torch.dtype) -> str:
    """`models.partition.fingerprint` of the model `net` (a `skeleton`, its embeddings loaded or not) as
    `merged`'s checkpoint holds it: the sampled embedding rows (`fingerprint_rows`, about 64 rows)
    are read from the safetensors alone, cast to `dtype`, so a holder without the embeddings (a split
    trunk) gets the same hash as one that loaded them. Adapters are not folded in (a skeleton has none)."""
    from safetensors import safe_open

    from smolforge.models.partition import fingerprint_of, fingerprint_rows

    owner = {id(m): name for name, m in net.named_modules()}
    key = _checkpoint_key(f"{owner[id(net.get_input_embeddings())]}.weight", set(merged.shapes()), False)
    for path in merged.files:
        with safe_open(str(path), "pt") as f:
            if key in f.keys():
                sliced = f.get_slice(key)
                rows = sliced[fingerprint_rows(sliced.get_shape()[0])]
                return fingerprint_of(net.config, rows.to(dtype))
    raise SmolforgeError(f"the checkpoint has no tensor {key}", where=str(merged.base_dir),
                         fix="re-save the model with save_pretrained (safetensors)")
