"""compose.yaml's `redis-ha-stop` (profile `ha`): end the sentinels and the Redis nodes once
the run is over, so that `docker compose up` returns as it does without the profile.

`finish --shutdown-store` shuts the primary down, the end of a run without the profile. To the
sentinels that is a failed primary: they would promote a replica and the store would go on.
So this waits until the run has asked its routers to stop (finish's last request, made a few
seconds before that shutdown), then tells every sentinel to wait an hour before it calls the
primary down (`SENTINEL SET ... down-after-milliseconds`: they still name it, so finish's
client still finds it, but none starts a failover), then waits until the primary stops
answering (finish's shutdown; at most --grace seconds, 300), then shuts the sentinels down and
then every node that still answers. Each exits 0, and `blobs`, which stops once the store is
gone, with them. (Waiting for the shutdown first raced the sentinels: a probe of the dead
primary's address can take longer than their 2 s down-after, and then they had promoted a
replica that answered.)

    python redis-ha-stop.py --sentinels sentinel-1:26379,... --nodes redis:6379,...

Environment: DDILOCO_REDIS_URL (the sentinel URL of the workers) and DDILOCO_RUN_ID. It keeps
its start time in --state, so a restart of the container still obeys a request made before it.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import redis
from redis.backoff import NoBackoff
from redis.retry import Retry

from ddiloco.pipeline.errors import DDilocoError
from ddiloco.store.connect import connect
from ddiloco.store.redis_store import RedisStore

SERVICE = "ddiloco"


def say(msg: str) -> None:
    print(f"[redis-ha-stop {time.strftime('%H:%M:%S')}] {msg}", flush=True)


def hosts(arg: str) -> list[tuple[str, int]]:
    out = []
    for item in arg.split(","):
        host, _, port = item.rpartition(":")
        out.append((host, int(port)))
    return out


def client(host: str, port: int) -> redis.Redis:
    """One try per command (redis-py would retry a SHUTDOWN's closed connection for seconds)."""
    return redis.Redis(host=host, port=port, socket_timeout=5.0, socket_connect_timeout=5.0,
                       retry=Retry(NoBackoff(), 0), decode_responses=True)


def primary(sentinels: list[tuple[str, int]]) -> tuple[str, int] | None:
    """The primary the first sentinel that answers names."""
    for host, port in sentinels:
        c = client(host, port)
        try:
            addr = c.sentinel_get_master_addr_by_name(SERVICE)
            if addr:
                return str(addr[0]), int(addr[1])
        except (redis.RedisError, OSError):
            continue
        finally:
            c.close()
    return None


def answers(host: str, port: int) -> bool:
    c = client(host, port)
    try:
        return bool(c.ping())
    except (redis.RedisError, OSError):
        return False
    finally:
        c.close()


def shutdown(host: str, port: int) -> str:
    c = client(host, port)
    try:
        c.execute_command("SHUTDOWN")
        return "shut down"
    except redis.ConnectionError:  # the connection closing is the success reply
        return "shut down"
    except (redis.RedisError, OSError) as exc:
        return f"not shut down ({exc})"
    finally:
        c.close()


#: down-after-milliseconds while the run ends: longer than finish takes to shut the primary down
HOLD_MS = 3_600_000


def hold_failover(host: str, port: int) -> str:
    """Tell one sentinel not to call the primary down for an hour (no failover at the end)."""
    c = client(host, port)
    try:
        c.execute_command("SENTINEL", "SET", SERVICE, "down-after-milliseconds", str(HOLD_MS))
        return "holds its failover"
    except (redis.RedisError, OSError) as exc:
        return f"did not answer ({exc})"
    finally:
        c.close()


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--sentinels", required=True, help="host:port,... of every sentinel")
    ap.add_argument("--nodes", required=True, help="host:port,... of every Redis node")
    ap.add_argument("--grace", type=float, default=300.0,
                    help="seconds to wait for finish to shut the primary down (it writes the "
                    "report first: a minute on a busy host)")
    ap.add_argument("--state", default="/tmp/redis-ha-stop.since", help="keeps the start time")
    args = ap.parse_args()
    sentinels, nodes = hosts(args.sentinels), hosts(args.nodes)
    url, run_id = os.environ["DDILOCO_REDIS_URL"], os.environ["DDILOCO_RUN_ID"]
    state = Path(args.state)
    if not state.exists():
        state.write_text(repr(time.time()))
    since = float(state.read_text())

    say(f"waiting for the end of run {run_id}")
    store: RedisStore | None = None
    while True:
        try:
            if store is None:
                store = RedisStore(connect(url, attempts=2, timeout_s=3.0), run_id)
            if store.stop_requested("routers", since=since):
                break
        except (DDilocoError, redis.RedisError, OSError):
            store = None  # an outage or a failover: connect again
        time.sleep(1.0)
    say("the run asked its routers to stop")
    for host, port in sentinels:
        say(f"sentinel {host}:{port}: {hold_failover(host, port)}")
    say("waiting for finish to shut the primary down")
    deadline = time.monotonic() + args.grace
    misses = 0
    while time.monotonic() < deadline:
        addr = primary(sentinels)
        misses = misses + 1 if addr is None or not answers(*addr) else 0
        if misses >= 2:  # twice in a row: not a slow reply on a busy host
            say(f"the primary {addr[0] if addr else '?'} is down")
            break
        time.sleep(0.5)
    else:
        say(f"the primary still answers after {args.grace:.0f} s; shutting it down")
    for host, port in sentinels:
        say(f"sentinel {host}:{port}: {shutdown(host, port)}")
    for host, port in nodes:
        if answers(host, port):
            say(f"node {host}:{port}: {shutdown(host, port)}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
