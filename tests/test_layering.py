"""Layering: asyncrl is a stack of units (packages, and the few modules at its root), each allowed to import only
the units below it. Two checks hold every unit to that, with no exemptions:
- imported alone in a fresh interpreter (every one of its modules), a unit pulls in only units it may use;
- reading the source of every module of asyncrl/ and of launch.py (`tests/layering.py`: lazy, relative and literal
  dynamic imports count, packages by their own names), no import points at a unit it may not use, and no modules
  (package `__init__`s included) import each other in a loop.
The checker's own tests build small trees with each kind of violation it once missed, and must catch every one."""

import ast
import json
import os
import pathlib
import subprocess
import sys

import pytest

from tests import layering

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
    # the OpenAI-compatible server over an engine, its sessions and agents
    "endpoint": {"inference", "envs", "tools", "models", "rollout", "validate"},
    "orchestration": {"inference", "train", "tasks", "envs", "endpoint", "weightsync", "models", "sharding",
                      "validate", "rollout"},
    "aot": {"inference", "train", "models", "sharding"},
    "config": {"inference", "orchestration", "endpoint", "tasks", "tools", "train", "weightsync",
               "validate"},  # the run's config
    "plan": {"config", "aot"},  # the pipeline model: a run's config, and at target scale the compiled programs' costs
    "cli": {"config", "orchestration", "aot", "plan", "inference", "envs", "tasks", "models", "rollout", "validate"},
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


def test_no_import_points_up_a_layer():
    """Read from the source (`layering.py`), so that lazy and relative imports count too, and `launch.py` is
    included."""
    graph = layering.module_graph(ROOT)
    assert "asyncrl.train" in graph and "launch" in graph  # packages are named as they are imported
    assert layering.up_arrows(graph, ALLOWED) == []


def test_train_imports_neither_inference_nor_orchestration():
    assert not ALLOWED["train"] & {"inference", "orchestration"}
    _, used = _imports("train")
    assert not used & {"inference", "orchestration"}, used


def test_no_import_cycles():
    graph = layering.module_graph(ROOT)
    assert graph["asyncrl.envs.environments"] >= {"asyncrl.envs.registry", "asyncrl.envs.tool_use"}
    assert layering.cycles(graph) == []
    # The checker finds a cycle when there is one: the old one between launch.py and the aot report.
    assert layering.cycles({**graph, "launch": graph["launch"] | {"asyncrl.aot.report"},
                            "asyncrl.aot.report": graph["asyncrl.aot.report"] | {"launch"}})


# ---- the checker itself, on synthetic trees ---------------------------------------------------------------------
# Two units: `low` may import nothing, `high` may import `low`. Each injection below once passed the old checker.

SYNTH_ALLOWED = {"low": set(), "high": {"low"}, "launch": {"high", "low"}}
CLEAN = {
    "asyncrl/__init__.py": "",
    "asyncrl/low/__init__.py": "from asyncrl.low.core import f\n",
    "asyncrl/low/core.py": "import json\n\n\ndef f():\n    return json.dumps(1)\n",
    "asyncrl/low/util.py": "from . import core\nfrom .core import f\n",
    "asyncrl/high/__init__.py": "",
    "asyncrl/high/run.py": "import asyncrl.low\nfrom asyncrl.low import f\nfrom ..low import util\n\n\n"
                           "def g():\n    from asyncrl.high import run\n    return f, util, run\n",
    "launch.py": "from asyncrl.high.run import g\n",
}


def _tree(tmp_path: pathlib.Path, files: dict[str, str]) -> pathlib.Path:
    for rel, text in files.items():
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_text(text)
    return tmp_path


def test_checker_passes_a_clean_tree(tmp_path):
    root = _tree(tmp_path, CLEAN)
    graph = layering.module_graph(root)
    assert graph["asyncrl.high.run"] == {"asyncrl.low", "asyncrl.low.util"}
    assert graph["asyncrl.low.util"] == {"asyncrl.low.core"} and graph["asyncrl.low"] == {"asyncrl.low.core"}
    assert layering.violations(root, SYNTH_ALLOWED) == []


@pytest.mark.parametrize("text", ["import asyncrl.high\n", "import asyncrl.high.run as r\n",
                                  "from asyncrl import high\n"])
def test_checker_catches_a_lazy_import_of_a_package(tmp_path, text):
    """A package imported by its own name inside a function (the old checker stored packages as `X.__init__`)."""
    body = "def h():\n" + "".join(f"    {line}\n" for line in text.splitlines()) + "    return 1\n"
    root = _tree(tmp_path, {**CLEAN, "asyncrl/low/lazy.py": body})
    bad = layering.violations(root, SYNTH_ALLOWED)
    assert len(bad) == 1 and bad[0].startswith("asyncrl.low.lazy -> asyncrl.high"), bad


@pytest.mark.parametrize("text", ["from ..high import run\n", "from ..high.run import g\n", "from .. import high\n"])
def test_checker_catches_a_relative_import(tmp_path, text):
    """A relative import up a layer (the old checker skipped every relative import)."""
    root = _tree(tmp_path, {**CLEAN, "asyncrl/low/rel.py": text})
    bad = layering.violations(root, SYNTH_ALLOWED)
    assert len(bad) == 1 and bad[0].startswith("asyncrl.low.rel -> asyncrl.high"), bad


def test_checker_catches_a_dynamic_import(tmp_path):
    root = _tree(tmp_path, {**CLEAN, "asyncrl/low/dyn.py": "import importlib\n\n\n"
                                                           "def h(x):\n    return importlib.import_module("
                                                           "f'asyncrl.high.{x}')\n"})
    assert layering.violations(root, SYNTH_ALLOWED) == ["asyncrl.low.dyn -> asyncrl.high"]


def test_checker_catches_a_cycle_through_a_package_init(tmp_path):
    """`low/__init__` imports `low.core`, which imports a name from `low` (its `__init__`): a loop that the old
    checker missed, since it dropped every `__init__` before looking for cycles."""
    root = _tree(tmp_path, {**CLEAN, "asyncrl/low/core.py": "from asyncrl.low import f as g\n\n\ndef f():\n"
                                                            "    return g\n"})
    assert layering.violations(root, SYNTH_ALLOWED) == ["cycle: asyncrl.low <-> asyncrl.low.core"]
    root = _tree(tmp_path, {**CLEAN, "asyncrl/low/core.py": "from . import util\n\n\ndef f():\n    return util\n"})
    assert layering.violations(root, SYNTH_ALLOWED) == ["cycle: asyncrl.low.core <-> asyncrl.low.util"]


def test_checker_refuses_a_unit_missing_from_the_table_and_imports_in_the_root_package(tmp_path):
    root = _tree(tmp_path, {**CLEAN, "asyncrl/extra.py": "", "asyncrl/__init__.py": "from asyncrl import low\n"})
    assert layering.violations(root, SYNTH_ALLOWED) == [
        "asyncrl -> asyncrl.low (the root package runs first for every import; it may import nothing)",
        "asyncrl.extra: unit 'extra' is not in the table"]


def test_no_module_over_400_lines_unless_its_docstring_says_why():
    """One concept per file: a module under asyncrl/ past 400 lines must say in its docstring why it stays one file
    ("past the usual ~400 lines")."""
    long = []
    for path in sorted((ROOT / "asyncrl").rglob("*.py")):
        text = path.read_text()
        if text.count("\n") > 400 and "past the usual ~400 lines" not in (ast.get_docstring(ast.parse(text)) or ""):
            long.append(f"{path.relative_to(ROOT)}: {text.count(chr(10))} lines")
    assert not long, long
