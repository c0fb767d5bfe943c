"""Pydantic specs for jobs: YAML files plus `--set a.b=c` overrides.

One spec type per job keeps the CLI, the REST API and the Python API in agreement: each of them
builds the same object and validation errors read the same everywhere.
"""

from __future__ import annotations

import copy
import difflib
from collections import deque
from pathlib import Path
from typing import Annotated, Any, Callable, ClassVar, Literal

import yaml
from pydantic import BaseModel, BeforeValidator, ConfigDict, Field, ValidationError, field_validator, model_validator

from smolforge.errors import SmolforgeError
from smolforge.input_rules import first_problem, shown
from smolforge.paths import not_a_regular_file

# The names of a model's weights dtype (`--dtype`, spec fields `dtype`); what each means at load time
# is smolforge.models.dtypes. Here, at the bottom layer, so every spec and flag checks them alike.
DTYPE_CHOICES: tuple[str, ...] = ("auto", "bf16", "fp16", "fp32")
DTYPE_HELP = ("weights dtype: fp32 (default), bf16, fp16, or auto (the checkpoint's own where this device runs "
              "it well, else fp32)")
# Spellings people also write (torch's, numpy's); normalised at the config/CLI edge.
_ALIASES = {"bfloat16": "bf16", "float16": "fp16", "half": "fp16", "float32": "fp32", "float": "fp32"}


def normalise_dtype(value: Any) -> Any:
    """'bfloat16' → 'bf16' etc.; anything else unchanged (the Literal then names the choices)."""
    if isinstance(value, str):
        low = value.strip().lower()
        return _ALIASES.get(low, low)
    return value


PeftMethod = Literal["lora", "prefix", "prompt", "ia3", "adapter", "none"]


def _dtype_choice(value: Any) -> Any:
    """'bfloat16' etc. read as 'bf16'; an unknown name is one sentence that names the value and the choices."""
    value = normalise_dtype(value)
    if isinstance(value, str) and value not in DTYPE_CHOICES:
        raise ValueError(f"{value!r} is not a dtype: use one of {', '.join(DTYPE_CHOICES)} (e.g. bf16)")
    return value


# The weights' dtype of every model load (smolforge.models.dtypes).
ModelDtype = Annotated[Literal["auto", "bf16", "fp16", "fp32"], BeforeValidator(_dtype_choice)]
DataFormat = Literal["auto", "alpaca", "chat", "prompt_completion", "text"]


# The learning rate each PEFT method gets when none is given. One rate cannot suit them all: prompt and
# prefix tuning move a few virtual-token vectors through a frozen model and need rates 6-20x LoRA's,
# full fine-tuning moves every weight and wants a lower one. Chosen from a sweep on tiny-llama /
# bundled (BENCHMARKS.md, "Default learning rate per PEFT method"): per method the smallest rate whose
# held-out loss is within 0.1 nats of the best at 100 steps and, where measured, at 30. A tiny model tolerates high
# rates; a large pretrained one may want lower (pass lr).
DEFAULT_LR: dict[str, float] = {
    "lora": 5e-3, "prefix": 1e-1, "prompt": 3e-2, "ia3": 1e-1, "adapter": 5e-3, "none": 1e-3,
}


def default_lr(method: str) -> float:
    """The learning rate `method` trains at when the user gives none (see DEFAULT_LR)."""
    return DEFAULT_LR[method]


class Spec(BaseModel):
    """Every spec: unknown keys refused, and what it is given held to the input rules (smolforge.input_rules:
    UTF-8 text without NUL within a length, finite 64-bit numbers) whichever road it came by, a YAML file,
    `--set`, the REST API or the Python API. NaN and infinity are refused for every float field."""

    model_config = ConfigDict(extra="forbid", protected_namespaces=(), allow_inf_nan=False)

    @model_validator(mode="before")
    @classmethod
    def _input_rules(cls, data: Any) -> Any:
        found = first_problem(data) if isinstance(data, dict) else None
        if found:
            raise ValueError(f"{shown(found[0], 200)}: {found[1]}" if found[0] else found[1])
        return data


