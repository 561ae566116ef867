"""Every ``DESIGN §...`` citation in the repository points at something docs/DESIGN.md has.

docs/DESIGN.md numbers its sections ``## §n Title`` and subsections ``### §n.m Title``. The
numbered items (``1. ...``) of a subsection are its steps, and the subsection's title names
them ("Learner loop", "Syncer round"); a section's steps are those of all its subsections. A
subsection titled "Algorithm N" holds a fenced block whose lines are numbered.

A citation starts with ``DESIGN §n`` and may go on, within its parenthesis or sentence, with:

- more sections or a range: ``DESIGN §n, §m``, ``DESIGN §n-m``; a subsection ``DESIGN §n.m``;
- a step: ``DESIGN §n step k``, ``DESIGN §n steps k-l`` (any list of the section has them) or
  ``DESIGN §n, syncer round step k`` (the list of that name has it);
- lines of an algorithm: ``DESIGN §n, Algorithm N lines a-b``;
- quoted names, which the section's text must contain: ``DESIGN §n, "name"``.

A citation whose first section is not a number (``DESIGN §n`` in prose about citations) is not
checked; a ``§`` after another source's name (``paper §2``, ``RFC 8878 §3``) is not this
document's. Every ``§`` inside docs/DESIGN.md must name one of its own sections, too.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
DESIGN = ROOT / "docs" / "DESIGN.md"
SECTION_SIGN = "\u00a7"
#: Files whose citations are checked.
SUFFIXES = {".py", ".md", ".lua"}
#: Folders never read, at any depth: environments, caches, version control.
SKIP_DIRS = {".venv", "venv", ".git", "__pycache__", "node_modules", ".mypy_cache",
             ".pytest_cache", ".ruff_cache", ".hypothesis"}
#: Top-level folders of run and build outputs (``out*`` too): copies, not sources.
SKIP_TOP = {"build", "dist", "runs", "bench-out"}

HEADING_RE = re.compile(rf"^#{{2,6}}\s+{SECTION_SIGN}(\d+(?:\.\d+)*)\s+(.*?)\s*$")
STEP_RE = re.compile(r"^(\d+)\.\s")
ALGORITHM_RE = re.compile(r"\bAlgorithm\s+(\d+)\b")
CITE_RE = re.compile(rf"DESIGN\s*{SECTION_SIGN}")
REF_RE = re.compile(
    rf"{SECTION_SIGN}\s*(\d+(?:\.\d+)*)(?:\s*[-\u2013]\s*{SECTION_SIGN}?(\d+(?:\.\d+)*))?")
#: Where a citation's text ends: a closing parenthesis, a table cell, a code span, a paragraph,
#: a sentence.
END_RE = re.compile(r"\)|\||`|\n\s*\n|\.(?!\w)")
STEP_CITE_RE = re.compile(
    r"(?:(?P<name>[A-Za-z][A-Za-z\- ]*?)\s+)?steps?\s+(?P<first>\d+)"
    r"(?:\s*(?:-|\u2013|to|and)\s*(?P<last>\d+))?\b")
ALGORITHM_CITE_RE = re.compile(
    r"Algorithm\s+(?P<n>\d+)(?:,?\s+lines?\s+(?P<first>\d+)(?:\s*[-\u2013]\s*(?P<last>\d+))?)?")
NAME_RE = re.compile(r"\s*,?\s*[\"\u201c]([^\"\u201d\n]{1,80})[\"\u201d]")


@dataclass
class Section:
    """One numbered section or subsection of the design document."""

    number: str
    title: str
    lines: list[str] = field(default_factory=list)
    #: list name (a subsection's title, lower case) -> its step numbers
    steps: dict[str, set[int]] = field(default_factory=dict)
    #: algorithm number -> its numbered lines
    algorithms: dict[int, set[int]] = field(default_factory=dict)

    @property
    def text(self) -> str:
        return " ".join(" ".join(self.lines).split()).lower()

    def all_steps(self) -> set[int]:
        return set().union(*self.steps.values()) if self.steps else set()


def parse_design(text: str) -> dict[str, Section]:
    """Sections of the design document by number ("2", "2.5"); a section's text, steps and
    algorithms include those of its subsections."""
    sections: dict[str, Section] = {}
    current: list[Section] = []  # the section and its ancestors, outermost first
    fence = False
    for line in text.splitlines():
        if line.strip().startswith("```"):
            fence = not fence
            continue
        heading = None if fence else HEADING_RE.match(line)
        if heading:
            number, title = heading.groups()
            section = Section(number, title, [title])
            sections[number] = section
            parents = [s for s in current if number.startswith(s.number + ".")]
            for parent in parents:
                parent.lines.append(title)
            current = [*parents, section]
            continue
        if not current:
            continue
        for section in current:
            section.lines.append(line)
        own = current[-1]
        algorithm = ALGORITHM_RE.search(own.title)
        if fence and algorithm:
            number_match = re.match(r"\s*(\d+)\s", line)
            if number_match:
                for section in current:
                    section.algorithms.setdefault(int(algorithm.group(1)), set()).add(
                        int(number_match.group(1)))
        step = None if fence else STEP_RE.match(line)
        if step:
            name = own.title.lower()
            for section in current:
                section.steps.setdefault(name, set()).add(int(step.group(1)))
    return sections


@dataclass(frozen=True)
class Citation:
    """One reference inside a citation: a section number, and what the text after it names."""

    line: int
    number: str
    last: str | None
    qualifier: str


def _normalize(snippet: str) -> str:
    """A citation's text on one line: Python string concatenation and comment markers across
    line breaks removed, whitespace collapsed."""
    snippet = re.sub(r"[\"']\s*\n\s*[rbf]?[\"']", "", snippet)
    snippet = re.sub(r"\n\s*(?:#|--|\*)\s?", " ", snippet)
    return " ".join(snippet.split())


def citations(text: str) -> Iterator[Citation]:
    """Every reference of every ``DESIGN §`` citation of ``text``, with its line."""
    for match in CITE_RE.finditer(text):
        line = text.count("\n", 0, match.start()) + 1
        rest = text[match.end() - 1:match.end() + 400]
        end = END_RE.search(rest, 1)
        snippet = _normalize(rest[:end.start()] if end else rest)
        refs = list(REF_RE.finditer(snippet))
        if not refs or refs[0].start() != 0:
            continue  # DESIGN §n: a placeholder, not a citation
        kept = [refs[0]]
        for ref in refs[1:]:
            before = snippet[kept[-1].end():ref.start()].rstrip()
            # Another source's section (paper §2, RFC 8878 §3) ends this citation.
            if not before.endswith((",", ";", "/", " and", " or")):
                break
            kept.append(ref)
        for i, ref in enumerate(kept):
            stop = kept[i + 1].start() if i + 1 < len(kept) else len(snippet)
            yield Citation(line, ref.group(1), ref.group(2), snippet[ref.end():stop])


def _span(first: str, last: str) -> list[str]:
    """The sections of a range: ``1-3`` -> 1, 2, 3; ``3.3-3.5`` -> 3.3, 3.4, 3.5; anything
    else (``2.4-3``, a backward range) -> its two ends."""
    a, b = first.split("."), last.split(".")
    if len(a) == len(b) and a[:-1] == b[:-1] and int(a[-1]) <= int(b[-1]):
        return [".".join([*a[:-1], str(n)]) for n in range(int(a[-1]), int(b[-1]) + 1)]
    return [first, last]


def check(cite: Citation, sections: dict[str, Section]) -> str | None:
    """None when the citation resolves, else what is missing."""
    number = cite.number
    if cite.last is not None:
        missing = [n for n in _span(number, cite.last) if n not in sections]
        if missing:
            return f"no section {', '.join(missing)}"
    if number not in sections:
        return f"no section {number}"
    section = sections[number]
    qualifier = cite.qualifier.lstrip(" ,:;(")
    algorithm = ALGORITHM_CITE_RE.match(qualifier)
    if algorithm:
        n = int(algorithm.group("n"))
        if n not in section.algorithms:
            return f"no Algorithm {n} in {SECTION_SIGN}{number}"
        if algorithm.group("first"):
            first = int(algorithm.group("first"))
            wanted = set(range(first, int(algorithm.group("last") or first) + 1))
            if not wanted <= section.algorithms[n]:
                return (f"Algorithm {n} of {SECTION_SIGN}{number} has no line(s) "
                        f"{sorted(wanted - section.algorithms[n])}")
        return None
    step = STEP_CITE_RE.match(qualifier)
    if step:
        first = int(step.group("first"))
        wanted = set(range(first, int(step.group("last") or first) + 1))
        name = (step.group("name") or "").strip().lower()
        if name:
            lists = [s for key, s in section.steps.items() if key.startswith(name)]
            if not lists:
                return f"no list {name!r} of steps in {SECTION_SIGN}{number}"
        else:
            lists = list(section.steps.values())
        if not any(wanted <= s for s in lists):
            where = f"{name!r} of " if name else ""
            return f"no step(s) {sorted(wanted)} in {where}{SECTION_SIGN}{number}"
        return None
    text = section.text
    position = 0
    while (name_match := NAME_RE.match(cite.qualifier, position)) is not None:
        name = " ".join(name_match.group(1).split()).lower()
        if name not in text:
            return f"{SECTION_SIGN}{number} has nothing named {name_match.group(1)!r}"
        position = name_match.end()
    return None


def check_text(text: str, label: str, sections: dict[str, Section]) -> list[str]:
    """``label:line: problem`` for every citation of ``text`` that does not resolve."""
    problems = []
    for cite in citations(text):
        error = check(cite, sections)
        if error is not None:
            cited = f"DESIGN {SECTION_SIGN}{cite.number}{cite.qualifier}".strip().rstrip(",;")
            problems.append(f"{label}:{cite.line}: {cited!r}: {error}")
    return problems


def source_files() -> Iterator[Path]:
    """The repository's .py, .md and .lua files, outputs and environments left out."""
    for folder, dirs, files in os.walk(ROOT):
        top = Path(folder) == ROOT
        dirs[:] = sorted(d for d in dirs if d not in SKIP_DIRS and not d.endswith(".egg-info")
                         and not (top and (d in SKIP_TOP or d.startswith("out"))))
        for name in sorted(files):
            if Path(name).suffix in SUFFIXES:
                yield Path(folder) / name


