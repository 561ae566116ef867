"""Redis ACL users per worker role (docs/SECURITY.md): what each role may read and write.

Key layout (:class:`ddiloco.store.keys.Keys`): run-wide keys ``ddl:{<run>}:<name>``, fragment
keys ``ddl:{<run>:<p>}:<name>``. Redis 7 key selectors (``%R~`` read, ``%W~`` write, ``~``
both) give each role exactly what it needs:

=========== ================================================ ==============================
role        reads                                            writes
=========== ================================================ ==============================
learner     fragments, manifest, shard endpoints, registry   its own heartbeat, incarnation
                                                             and fate keys; the registry
                                                             set, events, counters, fates
syncer s    everything of the run                            its own fragments, its lease
                                                             and endpoint, the epoch, the
                                                             manifest, events, counters
evaluator   everything of the run                            events, counters
=========== ================================================ ==============================

So no learner and no evaluator can change a version, and a shard only the fragments it owns
(``p mod S == s``). Shared structures (the registry set, the event stream, the counters) stay
writable by every worker of the run: a keyed worker can disturb liveness or accounting there,
not the model. Commands: everything but the ``@dangerous`` and ``@admin`` categories (no
FLUSHALL, CONFIG, KEYS, DEBUG...), plus SCRIPT LOAD (the store's Lua scripts).
"""

from __future__ import annotations

import os
import secrets
from dataclasses import dataclass
from pathlib import Path
from urllib.parse import quote, urlsplit, urlunsplit

import redis

from ddiloco.pipeline.errors import ConfigError
from ddiloco.store.keys import KEY_PREFIX, SHARD, Keys

ROLES = ("learner", "syncer", "evaluator")
#: The Redis version whose ACLs have read/write key selectors.
MIN_VERSION = (7, 0)


@dataclass(frozen=True)
class RedisUser:
    """One worker's Redis user: its name, password and the URL it connects with."""

    worker: str
    username: str
    password: str
    url: str


def username(run_id: str, worker: str) -> str:
    """The Redis user of ``worker`` in run ``run_id`` (runs may share a Redis)."""
    return f"ddl-{run_id}-{worker}"


def role_of(worker: str) -> str:
    """``learner-3`` -> learner, ``shard-1`` -> syncer, ``evaluator`` -> evaluator.

    Raises:
        ConfigError: any other name.
    """
    if worker.startswith("learner-"):
        return "learner"
    if worker.startswith("shard-") and worker[len("shard-"):].isdigit():
        return "syncer"
    if worker == "evaluator":
        return "evaluator"
    raise ConfigError(f"worker {worker!r}: expected learner-<i>, shard-<s> or evaluator")


def acl_rules(run_id: str, worker: str, n_fragments: int, shards: int) -> list[str]:
    """ACL SETUSER rules (besides ``on`` and the password) of ``worker`` in run ``run_id``.

    Args:
        run_id: the run.
        worker: ``learner-<i>``, ``shard-<s>`` or ``evaluator``.
        n_fragments: P.
        shards: S (shard s owns fragments p with p mod S == s).

    Raises:
        ConfigError: an unknown worker name, or a shard id not below ``shards``.
    """
    keys = Keys(run_id)
    run = keys.run_prefix
    frags = f"{KEY_PREFIX}:{{{run_id}:*}}:*"
    rules = ["reset", "resetchannels", "+@all", "-@dangerous", "-@admin", "+script|load",
             "+info"]
    shared = [keys.events, keys.counters("*"), keys.learners, keys.fates]
    role = role_of(worker)
    if role == "learner":
        rules += [f"%R~{frags}", f"%R~{keys.manifest}", f"%R~{keys.blob_location}",
                  f"%R~{run}{SHARD}:*",
                  f"%R~{keys.shards}", f"%R~{keys.epoch}"]
        rules += [f"~{k}" for k in (*shared, keys.learner(worker), keys.incarnation(worker),
                                    keys.fate(worker, 0)[:-1] + "*")]
    elif role == "syncer":
        s = int(worker[len("shard-"):])
        if s >= shards:
            raise ConfigError(f"{worker}: the run has {shards} shards")
        rules += [f"%R~{run}*", f"%R~{frags}"]
        rules += [f"~{keys.fragment_prefix(p)}*" for p in range(n_fragments) if p % shards == s]
        rules += [f"~{k}" for k in (*shared, keys.lease(s), keys.shard(s), keys.shards,
                                    keys.epoch, keys.manifest, keys.blob_location)]
    else:
        rules += [f"%R~{run}*", f"%R~{frags}"]
        rules += [f"~{k}" for k in shared]
    return rules


def server_version(client: redis.Redis) -> tuple[int, int]:
    """(major, minor) of the server."""
    ver = str(client.info("server")["redis_version"]).split(".")
    return int(ver[0]), int(ver[1])


def create_users(admin: redis.Redis, admin_url: str, run_id: str, workers: list[str],
                 n_fragments: int, shards: int, out_dir: Path | None = None,
                 ) -> dict[str, RedisUser]:
    """Create (or reset) one Redis user per worker with a fresh random password.

    Args:
        admin: a client allowed to run ACL SETUSER (and ACL SAVE when the server has an ACL
            file).
        admin_url: the URL ``admin`` connected with; each worker's URL is it with the
            worker's user and password.
        run_id, n_fragments, shards: the run (manifest) they work for.
        workers: e.g. ``["learner-0", "shard-0", "evaluator"]``.
        out_dir: when given, each worker's URL is written to ``out_dir/<worker>.redis-url``
            (mode 0600) for that worker only.

    Raises:
        ConfigError: the server is older than Redis 7.0 (no read/write key selectors), or a
            bad worker name.
    """
    if server_version(admin) < MIN_VERSION:
        raise ConfigError(f"Redis {'.'.join(map(str, server_version(admin)))} has no read/"
                          f"write key selectors: per-role users need Redis >= 7.0")
    users: dict[str, RedisUser] = {}
    for worker in workers:
        rules = acl_rules(run_id, worker, n_fragments, shards)
        name = username(run_id, worker)
        password = secrets.token_urlsafe(24)
        admin.execute_command("ACL", "SETUSER", name, *rules, "on", f">{password}")
        users[worker] = RedisUser(worker, name, password, _with_user(admin_url, name, password))
    try:
        admin.execute_command("ACL", "SAVE")
    except redis.ResponseError:
        pass  # no ACL file configured: users live until the server restarts
    if out_dir is not None:
        out_dir.mkdir(parents=True, exist_ok=True)
        os.chmod(out_dir, 0o700)
        for u in users.values():
            path = out_dir / f"{u.worker}.redis-url"
            fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as f:
                f.write(u.url + "\n")
    return users


def _with_user(url: str, user: str, password: str) -> str:
    parts = urlsplit(url)
    host = parts.hostname or "127.0.0.1"
    if ":" in host:
        host = f"[{host}]"
    port = f":{parts.port}" if parts.port is not None else ""
    netloc = f"{quote(user, safe='')}:{quote(password, safe='')}@{host}{port}"
    return urlunsplit(parts._replace(netloc=netloc))
