"""The docs say only what is true: every command line in README.md and docs/*.md is checked.

Every fenced shell block is marked (a bare ```bash block is an error, so new docs are held to it):

- ```bash run: executed as written, each line must exit 0 (in a temporary directory that links
  the checkout's configs/, chaos/ and examples/; ``ddiloco`` from this venv first on PATH). Such
  blocks must be cheap: keys, simulate, config validation, ``--help``.
- ```bash check: lines that would train for minutes or need root, engines or other hosts. Every
  ``ddiloco ...`` (and ``python -m ddiloco ...``) line is parsed by the real click command tree,
  so an unknown command or option or a bad value fails with the doc's file and line; ``make X``
  needs target X in the Makefile; ``python script.py --opt`` needs the script and its options;
  ``pip install '.[extra]'`` needs the extra; ``docker compose`` needs its services and profiles;
  every path into the checkout (``configs/...``, ``chaos/scripts/...``) must exist.

Every config key the docs name (```sync.H```, ```--set train.steps=...```) must exist in
:class:`ddiloco.workers.run.config.Config`; a wrong one fails with the file, line and the nearest
key.
Inline mentions in prose are held to the same: ```ddiloco chaos run --isolate``` must name a
real command and options (arguments may be left out), every path into the checkout and every
relative link must exist, and statements that were once true and are not any more
(:data:`STALE`) stay out.
"""

from __future__ import annotations

import contextlib
import difflib
import functools
import importlib.util
import io
import os
import re
import shlex
import subprocess
import sys
import tomllib
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import pytest
import typer
import yaml

from ddiloco.cli import app
from ddiloco.workers.run.config import Config
from ddiloco.workers.run.config_schema import REMOVED_KEYS

ROOT = Path(__file__).resolve().parent.parent
DOCS = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]
#: Fence languages that hold shell commands: each such block must carry a mark.
SHELL_LANGS = {"bash", "sh", "shell", "console", "zsh"}
MARKS = {"run", "check"}
#: A run block's wall-clock limit, seconds (they must be cheap: the whole file stays under ~60 s).
RUN_TIMEOUT_S = 120
#: Top-level folders of the checkout whose paths, when a doc names them, must exist.
REPO_DIRS = ("configs", "chaos", "examples", "bench", "docker", "docs", "tests", "ddiloco",
             "workers", "store", "pipeline", ".ci")
_DIRS = "|".join(re.escape(d) for d in REPO_DIRS)
PATH_RE = re.compile(rf"^(?:\./)?(?:{_DIRS})/[\w.\-/]*\w$")
PYTHONS = {"python", "python3", ".venv/bin/python", "$(PY)"}
SEPARATORS = {"&&", "||", ";", "|", "&"}
REDIRECTS = {">", ">>", "<", "<<", "2>", "&>"}


@dataclass
class Block:
    """One fenced code block: its file, the line of its first content line (1-based)."""

    path: Path
    line: int
    lang: str
    marks: list[str]
    lines: list[str] = field(default_factory=list)

    def where(self, offset: int = 0) -> str:
        return f"{self.path.relative_to(ROOT)}:{self.line + offset}"


def blocks(path: Path, text: str | None = None) -> list[Block]:
    """The fenced blocks of a markdown file (``text`` instead of the file's, for tests)."""
    found: list[Block] = []
    current: Block | None = None
    lines = (path.read_text() if text is None else text).splitlines()
    for number, line in enumerate(lines, start=1):
        stripped = line.strip()
        if current is None and stripped.startswith("```"):
            info = stripped[3:].split()
            current = Block(path, number + 1, info[0] if info else "", info[1:])
        elif current is not None and stripped.startswith("```"):
            found.append(current)
            current = None
        elif current is not None:
            current.lines.append(line)
    return found


def shell_blocks(mark: str) -> list[Block]:
    return [b for p in DOCS for b in blocks(p) if b.lang in SHELL_LANGS and mark in b.marks]


# ---------------------------------------------------------------------------------------------
# Commands of a check block


@dataclass
class Command:
    """One simple command: where it starts in its block, its words, its environment."""

    offset: int
    words: list[str]
    env: dict[str, str]


