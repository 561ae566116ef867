"""Training went on across a Redis failover (docker/compose-test.sh ha).

Runs inside a compose container of the profile `ha` (the test pipes it into `python -`) and
prints one JSON line. Two modes:

``probe SECONDS``: writes a key of its own (``ddl-failover-probe:<run>``, outside the run's
keys, deleted at the end) through the workers' sentinel URL every 50 ms, each write
acknowledged once a replica has it (``WAIT 1``), through a client with the workers' retries
(store/connect.py), until 5 s of writes followed a gap of more than 2.5 s, or for SECONDS at
most. Prints ``probing`` once connected, then the longest gap between two acknowledged writes
(``gap_from``, ``gap_to``: epoch seconds) and how many there were: the time the store could not
take a replicated write. Errors go to stderr with their time and how long the command took.

``merges KILL_TIME``: reads the run's merge events (KILL_TIME: when the primary was killed, the
host's clock, which the containers share):

- ``kill_to_next_merge_s``: from the kill to the first merge recorded after it. A shard records
  a merge once the store acknowledged its publish (with WAIT: a replica has it);
- ``merge_gap_s``: that merge's time less the last merge's before the kill, against
  ``median_gap_before_s``, the run's usual gap between two merges before the kill;
- ``merges_after_kill`` and the fragments' head versions now;
- no fragment version was merged twice and every fragment's versions run on without a gap: a
  version acknowledged before the kill and lost with the primary would be published again.

Usage: python - probe SECONDS < docker/check-failover.py
       python - merges KILL_TIME < docker/check-failover.py   (DDILOCO_REDIS_URL, DDILOCO_RUN_ID)
"""

from __future__ import annotations

import itertools
import json
import os
import statistics
import sys
import time
from collections import Counter

import redis

from ddiloco.pipeline.errors import DDilocoError
from ddiloco.store.connect import connect
from ddiloco.store.redis_store import RedisStore
from ddiloco.workers.run.manifest import manifest_layout


def _url() -> str:
    url = os.environ["DDILOCO_REDIS_URL"]
    assert url.startswith("redis+sentinel://"), f"not the profile ha: {url}"
    return url


def _trace() -> None:
    """Log (stderr) each primary the sentinels name and each failed connect, with its time."""
    from redis import connection, sentinel

    discover, connect_ = sentinel.Sentinel.discover_master, connection.Connection._connect
    seen: list[object] = [None]

    def traced_discover(self: sentinel.Sentinel, name: str) -> object:
        try:
            addr = discover(self, name)
        except redis.RedisError as exc:
            print(f"{time.time():.2f} sentinels: {type(exc).__name__}", file=sys.stderr,
                  flush=True)
            raise
        if addr != seen[0]:
            seen[0] = addr
            print(f"{time.time():.2f} sentinels name {addr}", file=sys.stderr, flush=True)
        return addr

    def traced_connect(self: connection.Connection) -> object:
        t0 = time.time()
        try:
            return connect_(self)
        except OSError as exc:
            print(f"{t0:.2f} +{time.time() - t0:.2f} s: connect {self.host}:{self.port}: "
                  f"{exc}", file=sys.stderr, flush=True)
            raise

    sentinel.Sentinel.discover_master = traced_discover  # type: ignore[method-assign]
    connection.Connection._connect = traced_connect  # type: ignore[method-assign]


def probe(seconds: float) -> int:
    _trace()
    client = connect(_url())
    key = f"ddl-failover-probe:{os.environ['DDILOCO_RUN_ID']}"
    print("probing", flush=True)
    acks: list[float] = []
    errors: Counter[str] = Counter()
    end = time.time() + seconds
    while time.time() < end:
        t0 = time.time()
        try:
            client.set(key, repr(t0))
            if int(client.wait(1, 2000)) >= 1:
                acks.append(time.time())
            else:
                errors["WAIT: no replica"] += 1
        except (redis.RedisError, OSError, DDilocoError) as exc:
            errors[type(exc).__name__] += 1
            # the timeline, for a person reading the test's output
            pool = client.connection_pool
            master = getattr(getattr(pool, "proxy", pool), "master_address", None)
            print(f"{t0:.2f} +{time.time() - t0:.2f} s: {type(exc).__name__}: {exc} "
                  f"(primary as last named: {master})", file=sys.stderr, flush=True)
        if len(acks) >= 2:
            gap_end = max(itertools.pairwise(acks), key=lambda g: g[1] - g[0])
            if gap_end[1] - gap_end[0] > 2.5 and acks[-1] - gap_end[1] > 5.0:
                break  # recovered from the failover
        time.sleep(0.05)
    try:
        client.delete(key)
    except (redis.RedisError, OSError):
        pass
    assert len(acks) >= 2, f"{len(acks)} acknowledged writes in {seconds} s: {dict(errors)}"
    gap_from, gap_to = max(itertools.pairwise(acks), key=lambda g: g[1] - g[0])
    print(json.dumps({"acks": len(acks), "longest_gap_s": round(gap_to - gap_from, 2),
                      "gap_from": gap_from, "gap_to": gap_to, "errors": dict(errors)}))
    return 0


def merges(kill_time: float) -> int:
    store = RedisStore(connect(_url()), os.environ["DDILOCO_RUN_ID"])
    manifest = store.get_manifest()
    assert manifest is not None, "no manifest"
    n = manifest_layout(manifest).n_fragments
    events = [e for _, e in store.events(kinds=["merge"])]
    before = sorted(e["t"] for e in events if e["t"] <= kill_time)
    after = sorted(e["t"] for e in events if e["t"] > kill_time)
    assert before, "no merge before the kill"
    assert after, "no merge after the kill"
    pairs = Counter((int(e["fragment"]), int(e["version"])) for e in events)
    twice = sorted(k for k, c in pairs.items() if c > 1)
    assert not twice, f"(fragment, version) merged more than once: {twice[:10]}"
    gaps = {}
    for p in range(n):
        versions = sorted(v for q, v in pairs if q == p)
        missing = sorted(set(range(versions[0], versions[-1] + 1)) - set(versions)) \
            if versions else []
        if missing:
            gaps[p] = missing[:10]
    assert not gaps, f"fragment versions missing from the merges: {gaps}"
    usual = [b - a for a, b in itertools.pairwise(before)]
    heads = store.heads(n)
    print(json.dumps({
        "kill_to_next_merge_s": round(after[0] - kill_time, 2),
        "merge_gap_s": round(after[0] - before[-1], 2),
        "median_gap_before_s": round(statistics.median(usual), 2) if usual else None,
        "merges_before_kill": len(before),
        "merges_after_kill": len(after),
        "versions": [h.version if h else None for h in heads],
    }))
    return 0


if __name__ == "__main__":
    mode, arg = sys.argv[1], float(sys.argv[2])
    sys.exit(probe(arg) if mode == "probe" else merges(arg))
