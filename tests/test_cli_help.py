"""Help of the command line: every command, option and argument has a help text, and help is
printed as written (no rich markup: ``[...]`` survives)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import typer
import typer.main
from typer.testing import CliRunner

from ddiloco.cli import app
from ddiloco.workers import cli as workers_cli
from ddiloco.workers.cli import new_app

#: Every command tree a user can run: ``ddiloco`` and ``python -m ddiloco.workers``.
APPS = {"ddiloco": app, "python -m ddiloco.workers": workers_cli.app}


def _walk(command: Any, path: str) -> Iterator[tuple[str, Any]]:
    """(command path, click command) of ``command`` and everything under it."""
    yield path, command
    for name, sub in getattr(command, "commands", {}).items():
        yield from _walk(sub, f"{path} {name}")


def _tree() -> list[tuple[str, Any]]:
    return [node for name, typer_app in APPS.items()
            for node in _walk(typer.main.get_command(typer_app), name)]


def test_the_tree_is_walked() -> None:
    paths = {path for path, _ in _tree()}
    # the walk reaches nested groups, so a new sub-app is held to the tests below
    assert {"ddiloco run", "ddiloco keys new", "ddiloco chaos report",
            "python -m ddiloco.workers learner"} <= paths


def test_every_option_and_argument_has_help() -> None:
    missing = [f"{path}: {'/'.join(param.opts)}" for path, command in _tree()
               for param in command.params if not (getattr(param, "help", None) or "").strip()]
    assert not missing, "options and arguments without help= text: " + ", ".join(missing)


def test_every_repeatable_option_names_what_it_takes() -> None:
    """A ``list[...]`` option shows as ``<list[str]>`` unless it has a metavar (KEY=VALUE)."""
    unnamed = [f"{path}: {'/'.join(param.opts)}" for path, command in _tree()
               for param in command.params
               if param.param_type_name == "option" and param.multiple and not param.metavar]
    assert not unnamed, "repeatable options without metavar=: " + ", ".join(unnamed)


def test_every_command_has_help() -> None:
    missing = [path for path, command in _tree() if not (command.help or "").strip()]
    assert not missing, "commands without a docstring or help=: " + ", ".join(missing)


def test_help_is_never_rich_markup() -> None:
    """Rich markup would eat ``'ddiloco[wan]'`` and ``[a-z0-9]{1,8}``: every command renders
    its help with click's plain formatter (the root app's ``rich_markup_mode=None``, which
    typer hands down to every group and command under it)."""
    marked = [path for path, command in _tree()
              if getattr(command, "rich_markup_mode", None) is not None]
    assert not marked, ("help rendered as rich markup (create the app with "
                        "ddiloco.workers.cli.new_app): " + ", ".join(marked))


def _help(*args: str) -> str:
    res = CliRunner().invoke(app, [*args, "--help"], terminal_width=100)
    assert res.exit_code == 0, res.output
    return " ".join(res.output.split())  # help is wrapped: compare without line breaks


@pytest.mark.parametrize("args, literal", [
    (("regions",), "the regions' run tag, [a-z0-9]{1,8}"),  # an option's help
    (("blobs-server",), "pip install 'ddiloco[objects]'"),  # a command's docstring
])
def test_bracketed_help_is_printed_literally(args: tuple[str, ...], literal: str) -> None:
    assert literal in _help(*args)


def test_markup_in_a_new_command_is_printed_literally() -> None:
    demo = new_app("Demo [bold]group[/bold].")

    @demo.command()
    def go(tag: str = typer.Option("x", help="must match [a-z0-9]{1,8}; [red]not red")) -> None:
        """Needs pip install 'ddiloco[wan]'."""

    @demo.command()
    def stop() -> None:
        """Stop [i]now[/i]."""

    res = CliRunner().invoke(demo, ["go", "--help"], terminal_width=100)
    assert res.exit_code == 0, res.output
    assert "pip install 'ddiloco[wan]'" in res.output
    assert "must match [a-z0-9]{1,8}; [red]not red" in res.output
    top = CliRunner().invoke(demo, ["--help"], terminal_width=100)
    assert "Demo [bold]group[/bold]." in top.output and "Stop [i]now[/i]." in top.output


def test_every_command_prints_its_help() -> None:
    for path, command in _tree():
        if not path.startswith("ddiloco"):
            continue
        args = path.split()[1:]
        text = _help(*args)
        for param in command.params:
            for opt in param.opts:
                if opt.startswith("-"):
                    assert opt in text, f"{path}: {opt} missing from its --help"
