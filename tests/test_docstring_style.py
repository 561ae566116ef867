"""Docstrings use Google style (``Args:``, ``Returns:``, ``Raises:``...), not numpy or Sphinx.

Every module, class and function docstring of the code folders is read with :mod:`ast`. A line
of three or more ``-`` or ``=`` right under a non-empty line is a numpy-style (reST) section
underline (``Parameters`` / ``----------``); ``:param``, ``:returns:``, ``:raises`` and their
kin are Sphinx fields. Either fails the test, naming ``file:line``. A reST table's borders
(``===== =====``, with gaps) are not underlines.
"""

from __future__ import annotations

import ast
import re
from collections.abc import Iterator
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
FOLDERS = ("pipeline", "store", "workers", "chaos", "ddiloco", "bench", "examples")

UNDERLINE = re.compile(r"\s*(-{3,}|={3,})\s*")
SPHINX_FIELD = re.compile(r"\s*:(param|type|returns?|rtype|raises?|except(ion)?)\b")

_DOCUMENTED = (ast.Module, ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)


def source_files() -> list[Path]:
    files = []
    for folder in FOLDERS:
        files += [p for p in (ROOT / folder).rglob("*.py") if "__pycache__" not in p.parts]
    return sorted(files)


def docstrings(tree: ast.Module) -> Iterator[tuple[int, str]]:
    """(first source line, raw text) of every module, class and function docstring."""
    for node in ast.walk(tree):
        if not isinstance(node, _DOCUMENTED) or not node.body:
            continue
        first = node.body[0]
        if (isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant)
                and isinstance(first.value.value, str)):
            yield first.lineno, first.value.value


def style_problems(text: str, first_line: int = 1) -> list[tuple[int, str]]:
    """(source line, what) of each numpy-style section (its title's line) or Sphinx field.

    Args:
        text: the docstring as written (not ``inspect.cleandoc``-ed), so that its line ``i``
            is source line ``first_line + i``.
        first_line: the source line of the opening quotes.
    """
    problems = []
    lines = text.split("\n")
    for i, line in enumerate(lines):
        if i and UNDERLINE.fullmatch(line) and lines[i - 1].strip():
            problems.append((first_line + i - 1, f"numpy-style section {lines[i - 1].strip()!r}"))
        elif SPHINX_FIELD.match(line):
            problems.append((first_line + i, f"Sphinx field {line.strip()[:40]!r}"))
    return problems


def test_the_code_folders_have_python_files() -> None:
    files = source_files()
    assert len(files) > 50, files
    for folder in ("pipeline", "store", "workers", "chaos"):
        assert any(p.relative_to(ROOT).parts[0] == folder for p in files), folder


def test_every_docstring_is_google_style() -> None:
    found = []
    for path in source_files():
        tree = ast.parse(path.read_text(encoding="utf-8"), filename=str(path))
        for lineno, text in docstrings(tree):
            for line, what in style_problems(text, lineno):
                found.append(f"{path.relative_to(ROOT)}:{line}: {what}")
    assert not found, "use Google style (Args:, Returns:, Raises:):\n" + "\n".join(found)


def test_the_check_flags_numpy_sections_and_sphinx_fields() -> None:
    numpy_style = '''"""Summary.

    Parameters
    ----------
    x : int
        A value.

    Returns
    =======
    int
    """'''
    tree = ast.parse(f"def f(x):\n    {numpy_style}\n")
    (lineno, text), = docstrings(tree)
    assert style_problems(text, lineno) == [
        (4, "numpy-style section 'Parameters'"),
        (9, "numpy-style section 'Returns'"),
    ]
    sphinx = "Summary.\n\n:param x: a value.\n:returns: twice x.\n:raises ValueError: never.\n"
    assert [line for line, _ in style_problems(sphinx)] == [3, 4, 5]


def test_the_check_passes_google_style_and_rest_tables() -> None:
    google = """Summary.

    Args:
        x: a value; see :func:`g` and :class:`H`.

    Returns:
        Twice ``x``.

    Raises:
        ValueError: never.
    """
    table = """Keys:

      ===== ====== ======
      key   type   meaning
      ===== ====== ======
      fv    int    format version
      ===== ====== ======

    A rule between paragraphs:

    ---
    """
    assert style_problems(google) == []
    assert style_problems(table) == []