class PeftSpec(Spec):
    method: PeftMethod = "lora"
    r: int = Field(8, ge=1, description="LoRA rank")
    alpha: float = Field(16, gt=0, description="LoRA alpha")
    dropout: float = Field(0.05, ge=0, lt=1)
    target_modules: list[str] | str | None = Field(None, description="None picks every linear layer of the blocks")
    num_virtual_tokens: int = Field(8, ge=1, description="prefix / prompt tuning length")
    adapter_size: int = Field(16, ge=1, description="Houlsby bottleneck width")
    reduction_factor: int | None = Field(
        None, ge=1, description="Houlsby bottleneck as hidden size / this (the seeds' adapter key); "
                                "when set it replaces adapter_size")
    # Prompt tuning starts from real token embeddings (SAMPLE_VOCAB: random vocabulary entries; TEXT:
    # the embeddings of prompt_tuning_init_text), so the frozen model first sees a prompt it could
    # have read; RANDOM is peft's continuous N(0, 1) init, off the embedding manifold, which makes the
    # model worse than the base before training can help (the seeds' keys, as peft spells them).
    prompt_tuning_init: Literal["SAMPLE_VOCAB", "TEXT", "RANDOM"] = Field(
        "SAMPLE_VOCAB", description="prompt tuning init: SAMPLE_VOCAB (default), TEXT or RANDOM")
    prompt_tuning_init_text: str | None = Field(None, description="the text TEXT init embeds")

    @field_validator("prompt_tuning_init", mode="before")
    @classmethod
    def _upper(cls, value: Any) -> Any:
        return value.upper() if isinstance(value, str) else value

    @model_validator(mode="after")
    def _text_needs_text(self) -> "PeftSpec":
        if self.prompt_tuning_init == "TEXT" and not (self.prompt_tuning_init_text or "").strip():
            raise ValueError("prompt_tuning_init TEXT needs prompt_tuning_init_text (the words whose embeddings "
                             "start the virtual tokens), e.g. \"Answer the question:\"")
        return self


# A dataset by name (`--dataset-name` and its companions; the same keys in every spec that names a data
# file): smolforge.data.hub.by_name reads it offline and writes it once as JSONL.
NAMED_DATASET_KEYS: tuple[str, ...] = ("dataset_name", "dataset_config", "dataset_split", "dataset_column")
# With dataset_name, in a section that has a held-out file too (`DataSpec.eval_path`): the named dataset's
# split read into that file, as TRL's `dataset_test_split` (e.g. wikitext's `validation`).
EVAL_SPLIT_KEY = "dataset_eval_split"


def dataset_choice_problem(file_key: str, file: Any, named: dict[str, Any],
                           spell: Callable[[str], str] = lambda key: key) -> str | None:
    """What is wrong with a dataset given as a file (FILE_KEY = FILE) and/or by name (NAMED: the
    NAMED_DATASET_KEYS given), as a sentence naming both spellings (SPELL: a key as the user wrote it,
    a spec field or a flag); None when it is one or the other. The one rule for flags and specs."""
    name = named.get("dataset_name")
    if name is None:
        extra = [key for key in NAMED_DATASET_KEYS[1:] if named.get(key) is not None]
        return f"{spell(extra[0])} needs {spell('dataset_name')}" if extra else None
    if file is not None:
        return f"both {spell(file_key)} {file} and {spell('dataset_name')} {name}"
    return None


def eval_split_problem(eval_key: str, eval_file: Any, name: Any, eval_split: Any,
                       spell: Callable[[str], str] = lambda key: key) -> str | None:
    """What is wrong with a held-out set given as a file (EVAL_KEY = EVAL_FILE) and/or as the named
    dataset's split (`dataset_eval_split`), as a sentence naming both spellings; None when fine. The
    one rule for flags and specs, beside `dataset_choice_problem`."""
    if eval_split is None:
        return None
    if name is None:
        return f"{spell(EVAL_SPLIT_KEY)} needs {spell('dataset_name')}"
    if eval_file is not None:
        return f"both {spell(eval_key)} {eval_file} and {spell(EVAL_SPLIT_KEY)} {eval_split}: give one"
    return None


