"""Wide-area topologies: regions of workers and the links between them (pure, validated).

A topology file names regions, the workers that live in each, and per-link rate, one-way delay,
loss and bottleneck buffer (``queue``)::

    name: four-regions
    defaults: {rate: 100mbit, delay: 0ms, loss: 0%}
    regions:
      hub:  {workers: [redis, shard-0, shard-1, evaluator]}
      us:   {workers: [learner-0]}
      eu:   {workers: [learner-1], rate: 100mbit}
      asia: {workers: [learner-2, learner-3], rate: 10mbit, loss: 0.5%}
    links:               # optional per-pair overrides (symmetric unless `oneway: true`)
      - {from: us, to: eu, rate: 50mbit}

Units: rates in bit/s (``"10mbit"``, ``"1.5gbit"``, ``"64kbit"``; a bare number is bit/s;
k/m/g are powers of 1000), delays in seconds (``"20ms"``, ``"0.1s"``; a bare number is seconds),
loss as a percentage string (``"0.5%"``), queue as seconds of buffer at the link's rate
(``"250ms"``, the default; ``"1s"`` for a bloated buffer).

Resolution of the link ``src -> dst`` (:meth:`Topology.link`), field by field:

1. a ``links`` entry for that pair (``from: src, to: dst``, or ``from: dst, to: src`` unless it
   is ``oneway``) that sets the field;
2. else the values set on the two regions themselves: if only one of them sets the field, that
   value; if both do, the more restrictive one (the lower rate, the longer delay, the higher
   loss, the deeper queue), as a path is as bad as its worse end;
3. else ``defaults`` (which themselves default to 1 gbit, 0 s, 0 %, 250 ms).

Every ordered pair of regions is an independent link: a region with three peers may send at its
link rate to each of them at once (there is no shared access link).

Errors raise :class:`TopologyError` naming the file and the field:
``wan.yaml: regions.asia.rate: '10 mbps' is not a rate (bit/s, or e.g. '10mbit', '1gbit')``.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Annotated, Any

from pydantic import (
    BaseModel,
    BeforeValidator,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from ddiloco.pipeline.errors import ConfigError
from ddiloco.workers.run.specfile import FieldProblem, parse_duration, read_yaml, validate_model

__all__ = [
    "DEFAULT_DELAY_S",
    "DEFAULT_LOSS",
    "DEFAULT_QUEUE_S",
    "DEFAULT_RATE_BPS",
    "LINK_OVERHEAD_SHARE",
    "LINK_SLACK_BYTES",
    "LinkEntry",
    "LinkSettings",
    "LinkSpec",
    "LinkTraffic",
    "Region",
    "Topology",
    "TopologyError",
    "link_traffic",
    "load_topology",
    "parse_loss",
    "parse_rate",
    "parse_topology",
]

DEFAULT_RATE_BPS = 1e9
"""Rate of a link nothing sets, in bit/s (1 gbit)."""
DEFAULT_DELAY_S = 0.0
"""One-way delay of a link nothing sets, in seconds."""
DEFAULT_LOSS = 0.0
"""Loss probability of a link nothing sets (a fraction in [0, 1])."""
DEFAULT_QUEUE_S = 0.25
"""Bottleneck buffer of a link nothing sets, seconds at the link's rate."""

MIN_RATE_BPS = 1e3
"""Lowest rate accepted, in bit/s (1 kbit)."""
MAX_RATE_BPS = 1e11
"""Highest rate accepted, in bit/s (100 gbit)."""

REGION_RE = re.compile(r"^[a-z][a-z0-9-]{0,11}$")
"""Region names: a lowercase letter then up to 11 of ``[a-z0-9-]`` (they become part of
network-namespace and interface names)."""
RESERVED_REGIONS = frozenset({"br"})
"""Names a region may not take (``br`` names the bridge namespace of a run)."""


class TopologyError(ConfigError):
    """A topology file is unreadable or invalid; the message names the file and the field."""


# --------------------------------------------------------------------------------------------
# Units
# --------------------------------------------------------------------------------------------

_RATE_RE = re.compile(
    r"^\s*([0-9]+\.?[0-9]*|\.[0-9]+)(?:[eE]([-+]?[0-9]+))?\s*(kbit|mbit|gbit)?\s*$"
)
_RATE_UNITS = {None: 1.0, "kbit": 1e3, "mbit": 1e6, "gbit": 1e9}
_LOSS_RE = re.compile(r"^\s*([0-9]+\.?[0-9]*|\.[0-9]+)\s*%\s*$")


