"""The end of a run that no supervisor ends: wait for the learners, stop the rest, report.

``ddiloco run`` owns its processes and stops the shards and the evaluator itself once the
learners are done. A deployment of independent containers (compose.yaml) has no such owner:
learners exit when their step budget is spent, while shards and the evaluator would serve
forever. ``ddiloco finish`` plays the owner's part through the store only:

1. wait until every learner of the run has left after its last step (:func:`pending_learners`);
2. ask the shards to stop (they merge what the learners' drains left open, as on SIGTERM) and
   wait for each one's ``shard_stop`` event;
3. ask the evaluator to stop (it evaluates the final model once more) and wait for its
   ``evaluator_stop`` event;
4. ask the region routers to stop, then write ``report.json`` and ``report.png`` (the same
   report block as a local run) and print the summary.

A store outage (``StoreUnavailable``: a Redis restart, a Sentinel failover) while it waits is
"not yet", said once per outage: the run goes on without it, so ``finish`` waits it out too.

The requests are keys in the store (:meth:`ddiloco.store.redis_store.RedisStore.request_stop`), so
every
worker can be anywhere the store is reachable.
"""

from __future__ import annotations

import json
import time
from collections.abc import Callable, Iterable, Sequence
from pathlib import Path
from typing import Any, TypeVar

from ddiloco.pipeline.errors import DDilocoError, StoreUnavailable
from ddiloco.pipeline.waiting import poll_until
from ddiloco.store.base import ParameterStore
from ddiloco.store.core import shutdown_server

__all__ = ["FinishTimeout", "finish_run", "pending_learners", "shutdown_server"]


class FinishTimeout(DDilocoError):
    """A stage of :func:`finish_run` did not complete in time (the message names it)."""


def pending_learners(events: Iterable[dict[str, Any]], expected: Sequence[str], steps: int,
                     live: Iterable[str]) -> list[str]:
    """Learners that have not yet finished the run, sorted.

    A learner is finished when it is not live and its latest ``leave`` event (learner shut
    down cleanly) reports ``step >= steps``. A learner that left early (stopped by hand, or by
    a fault) and was restarted is pending again from its next ``join``.

    Args:
        events: the run's events in time order (``{"kind", "t", ...}``).
        expected: learner ids the run must see finish (those of the manifest); learners that
            joined but are not listed are waited for too.
        steps: the step budget, inner steps.
        live: ids of learners whose heartbeat entry is alive now.
    """
    done: dict[str, bool] = {lid: False for lid in expected}
    for e in events:
        lid = e.get("learner")
        if not isinstance(lid, str):
            continue
        if e.get("kind") == "join":
            done[lid] = False
        elif e.get("kind") == "leave":
            done[lid] = int(e.get("step") or 0) >= steps
    live_set = set(live)
    return sorted(lid for lid, ok in done.items() if not ok or lid in live_set)


_T = TypeVar("_T")


def _wait(what: str, done: Callable[[], bool], timeout_s: float, say: Callable[[str], None],
          progress: Callable[[], str] | None = None, every_s: float = 10.0) -> None:
    """Wait until ``done()``, saying ``progress()`` every ``every_s`` seconds. A ``done()``
    that raises ``StoreUnavailable`` is not done yet (said once per outage).

    Raises:
        FinishTimeout: not done after ``timeout_s`` seconds (with the last progress).
    """
    last = [time.monotonic()]
    outage = [False]

    def check() -> bool:
        try:
            finished = done()
        except StoreUnavailable as exc:
            if not outage[0]:
                say(f"waiting for {what}: the store is unavailable ({exc}); trying again")
            outage[0] = True
            return False
        if outage[0]:
            say(f"waiting for {what}: the store answers again")
            outage[0] = False
        if finished:
            return True
        if progress is not None and time.monotonic() - last[0] > every_s:
            last[0] = time.monotonic()
            say(f"waiting for {what}: {progress()}")
        return False

    if not poll_until(check, timeout_s=timeout_s, interval_s=0.5):
        raise FinishTimeout(f"{what}: not done after {timeout_s:.0f} s"
                            + (f" ({progress()})" if progress else ""))


