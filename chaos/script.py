"""Declarative, seeded fault scripts shared by the chaos runner and the integration tests.

A script is a YAML file: an explicit timeline of faults plus optional stochastic entries whose
arrivals are drawn from a seeded RNG. :func:`load_script` validates it into a
:class:`FaultScript`; :func:`expand` turns that into the concrete, time-sorted list of
:class:`FaultAction` that a runner executes. All times are seconds from the start of the run.

Format (every field in docs/CHAOS.md; durations are seconds or strings such as ``"40s"``,
``"1.5m"``, ``"500ms"``)::

    name: poisson-kill-storm          # required
    seed: 7                           # default 0
    duration_s: 150                   # required: length of the chaos run
    faults:                           # explicit timeline: kill (+ down, restart), pause (+ for),
      - {at: 40s, kill: learner-2, down: 15s}     # slow (+ factor), partition and congest
      - {at: 50s, partition: learner-0, from: syncers, for: 10s}   # (+ from: syncers | redis)
      - {at: 90s, kill: blobs, down: 5s}          # the object-store server
    stochastic:                       # seeded arrivals per target
      - {targets: learners, fault: kill, mtbf: 60s, start: 10s, max_concurrent: 2,
         repair: {dist: uniform, min: 10s, max: 20s}}   # or exponential, weibull, fixed
    failpoints: "shard-0/store.publish=after-effect:2@5"   # store calls that fail

Targets are ``learner-<i>``, ``shard-<i>``, ``redis`` and ``blobs`` (the object-store server
that holds the fragment blobs); the groups ``learners`` and ``shards`` are allowed in stochastic
entries only. Kill and pause apply to every target; slow, partition and congest to learners and
shards only. Congest needs emulated regions (``--regions``): it saturates the links between the
target's region and the peer's, both ways.

A script holds no configuration: faults on ``blobs`` need a run whose blobs live in the object
store the runner starts and can kill, ``--set store.blobs=embedded-s3`` (a local run, without
``--regions``), or a compose project with a ``blobs`` service.

Every problem raises :class:`ScriptError` naming the file, the field path and the problem, e.g.
``gentle.yaml: faults[2].at: '4O s' is not a duration``.
"""

from __future__ import annotations

import math
import re
from collections import Counter
from dataclasses import dataclass
from enum import Enum
from pathlib import Path
from typing import Annotated, Any, Literal, TypeVar

import numpy as np
from pydantic import (
    AfterValidator,
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    model_validator,
)

from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.run.specfile import (
    Duration,
    FieldProblem,
    PositiveDuration,
    parse_duration,
    read_yaml,
    validate_model,
)

__all__ = [
    "SCRIPTS_DIR",
    "SERVICES",
    "FaultAction",
    "FaultKind",
    "FaultScript",
    "RepairSpec",
    "ScriptError",
    "StochasticFault",
    "TimelineFault",
    "describe",
    "expand",
    "load_script",
    "parse_duration",
    "parse_script",
]

SCRIPTS_DIR = Path(__file__).resolve().parent / "scripts"
"""Directory of the fault scripts shipped with ddiloco (``gentle.yaml``, ``ci-short.yaml``...)."""

_TIME_DECIMALS = 3  # stochastic times are rounded to the millisecond


_M = TypeVar("_M", bound=BaseModel)


class ScriptError(ConfigError):
    """A fault script is unreadable or invalid; the message names the file and the field."""


class FaultKind(str, Enum):
    """What a fault does to its target."""

    KILL = "kill"
    PAUSE = "pause"
    SLOW = "slow"
    PARTITION = "partition"
    CONGEST = "congest"
    WIPE = "wipe"


Peer = Literal["syncers", "redis"]
_KINDS: tuple[str, ...] = tuple(k.value for k in FaultKind)
_GROUPS = ("learners", "shards")
#: Targets that are servers of the run rather than workers: never gang-failed, never supervised.
SERVICES = ("redis", "blobs")
_TARGET_RE = re.compile(r"^(?:(learner|shard)-(0|[1-9][0-9]*)|redis|blobs)$")


