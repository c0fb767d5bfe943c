"""No branch on a PEFT method's, a teacher backend's or a model type's name outside the classes that
own that knowledge (issue 41): `models/peft/` (one class per PEFT method), `distill/backends.py` (one
class per teacher backend), `models/families/` (one class per model family).

The scan reads `src/smolforge` with `ast` and reports every comparison (==, !=, in, not in) of a
name or attribute called as below, or of `model_method(...)` / `adapter_method(...)`, against string
constants; the model-type part also reports any comparison with the string "gpt2". A comparison
with another variable is not a branch on a name and is not reported.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src" / "smolforge"

PEFT_NAMES = {"method", "peft_method", "peft", "student_peft", "peft_type", "model_method", "adapter_method"}
BACKEND_NAMES = {"backend", "teacher_backend", "model_backend"}
MODEL_TYPE_NAMES = {"model_type"}
MODEL_TYPE_CONSTANTS = {"gpt2"}

OWNERS = ("models/families/", "models/peft/", "distill/backends.py")

# (file under src/smolforge, compared name, the constants it may be compared with): other meanings of the
# same words, or a setting that is not a PEFT method/teacher backend choice. Each says why.
ALLOWED = (
    ("client.py", "method", {"GET"}),  # the HTTP method of a request (GET retries), not a PEFT method
    ("distill/aggregate.py", "method", {"mean", "ties"}),  # the students' merge method (--aggregate)
    ("parallel/rendezvous.py", "backend", {"auto", "gloo", "nccl"}),  # torch.distributed's process-group backend
    # the demo's own two-way --student-peft (lora at its lora_lr, or none at its full_lr), validated
    # against those two; the PEFT work itself goes through apply_peft and the classes
    ("cli/demo.py", "student_peft", {"none", "lora"}),
    ("distill/demo.py", "peft", {"lora"}),
    ("distill/demo.py", "student_peft", {"lora"}),
)
# model_type / "gpt2" branches outside models/families/: empty since the families migration, and meant to stay so
MODEL_TYPE_ALLOWED: tuple[tuple[str, str, set[str]], ...] = ()


def _name(node: ast.AST) -> str | None:
    if isinstance(node, ast.Name):
        return node.id
    if isinstance(node, ast.Attribute):
        return node.attr
    if isinstance(node, ast.Call):
        return _name(node.func)
    if isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant) and isinstance(node.slice.value, str):
        return node.slice.value  # spec["backend"], o["peft"]
    return None


def _strings(node: ast.AST) -> set[str] | None:
    """The string constants `node` is (a constant, or a tuple/list/set of them), else None."""
    if isinstance(node, ast.Constant) and isinstance(node.value, str):
        return {node.value}
    if isinstance(node, (ast.Tuple, ast.List, ast.Set)) and node.elts:
        found = [_strings(e) for e in node.elts]
        if all(f is not None for f in found):
            return set().union(*found)  # type: ignore[arg-type]
    return None


def branches(source: str, names: set[str], constants: set[str] = frozenset()) -> list[tuple[int, str, set[str]]]:
    """(line, compared name, string constants) of each comparison in `source` of one of `names` against
    string constants, or of anything against one of `constants`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, ast.Compare):
            continue
        operands = [node.left, *node.comparators]
        for i, op in enumerate(node.ops):
            if not isinstance(op, (ast.Eq, ast.NotEq, ast.In, ast.NotIn)):
                continue
            for side, other in ((operands[i], operands[i + 1]), (operands[i + 1], operands[i])):
                strings = _strings(other)
                if strings is None:
                    continue
                name = _name(side)
                if name in names or strings & constants:
                    found.append((node.lineno, name or ast.unparse(side), strings))
    return sorted(found, key=lambda f: f[0])


def _scan(names: set[str], allowed, constants: set[str] = frozenset()) -> list[str]:
    bad = []
    for path in sorted(SRC.rglob("*.py")):
        rel = path.relative_to(SRC).as_posix()
        if rel.startswith(OWNERS):
            continue
        for line, name, strings in branches(path.read_text(encoding="utf-8"), names, constants):
            if not any(rel == f and name == n and strings <= ok for f, n, ok in allowed):
                bad.append(f"src/smolforge/{rel}:{line}: {name} vs {sorted(strings)}")
    return bad


def test_scanner_finds_name_branches():
    """The scanner itself: what it must report and what it must not."""
    source = '''
if spec.method == "lora": pass
if backend in ("hf", "ollama"): pass
if model_method(model) != "prompt": pass
if spec["backend"] != "ollama": pass
if method == other_method: pass
if kind.merges: pass
if arch.family == "gpt2": pass
'''
    found = branches(source, PEFT_NAMES | BACKEND_NAMES, {"gpt2"})
    assert [(line, name) for line, name, _ in found] == [(2, "method"), (3, "backend"), (4, "model_method"),
                                                          (5, "backend"), (8, "family")]


def test_no_peft_method_or_teacher_backend_branches():
    bad = _scan(PEFT_NAMES | BACKEND_NAMES, ALLOWED)
    assert not bad, ("branches on a PEFT method or teacher backend name outside their classes "
                     "(ask `smolforge.models.peft` / `smolforge.distill.backends`):\n" + "\n".join(bad))


def test_no_model_type_branches():
    bad = _scan(MODEL_TYPE_NAMES, MODEL_TYPE_ALLOWED, MODEL_TYPE_CONSTANTS)
    assert not bad, ("branches on a model type outside models/families/ (ask the family class):\n" + "\n".join(bad))
