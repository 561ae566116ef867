"""Token fate, goodput, downtime and recovery times of a run, as pure functions (DESIGN §5).

Everything here is computed from plain data: the event stream (``store.events()``; either its
``(id, event)`` pairs or the bare event dicts), the per-incarnation fate records the learners
keep, and the fragment-tokens the shards received from each incarnation. No I/O, no clock: the
same numbers come out of a live run, a finished one and a hand-written test log.

Units:

A learner step of ``B`` tokens adds ``B`` tokens to the pending delta of *every* fragment, so
token accounting is exact only per fragment: all token counts here are **fragment-tokens**
(tokens x fragments, integers). ``tokens = fragment-tokens / P`` with ``P`` fragments. Times are
wall-clock seconds (``time.time()`` of the writer of each event).

Token fate (DESIGN §5):

Every fragment-token a learner processes ends in exactly one fate:

* **merged**: it entered a round with weight > 0 (a ``merge`` event's contribution);
* **discarded**: overwritten by an adoption before it was sent (``overwritten``), left unsent on
  a clean exit because it was too small to be worth a merge (``drain``), or sent and dropped by
  a shard (``dropped:<reason>``, e.g. ``dropped:stale``);
* **lost**: sent but never arrived (``in_flight``), accepted by a shard that died before merging
  it (``shard_lost``), or never sent because the learner was killed (``learner_killed``);
  ``unsent_at_exit`` is the same residual for a learner that drained or was still running.

The lost terms are residuals of the counters (``in_flight = sent - received``, and so on), so
the fates sum to the processed tokens by construction *unless* something was counted twice: a
negative residual. Such a residual is reported in :attr:`TokenFate.anomalies`, clipped to 0 in
:attr:`TokenFate.lost` and its size recorded in :attr:`TokenFate.excess`; then
``balance == -sum(excess) < 0``. Hence ``balance != 0`` exactly when something was double
counted (or merged/dropped tokens name an incarnation that has no fate record).
"""

from __future__ import annotations

import itertools
from collections import Counter
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, TypeAlias

__all__ = [
    "FAULT_STATES",
    "EventLike",
    "TokenFate",
    "availability",
    "complete_goodput",
    "dp_token_fate",
    "global_downtime",
    "goodput",
    "payloads",
    "step_time_fallback",
    "token_fate",
]

#: One stream entry: a bare event dict, or the ``(id, event)`` pair ``store.events()`` returns.
EventLike: TypeAlias = "Mapping[str, Any] | tuple[str, Mapping[str, Any]]"

#: Timeline state of a worker while a fault of each type is active.
FAULT_STATES = {"kill": "down", "pause": "paused", "partition": "partitioned", "slow": "slow",
                "congest": "congested"}

#: Names of the learner-side residual by how the incarnation ended.
_UNSENT_KILLED = "learner_killed"
_UNSENT_OTHER = "unsent_at_exit"

Incarnation: TypeAlias = tuple[str, int]


def payloads(events: Iterable[EventLike]) -> list[dict[str, Any]]:
    """The event dicts of ``events``, oldest first (stream ids stripped, dicts copied)."""
    out: list[dict[str, Any]] = []
    for e in events:
        out.append(dict(e[1]) if isinstance(e, tuple) else dict(e))
    return out


def _label(key: Incarnation) -> str:
    return f"{key[0]}#{key[1]}"


def _check_fragments(n_fragments: int) -> None:
    if n_fragments < 1:
        raise ValueError(f"n_fragments must be >= 1, got {n_fragments}")


# ------------------------------------------------------------------------------------------
# Token fate
# ------------------------------------------------------------------------------------------


