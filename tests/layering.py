"""The static layering checker, on any tree: `violations(root, allowed)` reads every module of `<root>/asyncrl/`
(and `<root>/launch.py`) and lists each import that points up a layer and each import cycle.

A module's name is its dotted import name: `asyncrl/x/__init__.py` is `asyncrl.x`, so that `import asyncrl.x`, `from
asyncrl.x import y` and `from . import y` (inside `asyncrl/x/`) all name the module that runs. Every import counts:
absolute and relative, at module level or inside a function, and `importlib.import_module` / `__import__` with a
literal name (an f-string counts by its literal prefix). A name that is not a module resolves to the longest module
prefix that is (`from asyncrl.x import f` reads `asyncrl.x`). Package `__init__`s are nodes of the cycle check like
any module. (tests/test_layering.py runs it on the real tree and on synthetic trees with injected violations.)
"""

from __future__ import annotations

import ast
import pathlib

PACKAGE = "asyncrl"
SCRIPT = "launch"  # the top: `launch.py` beside the package
ROOT_PACKAGE = PACKAGE  # `asyncrl/__init__.py`: run by every import, so it is below every unit and imports none


def sources(root: pathlib.Path) -> dict[str, pathlib.Path]:
    """Dotted module name -> file, for every module of `<root>/asyncrl/` and `<root>/launch.py`."""
    root = pathlib.Path(root)
    mods = {}
    for path in sorted((root / PACKAGE).rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        if parts[-1] == "__init__":
            parts = parts[:-1]
        mods[".".join(parts)] = path
    if (root / f"{SCRIPT}.py").is_file():
        mods[SCRIPT] = root / f"{SCRIPT}.py"
    return mods


def unit(module: str) -> str:
    """The layer a module belongs to: `launch`, the root package, or the first name below `asyncrl`."""
    if module in (SCRIPT, ROOT_PACKAGE):
        return module
    return module.split(".")[1]


def _resolve(name: str, mods: dict[str, pathlib.Path]) -> str | None:
    """The module that `name` (a module, or a name inside one) makes Python run: its longest module prefix."""
    parts = name.split(".")
    for n in range(len(parts), 0, -1):
        prefix = ".".join(parts[:n])
        if prefix in mods:
            return prefix
    return None


def _absolute(node: ast.ImportFrom, importer: str, is_package: bool) -> str:
    """The absolute module a `from ... import` names, relative levels resolved against the importer's package."""
    if node.level == 0:
        return node.module or ""
    package = importer.split(".") if is_package else importer.split(".")[:-1]
    if node.level - 1 > len(package) - 1:
        raise ValueError(f"{importer}: `from {'.' * node.level}{node.module or ''} import ...` goes above the tree")
    base = package[: len(package) - (node.level - 1)]
    return ".".join(base + ([node.module] if node.module else []))


def _dynamic_name(node: ast.Call) -> str | None:
    """The literal module name of `importlib.import_module(...)` / `import_module(...)` / `__import__(...)`; for an
    f-string, its literal prefix up to the last dot (`f"asyncrl.cli.{x}"` -> `asyncrl.cli`)."""
    fn = node.func
    called = fn.attr if isinstance(fn, ast.Attribute) else fn.id if isinstance(fn, ast.Name) else None
    if called not in ("import_module", "__import__") or not node.args:
        return None
    arg = node.args[0]
    if isinstance(arg, ast.Constant) and isinstance(arg.value, str):
        return arg.value
    if isinstance(arg, ast.JoinedStr) and arg.values and isinstance(arg.values[0], ast.Constant):
        return str(arg.values[0].value).rpartition(".")[0] or None
    return None


def _ours(name: str) -> bool:
    return name.split(".")[0] in (PACKAGE, SCRIPT)


def module_graph(root: pathlib.Path) -> dict[str, set[str]]:
    """module -> the tree's modules it imports anywhere in its source (itself excluded)."""
    mods = sources(root)
    graph = {}
    for name, path in mods.items():
        is_package = path.name == "__init__.py"
        targets: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names if _ours(a.name)}
            elif isinstance(node, ast.ImportFrom):
                base = _absolute(node, name, is_package)
                if _ours(base):
                    # `from X import y` runs X.y when y is a module, else reads y from X.
                    targets |= {f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base for a in node.names}
            elif isinstance(node, ast.Call):
                dyn = _dynamic_name(node)
                if dyn is not None and _ours(dyn):
                    targets.add(dyn)
        deps = {_resolve(t, mods) for t in targets}
        graph[name] = {d for d in deps if d is not None and d != name}
    return graph


def up_arrows(graph: dict[str, set[str]], allowed: dict[str, set[str]]) -> list[str]:
    """Each import from a unit to another that `allowed[unit]` (the transitive table) does not list. A module of a
    unit missing from the table is itself an error: nothing is exempt."""
    bad = []
    for mod, deps in sorted(graph.items()):
        u = unit(mod)
        if u != ROOT_PACKAGE and u not in allowed:
            bad.append(f"{mod}: unit {u!r} is not in the table")
            continue
        for d in sorted(deps):
            target = unit(d)
            if u == ROOT_PACKAGE:
                bad.append(f"{mod} -> {d} (the root package runs first for every import; it may import nothing)")
            elif target != u and target != ROOT_PACKAGE and target not in allowed[u]:
                bad.append(f"{mod} -> {d}")
    return bad


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan), package `__init__`s included."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp: list[str] = []
            while not comp or comp[-1] != v:
                comp.append(stack.pop())
                on.discard(comp[-1])
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return out


def violations(root: pathlib.Path, allowed: dict[str, set[str]]) -> list[str]:
    """Every up-arrow and every cycle in the tree at `root`; empty when its layering holds."""
    graph = module_graph(root)
    return up_arrows(graph, allowed) + [f"cycle: {' <-> '.join(c)}" for c in cycles(graph)]