def check_call_dataset(where: str, file_key: str, file: Any, named: dict[str, Any], eval_file: Any = None,
                       required: bool = True) -> dict[str, Any]:
    """A seed call's dataset (`Orchestrator.create_*_tasks`), a file (FILE_KEY = FILE) or by name (NAMED:
    `dataset_name` and its companions; `dataset_eval_split` beside the call's held-out file EVAL_FILE), checked by the rules the commands and
    specs follow (`config.dataset_choice_problem`, `eval_split_problem`), in the call's own argument names.
    Returns the NAMED keys given. SmolforgeError (where: the call) for a file and a name, a companion
    without the name, an eval split beside a held-out file, or (REQUIRED) neither file nor name."""
    given = {key: value for key, value in named.items() if value is not None}
    problem = dataset_choice_problem(file_key, file, given) or eval_split_problem(
        "eval_path", eval_file, given.get("dataset_name"), given.get(EVAL_SPLIT_KEY))
    if problem is None and required and file is None and not given:
        problem = f"no dataset: give {file_key} or dataset_name"
    if problem:
        raise SmolforgeError(problem, where=where, fix=f"pass one of {file_key}=FILE and dataset_name=NAME "
                             "(with dataset_config=, dataset_split=, dataset_column=, dataset_eval_split= as needed)")
    return given


class NamedDataset(Spec):
    """A spec section that names its data as a file (the field `DATASET_FILE`) or by name: `dataset_name`
    [`dataset_config`, `dataset_split`, `dataset_column`], as the commands' `--dataset-name` flags. One or
    the other (both, or a companion without the name, is refused naming the fields). The name is resolved
    into a JSONL file where the spec is submitted (`smolforge.data.hub.resolved`; a job uploads it as any
    JSONL), so what runs sees the file field only."""

    DATASET_FILE: ClassVar[str] = "path"
    EVAL_FILE: ClassVar[str | None] = None  # the held-out file `dataset_eval_split` stands for (DataSpec: eval_path)

    dataset_name: str | None = Field(None, description="a Hugging Face dataset by name, read offline from the local "
                                     "HF cache, or a save_to_disk / Hub-layout directory: written once as JSONL and "
                                     "used in place of the data file (e.g. wikitext)")
    dataset_config: str | None = Field(None, description="with dataset_name: its config (e.g. wikitext-2-raw-v1)")
    dataset_split: str | None = Field(None, description="with dataset_name: its split (default train)")
    dataset_column: str | None = Field(None, description="with dataset_name: the text column (default: rows shaped "
                                       "as text/alpaca/chat)")

    @model_validator(mode="after")
    def _file_or_name(self) -> "NamedDataset":
        file = getattr(self, self.DATASET_FILE) if self.DATASET_FILE in self.model_fields_set else None
        problem = dataset_choice_problem(self.DATASET_FILE, file, self.named_dataset())
        if problem:
            raise ValueError(f"{problem}: give one of {self.DATASET_FILE} and dataset_name")
        if file is None and self.dataset_name is None and getattr(self, self.DATASET_FILE) is None:
            raise ValueError(f"no dataset: give {self.DATASET_FILE} (a JSONL file or 'bundled') or dataset_name")
        if self.EVAL_FILE is not None:
            problem = eval_split_problem(self.EVAL_FILE, getattr(self, self.EVAL_FILE),
                                         self.dataset_name, getattr(self, EVAL_SPLIT_KEY))
            if problem:
                raise ValueError(problem)
        return self

    def named_dataset(self) -> dict[str, Any]:
        """The NAMED_DATASET_KEYS given (not None)."""
        return {key: getattr(self, key) for key in NAMED_DATASET_KEYS if getattr(self, key) is not None}


class DataSpec(NamedDataset):
    EVAL_FILE: ClassVar[str | None] = "eval_path"

    path: str | None = Field(None, description="JSONL file, or 'bundled' for the generated task set (or dataset_name)")
    format: DataFormat = "auto"
    eval_path: str | None = Field(None, description="held-out JSONL; default: a split of `path` (or "
                                  "dataset_eval_split)")
    dataset_eval_split: str | None = Field(None, description="with dataset_name: its split held out for eval, read "
                                           "as eval_path (e.g. validation; TRL's dataset_test_split)")
    eval_fraction: float = Field(0.1, ge=0, lt=1)
    max_eval_samples: int | None = 200
    max_samples: int | None = None
    max_length: int = Field(256, ge=8)
    packing: bool = False
    skip_bad_lines: bool = False