@dataclass
class TokenFate:
    """Where every processed fragment-token went (DESIGN §5). All counts in fragment-tokens.

    Attributes:
        processed: fragment-tokens the learners trained on (all incarnations).
        merged: fragment-tokens that entered a merge with weight > 0.
        discarded: by cause: ``overwritten``, ``drain`` (learner side) and ``dropped:<reason>``
            (shard side).
        lost: by cause: ``in_flight``, ``shard_lost``, ``learner_killed``, ``unsent_at_exit``
            (DiLoCo); ``rollback``, ``unsent_at_exit`` (data-parallel baseline).
        n_fragments: P; ``tokens = fragment-tokens / P``.
        anomalies: human-readable evidence of double counting or of records that do not match
            (a negative residual, a merge naming an incarnation without a fate record, ...).
        excess: fragment-tokens counted beyond what was processed, by cause (each negative
            residual's size; ``no_fate_record`` for merges and drops of unknown incarnations).
        per_incarnation: the same breakdown per ``"<learner>#<incarnation>"``.
    """

    processed: int
    merged: int
    discarded: dict[str, int]
    lost: dict[str, int]
    n_fragments: int
    anomalies: list[str] = field(default_factory=list)
    excess: dict[str, int] = field(default_factory=dict)
    per_incarnation: dict[str, dict[str, Any]] = field(default_factory=dict)

    @property
    def balance(self) -> int:
        """``processed - merged - sum(discarded) - sum(lost)`` in fragment-tokens.

        0 when every processed fragment-token has exactly one fate; negative (``-sum(excess)``)
        when something was counted twice.
        """
        return (
            self.processed
            - self.merged
            - sum(self.discarded.values())
            - sum(self.lost.values())
        )

    def to_json(self) -> dict[str, Any]:
        """JSON-able summary: the counts in fragment-tokens and in tokens (/ P, 1 decimal),
        each fate's share of the processed tokens, the balance, excess and anomalies."""
        p = self.n_fragments

        def tok(x: int) -> float:
            return round(x / p, 1)

        def share(x: int) -> float | None:
            return round(x / self.processed, 4) if self.processed else None

        discarded_total = sum(self.discarded.values())
        lost_total = sum(self.lost.values())
        return {
            "n_fragments": p,
            "fragment_tokens": {
                "processed": self.processed,
                "merged": self.merged,
                "discarded": dict(self.discarded),
                "lost": dict(self.lost),
                "balance": self.balance,
            },
            "tokens": {
                "processed": tok(self.processed),
                "merged": tok(self.merged),
                "discarded": {k: tok(v) for k, v in self.discarded.items()},
                "lost": {k: tok(v) for k, v in self.lost.items()},
                "balance": tok(self.balance),
            },
            "shares": {
                "merged": share(self.merged),
                "discarded": share(discarded_total),
                "lost": share(lost_total),
            },
            "excess": dict(self.excess),
            "anomalies": list(self.anomalies),
            "per_incarnation": {k: dict(v) for k, v in self.per_incarnation.items()},
        }


class _Ledger:
    """Accumulates totals; negative residuals go to ``excess`` (see the module docstring)."""

    def __init__(self) -> None:
        self.processed = 0
        self.merged = 0
        self.discarded: Counter[str] = Counter()
        self.lost: Counter[str] = Counter()
        self.excess: Counter[str] = Counter()
        self.anomalies: list[str] = []

    def residual(self, label: str, name: str, value: int, how: str) -> int:
        if value < 0:
            self.anomalies.append(f"{label}: {name} residual {value} < 0 ({how})")
            self.excess[name] += -value
            return 0
        self.lost[name] += value
        return value

    def result(
        self, n_fragments: int, per_incarnation: dict[str, dict[str, Any]]
    ) -> TokenFate:
        return TokenFate(
            processed=self.processed,
            merged=self.merged,
            discarded=dict(sorted(self.discarded.items())),
            lost=dict(sorted(self.lost.items())),
            n_fragments=n_fragments,
            anomalies=self.anomalies,
            excess={k: v for k, v in sorted(self.excess.items()) if v},
            per_incarnation=per_incarnation,
        )