# --------------------------------------------------------------------------------------------
# Durations and targets
# --------------------------------------------------------------------------------------------

def _check_target(target: str, kind: FaultKind, groups_ok: bool) -> None:
    """Raise ValueError when ``target`` is malformed or ``kind`` does not apply to it."""
    if target in _GROUPS:
        if not groups_ok:
            raise ValueError(
                f"group {target!r} is allowed in stochastic entries only; "
                f"name one target such as '{target[:-1]}-0'"
            )
    elif not _TARGET_RE.match(target):
        raise ValueError(
            f"{target!r} is not a target (learner-<i>, shard-<i>, redis, blobs"
            + (", learners, shards)" if groups_ok else ")")
        )
    if target in SERVICES and kind in (FaultKind.SLOW, FaultKind.PARTITION, FaultKind.CONGEST):
        raise ValueError(f"{kind.value} applies to learners and shards, not {target}")
    if kind is FaultKind.WIPE and target != "redis":
        raise ValueError(f"wipe applies to redis only, not {target}")


def _check_factor(value: float) -> float:
    if not (math.isfinite(value) and value > 1):
        raise ValueError(f"must be a slowdown factor > 1, got {value}")
    return value


Factor = Annotated[float, AfterValidator(_check_factor)]
"""A slowdown factor > 1 (1.0 is full speed)."""


def _fmt_s(seconds: float) -> str:
    return "inf" if math.isinf(seconds) else f"{seconds:g} s"


def _overlaps(a0: float, a1: float, b0: float, b1: float) -> bool:
    """Whether [a0, a1) and [b0, b1) share time; zero-length faults occupy their instant."""
    return a0 == b0 or (a0 < b1 and b0 < a1)


# --------------------------------------------------------------------------------------------
# The file format
# --------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


_TIMELINE_KEYS: dict[FaultKind, tuple[str, ...]] = {
    FaultKind.KILL: ("down", "restart"),
    FaultKind.PAUSE: ("for",),
    FaultKind.SLOW: ("factor", "for"),
    FaultKind.PARTITION: ("from", "for"),
    FaultKind.CONGEST: ("from", "for"),
    FaultKind.WIPE: ("down",),
}
_TIMELINE_REQUIRED: dict[FaultKind, tuple[str, ...]] = {
    FaultKind.KILL: (),
    FaultKind.PAUSE: ("for",),
    FaultKind.SLOW: ("factor",),
    FaultKind.PARTITION: ("from", "for"),
    FaultKind.CONGEST: ("from", "for"),
    FaultKind.WIPE: (),
}
_ALL_TIMELINE_KEYS = frozenset({"at", *_KINDS, *(k for ks in _TIMELINE_KEYS.values() for k in ks)})