class TrainConfig(Spec):
    model: str
    data: DataSpec
    peft: PeftSpec = PeftSpec()
    output_dir: str = "outputs/run"
    max_steps: int | None = Field(None, ge=1, description="overrides epochs when set")
    epochs: float = Field(1.0, gt=0)
    batch_size: int = Field(8, ge=1)
    grad_accum: int = Field(1, ge=1)
    lr: float | None = Field(None, gt=0, description="default: per PEFT method (config.DEFAULT_LR)")
    weight_decay: float = Field(0.0, ge=0)
    optimizer: Literal["adamw", "sgd"] = Field("adamw", description="adamw, or plain sgd (no momentum)")
    warmup_steps: int = Field(0, ge=0)
    scheduler: Literal["cosine", "linear", "constant"] = "cosine"
    min_lr_ratio: float = Field(0.0, ge=0, le=1)
    max_grad_norm: float | None = 1.0
    gradient_checkpointing: bool = False
    precision: Literal["auto", "fp32", "bf16", "fp16"] = "auto"
    dtype: ModelDtype = Field("fp32", description="the weights' dtype: fp32, bf16, fp16 or auto (the checkpoint's "
                              "own where the device runs it well); a LoRA base in bf16 keeps its adapter in fp32")
    eval_every: int = Field(0, ge=0, description="0: evaluate at the end only")
    eval_accuracy: bool = Field(True, description="exact-match accuracy where the data has answers")
    max_new_tokens: int = Field(16, ge=1)
    save_every: int = Field(0, ge=0, description="0: save at the end only")
    keep_last: int = Field(2, ge=1)
    resume: bool = False
    resume_new_data: bool = Field(False, description="resume over training rows that changed since the checkpoint "
                                  "(another file, max_length or packing): continue at its step in the new order")
    seed: int = 0
    device: str = "auto"
    num_threads: int | None = Field(None, ge=1, description="torch threads; default: the CPUs given")
    log_every: int = Field(10, ge=1)
    quiet: bool = False
    tensorboard: bool | None = Field(None, description="TensorBoard event files under output_dir/tensorboard; "
                                     "default (None): on for `smolforge train`, off for a data-parallel job (there: "
                                     "one run dir per rank, written by the coordinator)")
    wandb: str | None = Field(None, description="W&B project: an offline run (per rank in a data-parallel job) "
                              "under output_dir/wandb; needs smolforge[wandb]")

    @model_validator(mode="after")
    def _lr_for_method(self) -> "TrainConfig":
        """An omitted lr becomes the PEFT method's default here, once, so every reader sees a number."""
        if self.lr is None:
            self.lr = default_lr(self.peft.method)
        return self


MAX_NESTING = 32  # levels of sections and lists in a config, a job spec or one --set value
MAX_VALUES = 100_000  # values in one of them, YAML aliases expanded


def check_nesting(value: Any, where: str) -> Any:
    """Refuse a parsed document nested deeper than MAX_NESTING or holding more than MAX_VALUES values
    (aliases let a small YAML file expand without bound); returns it. Walked without recursion: the
    parsers, pydantic and `json.dumps` all recurse per level, so 5 000 `[` ended in a RecursionError."""
    stack, seen = [(value, 0)], 0
    while stack:
        item, depth = stack.pop()
        seen += 1
        if depth > MAX_NESTING or seen > MAX_VALUES:
            what = f"nests deeper than {MAX_NESTING} levels" if depth > MAX_NESTING else \
                f"holds more than {MAX_VALUES:,} values (aliases expanded)"
            raise SmolforgeError(what, where=where, fix="write plain sections a few levels deep (e.g. data.max_length: 64)")
        children = item.values() if isinstance(item, dict) else item if isinstance(item, (list, tuple)) else ()
        stack.extend((child, depth + 1) for child in children)
    return value


def _safe_load(text: str, where: str) -> Any:
    """yaml.safe_load, with nesting past the parser's recursion one message (see check_nesting)."""
    try:
        return check_nesting(yaml.safe_load(text), where)
    except RecursionError:
        raise SmolforgeError(f"nests deeper than {MAX_NESTING} levels", where=where,
                             fix="write plain sections a few levels deep (e.g. data.max_length: 64)") from None


def _parse_value(raw: str, where: str = "--set") -> Any:
    try:
        return _safe_load(raw, where)
    except yaml.YAMLError:
        return raw


