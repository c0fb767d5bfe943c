"""Teacher backends, one class each, registered by `@register`: what each needs and produces, and
how its teacher is built. `make_teacher`, `check_run`, the planner and the cluster's distill run ask
the class; nothing else branches on a backend's name.

A new backend is one class here (or in its own module, imported at the end of this one) with
`@register`. No torch at import: `check_run` asks the classes before anything heavy loads.

What a backend needs from the node: a `Loader`, the way a task loads its model there: the weights
(HF cache, `--models-dir`: a node's `models`, Ray resource `model:<name>`) or an Ollama tag (its
`ollama_models`, `ollama:<name>`). Students always load weights.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar, TypeVar

from smolforge.errors import SmolforgeError, in_spec


@dataclass(frozen=True)
class Loader:
    """How a task loads its model on a node, and how a node advertises what it can load that way."""

    name: str  # the node inventory's key (`cluster/nodes/discovery.by_backend`): "hf", "ollama"
    node_attr: str  # the NodeInfo attribute listing what a node holds this way
    resource_prefix: str  # the Ray resource a node advertises per model: prefix + name
    label: str  # how a node's list of such models is labelled next to another list
    how: str  # "as weights (...)": how a missing model was looked for
    none_held: str  # a node's list when empty
    where: str  # appended to "does not hold model M" ("" or " in Ollama")
    weights: bool  # the model's files: they can travel to a node, and presets build anywhere
    anywhere: bool = False  # nothing to hold: every node may run the task (a model behind a URL)

    def missing_fix(self, model: str, role: str) -> str:
        """What to do when no node holds `model` this way."""
        if self.weights:
            return (f"put {model} on a worker (HF cache or `smolforge worker join --models-dir DIR`), or pick a "
                    "model that a node lists under `smolforge nodes`")
        return (f"`ollama pull {model}` on a worker and run `smolforge worker rescan` there, or use "
                "--teacher-backend hf with weights a node holds")


WEIGHTS = Loader("hf", "models", "model:", "weights", "as weights (HF cache or --models-dir)", "no models", "",
                 weights=True)
OLLAMA_TAG = Loader("ollama", "ollama_models", "ollama:", "Ollama", "as an Ollama tag", "no Ollama models",
                    " in Ollama", weights=False)
ENDPOINT = Loader("endpoint", "", "", "endpoint", "behind a URL (--teacher-url)", "", "", weights=False, anywhere=True)
LOADERS: dict[str, Loader] = {loader.name: loader for loader in (WEIGHTS, OLLAMA_TAG, ENDPOINT)}


def loader(name: str) -> Loader:
    """The loader called `name` ("hf": weights, "ollama": an Ollama tag)."""
    if name not in LOADERS:
        raise SmolforgeError(f"unknown model loader {name!r}", fix=f"use one of {', '.join(LOADERS)}")
    return LOADERS[name]


class TeacherBackend:
    """One teacher backend: what it needs, what it produces, and how its teacher is built."""

    name: ClassVar[str]
    description: ClassVar[str]  # for help and messages
    loader: ClassVar[Loader] = WEIGHTS  # what the node must hold
    needs_gguf: ClassVar[bool] = False  # runs a GGUF (given, or exported once per node from the weights)
    student_tokenizer: ClassVar[bool] = False  # a given GGUF's vocabulary is checked against the student's
    produces: ClassVar[frozenset[str]] = frozenset({"text"})  # "text", "topk" (top-k logits for token-level KD)
    on_policy: ClassVar[bool] = False  # scores the student's own samples (--on-policy-ratio > 0)
    scores_reference: ClassVar[bool] = False  # --teacher-responses reference: scores the dataset's answers

    teacher: ClassVar[str]  # "module:Class" of its teacher, imported when first built (torch: not before)

    def teacher_class(self) -> Any:
        """The teacher's class (`generate(items, settings)` -> TeacherRecords), imported now."""
        module, _, name = self.teacher.partition(":")
        return getattr(importlib.import_module(module), name)

    def build(self, model: str, **kwargs: Any) -> Any:
        """The teacher object for `model`. kwargs: device, dtype, ollama_host, tokenizer (the student's),
        quant, n_threads, teacher_url, teacher_key_file, as the backend uses them."""
        raise NotImplementedError(self.name)

    def check(self, cfg: Any) -> None:
        """This backend's own checks of a run's settings (a `DistillSettings`) at submit; the shared ones
        are `settings.check_run`'s."""

    def tokenizer_for(self, students: list[str]) -> str | None:
        """The tokenizer the teacher task gets: the first student's where its vocabulary is checked."""
        return students[0] if self.student_tokenizer and students else None


_REGISTRY: dict[str, type[TeacherBackend]] = {}
B = TypeVar("B", bound=type[TeacherBackend])


def register(cls: B) -> B:
    """Class decorator: make `cls` the backend named `cls.name`."""
    if cls.name in _REGISTRY and _REGISTRY[cls.name] is not cls:
        raise ValueError(f"teacher backend {cls.name!r} registered twice")
    _REGISTRY[cls.name] = cls
    return cls


def backend_names() -> tuple[str, ...]:
    """What --teacher-backend takes, in registration order."""
    return tuple(_REGISTRY)