class TimelineFault(_Strict):
    """One explicit fault: ``{at: 40s, kill: learner-2, down: 15s}`` and the like.

    Exactly one of ``kill``, ``pause``, ``slow``, ``partition``, ``congest``, ``wipe`` names the
    target.
    """

    at: Duration = Field(description="seconds from run start")
    kill: str | None = None
    pause: str | None = None
    slow: str | None = None
    partition: str | None = None
    congest: str | None = None
    wipe: str | None = None
    down: Duration | None = Field(default=None,
                                  description="kill, wipe: seconds before restart")
    restart: bool = Field(default=True, description="kill: false keeps the target dead")
    for_: PositiveDuration | None = Field(
        default=None, alias="for",
        description="pause/partition/congest/slow: seconds until healed",
    )
    factor: Factor | None = Field(default=None, description="slow: slowdown factor > 1")
    from_: Peer | None = Field(
        default=None, alias="from", description="partition/congest: peer"
    )

    @model_validator(mode="before")
    @classmethod
    def _shape(cls, data: Any) -> Any:
        if not isinstance(data, dict):
            return data
        kinds = [k for k in _KINDS if k in data]
        if not kinds:
            unknown = [str(k) for k in data if k not in _ALL_TIMELINE_KEYS]
            if unknown:
                raise FieldProblem(
                    f"unknown fault {unknown[0]!r} (one of {', '.join(_KINDS)})", at=unknown[0]
                )
            raise FieldProblem(f"no fault given (one of {', '.join(_KINDS)})")
        if len(kinds) > 1:
            raise FieldProblem(f"one fault per entry, got {' and '.join(kinds)}", at=kinds[1])
        kind = FaultKind(kinds[0])
        allowed = ("at", kind.value, *_TIMELINE_KEYS[kind])
        for key in data:
            if key not in allowed:
                problem = "unknown key" if key not in _ALL_TIMELINE_KEYS else (
                    f"not allowed with {kind.value}"
                )
                raise FieldProblem(f"{problem} (allowed: {', '.join(allowed)})", at=str(key))
        for key in _TIMELINE_REQUIRED[kind]:
            if key not in data:
                raise FieldProblem(f"required with {kind.value}", at=key)
        if kind is FaultKind.KILL and data.get("restart") is False and "down" in data:
            raise FieldProblem("has no meaning with restart: false", at="down")
        return data

    @model_validator(mode="after")
    def _target(self) -> TimelineFault:
        try:
            _check_target(self.target, self.kind, groups_ok=False)
        except ValueError as exc:
            raise FieldProblem(str(exc), at=self.kind.value) from None
        return self

    @property
    def kind(self) -> FaultKind:
        """The fault kind given by the key that names the target."""
        for kind in FaultKind:
            if getattr(self, kind.value) is not None:
                return kind
        raise AssertionError("validated TimelineFault without a kind")

    @property
    def target(self) -> str:
        """The concrete target, e.g. ``learner-2``."""
        value = getattr(self, self.kind.value)
        assert isinstance(value, str)
        return value

    @property
    def duration_s(self) -> float | None:
        """Seconds until heal/restart; None for a kill without restart or a persistent slow."""
        if self.kind is FaultKind.KILL:
            return (self.down or 0.0) if self.restart else None
        if self.kind is FaultKind.WIPE:
            return self.down or 0.0
        return self.for_

    @property
    def end_s(self) -> float:
        """Seconds from run start when the fault is over (``inf`` when it never is)."""
        duration = self.duration_s
        return math.inf if duration is None else self.at + duration


_REPAIR_KEYS: dict[str, tuple[str, ...]] = {
    "exponential": ("mean",),
    "weibull": ("shape", "scale"),
    "uniform": ("min", "max"),
    "fixed": ("value",),
}


class RepairSpec(_Strict):
    """Distribution of a stochastic fault's length (kill: seconds down before the restart)."""

    dist: Literal["exponential", "weibull", "uniform", "fixed"]
    mean: PositiveDuration | None = Field(default=None, description="exponential, seconds")
    shape: float | None = Field(default=None, gt=0, description="weibull shape k")
    scale: PositiveDuration | None = Field(default=None, description="weibull scale, seconds")
    min_: Duration | None = Field(default=None, alias="min", description="uniform, seconds")
    max_: Duration | None = Field(default=None, alias="max", description="uniform, seconds")
    value: Duration | None = Field(default=None, description="fixed, seconds")

    @model_validator(mode="before")
    @classmethod
    def _shape_keys(cls, data: Any) -> Any:
        if not isinstance(data, dict) or data.get("dist") not in _REPAIR_KEYS:
            return data
        dist = data["dist"]
        allowed = ("dist", *_REPAIR_KEYS[dist])
        for key in data:
            if key not in allowed:
                raise FieldProblem(f"not allowed with dist {dist} (allowed: {', '.join(allowed)})",
                               at=str(key))
        for key in _REPAIR_KEYS[dist]:
            if key not in data:
                raise FieldProblem(f"required with dist {dist}", at=key)
        return data

    @model_validator(mode="after")
    def _bounds(self) -> RepairSpec:
        if self.dist == "uniform":
            assert self.min_ is not None and self.max_ is not None
            if self.max_ < self.min_:
                raise FieldProblem(f"must be >= min ({_fmt_s(self.min_)}), got {_fmt_s(self.max_)}",
                               at="max")
        return self

    @property
    def mean_s(self) -> float:
        """Mean length in seconds."""
        if self.dist == "exponential":
            assert self.mean is not None
            return self.mean
        if self.dist == "weibull":
            assert self.scale is not None and self.shape is not None
            return self.scale * math.gamma(1.0 + 1.0 / self.shape)
        if self.dist == "uniform":
            assert self.min_ is not None and self.max_ is not None
            return (self.min_ + self.max_) / 2.0
        assert self.value is not None
        return self.value

    def sample(self, rng: np.random.Generator) -> float:
        """Draw one length in seconds (always consumes exactly one draw of ``rng``)."""
        if self.dist == "exponential":
            assert self.mean is not None
            return float(rng.exponential(self.mean))
        if self.dist == "weibull":
            assert self.scale is not None and self.shape is not None
            return float(self.scale * rng.weibull(self.shape))
        if self.dist == "uniform":
            assert self.min_ is not None and self.max_ is not None
            return float(rng.uniform(self.min_, self.max_))
        rng.random()
        assert self.value is not None
        return self.value


