"""Failpoints: make one store or object-store call fail at a chosen place, in a real process.

Every method of the store protocols (:mod:`ddiloco.store.base`) is a point named
``store.<method>`` (``store.publish``, ``store.add_event``, ...), a batch's ``execute`` is
``store.execute``, and the object store's calls are ``objects.put``, ``objects.get``,
``objects.get_many``, ``objects.delete`` and ``objects.list``. Each point has three places:

* ``before``: the call raises :class:`FailpointFired` (a ``StoreUnavailable``) and does nothing;
* ``after-effect``: the call runs and takes effect, then its reply is lost: the caller gets
  :class:`FailpointFired`, as when a connection drops after the server executed a command;
* ``after``: the call runs and the caller gets its reply; then the store goes down for the
  process's next store call, whichever it is (it raises before taking effect).

Points are armed by the environment variable :data:`ENV` (or :func:`arm` in tests) with a spec
``[WORKER/]POINT=PLACE[:COUNT][@NTH]``, several separated by ``,``: ``COUNT`` is ``once`` (the
default), a number of firings or ``always``; ``@NTH`` lets the first ``NTH - 1`` calls of the
point pass (``store.publish=after-effect:once@3`` fails the third publish once); ``WORKER/``
arms it in that worker only (``shard-0/store.publish=...``), else in every worker process. A
network peer cannot arm them: only the process's own environment or configuration does.

Zero cost when unarmed: :func:`with_failpoints` returns the store itself, unwrapped.

Errors: :class:`UnknownFailpoint` (a ``ConfigError``) names an unknown point or place with the
list of valid ones.
"""

from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any, TypeVar

from ddiloco.pipeline.errors import ConfigError, StoreUnavailable
from ddiloco.store.base import MembershipStore, RunStore, TelemetryStore, VersionStore

__all__ = [
    "ENV",
    "OBJECT_POINTS",
    "PLACES",
    "POINTS",
    "STORE_POINTS",
    "Arm",
    "FailpointFired",
    "Failpoints",
    "UnknownFailpoint",
    "arm",
    "from_env",
    "parse",
    "with_failpoints",
]

log = logging.getLogger("ddiloco.failpoints")

#: The environment variable a process reads its armed failpoints from.
ENV = "DDILOCO_FAILPOINTS"
#: Where a point can fail (module docstring).
PLACES = ("before", "after-effect", "after")


def _protocol_methods() -> tuple[str, ...]:
    names: set[str] = set()
    for proto in (RunStore, VersionStore, MembershipStore, TelemetryStore):
        for name, value in vars(proto).items():
            if not name.startswith("_") and callable(value) and not isinstance(value, property):
                names.add(name)
    names.discard("pipeline")  # a batch fails at its execute (store.execute)
    return tuple(sorted(names))


#: Points on store calls: one per method of the store protocols, and a batch's execute.
STORE_POINTS = tuple(f"store.{m}" for m in (*_protocol_methods(), "execute"))
#: Points on object-store calls (blobs in files or S3, :mod:`ddiloco.store.objects`).
OBJECT_POINTS = tuple(f"objects.{m}" for m in ("put", "get", "get_many", "delete", "list"))
#: Every point.
POINTS = STORE_POINTS + OBJECT_POINTS


class UnknownFailpoint(ConfigError):
    """A failpoint spec names an unknown point or place, or is malformed."""


class FailpointFired(StoreUnavailable):
    """An armed failpoint made a store call fail (a ``StoreUnavailable``: callers take it as
    an outage)."""


@dataclass
class Arm:
    """One armed point.

    Attributes:
        point: the point's name (:data:`POINTS`).
        worker: the worker it is armed in (None: every worker).
        place: ``before``, ``after-effect`` or ``after``.
        times: firings left; -1 for ``always``.
        skip: calls of the point that pass before the first firing.
    """

    point: str
    place: str
    times: int = 1
    skip: int = 0
    worker: str | None = None


def parse(spec: str) -> list[Arm]:
    """The arms of a spec ``[WORKER/]POINT=PLACE[:COUNT][@NTH][,...]`` (module docstring).

    Raises:
        UnknownFailpoint: an unknown point or place, or a malformed count.
    """
    arms = []
    for item in (s.strip() for s in spec.replace(";", ",").split(",")):
        if not item:
            continue
        point, sep, rest = item.partition("=")
        worker, slash, point = point.strip().rpartition("/")
        point = point.strip()
        if point not in POINTS:
            raise UnknownFailpoint(f"unknown failpoint {point!r}; the points are: "
                                   f"{', '.join(POINTS)}")
        if not sep:
            raise UnknownFailpoint(f"failpoint {item!r}: write {point}=PLACE[:COUNT][@NTH] "
                                   f"with PLACE one of {', '.join(PLACES)}")
        rest, _, nth = rest.partition("@")
        place, _, count = rest.partition(":")
        place = place.strip()
        if place not in PLACES:
            raise UnknownFailpoint(f"failpoint {point}: unknown place {place!r}; the places "
                                   f"are {', '.join(PLACES)}")
        times = _count(point, count.strip() or "once")
        skip = 0
        if nth:
            if not nth.strip().isdigit() or int(nth) < 1:
                raise UnknownFailpoint(f"failpoint {point}: @{nth} must be a call number >= 1")
            skip = int(nth) - 1
        arms.append(Arm(point, place, times, skip, worker.strip() if slash else None))
    return arms


