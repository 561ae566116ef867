"""Redis roles and TLS against a real redis-server 7 (the Debian package; CI installs it).

Each role's user does its own work through the real store and is refused (NOPERM) what its
role must not do: a learner or the evaluator cannot write a version, a shard cannot write a
fragment it does not own. TLS: a redis-server with a TLS port and certificates made here,
reached with ``rediss://``.
"""

from __future__ import annotations

import shutil
import stat
import subprocess
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import redis

from ddiloco.pipeline.errors import ConfigError, StoreUnavailable
from ddiloco.pipeline.waiting import wait_until
from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.acl import acl_rules, create_users, role_of, server_version
from ddiloco.store.connect import connect
from ddiloco.workers.run.blobs import encode_blob
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.manifest import build_manifest

RUN = "acl-run"


def redis7() -> str | None:
    exe = shutil.which("redis-server")
    if exe is None:
        return None
    out = subprocess.run([exe, "--version"], capture_output=True, text=True).stdout
    ver = out.split("v=", 1)[1].split()[0] if "v=" in out else "0"
    return exe if int(ver.split(".")[0]) >= 7 else None


needs_redis7 = pytest.mark.skipif(redis7() is None, reason="needs redis-server >= 7 on PATH "
                                  "(apt-get install redis-server); CI installs it")


def test_rules_by_hand() -> None:
    learner = acl_rules(RUN, "learner-1", 4, 2)
    assert "%R~ddl:{acl-run:*}:*" in learner  # reads every fragment
    assert not any(r.startswith("~ddl:{acl-run:") for r in learner)  # writes none
    assert "~ddl:{acl-run}:learner:learner-1" in learner
    assert "~ddl:{acl-run}:fate:learner-1:*" in learner
    assert not any("learner-0" in r for r in learner)
    shard1 = acl_rules(RUN, "shard-1", 4, 2)
    assert [r for r in shard1 if r.startswith("~ddl:{acl-run:")] == [
        "~ddl:{acl-run:1}:*", "~ddl:{acl-run:3}:*"]
    assert "~ddl:{acl-run}:lease:1" in shard1 and "~ddl:{acl-run}:lease:0" not in shard1
    ev = acl_rules(RUN, "evaluator", 4, 2)
    assert not any(r.startswith("~ddl:{acl-run:") or (r.endswith("manifest") and
                   r.startswith("~")) for r in ev)
    assert role_of("shard-0") == "syncer"
    for bad in ("mallory", "shard-x"):
        with pytest.raises(ConfigError):
            role_of(bad)
    with pytest.raises(ConfigError, match="2 shards"):
        acl_rules(RUN, "shard-2", 4, 2)