def parse_rate(value: Any) -> float:
    """Read a rate in bit/s.

    Args:
        value: a number of bit/s, or a string: a number with an optional unit ``kbit``, ``mbit``
            or ``gbit`` (powers of 1000), e.g. ``"100mbit"``, ``"1.5gbit"``.

    Returns:
        The rate in bit/s, within [:data:`MIN_RATE_BPS`, :data:`MAX_RATE_BPS`].

    Raises:
        TopologyError: not a rate, or out of range.
    """
    hint = "(bit/s, or e.g. '10mbit', '1gbit', '64kbit')"
    rate: float
    if isinstance(value, bool):
        raise TopologyError(f"{value!r} is not a rate {hint}")
    if isinstance(value, (int, float)):
        rate = float(value)
    elif isinstance(value, str) and (match := _RATE_RE.match(value.lower())):
        exponent = int(match.group(2)) if match.group(2) else 0
        rate = float(match.group(1)) * 10.0**exponent * _RATE_UNITS[match.group(3)]
    else:
        raise TopologyError(f"{value!r} is not a rate {hint}")
    if not (math.isfinite(rate) and MIN_RATE_BPS <= rate <= MAX_RATE_BPS):
        raise TopologyError(f"rate {value!r} is outside [1kbit, 100gbit]")
    return rate


def parse_loss(value: Any) -> float:
    """Read a loss percentage.

    Args:
        value: a string with a ``%`` sign, e.g. ``"0.5%"``; bare numbers are refused because
            ``0.5`` could mean 0.5 % or 50 %.

    Returns:
        The loss probability as a fraction in [0, 1].

    Raises:
        TopologyError: no ``%`` sign, not a number, or above 100 %.
    """
    if isinstance(value, str) and (match := _LOSS_RE.match(value)):
        percent = float(match.group(1))
        if percent > 100.0:
            raise TopologyError(f"loss {value!r} is above 100%")
        return percent / 100.0
    raise TopologyError(f"{value!r} is not a loss percentage (e.g. '0.5%', '0%')")


def _parse_delay(value: Any) -> float:
    try:
        return parse_duration(value)
    except ConfigError as exc:  # ScriptError: re-worded for this file format
        raise TopologyError(f"{value!r} is not a delay (seconds, or e.g. '20ms', '0.1s')") from (
            exc
        )


Rate = Annotated[float, BeforeValidator(parse_rate)]
"""A rate in bit/s."""
Delay = Annotated[float, BeforeValidator(_parse_delay), Field(ge=0, le=10)]
"""A one-way delay in [0, 10] s (longer would hold too many packets in the delayer)."""
Queue = Annotated[float, BeforeValidator(_parse_delay), Field(gt=0, le=10)]
"""A bottleneck buffer in (0, 10] s at the link's rate."""
Loss = Annotated[float, BeforeValidator(parse_loss)]
"""A loss probability in [0, 1] (written as a percentage)."""


# --------------------------------------------------------------------------------------------
# The file format
# --------------------------------------------------------------------------------------------


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)


class LinkSettings(_Strict):
    """Rate, delay, loss and queue, each optional (unset fields fall through, see the module
    doc)."""

    rate: Rate | None = Field(default=None, description="bit/s")
    delay: Delay | None = Field(default=None, description="one-way delay, seconds")
    loss: Loss | None = Field(default=None, description="loss probability, fraction")
    queue: Queue | None = Field(default=None, description="bottleneck buffer, seconds at rate")


class Region(LinkSettings):
    """A region: the workers that live in it and, optionally, its link settings."""

    workers: tuple[str, ...] = ()

    @field_validator("workers")
    @classmethod
    def _workers(cls, workers: tuple[str, ...]) -> tuple[str, ...]:
        for i, worker in enumerate(workers):
            if not worker.strip():
                raise FieldProblem("a worker name must not be empty", at=f"[{i}]")
            if workers.index(worker) != i:
                raise FieldProblem(f"worker {worker!r} is listed twice", at=f"[{i}]")
        return workers


class LinkEntry(LinkSettings):
    """An override for the link ``from -> to`` (and ``to -> from`` unless ``oneway``)."""

    from_: str = Field(alias="from")
    to: str
    oneway: bool = False

    @model_validator(mode="after")
    def _some_setting(self) -> LinkEntry:
        if self.from_ == self.to:
            raise FieldProblem(f"a link joins two different regions, got {self.to!r} twice",
                               at="to")
        if self.rate is None and self.delay is None and self.loss is None and self.queue is None:
            raise FieldProblem("a link entry must set at least one of rate, delay, loss, queue")
        return self


