"""The syncer shard process: lease, sockets, the poll loop and liveness around a shard core.

:class:`ddiloco.workers.syncer.core.ShardCore` (or a variant) holds the logic and no sockets;
:func:`serve`
is the thin process around it (DESIGN §2, §3): it waits for the run manifest and the shard's
lease, loads the owned fragments, binds the PULL and PUB sockets, announces them in the store,
then feeds every received message to the core and publishes what it returns. A ticker renews
the lease; a lost lease or a fenced-out publish stops the process (exit code 3), so a newer
owner never competes with it. The core's class is the caller's choice
(:mod:`ddiloco.workers.roles`).
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
import uuid
from collections.abc import Callable
from typing import Any

from ddiloco.pipeline.errors import ConfigError, FencedOut, StoreUnavailable, VersionConflict
from ddiloco.pipeline.security import Authenticator, is_loopback, load_keys
from ddiloco.pipeline.transport import ShardSockets, max_message_bytes
from ddiloco.pipeline.waiting import poll_until
from ddiloco.store.base import ParameterStore
from ddiloco.store.objects import ObjectStoreUnavailable
from ddiloco.workers.run.config import Config
from ddiloco.workers.run.liveness import StoreOutage, Ticker
from ddiloco.workers.run.manifest import manifest_config, stored_initial, wait_for_manifest
from ddiloco.workers.run.runtime import setup_logging
from ddiloco.workers.syncer.core import ShardCore
from ddiloco.workers.syncer.fused import warm_up

__all__ = ["STOP_DRAIN_S", "STOP_QUIET_MS", "CoreFactory", "acquire_lease", "serve"]

#: At a clean stop, seconds a shard spends filing the deltas still queued at its socket.
STOP_DRAIN_S = 10.0
#: ... until nothing arrived for this long, milliseconds (frames still in the I/O thread)
STOP_QUIET_MS = 100
#: Pause between two tries for a lease held by another owner, seconds.
LEASE_RETRY_S = 0.2

CoreFactory = Callable[[dict[str, Any], int, ParameterStore, int], ShardCore]
"""``(manifest, shard, store, epoch) -> core``: the shard core of a run's mode."""


def acquire_lease(store: ParameterStore, shard: int, owner: str, ttl_ms: int,
                  stop: Callable[[], bool], log: logging.Logger) -> int | None:
    """Wait until this process holds shard ``shard``'s lease; returns its epoch, or None when
    ``stop()`` turned true first. Tries every :data:`LEASE_RETRY_S` seconds, without deadline.

    A previous owner killed with SIGKILL holds the lease until its TTL runs out.
    """
    got: list[int] = []  # the epoch, once held (an epoch may be 0: not a truth value)
    logged = False

    def held_or_stopped() -> bool:
        nonlocal logged
        if stop():
            return True
        epoch = store.acquire_lease(shard, owner, ttl_ms)
        if epoch is not None:
            got.append(int(epoch))
            return True
        if not logged:
            log.info("lease of shard %d is held; waiting for it to expire", shard)
            logged = True
        return False

    poll_until(held_or_stopped, timeout_s=None, interval_s=LEASE_RETRY_S)
    return got[0] if got else None


