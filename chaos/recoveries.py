"""Faults and recoveries read from a run's event log (DESIGN §5): each fault's detection and
recovery, fault counts, the per-worker timeline, and the summary statistics of a chaos report
(percentiles, merges per fragment, participation). Token fate and goodput are in
:mod:`ddiloco.chaos.accounting`."""

from __future__ import annotations

import math
import re
from collections import Counter
from collections.abc import Callable, Iterable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from ddiloco.chaos.accounting import (
    FAULT_STATES,
    EventLike,
    payloads,
)

# ------------------------------------------------------------------------------------------
# Faults and recoveries
# ------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Recovery:
    """How quickly one injected fault was noticed and healed.

    Attributes:
        id: the fault's id.
        kind: fault type: ``kill``, ``pause``, ``slow`` or ``partition``.
        target: ``learner-<i>``, ``shard-<i>``, ``redis`` or ``blobs``.
        injected_t: wall-clock seconds of the inject event.
        detect_s: seconds from injection to the runner's ``detected`` event; None if none.
        recover_s: seconds from injection to the event that shows the system whole again (see
            :func:`recoveries`); None for ``slow`` faults and for faults the run never
            recovered from.
        interrupted_by: for a learner kill, the id of a later kill of the same learner that
            came before this one's recovery (the restarted process died before its first
            step, so the recovery is the later kill's too); None otherwise. Such a fault's
            ``recover_s`` includes the later fault's down time: it is not a rejoin time.
    """

    id: str
    kind: str
    target: str
    injected_t: float
    detect_s: float | None
    recover_s: float | None
    interrupted_by: str | None = None


def _target_kind(target: str) -> str:
    """``learner-2`` -> ``learner``, ``shard-0`` -> ``shard``, ``redis`` -> ``redis``."""
    return re.sub(r"-\d+$", "", target)


def _contributors(merge: Mapping[str, Any]) -> set[str]:
    names = {str(c["learner"]) for c in merge.get("contributions") or [] if "learner" in c}
    return names | {str(x) for x in merge.get("contributors") or []}


def _first(
    evs: Sequence[Mapping[str, Any]], start: int, pred: Callable[[Mapping[str, Any]], bool]
) -> int | None:
    """Index of the first event at or after ``start`` that satisfies ``pred``, else None."""
    for j in range(start, len(evs)):
        if pred(evs[j]):
            return j
    return None


def _is_heal(fid: str) -> Callable[[Mapping[str, Any]], bool]:
    """Predicate: the ``heal`` or ``restart`` event of fault ``fid``."""
    return lambda e: (e.get("kind") == "fault" and str(e.get("id")) == fid
                      and e.get("phase") in ("heal", "restart"))


def _is_detection(fid: str) -> Callable[[Mapping[str, Any]], bool]:
    """Predicate: the runner's ``detected`` event of fault ``fid``."""
    return lambda e: e.get("kind") == "detected" and str(e.get("id")) == fid


def _is_kill_of(target: str) -> Callable[[Mapping[str, Any]], bool]:
    """Predicate: the ``inject`` event of a kill of ``target``."""
    return lambda e: (e.get("kind") == "fault" and e.get("phase") == "inject"
                      and e.get("fault") == "kill" and str(e.get("target")) == target)