def _targets_input(value: Any) -> Any:
    if isinstance(value, str):
        return value
    if isinstance(value, (list, tuple)) and value and all(isinstance(v, str) for v in value):
        return tuple(value)
    raise ValueError(
        "must be 'learners', 'shards', a target name or a non-empty list of target names, "
        f"got {value!r}"
    )


class StochasticFault(_Strict):
    """A seeded fault process: per target, exponential arrivals with mean ``mtbf`` seconds."""

    targets: Annotated[str | tuple[str, ...], BeforeValidator(_targets_input)]
    fault: FaultKind
    mtbf: PositiveDuration = Field(description="per-target mean time between failures, seconds")
    repair: RepairSpec
    start: Duration = Field(default=0.0, description="no faults before this, seconds")
    max_concurrent: int | None = Field(default=None, ge=1)
    factor: Factor | None = Field(default=None, description="slow: slowdown factor > 1")
    from_: Peer | None = Field(
        default=None, alias="from", description="partition/congest: peer"
    )

    @model_validator(mode="after")
    def _consistent(self) -> StochasticFault:
        if self.fault is FaultKind.WIPE:
            raise FieldProblem("wipe is a timeline fault only (one loss of Redis, at a "
                               "chosen time)", at="fault")
        if self.fault is FaultKind.SLOW and self.factor is None:
            raise FieldProblem("required with fault: slow", at="factor")
        if self.fault is not FaultKind.SLOW and self.factor is not None:
            raise FieldProblem(f"not allowed with fault: {self.fault.value}", at="factor")
        with_peer = (FaultKind.PARTITION, FaultKind.CONGEST)
        if self.fault in with_peer and self.from_ is None:
            raise FieldProblem(f"required with fault: {self.fault.value}", at="from")
        if self.fault not in with_peer and self.from_ is not None:
            raise FieldProblem(f"not allowed with fault: {self.fault.value}", at="from")
        names = (self.targets,) if isinstance(self.targets, str) else self.targets
        seen: set[str] = set()
        for i, name in enumerate(names):
            at = "targets" if isinstance(self.targets, str) else f"targets[{i}]"
            if name in seen:
                raise FieldProblem(f"{name!r} is listed twice", at=at)
            seen.add(name)
            if name in _GROUPS and not isinstance(self.targets, str):
                raise FieldProblem(f"group {name!r} cannot be part of a list", at=at)
            try:
                _check_target(name, self.fault, groups_ok=True)
            except ValueError as exc:
                raise FieldProblem(str(exc), at=at) from None
        return self


def _none_is_empty(value: Any) -> Any:
    return () if value is None else value


