"""Redis high availability (docs/RELIABILITY.md): Sentinel URLs, a publish acknowledged only
once a replica has it, and a store that goes on after its primary is killed for good: real
redis-server processes (a primary, two replicas, three sentinels)."""

from __future__ import annotations

import socket
from collections.abc import Iterator
from pathlib import Path

import pytest
from redis.backoff import NoBackoff
from redis.retry import Retry

from ddiloco.pipeline.errors import ConfigError, StoreUnavailable
from ddiloco.store import RedisStore, connect, redact_url
from ddiloco.store.connect import REPLICAS_ATTR, AskingConnection
from ddiloco.store.embedded import EmbeddedRedis
from ddiloco.store.embedded_ha import SERVICE, EmbeddedRedisHA

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def ha(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedisHA]:
    with EmbeddedRedisHA(tmp_path_factory.mktemp("ha")) as cluster:
        yield cluster


def test_sentinel_urls_are_checked_and_their_passwords_masked(ha: EmbeddedRedisHA) -> None:
    url = "redis+sentinel://user:s3cret@h1:26379,h2:26379/svc"
    assert redact_url(url) == "redis+sentinel://user:***@h1:26379,h2:26379/svc"
    with pytest.raises(ConfigError, match="SERVICE"):
        connect("redis+sentinel://127.0.0.1:1")
    with pytest.raises(ConfigError, match="not host:port"):
        connect("redis+sentinel://nohost/svc")
    with pytest.raises(ConfigError, match="unknown option"):
        connect(ha.url + "?replica=1")
    wrong = ha.url.replace(f"/{SERVICE}", "/nosuch").replace("//", "//u:pw@", 1)
    with pytest.raises(StoreUnavailable, match="name no primary for 'nosuch'") as info:
        connect(wrong, attempts=1, timeout_s=1.0)
    assert "pw" not in str(info.value) and "u:***@" in str(info.value)
    client = connect(ha.url + "?replicas=2&wait_ms=500")
    assert getattr(client, REPLICAS_ATTR) == (2, 500)


def test_a_store_on_sentinel_survives_losing_its_primary(tmp_path: Path) -> None:
    with EmbeddedRedisHA(tmp_path / "ha") as cluster:
        store = RedisStore(connect(cluster.url), "ha-run")
        for v in range(3):  # each acknowledged only once a replica has it
            assert store.publish(0, expected_version=v - 1, epoch=1, value=f"v{v}".encode(),
                                 momentum=b"", keep=8) == v
        store.add_event("before", {})
        old = cluster.kill_primary()
        # the client's retries find the new primary; nothing acknowledged was lost
        assert store.publish(0, expected_version=2, epoch=1, value=b"v3", momentum=b"",
                             keep=8) == 3
        assert cluster.primary() is not old
        assert [store.get_version(0, v).value for v in range(4)] == [b"v0", b"v1", b"v2",
                                                                     b"v3"]
        assert [e["kind"] for _, e in store.events()] == ["before"]
        # the killed node comes back as a replica of the new primary
        cluster.restart()
        assert store.publish(0, expected_version=3, epoch=1, value=b"v4", momentum=b"",
                             keep=8) == 4


def test_a_primary_short_of_replicas_is_an_outage() -> None:
    import redis

    from ddiloco.store.core import unavailable

    @unavailable
    def publish() -> None:
        raise redis.ResponseError("Error running script (call to f_a4ad): @user_script:4: "
                                  "-NOREPLICAS Not enough good replicas to write.")

    @unavailable
    def conflict() -> None:
        raise redis.ResponseError("VERSION_CONFLICT head version 3, expected 2")

    with pytest.raises(StoreUnavailable, match="NOREPLICAS"):
        publish()
    with pytest.raises(redis.ResponseError, match="VERSION_CONFLICT"):
        conflict()


class _Pool:
    """What a sentinel-managed connection asks of its pool: the primary's address, in turn."""

    is_master = True
    check_connection = False
    service_name = SERVICE

    def __init__(self, addresses: list[tuple[str, int]]) -> None:
        self.addresses = addresses
        self.asked = 0

    def get_master_address(self) -> tuple[str, int]:
        self.asked += 1
        return self.addresses[min(self.asked, len(self.addresses)) - 1]


def test_a_broken_connection_asks_the_sentinels_on_each_retry(redis_server: EmbeddedRedis) -> None:
    # The primary it had is gone (nothing listens there); the sentinels' next answer is a live
    # one. redis-py's own reconnect (redis-py #3874) would retry the dead address every time.
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        dead = probe.getsockname()
    pool = _Pool([dead, ("127.0.0.1", redis_server.port)])
    conn = AskingConnection(connection_pool=pool, retry=Retry(NoBackoff(), 3),
                            socket_connect_timeout=2.0)
    conn.host, conn.port = dead
    try:
        conn.send_command("PING")  # connects the way a command finding its socket broken does
        assert conn.read_response() == b"PONG"
        assert (conn.host, conn.port) == ("127.0.0.1", redis_server.port)
        assert pool.asked == 2
    finally:
        conn.disconnect()
