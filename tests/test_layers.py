"""The package folders are layers that import only downward:
pipeline < store < workers < chaos < ddiloco (the app).

Every import in every module counts, including those inside functions (deferred imports are
still dependencies). ``bench/`` and ``tests/`` sit above all layers and are not checked here;
no layer may import them.
"""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
LAYERS = ["pipeline", "store", "workers", "chaos", "ddiloco"]
ABOVE_ALL = {"bench", "tests"}


def _imported_modules(tree: ast.AST, package: str) -> list[tuple[int, str]]:
    """(line, dotted module) of every import in ``tree``; relative imports resolve to
    ``package`` (a file's own layer)."""
    found: list[tuple[int, str]] = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found.extend((node.lineno, alias.name) for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                found.append((node.lineno, package + (f".{node.module}" if node.module else "")))
            elif node.module:
                found.append((node.lineno, node.module))
    return found


def layer_violations() -> list[str]:
    """``file:line: layer imports module`` for every import of a higher layer (or of
    ``bench``/``tests``)."""
    rank = {name: i for i, name in enumerate(LAYERS)}
    problems = []
    for layer in LAYERS:
        for path in sorted((ROOT / layer).rglob("*.py")):
            tree = ast.parse(path.read_text(), filename=str(path))
            for line, module in _imported_modules(tree, layer):
                top = module.split(".")[0]
                if top in ABOVE_ALL or rank.get(top, -1) > rank[layer]:
                    problems.append(f"{path.relative_to(ROOT)}:{line}: {layer} imports {module}"
                                    f" (allowed: {', '.join(LAYERS[:rank[layer] + 1])})")
    return problems


def test_every_layer_exists() -> None:
    for layer in LAYERS:
        assert (ROOT / layer / "__init__.py").is_file(), f"{layer}/ is not a package"


def test_layers_import_only_downward() -> None:
    problems = layer_violations()
    assert not problems, ("imports of a higher layer (order: " + " < ".join(LAYERS) + "):\n"
                          + "\n".join(problems))


def test_the_check_sees_deferred_and_relative_imports() -> None:
    tree = ast.parse("import os\n"
                     "def f():\n"
                     "    from chaos.runner import run_chaos\n"
                     "    import ddiloco.cli\n"
                     "from . import sibling\n")
    assert sorted(_imported_modules(tree, "workers")) == [
        (1, "os"), (3, "chaos.runner"), (4, "ddiloco.cli"), (5, "workers")]
