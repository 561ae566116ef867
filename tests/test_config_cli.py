"""``ddiloco config show / validate / docs``, docs/CONFIG.md kept in step with the schema, and
every shipped config file valid."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import yaml
from typer.testing import CliRunner

from ddiloco.cli import app
from ddiloco.config_cli import reference
from ddiloco.store import EmbeddedRedis
from ddiloco.workers.run.config import Config, load_config
from ddiloco.workers.run.config_schema import count_keys

ROOT = Path(__file__).resolve().parent.parent
REGENERATE = ".venv/bin/ddiloco config docs > docs/CONFIG.md"


def _invoke(*args: str) -> tuple[int, str, str]:
    res = CliRunner().invoke(app, list(args))
    return res.exit_code, res.stdout, res.stderr


def _keys(tree: dict[str, dict[str, object]]) -> set[str]:
    return {f"{s}.{k}" for s, keys in tree.items() for k in keys}


def _schema_keys() -> set[str]:
    return {f"{s}.{k}" for s, info in Config.model_fields.items()
            for k in info.annotation.model_fields}


def test_config_docs_is_current() -> None:
    on_disk = (ROOT / "docs" / "CONFIG.md").read_text()
    assert on_disk == reference(), f"docs/CONFIG.md is stale: run `{REGENERATE}`"


def test_docs_name_every_key_with_its_default_and_range() -> None:
    code, out, _ = _invoke("config", "docs")
    assert code == 0 and out == reference() == reference()  # deterministic
    for key in _schema_keys():
        assert f"| `{key}` |" in out, key
    assert "| `sync.gamma` | number | `0.9` | (0, 1] |" in out
    assert "| `train.schedule` | choice | `\"cosine\"` | cosine, linear, constant |" in out
    assert "| `run.out` | not a config key; the run directory is the --out option |" in out


@pytest.mark.parametrize("fmt", ["yaml", "json", "toml"])
def test_show_prints_every_key_and_loads_back(fmt: str, tmp_path: Path) -> None:
    if fmt == "toml":
        pytest.importorskip("tomli_w")
    code, out, err = _invoke("config", "show", "--config", str(ROOT / "configs" / "ci-tiny.yaml"),
                             "--set", "sync.H=5", "--set", "data.corpus=/p/a.txt",
                             "--format", fmt)
    assert code == 0, err
    want = load_config(ROOT / "configs" / "ci-tiny.yaml", ["sync.H=5", "data.corpus=/p/a.txt"])
    f = tmp_path / f"shown.{fmt}"
    f.write_text(out)
    assert load_config(f) == want  # a shown config is a valid config, the same one
    if fmt == "toml":
        # TOML has no null: an unset key is a comment, and loads back as its default
        assert "# task = none  (TOML has no null: left out)" in out
    else:
        tree = json.loads(out) if fmt == "json" else yaml.safe_load(out)
        assert _keys(tree) == _schema_keys()
        assert tree["model"]["task"] is None and tree["sync"]["H"] == 5


def test_show_reports_a_bad_override() -> None:
    code, _, err = _invoke("config", "show", "--set", "sync.HH=3")
    assert code == 2
    assert err.strip() == "error: unknown key sync.HH; did you mean sync.H?"


def test_validate_counts_keys_set_and_defaults(tmp_path: Path) -> None:
    f = tmp_path / "c.yaml"
    f.write_text("sync: {H: 12, tau: 1}\ntrain: {speed: {learner-0: 0.5}}\n")
    code, out, _ = _invoke("config", "validate", str(f), "--set", "run.learners=2",
                           "--set", "sync.H=6")
    total = count_keys(Config)
    assert code == 0
    assert out.strip() == f"{f}: valid (4 keys set, {total - 4} defaults)"


def test_validate_names_the_file_and_the_key(tmp_path: Path) -> None:
    f = tmp_path / "c.toml"
    f.write_text("[train]\nsteps = 1\nwarmup_steps = 50\n")
    code, _, err = _invoke("config", "validate", str(f))
    assert code == 2
    assert err.strip() == (f"error: {f}: train.steps: 1 must exceed train.warmup_steps (50) "
                           "for a decaying schedule; lower train.warmup_steps or set "
                           "train.schedule=constant")
    bad = tmp_path / "bad.toml"
    bad.write_text("[sync\nH=")
    code, _, err = _invoke("config", "validate", str(bad))
    assert code == 2 and err.startswith(f"error: config file {bad}: ")


def test_the_installed_command_refuses_a_bad_file_in_one_line(tmp_path: Path) -> None:
    f = tmp_path / "bad.yaml"
    f.write_text("sync: {HH: 3}\n")
    exe = Path(sys.executable).with_name("ddiloco")
    res = subprocess.run([str(exe), "config", "validate", str(f)], capture_output=True,
                         text=True, timeout=60)
    assert res.returncode == 2
    assert res.stderr.splitlines() == [f"error: {f}: unknown key sync.HH; did you mean sync.H?"]
    assert res.stdout == ""


def _shipped() -> list[Path]:
    skip = {"grafana", "prometheus"}
    return sorted(p for p in (ROOT / "configs").rglob("*")
                  if p.suffix in (".toml", ".yaml", ".yml")
                  and not skip & set(p.relative_to(ROOT / "configs").parts))


@pytest.mark.parametrize("path", _shipped(), ids=lambda p: p.name)
def test_every_shipped_file_validates(path: Path) -> None:
    """Run configs against the config schema, region topologies (a top-level ``regions``)
    against theirs: an unknown or misspelt key fails either."""
    tree = yaml.safe_load(path.read_text()) if path.suffix != ".toml" else None
    if tree is not None and "regions" in tree:
        from ddiloco.chaos.wan.topology import load_topology

        load_topology(path)
        return
    code, out, err = _invoke("config", "validate", str(path))
    assert code == 0, err
    assert out.startswith(f"{path}: valid (")


def test_default_toml_holds_defaults_and_says_where_the_rest_is() -> None:
    path = ROOT / "configs" / "default.toml"
    assert load_config(path) == load_config()
    head = path.read_text().split("\n\n", 1)[0]
    assert "docs/CONFIG.md" in head and "ddiloco config show" in head


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_syncer_announces_run_advertise_host_from_its_config(redis_server: EmbeddedRedis,
                                                             tmp_path: Path) -> None:
    """``ddiloco syncer --config F`` with no --advertise announces F's run.advertise_host."""
    from ddiloco.pipeline.waiting import poll_until
    from ddiloco.store import RedisStore
    from ddiloco.store.connect import connect
    from ddiloco.workers.run.launch import LocalCluster

    f = tmp_path / "c.yaml"
    f.write_text((ROOT / "configs" / "ci-tiny.yaml").read_text()
                 + "security: {curve: false}\n"
                 + "data: {corpus: [" + json.dumps(str(tmp_path / "text.txt")) + "]}\n")
    (tmp_path / "text.txt").write_text("To be, or not to be, that is the question.\n" * 400)
    f.write_text(f.read_text().replace("run: {", "run: {advertise_host: localhost, "))
    run_id = "it-advertise"
    store = RedisStore(connect(redis_server.url), run_id)
    cluster = LocalCluster(redis_server.url, run_id, tmp_path)
    shard = cluster.add_syncer(0)
    shard.argv += ["--config", str(f)]
    cluster.start("shard-0")
    try:
        eps = poll_until(lambda: store.shard_endpoints(0), timeout_s=90, interval_s=0.2)
        assert eps["pull"].startswith("tcp://localhost:"), eps
        assert eps["pub"].startswith("tcp://localhost:"), eps
    finally:
        cluster.stop_all()
        store.flush_run()
