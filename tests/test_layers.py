"""The layer packages import only downward, and no module imports itself back.

Layers, lowest first (each installed under the one ``ddiloco`` namespace):
``ddiloco.pipeline`` < ``ddiloco.store`` < ``ddiloco.workers`` < ``ddiloco.chaos.wan`` (WAN
emulation) < ``ddiloco.chaos`` (faults) < ``ddiloco`` (the application: CLI, local runner,
reports, public API).

Every import in every module counts, including those inside functions: a deferred import is
still a dependency. ``bench/`` and ``tests/`` sit above all layers; no layer may import them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
#: (layer name, dotted package, folder in the checkout), lowest first
LAYERS = [
    ("pipeline", "ddiloco.pipeline", ROOT / "pipeline"),
    ("store", "ddiloco.store", ROOT / "store"),
    ("workers", "ddiloco.workers", ROOT / "workers"),
    ("wan", "ddiloco.chaos.wan", ROOT / "chaos" / "wan"),
    ("chaos", "ddiloco.chaos", ROOT / "chaos"),
    ("app", "ddiloco", ROOT / "ddiloco"),
]
ABOVE_ALL = {"bench", "tests"}
#: the old top-level names, which nothing may import any more
OLD_NAMES = {"pipeline", "store", "workers", "chaos"}


def module_files() -> dict[str, Path]:
    """Dotted module name -> file, for every module of every layer."""
    out: dict[str, Path] = {}
    for _, package, folder in LAYERS:
        if not folder.is_dir():
            continue
        for path in sorted(folder.rglob("*.py")):
            rel = path.relative_to(folder).with_suffix("")
            parts = [p for p in rel.parts if p != "__init__"]
            name = ".".join([package, *parts])
            out.setdefault(name, path)
    return out


def layer_of(module: str) -> str | None:
    """The layer a dotted module belongs to (the most specific package that holds it)."""
    best: tuple[int, str] | None = None
    for layer, package, _ in LAYERS:
        if module == package or module.startswith(package + "."):
            if best is None or len(package) > best[0]:
                best = (len(package), layer)
    return None if best is None else best[1]


def _resolve_relative(module: str, is_package: bool, level: int, name: str | None) -> str:
    base = module.split(".")
    if not is_package:
        base = base[:-1]
    base = base[: len(base) - (level - 1)] if level > 1 else base
    return ".".join([*base, name] if name else base)


def imported_modules(tree: ast.AST, module: str, is_package: bool,
                     known: set[str] | None = None) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in ``tree`` of ``module``, deferred ones included.

    ``from pkg import name`` counts as an import of ``pkg.name`` when that is a module in
    ``known``, else of ``pkg``; relative imports are resolved against ``module``.
    """
    known = known or set()
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            target = (_resolve_relative(module, is_package, node.level, node.module)
                      if node.level else (node.module or ""))
            for alias in node.names:
                sub = f"{target}.{alias.name}"
                found.append((node.lineno, sub if sub in known else target))
    return found


def _graph() -> tuple[dict[str, list[tuple[int, str]]], dict[str, Path]]:
    files = module_files()
    known = set(files)
    graph = {}
    for name, path in files.items():
        tree = ast.parse(path.read_text(), filename=str(path))
        graph[name] = imported_modules(tree, name, path.name == "__init__.py", known)
    return graph, files


def layer_violations() -> list[str]:
    """``file:line: layer imports module`` for every import of a higher layer, of ``bench`` or
    ``tests``, or of an old top-level name."""
    rank = {layer: i for i, (layer, _, _) in enumerate(LAYERS)}
    graph, files = _graph()
    problems = []
    for name, imports in graph.items():
        own = layer_of(name)
        assert own is not None
        for line, target in imports:
            top = target.split(".")[0]
            where = f"{files[name].relative_to(ROOT)}:{line}"
            if top in ABOVE_ALL or top in OLD_NAMES:
                problems.append(f"{where}: {own} imports {target}")
                continue
            other = layer_of(target)
            if other is None or target == "ddiloco":
                # ``import ddiloco`` alone (the package's lazy public names) is the app's.
                other = "app" if target == "ddiloco" else None
            if other is not None and rank[other] > rank[own]:
                allowed = ", ".join(layer for layer, _, _ in LAYERS[:rank[own] + 1])
                problems.append(f"{where}: {own} imports {target} (allowed: {allowed})")
    return problems


def import_cycles() -> list[list[str]]:
    """Every strongly connected set of two or more modules in the import graph (Tarjan)."""
    graph, _ = _graph()
    edges = {name: sorted({t for _, t in imports if t in graph and t != name})
             for name, imports in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.append(w)
                if w == v:
                    break
            if len(group) > 1:
                cycles.append(sorted(group))

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return cycles


def test_every_layer_exists() -> None:
    for layer, _, folder in LAYERS:
        assert (folder / "__init__.py").is_file(), f"{layer} ({folder}) is not a package"


def test_layers_import_only_downward() -> None:
    problems = layer_violations()
    order = " < ".join(layer for layer, _, _ in LAYERS)
    assert not problems, f"imports of a higher layer (order: {order}):\n" + "\n".join(problems)


def test_no_import_cycles() -> None:
    cycles = import_cycles()
    assert not cycles, "import cycles (deferred imports included):\n" + "\n".join(
        " <-> ".join(group) for group in cycles)


def test_the_check_sees_deferred_and_relative_imports() -> None:
    tree = ast.parse("import os\n"
                     "def f():\n"
                     "    from ddiloco.chaos.runner import run_chaos\n"
                     "    import ddiloco.cli\n"
                     "from . import sibling\n"
                     "from .other import x\n")
    known = {"ddiloco.workers.sibling"}
    assert sorted(imported_modules(tree, "ddiloco.workers.example", False, known)) == [
        (1, "os"), (3, "ddiloco.chaos.runner"), (4, "ddiloco.cli"),
        (5, "ddiloco.workers.sibling"), (6, "ddiloco.workers.other")]


def test_layer_of_picks_the_most_specific_package() -> None:
    assert layer_of("ddiloco.chaos.wan.delayer") == "wan"
    assert layer_of("ddiloco.chaos.runner") == "chaos"
    assert layer_of("ddiloco.cli") == "app"
    assert layer_of("ddiloco.workersx") == "app"
    assert layer_of("numpy") is None


def redis_outside_the_store() -> list[str]:
    """``module:line`` of every import of ``redis`` by a module outside ``ddiloco.store``:
    Redis is the store's business; every other layer talks to the store's protocol."""
    graph, _ = _graph()
    return sorted(f"{module}:{line} imports {target}" for module, edges in graph.items()
                  for line, target in edges
                  if (target == "redis" or target.startswith("redis."))
                  and layer_of(module) != "store")


def test_redis_is_imported_by_the_store_only() -> None:
    graph, _ = _graph()
    assert any(t == "redis" for _, t in graph["ddiloco.store.core"])  # it sees imports
    found = redis_outside_the_store()
    assert not found, "Redis outside store/ (add a store method instead):\n" + "\n".join(found)