def _fate_records(
    fates: Iterable[Mapping[str, Any]], ledger: _Ledger
) -> dict[Incarnation, Mapping[str, Any]]:
    records: dict[Incarnation, Mapping[str, Any]] = {}
    for f in fates:
        key = (str(f["learner"]), int(f["incarnation"]))
        if key in records:
            ledger.anomalies.append(f"{_label(key)}: two fate records; the last one is used")
        records[key] = f
    return dict(sorted(records.items()))


def _learner_counters(record: Mapping[str, Any]) -> tuple[int, int, int, int]:
    """``(processed, sent, overwritten, drain)`` of a fate record, in fragment-tokens.

    A record may carry ``wire``: the send-time snapshots ``[processed, sent, overwritten,
    drain]`` that shards saw in delta headers. The counters are cumulative and only grow, so
    the newest knowledge is the maximum of the record and every snapshot (a learner killed
    between two updates of its record is still known up to its last send).
    """
    learner_side = record.get("discarded") or {}
    best = [
        int(record.get("processed") or 0),
        int(record.get("sent") or 0),
        int(learner_side.get("overwritten") or 0),
        int(learner_side.get("drain") or 0),
    ]
    for snap in record.get("wire") or []:
        if isinstance(snap, Sequence) and len(snap) == 4:
            best = [max(b, int(x)) for b, x in zip(best, snap, strict=True)]
    return best[0], best[1], best[2], best[3]


def token_fate(
    fates: Sequence[Mapping[str, Any]],
    merges: Sequence[Mapping[str, Any]],
    drops: Sequence[Mapping[str, Any]],
    received: Mapping[tuple[str, int], int],
    n_fragments: int,
) -> TokenFate:
    """Fate of every processed fragment-token of a DiLoCo run (DESIGN §5).

    Per incarnation ``(learner, inc)``, all in fragment-tokens:

    * merged = sum of the ``tokens`` of the merge contributions naming it;
    * ``dropped:<reason>`` = sum of the ``tokens`` of the drop events naming it;
    * ``overwritten`` and ``drain`` as in its fate record (learner side);
    * lost ``in_flight`` = sent - received;
    * lost ``shard_lost`` = received - merged - dropped (accepted, then the shard died);
    * lost ``learner_killed`` (ended ``"killed"``) or ``unsent_at_exit`` (``"drained"`` or
      ``"running"``) = processed - sent - overwritten - drain.

    A negative residual is double counting: it is listed in ``anomalies``, clipped to 0 and its
    size kept in ``excess``, so ``balance == -sum(excess)``. Merges and drops that name an
    incarnation without a fate record count in ``merged``/``discarded`` and in
    ``excess["no_fate_record"]`` (their tokens were never recorded as processed).

    Args:
        fates: one record per learner incarnation: ``learner``, ``incarnation``, ``ended``,
            ``processed``, ``sent``, ``discarded`` (``{"overwritten", "drain"}``); cumulative
            fragment-tokens of that incarnation. Optional ``wire`` snapshots (as returned by
            ``RedisStore.fate_records``) raise these counters to the newest value seen, and an
            optional ``received`` is used when ``received`` below has no entry for it.
        merges: ``merge`` events; each DiLoCo merge's ``contributions`` is a list of
            ``{learner, inc, seqs, tokens}``. Data-parallel merges (with ``dp_step``) carry no
            contributions and are ignored.
        drops: ``drop`` events; those with ``learner`` and ``inc`` count for that incarnation.
        received: fragment-tokens of the deltas of each ``(learner, inc)`` that shards decoded
            with a known sender (accepted into a round or dropped).
        n_fragments: P.

    Raises:
        ValueError: ``n_fragments < 1``.
    """
    _check_fragments(n_fragments)
    ledger = _Ledger()
    records = _fate_records(fates, ledger)
    merged_by: Counter[Incarnation] = Counter()
    dropped_by: dict[Incarnation, Counter[str]] = {}
    orphans: Counter[Incarnation] = Counter()

    for m in merges:
        if "dp_step" in m:
            continue
        for c in m.get("contributions") or []:
            key = (str(c["learner"]), int(c["inc"]))
            tokens = int(c.get("tokens") or 0)
            ledger.merged += tokens
            if key in records:
                merged_by[key] += tokens
            else:
                orphans[key] += tokens
                ledger.excess["no_fate_record"] += tokens

    for d in drops:
        reason = str(d.get("reason") or "unknown")
        tokens = int(d.get("tokens") or 0)
        learner, inc = d.get("learner"), d.get("inc")
        if learner is None or inc is None:
            if tokens:
                ledger.anomalies.append(
                    f"drop ({reason}) of {tokens} fragment-tokens without a known sender "
                    "incarnation: not attributed"
                )
            continue
        key = (str(learner), int(inc))
        ledger.discarded[f"dropped:{reason}"] += tokens
        if key in records:
            dropped_by.setdefault(key, Counter())[reason] += tokens
        else:
            orphans[key] += tokens
            ledger.excess["no_fate_record"] += tokens

    for key, tokens in sorted(orphans.items()):
        ledger.anomalies.append(
            f"{_label(key)}: merges/drops of {tokens} fragment-tokens but no fate record"
        )
    for key in sorted(set(received) - set(records)):
        ledger.anomalies.append(
            f"{_label(key)}: shards received {received[key]} fragment-tokens but there is "
            "no fate record"
        )

    per: dict[str, dict[str, Any]] = {}
    for key, f in records.items():
        label = _label(key)
        processed, sent, overwritten, drain = _learner_counters(f)
        got = int(received[key]) if key in received else int(f.get("received") or 0)
        merged = merged_by[key]
        dropped = dropped_by.get(key, Counter())
        dropped_total = sum(dropped.values())
        ended = str(f.get("ended") or "running")
        unsent_name = _UNSENT_KILLED if ended == "killed" else _UNSENT_OTHER

        ledger.processed += processed
        ledger.discarded["overwritten"] += overwritten
        ledger.discarded["drain"] += drain
        unsent = ledger.residual(
            label, unsent_name, processed - sent - overwritten - drain,
            f"processed {processed} < sent {sent} + overwritten {overwritten} + drain {drain}",
        )
        in_flight = ledger.residual(
            label, "in_flight", sent - got, f"received {got} > sent {sent}"
        )
        shard_lost = ledger.residual(
            label, "shard_lost", got - merged - dropped_total,
            f"merged {merged} + dropped {dropped_total} > received {got}",
        )
        per[label] = {
            "ended": ended,
            "processed": processed,
            "sent": sent,
            "received": got,
            "merged": merged,
            "discarded": {
                "overwritten": overwritten,
                "drain": drain,
                **{f"dropped:{r}": v for r, v in sorted(dropped.items())},
            },
            "lost": {unsent_name: unsent, "in_flight": in_flight, "shard_lost": shard_lost},
        }

    return ledger.result(n_fragments, per)