class FaultScript(_Strict):
    """A parsed, validated fault script (see the module docstring for the file format)."""

    name: str = Field(min_length=1)
    description: str | None = None
    seed: int = Field(default=0, ge=0)
    duration_s: PositiveDuration = Field(description="length of the chaos run, seconds")
    faults: Annotated[tuple[TimelineFault, ...], BeforeValidator(_none_is_empty)] = ()
    stochastic: Annotated[tuple[StochasticFault, ...], BeforeValidator(_none_is_empty)] = ()
    #: failpoints the run's workers arm (``[WORKER/]POINT=PLACE[:COUNT][@NTH],...``,
    #: :mod:`ddiloco.store.failpoints`); a restarted worker arms them again
    failpoints: str | None = None

    _source: str = PrivateAttr(default="<script>")

    @model_validator(mode="after")
    def _failpoints(self) -> FaultScript:
        if self.failpoints:
            from ddiloco.store.failpoints import UnknownFailpoint, parse

            try:
                parse(self.failpoints)
            except UnknownFailpoint as exc:
                raise FieldProblem(str(exc), at="failpoints") from None
        return self

    @model_validator(mode="after")
    def _timeline(self) -> FaultScript:
        for i, fault in enumerate(self.faults):
            if fault.at >= self.duration_s:
                raise FieldProblem(
                    f"{_fmt_s(fault.at)} is not before duration_s ({_fmt_s(self.duration_s)})",
                    at=f"faults[{i}].at",
                )
        for i, entry in enumerate(self.stochastic):
            if entry.start >= self.duration_s:
                raise FieldProblem(
                    f"{_fmt_s(entry.start)} is not before duration_s ({_fmt_s(self.duration_s)})",
                    at=f"stochastic[{i}].start",
                )
        for i, fault in enumerate(self.faults):
            for j in range(i):
                other = self.faults[j]
                if other.target == fault.target and _overlaps(
                    fault.at, fault.end_s, other.at, other.end_s
                ):
                    raise FieldProblem(
                        f"{fault.kind.value} of {fault.target} at {_fmt_s(fault.at)} overlaps "
                        f"faults[{j}] ({other.kind.value} from {_fmt_s(other.at)} to "
                        f"{_fmt_s(other.end_s)}); faults on one target must not overlap",
                        at=f"faults[{i}]",
                    )
        return self

    @property
    def source(self) -> str:
        """Where the script came from (a file path, or the ``source`` given to parse_script)."""
        return self._source


# --------------------------------------------------------------------------------------------
# Loading
# --------------------------------------------------------------------------------------------


def parse_script(data: dict[str, Any], source: str = "<script>") -> FaultScript:
    """Validate a mapping (the content of a script file) into a :class:`FaultScript`.

    Args:
        data: the parsed YAML.
        source: name used in error messages and kept as ``FaultScript.source``.

    Raises:
        ScriptError: ``"<source>: <field path>: <problem>"`` for every invalid field.
    """
    script = validate_model(FaultScript, data, source, ScriptError)
    script._source = source
    return script


def load_script(path: Path | str) -> FaultScript:
    """Read and validate a YAML fault script.

    Raises:
        ScriptError: missing or unreadable file, malformed YAML, or any invalid field (the
            message names the file and the field path).
    """
    return parse_script(read_yaml(path, ScriptError, "fault script"), source=str(path))