class LinkSpec(BaseModel):
    """The resolved settings of one direction of one link."""

    model_config = ConfigDict(frozen=True)

    rate_bps: float
    """Rate in bit/s."""
    delay_s: float
    """One-way delay in seconds."""
    loss: float
    """Loss probability, a fraction in [0, 1]."""
    queue_s: float = DEFAULT_QUEUE_S
    """Bottleneck buffer in seconds at ``rate_bps`` (a byte FIFO of ``rate_bps / 8 * queue_s``)."""


class Topology(_Strict):
    """A validated topology; build it with :func:`parse_topology` or :func:`load_topology`."""

    name: str = Field(min_length=1)
    defaults: LinkSettings = LinkSettings()
    regions: dict[str, Region] = Field(min_length=1)
    links: tuple[LinkEntry, ...] = ()
    _source: str = PrivateAttr(default="<topology>")

    @field_validator("regions")
    @classmethod
    def _region_names(cls, regions: dict[str, Region]) -> dict[str, Region]:
        owner: dict[str, str] = {}
        for name, region in regions.items():
            if not REGION_RE.match(name):
                raise FieldProblem(
                    f"{name!r} is not a region name ([a-z][a-z0-9-]{{0,11}}: a lowercase "
                    "letter, then up to 11 lowercase letters, digits or '-')",
                    at=name,
                )
            if name in RESERVED_REGIONS:
                raise FieldProblem(f"region name {name!r} is reserved", at=name)
            for i, worker in enumerate(region.workers):
                if worker in owner:
                    raise FieldProblem(
                        f"worker {worker!r} is in two regions ({owner[worker]!r} and {name!r})",
                        at=f"{name}.workers[{i}]",
                    )
                owner[worker] = name
        return regions

    @model_validator(mode="after")
    def _links(self) -> Topology:
        seen: dict[tuple[str, str], int] = {}
        for i, link in enumerate(self.links):
            for field, region in (("from", link.from_), ("to", link.to)):
                if region not in self.regions:
                    raise FieldProblem(
                        f"unknown region {region!r} (one of {', '.join(self.regions)})",
                        at=f"links[{i}].{field}",
                    )
            pairs = [(link.from_, link.to)]
            if not link.oneway:
                pairs.append((link.to, link.from_))
            for pair in pairs:
                if pair in seen:
                    raise FieldProblem(
                        f"link {pair[0]} -> {pair[1]} is already set by links[{seen[pair]}]",
                        at=f"links[{i}]",
                    )
                seen[pair] = i
        return self

    @property
    def source(self) -> str:
        """The file (or label) the topology was read from."""
        return self._source

    @property
    def workers(self) -> dict[str, str]:
        """Every worker, mapped to its region."""
        return {w: name for name, region in self.regions.items() for w in region.workers}

    def region_of(self, worker: str) -> str:
        """The region ``worker`` lives in.

        Raises:
            KeyError: the worker is in no region.
        """
        try:
            return self.workers[worker]
        except KeyError:
            raise KeyError(f"{self._source}: worker {worker!r} is in no region") from None

    def pairs(self) -> list[tuple[str, str]]:
        """Every ordered pair ``(src, dst)`` of distinct regions, in file order."""
        return [(a, b) for a in self.regions for b in self.regions if a != b]

    def link(self, src: str, dst: str) -> LinkSpec:
        """The settings of the link from region ``src`` to region ``dst`` (module doc: rule).

        Raises:
            KeyError: an unknown region.
            ValueError: ``src == dst`` (traffic inside a region is not shaped).
        """
        for region in (src, dst):
            if region not in self.regions:
                raise KeyError(f"{self._source}: unknown region {region!r}")
        if src == dst:
            raise ValueError(f"a link joins two different regions, got {src!r} twice")
        entry: LinkSettings = LinkSettings()
        for link in self.links:
            if (link.from_, link.to) == (src, dst) or (
                not link.oneway and (link.from_, link.to) == (dst, src)
            ):
                entry = link
                break
        ends = (self.regions[src], self.regions[dst])

        def pick(field: str, worse: Any, default: float) -> float:
            explicit = getattr(entry, field)
            if explicit is not None:
                return float(explicit)
            values = [getattr(r, field) for r in ends if getattr(r, field) is not None]
            if values:
                return float(worse(values))
            own = getattr(self.defaults, field)
            return default if own is None else float(own)

        return LinkSpec(
            rate_bps=pick("rate", min, DEFAULT_RATE_BPS),
            delay_s=pick("delay", max, DEFAULT_DELAY_S),
            loss=pick("loss", max, DEFAULT_LOSS),
            queue_s=pick("queue", max, DEFAULT_QUEUE_S),
        )