def serve(store: ParameterStore, shard: int, *, make_core: CoreFactory,
          bind_host: str = "127.0.0.1", advertise_host: str | None = None, pull_port: int = 0,
          pub_port: int = 0, metrics_port: int | None = None) -> int:
    """Run one syncer shard until SIGTERM/SIGINT, a stop request in the store, or a lost
    lease. Returns the process exit code (0 on a clean stop, 3 when another writer took over).

    Args:
        store: the run's parameter store.
        shard: this shard's id.
        make_core: builds the shard core of the run's mode
        (:func:`ddiloco.workers.roles.make_shard_core`).
        bind_host: address the PULL and PUB sockets bind to; only loopback may be plain TCP.
        advertise_host: address learners connect to (default: ``bind_host``).
        pull_port: PULL port (0: any free port); ``pub_port`` likewise.
        metrics_port: serve Prometheus metrics there (:mod:`ddiloco.workers.run.metrics`); None:
        off.

    Raises:
        ConfigError: ``security.curve`` without ``security.keys_dir``, or plain TCP on a
            non-loopback bind.
        StoreUnavailable: no manifest (see :func:`ddiloco.workers.run.manifest.wait_for_manifest`).
    """
    import zmq

    log = setup_logging(f"shard-{shard}")
    stopping = {"flag": False}

    def _stop(signum: int, _frame: Any) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    manifest = wait_for_manifest(store)
    cfg = manifest_config(manifest)
    owner = f"shard-{shard}-{uuid.uuid4().hex[:8]}"
    lease_ms = int(cfg.run.lease_ttl_s * 1000)
    # before the lease and the sockets: compiling holds the GIL (fused.warm_up)
    log.info("merge kernels ready in %.1f s", warm_up(
        [cfg.sync.codec_up, cfg.sync.codec_dp, cfg.sync.codec_down]))
    epoch = acquire_lease(store, shard, owner, lease_ms, lambda: stopping["flag"], log)
    if epoch is None:
        return 0
    core = make_core(manifest, shard, store, epoch)
    core.load(lambda: stored_initial(store, core.layout, core.owned))
    if metrics_port is not None:
        from ddiloco.workers.run.metrics import ShardCollector, serve_metrics

        serve_metrics(ShardCollector(core), metrics_port)
    layout = core.layout
    ctx = zmq.Context()
    biggest = max(layout.n_values(p) for p in range(layout.n_fragments))
    keys, auth = None, None
    if cfg.security.curve:
        keys_dir = cfg.security.keys_dir
        if keys_dir is None:
            raise ConfigError("security.curve needs security.keys_dir (docs/SECURITY.md)")
        keys = load_keys(keys_dir, core.name)
        auth = Authenticator(ctx, keys_dir, roles=("learner-",),
                             on_refused=lambda who: store.incr_counter(
                                 "auth", "refused" if who is None else f"refused:{who}"))
        auth.start()
    elif not is_loopback(bind_host):
        raise ConfigError(f"plain TCP (security.curve = false) on {bind_host!r}: only "
                          "loopback binds may be insecure")
    # a delta's frame is bounded by the codec the manifest fixes for it, not by float32
    socks = ShardSockets(ctx, max_message_bytes(biggest, core.allowed_codecs),
                         host=bind_host, pull_port=pull_port, pub_port=pub_port,
                         advertise_host=advertise_host, curve=keys)
    endpoints = {"pull": socks.pull_endpoint, "pub": socks.pub_endpoint, "owner": owner}
    store.announce_shard(shard, endpoints, lease_ms)
    store.add_event("shard_start", {"shard": core.name, "epoch": epoch,
                                    "versions": {str(p): s.version for p, s in core.frags.items()},
                                    "endpoints": endpoints})
    log.info("shard %d epoch %d owns fragments %s at versions %s; pull %s pub %s", shard, epoch,
             core.owned, {p: s.version for p, s in core.frags.items()}, socks.pull_endpoint,
             socks.pub_endpoint)
    lost = threading.Event()

    def keep_lease() -> None:
        if lost.is_set():
            return
        if not store.renew_lease(shard, owner, lease_ms):
            # The lease expired (e.g. Redis was down for longer than its TTL). Take it again
            # if it is free: publishes compare-and-set on the version, so a shard whose state
            # went stale meanwhile is still refused and restarts from the store.
            new_epoch = store.acquire_lease(shard, owner, lease_ms)
            if new_epoch is None:
                lost.set()
                return
            core.epoch = int(new_epoch)
            log.warning("lease of shard %d re-acquired with epoch %d", shard, core.epoch)
            store.add_event("lease_reacquired", {"shard": core.name, "epoch": core.epoch})
        store.announce_shard(shard, endpoints, lease_ms)

    ticker = Ticker(cfg.run.lease_ttl_s / 4, keep_lease, f"shard-{shard}-lease").start()
    clock_state = {"house": 0.0, "pub": time.monotonic(), "started": time.time()}
    outage = StoreOutage()
    try:
        while not stopping["flag"]:
            try:
                code = _serve_once(core, socks, store, cfg, lost, clock_state, log)
            except StoreUnavailable as exc:
                # Keep every accepted contribution; merges resume when the store is back.
                # Versions committed before the failure are broadcast all the same.
                for out in core.take_unsent():
                    socks.publish(out)
                blobs = isinstance(exc, ObjectStoreUnavailable)
                wait_s, report = outage.failed(time.monotonic(), blobs)
                log.warning("store unavailable (next try in %.1f s): %s", wait_s, exc)
                if report:
                    _event(store, "blobs_unavailable", {"shard": core.name,
                                                        "error": str(exc)[:300]}, log)
                _sleep_serving(wait_s, stopping)
                continue
            ended = outage.succeeded(time.monotonic())
            if ended is not None:
                log.info("object store back after %.1f s", ended["outage_s"])
                _event(store, "blobs_restored", {"shard": core.name, **ended}, log)
            if code is not None:
                return code
    finally:
        ticker.stop()
        try:
            if core.mode == "diloco" and not lost.is_set():
                # A clean stop: file what the learners' drains left queued, then merge it.
                deadline = time.monotonic() + STOP_DRAIN_S
                while time.monotonic() < deadline:
                    frames = socks.recv(STOP_QUIET_MS)
                    if frames is None:
                        break
                    for out in core.handle(frames, socks.last_peer):
                        socks.publish(out)
                for out in core.flush():
                    socks.publish(out)
            elif not lost.is_set():
                core.tick()  # a DP shard: a checkpoint whose outcome is unknown is settled
            core.drop_pending("shard_stop")
            core.records.event("shard_stop", {"shard": core.name, "merges": core.merges})
            if core.records.flush():
                log.warning("store unavailable at stop: %d records not written",
                            len(core.records))
            store.release_lease(shard, owner)
        except StoreUnavailable as exc:
            for out in core.take_unsent():
                socks.publish(out)
            log.warning("store unavailable at stop: %s", exc)
        socks.close()
        if auth is not None:
            auth.stop()
        ctx.term()
    log.info("shard %d stopped after %d merges", shard, core.merges)
    return 0


