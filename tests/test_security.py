"""CURVE keys, the allow-list and a real shard process refusing what is not keyed.

The shard runs as its own process on real sockets; the attackers are sockets of this test
process. Every negative result is observed as an event (a handshake failure on the attacker's
socket monitor, a drop or refusal counter in the store), then a keyed learner's delta is shown
to merge, and the merge names only that delta.
"""

from __future__ import annotations

import os
import stat
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import zmq
import zmq.auth
from zmq.utils.monitor import recv_monitor_message

from ddiloco.pipeline import security, wire
from ddiloco.pipeline.errors import ConfigError
from ddiloco.pipeline.wire import Header, Kind
from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.connect import connect
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.launch import LocalCluster, with_run_keys
from ddiloco.workers.run.manifest import init_run, manifest_layout

ROOT = Path(__file__).resolve().parent.parent


# ---------------------------------------------------------------------------- keys


def test_keys_are_private_and_loadable(tmp_path: Path) -> None:
    kp = security.create_keys(tmp_path, "learner-0")
    assert len(kp.public) == 40 and len(kp.secret) == 40
    for path in (tmp_path / "learner-0.key", tmp_path / "private" / "learner-0.key_secret"):
        assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert stat.S_IMODE((tmp_path / "private").stat().st_mode) == 0o700
    assert security.load_keys(tmp_path, "learner-0") == kp
    assert security.public_key(tmp_path, "learner-0") == kp.public
    assert security.allow_list(tmp_path) == {kp.public: "learner-0"}
    with pytest.raises(ConfigError, match="exist"):
        security.create_keys(tmp_path, "learner-0")
    assert security.create_keys(tmp_path, "learner-0", overwrite=True).public != kp.public
    os.chmod(tmp_path / "private" / "learner-0.key_secret", 0o644)
    with pytest.raises(ConfigError, match="chmod 600"):
        security.load_keys(tmp_path, "learner-0")
    with pytest.raises(ConfigError, match="ddiloco keys new"):
        security.load_keys(tmp_path, "learner-9")
    with pytest.raises(ConfigError, match="key name"):
        security.create_keys(tmp_path, "../evil")


def test_insecure_only_on_loopback() -> None:
    load_config(None, {"security.curve": False})
    with pytest.raises(ConfigError, match="loopback only"):
        load_config(None, {"security.curve": False, "run.bind_host": "0.0.0.0"})
    load_config(None, {"run.bind_host": "0.0.0.0"})  # CURVE: any bind


def test_local_run_keys_cover_every_worker(tmp_path: Path) -> None:
    cfg = with_run_keys(load_config(None, {"run.learners": 3, "run.shards": 2}), tmp_path)
    assert cfg.security.keys_dir == str((tmp_path / "keys").resolve())
    assert sorted(security.allow_list(cfg.security.keys_dir).values()) == [
        "learner-0", "learner-1", "learner-2", "shard-0", "shard-1"]
    again = with_run_keys(load_config(None, {"run.learners": 3, "run.shards": 2}), tmp_path)
    assert security.allow_list(again.security.keys_dir) == \
        security.allow_list(cfg.security.keys_dir)  # kept, not replaced
    insecure = load_config(None, {"security.curve": False})
    assert with_run_keys(insecure, tmp_path) is insecure


# ---------------------------------------------------------------------------- a real shard


def wait_for(pred: Callable[[], Any], timeout_s: float, what: str) -> Any:
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        got = pred()
        if got:
            return got
        time.sleep(0.1)
    raise AssertionError(f"timed out after {timeout_s} s waiting for {what}")


def connect_watched(sock: zmq.Socket, endpoint: str) -> zmq.Socket:
    """Connect ``sock`` with its monitor attached first (no event can be missed); returns
    the monitor socket."""
    mon = sock.get_monitor_socket()
    sock.connect(endpoint)
    return mon


def wait_event(mon: zmq.Socket, events: set[int], timeout_s: float = 20.0) -> int:
    """Wait for one of ``events`` on a monitor socket; returns it. The monitor stays open
    (:func:`close_watched` closes it): with each monitor closed here while its socket still
    reported events into it, a later socket of the context saw no event and delivered nothing
    in about 1 run of 5 on a loaded machine (three busy processes on two cores); closed after
    ``disable_monitor``, 40 runs of 40 passed there."""
    deadline = time.monotonic() + timeout_s
    seen = []
    while time.monotonic() < deadline:
        if mon.poll(200):
            ev = recv_monitor_message(mon)["event"]
            seen.append(str(ev))
            if ev in events:
                return int(ev)
    raise AssertionError(f"no monitor event in {events} within {timeout_s} s (saw {seen})")


def close_watched(*socks: zmq.Socket) -> None:
    """Stop monitoring each socket, then close its monitor and the socket (that order)."""
    for s in socks:
        mon = s.get_monitor_socket()  # the open monitor of connect_watched
        s.disable_monitor()
        mon.close(linger=0)
        s.close(linger=0)


HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH}


@pytest.fixture(scope="module")
def shard(redis_server: EmbeddedRedis, tmp_path_factory: pytest.TempPathFactory
          ) -> Iterator[tuple[Any, RedisStore, dict[str, str], Path]]:
    run_dir = tmp_path_factory.mktemp("sec")
    run_id = "it-security"
    cfg = with_run_keys(load_config(ROOT / "configs" / "ci-tiny.yaml",
                                    {"run.learners": 2, "run.shards": 1,
                                     "sync.merge_every": 0.0}), run_dir)
    store = RedisStore(connect(redis_server.url), run_id)
    manifest = init_run(store, cfg, run_id)
    for lid in ("learner-0", "learner-1"):
        store.register_learner(lid)
    cluster = LocalCluster(redis_server.url, run_id, run_dir)
    cluster.add_syncer(0)
    cluster.start_all()
    try:
        eps = wait_for(lambda: store.shard_endpoints(0), 60, "the shard's endpoints")
        wait_for(lambda: store.get_latest(0) is not None, 60, "version 0")
        keys_dir = Path(cfg.security.keys_dir or "")
        # Serving: a keyed subscriber hears the shard's heartbeat (the tests below race the
        # handshakes of refused and admitted peers; they start once the shard serves).
        ctx = zmq.Context()
        probe = ctx.socket(zmq.SUB)
        probe.setsockopt(zmq.LINGER, 0)
        probe.setsockopt(zmq.SUBSCRIBE, b"")
        security.client(probe, security.load_keys(keys_dir, "learner-1"),
                        security.public_key(keys_dir, "shard-0"))
        probe.connect(eps["pub"])
        assert probe.poll(60_000), "the shard never broadcast a heartbeat"
        probe.close()
        ctx.term()
        yield manifest, store, eps, keys_dir
    finally:
        cluster.stop_all()
        store.flush_run()


def delta(manifest: dict[str, Any], sender: str, inc: int, seq: int) -> list[bytes]:
    layout = manifest_layout(manifest)
    rng = np.random.default_rng(seq)
    tensors = [rng.normal(scale=1e-3, size=s).astype(np.float32) for s in layout.shapes(0)]
    tpb = 8 * 32  # ci-tiny: batch 8 x seq_len 32
    return wire.encode(Header(kind=Kind.DELTA, run=manifest["run_id"], sender=sender, inc=inc,
                              seq=seq, frag=0, base=0, c_steps=6, c_tokens=6 * tpb,
                              new_tokens=6 * tpb, step=6, step_time=0.05, codec="int4"),
                       tensors)


def push(ctx: zmq.Context, endpoint: str, keys: security.KeyPair | None,
         server_key: bytes | None, retry_ms: int | None = None) -> zmq.Socket:
    """A PUSH socket, CURVE client with ``keys`` if given. ``retry_ms``: its reconnect
    interval (a refused peer retries every 100 ms by default, and each retry costs the shard
    a handshake: the tests observe one refusal)."""
    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.LINGER, 0)
    if retry_ms is not None:
        sock.setsockopt(zmq.RECONNECT_IVL, retry_ms)
    if keys is not None and server_key is not None:
        security.client(sock, keys, server_key)
    return sock