def teacher_backend(name: str) -> TeacherBackend:
    """The backend called `name`; a SmolforgeError naming the choices for any other."""
    if name not in _REGISTRY:
        raise SmolforgeError(f"unknown --teacher-backend {name!r}", fix=f"use {', '.join(_REGISTRY)}")
    return _REGISTRY[name]()


def backends_help() -> str:
    """`--teacher-backend`'s help: each backend's name and description, from the registry."""
    return "; ".join(f"{name}: {cls.description}" for name, cls in _REGISTRY.items())


def backends_that(capability: str) -> list[str]:
    """The backend names whose class says yes to `capability` (a boolean class attribute)."""
    return [name for name, cls in _REGISTRY.items() if getattr(cls, capability)]


# --------------------------------------------------------------------------- the backends


@register
class HFBackend(TeacherBackend):
    name = "hf"
    description = "transformers"
    produces = frozenset({"text", "topk"})
    on_policy = True
    scores_reference = True

    teacher = "smolforge.distill.teacher:HFTeacher"

    def build(self, model: str, **kwargs: Any) -> Any:
        return self.teacher_class()(model, device=kwargs.get("device", "auto"), dtype=kwargs.get("dtype"))


@register
class LlamaCppBackend(TeacherBackend):
    name = "llamacpp"
    description = "a GGUF in llama.cpp (--teacher model.gguf, or the HF teacher exported once per node)"
    needs_gguf = True
    student_tokenizer = True
    produces = frozenset({"text", "topk"})

    teacher = "smolforge.distill.teacher_llamacpp:LlamaCppTeacher"

    def build(self, model: str, **kwargs: Any) -> Any:
        return self.teacher_class()(model, tokenizer=kwargs.get("tokenizer"), quant=kwargs.get("quant") or "q8_0",
                                    n_threads=kwargs.get("n_threads") or 1, say=print)  # a first export takes minutes

    def check(self, cfg: Any) -> None:
        """The quantisation is one the export writes, and a GGUF teacher given as a file here shares the
        student's vocabulary (its logits train the student): refused now (exit 2) rather than by the
        teacher task on its node. (A path only a worker has is checked there, still before the first shard.)
        Each refusal names its settings (`teacher_quant`; `teacher` then `students`: a spec's line)."""
        from smolforge.models.export.cache import check_quant, is_gguf

        with in_spec(default=("teacher_quant",)):
            check_quant(cfg.teacher_quant)
        if is_gguf(cfg.teacher) and Path(cfg.teacher).expanduser().is_file():
            from smolforge.distill.teacher_llamacpp import check_gguf_vocab

            try:
                check_gguf_vocab(Path(cfg.teacher).expanduser(), cfg.students[0])
            except SmolforgeError as err:
                err.fields = (("teacher",), ("students",))
                raise


@register
class OllamaBackend(TeacherBackend):
    name = "ollama"
    description = "a model Ollama serves, through its HTTP API"
    loader = OLLAMA_TAG
    # top-k only when Ollama sends logprobs and the model's HF tokenizer is known (else text)
    produces = frozenset({"text", "topk"})

    teacher = "smolforge.distill.ollama:OllamaTeacher"

    def build(self, model: str, **kwargs: Any) -> Any:
        return self.teacher_class()(model, host=kwargs.get("ollama_host"), tokenizer_name=kwargs.get("tokenizer"))


@register
class OpenAIBackend(TeacherBackend):
    """A model behind any OpenAI-compatible endpoint (`--teacher-url`; `distill/teacher_openai.py`):
    asked for completions with `logprobs`, its token texts mapped to the student's ids."""

    name = "openai"
    loader = ENDPOINT  # the model is a name the endpoint serves: any node may ask it
    description = "a model behind an OpenAI-compatible endpoint (--teacher-url; key: $OPENAI_API_KEY or --teacher-key-file)"
    student_tokenizer = True  # the store's ids are the student's: the endpoint's tokens are mapped into them
    produces = frozenset({"text", "topk"})  # top-k where the endpoint's tokens map; else text (sequence-level KD)
    scores_reference = True  # echo + logprobs, where the endpoint supports it

    teacher = "smolforge.distill.teacher_openai:OpenAITeacher"

    def build(self, model: str, **kwargs: Any) -> Any:
        return self.teacher_class()(model, url=kwargs.get("teacher_url"), tokenizer=kwargs.get("tokenizer"),
                                    key_file=kwargs.get("teacher_key_file"))

    def check(self, cfg: Any) -> None:
        """A URL is given, and the endpoint answers it with the key and lists the teacher (`probe`: an
        unreachable URL, a refused key or an unknown model is exit 2 before anything starts). The key is read
        here and where the teacher runs, and travels in no spec."""
        if not getattr(cfg, "teacher_url", None):
            raise SmolforgeError("--teacher-backend openai needs the endpoint's URL", where="--teacher-url",
                                 fix="add --teacher-url http://HOST:PORT/v1", field=("teacher_backend",))
        self.teacher_class().probe(cfg.teacher_url, cfg.teacher, cfg.teacher_key_file)


@register
class ReferenceBackend(TeacherBackend):
    name = "reference"
    description = "the dataset's own answers (the SFT baseline; the model supplies the tokenizer)"
    scores_reference = True  # its responses are the references

    teacher = "smolforge.distill.teacher:ReferenceTeacher"

    def build(self, model: str, **kwargs: Any) -> Any:
        return self.teacher_class()(model)