def commands(block: Block) -> Iterator[Command]:
    """The simple commands of a shell block: continuation lines joined, comments and heredoc
    bodies dropped, split at ``&&``, ``||``, ``;`` and ``|``; ``VAR=x cmd`` and ``export VAR=x``
    kept as the command's environment; ``sudo [-E]`` removed."""
    exported: dict[str, str] = {}
    i = 0
    while i < len(block.lines):
        start = i
        text = block.lines[i]
        while text.endswith("\\") and i + 1 < len(block.lines):
            i += 1
            text = text[:-1] + " " + block.lines[i]
        heredoc = re.search(r"<<-?\s*['\"]?(\w+)['\"]?", text)
        if heredoc:
            while i + 1 < len(block.lines) and block.lines[i + 1].strip() != heredoc.group(1):
                i += 1
            i += 1  # the delimiter line
        while True:
            try:
                tokens = _words(text)
                break
            except ValueError as exc:  # a quoted string that goes on over the next line
                if i + 1 >= len(block.lines):
                    raise AssertionError(f"{block.where(start)}: cannot parse {text!r}: "
                                         f"{exc}") from None
                i += 1
                text += "\n" + block.lines[i]
        i += 1
        segment: list[str] = []
        for token in [*tokens, ";"]:
            if token in SEPARATORS:
                yield from _command(start, segment, exported)
                segment = []
            else:
                segment.append(token)


def _words(text: str) -> list[str]:
    """Shell words and operators (``&&``, ``|``, ``;``, ``>``) of one line, comments dropped.

    Raises:
        ValueError: an unclosed quotation.
    """
    lexer = shlex.shlex(text, posix=True, punctuation_chars=True)
    lexer.whitespace_split = True
    lexer.commenters = "#"
    return list(lexer)


def _command(offset: int, words: list[str], exported: dict[str, str]) -> Iterator[Command]:
    # Redirections and their targets are not arguments of the command.
    kept: list[str] = []
    skip = False
    for word in words:
        if skip:
            skip = False
        elif word in REDIRECTS:
            skip = True
        else:
            kept.append(word)
    env = dict(exported)
    while kept and re.match(r"^[A-Za-z_]\w*=", kept[0]):
        key, value = kept.pop(0).split("=", 1)
        env[key] = value
    if kept and kept[0] == "export":
        for item in kept[1:]:
            if "=" in item:
                key, value = item.split("=", 1)
                exported[key] = value
        return
    if kept and kept[0] == "sudo":
        kept.pop(0)
        while kept and kept[0].startswith("-"):
            kept.pop(0)
    if kept:
        yield Command(offset, kept, env)


@contextlib.contextmanager
def _environment(env: dict[str, str]) -> Iterator[None]:
    """``env`` added to os.environ and the checkout as cwd (click reads envvars and checks
    paths at parse time); both restored after."""
    saved = dict(os.environ)
    cwd = Path.cwd()
    os.environ.update(env)
    os.chdir(ROOT)
    try:
        yield
    finally:
        os.environ.clear()
        os.environ.update(saved)
        os.chdir(cwd)


@functools.cache
def _root_command() -> Any:
    return typer.main.get_command(app)


def check_cli(args: list[str], env: dict[str, str] | None = None) -> str | None:
    """Parse ``ddiloco ARGS`` with the real command tree, invoking nothing.

    Returns:
        None when every command, option and value is accepted, else click's message.
    """
    root = _root_command()
    out = io.StringIO()
    with _environment(env or {}), contextlib.redirect_stdout(out), \
            contextlib.redirect_stderr(out):
        try:
            ctx = root.make_context("ddiloco", list(args), resilient_parsing=False)
            command: Any = root
            # typer vendors its own click: groups are found by what they can do.
            while hasattr(command, "resolve_command"):
                rest = [*ctx._protected_args, *ctx.args]
                if not rest:
                    break
                name, sub, sub_args = command.resolve_command(ctx, rest)
                assert name is not None and sub is not None
                ctx = sub.make_context(name, sub_args, parent=ctx, resilient_parsing=False)
                command = sub
        except typer.Exit as exc:  # --help, --version: parsed and done
            return None if exc.exit_code == 0 else f"exit {exc.exit_code}: {out.getvalue()}"
        except typer.TyperException as exc:  # click's UsageError, BadParameter...
            return str(exc.format_message()) if hasattr(exc, "format_message") else str(exc)
    return None