def _recovered_at(evs: Sequence[Mapping[str, Any]], i: int, heal: int | None) -> int | None:
    """Index of the event that marks the recovery of the fault injected at ``evs[i]``."""
    fault = evs[i]
    kind, target = str(fault.get("fault")), str(fault.get("target"))
    what = _target_kind(target)
    if kind == "slow":
        return None
    if kind == "kill" and what == "learner":
        before = [
            int(e["incarnation"]) for e in evs[:i]
            if e.get("learner") == target and e.get("incarnation") is not None
        ]
        last = max(before, default=0)
        return _first(evs, i + 1, lambda e: e.get("kind") == "first_step"
                      and e.get("learner") == target and int(e.get("incarnation", 0)) > last)
    if kind == "kill" and what == "shard":
        started = _first(evs, i + 1,
                         lambda e: e.get("kind") == "shard_start" and e.get("shard") == target)
        if started is None:
            return None
        return _first(evs, started + 1,
                      lambda e: e.get("kind") == "merge" and e.get("shard") == target)
    if heal is None:
        return None
    if what in ("redis", "blobs"):
        return _first(evs, heal + 1, lambda e: e.get("kind") == "merge")
    if what == "learner":
        return _first(evs, heal + 1,
                      lambda e: e.get("kind") == "merge" and target in _contributors(e))
    if what == "shard":
        return _first(evs, heal + 1,
                      lambda e: e.get("kind") == "merge" and e.get("shard") == target)
    return None


def recoveries(events: Iterable[EventLike]) -> list[Recovery]:
    """Detection and recovery time of every injected fault, in injection order.

    ``recover_s`` is measured from the fault's ``inject`` event to:

    * learner kill: the first ``first_step`` of that learner with an incarnation above every
      incarnation it had before the fault (when the learner was killed again before that
      step, ``interrupted_by`` names the later kill);
    * shard kill: the first ``merge`` by that shard after its next ``shard_start``;
    * Redis or object-store (``blobs``) kill or pause, Redis partition: the first ``merge``
      of any shard after the fault's ``heal``/``restart`` event;
    * learner pause, partition or congest: the first ``merge`` whose contributors include the
      learner after the heal event;
    * shard pause, partition or congest: the first ``merge`` by that shard after the heal event;
    * slow: None (a persistent degradation has no recovery).

    ``detect_s`` is the first ``detected`` event with the fault's id minus the injection time
    (for ``blobs``: when the runner saw a shard's ``blobs_unavailable``).
    Either is None when the event never came (e.g. the run ended first). Seconds throughout.
    """
    evs = payloads(events)
    out: list[Recovery] = []
    for i, e in enumerate(evs):
        if e.get("kind") != "fault" or e.get("phase") != "inject":
            continue
        fid = str(e.get("id"))
        t0 = float(e["t"])
        detected = _first(evs, i + 1, _is_detection(fid))
        heal = _first(evs, i + 1, _is_heal(fid))
        done = _recovered_at(evs, i, heal)
        again = None
        if e.get("fault") == "kill" and _target_kind(str(e.get("target"))) == "learner":
            again = _first(evs, i + 1, _is_kill_of(str(e.get("target"))))
            if again is not None and done is not None and again > done:
                again = None
        out.append(Recovery(
            id=fid,
            kind=str(e.get("fault")),
            target=str(e.get("target")),
            injected_t=t0,
            detect_s=None if detected is None else float(evs[detected]["t"]) - t0,
            recover_s=None if done is None else float(evs[done]["t"]) - t0,
            interrupted_by=None if again is None or done is None else str(evs[again].get("id")),
        ))
    return out


def fault_counts(events: Iterable[EventLike]) -> dict[str, int]:
    """Injected faults by ``"<type>:<target kind>"``, e.g. ``{"kill:learner": 3}``."""
    counts: Counter[str] = Counter()
    for e in payloads(events):
        if e.get("kind") == "fault" and e.get("phase") == "inject":
            counts[f"{e.get('fault')}:{_target_kind(str(e.get('target')))}"] += 1
    return dict(sorted(counts.items()))


