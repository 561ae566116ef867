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
from ddiloco.workers.cli import guard, user_error_message


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


# --------------------------------------------------------------------------------------------
# One line and exit 2 for every user error (file-system ones included); bugs keep a traceback.
# --------------------------------------------------------------------------------------------

#: The installed console script, as a user runs it.
DDILOCO = Path(sys.executable).with_name("ddiloco")


@pytest.mark.integration  # the console script, as a user runs it
@pytest.mark.timeout(120)
@pytest.mark.parametrize("args, where", [
    (("run", "--out", "/dev/null/out", "--no-live"), "/dev/null/out"),
    (("keys", "new", "--dir", "/dev/null/k", "learner-0"), "/dev/null/k"),
])
def test_file_system_errors_are_one_line_and_exit_2(args: tuple[str, ...], where: str,
                                                   tmp_path: Path) -> None:
    assert DDILOCO.exists(), f"no console script at {DDILOCO} (pip install -e .)"
    res = subprocess.run([str(DDILOCO), *args], capture_output=True, text=True, timeout=100,
                         cwd=tmp_path)
    assert res.returncode == 2, res.stderr
    assert "Traceback" not in res.stdout + res.stderr
    lines = res.stderr.splitlines()
    assert len(lines) == 1, res.stderr
    assert lines[0].startswith("error: ") and where in lines[0] and "Not a directory" in lines[0]


@pytest.mark.integration  # a real Redis holding a run to export
@pytest.mark.timeout(120)
def test_export_to_a_path_under_a_file_is_one_line(redis_server: Any) -> None:
    from ddiloco.store import RedisStore
    from ddiloco.store.connect import connect
    from ddiloco.workers.run.config import load_config
    from ddiloco.workers.run.manifest import init_run

    store = RedisStore(connect(redis_server.url), "cli-export-error")
    manifest = init_run(store, load_config(Path(__file__).parent.parent / "configs" /
                                           "ci-tiny.yaml"), "cli-export-error")
    for p in range(len(manifest["layout"])):  # version 0 = the initial values: a model to export
        store.publish(p, expected_version=-1, epoch=1, value=store.get_initial(p) or b"",
                      momentum=b"", keep=2)
    try:
        res = CliRunner().invoke(app, ["export", "/dev/null/x.safetensors", "--redis-url",
                                       redis_server.url, "--run-id", "cli-export-error"])
    finally:
        store.flush_run()
    assert res.exit_code == 2, res.output
    assert res.stderr == "error: /dev/null: exists and is not a directory\n"


def test_guard_turns_a_real_os_error_into_one_line(tmp_path: Path,
                                                   capsys: pytest.CaptureFixture[str]) -> None:
    blocker = tmp_path / "file"
    blocker.write_text("")

    def body() -> int:
        (blocker / "sub").mkdir(parents=True)
        return 0

    with pytest.raises(typer.Exit) as info:
        guard(body)
    assert info.value.exit_code == 2
    assert capsys.readouterr().err == f"error: {blocker / 'sub'}: Not a directory\n"


def test_guard_keeps_the_traceback_of_a_bug() -> None:
    def body() -> int:
        raise KeyError("a bug, not a user error")

    with pytest.raises(KeyError):
        guard(body)


def test_user_error_messages_are_one_line(tmp_path: Path) -> None:
    import errno

    import pydantic
    import yaml

    assert user_error_message(DDilocoError("bad [x]")) == "bad [x]"
    assert user_error_message(PermissionError(errno.EACCES, "Permission denied", "/root/k")) \
        == "/root/k: Permission denied"
    assert user_error_message(OSError(errno.EXDEV, "Invalid cross-device link", "a", None,
                                      "b")) == "a -> b: Invalid cross-device link"
    assert user_error_message(OSError(errno.EADDRINUSE, "Address already in use")) \
        == "Address already in use"
    # A closed pipe (`ddiloco status | head`) is typer's to end quietly.
    assert user_error_message(BrokenPipeError(errno.EPIPE, "Broken pipe")) is None
    assert user_error_message(RuntimeError("a bug")) is None

    class Train(pydantic.BaseModel):
        model_config = pydantic.ConfigDict(extra="forbid")
        steps: int

    with pytest.raises(pydantic.ValidationError) as invalid:
        Train.model_validate({"steps": "many", "stpes": 1})
    message = user_error_message(invalid.value)
    assert message is not None and "\n" not in message
    assert message.startswith("invalid Train: steps: ") and "stpes: " in message

    with pytest.raises(yaml.YAMLError) as malformed:
        yaml.safe_load("a: [\n")
    message = user_error_message(malformed.value)
    assert message is not None and "\n" not in message
    assert message.startswith("malformed YAML: <unicode string>:2:1: ")