def apply_overrides(data: dict[str, Any], overrides: list[str], strip_training: bool = True) -> dict[str, Any]:
    """Apply `a.b=c` overrides (values parsed as YAML) to a nested dict, in place: the one `--set` parser.

    `strip_training` drops a leading `training.` (the seeds write training.x for top-level fields);
    job specs route their keys first (smolforge.cluster.control.kinds.apply_job_overrides) and pass False.
    """
    for item in overrides:
        if "=" not in item:
            raise SmolforgeError(f"--set {item!r} is not key=value", fix="write it as --set training.batch_size=16")
        key, raw = item.split("=", 1)
        parts = [p for p in key.strip().split(".") if p]
        if strip_training and parts and parts[0] == "training":
            parts = parts[1:]
        if not parts:
            raise SmolforgeError(f"--set {item!r} has an empty key", fix="write it as --set lr=1e-4")
        if len(parts) > MAX_NESTING:
            raise SmolforgeError(f"--set key {key[:60]!r}... has more than {MAX_NESTING} parts", where="--set",
                                 fix="name a setting, e.g. --set data.max_length=64")
        put_path(data, ".".join(parts), _parse_value(raw, f"--set {'.'.join(parts)[:60]}"), where=f"--set {item!r}")
    return data


def get_path(data: dict[str, Any], dotted: str) -> Any:
    """data["a"]["b"] for "a.b"; None where a part is missing."""
    node: Any = data
    for part in dotted.split("."):
        if not isinstance(node, dict):
            return None
        node = node.get(part)
    return node


def put_path(data: dict[str, Any], dotted: str, value: Any, where: str | None = None) -> None:
    """data["a"]["b"] = value for "a.b", making the sections on the way: the one nested setter (command
    flags, `--set`, job specs). A part that holds a value, not a section, is one message."""
    *parents, last = dotted.split(".")
    node = data
    for part in parents:
        node = node.setdefault(part, {})
        if not isinstance(node, dict):
            raise SmolforgeError(f"{where or dotted}: {part} is not a section", fix="check the key path")
    node[last] = value


Loc = tuple[Any, ...]  # a key path in a document: ("train", "data", "max_length"), list items by index


class SpecFile(dict):
    """A mapping read from a YAML file (`load_yaml`) that remembers where each key was written, so an
    error in a field names it as `file:line` (`spec_error`). `source` is the path; `marks` maps each key
    path (list items by index) to its 1-based line. A value that changed since it was read (a flag or
    --set replaced it) is not the file's: its error names no line. `copy.deepcopy` keeps all of it."""

    def __init__(self, data: dict[str, Any], source: str, marks: dict[Loc, int]):
        super().__init__(data)
        self.source, self.marks = source, marks
        self.loaded = copy.deepcopy(data)  # what the file said, to tell its values from later ones

    def line_of(self, loc: Loc, missing: bool = False) -> int | None:
        """The line of the key at LOC (a pydantic error's `loc`; parts past a value, as a union's branch
        names, are ignored), while its value is still the file's; for a MISSING key, its section's line.
        None where the file did not write it."""
        for end in range(len(loc), -1, -1):
            if loc[:end] in self.marks:
                break
        else:
            return None
        here, then = get_path_loc(self, loc[:end]), get_path_loc(self.loaded, loc[:end])
        if isinstance(here, (dict, list)):  # a section: where the file wrote it
            return self.marks[loc[:end]] if end == len(loc) or missing else None
        return self.marks[loc[:end]] if here == then else None

    def moved(self, data: dict[str, Any], loaded: dict[str, Any], moves: dict[Loc, Loc]) -> "SpecFile":
        """This file after a translation that moved some of its keys (`specs.from_seed_task`: the seeds'
        `dataset` is `train.data.path`): DATA is the translated mapping, LOADED the file's own values
        translated the same way, MOVES each moved key path -> its new one (the keys under it move with it).
        Each key keeps its line at its new path, and a section the move made is at its first key's line,
        so an error at the translated path names the line the file wrote it on."""
        marks: dict[Loc, int] = {}
        made: dict[Loc, int] = {}
        for loc, line in self.marks.items():
            old = next((o for o in moves if loc[:len(o)] == o), None)
            new = loc if old is None else (*moves[old], *loc[len(old):])
            marks[new] = line
            for end in range(1, len(new) if old is not None else 0):
                made[new[:end]] = min(line, made.get(new[:end], line))
        out = SpecFile(data, self.source, {**made, **marks})
        out.loaded = copy.deepcopy(loaded)
        return out

    def place(self, loc: Loc) -> str | None:
        """`file:line` of the key at LOC while its value is the file's (`line_of`); None where it is not."""
        line = self.line_of(loc)
        return f"{self.source}:{line}" if line else None


