"""compose.yaml validated offline: the compose JSON schema, and consistency with the CLI."""

from __future__ import annotations

import ipaddress
import re
import shutil
import subprocess
import sys
from pathlib import Path
from typing import Any

import yaml

ROOT = Path(__file__).resolve().parent.parent


def test_compose_matches_the_compose_spec_schema() -> None:
    exe = shutil.which("check-jsonschema") or str(Path(sys.executable).parent / "check-jsonschema")
    proc = subprocess.run([exe, "--builtin-schema", "vendor.compose-spec",
                           str(ROOT / "compose.yaml")], capture_output=True, text=True,
                          timeout=120)
    assert proc.returncode == 0, proc.stdout + proc.stderr


_VAR = re.compile(r"\$\{(\w+):-([^}]*)\}")


def _spec() -> dict[str, Any]:
    """compose.yaml with every ``${VAR:-default}`` at its default."""
    return yaml.safe_load(_VAR.sub(lambda m: m.group(2), (ROOT / "compose.yaml").read_text()))


def _worker_argv(svc: dict[str, Any]) -> list[str]:
    return list(svc["command"])


def test_compose_services_are_valid_worker_commands() -> None:
    from typer.testing import CliRunner

    from ddiloco.cli import app

    services = _spec()["services"]
    assert any("appendonly" in " ".join(services["redis"]["command"]) for _ in [0])
    runner = CliRunner()
    for name, svc in services.items():
        if name in ("redis", "prometheus", "grafana"):
            continue
        argv = _worker_argv(svc)
        # every subcommand and option in compose exists in the CLI (help parses them)
        cmd = argv[:2] if argv[0] in ("keys", "chaos") else argv[:1]
        result = runner.invoke(app, [*cmd, "--help"], terminal_width=200)
        assert result.exit_code == 0, result.output
        for opt in (a for a in argv[len(cmd):] if a.startswith("--")):
            assert opt in result.output, f"{name}: {opt} is not an option of {cmd}"
    # one build for every service: only `keys` builds; the others use its image as is
    builders = [n for n, s in services.items() if "build" in s]
    assert builders == ["keys"]
    image = services["keys"]["image"]
    for name, svc in services.items():
        if svc.get("image") == image and name != "keys":
            assert svc.get("pull_policy") == "never", name
    # both shards write the same manifest (same config and overrides)
    assert services["shard-0"]["command"][4:8] == services["shard-1"]["command"][4:8]


def test_compose_regions_go_through_their_routers() -> None:
    """Learners sit in region networks with only their router; the router's region, subnets
    and gateway address agree with the topology file and the networks; shards, Redis and the
    evaluator sit in the hub network only, at the addresses the learners' hosts entries use."""
    from ddiloco.chaos.wan.topology import load_topology

    spec = _spec()
    services, networks = spec["services"], spec["networks"]
    subnet = {n: net["ipam"]["config"][0]["subnet"] for n, net in networks.items()}
    learners = [s for s in services if s.startswith("learner-")]
    regions = {n for s in learners for n in services[s]["networks"]}
    assert len(regions) >= 3, "learners must sit in at least three region networks"
    routers = {services[r]["command"][services[r]["command"].index("--region") + 1]: r
               for r in services if r.startswith("router-")}
    for name in learners:
        svc = services[name]
        (region,) = svc["networks"]
        router = services[routers[region]]
        argv = router["command"]
        topo = load_topology(ROOT / argv[argv.index("--topology") + 1].replace("/app/", ""))
        assert topo.region_of(name) == region, name
        assert argv[argv.index("--lan") + 1] == subnet[region]
        assert argv[argv.index("--wan") + 1] == subnet["core"]
        assert svc["environment"]["DDILOCO_GATEWAY"] == router["networks"][region][
            "ipv4_address"]
        assert svc["environment"]["DDILOCO_HUB_NET"] == subnet["core"]
        assert "NET_ADMIN" in svc["cap_add"] and "NET_ADMIN" in router["cap_add"]
        assert "net.ipv4.ip_forward=1" in router["sysctls"]
        assert svc["depends_on"][routers[region]]["condition"] == "service_healthy"
        hosts = dict(h.split(":") for h in svc["extra_hosts"])
        for hub_service, ip in hosts.items():
            assert services[hub_service]["networks"]["core"]["ipv4_address"] == ip
            assert ipaddress.IPv4Address(ip) in ipaddress.IPv4Network(subnet["core"])
    # fixed addresses lie outside the range the engine hands out (a container started early
    # took a router's address once: "Address already in use")
    for name, svc in services.items():
        nets = svc.get("networks", {})
        for net, opts in (nets.items() if isinstance(nets, dict) else []):
            if opts and "ipv4_address" in opts:
                pool = ipaddress.IPv4Network(networks[net]["ipam"]["config"][0]["ip_range"])
                assert ipaddress.IPv4Address(opts["ipv4_address"]) not in pool, (name, net)
    for hub_service in ("redis", "shard-0", "shard-1", "evaluator"):
        assert set(services[hub_service]["networks"]) == {"core"}, hub_service
        assert topo.region_of(hub_service) == "hub"


def test_compose_run_ends_on_its_own() -> None:
    """`up` returns: every long-running service stops when the run is over (learners at
    their budget; shards, evaluator, routers and Redis through `finish`), metrics are opt-in."""
    services = _spec()["services"]
    finish = services["finish"]["command"]
    assert finish[0] == "finish" and "--shutdown-store" in finish
    for name, svc in services.items():
        if name in ("prometheus", "grafana"):
            assert svc.get("profiles"), f"{name} must be opt-in: it never stops"
        else:
            assert not svc.get("profiles"), name
    for name in (n for n in services if n.startswith("router-")):
        assert services[name]["environment"]["DDILOCO_RUN_ID"]  # routers read stop requests


def test_compose_prometheus_scrapes_every_worker() -> None:
    """Every worker serves metrics, the compose Prometheus scrapes each of them, it reaches
    their networks, and Grafana gets the repository's dashboard."""
    services = _spec()["services"]
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
    folders = set(pyproject["tool"]["setuptools"]["package-dir"].values())
    assert folders == {"ddiloco", "pipeline", "store", "workers", "chaos"}
    dockerfile = (ROOT / "Dockerfile").read_text()
    for folder in folders:
        assert f"COPY {folder} ./{folder}" in dockerfile, folder
