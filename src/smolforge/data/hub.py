"""Datasets by their Hugging Face Hub names, offline, as one JSONL file the rest of smolforge reads.

`--dataset-name NAME [--dataset-config C] [--dataset-split S] [--dataset-column COL]` names one of:
- a `datasets.Dataset.save_to_disk` directory (a Dataset or a DatasetDict: the split picks one);
- a local directory laid out like a Hub dataset (data files `datasets.load_dataset` reads: parquet,
  jsonl, csv, ... under `data/` or split-named files);
- a Hub name (`wikitext`, `tatsu-lab/alpaca`) that `datasets.load_dataset` has already put in the
  local Hugging Face cache: it is read offline (no network), so a name not cached fails at once.

`by_name` is the one answer every command (`--dataset-name` of train, eval, launch, distill, split
train; `data show NAME`) and every spec (`dataset_name`: config.NamedDataset, read at submit) asks. The rows are written
once into `$SMOLFORGE_HOME/datasets/<name>-<split>-<fingerprint>.jsonl`; that file is what a command
reads and what a job uploads to the coordinator, as any JSONL. The row shapes
(text/alpaca/chat/prompt_completion) are those of JSONL files: `formats.detect_format` decides.
"""

from __future__ import annotations

import hashlib
import os
import re
from pathlib import Path
from typing import Any, Callable, TypeVar

from smolforge.config import EVAL_SPLIT_KEY, NAMED_DATASET_KEYS, NamedDataset
from smolforge.data.formats import detect_format
from smolforge.data.synthetic import BUILTIN_DATASETS
from smolforge.errors import SmolforgeError
from smolforge.paths import home

_OFFLINE = ("HF_DATASETS_OFFLINE", "HF_HUB_OFFLINE")

Spell = Callable[[str], str]  # a NAMED_DATASET_KEYS key as the user wrote it: a flag, or a spec field


def as_flag(key: str) -> str:
    """`dataset_split` as the commands spell it: `--dataset-split`."""
    return "--" + key.replace("_", "-")


def as_field(key: str) -> str:
    """`dataset_split` as a spec spells it: as it is."""
    return key


def _load_call(name: str, config: str | None, split: str) -> str:
    """The `datasets` call that puts this dataset in the cache, as Python (for the fix line)."""
    return f"datasets.load_dataset({name!r}{f', {config!r}' if config else ''}, split={split!r})"


def _missing(name: str, config: str | None, split: str, why: str, spell: Spell) -> SmolforgeError:
    call = _load_call(name, config, split)
    return SmolforgeError(
        f"dataset {name}{f' ({config})' if config else ''} split {split} is not in the local Hugging Face cache"
        f" and this smolforge reads datasets offline ({why})",
        fix=f"on a machine with internet run: python -c \"import datasets; {call}\" and copy its "
            f"~/.cache/huggingface/datasets here (or .save_to_disk('DIR') there and pass {spell('dataset_name')} DIR)")


def _is_saved(path: Path) -> bool:
    """A `save_to_disk` directory: a Dataset (state.json) or a DatasetDict (dataset_dict.json)."""
    return (path / "state.json").is_file() or (path / "dataset_dict.json").is_file()


def load_rows(name: str, config: str | None = None, split: str = "train", spell: Spell = as_flag) -> Any:
    """The `datasets.Dataset` that NAME names (see the module doc), read without network.

    Raises SmolforgeError (exit 2): a name not cached (with the command that caches it), a split the
    dataset lacks (naming those it has), a config given with a save_to_disk directory."""
    import datasets  # heavy (pyarrow, pandas): only when a dataset is named

    datasets.disable_progress_bars()
    datasets.logging.set_verbosity_error()  # "Using the latest cached version ... (offline mode)": expected here

    path = Path(name).expanduser()
    if path.is_dir() and _is_saved(path):
        if config:
            raise SmolforgeError(f"{spell('dataset_config')} {config}: {name} is a save_to_disk directory, which has "
                                 "no configs", fix=f"drop {spell('dataset_config')}")
        loaded = datasets.load_from_disk(str(path))
        if isinstance(loaded, datasets.DatasetDict):
            if split not in loaded:
                raise SmolforgeError(f"{name} has no split {split!r}",
                                     fix=f"pass {spell('dataset_split')} one of {', '.join(loaded)}")
            return loaded[split]
        return loaded
    saved = {k: os.environ.get(k) for k in _OFFLINE}
    os.environ.update({k: "1" for k in _OFFLINE})
    offline = datasets.config.HF_HUB_OFFLINE
    datasets.config.HF_HUB_OFFLINE = True  # read at import: the environment alone is too late here
    try:
        return datasets.load_dataset(str(path) if path.is_dir() else name, config, split=split)
    except ValueError as err:  # an unknown split, or a config not cached (naming those that are)
        lines = str(err).splitlines()
        if "split" in lines[0].lower() and "find cache" not in lines[0]:
            raise SmolforgeError(f"dataset {name}: {lines[0]}", fix=f"pass {spell('dataset_split')} SPLIT (e.g. train)") from None
        raise _missing(name, config, split, "; ".join(lines), spell) from None
    except Exception as err:  # not cached: datasets' own error types differ by version
        raise _missing(name, config, split, f"{type(err).__name__}: {str(err).splitlines()[0] if str(err) else ''}",
                       spell) from None
    finally:
        datasets.config.HF_HUB_OFFLINE = offline
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


