"""Layering: asyncrl is a stack of units (packages, and the few modules at its root), each allowed to import only
the units below it. Two checks hold every unit to that, with no exemptions:
- imported alone in a fresh interpreter (every one of its modules), a unit pulls in only units it may use;
- reading the source of every module of asyncrl/ and of launch.py (lazy imports inside functions count), no import
  points at a unit it may not use, and no modules import each other in a loop."""

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent

# unit -> the units it may import directly. Bottom first; `launch.py` is the top.
DIRECT = {
    "validate": set(),  # config-field checks every package uses
    "rollout": set(),  # the rollout record: produced by inference, consumed by train and orchestration
    "sharding": set(),
    "ops": {"sharding"},
    "models": {"ops", "sharding"},
    "weightsync": {"sharding", "validate"},
    "tasks": {"validate"},
    "tools": {"validate"},  # tool-call formats and the sandbox that runs model-written code
    "envs": {"tasks", "tools", "rollout", "validate"},  # what a completion is sampled in (the protocol: rollout)
    "inference": {"models", "ops", "sharding", "validate", "rollout"},
    "train": {"models", "ops", "sharding", "validate", "rollout"},  # batch -> step math: no inference, no queues
    "orchestration": {"inference", "train", "tasks", "envs", "weightsync", "models", "sharding", "validate",
                      "rollout"},
    "aot": {"inference", "train", "models", "sharding"},
    "config": {"inference", "orchestration", "tasks", "tools", "train", "weightsync", "validate"},  # the run's config
    "plan": {"config", "aot"},  # the pipeline model: a run's config, and at target scale the compiled programs' costs
    "cli": {"config", "orchestration", "aot", "plan", "inference", "tasks", "models", "rollout", "validate"},
    "generate": {"cli"},  # `python -m asyncrl.generate`, kept
    "evaluate": {"cli"},
    "launch": {"cli"},
}


def _closure(unit: str) -> set[str]:
    out, todo = set(), list(DIRECT[unit])
    while todo:
        u = todo.pop()
        if u not in out:
            out.add(u)
            todo.extend(DIRECT[u])
    return out


ALLOWED = {u: _closure(u) for u in DIRECT}
PACKAGES = sorted(u for u in DIRECT if (ROOT / "asyncrl" / u).is_dir())

PROBE = r"""
import importlib, json, pkgutil, sys
unit = sys.argv[1]
mod = importlib.import_module("asyncrl." + unit)
names = [m.name for m in pkgutil.walk_packages(mod.__path__, "asyncrl." + unit + ".")]
for name in names:
    importlib.import_module(name)
loaded = sorted({m.split(".")[1] for m in sys.modules if m.startswith("asyncrl.") and m.count(".") >= 1})
print(json.dumps({"modules": names, "units": loaded}))
"""


def _imports(unit: str) -> tuple[list[str], set[str]]:
    out = subprocess.run([sys.executable, "-c", PROBE, unit], capture_output=True, text=True, timeout=300,
                         env={"JAX_PLATFORMS": "cpu", **os.environ}, cwd=ROOT)
    assert out.returncode == 0, out.stderr[-3000:]
    res = json.loads(out.stdout.strip().splitlines()[-1])
    return res["modules"], set(res["units"]) - {unit}


def test_every_unit_is_in_the_table():
    units = {p.stem for p in (ROOT / "asyncrl").glob("*.py") if p.name != "__init__.py"}
    units |= {p.name for p in (ROOT / "asyncrl").iterdir() if (p / "__init__.py").is_file()}
    assert units == set(DIRECT) - {"launch"}, sorted(units ^ (set(DIRECT) - {"launch"}))


@pytest.mark.parametrize("unit", PACKAGES)
def test_package_imported_alone_loads_only_lower_units(unit):
    modules, used = _imports(unit)
    assert modules, f"asyncrl.{unit} has no modules to import"
    extra = used - ALLOWED[unit]
    assert not extra, f"asyncrl.{unit} imports {sorted(extra)}; allowed: {sorted(ALLOWED[unit])}"


def test_models_never_import_the_trainer_inference_or_orchestration():
    _, used = _imports("models")
    assert not used & {"train", "inference", "orchestration", "tasks", "aot", "weightsync", "config", "cli"}, used


def _sources() -> dict[str, pathlib.Path]:
    mods = {".".join(p.relative_to(ROOT).with_suffix("").parts): p for p in (ROOT / "asyncrl").rglob("*.py")}
    mods["launch"] = ROOT / "launch.py"
    return mods


def _unit(module: str) -> str:
    return "launch" if module == "launch" else module.split(".")[1]


def _module_graph() -> dict[str, set[str]]:
    """module -> the asyncrl modules (and `launch`) it imports anywhere in its source. A package's `__init__` counts
    as its package (a `from asyncrl.x import y` reads it)."""
    mods = _sources()
    graph = {}
    for name, path in mods.items():
        deps = set()
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] in ("asyncrl", "launch"):
                for a in node.names:
                    full = f"{node.module}.{a.name}"
                    deps.add(full if full in mods else node.module if node.module in mods
                             else f"{node.module}.__init__")
            elif isinstance(node, ast.Import):
                deps |= {a.name for a in node.names if a.name.split(".")[0] in ("asyncrl", "launch")}
        graph[name] = {d for d in deps if d in mods and d != name}
    return graph


def test_no_import_points_up_a_layer():
    """Read from the source, so that a lazy import inside a function counts too, and `launch.py` is included."""
    bad = []
    for mod, deps in _module_graph().items():
        unit = _unit(mod)
        for d in deps:
            target = _unit(d)
            if target != unit and target not in ALLOWED[unit]:
                bad.append(f"{mod} -> {d}")
    assert not bad, bad


def test_train_imports_neither_inference_nor_orchestration():
    assert not ALLOWED["train"] & {"inference", "orchestration"}
    _, used = _imports("train")
    assert not used & {"inference", "orchestration"}, used


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
    graph = {m: {d for d in deps if not d.endswith(".__init__")} for m, deps in _module_graph().items()
             if not m.endswith(".__init__")}
    assert "asyncrl.tasks.registry" in graph and graph["asyncrl.tasks.registry"] >= {"asyncrl.tasks.digits"}
    assert _cycles(graph) == []
    # The checker finds a cycle when there is one: the old one between launch.py and the aot report.
    assert _cycles({**graph, "launch": graph["launch"] | {"asyncrl.aot.report"},
                    "asyncrl.aot.report": graph["asyncrl.aot.report"] | {"launch"}})


def test_no_module_over_400_lines_unless_its_docstring_says_why():
    """One concept per file: a module under asyncrl/ past 400 lines must say in its docstring why it stays one file
    ("past the usual ~400 lines")."""
    long = []
    for path in sorted((ROOT / "asyncrl").rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 400 and "past the usual ~400 lines" not in (ast.get_docstring(ast.parse(text)) or ""):
            long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert not long, long