def _stored(what: str, call: Callable[[], _T], timeout_s: float,
            say: Callable[[str], None]) -> _T:
    """``call()``'s result, calling it again while it raises ``StoreUnavailable``.

    Raises:
        FinishTimeout: the store was unavailable for ``timeout_s`` seconds.
    """
    box: list[_T] = []

    def done() -> bool:
        box.append(call())
        return True

    _wait(what, done, timeout_s, say)
    return box[0]


ROUTER_GRACE_S = 4.0
"""Seconds between asking the routers to stop and shutting the store down: routers look for
the request every second (ddiloco.chaos.wan.router)."""


def finish_run(store: ParameterStore, out: Path, *, learners_timeout_s: float = 3600.0,
               stop_timeout_s: float = 120.0, shutdown_store: bool = False,
               say: Callable[[str], None] = print) -> dict[str, Any]:
    """Wait for the run in ``store`` to finish, stop its shards, evaluator and routers, and
    write ``out/report.json`` and ``out/report.png``; returns the report.

    ``shutdown_store``: then shut Redis down (``SHUTDOWN SAVE``; its data stays on disk), the
    last running service of a compose deployment, so that ``docker compose up`` returns.

    Raises:
        FinishTimeout: the learners, the shards or the evaluator did not finish in time, or
            the store stayed unavailable for ``stop_timeout_s`` seconds.
        ddiloco.pipeline.errors.DDilocoError: the store has no manifest.
    """
    from ddiloco.report import mode_report, plot_report
    from ddiloco.workers.run.manifest import manifest_config, wait_for_manifest

    manifest = wait_for_manifest(store)
    cfg = manifest_config(manifest)
    expected = [f"learner-{i}" for i in range(cfg.run.learners)]
    steps = cfg.train.steps
    state: dict[str, Any] = {"pending": expected}

    def learners_done() -> bool:
        events = [e for _, e in store.events(kinds=["join", "leave"])]
        state["pending"] = pending_learners(events, expected, steps, store.live_learners())
        return not state["pending"]

    say(f"run {store.run_id}: waiting for {len(expected)} learners to finish {steps} steps")
    _wait("the learners", learners_done, learners_timeout_s, say,
          lambda: f"pending {state['pending']}", every_s=30.0)

    t_stop = time.time()
    shards = [f"shard-{s}" for s in range(cfg.run.shards)]
    say(f"learners done; stopping {shards}")
    _stored("the shards' stop request",
            lambda: store.request_stop("shards", "run finished", t=t_stop), stop_timeout_s, say)

    def stopped(kind: str, names: Sequence[str], key: str) -> Callable[[], bool]:
        def check() -> bool:
            seen = {e.get(key) for _, e in store.events(kinds=[kind]) if e["t"] >= t_stop}
            return all(n in seen for n in names)
        return check

    _wait("the shards' final merges", stopped("shard_stop", shards, "shard"), stop_timeout_s,
          say)
    say("shards stopped; final evaluation")
    t_eval = time.time()
    _stored("the evaluator's stop request",
            lambda: store.request_stop("evaluator", "run finished", t=t_eval), stop_timeout_s, say)

    def evaluated() -> bool:
        return any(e["t"] >= t_eval for _, e in store.events(kinds=["evaluator_stop"]))

    _wait("the final evaluation", evaluated, stop_timeout_s, say)
    _stored("the routers' stop request",
            lambda: store.request_stop("routers", "run finished"), stop_timeout_s, say)

    events = _stored("the run's events", lambda: [e for _, e in store.events()], stop_timeout_s,
                     say)
    joins = [e["t"] for e in events if e["kind"] == "join"]
    leaves = [e["t"] for e in events if e["kind"] == "leave"]
    wall = max(leaves) - min(joins) if joins and leaves else 0.0
    report: dict[str, Any] = {
        manifest["mode"]: _stored("the report", lambda: mode_report(store, wall),
                                  stop_timeout_s, say)}
    out.mkdir(parents=True, exist_ok=True)
    (out / "report.json").write_text(json.dumps(report, indent=2))
    plot_report(report, out / "report.png")
    if shutdown_store:
        time.sleep(ROUTER_GRACE_S)
        say("shutting the store down (its data stays in its volume)")
        store.shutdown_server()
    return report