def timeline(events: Iterable[EventLike], t0: float) -> dict[str, list[tuple[float, float, str]]]:
    """Per worker, the intervals ``(start_s, end_s, state)`` during which a fault was active.

    Seconds relative to ``t0``. ``state`` is ``down`` (kill), ``paused``, ``partitioned`` or
    ``slow`` (:data:`FAULT_STATES`). An interval ends at the fault's first ``heal``/``restart``
    event; without one, at injection + ``duration_s`` when given, else at the end of the run
    (``chaos_end``, or the last event).
    """
    evs = payloads(events)
    ends = [float(e["t"]) for e in evs if e.get("kind") == "chaos_end"]
    t_end = ends[-1] if ends else max((float(e["t"]) for e in evs), default=t0)
    out: dict[str, list[tuple[float, float, str]]] = {}
    for i, e in enumerate(evs):
        if e.get("kind") != "fault" or e.get("phase") != "inject":
            continue
        fid = str(e.get("id"))
        start = float(e["t"])
        heal = _first(evs, i + 1, _is_heal(fid))
        if heal is not None:
            end = float(evs[heal]["t"])
        elif e.get("duration_s") is not None:
            end = min(start + float(e["duration_s"]), max(t_end, start))
        else:
            end = max(t_end, start)
        state = FAULT_STATES.get(str(e.get("fault")), str(e.get("fault")))
        out.setdefault(str(e.get("target")), []).append(
            (round(start - t0, 3), round(end - t0, 3), state)
        )
    return {k: sorted(v) for k, v in sorted(out.items())}


# ------------------------------------------------------------------------------------------
# Summaries
# ------------------------------------------------------------------------------------------


def _quantile(sorted_values: Sequence[float], q: float) -> float:
    """Linear interpolation between closest ranks (numpy's default)."""
    pos = (len(sorted_values) - 1) * q
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_values) - 1)
    return sorted_values[lo] + (sorted_values[hi] - sorted_values[lo]) * (pos - lo)


def percentile_summary(values: Iterable[float | None]) -> dict[str, float | None]:
    """``{"n", "missing", "p50", "p90", "max"}`` of ``values`` (e.g. recovery seconds).

    None entries (e.g. faults never recovered from) are counted in ``missing`` and left out of
    the statistics, which are None when no value remains.
    """
    given = list(values)
    vals = sorted(float(v) for v in given if v is not None)
    missing = len(given) - len(vals)
    if not vals:
        return {"n": 0, "missing": missing, "p50": None, "p90": None, "max": None}
    return {
        "n": len(vals),
        "missing": missing,
        "p50": _quantile(vals, 0.5),
        "p90": _quantile(vals, 0.9),
        "max": vals[-1],
    }


def rejoin_summary(recs: Iterable[Recovery],
                   down_s: Mapping[str, float | None]) -> dict[str, float | None]:
    """How long restarted workers took to take part again: :func:`percentile_summary` of each
    kill's ``recover_s`` less its scripted down time (``down_s`` by fault id, seconds; None or
    absent: 0), plus ``"interrupted"``: the learner kills whose restarted process was killed
    again before its first step. Those have no rejoin time of their own (their recovery spans
    the later kill's down time as well) and are left out; the later kill's rejoin is counted.
    """
    kills = [r for r in recs if r.kind == "kill" and r.recover_s is not None]
    summary = percentile_summary([r.recover_s - (down_s.get(r.id) or 0.0) for r in kills
                                  if r.recover_s is not None and r.interrupted_by is None])
    summary["interrupted"] = sum(1 for r in kills if r.interrupted_by is not None)
    return summary


def merges_per_fragment(merges: Iterable[Mapping[str, Any]]) -> dict[int, int]:
    """Number of merges of each fragment, by fragment index."""
    counts = Counter(int(m["fragment"]) for m in merges)
    return dict(sorted(counts.items()))


def participation(merges: Iterable[Mapping[str, Any]]) -> dict[str, Any]:
    """How many learners contributed to each DiLoCo merge.

    Returns:
        ``{"histogram": {n_contributors: merges}, "mean": float | None}``; data-parallel merges
        (with ``dp_step``, no contributors) are left out.
    """
    sizes = [len(_contributors(m)) for m in merges if "dp_step" not in m]
    hist = Counter(sizes)
    return {
        "histogram": dict(sorted(hist.items())),
        "mean": sum(sizes) / len(sizes) if sizes else None,
    }