@pytest.fixture(scope="module")
def sections() -> dict[str, Section]:
    return parse_design(DESIGN.read_text())


# ---------------------------------------------------------------------------------------------
# The repository


def test_design_has_numbered_sections_and_steps(sections: dict[str, Section]) -> None:
    """The anchors the checker reads exist: numbered sections, the two step lists of the
    algorithm, Algorithm 1."""
    top = sorted(int(n) for n in sections if "." not in n)
    assert top == list(range(1, len(top) + 1)), f"sections numbered {top}"
    lists = sections["2"].steps
    assert any(k.startswith("learner loop") for k in lists), sorted(lists)
    assert any(k.startswith("syncer round") for k in lists), sorted(lists)
    assert 1 in sections["2"].algorithms


def test_every_citation_resolves(sections: dict[str, Section]) -> None:
    problems: list[str] = []
    count = 0
    for path in source_files():
        text = path.read_text(encoding="utf-8", errors="replace")
        if "DESIGN" not in text:
            continue
        count += sum(1 for _ in citations(text))
        problems += check_text(text, str(path.relative_to(ROOT)), sections)
    assert count > 0, "no DESIGN citation found: is the scan reading the repository?"
    assert not problems, ("citations of docs/DESIGN.md that point at nothing:\n"
                          + "\n".join(problems))