def dp_token_fate(
    fates: Sequence[Mapping[str, Any]], tokens_per_step: int, n_fragments: int
) -> TokenFate:
    """Fate of every processed fragment-token of the data-parallel baseline (DESIGN §2, §5).

    Data-parallel training without elasticity restarts the whole job from its last checkpoint
    after any failure: only the steps up to the checkpoint survive. Per incarnation, in
    fragment-tokens:

    * merged = ``(committed_step - start_step) * tokens_per_step * n_fragments``, clipped to
      ``[0, processed]`` (``committed_step`` None: nothing committed);
    * lost ``rollback`` = processed - merged for an incarnation that ended ``"killed"``,
      ``unsent_at_exit`` for ``"drained"`` and ``"running"`` ones (normally 0 after a drain).

    Args:
        fates: fate records with ``learner``, ``incarnation``, ``ended``, ``processed``,
            ``start_step`` and ``committed_step``.
        tokens_per_step: tokens of one learner step (batch x sequence length).
        n_fragments: P.

    Raises:
        ValueError: ``n_fragments < 1`` or ``tokens_per_step < 1``.
    """
    _check_fragments(n_fragments)
    if tokens_per_step < 1:
        raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step}")
    ledger = _Ledger()
    per: dict[str, dict[str, Any]] = {}
    for key, f in _fate_records(fates, ledger).items():
        processed = _learner_counters(f)[0]
        start = int(f.get("start_step") or 0)
        committed_raw = f.get("committed_step")
        committed = start if committed_raw is None else int(committed_raw)
        merged = min(max(0, (committed - start) * tokens_per_step * n_fragments), processed)
        ended = str(f.get("ended") or "running")
        name = "rollback" if ended == "killed" else _UNSENT_OTHER
        ledger.processed += processed
        ledger.merged += merged
        rest = ledger.residual(
            _label(key), name, processed - merged, f"processed {processed} < 0"
        )
        per[_label(key)] = {
            "ended": ended,
            "processed": processed,
            "merged": merged,
            "start_step": start,
            "committed_step": committed_raw,
            "lost": {name: rest},
        }
    return ledger.result(n_fragments, per)