# --------------------------------------------------------------------------------------------
# Reading
# --------------------------------------------------------------------------------------------


def parse_topology(data: Any, source: str = "<topology>") -> Topology:
    """Validate a mapping (the content of a topology file) into a :class:`Topology`.

    Args:
        data: the parsed YAML.
        source: name used in error messages and kept as :attr:`Topology.source`.

    Raises:
        TopologyError: ``"<source>: <field path>: <problem>"`` for every invalid field.
    """
    topology = validate_model(Topology, data, source, TopologyError)
    topology._source = source
    return topology


def load_topology(path: Path | str) -> Topology:
    """Read and validate a YAML topology file.

    Raises:
        TopologyError: missing or unreadable file, malformed YAML, or any invalid field (the
            message names the file and the field path).
    """
    return parse_topology(read_yaml(path, TopologyError, "topology"), source=str(path))


# --------------------------------------------------------------------------------------------
# Traffic per link: interface counters against the application's own accounting
# --------------------------------------------------------------------------------------------

LINK_OVERHEAD_SHARE = 0.25
"""A link may carry this share more than the application counted on it (TCP/IP and Ethernet
headers, ACKs of the opposite flow, Redis commands, ZMTP heartbeats) ..."""
LINK_SLACK_BYTES = 256 * 1024
"""... plus or minus this many bytes (messages still in a socket's buffer when its process
ended, the start-up handshakes), in bytes."""


@dataclass(frozen=True)
class LinkTraffic:
    """Bytes that crossed the link ``src -> dst`` (regions) during a run, two ways.

    Attributes:
        src, dst: the regions.
        app_bytes: what the learners counted as sent between a worker of ``src`` and one of
            ``dst``: ZeroMQ messages to and from syncer shards, fragment blobs read from Redis.
        link_bytes: what the link's own counter saw (the HTB class of ``src`` on the bridge
            port towards ``dst``, :meth:`ddiloco.chaos.wan.regions.Regions.link_bytes`),
            Ethernet frames.
    """

    src: str
    dst: str
    app_bytes: int
    link_bytes: int

    @property
    def overhead(self) -> float | None:
        """``link_bytes / app_bytes - 1`` (None when the application counted nothing)."""
        return self.link_bytes / self.app_bytes - 1 if self.app_bytes else None

    @property
    def within_margin(self) -> bool:
        """``app - slack <= link <= (1 + share) app + slack``
        (:data:`LINK_OVERHEAD_SHARE`, :data:`LINK_SLACK_BYTES`)."""
        lo = self.app_bytes - LINK_SLACK_BYTES
        hi = (1 + LINK_OVERHEAD_SHARE) * self.app_bytes + LINK_SLACK_BYTES
        return lo <= self.link_bytes <= hi

    def to_json(self) -> dict[str, Any]:
        """The fields plus ``overhead`` (rounded) and ``within_margin``."""
        ov = self.overhead
        return {"src": self.src, "dst": self.dst, "app_bytes": self.app_bytes,
                "link_bytes": self.link_bytes,
                "overhead": None if ov is None else round(ov, 4),
                "within_margin": self.within_margin}


def link_traffic(
    workers: Mapping[str, str], peer_bytes: Mapping[str, int],
    link_bytes: Mapping[tuple[str, str], int],
) -> list[LinkTraffic]:
    """Match each link's counter with the application bytes sent over it.

    Args:
        workers: worker -> region (:attr:`Topology.workers`); pairs with a worker in no region
            (on the host, or ``?``: an undecodable message) do not cross a shaped link and are
            left out.
        peer_bytes: application bytes per directed worker pair, ``{"learner-1>shard-0": n}``
            (:meth:`ddiloco.store.base.ParameterStore.wire_peers`).
        link_bytes: bytes per link ``(src, dst)`` from its counter, over the same interval.

    Returns:
        One :class:`LinkTraffic` per link of ``link_bytes``, in its order.

    Raises:
        ValueError: a ``peer_bytes`` key is not ``"src>dst"``.
    """
    app: dict[tuple[str, str], int] = {}
    for pair, n in peer_bytes.items():
        src, sep, dst = pair.partition(">")
        if not sep or not src or not dst:
            raise ValueError(f"peer pair {pair!r} is not 'src>dst'")
        a, b = workers.get(src), workers.get(dst)
        if a is not None and b is not None and a != b:
            app[(a, b)] = app.get((a, b), 0) + int(n)
    return [LinkTraffic(s, d, app.get((s, d), 0), int(n)) for (s, d), n in link_bytes.items()]