def make_targets() -> set[str]:
    targets: set[str] = set()
    for line in (ROOT / "Makefile").read_text().splitlines():
        match = re.match(r"^([\w.\-/ ]+?)\s*:(?!=)", line)
        if match and not line.startswith("\t"):
            targets.update(match.group(1).split())
        if line.startswith(".PHONY:"):
            targets.update(line.split(":", 1)[1].split())
    return targets


def extras() -> set[str]:
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    return set(project.get("optional-dependencies", {}))


def compose_names() -> tuple[set[str], set[str]]:
    """The services and profiles of compose.yaml."""
    compose = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = set(compose.get("services", {}))
    profiles = {p for s in compose.get("services", {}).values() for p in s.get("profiles", [])}
    return services, profiles


def check_command(cmd: Command) -> list[str]:
    """What is wrong with one command of a check block (empty: nothing)."""
    problems: list[str] = []
    words = cmd.words
    for word in words:
        value = word.split("=", 1)[1] if word.startswith("--") and "=" in word else word
        value = re.sub(r":\w+$", "", value)  # --task path/to/file.py:factory
        if PATH_RE.match(value) and not (ROOT / value).exists():
            problems.append(f"no such path in the checkout: {value}")
    head = words[0]
    if head == "ddiloco":
        error = check_cli(words[1:], cmd.env)
        if error:
            problems.append(f"ddiloco: {error}")
    elif head == "make":
        targets = make_targets()
        for target in (w for w in words[1:] if not w.startswith("-") and "=" not in w):
            if target not in targets:
                problems.append(f"make: no target {target!r} in the Makefile")
    elif head in PYTHONS:
        problems += _check_python(words[1:], cmd.env)
    elif head in {"pip", "pip3"} or words[:3] == [head, "-m", "pip"]:
        for word in words:
            for extra in re.findall(r"\[([\w,\-]+)\]", word):
                missing = set(extra.split(",")) - extras()
                if missing:
                    problems.append(f"pip: no extra {sorted(missing)} in pyproject.toml")
    elif head == "docker" and words[1:2] == ["compose"]:
        problems += _check_compose(words[2:])
    return problems


def _check_python(args: list[str], env: dict[str, str]) -> list[str]:
    if args[:1] == ["-m"] and len(args) > 1:
        module, rest = args[1], args[2:]
        if module.split(".")[0] != "ddiloco":
            return []
        spec = importlib.util.find_spec(module)
        if spec is None:
            return [f"python -m {module}: no such module"]
        if spec.submodule_search_locations is not None and \
                importlib.util.find_spec(f"{module}.__main__") is None:
            return [f"python -m {module}: a package without __main__ cannot be run"]
        if module == "ddiloco":
            error = check_cli(rest, env)
            return [f"python -m ddiloco: {error}"] if error else []
        return []
    if not args or args[0].startswith("-"):
        return []
    script = ROOT / args[0]
    if not script.exists():
        return [f"python: no script {args[0]}"]
    source = script.read_text()
    return [f"python {args[0]}: the script has no option {opt}"
            for opt in (a.split("=", 1)[0] for a in args[1:] if a.startswith("--"))
            if opt not in source]


def _check_compose(args: list[str]) -> list[str]:
    services, profiles = compose_names()
    problems = []
    for i, word in enumerate(args):
        if word == "--profile" and i + 1 < len(args) and args[i + 1] not in profiles:
            problems.append(f"docker compose: no profile {args[i + 1]!r} in compose.yaml")
    verbs = [w for w in args if not w.startswith("-")]
    if verbs and verbs[0] in {"exec", "logs", "restart", "stop", "kill"}:
        names = verbs[1:2] if verbs[0] == "exec" else verbs[1:]
        problems += [f"docker compose: no service {name!r} in compose.yaml"
                     for name in names if name not in services]
    return problems


def check_block(block: Block) -> list[str]:
    return [f"{block.where(cmd.offset)}: {problem}  [{' '.join(cmd.words)}]"
            for cmd in commands(block) for problem in check_command(cmd)]


# ---------------------------------------------------------------------------------------------
# Config keys named in the docs