def test_design_references_itself_correctly(sections: dict[str, Section]) -> None:
    """Every ``§n`` (and ``§n.m step k``) inside docs/DESIGN.md names one of its sections."""
    problems = []
    for number, line in enumerate(DESIGN.read_text().splitlines(), start=1):
        if HEADING_RE.match(line):
            continue
        for ref in REF_RE.finditer(line):
            cite = Citation(number, ref.group(1), ref.group(2), line[ref.end():])
            error = check(cite, sections)
            if error is not None:
                problems.append(f"docs/DESIGN.md:{number}: {ref.group(0)}: {error}")
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# The checker itself (the citations are built with SECTION_SIGN, so this file's own text
# holds none that the scan above would read)

S = SECTION_SIGN
SAMPLE = f"""\
## {S}1 Terms
## {S}2 Algorithm
### {S}2.1 Learner loop
1. inner step
2. send
### {S}2.2 Syncer round
1. collect
2. decide
3. publish
### {S}2.3 Algorithm 1
```text
 1  first
 2  second
```
## {S}3 Store
**A lease per syncer shard.** Blobs live elsewhere.
"""


def _problems(text: str) -> list[str]:
    return check_text(text, "x.py", parse_design(SAMPLE))


@pytest.mark.parametrize("text", [
    f"(DESIGN {S}2)", f"(DESIGN {S}1-2; paper: 24)", f"(DESIGN {S}2, {S}3)",
    f"DESIGN {S}2.2 step 3.", f"(DESIGN {S}2 step 3)", f"(DESIGN {S}2 steps 1-2)",
    f"(DESIGN {S}2 steps 2-3)",
    f"(DESIGN {S}2, syncer round step 3; lineage)", f"(DESIGN {S}2, learner loop step 2)",
    f"(DESIGN {S}2, Algorithm 1 lines 1-2)", f'(DESIGN {S}3, "blobs")',
    f'(DESIGN {S}3 "a lease per syncer shard", "blobs"; {S}1 terms)',
    f'"grace (DESIGN {S}2, "\n        "syncer round step 2)"',
    f"DESIGN {S}n is a section", f"(DESIGN {S}2, paper {S}9)", f"(DESIGN {S}2, RFC 8878 {S}9.1)",
])
def test_checker_accepts(text: str) -> None:
    assert _problems(text) == []


