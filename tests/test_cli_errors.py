"""User-facing errors print their text literally (rich markup must not eat ``[...]``), and bad
choices are refused by the command line itself."""

from __future__ import annotations

import subprocess
import sys

import pytest
import typer

from ddiloco.pipeline.errors import DDilocoError
from ddiloco.workers.cli import guard


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, "-m", "ddiloco.cli", *args], capture_output=True,
                          text=True, timeout=120)


def test_guard_prints_the_message_with_its_brackets(capsys: pytest.CaptureFixture[str]) -> None:
    def body() -> int:
        raise DDilocoError("needs NetfilterQueue: pip install 'ddiloco[wan]' ([red]not markup)")

    with pytest.raises(typer.Exit) as info:
        guard(body)
    assert info.value.exit_code == 2
    err = capsys.readouterr().err
    assert "pip install 'ddiloco[wan]' ([red]not markup)" in err


def test_regions_errors_keep_their_brackets() -> None:
    res = _cli("regions", "down", "--tag", "BAD!")
    assert res.returncode == 2
    assert "must match [a-z0-9]{1,8}" in res.stdout + res.stderr


def test_an_unknown_baseline_is_refused_with_the_choices() -> None:
    res = _cli("run", "--baseline", "zero", "--no-live")
    assert res.returncode == 2
    assert "'zero' is not one of 'dp'" in res.stdout + res.stderr