# --------------------------------------------------------------------------------------------
# keys: the flags named in the message; a missing or empty key directory said as such.
# --------------------------------------------------------------------------------------------


def test_keys_new_twice_names_both_flags(tmp_path: Path) -> None:
    runner = CliRunner()
    first = runner.invoke(app, ["keys", "new", "learner-0", "--dir", str(tmp_path)])
    assert first.exit_code == 0, first.output
    again = runner.invoke(app, ["keys", "new", "learner-0", "--dir", str(tmp_path)])
    assert again.exit_code == 2
    assert again.stderr == (f"error: keys for 'learner-0' exist in {tmp_path} (pass --force to "
                            "replace them, or --exist-ok to keep them)\n")
    # both flags do what the message says
    public = (tmp_path / "learner-0.key").read_text()
    kept = runner.invoke(app, ["keys", "new", "learner-0", "--dir", str(tmp_path), "--exist-ok"])
    assert kept.exit_code == 0 and (tmp_path / "learner-0.key").read_text() == public
    replaced = runner.invoke(app, ["keys", "new", "learner-0", "--dir", str(tmp_path), "--force"])
    assert replaced.exit_code == 0 and (tmp_path / "learner-0.key").read_text() != public


def test_keys_list_of_a_missing_directory_is_an_error(tmp_path: Path) -> None:
    missing = tmp_path / "nonexistent"
    res = CliRunner().invoke(app, ["keys", "list", "--dir", str(missing)])
    assert res.exit_code == 2
    assert res.stderr == f"error: {missing}: no such key directory\n"
    a_file = tmp_path / "file"
    a_file.write_text("")
    res = CliRunner().invoke(app, ["keys", "list", "--dir", str(a_file)])
    assert res.exit_code == 2 and res.stderr == f"error: {a_file}: not a directory\n"


def test_keys_list_of_an_empty_directory_says_so(tmp_path: Path) -> None:
    res = CliRunner().invoke(app, ["keys", "list", "--dir", str(tmp_path)])
    assert res.exit_code == 0
    assert res.stdout == ""
    assert res.stderr.startswith(f"no public keys in {tmp_path} (create them with `ddiloco "
                                 "keys new")


# --------------------------------------------------------------------------------------------
# "Did you mean" for mistyped commands and options, in every group; brackets kept.
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("args, expected", [
    (["rn"], "No such command 'rn'. Did you mean 'run'?"),
    (["stauts"], "No such command 'stauts'. Did you mean 'status'?"),
    (["keys", "lst"], "No such command 'lst'. Did you mean 'list'?"),
    (["chaos", "reprot"], "No such command 'reprot'. Did you mean 'report'?"),
    (["run", "--ot", "x"], "No such option: --ot (Possible options: --out,"),
])
def test_mistyped_names_get_a_suggestion(args: list[str], expected: str) -> None:
    res = CliRunner().invoke(app, args)
    assert res.exit_code == 2
    assert expected in res.output


def test_an_unknown_command_far_from_any_gets_no_guess() -> None:
    res = CliRunner().invoke(app, ["zzzzzz"])
    assert res.exit_code == 2
    assert "No such command 'zzzzzz'." in res.output and "Did you mean" not in res.output


def test_usage_errors_keep_their_brackets() -> None:
    res = CliRunner().invoke(app, ["run", "--baseline", "[red]x[/red]"])
    assert res.exit_code == 2
    assert "'[red]x[/red]' is not one of 'dp'" in res.output


def test_an_out_under_a_file_is_refused_before_anything_starts(tmp_path: Path) -> None:
    # checked by check_out, before a run downloads its corpus (one line, nothing printed first)
    from ddiloco.workers.run.rundir import RunFolderError, check_out

    f = tmp_path / "file"
    f.write_text("x")
    with pytest.raises(RunFolderError) as exc:
        check_out(f / "a" / "b", force=False)
    assert str(exc.value) == (f"--out {f / 'a' / 'b'}: cannot create the run folder (Not a "
                              "directory); pick a writable path")
    assert check_out(tmp_path / "new" / "out", force=False) == []
