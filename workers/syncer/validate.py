"""What a received message must satisfy before a server records anything (DESIGN §4).

:func:`ddiloco.pipeline.wire.decode` checks the frame itself (format, run id, CRC, codec, shapes
against the manifest, finite tensors). The checks here need the receiver's role: which
fragments a shard owns, which kinds it takes, how many tokens a learner can have processed.
Every function is pure and raises a named :class:`ddiloco.pipeline.errors.DropError`; the caller
drops
and counts the message with that reason and changes nothing else.

Token claims: a delta's header sets its own token weight (``c_tokens^2 / c_steps``, paper), so
the claims are bounded by what a learner can produce (``c_tokens <= c_steps * batch tokens``,
``new_tokens <= c_tokens``, ``c_steps <= step``) and ``c_steps`` is clamped to
:attr:`ClaimLimits.max_c_steps` (ours: four sync periods), so that even a keyed learner that
lies cannot outweigh an honest one by more than that factor.
"""

from __future__ import annotations

import math
from collections.abc import Collection, Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np

from ddiloco.pipeline.errors import (
    ImplausibleClaim,
    InvalidField,
    MissingPayload,
    NotOwned,
)
from ddiloco.pipeline.wire import Header, Kind

#: Longest plausible inner step, seconds; a larger ``step_time`` would pin the grace window.
MAX_STEP_TIME_S = 3600.0
#: Largest counter a header may carry (int64 range, so numpy arithmetic cannot wrap).
MAX_COUNTER = 2**62
#: CONTROL actions a shard takes from a learner, and a learner from a shard.
SHARD_ACTIONS = frozenset({"join"})
LEARNER_ACTIONS = frozenset({"round_open", "resync"})


@dataclass(frozen=True)
class ClaimLimits:
    """Bounds on a delta's token counters.

    Attributes:
        tokens_per_batch: tokens of one inner step of one learner (batch_size * seq_len).
        max_c_steps: steps since adoption counted towards the token weight; larger claims
            are clamped to it (0: no clamp).
    """

    tokens_per_batch: int
    max_c_steps: int = 0


@dataclass(frozen=True)
class DeltaClaim:
    """A validated delta's counters, as the shard files them."""

    c_steps: int
    c_tokens: int
    new_tokens: int
    #: the learner's cumulative [processed, sent, overwritten, drain] fragment-tokens, if sent
    fate: list[int] | None
    #: True when c_steps was clamped to ClaimLimits.max_c_steps
    clamped: bool = False


def check_counters(h: Header) -> None:
    """Every counter non-negative and below :data:`MAX_COUNTER`, ids >= -1, times finite;
    ``step_time`` in [0, :data:`MAX_STEP_TIME_S`].

    Raises:
        InvalidField: naming the field.
    """
    for name in ("inc", "seq", "c_steps", "c_tokens", "new_tokens", "step"):
        v = getattr(h, name)
        if not 0 <= v <= MAX_COUNTER:
            raise InvalidField(f"header field {name!r} = {v} is out of range")
    for name in ("frag", "base", "ver"):
        v = getattr(h, name)
        if not -1 <= v <= MAX_COUNTER:
            raise InvalidField(f"header field {name!r} = {v} is out of range")
    if not (math.isfinite(h.step_time) and 0.0 <= h.step_time <= MAX_STEP_TIME_S):
        raise InvalidField(f"step_time {h.step_time!r} is not in [0, {MAX_STEP_TIME_S}] s")
    if not math.isfinite(h.t):
        raise InvalidField(f"send time {h.t!r} is not finite")


def check_fate(extra: Mapping[str, Any]) -> list[int] | None:
    """The token-fate record a DELTA may carry in ``extra["fate"]`` (DESIGN §5).

    Returns:
        [processed, sent, overwritten, drain] fragment-tokens, or None when absent.

    Raises:
        InvalidField: not a list of four ints in [0, MAX_COUNTER].
    """
    fate = extra.get("fate")
    if fate is None:
        return None
    if not (isinstance(fate, list) and len(fate) == 4
            and all(isinstance(x, int) and not isinstance(x, bool) and 0 <= x <= MAX_COUNTER
                    for x in fate)):
        raise InvalidField(f"malformed token-fate record {str(fate)[:80]!r}")
    return [int(x) for x in fate]


def check_claim(h: Header, limits: ClaimLimits) -> tuple[int, int, bool]:
    """Bound a delta's token counters by what a learner can produce.

    Returns:
        (c_steps, c_tokens, clamped): c_steps clamped to ``limits.max_c_steps`` and c_tokens
        scaled with it, so the token weight ``c_tokens^2 / c_steps`` is bounded too.

    Raises:
        ImplausibleClaim: c_steps < 1, c_steps > step, c_tokens > c_steps * tokens_per_batch
            or new_tokens > c_tokens.
    """
    if h.c_steps < 1:
        raise ImplausibleClaim(f"c_steps {h.c_steps}: a delta holds at least one inner step")
    if h.c_steps > h.step:
        raise ImplausibleClaim(f"c_steps {h.c_steps} exceeds the learner's step {h.step}")
    if h.c_tokens > h.c_steps * limits.tokens_per_batch:
        raise ImplausibleClaim(
            f"c_tokens {h.c_tokens} exceeds c_steps {h.c_steps} x {limits.tokens_per_batch} "
            "tokens per batch")
    if h.new_tokens > h.c_tokens:
        raise ImplausibleClaim(f"new_tokens {h.new_tokens} exceeds c_tokens {h.c_tokens}")
    if limits.max_c_steps and h.c_steps > limits.max_c_steps:
        c_tokens = h.c_tokens * limits.max_c_steps // h.c_steps
        return limits.max_c_steps, c_tokens, True
    return h.c_steps, h.c_tokens, False


