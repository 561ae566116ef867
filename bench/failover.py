"""How long the store is gone when its Redis dies: a Sentinel failover against a single Redis
restarted from its AOF, side by side in one run.

    python bench/failover.py [--kills 3] [--json PATH]

A writer publishes 20 fragment versions through :class:`ddiloco.store.RedisStore` (64 KB
each, acknowledged only once a replica has it under Sentinel), then the store is killed and
the clock runs until the next publish is acknowledged. Each repetition, in alternating order:

* ``ha``: :class:`ddiloco.store.embedded_ha.EmbeddedRedisHA` (a primary, two replicas, three
  sentinels, ``down-after-milliseconds`` 1000); the current primary is killed with SIGKILL
  for good (the client's retries find the promoted replica);
* ``single``: one :class:`ddiloco.store.EmbeddedRedis` killed with SIGKILL and restarted at
  once on its AOF (what a supervisor does for a deployment without replicas, when the host
  survives: a lost host has nothing to restart).

After each, every version acknowledged before the kill is read back (``lost`` counts those
missing). It prints a table (seconds, median and worst) and one JSON line.
"""

from __future__ import annotations

import argparse
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

VALUE = b"x" * 65_536


def _measure(store: Any, kill: Any) -> tuple[float, int]:
    """Publish 20 versions; kill; seconds from the kill to the next acknowledged publish
    (retried as a shard does: after an unknown outcome the head says where it stands), and
    acknowledged versions missing afterwards."""
    acked: list[int] = []
    version = -1
    for _ in range(20):
        version = store.publish(0, expected_version=version, epoch=1, value=VALUE,
                                momentum=b"", keep=64)
        acked.append(version)
    t0 = time.monotonic()
    kill()
    while True:
        try:
            acked.append(store.publish(0, expected_version=version, epoch=1, value=VALUE,
                                       momentum=b"", keep=64))
            break
        except Exception:  # an outage (the client gave up its retries): try again
            time.sleep(0.02)
    took = time.monotonic() - t0
    lost = sum(1 for v in acked if store.get_version(0, v) is None)
    return took, lost


def main() -> int:
    from ddiloco.store import EmbeddedRedis, RedisStore
    from ddiloco.store.connect import connect
    from ddiloco.store.embedded_ha import EmbeddedRedisHA

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--kills", type=int, default=3, help="repetitions of each")
    ap.add_argument("--json", help="write the result object to this file")
    args = ap.parse_args()
    res: dict[str, list[float]] = {"ha": [], "single": []}
    lost = {"ha": 0, "single": 0}
    with tempfile.TemporaryDirectory(prefix="ddl-failover-") as tmp:
        for rep in range(args.kills):
            for kind in (("ha", "single") if rep % 2 == 0 else ("single", "ha")):
                where = Path(tmp) / f"{kind}-{rep}"
                if kind == "ha":
                    with EmbeddedRedisHA(where) as ha:
                        store = RedisStore(connect(ha.url), "failover")
                        s, n = _measure(store, ha.kill_primary)
                else:
                    with EmbeddedRedis(where) as one:
                        store = RedisStore(connect(one.url), "failover")
                        s, n = _measure(store, lambda one=one: (one.crash(), one.restart()))
                res[kind].append(s)
                lost[kind] += n
                print(f"  {kind:<6} kill {rep + 1}: next publish after {s:.2f} s, "
                      f"{n} acknowledged version(s) lost", file=sys.stderr)
    out: dict[str, Any] = {
        kind: {"median_s": round(statistics.median(v), 3), "max_s": round(max(v), 3),
               "kills": len(v), "lost": lost[kind]} for kind, v in res.items()}
    out["ratio_median"] = round(out["ha"]["median_s"] / out["single"]["median_s"], 2)
    print(f"{'store':<8} {'median s':>9} {'worst s':>8} {'lost':>5}")
    for kind in ("ha", "single"):
        o = out[kind]
        print(f"{kind:<8} {o['median_s']:>9.2f} {o['max_s']:>8.2f} {o['lost']:>5}")
    line = json.dumps(out, sort_keys=True)
    print(line)
    if args.json:
        Path(args.json).write_text(line + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
