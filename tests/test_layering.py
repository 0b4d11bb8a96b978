"""Layering: each lower package, imported on its own in a fresh interpreter (every one of its modules), pulls in
only the packages below it; the model never depends on the trainer, inference or orchestration. And no two
modules import each other, directly or round a loop (lazy imports inside functions count)."""

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

# package -> the asyncrl packages its modules may import (besides itself).
ALLOWED = {
    "sharding": set(),
    "ops": {"sharding"},
    "models": {"ops", "sharding"},
    "weightsync": {"config", "sharding"},
    "config": set(),  # validate.py; the run's schema and its loader sit on top of everything (EXEMPT)
    "tasks": {"config"},
    "inference": {"config", "models", "ops", "sharding"},
    "train": {"config", "inference", "models", "ops", "sharding"},
}
# Modules that sit above their package's layer on purpose.
EXEMPT = {"asyncrl.config.schema", "asyncrl.config.loader"}  # the run's config: one field per package

PROBE = r"""
import importlib, json, pkgutil, sys
pkg = sys.argv[1]
exempt = set(json.loads(sys.argv[2]))
mod = importlib.import_module("asyncrl." + pkg)
names = [m.name for m in pkgutil.walk_packages(mod.__path__, "asyncrl." + pkg + ".") if m.name not in exempt]
for name in names:
    importlib.import_module(name)
loaded = sorted({m.split(".")[1] for m in sys.modules if m.startswith("asyncrl.") and m.count(".") >= 1})
print(json.dumps({"modules": names, "packages": loaded}))
"""


def _imports(pkg: str) -> tuple[list[str], set[str]]:
    out = subprocess.run([sys.executable, "-c", PROBE, pkg, json.dumps(sorted(EXEMPT))], capture_output=True,
                         text=True, timeout=300, env={"JAX_PLATFORMS": "cpu", **os.environ})
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return res["modules"], set(res["packages"]) - {pkg}


@pytest.mark.parametrize("pkg", sorted(ALLOWED))
def test_package_imports_only_lower_layers(pkg):
    modules, used = _imports(pkg)
    assert modules, f"asyncrl.{pkg} has no modules to import"
    extra = used - ALLOWED[pkg]
    assert not extra, f"asyncrl.{pkg} imports {sorted(extra)}; allowed: {sorted(ALLOWED[pkg])}"


def test_models_never_import_the_trainer_inference_or_orchestration():
    _, used = _imports("models")
    assert not used & {"train", "inference", "orchestration", "tasks", "aot", "weightsync"}, used


def _module_graph() -> dict[str, set[str]]:
    """asyncrl module -> the asyncrl modules it imports anywhere in its source (package __init__ re-exports left
    out: they import their own package's modules by design)."""
    root = pathlib.Path(__file__).resolve().parent.parent
    mods = {".".join(p.relative_to(root).with_suffix("").parts): p for p in (root / "asyncrl").rglob("*.py")
            if p.name != "__init__.py"}
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.startswith("asyncrl"):
                deps |= {f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module
                         for a in node.names}
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.startswith("asyncrl")}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index, low, stack, on, out = {}, {}, [], set(), []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def test_no_import_cycles():
    graph = _module_graph()
    assert "asyncrl.tasks.registry" in graph and graph["asyncrl.tasks.registry"] >= {"asyncrl.tasks.digits"}
    assert _cycles(graph) == []
    # The checker finds a cycle when there is one (the task registry's old shape: base imported the tasks).
    assert _cycles({**graph, "asyncrl.tasks.base": graph["asyncrl.tasks.base"] | {"asyncrl.tasks.digits"}})


def test_no_module_over_400_lines_unless_its_docstring_says_why():
    """One concept per file: a module under asyncrl/ past 400 lines must say in its docstring why it stays one file
    ("past the usual ~400 lines")."""
    root = pathlib.Path(__file__).resolve().parent.parent / "asyncrl"
    long = []
    for path in sorted(root.rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 400 and "past the usual ~400 lines" not in (ast.get_docstring(ast.parse(text)) or ""):
            long.append(f"{path.relative_to(root.parent)}: {text.count(chr(10))} lines")
    assert not long, long