def _count(point: str, text: str) -> int:
    if text == "once":
        return 1
    if text == "always":
        return -1
    if text.isdigit() and int(text) >= 1:
        return int(text)
    raise UnknownFailpoint(f"failpoint {point}: count {text!r} must be once, always or a "
                           "number >= 1")


class Failpoints:
    """The armed points of one process, thread-safe.

    Args:
        arms: what :func:`parse` returned.
    """

    def __init__(self, arms: Iterable[Arm]) -> None:
        self.arms: dict[str, list[Arm]] = {}
        for a in arms:
            self.arms.setdefault(a.point, []).append(a)
        self._lock = threading.Lock()
        self._down_next = 0
        #: how often each ``point:place`` fired
        self.fired: dict[str, int] = {}

    def __bool__(self) -> bool:
        return bool(self.arms)

    def describe(self) -> str:
        """The armed points, as a spec."""
        out = []
        for arms in self.arms.values():
            for a in arms:
                who = f"{a.worker}/" if a.worker else ""
                count = "always" if a.times < 0 else str(a.times)
                nth = f"@{a.skip + 1}" if a.skip else ""
                out.append(f"{who}{a.point}={a.place}:{count}{nth}")
        return ",".join(out)

    def _take(self, point: str) -> str | None:
        """The place at which this call of ``point`` fails, or None; counts the call."""
        with self._lock:
            if self._down_next > 0:
                self._down_next -= 1
                self._fired(point, "down")
                return "down"
            for a in self.arms.get(point, ()):
                if a.skip > 0:
                    a.skip -= 1
                    continue
                if a.times == 0:
                    continue
                if a.times > 0:
                    a.times -= 1
                self._fired(point, a.place)
                return a.place
        return None

    def _fired(self, point: str, place: str) -> None:
        key = f"{point}:{place}"
        self.fired[key] = self.fired.get(key, 0) + 1
        log.warning("failpoint %s fired", key)

    def call(self, point: str, fn: Callable[[], Any]) -> Any:
        """Run ``fn`` (the call at ``point``) with the point's failure, if armed.

        Raises:
            FailpointFired: the point fired here.
        """
        place = self._take(point)
        if place is None:
            return fn()
        if place in ("before", "down"):
            raise FailpointFired(f"failpoint {point}={place}: the store call did not run")
        result = fn()
        if place == "after-effect":
            raise FailpointFired(f"failpoint {point}=after-effect: the call took effect, its "
                                 "reply was lost")
        with self._lock:  # "after": the reply reaches the caller, the next call fails
            self._down_next += 1
        return result


class _Wrapped:
    """A proxy that sends the named methods of ``inner`` through ``fps``; everything else
    (attributes, properties) is ``inner``'s own."""

    def __init__(self, inner: Any, fps: Failpoints, prefix: str, names: Iterable[str]) -> None:
        self._inner = inner
        self._fps = fps
        self._prefix = prefix
        self._names = frozenset(names)

    def __getattr__(self, name: str) -> Any:
        attr = getattr(self._inner, name)
        if name not in self._names or not callable(attr):
            return attr
        point = f"{self._prefix}.{name}"

        def call(*args: Any, **kwargs: Any) -> Any:
            if kwargs.get("pipe") is not None:
                return attr(*args, **kwargs)  # queued: it fails, if at all, at store.execute
            return self._fps.call(point, lambda: attr(*args, **kwargs))

        return call

    def __repr__(self) -> str:
        return f"Failpoints({self._inner!r})"


class _Store(_Wrapped):
    def pipeline(self) -> Any:
        return _Wrapped(self._inner.pipeline(), self._fps, "store", ["execute"])


S = TypeVar("S")


def with_failpoints(store: S, fps: Failpoints | None = None, worker: str | None = None) -> S:
    """``store`` with its calls sent through the armed failpoints (``fps``, else those
    :data:`ENV` arms for ``worker``); ``store`` itself when nothing is armed. The object
    store behind it (blobs in files or S3) is wrapped too, through the store's
    ``object_wrapper`` hook.

    Raises:
        UnknownFailpoint: the environment's spec names an unknown point or place.
    """
    fps = from_env(worker=worker) if fps is None else fps
    if not fps:
        return store
    log.warning("failpoints armed: %s", fps.describe())
    if hasattr(store, "object_wrapper"):
        store.object_wrapper = lambda objs: _Wrapped(  # type: ignore[attr-defined]
            objs, fps, "objects", [p.split(".", 1)[1] for p in OBJECT_POINTS])
    names = [p.split(".", 1)[1] for p in STORE_POINTS]
    wrapped: Any = _Store(store, fps, "store", names)
    return wrapped  # type: ignore[no-any-return]


def from_env(environ: dict[str, str] | None = None, worker: str | None = None) -> Failpoints:
    """The failpoints :data:`ENV` arms in ``worker`` (those naming no worker, and those
    naming it); none when it is unset or empty.

    Raises:
        UnknownFailpoint: as :func:`parse`.
    """
    spec = (os.environ if environ is None else environ).get(ENV, "")
    return Failpoints(a for a in parse(spec) if a.worker is None or a.worker == worker)


def arm(spec: str) -> Failpoints:
    """Failpoints from a spec string (:func:`parse`), for tests and the chaos runner."""
    return Failpoints(parse(spec))
