"""compose.yaml validated offline: the compose JSON schema, and consistency with the CLI."""

from __future__ import annotations

import shutil
import subprocess
import sys
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_matches_the_compose_spec_schema() -> None:
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    proc = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec",
                           str(ROOT / "compose.yaml")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


def test_compose_services_are_valid_worker_commands() -> None:
    from typer.testing import CliRunner

    from ddiloco.cli import app

    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = spec["services"]
    learners = [s for s in services if s.startswith("learner-")]
    regions = {n for s in learners for n in services[s]["networks"]}
    assert len(regions) >= 3, "learners must sit in at least three region networks"
    assert any("appendonly" in " ".join(services["redis"]["command"]) for _ in [0])
    runner = CliRunner()
    for name, svc in services.items():
        if name in ("redis", "prometheus", "grafana"):
            continue
        argv = svc["command"]
        # every subcommand and option in compose exists in the CLI (help parses them)
        cmd = argv[:2] if argv[0] in ("keys", "chaos") else argv[:1]
        result = runner.invoke(app, [*cmd, "--help"], terminal_width=200)
        assert result.exit_code == 0, result.output
        for opt in (a for a in argv[len(cmd):] if a.startswith("--")):
            assert opt in result.output, f"{name}: {opt} is not an option of {cmd}"
    # syncers must be reachable from every learner's region
    for shard in (s for s in services if s.startswith("shard-")):
        assert regions <= set(services[shard]["networks"])
    assert (ROOT / "Dockerfile").exists()


def test_compose_prometheus_scrapes_every_worker() -> None:
    """Every worker serves metrics, the compose Prometheus scrapes each of them, it reaches
    their networks, and Grafana gets the repository's dashboard."""
    spec = yaml.safe_load((ROOT / "compose.yaml").read_text())
    services = spec["services"]
    workers = [n for n in services if n.startswith(("shard-", "learner-")) or n == "evaluator"]
    prom = yaml.safe_load((ROOT / "configs" / "prometheus" / "compose.yml").read_text())
    targets = {t for sc in prom["scrape_configs"] for c in sc["static_configs"]
               for t in c["targets"]}
    for name in workers:
        argv = services[name]["command"]
        port = argv[argv.index("--metrics-port") + 1]
        assert f"{name}:{port}" in targets, name
        assert set(services[name]["networks"]) <= set(services["prometheus"]["networks"])
    mounts = " ".join(services["grafana"]["volumes"])
    assert "./configs/grafana/dashboards" in mounts and "./configs/grafana/provisioning" in mounts
    for mount in [*services["grafana"]["volumes"], *services["prometheus"]["volumes"]]:
        assert (ROOT / mount.split(":")[0]).exists(), mount


def test_dockerfile_copies_every_package() -> None:
    """The image installs with `pip install .`: a package folder it does not copy is silently
    left out (chaos/ was), and its commands fail inside the containers."""
    import tomllib

    pyproject = tomllib.loads((ROOT / "pyproject.toml").read_text())
    packages = [p.rstrip("*") for p in pyproject["tool"]["setuptools"]["packages"]["find"]
                ["include"]]
    dockerfile = (ROOT / "Dockerfile").read_text()
    for pkg in packages:
        assert f"COPY {pkg} ./{pkg}" in dockerfile, pkg