def _event(store: ParameterStore, kind: str, fields: dict[str, Any],
           log: logging.Logger) -> None:
    try:
        store.add_event(kind, fields)
    except StoreUnavailable as exc:  # Redis down too: the log keeps it
        log.warning("event %s not recorded: %s", kind, exc)


def _sleep_serving(wait_s: float, stopping: dict[str, bool]) -> None:
    """Wait ``wait_s`` seconds without sleeping through a stop signal."""
    deadline = time.monotonic() + wait_s
    while not stopping["flag"] and time.monotonic() < deadline:
        time.sleep(min(0.1, max(0.0, deadline - time.monotonic())))


def _serve_once(core: ShardCore, socks: ShardSockets, store: ParameterStore, cfg: Config,
                lost: threading.Event, clock: dict[str, float],
                log: logging.Logger) -> int | None:
    """One iteration of the shard loop; returns an exit code to stop, else None.

    Raises:
        StoreUnavailable: the store did not answer (the caller waits and goes on).
    """
    frames = socks.recv(5)
    outgoing: list[list[bytes]] = []
    if frames is not None:
        outgoing += core.handle(frames, socks.last_peer)
        # Drain what is queued before deciding rounds: arrivals within one poll count.
        for _ in range(64):
            more = socks.recv(0)
            if more is None:
                break
            outgoing += core.handle(more, socks.last_peer)
    now = time.monotonic()
    if lost.is_set():
        log.error("lost the lease of shard %d: stopping", core.shard)
        return 3
    if now - clock["house"] > cfg.run.heartbeat_s:
        clock["house"] = now
        core.set_live(set(store.live_learners()))
        if store.stop_requested("shards", since=clock["started"]):
            # The run is over (``ddiloco finish``): the same clean stop as on SIGTERM.
            log.info("stop requested through the store")
            return 0
    core.records.flush()  # what an outage queued, in order (a no-op when nothing is)
    if core.held:
        outgoing += core.retry_held()
    # Every mode ticks: a DiLoCo shard merges the rounds that are ready, and both settle the
    # publishes whose outcome an outage left unknown as soon as the store answers (a DP job
    # that stands still, a learner down, sends nothing that would settle them otherwise).
    try:
        outgoing += core.tick()
    except (FencedOut, VersionConflict) as exc:
        log.error("another writer holds a fragment: %s", exc)
        return 3
    except StoreUnavailable:
        core.unsent[:0] = outgoing  # controls and resyncs go out with the kept versions
        raise
    if core.mode == "diloco" and core.merges and not clock.get("frozen"):
        # The first merge loads JAX and optax (the lr schedule): a million long-lived
        # objects that every full collection would walk again, during merges.
        clock["frozen"] = 1.0
        gc.collect()
        gc.freeze()
    for out in outgoing:
        socks.publish(out)
        clock["pub"] = now
    if now - clock["pub"] > cfg.run.heartbeat_s:
        socks.publish(core.heartbeat())
        clock["pub"] = now
    return None