@pytest.mark.parametrize(("text", "why"), [
    (f"(DESIGN {S}9)", "no section 9"),
    (f"(DESIGN {S}2.7)", "no section 2.7"),
    (f"(DESIGN {S}1-4)", "no section 4"),
    (f"(DESIGN {S}2, {S}5)", "no section 5"),
    (f"(DESIGN {S}2 step 4)", "no step(s) [4]"),
    (f"(DESIGN {S}2 steps 2-4)", "no step(s) [2, 3, 4]"),
    (f"(DESIGN {S}2, learner loop step 3)", "'learner loop'"),
    (f"(DESIGN {S}2, shard loop step 1)", "no list 'shard loop'"),
    (f"(DESIGN {S}2, Algorithm 1 lines 2-3)", "no line(s) [3]"),
    (f"(DESIGN {S}2, Algorithm 2 lines 1-2)", "no Algorithm 2"),
    (f'(DESIGN {S}3, "object store layout")', "nothing named 'object store layout'"),
    (f'"merge (DESIGN {S}2, "\n    "syncer round step 9)"', "no step(s) [9]"),
])
def test_checker_catches(text: str, why: str) -> None:
    problems = _problems(text)
    assert len(problems) == 1 and why in problems[0], problems


def test_checker_names_file_and_line() -> None:
    text = f"first line\n\"\"\"A docstring (DESIGN {S}2 step 2).\n\nSee DESIGN {S}8.\"\"\"\n"
    assert _problems(text) == [f"x.py:4: 'DESIGN {S}8': no section 8"]


def test_checker_reads_the_real_document_too(sections: dict[str, Section]) -> None:
    """A dangling citation in a file of the repository's shape is caught against the real
    document, and the real document's step lists are the ones the code cites."""
    assert check_text(f"# x (DESIGN {S}99)\n", "a.py", sections) == [
        f"a.py:1: 'DESIGN {S}99': no section 99"]
    assert check_text(f"# x (DESIGN {S}2, syncer round step 6)\n", "a.py", sections) == []
    assert check_text(f"# x (DESIGN {S}2, learner loop step 6)\n", "a.py", sections) != []