# --------------------------------------------------------------------------------------------
# Expansion into concrete actions
# --------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class FaultAction:
    """One concrete fault for a runner to inject.

    Attributes:
        id: stable identifier: ``f<index>-<kind>-<target>`` for the timeline entry ``index``,
            ``s<entry>.<n>-<kind>-<target>`` for the ``n``-th draw of stochastic entry ``entry``
            on that target.
        at_s: seconds from run start.
        kind: what to do.
        target: concrete target (``learner-2``, ``shard-0``, ``redis``, ``blobs``).
        duration_s: kill: seconds down before the restart (None: never restart); wipe:
            seconds down before the rebuild;
            pause/partition/congest: seconds until healed; slow: seconds until healed, None =
            persistent.
        factor: slow only: slowdown factor (> 1).
        peer: partition and congest only: ``"syncers"`` or ``"redis"``.
        source: ``"timeline"`` or ``"stochastic[<i>]"``.
    """

    id: str
    at_s: float
    kind: FaultKind
    target: str
    duration_s: float | None
    factor: float | None = None
    peer: str | None = None
    source: str = "timeline"

    @property
    def end_s(self) -> float | None:
        """Seconds from run start when the target heals or restarts; None when it never does."""
        return None if self.duration_s is None else self.at_s + self.duration_s

    def to_json(self) -> dict[str, Any]:
        """JSON-able dict of every field plus ``end_s`` (read back by :meth:`from_json`)."""
        return {
            "id": self.id,
            "at_s": self.at_s,
            "kind": self.kind.value,
            "target": self.target,
            "duration_s": self.duration_s,
            "factor": self.factor,
            "peer": self.peer,
            "source": self.source,
            "end_s": self.end_s,
        }

    @classmethod
    def from_json(cls, data: dict[str, Any]) -> FaultAction:
        """Inverse of :meth:`to_json` (``end_s`` is derived, so it is ignored)."""

        def opt(key: str) -> float | None:
            value = data.get(key)
            return None if value is None else float(value)

        return cls(
            id=str(data["id"]),
            at_s=float(data["at_s"]),
            kind=FaultKind(data["kind"]),
            target=str(data["target"]),
            duration_s=opt("duration_s"),
            factor=opt("factor"),
            peer=None if data.get("peer") is None else str(data["peer"]),
            source=str(data.get("source", "timeline")),
        )


def _check_in_range(target: str, learners: int, shards: int, where: str) -> None:
    match = _TARGET_RE.match(target)
    if match is None or match.group(1) is None:
        return  # redis, blobs
    role, index = match.group(1), int(match.group(2))
    count = learners if role == "learner" else shards
    if index >= count:
        have = f"no {role}s" if count == 0 else (
            f"{count} {role}{'s' if count != 1 else ''} ({role}-0 .. {role}-{count - 1})"
        )
        raise ScriptError(f"{where}: {target} is out of range: the run has {have}")


def _resolve(entry: StochasticFault, learners: int, shards: int, where: str) -> list[str]:
    if entry.targets == "learners":
        return [f"learner-{i}" for i in range(learners)]
    if entry.targets == "shards":
        return [f"shard-{i}" for i in range(shards)]
    if isinstance(entry.targets, str):
        _check_in_range(entry.targets, learners, shards, f"{where}.targets")
        return [entry.targets]
    for i, name in enumerate(entry.targets):
        _check_in_range(name, learners, shards, f"{where}.targets[{i}]")
    return list(entry.targets)


def _target_rng(seed: int, entry: int, target: str) -> np.random.Generator:
    """An RNG private to (seed, stochastic entry, target): other targets never shift its draws."""
    return np.random.default_rng(
        np.random.SeedSequence(entropy=seed, spawn_key=(entry, *target.encode()))
    )


