"""PEFT methods and teacher backends as registered classes (issue 41, item 2): the registries name
what the CLI takes, and every refusal built from a class's capabilities names a command that takes it.
Torch-free: milliseconds each."""

from __future__ import annotations

import re

import pytest

from smolforge.distill.backends import backend_names, backends_that, teacher_backend
from smolforge.distill.planner import TEACHER_BACKENDS, model_backend
from smolforge.distill.settings import DistillSettings, check_run
from smolforge.errors import SmolforgeError
from smolforge.models.peft import ENGINES, EXPORT_TARGETS, accepts, all_methods, peft_method
from smolforge.models.peft_spec import METHODS

ACTIONS = ("merge", "export", *(f"export:{t}" for t in EXPORT_TARGETS), "aggregate", "pipeline", "split",
           *(f"serve:{e}" for e in ENGINES))


def test_registry_is_what_peft_takes():
    assert [m.name for m in all_methods()] == list(METHODS)
    for cls in all_methods():
        assert cls.serves <= set(ENGINES) and cls.exports <= set(EXPORT_TARGETS), cls.name
        assert bool(cls.exports) <= cls.merges, f"{cls.name}: every export target needs a merge"


def _accepted_by_fix(fix: str) -> list[str]:
    """The actions the commands a fix names need (a command named must accept the adapter)."""
    needs = []
    for command in re.findall(r"smolforge [a-z]+(?: --stages \d+)?[^,;`]*", fix):
        if command.startswith("smolforge serve --stages"):
            needs.append("serve:stages")
        elif command.startswith("smolforge serve"):
            needs.append("serve:torch")
        elif command.startswith("smolforge export"):
            needs.append("export:" + command.rsplit("--to ", 1)[1].split()[0])
    return needs


@pytest.mark.parametrize("name", METHODS)
def test_every_refusal_names_commands_that_accept_it(name):
    kind = peft_method(name)
    for action in ACTIONS:
        if accepts(kind, action):
            continue
        err = kind.refusal(action, adapter="out/x_adapter", base="tiny-llama")
        assert err.fix and "smolforge" in err.fix or "--peft" in err.fix, (name, action, err.render())
        for needed in _accepted_by_fix(err.fix):
            assert accepts(kind, needed), f"{name} {action}: the fix names a command that refuses it: {err.render()}"
        for other in re.findall(r"--peft ([a-z0-9 /]+)", err.fix):  # the methods it suggests instead do it
            for method in other.split(" / "):
                assert accepts(peft_method(method.strip().split()[0]), action), (name, action, method)


def test_prefix_adapter_is_not_a_dead_end():
    """Issue 41: export said "serve it unmerged" and serve refused it; now both name generate/eval."""
    prefix = peft_method("prefix")
    for action in ("export:gguf", "serve:torch", "serve:stages"):
        fix = prefix.refusal(action, adapter="out/prefix_adapter").fix
        assert "smolforge generate --model BASE --adapter out/prefix_adapter" in fix
        assert "smolforge serve" not in fix and "smolforge export" not in fix


def test_teacher_backends_registry():
    assert backend_names() == TEACHER_BACKENDS == ("hf", "llamacpp", "ollama", "openai", "reference")
    assert {b: model_backend(b) for b in TEACHER_BACKENDS} == {"hf": "hf", "llamacpp": "hf", "ollama": "ollama",
                                                              "openai": "endpoint", "reference": "hf"}
    assert backends_that("on_policy") == ["hf"]
    assert teacher_backend("llamacpp").tokenizer_for(["s1", "s2"]) == "s1"
    assert teacher_backend("hf").tokenizer_for(["s1"]) is None
    with pytest.raises(SmolforgeError, match="unknown --teacher-backend 'vllm'") as err:
        teacher_backend("vllm")
    assert "hf, llamacpp, ollama, openai, reference" in err.value.fix


def _settings(**kw) -> DistillSettings:
    return DistillSettings(teacher="tiny-llama", students=["tiny-llama"], data="bundled", **kw)


@pytest.mark.parametrize(("kw", "match", "fix"), [
    ({"teacher_backend": "ollama", "on_policy_ratio": 0.5}, "the ollama backend cannot", "--teacher-backend hf"),
    # refused at submit now (it was refused only when the Ollama teacher ran)
    ({"teacher_backend": "ollama", "teacher_responses": "reference"}, "the ollama backend generates its own",
     "--teacher-backend hf or openai or reference"),
    ({"teacher_backend": "vllm"}, "unknown --teacher-backend", "hf, llamacpp"),
])
def test_check_run_asks_the_backend_class(kw, match, fix):
    with pytest.raises(SmolforgeError, match=match) as err:
        check_run(_settings(**kw))
    assert fix in err.value.fix


def _adapter(tmp_path, peft_type: str):
    path = tmp_path / f"{peft_type.lower()}_adapter"
    path.mkdir()
    (path / "adapter_config.json").write_text(f'{{"peft_type": "{peft_type}"}}', encoding="utf-8")
    return path


def test_serve_asks_the_class(tmp_path):
    """`serve` (torch engine, stages) and `serve --engine llamacpp` refuse from the adapter's class, and
    the fix names only commands that take it: the prefix dead end of issue 41 is closed."""
    from smolforge.serve.engines import _refuse_adapter
    from smolforge.serve.model import _check_servable

    prefix, lora = _adapter(tmp_path, "PREFIX_TUNING"), _adapter(tmp_path, "LORA")
    assert _check_servable(str(lora)) == lora and _check_servable(str(lora), "stages") == lora
    for engine in ("torch", "stages"):
        with pytest.raises(SmolforgeError, match="cannot serve prefix tuning") as err:
            _check_servable(str(prefix), engine)
        assert f"smolforge generate --model BASE --adapter {prefix}" in err.value.fix
        assert "smolforge serve" not in err.value.fix
    with pytest.raises(SmolforgeError, match="GGUF cache holds no adapters") as err:
        _refuse_adapter(str(lora))
    assert f"smolforge serve --model BASE --adapter {lora}" in err.value.fix and "--to gguf" in err.value.fix
    with pytest.raises(SmolforgeError, match="GGUF cache holds no adapters") as err:
        _refuse_adapter(str(prefix))
    assert "smolforge serve" not in err.value.fix and "smolforge export" not in err.value.fix
