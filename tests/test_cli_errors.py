"""User-facing errors print their text literally (rich markup must not eat ``[...]``), and bad
choices are refused by the command line itself."""

from __future__ import annotations

import signal
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import typer
from typer.testing import CliRunner

from ddiloco import localrun
from ddiloco.chaos.wan.netns import RegionsError
from ddiloco.cli import app
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


@pytest.fixture
def keep_sigterm() -> Iterator[None]:
    """``ddiloco run`` turns SIGTERM into Ctrl-C for its process; give pytest its own back."""
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_run_with_regions_without_the_wan_extra_prints_the_install_line(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path, keep_sigterm: None) -> None:
    topology = tmp_path / "topology.yaml"
    topology.write_text("regions: {}\n")
    message = (f"{topology}: a link asks for a delay > 0, which needs the NetfilterQueue "
               "package: pip install 'ddiloco[wan]' (it builds against libnetfilter-queue-dev)")

    def no_wan(*args: Any, **kwargs: Any) -> dict[str, Any]:
        assert kwargs["regions"] == topology
        raise RegionsError(message)  # what chaos.wan.regions raises without NetfilterQueue

    monkeypatch.setattr(localrun, "run_local", no_wan)
    res = CliRunner().invoke(app, ["run", "--regions", str(topology), "--no-live",
                                   "--out", str(tmp_path / "out")])
    assert res.exit_code == 2
    assert "pip install 'ddiloco[wan]'" in res.output
    assert message in " ".join(res.output.split())