def _draw(
    entry: StochasticFault,
    index: int,
    targets: list[str],
    seed: int,
    duration_s: float,
    busy: dict[str, list[tuple[float, float]]],
) -> list[FaultAction]:
    """Draw one stochastic entry's faults over [start, duration_s), in time order."""
    rngs = {t: _target_rng(seed, index, t) for t in targets}
    order = {t: i for i, t in enumerate(targets)}
    counts = dict.fromkeys(targets, 0)
    pending = {
        t: round(entry.start + float(rngs[t].exponential(entry.mtbf)), _TIME_DECIMALS)
        for t in targets
    }
    active: list[tuple[float, float]] = []
    out: list[FaultAction] = []
    while pending:
        target = min(pending, key=lambda t: (pending[t], order[t]))
        at = pending[target]
        if at >= duration_s:
            del pending[target]
            continue
        rng = rngs[target]
        length = round(entry.repair.sample(rng), _TIME_DECIMALS)
        end = at + length
        free = not any(_overlaps(at, end, s, e) for s, e in busy.get(target, ()))
        under_cap = entry.max_concurrent is None or sum(
            1 for s, e in active if s == at or s <= at < e
        ) < entry.max_concurrent
        if free and under_cap:
            counts[target] += 1
            out.append(
                FaultAction(
                    id=f"s{index}.{counts[target]:03d}-{entry.fault.value}-{target}",
                    at_s=at,
                    kind=entry.fault,
                    target=target,
                    duration_s=length,
                    factor=entry.factor,
                    peer=entry.from_,
                    source=f"stochastic[{index}]",
                )
            )
            busy.setdefault(target, []).append((at, end))
            active.append((at, end))
            resume = end  # the next inter-arrival starts when this fault is repaired
        else:
            resume = at  # skipped: move on to the next arrival
        pending[target] = round(resume + float(rng.exponential(entry.mtbf)), _TIME_DECIMALS)
    return out


def expand(
    script: FaultScript, learners: int, shards: int, seed: int | None = None
) -> list[FaultAction]:
    """Turn a script into the concrete, time-sorted actions of one run over [0, duration_s).

    Group targets are resolved with the given counts. Every stochastic target draws from its own
    RNG derived from (seed, entry index, target name), so the same arguments always give the same
    list and adding a target leaves the other targets' draws unchanged. A stochastic target gets
    no new fault while its previous one is active (the next inter-arrival is drawn from the end
    of the repair); a draw that would overlap another fault on its target (explicit, or from an
    earlier entry) or exceed ``max_concurrent`` is skipped and the next arrival is drawn from it.
    Stochastic times are rounded to the millisecond.

    Args:
        script: a validated script.
        learners: number of learners of the run (``learner-0`` .. ``learner-<learners-1>``).
        shards: number of syncer shards (``shard-0`` .. ``shard-<shards-1>``).
        seed: overrides ``script.seed`` when given.

    Returns:
        Actions sorted by ``at_s`` (timeline before stochastic at equal times, then by id).

    Raises:
        ScriptError: a target index out of range, negative counts or a negative seed.
    """
    src = script.source
    for label, count in (("learners", learners), ("shards", shards)):
        if isinstance(count, bool) or not isinstance(count, int) or count < 0:
            raise ScriptError(f"{src}: expand: {label} must be an int >= 0, got {count!r}")
    run_seed = script.seed if seed is None else seed
    if isinstance(run_seed, bool) or not isinstance(run_seed, int) or run_seed < 0:
        raise ScriptError(f"{src}: expand: seed must be an int >= 0, got {run_seed!r}")

    actions: list[FaultAction] = []
    busy: dict[str, list[tuple[float, float]]] = {}
    for i, fault in enumerate(script.faults):
        _check_in_range(fault.target, learners, shards, f"{src}: faults[{i}].{fault.kind.value}")
        actions.append(
            FaultAction(
                id=f"f{i:03d}-{fault.kind.value}-{fault.target}",
                at_s=fault.at,
                kind=fault.kind,
                target=fault.target,
                duration_s=fault.duration_s,
                factor=fault.factor,
                peer=fault.from_,
            )
        )
        busy.setdefault(fault.target, []).append((fault.at, fault.end_s))
    for e, entry in enumerate(script.stochastic):
        targets = _resolve(entry, learners, shards, f"{src}: stochastic[{e}]")
        actions.extend(_draw(entry, e, targets, run_seed, script.duration_s, busy))
    actions.sort(key=lambda a: (a.at_s, a.source != "timeline", a.id))
    return actions


def describe(actions: list[FaultAction]) -> dict[str, int]:
    """Number of actions per kind, in :class:`FaultKind` order, e.g. ``{"kill": 5, "pause": 1}``."""
    counts = Counter(a.kind for a in actions)
    return {kind.value: counts[kind] for kind in FaultKind if counts[kind]}