#: ``section.field``, not preceded by a path or module (``ddiloco.store.x``, ``chaos/run.py``)
#: and not followed by a call (``model.make_train_step(...)``: a function).
_SECTIONS = "|".join(Config.model_fields)
KEY_RE = re.compile(rf"(?<![\w./\-$])({_SECTIONS})\.([A-Za-z_]\w*)(?![\w(])")
#: ``run.json``, ``store.py``: files, not keys.
FILE_SUFFIXES = {"py", "json", "toml", "yaml", "yml", "md", "sh", "png", "lua", "txt", "log"}
#: ``--set section.field=``; placeholders (``--set k=v``, ``section.key=value``) are not keys.
SET_RE = re.compile(rf"""--set[= ]+['"]?((?:{_SECTIONS})\.[\w.]+)=""")


def schema_keys() -> dict[str, set[str]]:
    """section -> its field names (and aliases)."""
    keys: dict[str, set[str]] = {}
    for section, info in Config.model_fields.items():
        model = info.annotation
        fields = getattr(model, "model_fields", {})
        keys[section] = set(fields) | {f.alias for f in fields.values() if f.alias}
    return keys


def check_key(key: str) -> str | None:
    """None when ``section.field`` is a key of the schema, else the error with a suggestion."""
    keys = schema_keys()
    section, _, name = key.partition(".")
    if name in FILE_SUFFIXES:
        return None
    if section in keys and name in keys[section]:
        return None
    if f"{section}.{name}" in REMOVED_KEYS:  # named to say it is gone (docs/CONFIG.md)
        return None
    every = [f"{s}.{f}" for s, fields in keys.items() for f in sorted(fields)]
    close = difflib.get_close_matches(key, every, n=1, cutoff=0.6)
    if not close and section in keys:
        near = difflib.get_close_matches(name, sorted(keys[section]), n=1, cutoff=0.0)
        close = [f"{section}.{near[0]}"] if near else []
    hint = f" (did you mean {close[0]}?)" if close else ""
    return f"{key} is not a config key{hint}; the keys are in docs/CONFIG.md"


def _doc_lines(path: Path, text: str | None = None) -> Iterator[tuple[int, str, bool]]:
    """(line number, line, inside a fenced block) of a document, fence lines left out."""
    fence = False
    for number, line in enumerate((path.read_text() if text is None else text).splitlines(),
                                  start=1):
        if line.strip().startswith("```"):
            fence = not fence
            continue
        yield number, line, fence


def doc_keys(path: Path, text: str | None = None) -> Iterator[tuple[int, str]]:
    """(line, key) for every config key named in inline code or in a ``--set``."""
    for number, line, fence in _doc_lines(path, text):
        spans = [line] if fence else re.findall(r"`([^`]+)`", line)
        for span in spans:
            found = [m.group(1) for m in SET_RE.finditer(span)]
            if not fence:
                found += [f"{m.group(1)}.{m.group(2)}" for m in KEY_RE.finditer(span)]
            for key in found:
                if "." in key:
                    yield number, key


# ---------------------------------------------------------------------------------------------
# The docs


def test_every_shell_block_is_marked() -> None:
    """A bare ```bash block is an error: each one says whether it runs or is only checked."""
    bare = [f"{b.where(-1)}: ```{b.lang} block without a mark (```{b.lang} run or "
            f"```{b.lang} check; tests/test_docs.py)"
            for p in DOCS for b in blocks(p)
            if b.lang in SHELL_LANGS and not MARKS & set(b.marks)]
    assert not bare, "\n".join(bare)


@pytest.mark.parametrize("block", shell_blocks("check") + shell_blocks("run"),
                         ids=lambda b: b.where())
def test_command_lines_parse(block: Block) -> None:
    """Every command of a marked block names real commands, options, values and paths."""
    problems = check_block(block)
    assert not problems, "\n".join(problems)


@pytest.mark.integration
@pytest.mark.parametrize("block", shell_blocks("run"), ids=lambda b: b.where())
def test_run_blocks_run(block: Block, tmp_path: Path) -> None:
    """A ```bash run block, executed as written, exits 0 on every line."""
    for name in ("configs", "chaos", "examples"):
        (tmp_path / name).symlink_to(ROOT / name)
    header = ["set -euo pipefail", "trap 'echo \"DOCS_FAILED_LINE=$LINENO\" >&2' ERR"]
    script = tmp_path / "block.sh"
    script.write_text("\n".join([*header, *block.lines]) + "\n")
    env = dict(os.environ, PATH=f"{Path(sys.executable).parent}{os.pathsep}{os.environ['PATH']}")
    proc = subprocess.run(["bash", str(script)], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=RUN_TIMEOUT_S)
    if proc.returncode != 0:
        failed = re.findall(r"DOCS_FAILED_LINE=(\d+)", proc.stderr)
        offset = int(failed[-1]) - len(header) - 1 if failed else 0
        pytest.fail(f"{block.where(offset)}: exit {proc.returncode}: "
                    f"{block.lines[offset] if failed else ''}\n{proc.stderr[-2000:]}")