# ------------------------------------------------------------------------------------------
# Goodput and downtime
# ------------------------------------------------------------------------------------------


def goodput(
    merged_fragment_tokens: int,
    n_fragments: int,
    tokens_per_step: int,
    ref_step_s: float,
    learners: int,
    wall_s: float,
) -> float:
    """Share of allocated learner-time whose tokens entered the global model (DESIGN §5).

    ``merged_fragment_tokens / n_fragments / tokens_per_step`` is the number of learner steps
    whose tokens were merged; at the fault-free step time ``ref_step_s`` (seconds) that is the
    useful learner-time, divided by the allocated learner-time ``learners * wall_s``.

    The result is not clipped: a value above 1 means more tokens were counted as merged than the
    learners could have processed at ``ref_step_s`` (double counting, or a reference step time
    slower than the run's), which is a bug signal to surface, not to hide.

    Raises:
        ValueError: a non-positive ``n_fragments``, ``tokens_per_step``, ``ref_step_s``,
            ``learners`` or ``wall_s``, or negative ``merged_fragment_tokens``.
    """
    _check_fragments(n_fragments)
    if tokens_per_step < 1:
        raise ValueError(f"tokens_per_step must be >= 1, got {tokens_per_step}")
    if not ref_step_s > 0:
        raise ValueError(f"ref_step_s must be > 0 seconds, got {ref_step_s}")
    if learners < 1:
        raise ValueError(f"learners must be >= 1, got {learners}")
    if not wall_s > 0:
        raise ValueError(f"wall_s must be > 0 seconds, got {wall_s}")
    if merged_fragment_tokens < 0:
        raise ValueError(f"merged_fragment_tokens must be >= 0, got {merged_fragment_tokens}")
    useful_s = merged_fragment_tokens / n_fragments / tokens_per_step * ref_step_s
    return useful_s / (learners * wall_s)


def availability(
    goodput_: float,
    merged_fragment_tokens: int,
    discarded_fragment_tokens: int,
    n_fragments: int,
    tokens_per_step: int,
    ref_step_s: float,
    learners: int,
    wall_s: float,
) -> float:
    """Goodput counting every token not lost to a fault (merged, or discarded by the
    algorithm, e.g. overwritten or dropped as stale): the share of allocated learner-time the
    faults left usable, which is what ``chaos.simulator`` models.

    With merged tokens, ``goodput_`` scaled by ``(merged + discarded) / merged`` (the run's
    totals; ``goodput_`` counts the scripted window only). With none merged, the discarded
    fragment-tokens converted to learner-time at ``ref_step_s`` as in :func:`goodput`, added
    to ``goodput_``.

    Raises:
        ValueError: as :func:`goodput`, or negative token counts.
    """
    if merged_fragment_tokens < 0 or discarded_fragment_tokens < 0:
        raise ValueError("fragment-token counts must be >= 0, got "
                         f"{merged_fragment_tokens}, {discarded_fragment_tokens}")
    if merged_fragment_tokens > 0:
        return goodput_ * (merged_fragment_tokens + discarded_fragment_tokens) / (
            merged_fragment_tokens)
    return goodput_ + goodput(discarded_fragment_tokens, n_fragments, tokens_per_step,
                              ref_step_s, learners, wall_s)


