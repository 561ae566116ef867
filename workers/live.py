"""A live view of a running local cluster: one rich table of its workers and the store's counters.

Used by ``ddiloco run`` (:mod:`ddiloco.localrun`) and the chaos runner
(:mod:`ddiloco.chaos.runner`).
"""

from __future__ import annotations

import time
from typing import Any

from ddiloco.store.base import ParameterStore
from ddiloco.workers.launch import LocalCluster


def live_table(store: ParameterStore, cluster: LocalCluster, mode: str, t0: float,
               layout_p: int) -> Any:
    """A rich table of the run now: learners' state, step, tokens and loss, shards up or down,
    versions, merges, wire bytes, drops and the latest validation loss (``t0``: monotonic
    start time, seconds).

    Raises:
        StoreUnavailable: the store did not answer.
    """
    from rich.table import Table

    live = store.live_learners()
    heads = store.heads(layout_p)
    wire = store.counters("wire")
    tokens = sum(store.counters("tokens").values())
    evals = store.events(kinds={"eval"})
    drops = store.counters("drops")
    merges = len(store.events(kinds={"merge"}))
    t = Table(title=f"ddiloco {mode}  run {store.run_id}  {time.monotonic() - t0:,.0f} s",
              caption=(f"versions {[h.version if h else None for h in heads]}  merges {merges}"
                       f"  wire up {int(wire.get('up', 0)) / 1e6:.2f} MB"
                       f" down {int(wire.get('down', 0)) / 1e6:.2f} MB"
                       f"  drops {drops or 0}  val loss "
                       + (f"{evals[-1][1]['loss']:.4f}" if evals else "-")
                       + f"  tokens {tokens:,}"))
    for col in ("worker", "state", "step", "tokens", "loss", "incarnation"):
        t.add_column(col)
    for name in cluster.names("learner"):
        info = live.get(name, {})
        state = info.get("state", "down" if not cluster.workers[name].alive else "starting")
        if not cluster.workers[name].alive and name not in live:
            state = "exited"
        t.add_row(name, state, str(info.get("step", "")), f"{info.get('tokens', 0):,}",
                  str(info.get("loss", "")), str(info.get("incarnation", "")))
    for name in cluster.names("shard"):
        t.add_row(name, "up" if cluster.workers[name].alive else "down", "", "", "", "")
    return t