#: What an inline mention may leave out: it names a command or an option, not a whole line.
PARTIAL_RE = re.compile(r"^(Missing (argument|option|parameter)"
                        r"|Option '[^']+' requires an argument)")


def inline_commands(path: Path, text: str | None = None) -> Iterator[tuple[int, list[str]]]:
    """(line, words) of every inline ``ddiloco ...`` span outside fenced blocks; optional
    parts written ``[--opt X]`` count as given, and the span ends at a shell operator."""
    for number, line, fence in _doc_lines(path, text):
        if fence:
            continue
        for span in re.findall(r"`(ddiloco [^`]+)`", line):
            try:
                words = _words(span.replace("[", " ").replace("]", " ").replace("\\|", "|"))
            except ValueError:
                continue
            cut = next((i for i, w in enumerate(words) if w in SEPARATORS | REDIRECTS),
                       len(words))
            yield number, words[:cut]


def check_inline(words: list[str]) -> str | None:
    """None when an inline mention's commands, options and values exist (missing arguments
    are allowed), else click's message."""
    command = _root_command()
    for word in words[1:]:  # `ddiloco config`: a group named alone prints its help
        command = getattr(command, "commands", {}).get(word)
    if command is not None and hasattr(command, "commands"):
        return None
    error = check_cli(words[1:])
    return None if error is None or PARTIAL_RE.match(error) else error


def test_inline_commands_parse() -> None:
    """Every inline ``ddiloco ...`` mention names real commands and options."""
    problems = [f"{path.relative_to(ROOT)}:{line}: `{' '.join(words)}`: {error}"
                for path in DOCS for line, words in inline_commands(path)
                if (error := check_inline(words)) is not None]
    assert not problems, "\n".join(problems)


#: Paths into the checkout named anywhere in the docs (globs allowed).
DOC_PATH_RE = re.compile(rf"(?<![\w/.\-])((?:{_DIRS})/[\w.\-/*]*\w)")


def test_paths_exist() -> None:
    """Every path into the checkout the docs name (``workers/learner/core.py``, ``chaos/scripts/
    *.yaml``, a link) exists."""
    problems = []
    for path in DOCS:
        for number, line in enumerate(path.read_text().splitlines(), start=1):
            for name in DOC_PATH_RE.findall(line):
                if not (list(ROOT.glob(name)) if "*" in name else (ROOT / name).exists()):
                    problems.append(f"{path.relative_to(ROOT)}:{number}: no {name}")
            for target in re.findall(r"\]\(([^)#\s]+)", line):
                if "://" not in target and not (path.parent / target).exists():
                    problems.append(f"{path.relative_to(ROOT)}:{number}: broken link {target}")
    assert not problems, "\n".join(problems)


def test_config_keys_exist() -> None:
    """Every ``section.field`` the docs name is a key of the schema."""
    problems = [f"{path.relative_to(ROOT)}:{line}: {error}"
                for path in DOCS for line, key in doc_keys(path)
                if (error := check_key(key)) is not None]
    assert not problems, "\n".join(problems)


#: Statements that were once true and are not any more: pattern -> what is true now.
STALE = {
    r"`OUT/keys`": "a local run's keys are in OUT/<mode>/keys (workers/run/launch.py "
                   "with_run_keys)",
    r"[Ee]very default is in": "docs/CONFIG.md has every key; configs/default.toml the common ones",
    r"embedded server runs with AOF `appendfsync everysec`": "store/embedded.py: always",
    r"Redis ACLs, not yet": "per-worker ACL users exist (store/acl.py, ddiloco redis-users)",
    r"heartbeats \(1 s interval|LINGER 0, ZMTP heartbeats":
        "no socket carries ZMTP heartbeats (pipeline/transport.py): TCP keepalives",
    r"outer Nesterov step,|applies an outer Nesterov":
        "the default outer step is SGD at lr 1.0 without momentum",
}


