"""Redis high availability (docs/RELIABILITY.md): Sentinel URLs, a publish acknowledged only
once a replica has it, and a store that goes on after its primary is killed for good: real
redis-server processes (a primary, two replicas, three sentinels)."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from ddiloco.pipeline.errors import ConfigError, StoreUnavailable
from ddiloco.store import RedisStore, connect, redact_url
from ddiloco.store.connect import REPLICAS_ATTR
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
