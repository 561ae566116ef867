"""Every named error of ddiloco, in one place.

Policy (docs/ARCHITECTURE.md, "Errors"):

* bad configuration -> :class:`ConfigError` (a ``ValueError``) at construction, naming the field;
* transient I/O -> retried with backoff (redis-py ``Retry``), then :class:`StoreUnavailable`;
* a bad, stale or duplicate message -> a :class:`DropError` subclass: the receiver drops the
  message, counts it under ``reason`` and carries on; servers never crash on one;
* shutdown (``KeyboardInterrupt``, ``SystemExit``) is never swallowed: nothing here derives from
  ``BaseException`` directly and handlers catch :class:`DDilocoError`, not ``Exception``.
"""

from __future__ import annotations


class DDilocoError(Exception):
    """Base class of every error raised on purpose by ddiloco."""


class ConfigError(DDilocoError, ValueError):
    """A configuration value is invalid; the message names the field."""


class CorpusUnavailable(DDilocoError):
    """The training corpus could not be fetched or read."""


# --------------------------------------------------------------------------------------------
# Messages that are dropped and counted. ``reason`` is the label used in counters and events.
# --------------------------------------------------------------------------------------------


class DropError(DDilocoError):
    """A message that must be dropped and counted (never applied, never fatal)."""

    reason: str = "bad_message"


class WireError(DropError):
    """A frame that cannot be decoded."""

    reason = "corrupt"


class FrameError(WireError):
    """Wrong number of frames, undecodable header or missing/ill-typed header fields."""

    reason = "corrupt"


class TruncatedFrame(WireError):
    """The payload is shorter than the header declares, or the zstd frame ends early."""

    reason = "truncated"


class OversizedFrame(WireError):
    """A header, payload or decompressed payload exceeds what the manifest allows."""

    reason = "oversized"


class ChecksumMismatch(WireError):
    """The payload checksum or the zstd content checksum does not match."""

    reason = "checksum"


class UnsupportedVersion(WireError):
    """The frame's format version is not one this build speaks."""

    reason = "format_version"


class WrongRun(WireError):
    """The frame belongs to another run id."""

    reason = "wrong_run"


class SchemaMismatch(WireError):
    """Shapes, dtypes, fragment id or codec do not match the run manifest."""

    reason = "schema"


class NonFinite(WireError):
    """The decoded tensors contain NaN or Inf."""

    reason = "nonfinite"


class CodecError(WireError):
    """The payload is not a valid encoding for its codec (bad sizes, bad scales)."""

    reason = "codec"


class StaleDelta(DropError):
    """A delta made against a version older than the kept history (DESIGN §2 step 3)."""

    reason = "stale"


class DuplicateDelta(DropError):
    """A (sender, incarnation, sequence) that was already seen."""

    reason = "duplicate"


class OutOfOrder(DuplicateDelta):
    """An older message of a sender arriving after a newer one: after a reconnect, the old
    connection's backlog is fair-queued with the new one's. Deltas are cumulative, so the
    newer one already superseded it."""

    reason = "out_of_order"


class UnknownSender(DropError):
    """A sender that is not a registered learner of this run."""

    reason = "unknown_sender"


class InvalidField(DropError):
    """A header field out of its range: a negative counter, a non-finite or absurd time, a
    malformed token-fate record, a message kind the receiver does not take."""

    reason = "invalid_field"


class NotOwned(DropError):
    """A message naming a fragment this shard does not own (or the run does not have)."""

    reason = "not_owned"


class MissingPayload(DropError):
    """A message kind that needs tensors (DELTA, GRAD, VERSION, GRAD_AVG) arrived without."""

    reason = "no_payload"


class ImplausibleClaim(DropError):
    """Token counters no learner can produce: more tokens than its batch size times its
    steps, more new tokens than tokens since adoption, more steps since adoption than steps
    in all. Such a header would set its own token weight."""

    reason = "implausible_claim"


class SpoofedSender(DropError):
    """The header's sender is not the identity the connection authenticated as (CURVE)."""

    reason = "spoofed_sender"


class MergeRefused(DropError):
    """A merge whose outer step is not finite or whose update norm is far outside the
    fragment's recent range: the version is not published and the round's contributions are
    dropped."""

    reason = "merge_refused"


class StoreDown(DropError):
    """A check needed the store (an unknown sender's registration) while it was down: the
    message is dropped, counted and recorded when the store is back."""

    reason = "store_unavailable"


class InternalError(DropError):
    """A message that raised an unexpected error in its handler: dropped, counted and logged
    with its traceback, so that no input can stop a server."""

    reason = "internal"


# --------------------------------------------------------------------------------------------
# Store
# --------------------------------------------------------------------------------------------


class WorkerThreadDied(DDilocoError):
    """A thread a worker cannot work without (a learner's comms thread) stopped on an error:
    the process exits non-zero with the cause, so its supervisor restarts it."""


class DeterminismBroken(DDilocoError):
    """A deterministic run (``run.deterministic``) cannot go on as its seed dictates: a round a
    learner waits for did not merge in time. The learner exits non-zero with the cause."""


class StoreError(DDilocoError):
    """Base class of parameter-store errors."""


class StoreUnavailable(StoreError):
    """Redis could not be reached after retrying with backoff."""


class VersionConflict(StoreError):
    """Compare-and-set failed: the fragment's head version is not the expected one."""


class AlreadyMerged(StoreError):
    """A publish would merge a delta the fragment's merge ledger holds already: the round is
    in an earlier version (exactly once, docs/RELIABILITY.md)."""


class FencedOut(StoreError):
    """A writer's epoch is lower than the fragment's: another shard owns it now."""


class ManifestMismatch(StoreError):
    """A worker's run manifest differs from the one stored for the run."""