def step_time_fallback(
    mode: str, blocks: Mapping[str, Mapping[str, Any]]
) -> tuple[float | None, str | None]:
    """A step time for ``mode`` when neither its chaos run nor its reference run measured one
    (a mode that never reached a fault-free stretch): another mode's, the first in name order
    that has one.

    Returns:
        ``(ref_step_s, "<other mode>:<its source>")``, or ``(None, None)`` when no mode has
        one. A block's own source is ``step_time_source`` (``"reference"``: its fault-free
        reference run; ``"own"``: the median over its learners), ``"measured"`` if absent.
    """
    for other in sorted(blocks):
        blk = blocks[other]
        step = blk.get("ref_step_s")
        if other != mode and step:
            return float(step), f"{other}:{blk.get('step_time_source') or 'measured'}"
    return None, None


def complete_goodput(
    blocks: Mapping[str, Mapping[str, Any]]
) -> dict[str, dict[str, Any]]:
    """chaos.json mode blocks in which every mode has ``goodput`` and ``availability``.

    A block without goodput (no step time: its learners never finished a fault-free stretch
    and there is no reference run) gets the step time of :func:`step_time_fallback`, its
    ``step_time_source`` naming where it came from, and the goodput of its merged tokens at
    that step time (:func:`goodput`). A block with goodput but no availability (nothing
    merged) gets :func:`availability`. Blocks are copied, never changed in place; a mode stays
    without goodput only when no mode measured a step time.

    Each block needs ``merged_tokens_in_window`` (tokens), ``tokens_per_step``,
    ``learners``, ``wall_s`` and ``token_fate`` (:meth:`TokenFate.to_json`).
    """
    out = {mode: dict(blk) for mode, blk in blocks.items()}
    for mode, blk in out.items():
        fate = blk.get("token_fate") or {}
        n_fragments = int(fate.get("n_fragments") or 1)
        counts = fate.get("fragment_tokens") or {}
        merged = int(counts.get("merged") or 0)
        discarded = int(sum((counts.get("discarded") or {}).values()))
        tokens_per_step = int(blk.get("tokens_per_step") or 0)
        learners = int(blk.get("learners") or 0)
        wall_s = float(blk.get("wall_s") or 0.0)
        if tokens_per_step < 1 or learners < 1 or not wall_s > 0:
            continue
        if blk.get("goodput") is None:
            step, source = step_time_fallback(mode, blocks)
            if step is None:
                continue
            window = round(float(blk.get("merged_tokens_in_window") or 0.0) * n_fragments)
            blk["ref_step_s"] = step
            blk["step_time_source"] = source
            blk["goodput"] = round(goodput(window, n_fragments, tokens_per_step, step, learners,
                                           wall_s), 4)
            blk["availability"] = None
        if blk.get("availability") is None:
            blk["availability"] = round(availability(
                float(blk["goodput"]), merged, discarded, n_fragments, tokens_per_step,
                float(blk["ref_step_s"]), learners, wall_s), 4)
    return out


def global_downtime(
    merge_times: Sequence[float], t_start: float, t_end: float
) -> tuple[float, float, float]:
    """Longest interval (seconds) in ``[t_start, t_end]`` without a merge of any fragment.

    The edges count: ``t_start`` to the first merge and the last merge to ``t_end``. Merge
    times outside the window are ignored. Ties go to the earliest gap.

    Returns:
        ``(gap_s, gap_start, gap_end)``, wall-clock seconds.

    Raises:
        ValueError: ``t_end < t_start``.
    """
    if t_end < t_start:
        raise ValueError(f"t_end {t_end} is before t_start {t_start}")
    points = [t_start, *sorted(t for t in merge_times if t_start <= t <= t_end), t_end]
    best = (0.0, t_start, t_start)
    for a, b in itertools.pairwise(points):
        if b - a > best[0]:
            best = (b - a, a, b)
    return best
