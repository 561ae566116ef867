"""One-way link delay in user space: an NFQUEUE consumer that holds packets, then accepts them.

This kernel has no ``netem``, so :class:`~ddiloco.chaos.wan.regions.Regions` emulates a link's
one-way delay at its receiver: in each region's namespace an ``iptables`` INPUT rule sends IPv4
packets arriving from a delayed source to NFQUEUE ``0``; this process (one per region, started
inside that namespace) receives each packet's verdict handle, keeps it for the link's delay and
then accepts it. The kernel keeps the packet itself; only its first 20 bytes (the IPv4 header,
for the source) are copied here.

Why at the receiver: the sender's rate shaper has already serialized the packet, as a real link
does before propagation, and the packet no longer counts against the sending socket. Held at the
sender instead, it would: TCP small queues then allow only about a millisecond of data in the
host's queues, and a 20 Mbit/s link with 80 ms round trip measured under 1 Mbit/s.

The hold logic is the pure :class:`DelayLine` (injectable clock); :func:`serve` only moves
verdicts. Packets from one source leave in arrival order because their delay is constant.

Run as ``python -m ddiloco.chaos.wan.delayer --tag TAG --region NAME --delay 10.1.2.3=0.025
...`` (the address is the sending region's); it exits cleanly on SIGTERM/SIGINT, accepting what
it still holds, and prints a JSON summary line.
"""

from __future__ import annotations

import argparse
import heapq
import ipaddress
import json
import os
import select
import signal
import socket
import sys
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

__all__ = ["DelayLine", "DelayStats", "parse_delays", "serve"]

T = TypeVar("T")

QUEUE_NUM = 0
"""The NFQUEUE number the region's rules use (queues are per network namespace)."""
MAX_QUEUE_LEN = 20_000
"""Packets the kernel may hold for this queue before it drops (counted in ``queue_dropped``)."""
MAX_DELAY_S = 10.0
"""Longest one-way delay accepted: longer would hold too many packets in the kernel."""


@dataclass
class DelayStats:
    """Counters of one delay line."""

    packets: int = 0
    """Packets held and released."""
    passed: int = 0
    """Packets whose destination has no delay (released at once)."""
    late_max_s: float = 0.0
    """Largest lateness of a release after its due time, seconds (scheduling jitter)."""
    late_sum_s: float = 0.0
    per_peer: dict[str, int] = field(default_factory=dict)
    """Packets held per peer address."""

    @property
    def late_mean_s(self) -> float:
        """Mean lateness of a release, seconds."""
        return self.late_sum_s / self.packets if self.packets else 0.0


class DelayLine(Generic[T]):
    """Holds items for a per-peer delay and hands them back in due order.

    Args:
        delays_s: one-way delay in seconds per peer address (``"10.1.2.3"``); a peer not
            listed, or listed with 0, is released at once.
        clock: monotonic clock in seconds (``time.monotonic`` by default; tests inject one).

    Raises:
        ValueError: a delay is negative, not finite or above :data:`MAX_DELAY_S`.
    """

    def __init__(
        self, delays_s: dict[str, float], clock: Callable[[], float] = time.monotonic
    ) -> None:
        for peer, d in delays_s.items():
            if not 0.0 <= d <= MAX_DELAY_S:
                raise ValueError(f"delay for {peer} is {d!r} s; must be in [0, {MAX_DELAY_S}]")
        self.delays_s = dict(delays_s)
        #: keys with a prefix length ("10.1.2.0/24"): a delay for every address in the network
        self._networks = [(ipaddress.IPv4Network(k), d) for k, d in delays_s.items() if "/" in k]
        self._resolved: dict[str, float] = {}
        self.clock = clock
        self.stats = DelayStats()
        self._heap: list[tuple[float, int, T]] = []
        self._seq = 0

    def push(self, peer: str, item: T) -> T | None:
        """Take ``item`` from ``peer``. Returns it straight back when ``peer`` has no delay,
        else holds it and returns None."""
        delay = self.delay_of(peer)
        if delay <= 0.0:
            self.stats.passed += 1
            return item
        self._seq += 1
        heapq.heappush(self._heap, (self.clock() + delay, self._seq, item))
        self.stats.per_peer[peer] = self.stats.per_peer.get(peer, 0) + 1
        return None

    def delay_of(self, peer: str) -> float:
        """The delay of ``peer`` in seconds: its own entry, else that of the first network
        entry that contains it, else 0."""
        delay = self.delays_s.get(peer)
        if delay is not None:
            return delay
        cached = self._resolved.get(peer)
        if cached is None:
            cached = 0.0
            try:
                addr = ipaddress.IPv4Address(peer)
            except ValueError:
                addr = None
            if addr is not None:
                cached = next((d for net, d in self._networks if addr in net), 0.0)
            self._resolved[peer] = cached
        return cached

    def pop_due(self) -> list[T]:
        """Items whose due time has come, earliest first."""
        now = self.clock()
        out: list[T] = []
        while self._heap and self._heap[0][0] <= now:
            due, _, item = heapq.heappop(self._heap)
            late = now - due
            self.stats.packets += 1
            self.stats.late_sum_s += late
            self.stats.late_max_s = max(self.stats.late_max_s, late)
            out.append(item)
        return out

    def drain(self) -> list[T]:
        """Every held item, earliest first, regardless of due time (for a clean exit)."""
        out = [item for _, _, item in sorted(self._heap)]
        self.stats.packets += len(out)
        self._heap.clear()
        return out

    def wait_s(self, idle_s: float = 1.0) -> float:
        """Seconds until the next item is due (0 when one is overdue; ``idle_s`` when empty)."""
        if not self._heap:
            return idle_s
        return max(0.0, self._heap[0][0] - self.clock())

    def __len__(self) -> int:
        return len(self._heap)