def test_unkeyed_and_spoofed_senders_cannot_change_a_version(
        shard: tuple[Any, RedisStore, dict[str, str], Path], tmp_path: Path) -> None:
    manifest, store, eps, keys_dir = shard
    server_key = security.public_key(keys_dir, "shard-0")
    ctx = zmq.Context()
    try:
        # 1. plain TCP, the header claiming a registered learner: the handshake fails
        plain = push(ctx, eps["pull"], None, None, retry_ms=10_000)
        mon = connect_watched(plain, eps["pull"])
        try:  # a connection whose handshake already failed leaves no pipe: may not queue
            plain.send_multipart(delta(manifest, "learner-0", 7, 1), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        wait_event(mon, HANDSHAKE_FAILED | {zmq.EVENT_DISCONNECTED})
        # 2. CURVE with a key outside the allow-list: refused by the ZAP handler
        mallory = security.create_keys(tmp_path, "mallory")
        outsider = push(ctx, eps["pull"], mallory, server_key, retry_ms=10_000)
        mon = connect_watched(outsider, eps["pull"])
        assert wait_event(mon, HANDSHAKE_FAILED) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        try:  # refused connections leave no peer to queue for: this may not even queue
            outsider.send_multipart(delta(manifest, "learner-0", 8, 1), flags=zmq.NOBLOCK)
        except zmq.Again:
            pass
        wait_for(lambda: store.counters("auth").get("refused", 0) >= 1, 20,
                 "the shard's refusal count")
        # 3. learner-1's key speaking for learner-0: dropped as spoofed
        l1 = security.load_keys(keys_dir, "learner-1")
        spoof = push(ctx, eps["pull"], l1, server_key)
        mon_spoof = connect_watched(spoof, eps["pull"])
        # sent once the handshake is done, so that a failure names the stage that failed
        assert wait_event(mon_spoof, {zmq.EVENT_HANDSHAKE_SUCCEEDED} | HANDSHAKE_FAILED,
                          timeout_s=60) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        spoof.send_multipart(delta(manifest, "learner-0", 9, 1))
        try:
            wait_for(lambda: store.counters("drops").get("spoofed_sender") == 1, 20,
                     "the spoofed delta's drop")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: drops {store.counters('drops')}, auth "
                                 f"{store.counters('auth')}, events "
                                 f"{[k for _, k in store.events()][-8:]}") from None
        assert store.get_latest(0).version == 0  # type: ignore[union-attr]
        # the positive control: learner-0's own key, its own id -> merged
        sub_ok = ctx.socket(zmq.SUB)
        sub_ok.setsockopt(zmq.LINGER, 0)
        sub_ok.setsockopt(zmq.SUBSCRIBE, b"")
        security.client(sub_ok, l1, server_key)
        mon_ok = connect_watched(sub_ok, eps["pub"])
        sub_bad = ctx.socket(zmq.SUB)
        sub_bad.setsockopt(zmq.LINGER, 0)
        sub_bad.setsockopt(zmq.SUBSCRIBE, b"")
        sub_bad.setsockopt(zmq.RECONNECT_IVL, 10_000)  # one refusal is what is tested
        security.client(sub_bad, mallory, server_key)
        mon_bad = connect_watched(sub_bad, eps["pub"])
        assert wait_event(mon_bad, HANDSHAKE_FAILED) == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        assert wait_event(mon_ok, {zmq.EVENT_HANDSHAKE_SUCCEEDED}) == \
            zmq.EVENT_HANDSHAKE_SUCCEEDED
        l0 = security.load_keys(keys_dir, "learner-0")
        good = push(ctx, eps["pull"], l0, server_key)
        mon_good = connect_watched(good, eps["pull"])
        assert wait_event(mon_good, {zmq.EVENT_HANDSHAKE_SUCCEEDED} | HANDSHAKE_FAILED,
                          timeout_s=60) == zmq.EVENT_HANDSHAKE_SUCCEEDED
        good.send_multipart(delta(manifest, "learner-0", 1, 100))
        def merges_of_fragment_0() -> list[dict[str, Any]]:
            return [e for _, e in store.events(kinds={"merge"}) if e.get("fragment") == 0]

        try:
            # the merge's event, not only its version: a shard records the event after the
            # publish (workers/syncer/records.py), so a version can be seen first
            wait_for(lambda: store.get_latest(0).version >= 1  # type: ignore[union-attr]
                     and merges_of_fragment_0(), 30, "the keyed delta's merge")
        except AssertionError as exc:
            raise AssertionError(f"{exc}: drops {store.counters('drops')}, auth "
                                 f"{store.counters('auth')}, events "
                                 f"{[k for _, k in store.events()][-8:]}") from None
        merges = merges_of_fragment_0()
        assert [c for m in merges for c in m["contributions"]] == [
            {"learner": "learner-0", "inc": 1, "seqs": [100], "tokens": 6 * 256}], merges
        # encrypted broadcasts: the keyed subscriber gets the version, the outsider nothing
        assert sub_ok.poll(60_000), "no version broadcast reached the keyed subscriber"
        got = wire.decode(sub_ok.recv_multipart(), run_id=manifest["run_id"],
                          expected_shapes=lambda h: manifest_layout(manifest).shapes(h.frag))
        assert got.header.kind in (Kind.VERSION, Kind.HEARTBEAT, Kind.CONTROL)
        assert not sub_bad.poll(500)
        close_watched(plain, outsider, spoof, good, sub_ok, sub_bad)
    finally:
        ctx.destroy(linger=0)


def test_keys_cli(tmp_path: Path) -> None:
    import subprocess
    import sys

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([sys.executable, "-m", "ddiloco.cli", *args],
                              capture_output=True, text=True, timeout=120)

    made = cli("keys", "new", "learner-0", "shard-0", "--dir", str(tmp_path))
    assert made.returncode == 0, made.stderr
    listed = cli("keys", "list", "--dir", str(tmp_path))
    assert [line.split("\t")[0] for line in listed.stdout.splitlines()] == \
        ["learner-0", "shard-0"]
    again = cli("keys", "new", "learner-0", "--dir", str(tmp_path))
    assert again.returncode == 2 and "exist" in again.stderr
    kept = cli("keys", "new", "learner-0", "--dir", str(tmp_path), "--exist-ok")
    assert kept.returncode == 0 and kept.stdout.split()[1] == made.stdout.split()[1]
    assert "--insecure" in cli("run", "--help").stdout
