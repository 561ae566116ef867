"""Version records: what the object store keeps beside a version's blobs, so that Redis can be
rebuilt from the object store alone (docs/RELIABILITY.md, "Losing Redis altogether").

With blobs in an object store, :meth:`~ddiloco.store.versions.RedisVersions.publish` writes,
after the value and momentum objects and before the compare-and-set of the head, one more
immutable object: ``<run>/f<p>/v<version:012d>-<token>.meta``, a JSON :class:`VersionRecord`
holding everything Redis keeps about that version (the head's fields, the version's meta, both
blob pointers, and the fragment's whole merge ledger as it is once the version is in). The
record is the last object of a version to be written, so a record implies both blobs exist.

Every acknowledged version therefore has a record. The converse does not hold: a publish that
crashed (or lost Redis) between its objects and the compare-and-set leaves a record of a version
that never became the head, and two writers racing for one version (a fenced-out shard and its
successor) both leave one. :func:`plan_fragment` picks one consistent chain of versions out of
what is listed: the newest version with a complete record (ties: the higher epoch, then the later
``updated_at``), then each older kept version by the ``parent`` token the newer one names. Taking
an unacknowledged newest version is safe: it is a complete merge of accepted deltas built on the
chosen parent, its ledger names the deltas in it, and a shard that still holds that round pending
finds its token in the head and applies it (:mod:`ddiloco.workers.syncer.fragment_state`).

Also kept beside the blobs: ``<run>/manifest.json`` (the stored manifest, byte for byte) and
``<run>/f<p>/init.json`` (the initial value's pointer, written by the init step that won it).
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from ddiloco.store.objects import CorruptObject, Pointer

__all__ = [
    "FORMAT",
    "INIT_RECORD",
    "MANIFEST_OBJECT",
    "RECORD_SUFFIX",
    "VersionRecord",
    "init_record_path",
    "manifest_path",
    "plan_fragment",
    "record_path",
]

#: The record format's name and revision, checked on read.
FORMAT = "ddiloco-version/1"
#: Suffix of a version record's object path.
RECORD_SUFFIX = ".meta"
#: Name of the run's manifest object, under the run's folder.
MANIFEST_OBJECT = "manifest.json"
#: Name of a fragment's initial-value pointer object, under the fragment's folder.
INIT_RECORD = "init.json"


def record_path(run_id: str, p: int, version: int, token: str) -> str:
    """Path of version ``version``'s record (beside its ``.value`` and ``.momentum``)."""
    return f"{run_id}/f{p}/v{version:012d}-{token}{RECORD_SUFFIX}"


def manifest_path(run_id: str) -> str:
    """Path of the run's manifest object."""
    return f"{run_id}/{MANIFEST_OBJECT}"


def init_record_path(run_id: str, p: int) -> str:
    """Path of fragment ``p``'s initial-value pointer object."""
    return f"{run_id}/f{p}/{INIT_RECORD}"


@dataclass(frozen=True)
class VersionRecord:
    """One published (or attempted) version of a fragment, as its record object holds it.

    Attributes:
        fragment: fragment index ``p``.
        version: the version number (>= 0).
        epoch: the writer's shard epoch.
        updated_at: wall-clock seconds of the publish.
        token: the publish's write token (also in the object paths and, once acknowledged, in
            the head).
        parent: the token of version ``version - 1`` this one was built on ("" for version 0).
        keep: how many newest versions the writer kept readable (>= 1).
        meta: the version's JSON meta, as given to the publish.
        value, momentum: pointers to the version's two blob objects.
        ledger: the fragment's merge ledger once this version is in:
            ``"<learner>:<incarnation>"`` -> the highest wire sequence number merged.
    """

    fragment: int
    version: int
    epoch: int
    updated_at: float
    token: str
    parent: str
    keep: int
    meta: dict[str, Any]
    value: Pointer
    momentum: Pointer
    ledger: dict[str, int] = field(default_factory=dict)

    def encode(self) -> bytes:
        """The record's object bytes (JSON, sorted keys)."""
        return json.dumps({
            "format": FORMAT, "fragment": self.fragment, "version": self.version,
            "epoch": self.epoch, "updated_at": self.updated_at, "token": self.token,
            "parent": self.parent, "keep": self.keep, "meta": self.meta,
            "value": _ptr(self.value), "momentum": _ptr(self.momentum),
            "ledger": self.ledger,
        }, sort_keys=True).encode()

    @staticmethod
    def decode(raw: bytes, path: str) -> VersionRecord:
        """The record in ``raw``, read from ``path``.

        Raises:
            CorruptObject: not JSON, another format, a missing or mistyped field, or fields
                that disagree with the object's path.
        """
        try:
            d = json.loads(raw)
            if d.get("format") != FORMAT:
                raise ValueError(f"format {d.get('format')!r}, expected {FORMAT!r}")
            rec = VersionRecord(
                fragment=int(d["fragment"]), version=int(d["version"]), epoch=int(d["epoch"]),
                updated_at=float(d["updated_at"]), token=str(d["token"]),
                parent=str(d["parent"]), keep=int(d["keep"]), meta=dict(d["meta"]),
                value=Pointer(**d["value"]), momentum=Pointer(**d["momentum"]),
                ledger={str(k): int(v) for k, v in dict(d["ledger"]).items()})
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise CorruptObject(f"version record {path}: {exc}") from None
        if not path.endswith(f"/f{rec.fragment}/v{rec.version:012d}-{rec.token}{RECORD_SUFFIX}"):
            raise CorruptObject(f"version record {path}: names fragment {rec.fragment} version "
                                f"{rec.version} token {rec.token}, which its path does not")
        if rec.version < 0 or rec.keep < 1:
            raise CorruptObject(f"version record {path}: version {rec.version} or keep "
                                f"{rec.keep} out of range")
        return rec

    @property
    def complete_in(self) -> tuple[str, str]:
        """The two blob paths the record needs to be usable."""
        return self.value.path, self.momentum.path


def _ptr(p: Pointer) -> dict[str, Any]:
    return {"path": p.path, "size": p.size, "crc32c": p.crc32c}


def plan_fragment(records: Iterable[VersionRecord],
                  present: Mapping[str, object] | set[str]) -> list[VersionRecord]:
    """The versions a rebuilt Redis keeps for one fragment, newest first (module docstring).

    Args:
        records: every readable record listed for the fragment.
        present: the object paths that exist (a record whose blobs are not both here is
            skipped: its publish crashed mid-way, or garbage collection removed them).

    Returns:
        The newest usable version and then the older ones it descends from (by ``parent``
        token), at most the newest one's ``keep`` versions and stopping at the first missing
        link; empty when no record is usable.
    """
    usable = [r for r in records if all(p in present for p in r.complete_in)]
    if not usable:
        return []
    newest = max(usable, key=lambda r: (r.version, r.epoch, r.updated_at, r.token))
    by_key = {(r.version, r.token): r for r in usable}
    chain = [newest]
    while len(chain) < newest.keep:
        cur = chain[-1]
        parent = by_key.get((cur.version - 1, cur.parent))
        if cur.version == 0 or parent is None:
            break
        chain.append(parent)
    return chain