@pytest.fixture(scope="module")
def server7(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    exe = redis7()
    if exe is None:
        pytest.skip("needs redis-server >= 7 on PATH (apt-get install redis-server)")
    with EmbeddedRedis(tmp_path_factory.mktemp("redis7"), executable=exe) as server:
        yield server


@needs_redis7
def test_each_role_does_its_work_and_nothing_more(server7: EmbeddedRedis,
                                                  tmp_path: Path) -> None:
    admin = connect(server7.url)
    assert server_version(admin) >= (7, 0)
    cfg = load_config(None, {"run.shards": 2, "sync.fragments": 4, "model.d_model": 16,
                             "model.n_layers": 1, "model.n_heads": 2, "model.d_ff": 32})
    RedisStore(admin, RUN).put_manifest(build_manifest(cfg, RUN))
    workers = ["learner-0", "learner-1", "shard-0", "shard-1", "evaluator"]
    users = create_users(admin, server7.url, RUN, workers, 4, 2, out_dir=tmp_path / "urls")
    for w in workers:
        path = tmp_path / "urls" / f"{w}.redis-url"
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
        assert path.read_text().strip() == users[w].url
    store = {w: RedisStore(connect(users[w].url, attempts=1), RUN) for w in workers}
    blob = encode_blob([np.zeros(3, np.float32)])

    # shards: claim and publish their own fragments (the store's Lua scripts included)
    for s in (0, 1):
        st = store[f"shard-{s}"]
        epoch = st.acquire_lease(s, f"owner-{s}", 5000)
        assert epoch is not None
        for p in (s, s + 2):
            st.claim_fragment(p, epoch)
            assert st.publish(p, expected_version=-1, epoch=epoch, value=blob, momentum=blob,
                              keep=4, meta={}) == 0
        st.announce_shard(s, {"pull": "tcp://x:1", "pub": "tcp://x:2"}, 5000)
        st.add_event("merge", {"shard": f"shard-{s}"})
        st.incr_counter("drops", "stale")
    # ... but not another shard's fragment
    with pytest.raises(redis.exceptions.NoPermissionError):
        store["shard-0"].publish(1, expected_version=0, epoch=1, value=blob, momentum=blob,
                                 keep=4, meta={})
    # learners: register, heartbeat, read versions and endpoints, record events and fates
    for m in (0, 1):
        st = store[f"learner-{m}"]
        inc = st.register_learner(f"learner-{m}")
        st.heartbeat_learner(f"learner-{m}", {"step": 1}, 3000)
        assert st.get_latest(0) is not None and st.get_manifest() is not None
        assert st.shards()
        st.add_event("leave", {"learner": f"learner-{m}"})
        st.set_fate(f"learner-{m}", inc, {"processed": 1})
    # ... but never a version, the manifest, a lease or another learner's keys
    lst = store["learner-0"]
    with pytest.raises(redis.exceptions.NoPermissionError):
        lst.publish(0, expected_version=0, epoch=1, value=blob, momentum=blob, keep=4, meta={})
    with pytest.raises(redis.exceptions.NoPermissionError):
        lst.client.set(lst.keys.value(0, 0), b"poison")
    with pytest.raises(redis.exceptions.NoPermissionError):
        lst.client.set(lst.keys.manifest, b"{}")
    with pytest.raises(redis.exceptions.NoPermissionError):
        lst.acquire_lease(0, "mallory", 5000)
    with pytest.raises(redis.exceptions.NoPermissionError):
        lst.heartbeat_learner("learner-1", {"step": 1}, 3000)
    with pytest.raises(redis.exceptions.NoPermissionError):
        lst.client.flushall()
    # the evaluator reads everything, writes no version
    ev = store["evaluator"]
    assert ev.get_latest_many([0, 1, 2, 3])[3] is not None
    assert len(ev.events(kinds={"merge"})) == 2
    with pytest.raises(redis.exceptions.NoPermissionError):
        ev.client.set(ev.keys.head(0), b"1")
    # nobody changed a version
    assert [b.version for b in RedisStore(admin, RUN).get_latest_many([0, 1, 2, 3])
            if b is not None] == [0, 0, 0, 0]


def test_redis6_has_no_selectors(tmp_path: Path) -> None:
    from ddiloco.store.embedded import find_redis_server

    exe = find_redis_server()
    with EmbeddedRedis(tmp_path / "r", executable=exe) as server:
        admin = connect(server.url)
        if server_version(admin) >= (7, 0):
            pytest.skip("the bundled redis-server is >= 7: nothing to refuse")
        with pytest.raises(ConfigError, match=r">= 7\.0"):
            create_users(admin, server.url, RUN, ["learner-0"], 4, 2)


# ---------------------------------------------------------------------------- TLS


def make_certs(d: Path) -> tuple[Path, Path, Path]:
    """A CA and a server certificate for 127.0.0.1 (openssl CLI)."""
    def run(*args: str) -> None:
        subprocess.run(["openssl", *args], check=True, capture_output=True, cwd=d)

    run("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-keyout", "ca.key", "-out",
        "ca.crt", "-days", "1", "-subj", "/CN=ddiloco-test-ca")
    run("req", "-newkey", "rsa:2048", "-nodes", "-keyout", "server.key", "-out", "server.csr",
        "-subj", "/CN=127.0.0.1")
    (d / "ext.cnf").write_text("subjectAltName=IP:127.0.0.1\n")
    run("x509", "-req", "-in", "server.csr", "-CA", "ca.crt", "-CAkey", "ca.key",
        "-CAcreateserial", "-out", "server.crt", "-days", "1", "-extfile", "ext.cnf")
    return d / "ca.crt", d / "server.crt", d / "server.key"


@needs_redis7
@pytest.mark.skipif(shutil.which("openssl") is None, reason="needs the openssl CLI")
def test_store_over_tls(tmp_path: Path) -> None:
    import socket

    ca, crt, key = make_certs(tmp_path)
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    exe = redis7()
    assert exe is not None
    proc = subprocess.Popen([exe, "--port", "0", "--tls-port", str(port), "--bind", "127.0.0.1",
                             "--tls-cert-file", str(crt), "--tls-key-file", str(key),
                             "--tls-ca-cert-file", str(ca), "--tls-auth-clients", "no",
                             "--save", "", "--appendonly", "no", "--dir", str(tmp_path)],
                            stdout=subprocess.DEVNULL, stderr=subprocess.STDOUT)
    try:
        url = f"rediss://127.0.0.1:{port}/0?ssl_ca_certs={ca}"
        client = wait_until(lambda: connect(url, attempts=1, timeout_s=1.0), timeout_s=10.0,
                            what="redis-server to accept TLS connections",
                            retry_on=(StoreUnavailable,))
        store = RedisStore(client, RUN)
        cfg = load_config(None, {"sync.fragments": 2, "run.shards": 1})
        store.put_manifest(build_manifest(cfg, RUN))
        assert store.get_manifest() is not None
        # a client that does not trust the server's CA is refused
        with pytest.raises(Exception, match=r"(?i)certificate|ssl|unavailable"):
            connect(f"rediss://127.0.0.1:{port}/0", attempts=1, timeout_s=1.0)
    finally:
        proc.terminate()
        proc.wait(10)


@needs_redis7
def test_local_run_workers_run_under_their_roles(tmp_path: Path) -> None:
    """`ddiloco run` on a Redis 7 embedded server: every worker connects as its own ACL user
    (a permission its role lacks would stop it with NOPERM), and the users are saved to the
    server's ACL file so a restarted Redis still knows them."""
    import json
    import os
    import sys

    exe = redis7()
    assert exe is not None
    out = tmp_path / "run"
    root = Path(__file__).resolve().parent.parent
    proc = subprocess.run(
        [sys.executable, "-m", "ddiloco.cli", "run", "--config",
         str(root / "configs" / "ci-tiny.yaml"), "--steps", "40", "--no-live", "--out",
         str(out)], capture_output=True, text=True, timeout=280, cwd=root,
        env={**os.environ, "DDILOCO_REDIS_SERVER": exe})
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    block = json.loads((out / "report.json").read_text())["diloco"]
    assert block["token_fate"]["balance"] == 0 and max(block["versions"]) > 0
    run_id = json.loads((out / "run.json").read_text())["run_id"]
    acl = (out / "redis" / "users.acl").read_text()
    for worker in ("learner-0", "learner-1", "shard-0", "evaluator"):
        assert f"user ddl-{run_id}-{worker} on" in acl
    commands = (out / "diloco" / "commands.sh").read_text()
    assert f"ddl-{run_id}-learner-0:" in commands  # each worker's own URL
    logs = "".join(p.read_text() for p in (out / "diloco" / "logs").glob("*.log"))
    assert "NOPERM" not in logs