def place_in(spec: Any, loc: Loc, default: str) -> str:
    """Where a problem with the key at LOC of SPEC is: `file:line` where SPEC was read from a file (a
    `SpecFile`) that wrote it, else DEFAULT (a flag's or the spec's name)."""
    return (spec.place(loc) if isinstance(spec, SpecFile) else None) or default


def placed(err: SmolforgeError, spec: Any) -> SmolforgeError:
    """ERR, a refusal of the spec SPEC, at the `file:line` of the field it names (`err.field`, set by the
    check that refused it, or sent back in a coordinator's 400) where SPEC was read from a file that wrote
    that value (`place_in`); a refusal across settings (`err.fields`) at the line of the first of them
    the file wrote; ERR itself where it names no field or the file wrote none of them (a flag's, a
    --set's). The one place a refusal made after the spec was parsed learns its line."""
    where = next((line for line in (place_in(spec, tuple(f), "") for f in err.fields) if line), "")
    if not where or where == err.where:
        return err
    return SmolforgeError(err.what, where=where, fix=err.fix, fields=err.fields)


def get_path_loc(data: Any, loc: Loc) -> Any:
    """The value at LOC in nested dicts and lists (list items by index); None where a part is missing."""
    for part in loc:
        if isinstance(data, dict):
            data = data.get(part)
        elif isinstance(data, list) and isinstance(part, int) and 0 <= part < len(data):
            data = data[part]
        else:
            return None
    return data


def key_lines(text: str) -> dict[Loc, int]:
    """Each key path of a YAML document (list items by index) -> the 1-based line it starts on, from the
    parser's node marks (`yaml.compose`: the same document `safe_load` read). A node is walked once, where
    it is written (an alias is not walked again: a small file cannot expand into many walks)."""
    marks: dict[Loc, int] = {}
    queue: deque[tuple[Any, Loc]] = deque([(yaml.compose(text, Loader=yaml.SafeLoader), ())])
    seen: set[int] = set()
    while queue:  # in document order: an anchored node's keys are marked where it is written, not at an alias
        node, path = queue.popleft()
        if node is None or id(node) in seen:
            continue
        seen.add(id(node))
        if isinstance(node, yaml.MappingNode):
            for key, value in node.value:
                if isinstance(key, yaml.ScalarNode):
                    marks[(*path, key.value)] = key.start_mark.line + 1
                    queue.append((value, (*path, key.value)))
        elif isinstance(node, yaml.SequenceNode):
            for i, item in enumerate(node.value):
                marks[(*path, i)] = item.start_mark.line + 1
                queue.append((item, (*path, i)))
    return marks


def load_yaml(path: str | Path) -> dict[str, Any]:
    """A config or job spec file as a `SpecFile` (a dict that knows each key's line). SmolforgeError
    (exit 2) for a file that is missing, not UTF-8, not YAML (naming `file:line`) or not a mapping."""
    path = Path(path)
    problem = not_a_regular_file(path)
    if problem == "does not exist":
        raise SmolforgeError(f"config file {path} does not exist", fix="check the --config path")
    if problem:
        raise SmolforgeError(f"config file {path} {problem}, not a YAML file", where=str(path),
                             fix="point --config at the YAML file itself")
    try:
        text = path.read_text(encoding="utf-8")
        data = _safe_load(text, str(path)) or {}
    except UnicodeDecodeError as err:
        raise SmolforgeError(f"{path} is not UTF-8 text (byte {err.start} is 0x{err.object[err.start]:02x})",
                             where=str(path), fix="save the YAML as UTF-8") from err
    except OSError as err:
        raise SmolforgeError(f"cannot read {path}: {err.strerror}", where=str(path),
                             fix="check the file's permissions") from err
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f"{path}:{mark.line + 1}" if mark else str(path)
        raise SmolforgeError(f"invalid YAML: {getattr(err, 'problem', err)}", where=where,
                             fix="fix the YAML syntax at that line") from err
    if not isinstance(data, dict):
        raise SmolforgeError("config must be a mapping of keys to values", where=str(path),
                             fix="write key: value lines at the top level")
    return SpecFile(data, str(path), key_lines(text))