def test_no_stale_statements() -> None:
    problems = [f"{path.relative_to(ROOT)}:{number}: {pattern!r}: {truth}"
                for path in DOCS
                for number, line in enumerate(path.read_text().splitlines(), start=1)
                for pattern, truth in STALE.items() if re.search(pattern, line)]
    assert not problems, "\n".join(problems)


# ---------------------------------------------------------------------------------------------
# The checker itself: what it must catch


def _block(text: str) -> Block:
    found = blocks(ROOT / "README.md", text)
    assert len(found) == 1
    return found[0]


def test_checker_catches_unknown_commands_options_and_values() -> None:
    block = _block("```bash check\n"
                   "ddiloco status --out out --json\n"
                   "ddiloco statuz --out out\n"
                   "ddiloco run --no-such-option 3 \\\n    --steps 10\n"
                   "ddiloco run --steps many\n"
                   "ddiloco chaos run chaos/scripts/no-such-script.yaml\n"
                   "make run && make no-such-target\n"
                   "python bench/codec.py --no-such-flag\n"
                   "pip install -e '.[no-such-extra]'\n"
                   "docker compose exec no-such-service ls\n"
                   "```\n")
    problems = check_block(block)
    text = "\n".join(problems)
    assert "README.md:2:" not in text  # the valid line
    assert "README.md:3:" in text and "statuz" in text
    assert "README.md:4:" in text and "--no-such-option" in text
    assert "README.md:6:" in text and "many" in text
    assert "README.md:7:" in text and "no-such-script.yaml" in text
    assert "README.md:8:" in text and "no-such-target" in text and "'run'" not in text
    assert "README.md:9:" in text and "--no-such-flag" in text
    assert "README.md:10:" in text and "no-such-extra" in text
    assert "README.md:11:" in text and "no-such-service" in text
    assert len(problems) == 8, text


def test_checker_reads_env_heredocs_and_help() -> None:
    block = _block("```bash check\n"
                   "cat > x.env <<'END'   # a heredoc body is not a command\n"
                   "ddiloco nonsense\n"
                   "END\n"
                   "export DDILOCO_RUN_ID=run-1\n"
                   "FOO=1 sudo -E ddiloco keys --help\n"
                   "ddiloco simulate --help   # a comment\n"
                   "```\n")
    assert check_block(block) == []
    assert [c.words[0] for c in commands(block)] == ["cat", "ddiloco", "ddiloco"]
    assert commands(block).__next__().offset == 0


def test_inline_check_allows_parts_but_not_unknown_names() -> None:
    text = ("`ddiloco chaos run --isolate` and `ddiloco run --task` and `ddiloco run [--json]`\n"
            "`ddiloco statuz` and `ddiloco config docs > docs/CONFIG.md`; `ddiloco chaos`\n")
    found = list(inline_commands(ROOT / "x.md", text))
    assert [line for line, _ in found] == [1, 1, 1, 2, 2, 2]
    assert check_inline(found[5][1]) is None  # a group named alone
    errors = [check_inline(words) for _, words in found]
    assert errors[0] is None and errors[1] is None  # a missing script, a missing value
    assert errors[2] is not None and "--json" in errors[2]
    assert errors[3] is not None and "statuz" in errors[3]
    assert found[4][1][-1] == "docs"  # the redirection is not an argument


def test_bare_block_is_found() -> None:
    block = _block("```bash\nddiloco run\n```\n")
    assert block.marks == [] and block.lang == "bash"


def test_key_check_suggests() -> None:
    assert check_key("sync.H") is None
    assert check_key("run.json") is None  # a file
    error = check_key("sync.outer_moment")
    assert error is not None and "did you mean sync.outer_momentum" in error
    error = check_key("train.stepz")
    assert error is not None and "train.steps" in error
    keys = list(doc_keys(ROOT / "x.md", "see `sync.H` and `workers/sync.py`\n"
                         "```bash check\nddiloco run --set train.stepz=3\n```\n"))
    assert keys == [(1, "sync.H"), (3, "train.stepz")]


def test_python_module_lines() -> None:
    block = _block("```bash check\n"
                   "python -m ddiloco.workers learner --help\n"
                   "python -m ddiloco status\n"
                   "python -m ddiloco.nope\n"
                   "```\n")
    text = "\n".join(check_block(block))
    assert "README.md:2:" not in text
    assert "README.md:3:" in text and "without __main__" in text
    assert "README.md:4:" in text and "no such module" in text
