"""The shape of the code itself: DeepSpeed's internals reached only from ``mt3d/ds``, its version
named in one place, and functions short enough to read at once."""

import ast
import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
SRC = ROOT / "mt3d"
DOOR = SRC / "ds"


def _modules(outside_door: bool = True):
    for path in sorted(SRC.rglob("*.py")):
        if outside_door and DOOR in path.parents:
            continue
        yield path, ast.parse(path.read_text(), filename=str(path))


def _own_private_names(defined_outside_door: bool = False) -> set[str]:
    """Underscore names mt3d defines itself (functions, classes, attributes it assigns); with
    ``defined_outside_door``, only the functions and classes it defines outside mt3d/ds."""
    names = set()
    for _, tree in _modules(outside_door=defined_outside_door):
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef | ast.ClassDef):
                names.add(node.name)
            elif defined_outside_door:
                continue
            elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store):
                names.add(node.attr)
            elif isinstance(node, ast.Name) and isinstance(node.ctx, ast.Store):
                names.add(node.id)
    return {n for n in names if n.startswith("_")}


def _deepspeed_private_names() -> set[str]:
    """Underscore names the installed DeepSpeed defines or assigns itself (a regex over its sources:
    0.2 s, against seconds for ``ast``). mt3d assigns some of them too, on DeepSpeed's objects inside
    the door (``engine._INSTRUCTION_MAP``), which must not make them mt3d's own outside it."""
    import deepspeed

    pattern = re.compile(
        r"(?:def|class)\s+(_[A-Za-z]\w*)|\.(_[A-Za-z]\w*)\s*=[^=]|^\s*(_[A-Za-z]\w*)\s*=[^=]", re.M
    )
    names = set()
    for path in Path(deepspeed.__file__).parent.rglob("*.py"):
        for m in pattern.finditer(path.read_text(errors="ignore")):
            names.add(next(g for g in m.groups() if g))
    return names


def _root(node: ast.AST) -> str | None:
    while isinstance(node, ast.Attribute):
        node = node.value
    return node.id if isinstance(node, ast.Name) else None


SHARED_NAMES = {"_file": "mt3d/model/hf.py: HFReader._file"}
"""Underscore names DeepSpeed defines too that mt3d reaches outside the door on objects of its own (not
on ``self``), each with mt3d's definition: any other such name is a reach."""


def test_deepspeed_internals_are_reached_only_from_the_door():
    """Outside mt3d/ds: no import of a private DeepSpeed name, no subclass of a DeepSpeed class, and no
    private attribute (``x._name``) that is not mt3d's own, except on torch/numpy/stdlib modules. A name
    DeepSpeed defines is mt3d's own only on a bare ``self``/``cls`` inside a class (no class outside the
    door subclasses DeepSpeed's, which the check enforces too) or where ``SHARED_NAMES`` lists it."""
    assert set(SHARED_NAMES) <= _own_private_names(defined_outside_door=True), SHARED_NAMES
    own = (_own_private_names() - _deepspeed_private_names()) | set(SHARED_NAMES)
    library_roots = {"torch", "np", "os", "sys", "dist", "F", "nn", "json", "math", "logging", "types"}
    reaches = []
    for path, tree in _modules():
        rel = path.relative_to(ROOT)
        ds_names = set()
        # inside a class (a module-level function whose first parameter is called self is not a method)
        methods = {id(n) for c in ast.walk(tree) if isinstance(c, ast.ClassDef) for n in ast.walk(c)}
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and (node.module or "").startswith("deepspeed"):
                for alias in node.names:
                    ds_names.add(alias.asname or alias.name)
                    if alias.name.startswith("_") or any(p.startswith("_") for p in node.module.split(".")):
                        reaches.append(f"{rel}:{node.lineno}: imports {node.module}.{alias.name}")
            elif isinstance(node, ast.ClassDef):
                for base in node.bases:
                    name = base.id if isinstance(base, ast.Name) else getattr(base, "attr", "")
                    if name in ds_names or _root(base) == "deepspeed":
                        reaches.append(f"{rel}:{node.lineno}: {node.name} subclasses DeepSpeed's {name}")
            elif isinstance(node, ast.Attribute) and re.match(r"_[^_]", node.attr):
                on_self = (
                    isinstance(node.value, ast.Name)
                    and node.value.id in ("self", "cls")
                    and id(node) in methods
                )
                if node.attr not in own and not on_self and _root(node) not in library_roots:
                    reaches.append(f"{rel}:{node.lineno}: reaches {ast.unparse(node)}")
    assert not reaches, "move these into mt3d/ds (DeepSpeed behind one door):\n" + "\n".join(reaches)


def test_the_deepspeed_version_is_pinned_in_one_place_and_installed():
    from mt3d.ds import REACHES, pinned_version, running_version

    setup = (ROOT / "setup.cfg").read_text()
    pins = re.findall(r"deepspeed\s*==\s*([\w.]+)", setup)
    assert len(pins) == 1 and pinned_version() == pins[0] == running_version()
    named = [str(p.relative_to(ROOT)) for p in SRC.rglob("*.py") if pins[0] in p.read_text()]
    assert not named, f"the DeepSpeed version is named in {named}: read it from mt3d.ds instead"
    tests = {p.name: p.read_text() for p in (ROOT / "tests").glob("test_*.py")}
    for reach in REACHES:
        file, name = reach.watch.split("::")
        assert f"def {name}(" in tests.get(file, ""), f"{reach.module}: watch test {reach.watch} is missing"
        assert (DOOR / f"{reach.module}.py").is_file(), reach.module


def test_no_function_is_longer_than_80_lines():
    long = []
    for path, tree in _modules(outside_door=False):
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                n = node.end_lineno - node.lineno + 1
                if n > 80:
                    long.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({n} lines)")
    assert not long, "split these:\n" + "\n".join(long)