# `--set`/`--override` keys as the seed documents (SmolCluster, SplitLearn, HF Trainer habits) name them ->
# ours, where the meaning is the same: `cli/aliases.py` rewrites them, and `_did_you_mean` offers ours for
# a key close to one of them (`learning_rat` -> `lr`)
SEED_KEYS: dict[str, str] = {
    "learning_rate": "lr", "num_epochs": "epochs", "num_train_epochs": "epochs",
    "gradient_accumulation_steps": "grad_accum", "max_seq_length": "data.max_length",
    "max_train_samples": "data.max_samples", "lora_rank": "peft.r", "lora_r": "peft.r", "lora_alpha": "peft.alpha",
    "lora_dropout": "peft.dropout", "eval_steps": "eval_every", "save_steps": "save_every",
    "logging_steps": "log_every",
}


def _did_you_mean(cls: type[BaseModel], error: dict[str, Any]) -> str:
    """For an unknown key, the section below that has it (a job's `batch_size` → `train.batch_size`), else the
    closest known one at that level (`bach_size` → `batch_size`), or ours for a key close to a seed's name
    (`SEED_KEYS`: `learning_rat` → `lr`)."""
    if error.get("type") != "extra_forbidden":
        return ""
    model: Any = cls
    for part in error["loc"][:-1]:  # walk down nested sections (data.pathh → DataSpec)
        field = getattr(model, "model_fields", {}).get(part)
        model = field.annotation if field is not None else None
        if not (isinstance(model, type) and issubclass(model, BaseModel)):
            return ""
    key = str(error["loc"][-1])
    below = [f"{name}.{key}" for name, f in model.model_fields.items()  # a section's key written above it
             if isinstance(f.annotation, type) and issubclass(f.annotation, BaseModel) and key in f.annotation.model_fields]
    if below:
        return f" (did you mean {below[0]!r}?)"
    close = difflib.get_close_matches(key, list(model.model_fields), n=1)
    if close:
        return f" (did you mean {close[0]!r}?)"
    seed = difflib.get_close_matches(key, list(SEED_KEYS), n=1)
    return f" (did you mean {SEED_KEYS[seed[0]]!r}? the seeds' {seed[0]!r})" if seed else ""


def validate(cls: type[BaseModel], data: dict[str, Any], where: str = "config"):
    """Build a spec, turning pydantic's error list into one SmolforgeError that names each field (its
    `field`: the first refused key path, within DATA)."""
    try:
        return cls.model_validate(data)
    except ValidationError as err:
        raise spec_error(cls, err, where, data if isinstance(data, SpecFile) else None) from err


def spec_error(cls: type[BaseModel], err: ValidationError, where: str = "config",
               file: SpecFile | None = None) -> SmolforgeError:
    """pydantic's error list as one SmolforgeError that names each field (and a likely misspelling).
    Read from a FILE: `where` is `file:line` of the first field the file wrote (each field's line too
    when several are)."""
    errors = err.errors()
    lines = [file.line_of(tuple(e["loc"]), e["type"] == "missing") if file is not None else None for e in errors]
    several = sum(n is not None for n in lines) > 1
    problems = "; ".join(f"{'.'.join(str(x) for x in e['loc']) or '<root>'}{f' (line {n})' if several and n else ''}: "
                         f"{e['msg']}{_did_you_mean(cls, e)}" for e, n in zip(errors, lines))
    first = next((n for n in lines if n is not None), None)
    field = tuple(errors[0]["loc"]) if errors and errors[0]["type"] != "missing" else None
    return SmolforgeError(f"invalid {cls.__name__}: {problems}", field=field,
                          where=f"{file.source}:{first}" if file is not None and first else where,
                          fix="correct or remove " + (f"the key at line {first} of {file.source}" if file is not None
                                                      and first and not several else "those keys")
                          + " (see `smolforge train --help`)")