def _shape(rows: Any, name: str, column: str | None, spell: Spell) -> Any:
    """The rows with a shape `detect_format` knows: COL renamed to `text` when given, else as they are."""
    columns = list(rows.column_names)
    if column is not None:
        if column not in columns:
            raise SmolforgeError(f"{spell('dataset_column')} {column}: {name} has no such column",
                                 fix=f"pass one of {', '.join(columns)}")
        return rows.select_columns([column]).rename_column(column, "text") if column != "text" \
            else rows.select_columns(["text"])
    if len(rows) == 0:
        raise SmolforgeError(f"dataset {name} has no rows", fix=f"pick another {spell('dataset_split')}")
    if detect_format(rows[0]) is None:
        raise SmolforgeError(f"cannot tell the format of {name} from its columns {columns}",
                             fix=f"pass {spell('dataset_column')} COL (the text column), or use a dataset with "
                                 "instruction/output, messages, prompt/completion or text columns")
    return rows


def dataset_to_jsonl(name: str, config: str | None = None, split: str | None = None,
                     column: str | None = None, out_dir: str | Path | None = None, spell: Spell = as_flag) -> Path:
    """NAME's rows as one JSONL file (made once per dataset fingerprint; see the module doc).

    Returns the file's path (default under $SMOLFORGE_HOME/datasets/). Raises SmolforgeError as
    `load_rows`, or for a column that is not there / rows of no known shape."""
    split = split or "train"
    rows = _shape(load_rows(name, config, split, spell), name, column, spell)
    key = "|".join([name, config or "", split, column or "", rows._fingerprint])
    slug = re.sub(r"[^A-Za-z0-9_.-]+", "_", Path(name).name or name).strip("._") or "dataset"
    out = Path(out_dir) if out_dir else home() / "datasets"
    out.mkdir(parents=True, exist_ok=True)
    path = out / f"{slug}-{split}-{hashlib.sha256(key.encode()).hexdigest()[:12]}.jsonl"
    if not path.is_file():
        tmp = path.with_suffix(f".tmp{os.getpid()}")
        rows.to_json(str(tmp), lines=True, force_ascii=False)
        tmp.replace(path)
    return path


def by_name(name: str, config: str | None = None, split: str | None = None, column: str | None = None,
            spell: Spell = as_flag, split_key: str = "dataset_split") -> str:
    """The one answer to "a dataset named by the user" (`--dataset-name` of every command, `dataset_name`
    of every spec): a built-in set ('bundled', 'digits', ...) or a local JSONL file as it is (it has no
    config, split or column); else a Hub name or dataset directory written once as JSONL
    (`dataset_to_jsonl`), its path returned. SmolforgeError (exit 2) for a name not cached, with the
    command that caches it; SPELL names the keys in messages as the user wrote them (flags or fields),
    SPLIT_KEY the key that gave SPLIT (`dataset_eval_split` for a held-out split)."""
    if name in BUILTIN_DATASETS or Path(name).expanduser().is_file():
        keys = (NAMED_DATASET_KEYS[1], split_key, NAMED_DATASET_KEYS[3])
        given = [key for key, value in zip(keys, (config, split, column)) if value is not None]
        if given:
            raise SmolforgeError(f"{spell(given[0])}: {name} is a local dataset, which has none",
                                 fix=f"drop {spell(given[0])}")
        return name
    return str(dataset_to_jsonl(name, config, split, column, spell=spell))


Section = TypeVar("Section", bound=NamedDataset)


def resolved(section: Section) -> Section:
    """SECTION (a spec's `NamedDataset` part) with its dataset by name read (`by_name`) into its file
    field, the name fields cleared, and its `dataset_eval_split` (where it has a held-out file: `EVAL_FILE`)
    read into that file; as it is when it names a file."""
    if section.dataset_name is None:
        return section
    named = [section.dataset_name, section.dataset_config, section.dataset_split, section.dataset_column]
    update: dict[str, Any] = {section.DATASET_FILE: by_name(*named, spell=as_field),
                              **{key: None for key in NAMED_DATASET_KEYS}}
    eval_split = getattr(section, EVAL_SPLIT_KEY, None) if section.EVAL_FILE else None
    if eval_split is not None:
        named[2] = eval_split
        update.update({section.EVAL_FILE: by_name(*named, spell=as_field, split_key=EVAL_SPLIT_KEY), EVAL_SPLIT_KEY: None})
    return section.model_copy(update=update)


def resolve_in(section: dict[str, Any], file_key: str, eval_key: str | None = None) -> dict[str, Any]:
    """A spec section as a dict (a job spec before it is validated): its `dataset_name` [...] read into
    FILE_KEY (`by_name`) when it names no file too, and its `dataset_eval_split` into EVAL_KEY (the
    section's held-out file, when it has one: `data.eval_path`); as it is otherwise (both, or a companion
    without a name, are the spec's validation's to refuse: `NamedDataset`)."""
    if section.get("dataset_name") is None or section.get(file_key) is not None:
        return section
    named = [section.get(key) for key in NAMED_DATASET_KEYS]
    eval_split = section.get(EVAL_SPLIT_KEY) if eval_key and section.get(eval_key) is None else None
    out = {k: v for k, v in section.items() if k not in NAMED_DATASET_KEYS}
    out[file_key] = by_name(*named, spell=as_field)
    if eval_key and eval_split is not None:
        out[eval_key] = by_name(named[0], named[1], eval_split, named[3], spell=as_field, split_key=EVAL_SPLIT_KEY)
        del out[EVAL_SPLIT_KEY]
    return out