def check_delta(h: Header, tensors: list[np.ndarray] | None, owned: Collection[int],
                limits: ClaimLimits) -> DeltaClaim:
    """Everything a DiLoCo shard checks on a DELTA before it files it.

    Args:
        h: the decoded header (``kind`` DELTA).
        tensors: the decoded payload (None when the message had none).
        owned: fragment ids this shard owns.
        limits: the run's claim bounds.

    Raises:
        NotOwned, MissingPayload, InvalidField, ImplausibleClaim.
    """
    check_counters(h)
    if h.frag not in owned:
        raise NotOwned(f"fragment {h.frag} is not owned by this shard")
    if tensors is None:
        raise MissingPayload(f"DELTA of fragment {h.frag} without tensors")
    if h.base < 0:
        raise InvalidField(f"DELTA base {h.base} is not a version")
    fate = check_fate(h.extra)
    c_steps, c_tokens, clamped = check_claim(h, limits)
    return DeltaClaim(c_steps, c_tokens, h.new_tokens, fate, clamped)


def check_grad(h: Header, tensors: list[np.ndarray] | None, owned: Collection[int]) -> None:
    """What a data-parallel shard checks on a GRAD before it files it.

    Raises:
        NotOwned, MissingPayload, InvalidField.
    """
    check_counters(h)
    if h.frag not in owned:
        raise NotOwned(f"fragment {h.frag} is not owned by this shard")
    if tensors is None:
        raise MissingPayload(f"GRAD of fragment {h.frag} without tensors")
    if h.ver < 0:
        raise InvalidField(f"GRAD step {h.ver} is negative")


def check_shard_control(h: Header, owned: Collection[int]) -> str:
    """A CONTROL a shard takes from a learner; returns its action.

    Raises:
        InvalidField: an action a shard does not take. NotOwned: a fragment it does not own.
    """
    check_counters(h)
    action = h.extra.get("action")
    if action not in SHARD_ACTIONS:
        raise InvalidField(f"CONTROL action {str(action)[:40]!r} is not one a shard takes")
    if h.frag not in owned:
        raise NotOwned(f"fragment {h.frag} is not owned by this shard")
    return str(action)


def check_broadcast(h: Header, tensors: list[np.ndarray] | None,
                    n_fragments: int) -> dict[int, int] | None:
    """What a learner checks on a message from a shard before it changes its view.

    Returns:
        For a HEARTBEAT, its ``{fragment: version}`` map; None otherwise.

    Raises:
        InvalidField, NotOwned (a fragment the run does not have), MissingPayload.
    """
    check_counters(h)
    if h.kind == Kind.HEARTBEAT:
        versions = h.extra.get("versions", {})
        if not isinstance(versions, dict):
            raise InvalidField("HEARTBEAT versions is not a map")
        out: dict[int, int] = {}
        for k, v in versions.items():
            if not (isinstance(k, str) and k.isdigit() and int(k) < n_fragments
                    and isinstance(v, int) and not isinstance(v, bool) and 0 <= v <= MAX_COUNTER):
                raise InvalidField(f"HEARTBEAT version entry {str(k)[:20]!r}: {str(v)[:20]!r}")
            out[int(k)] = int(v)
        return out
    if not 0 <= h.frag < n_fragments:
        raise NotOwned(f"fragment {h.frag} is not in the run (P = {n_fragments})")
    if h.kind == Kind.VERSION:
        if tensors is None:
            raise MissingPayload(f"VERSION {h.ver} of fragment {h.frag} without tensors")
        if h.enc not in ("diff", "full"):
            raise InvalidField(f"VERSION encoding {h.enc!r}")
        if h.ver <= h.base or (h.enc == "diff" and h.base < 0):
            raise InvalidField(f"VERSION {h.ver} from base {h.base}")
        merged = h.extra.get("merged", {})
        if not (isinstance(merged, dict) and all(
                isinstance(k, str) and isinstance(v, int) and not isinstance(v, bool)
                for k, v in merged.items())):
            raise InvalidField("VERSION 'merged' is not a map of learner -> step")
    elif h.kind == Kind.GRAD_AVG:
        if tensors is None:
            raise MissingPayload(f"GRAD_AVG of fragment {h.frag} without tensors")
    elif h.kind == Kind.CONTROL:
        if h.extra.get("action") not in LEARNER_ACTIONS:
            raise InvalidField(f"CONTROL action {str(h.extra.get('action'))[:40]!r}")
    else:
        raise InvalidField(f"a learner does not take {h.kind.name} messages")
    return None
