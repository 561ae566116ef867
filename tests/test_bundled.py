"""Bundled chaos scripts and configs: named without a checkout (``ddiloco chaos run gentle``,
``--config ci-tiny``), listed with their descriptions, a path wins, and an unknown name says
which one was meant. The installed wheel's side is in tests/test_install.py."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
from typer.testing import CliRunner

from ddiloco.bundled import (
    CHAOS_SCRIPTS,
    bundled_chaos_scripts,
    bundled_configs,
    resolve_chaos_script,
)
from ddiloco.chaos.script import load_script
from ddiloco.cli import app
from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.run.bundled import CONFIGS, Bundle, UnknownBundledName, resolve_config
from ddiloco.workers.run.config import load_config

ROOT = Path(__file__).resolve().parent.parent


@pytest.fixture
def elsewhere(tmp_path: Path) -> Path:
    """A working directory outside the checkout (no chaos/ or configs/ folder)."""
    cwd = Path.cwd()
    os.chdir(tmp_path)
    try:
        yield tmp_path
    finally:
        os.chdir(cwd)


def test_every_file_of_the_folders_is_bundled_by_its_stem() -> None:
    scripts = {p.stem for p in (ROOT / "chaos" / "scripts").glob("*.yaml")}
    assert set(bundled_chaos_scripts()) == scripts and "gentle" in scripts
    configs = {p.stem for p in (ROOT / "configs").iterdir() if p.suffix in (".yaml", ".toml")}
    assert set(bundled_configs()) == configs and {"ci-tiny", "default"} <= configs
    # the compose dashboards are not configs
    assert not any("grafana" in str(p) for p in CONFIGS.files().values())


def test_descriptions_are_one_line_first_sentences() -> None:
    scripts = bundled_chaos_scripts()
    assert scripts["gentle"] == ("One learner kill -9 with a 10 s outage, then one 5 s pause "
                                 "of another learner.")
    assert bundled_configs()["ci-tiny"] == ("A very small model for integration tests and "
                                            "quick smoke runs.")
    for text in [*scripts.values(), *bundled_configs().values()]:
        assert "\n" not in text and len(text) <= 160


def test_names_resolve_outside_a_checkout(elsewhere: Path) -> None:
    assert resolve_chaos_script("gentle").name == "gentle.yaml"
    assert resolve_chaos_script("gentle.yaml") == resolve_chaos_script("gentle")
    # the docs' spelling works outside a checkout too
    assert resolve_chaos_script("chaos/scripts/gentle.yaml") == resolve_chaos_script("gentle")
    assert load_script(resolve_chaos_script("gentle")).name == "gentle"
    cfg = load_config("ci-tiny")
    assert (cfg.run.learners, cfg.model.d_model) == (2, 32)
    assert load_config("configs/ci-tiny.yaml") == cfg
    assert resolve_config("regions-4").name == "regions-4.yaml"


def test_an_existing_path_wins_over_a_bundled_name(elsewhere: Path) -> None:
    (elsewhere / "gentle").write_text("name: mine\n")
    assert resolve_chaos_script("gentle") == Path("gentle")
    (elsewhere / "ci-tiny").write_text("run: {learners: 3}\n")
    assert load_config("ci-tiny").run.learners == 3


def test_an_unknown_name_suggests_the_closest(elsewhere: Path) -> None:
    with pytest.raises(UnknownBundledName) as exc:
        resolve_chaos_script("gentel")
    assert str(exc.value) == ("unknown chaos script 'gentel'; did you mean 'gentle'? "
                              "(ddiloco chaos scripts lists them)")
    with pytest.raises(ConfigError, match=r"unknown config 'ci-tny'; did you mean 'ci-tiny'\?"):
        load_config("ci-tny")
    with pytest.raises(UnknownBundledName, match="not a file here, nor one of ci-short, "):
        resolve_chaos_script("zzzz")
    # a path-like name that does not exist is left to the reader's "no such file" error
    assert resolve_chaos_script("missing/x.yaml") == Path("missing/x.yaml")
    assert resolve_chaos_script("/no/chaos/scripts/gentle.yaml") == Path(
        "/no/chaos/scripts/gentle.yaml")
    with pytest.raises(ConfigError, match=r"no-such\.toml: No such file"):
        load_config("no-such.toml")


def test_a_bundle_without_its_package_reads_the_checkout_folder(tmp_path: Path) -> None:
    (tmp_path / "a.yaml").write_text("# Alpha. More.\nx: 1\n")
    bundle = Bundle(kind="thing", package="ddiloco.no_such_package", folder="things",
                    suffixes=(".yaml",), lister="ddiloco things", checkout=tmp_path)
    assert bundle.files() == {"a": tmp_path / "a.yaml"}
    assert CHAOS_SCRIPTS.directories()  # the installed (or editable) package is found


def test_the_cli_lists_and_refuses(elsewhere: Path) -> None:
    runner = CliRunner()
    res = runner.invoke(app, ["chaos", "scripts"])
    assert res.exit_code == 0, res.output
    lines = res.output.splitlines()
    gentle = next(line for line in lines if line.startswith("gentle "))
    assert gentle.split(None, 1)[1] == bundled_chaos_scripts()["gentle"]
    res = runner.invoke(app, ["chaos", "scripts", "--configs", "--json"])
    assert res.exit_code == 0 and json.loads(res.output) == bundled_configs()
    res = runner.invoke(app, ["chaos", "run", "gentel", "--no-live"])
    assert res.exit_code == 2
    assert ("error: unknown chaos script 'gentel'; did you mean 'gentle'? (ddiloco chaos "
            "scripts lists them)") in res.output
    res = runner.invoke(app, ["run", "--config", "ci-tny", "--no-live", "--out",
                              str(elsewhere / "out")])
    assert res.exit_code == 2 and "did you mean 'ci-tiny'?" in res.output
    assert not (elsewhere / "out").exists()
