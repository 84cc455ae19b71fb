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
    library_roots = {
        "torch",
        "np",
        "os",
        "sys",
        "dist",
        "F",
        "nn",
        "json",
        "math",
        "logging",
        "types",
        "importlib_bootstrap",
    }
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


FLOORS = {
    "errors": 0, "inputs": 0, "versions": 0, "interpreter": 0, "pipeline": 1, "parallel": 2, "data": 3,
    "model": 4, "presets": 5, "config": 6, "planner": 7, "ds": 8, "checkpoint": 9, "training": 10,
    "train": 11, "bench": 12, "cli": 13, "__main__": 14, "__init__": 14,
}  # fmt: skip
"""DESIGN.md's floors, lowest first (the ground floor is the base modules): a module may import its own
floor and lower ones only. ``mt3d/__init__.py`` sits on top (its one lazy import, ``from_pretrained``)."""


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _floor(module: str) -> int:
    parts = module.split(".")
    return FLOORS["__init__" if len(parts) == 1 else parts[1]]


def _imports(path: Path, tree: ast.Module):
    """(line, module) of every mt3d import in a file, inside functions too, outside ``TYPE_CHECKING``
    blocks (type-only imports never run); ``from pkg import name`` names the module ``pkg.name`` where
    that is a module."""
    typing_only = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            typing_only.update(id(n) for n in ast.walk(node))
    here = _module_name(path).split(".")
    package = here if path.name == "__init__.py" else here[:-1]
    for node in ast.walk(tree):
        if id(node) in typing_only:
            continue
        if isinstance(node, ast.Import):
            targets = [a.name for a in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                base = ".".join(package[: len(package) - node.level + 1] + ([base] if base else []))
            targets = []
            for alias in node.names:
                sub = f"{base}.{alias.name}"
                is_module = (ROOT / sub.replace(".", "/")).with_suffix(".py").is_file() or (
                    ROOT / sub.replace(".", "/") / "__init__.py"
                ).is_file()
                targets.append(sub if is_module else base)
        else:
            continue
        for t in targets:
            if t == "mt3d" or t.startswith("mt3d."):
                yield node.lineno, t


def test_floors_hold_and_no_modules_import_each_other():
    """No module imports a higher floor (``FLOORS``), and the modules form no import cycle (an import
    inside a function counts: it runs on the first call)."""
    upward, edges = [], {}
    for path, tree in _modules(outside_door=False):
        me = _module_name(path)
        for line, target in _imports(path, tree):
            if _floor(target) > _floor(me):
                upward.append(f"{path.relative_to(ROOT)}:{line} imports {target} (a higher floor)")
            if target != me:
                edges.setdefault(me, set()).add(target)
    assert not upward, "\n".join(upward)
    cycles = _cycles(edges)
    assert not cycles, "modules that import each other:\n" + "\n".join(" -> ".join(c) for c in cycles)


def _cycles(edges: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected groups of more than one module (Tarjan's algorithm, iterative)."""
    index, low, stack, on, out, counter = {}, {}, [], set(), [], [0]
    for root in list(edges):
        if root in index:
            continue
        work = [(root, iter(sorted(edges.get(root, ()))))]
        index[root] = low[root] = counter[0]
        counter[0] += 1
        stack.append(root)
        on.add(root)
        while work:
            node, it = work[-1]
            nxt = next(it, None)
            if nxt is not None:
                if nxt not in index:
                    index[nxt] = low[nxt] = counter[0]
                    counter[0] += 1
                    stack.append(nxt)
                    on.add(nxt)
                    work.append((nxt, iter(sorted(edges.get(nxt, ())))))
                elif nxt in on:
                    low[node] = min(low[node], index[nxt])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                group = []
                while True:
                    w = stack.pop()
                    on.discard(w)
                    group.append(w)
                    if w == node:
                        break
                if len(group) > 1:
                    out.append(sorted(group))
    return out


def test_the_cycle_check_can_fail():
    """The check sees a cycle through an import inside a function, and an upward import."""
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]
    tree = ast.parse("def f():\n    from ..ds import engine\n")
    got = list(_imports(SRC / "parallel" / "x.py", tree))
    assert got == [(2, "mt3d.ds.engine")] and _floor("mt3d.ds.engine") > _floor("mt3d.parallel.x")


def test_files_are_short_and_public_names_documented():
    """No file over 500 lines; every public function, class and method of a public class has a
    docstring (private autograd functions' forward/backward are torch's protocol, not API)."""
    long, bare = [], []
    for path, tree in _modules(outside_door=False):
        rel = path.relative_to(ROOT)
        n = len(path.read_text().splitlines())
        if n > 500:
            long.append(f"{rel} ({n} lines)")
        for node in tree.body:
            if isinstance(node, ast.FunctionDef | ast.ClassDef) and not node.name.startswith("_"):
                if ast.get_docstring(node) is None:
                    bare.append(f"{rel}:{node.lineno} {node.name}")
                if isinstance(node, ast.ClassDef):
                    for m in node.body:
                        if (isinstance(m, ast.FunctionDef) and not m.name.startswith("_")
                                and ast.get_docstring(m) is None):  # fmt: skip
                            bare.append(f"{rel}:{m.lineno} {node.name}.{m.name}")
    assert not long, "split these files:\n" + "\n".join(long)
    assert not bare, "document these:\n" + "\n".join(bare)


REENTRANT_IMPORT = r"""
import os, signal, sys, threading, time, types
if sys.argv[1] == "mended":
    import mt3d  # applies mt3d.interpreter's mend
gate = types.ModuleType("gate")  # the slow module's body waits on these
gate.inside, gate.go = threading.Event(), threading.Event()
sys.modules["gate"] = gate
sys.path.insert(0, sys.argv[2])
main = threading.get_ident()
signal.signal(signal.SIGUSR1, lambda *_: __import__("nested"))  # an import inside the wait

def slow_import():
    import slow  # noqa: F401 - holds slow's module lock until gate.go

def interrupt():
    import importlib._bootstrap as bootstrap
    gate.inside.wait()
    while getattr(bootstrap._blocking_on.get(main), "name", None) != "slow":
        time.sleep(0.01)  # until the main thread waits on slow's lock
    signal.pthread_kill(main, signal.SIGUSR1)
    while "nested" not in sys.modules:
        time.sleep(0.01)  # until its handler has imported
    gate.go.set()

threads = [threading.Thread(target=slow_import), threading.Thread(target=interrupt)]
for t in threads:
    t.start()
gate.inside.wait()
try:
    import slow  # noqa: F401
    print("ok" if "nested" in sys.modules else "no nested import")
except KeyError:
    print("KeyError")
for t in threads:
    t.join()
"""


def test_an_import_inside_another_imports_lock_wait_works(tmp_path):
    """CPython gh-91351 (before 3.12): a nested import in the same thread during a module-lock wait
    (a signal handler here; a garbage-collected finalizer in CI) makes the outer import raise KeyError.
    Reproduced deterministically: unmended, this interpreter still has the bug (else drop the mend in
    mt3d/interpreter.py), and mt3d's mend removes it."""
    import subprocess
    import sys

    from mt3d.interpreter import NEEDS_REENTRANT_IMPORTS

    (tmp_path / "slow.py").write_text("import gate\ngate.inside.set()\ngate.go.wait()\n")
    (tmp_path / "nested.py").write_text("VALUE = 1\n")
    script = tmp_path / "reentrant.py"
    script.write_text(REENTRANT_IMPORT)

    def outcome(mode):
        argv = [sys.executable, str(script), mode, str(tmp_path)]
        done = subprocess.run(argv, cwd=ROOT, capture_output=True, text=True, timeout=120)
        return done.stdout.strip() or done.stderr[-2000:]

    assert outcome("plain") == ("KeyError" if NEEDS_REENTRANT_IMPORTS else "ok")
    assert outcome("mended") == "ok"
