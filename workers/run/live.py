"""Following a running local cluster: a live rich table of its workers and the store's
counters (``--live``), or one progress line every N seconds (``--no-live``).

Used by ``ddiloco run`` (:mod:`ddiloco.localrun`) and the chaos runner
(:mod:`ddiloco.chaos.runner`).
"""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from ddiloco.store.base import ParameterStore
from ddiloco.workers.run.launch import LocalCluster


def live_table(store: ParameterStore, cluster: LocalCluster, mode: str, t0: float,
               layout_p: int, loss_unit: str = "", meter: ProgressMeter | None = None) -> Any:
    """A rich table of the run now: learners' state, step, tokens and loss, shards up or down,
    versions, merges, wire bytes, drops and the latest validation loss (``t0``: monotonic
    start time, seconds; ``loss_unit``: the task's, ``manifest_loss_unit``).

    ``meter``: the run's :class:`ProgressMeter`, which reads only the events since its last
    call; without it the merges and the loss come from the whole event stream, a read that
    grows with the run (the view is redrawn every second on the learners' cores).

    Raises:
        StoreUnavailable: the store did not answer.
    """
    from rich.table import Table

    live = store.live_learners()
    heads = store.heads(layout_p)
    wire = store.counters("wire")
    drops = store.counters("drops")
    if meter is not None:
        snap = meter.snapshot()
        tokens, merges, loss = snap.tokens, snap.merges, snap.val_loss
    else:
        tokens = sum(store.counters("tokens").values())
        evals = store.events(kinds={"eval"})
        merges = len(store.events(kinds={"merge"}))
        loss = float(evals[-1][1]["loss"]) if evals else None
    t = Table(title=f"ddiloco {mode}  run {store.run_id}  {time.monotonic() - t0:,.0f} s",
              caption=(f"versions {[h.version if h else None for h in heads]}  merges {merges}"
                       f"  wire up {int(wire.get('up', 0)) / 1e6:.2f} MB"
                       f" down {int(wire.get('down', 0)) / 1e6:.2f} MB"
                       f"  drops {drops or 0}  val loss "
                       + (f"{loss:.4f} {loss_unit}".rstrip() if loss is not None else "-")
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


@dataclass(frozen=True)
class Progress:
    """One snapshot of a run, for a progress line (:func:`format_progress`)."""

    #: the mode, e.g. ``diloco``, ``dp`` or ``diloco chaos``
    mode: str
    #: seconds since the run's workers started
    elapsed_s: float
    #: tokens trained so far, every learner together
    tokens: int
    #: the run's token budget (learners x train.steps x tokens per step); None: no budget
    #: (a chaos run lasts its script's duration)
    budget: int | None
    #: recent training rate, tokens per second (None before there is one)
    tokens_per_s: float | None
    #: the latest validation loss of the global model, in ``loss_unit`` (None: none yet)
    val_loss: float | None
    loss_unit: str
    #: merges published so far
    merges: int
    #: messages dropped so far, every reason together
    drops: int
    #: estimated seconds to the end (None: unknown)
    eta_s: float | None


def format_duration(seconds: float) -> str:
    """``75`` -> ``1:15``, ``3725`` -> ``1:02:05`` (seconds, rounded down)."""
    s = max(0, int(seconds))
    h, rest = divmod(s, 3600)
    m, s = divmod(rest, 60)
    return f"{h}:{m:02d}:{s:02d}" if h else f"{m}:{s:02d}"


def estimate_eta(tokens: int, budget: int | None, tokens_per_s: float | None,
                 elapsed_s: float, deadline_s: float | None = None) -> float | None:
    """Seconds left: to ``deadline_s`` (seconds since start) when the run has one, else the
    tokens left of ``budget`` at ``tokens_per_s`` (0 once the budget is spent); None when
    neither is known (no budget, or no rate yet)."""
    if deadline_s is not None:
        return max(0.0, deadline_s - elapsed_s)
    if budget is not None and tokens >= budget:
        return 0.0
    if budget is None or not tokens_per_s or tokens_per_s <= 0:
        return None
    return max(0, budget - tokens) / tokens_per_s


def format_progress(p: Progress) -> str:
    """One plain-text progress line, e.g. ``diloco 2:05  tokens 1,228,800 / 4,915,200 (25%)
    9,830 tokens/s  val loss 2.3457 nats/byte  merges 48  drops 0  ETA 6:15``."""
    done = f"tokens {p.tokens:,}"
    if p.budget:
        done += f" / {p.budget:,} ({min(100.0, 100.0 * p.tokens / p.budget):.0f}%)"
    rate = "- tokens/s" if p.tokens_per_s is None else f"{p.tokens_per_s:,.0f} tokens/s"
    loss = "-" if p.val_loss is None else f"{p.val_loss:.4f} {p.loss_unit}"
    eta = "-" if p.eta_s is None else format_duration(p.eta_s)
    return (f"{p.mode} {format_duration(p.elapsed_s)}  {done}  {rate}  val loss {loss}  "
            f"merges {p.merges:,}  drops {p.drops:,}  ETA {eta}")


class ProgressMeter:
    """Snapshots of a running run from its store: tokens, the recent rate, the latest
    validation loss, merges and drops. Events are read incrementally (each snapshot reads only
    what was appended since the last one).

    Args:
        store: the run's store.
        mode: the label of the line (e.g. ``diloco``).
        loss_unit: the task's loss unit (``manifest_loss_unit``).
        budget: the token budget, or None.
        t0: monotonic start time, seconds.
        deadline_s: seconds after ``t0`` at which the run ends (a chaos window), or None.
        clock: monotonic clock (injectable for tests).
    """

    def __init__(self, store: ParameterStore, mode: str, loss_unit: str, budget: int | None,
                 t0: float, deadline_s: float | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.store, self.mode, self.loss_unit = store, mode, loss_unit
        self.budget, self.t0, self.deadline_s, self.clock = budget, t0, deadline_s, clock
        self.merges = 0
        self.val_loss: float | None = None
        self._last_id: str | None = None
        self._prev: tuple[float, int] | None = None

    def snapshot(self) -> Progress:
        """The run now.

        Raises:
            StoreUnavailable: the store did not answer.
        """
        now = self.clock()
        elapsed = now - self.t0
        tokens = sum(self.store.counters("tokens").values())
        drops = sum(int(v) for v in self.store.counters("drops").values())
        start = "-" if self._last_id is None else f"({self._last_id}"
        new = self.store.events(start=start, kinds={"merge", "eval"})
        for eid, event in new:
            if event["kind"] == "merge":
                self.merges += 1
            elif event.get("loss") is not None:
                self.val_loss = float(event["loss"])
            self._last_id = eid
        # The rate over the last interval, not since the start: compilation and start-up
        # would otherwise make the ETA far too long for most of the run.
        if self._prev is not None and now > self._prev[0]:
            rate: float | None = (tokens - self._prev[1]) / (now - self._prev[0])
        else:
            rate = tokens / elapsed if tokens and elapsed > 0 else None
        self._prev = (now, tokens)
        return Progress(self.mode, elapsed, tokens, self.budget, rate, self.val_loss,
                        self.loss_unit, self.merges, drops,
                        estimate_eta(tokens, self.budget, rate, elapsed, self.deadline_s))


class ProgressPrinter:
    """Prints a :class:`ProgressMeter` line every ``every_s`` seconds through ``emit``.

    Args:
        meter: where the numbers come from.
        every_s: seconds between two lines.
        emit: prints one line (e.g. a rich console's ``print`` with markup off).
    """

    def __init__(self, meter: ProgressMeter, every_s: float,
                 emit: Callable[[str], None]) -> None:
        self.meter, self.every_s, self.emit = meter, every_s, emit
        self._last = meter.clock()

    def tick(self, force: bool = False) -> bool:
        """Print a line if ``every_s`` has passed since the last one (or ``force``); returns
        whether it printed. A store that does not answer skips the line."""
        from ddiloco.pipeline.errors import StoreUnavailable

        if not force and self.meter.clock() - self._last < self.every_s:
            return False
        self._last = self.meter.clock()
        try:
            self.emit(format_progress(self.meter.snapshot()))
        except StoreUnavailable:
            return False
        return True


def token_budget(cfg: Any, manifest: dict[str, Any]) -> int:
    """The run's token budget: learners x ``train.steps`` x tokens per inner step (the task's
    tokens per batch times ``train.accumulate``)."""
    from ddiloco.workers.run.manifest import tokens_per_batch

    return (cfg.run.learners * cfg.train.steps * tokens_per_batch(manifest)
            * cfg.train.accumulate)


def start_lines(run_dir: Any, mode: str, log_level: str) -> list[str]:
    """What ``ddiloco run`` says at the start of a mode: where the worker logs and the
    workers' command lines are."""
    return [f"{mode}: worker logs in {run_dir}/logs/ (one <worker>.log each, level {log_level});"
            f" their command lines in {run_dir}/commands.sh"]