def parse_delays(items: Iterable[str]) -> dict[str, float]:
    """``["10.1.2.3=0.025", "10.9.0.0/16=0.04", ...]`` to ``{"10.1.2.3": 0.025, ...}``: a
    source address, or a network for every address in it (a region behind a router).

    Raises:
        ValueError: an item is not ``IPV4[/PREFIX]=SECONDS`` or the seconds are out of range.
    """
    out: dict[str, float] = {}
    for item in items:
        addr, sep, value = item.partition("=")
        if not sep:
            raise ValueError(f"delay {item!r} must be IPV4[/PREFIX]=SECONDS")
        if "/" in addr:
            ipaddress.IPv4Network(addr)
        else:
            ipaddress.IPv4Address(addr)
        seconds = float(value)
        if not 0.0 <= seconds <= MAX_DELAY_S:
            raise ValueError(f"delay {item!r}: seconds must be in [0, {MAX_DELAY_S}]")
        out[addr] = seconds
    return out


def _src_of(header: bytes) -> str:
    """Source address of an IPv4 header (bytes 12..15)."""
    return socket.inet_ntoa(header[12:16]) if len(header) >= 20 else ""


def serve(delays_s: dict[str, float], *, ready_fd: int | None = None) -> DelayStats:
    """Bind NFQUEUE :data:`QUEUE_NUM` in this network namespace and delay packets until
    SIGTERM/SIGINT. Writes one byte to ``ready_fd`` once bound.

    Raises:
        RuntimeError: the ``NetfilterQueue`` package is missing or the queue cannot be bound
            (not root, or another process holds queue 0 in this namespace).
    """
    try:
        from netfilterqueue import COPY_PACKET, NetfilterQueue
    except ImportError as exc:
        raise RuntimeError(
            "delay emulation needs the NetfilterQueue package "
            "(pip install 'ddiloco[wan]'; it builds against libnetfilter-queue-dev)"
        ) from exc
    line: DelayLine[Any] = DelayLine(delays_s)
    stop = False

    def on_signal(signum: int, frame: object) -> None:
        nonlocal stop
        stop = True

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)

    def on_packet(pkt: Any) -> None:
        now_pkt = line.push(_src_of(pkt.get_payload()[:20]), pkt)
        if now_pkt is not None:
            now_pkt.accept()

    nfq = NetfilterQueue()
    try:
        nfq.bind(QUEUE_NUM, on_packet, max_len=MAX_QUEUE_LEN, mode=COPY_PACKET, range=20)
    except OSError as exc:
        raise RuntimeError(f"cannot bind NFQUEUE {QUEUE_NUM}: {exc}") from exc
    sock = socket.fromfd(nfq.get_fd(), socket.AF_NETLINK, socket.SOCK_RAW)
    if ready_fd is not None:
        os.write(ready_fd, b"1")
        os.close(ready_fd)
    try:
        while not stop:
            try:
                readable, _, _ = select.select([sock], [], [], line.wait_s(0.5))
            except InterruptedError:
                continue
            if readable:
                nfq.run(block=False)
            for pkt in line.pop_due():
                pkt.accept()
        for pkt in line.drain():
            pkt.accept()
    finally:
        sock.close()
        nfq.unbind()
    return line.stats


def main(argv: list[str] | None = None) -> int:
    """CLI entry: ``python -m ddiloco.chaos.wan.delayer --tag T --region R --delay IP=S ...``."""
    parser = argparse.ArgumentParser(prog="python -m ddiloco.chaos.wan.delayer",
                                     description=__doc__)
    parser.add_argument("--tag", required=True, help="run tag (names the process)")
    parser.add_argument("--region", required=True, help="the region this delayer serves")
    parser.add_argument("--delay", action="append", default=[], help="IPV4=SECONDS, repeated")
    parser.add_argument("--ready-fd", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    try:
        delays = parse_delays(args.delay)
    except ValueError as exc:
        parser.error(str(exc))
    try:
        os.nice(-10)  # releases are due at fixed times; a busy machine should not delay them
    except OSError:
        pass
    try:
        stats = serve(delays, ready_fd=args.ready_fd)
    except RuntimeError as exc:
        print(f"delayer {args.tag}/{args.region}: {exc}", file=sys.stderr)
        return 2
    summary = {
        "tag": args.tag,
        "region": args.region,
        "packets": stats.packets,
        "passed": stats.passed,
        "late_mean_ms": round(stats.late_mean_s * 1e3, 3),
        "late_max_ms": round(stats.late_max_s * 1e3, 3),
        "per_peer": stats.per_peer,
    }
    print(json.dumps(summary), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
