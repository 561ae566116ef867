"""Hostile input against a real syncer shard process, over real CURVE-keyed ZeroMQ sockets.

Usage::

    python bench/hostile.py [--out bench-out/hostile] [--flood-s 60] [--config configs/ci-tiny.yaml]

It starts a private Redis (:class:`ddiloco.store.EmbeddedRedis`) and one shard process
(:class:`ddiloco.workers.run.launch.LocalCluster`; ``run.learners=2``, ``run.shards=1``,
``sync.merge_every=0``, CURVE on with the run's keys from
:func:`ddiloco.workers.run.launch.with_run_keys`;
learner-0 and learner-1 registered in the store), then sends every hostile class below to the
shard's PULL endpoint, one row each, and last a valid control delta that must be applied:

garbage bytes, bit flips of a valid delta, truncated payload, zstd bombs (declared size too
large, no declared size, a declared size that the data overruns), wrong run id, unknown format
version, NaN/Inf payloads (hand-built int4 scales), replay of an accepted delta, an unregistered
sender with a malformed token-fate record, DELTAs without tensors (fragment not owned / owned),
a delta near float32 max (valid int4; its merge must be refused), an implausible token claim,
``step_time = inf``, a codec other than the manifest's, a spoofed sender (learner-1's key,
header sender learner-0), an unkeyed plain-TCP sender, a CURVE key outside the allow-list, a
message over MAXMSGSIZE, and a flood of 1 MB frames for ``--flood-s`` seconds.

Most classes go through a socket keyed with learner-0's key, so they reach the shard's
validation; the plain / outsider / oversize rows test the transport. Every row gets its own
incarnation number, so merges (``merge`` events in the store) are attributed to it.

Per row: frames sent, merges applied, drops by reason (store counters ``drops`` and ``auth``,
after minus before), whether the shard died, the shard's RSS before and after, and whether the
published version of fragment 0 changed. Each row waits on an event (the expected drop counter
moved, a handshake failure or disconnect on the attacker's socket monitor, a new version), never
on a fixed sleep; the flood runs for its duration and then waits for the shard to drain.

After the flood the shard's RSS is checked against ``1.5 x idle RSS + one round's deltas``
(every fragment's fp32 size times the learners); idle is the warmed-up shard at rest just
before the flood (one merge done), and the check against the cold RSS right after start-up
is reported too. Prints a table, then one JSON line
``{"bench": "hostile", "rows": [...], "ok": bool}`` (also written to ``<out>/hostile.json``).
``ok``: no hostile row applied anything or changed the version, the valid control applied
exactly one merge, and the shard never died. Exit status 1 when not ok.
"""

from __future__ import annotations

import argparse
import json
import shutil
import struct
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import zmq
import zstandard
from rich.console import Console
from rich.table import Table
from zmq.utils.monitor import recv_monitor_message

# Run as a script from anywhere: make the repository root importable.
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from ddiloco.pipeline import codec, security, wire
from ddiloco.pipeline.fragments import FragmentLayout
from ddiloco.pipeline.transport import max_message_bytes
from ddiloco.pipeline.wire import Header, Kind
from ddiloco.store import EmbeddedRedis, RedisStore
from ddiloco.store.connect import connect
from ddiloco.workers.run.config import load_config
from ddiloco.workers.run.launch import LocalCluster, with_run_keys
from ddiloco.workers.run.manifest import build_manifest, manifest_layout

ROOT = Path(__file__).resolve().parents[1]

#: Seconds a row waits for its event (a drop counter, a monitor event, a new version).
ROW_TIMEOUT_S = 10.0
#: Rows whose drop only comes at the next merge wait for the round's grace window too.
MERGE_TIMEOUT_S = 20.0
#: Seconds the flood's backlog may take to drain after the flood.
DRAIN_TIMEOUT_S = 60.0
FLOOD_FRAME_BYTES = 1_000_000
HANDSHAKE_FAILED = {zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL, zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL,
                    zmq.EVENT_HANDSHAKE_FAILED_AUTH}


#: Send queue of the flood's socket, messages (each 1 MB held in this process).
FLOOD_SNDHWM = 16


@dataclass
class Row:
    """One hostile class's outcome."""

    name: str
    inc: int
    sent: int = 0
    applied: int = 0
    dropped: dict[str, int] = field(default_factory=dict)
    crashed: bool = False
    rss_before_mb: float = 0.0
    rss_after_mb: float = 0.0
    #: published versions of every fragment before / after the row
    versions_before: list[int] = field(default_factory=list)
    versions_after: list[int] = field(default_factory=list)
    #: what the row waited for and whether it came
    waited_for: str = ""
    event_seen: bool = False
    #: a transport row's own observation (socket monitor): None when the row has none
    transport_event: bool | None = None
    #: drop reasons this class may end in (empty: no drop counter, a transport event instead)
    expected: tuple[str, ...] = ()
    note: str = ""
    #: the store's event stream position when the row started (merge attribution)
    since: str = "-"

    @property
    def version_changed(self) -> bool:
        return self.versions_after != self.versions_before

    @property
    def as_expected(self) -> bool:
        """The awaited event came and the drops are all of the expected reasons."""
        return self.event_seen and all(r in self.expected for r in self.dropped)

    def as_json(self) -> dict[str, Any]:
        return {"class": self.name, "inc": self.inc, "sent": self.sent,
                "applied": self.applied, "dropped": self.dropped, "crashed": self.crashed,
                "rss_before_mb": round(self.rss_before_mb, 1),
                "rss_after_mb": round(self.rss_after_mb, 1),
                "versions_before": self.versions_before, "versions_after": self.versions_after,
                "version_changed": self.version_changed, "waited_for": self.waited_for,
                "event_seen": self.event_seen, "expected": list(self.expected),
                "as_expected": self.as_expected, "note": self.note}


Settle = Callable[[Row, dict[str, int]], bool]


class ShardDied(RuntimeError):
    """The shard process exited during a row: no further row can be sent."""


def wait_until(pred: Callable[[], Any], timeout_s: float, poll_s: float = 0.05) -> bool:
    """Poll ``pred`` until it is truthy (True) or ``timeout_s`` passed (False)."""
    deadline = time.monotonic() + timeout_s
    while True:
        if pred():
            return True
        if time.monotonic() >= deadline:
            return False
        time.sleep(poll_s)


def wait_monitor(mon: zmq.Socket, events: set[int], timeout_s: float) -> int | None:
    """The first of ``events`` on a socket monitor within ``timeout_s``, else None."""
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        if mon.poll(100):
            ev = int(recv_monitor_message(mon)["event"])
            if ev in events:
                return ev
    return None


def event_name(ev: int | None) -> str:
    """A socket monitor event's name (``None`` -> "none")."""
    if ev is None:
        return "none"
    for name in dir(zmq):
        if name.startswith("EVENT_") and getattr(zmq, name) == ev:
            return name[len("EVENT_"):]
    return str(ev)


class Bench:
    """The shard under attack, its store and the attackers' sockets."""

    def __init__(self, args: argparse.Namespace) -> None:
        self.out: Path = args.out
        self.run_dir = self.out / "run"
        shutil.rmtree(self.run_dir, ignore_errors=True)
        self.run_dir.mkdir(parents=True)
        self.redis = EmbeddedRedis(self.run_dir / "redis", fsync="everysec")
        self.redis.start()
        self.run_id = f"hostile-{int(time.time())}"
        self.cfg = with_run_keys(load_config(args.config, {"run.learners": 2, "run.shards": 1,
                                                           "sync.merge_every": 0.0}),
                                 self.run_dir)
        self.client = connect(self.redis.url)
        self.store = RedisStore(self.client, self.run_id)
        self.manifest = self.store.put_manifest(build_manifest(self.cfg, self.run_id))
        self.layout: FragmentLayout = manifest_layout(self.manifest)
        for lid in ("learner-0", "learner-1"):
            self.store.register_learner(lid)
        self.keys_dir = Path(self.cfg.security.keys_dir or "")
        self.cluster = LocalCluster(self.redis.url, self.run_id, self.run_dir)
        self.cluster.add_syncer(0)
        self.cluster.start_all()
        self.ctx = zmq.Context()
        self.rng = np.random.default_rng(20240611)
        self.socks: list[zmq.Socket] = []
        self.inc = 100
        self.tpb = self.cfg.train.batch_size * self.cfg.model.seq_len  # tokens per batch
        self.pull_ep = ""
        self.server_key = b""
        self.flood_peak_mb = 0.0
        self.rows: list[Row] = []

    def close(self) -> None:
        """Close the sockets, stop the shard and Redis."""
        for s in self.socks:
            s.close(linger=0)
        self.ctx.destroy(linger=0)
        self.cluster.stop_all()
        self.redis.stop()

    # ---------------------------------------------------------------- cluster state
    def wait_ready(self) -> None:
        """Wait for the shard's endpoints and version 0 of every fragment."""
        ok = wait_until(lambda: self.store.shard_endpoints(0) and all(
            v >= 0 for v in self.versions()), 180, 0.2)
        if not ok:
            raise SystemExit("the shard did not come up:\n" + self.cluster.log_tail("shard-0"))
        eps = self.store.shard_endpoints(0)
        assert eps is not None
        self.pull_ep = eps["pull"]
        self.server_key = security.public_key(self.keys_dir, "shard-0")

    @property
    def shard_alive(self) -> bool:
        return self.cluster.workers["shard-0"].alive

    def rss_mb(self) -> float:
        """The shard process's resident set, MiB (NaN when it is gone)."""
        pid = self.cluster.workers["shard-0"].pid
        if pid is None:
            return float("nan")
        try:
            return float(psutil.Process(pid).memory_info().rss) / 2**20
        except psutil.Error:
            return float("nan")

    def versions(self) -> list[int]:
        """Published version of every fragment (-1: none)."""
        blobs = self.store.get_latest_many(list(range(self.layout.n_fragments)))
        return [-1 if bl is None else bl.version for bl in blobs]

    def version(self, p: int = 0) -> int:
        return self.versions()[p]

    def counters(self) -> dict[str, int]:
        """Drop counters by reason, and the ``auth`` counters as ``auth:<field>``."""
        out = dict(self.store.counters("drops"))
        out.update({f"auth:{k}": v for k, v in self.store.counters("auth").items()})
        return out

    def last_event_id(self) -> str:
        """The event stream position now, as an exclusive ``start`` for store.events."""
        last: Any = self.client.xrevrange(self.store.keys.events, count=1)
        if not last:
            return "-"
        raw_id = last[0][0]
        return "(" + (raw_id.decode() if isinstance(raw_id, bytes) else str(raw_id))

    def merges_with(self, since: str, inc: int) -> int:
        """Merge events after ``since`` whose contributions hold incarnation ``inc``."""
        return sum(1 for _, ev in self.store.events(start=since, kinds={"merge"})
                   if any(c.get("inc") == inc for c in ev.get("contributions", [])))

    # ---------------------------------------------------------------- sockets
    def push(self, keys: security.KeyPair | None, *, wait: bool = True,
             hwm: int = 1000) -> tuple[zmq.Socket, zmq.Socket]:
        """A PUSH socket to the shard (a CURVE client when ``keys``) and its monitor; waits
        for the handshake when ``wait``."""
        sock = self.ctx.socket(zmq.PUSH)
        sock.setsockopt(zmq.LINGER, 0)
        sock.setsockopt(zmq.SNDHWM, hwm)
        if keys is not None:
            security.client(sock, keys, self.server_key)
        mon = sock.get_monitor_socket()
        sock.connect(self.pull_ep)
        self.socks += [sock, mon]
        if wait:
            ev = wait_monitor(mon, {zmq.EVENT_HANDSHAKE_SUCCEEDED} | HANDSHAKE_FAILED,
                              ROW_TIMEOUT_S)
            if ev != zmq.EVENT_HANDSHAKE_SUCCEEDED:
                raise RuntimeError(f"keyed handshake with the shard failed: {event_name(ev)}")
        return sock, mon

    def keys(self, name: str) -> security.KeyPair:
        return security.load_keys(self.keys_dir, name)

    # ---------------------------------------------------------------- frames
    def next_inc(self) -> int:
        self.inc += 1
        return self.inc

    def header(self, inc: int, seq: int = 1, **kw: Any) -> Header:
        """A plausible learner-0 DELTA header of fragment 0 against its current version."""
        fields: dict[str, Any] = dict(
            kind=Kind.DELTA, run=self.run_id, sender="learner-0", inc=inc, seq=seq, frag=0,
            base=self.version(0), c_steps=6, c_tokens=6 * self.tpb, new_tokens=6 * self.tpb,
            step=6, step_time=0.05, codec=self.cfg.sync.codec_up)
        fields.update(kw)
        return Header(**fields)

    def small(self, p: int = 0, scale: float = 1e-3) -> list[np.ndarray]:
        return [self.rng.normal(scale=scale, size=s).astype(np.float32)
                for s in self.layout.shapes(p)]

    def delta(self, inc: int, seq: int = 1, **kw: Any) -> list[bytes]:
        """A correctly encoded delta (header fields overridden by ``kw``)."""
        return wire.encode(self.header(inc, seq, **kw), self.small(kw.get("frag", 0)))

    def with_payload(self, h: Header, payload: bytes) -> list[bytes]:
        """Frames of header ``h`` (fragment shapes from the manifest) carrying ``payload``
        with a matching ``len`` and CRC."""
        shapes = tuple(tuple(s) for s in self.layout.shapes(max(0, h.frag)))
        h = replace(h, shapes=shapes, len=len(payload), crc=wire.payload_crc(payload),
                    t=h.t or time.time())
        return [wire._pack(h), payload]

    # ---------------------------------------------------------------- rows
    def run_row(self, row: Row, send: Callable[[Row], int], settle: Settle,
                timeout_s: float) -> Row:
        """Measure, ``send`` (returns the frames sent), wait for ``settle`` (bounded),
        measure again and attribute merges by the row's incarnation."""
        row.rss_before_mb = self.rss_mb()
        row.versions_before = self.versions()
        before = self.counters()
        row.since = self.last_event_id()
        row.sent = send(row)

        def diff() -> dict[str, int]:
            now = self.counters()
            return {k: now[k] - before.get(k, 0) for k in now if now[k] != before.get(k, 0)}

        settled = wait_until(lambda: settle(row, diff()) or not self.shard_alive, timeout_s)
        row.crashed = not self.shard_alive
        row.event_seen = settled and not row.crashed and row.transport_event is not False
        row.dropped = diff()
        row.applied = self.merges_with(row.since, row.inc)
        row.rss_after_mb = self.rss_mb()
        row.versions_after = self.versions()
        self.rows.append(row)
        if row.crashed:
            raise ShardDied(row.name)
        return row

    @staticmethod
    def dropped_n(n: int) -> Settle:
        """Settled when the drop counters moved by ``n`` in all."""
        def settle(row: Row, d: dict[str, int]) -> bool:
            row.waited_for = f"{n} drop(s)"
            return sum(v for k, v in d.items() if not k.startswith("auth:")) >= n
        return settle


def send_all(sock: zmq.Socket, messages: list[list[bytes]]) -> int:
    for m in messages:
        sock.send_multipart(m)
    return len(messages)


def try_send(sock: zmq.Socket, frames: list[bytes]) -> int:
    """Queue one message without blocking; 1 when queued, 0 when the socket refused."""
    try:
        sock.send_multipart(frames, flags=zmq.NOBLOCK)
    except zmq.Again:
        return 0
    return 1


def zstd_zeros(raw_len: int, *, content_size: bool) -> bytes:
    """One zstd frame (content checksum on) of ``raw_len`` zero bytes, compressed in 1 MiB
    chunks (never held whole); declares its content size when ``content_size``."""
    cctx = zstandard.ZstdCompressor(level=3, write_checksum=True,
                                    write_content_size=content_size)
    obj = cctx.compressobj(size=raw_len if content_size else -1)
    chunk = bytes(1 << 20)
    parts = [obj.compress(chunk) for _ in range(raw_len // len(chunk))]
    parts.append(obj.flush())
    return b"".join(parts)


def declare_size(frame: bytes, size: int) -> bytes:
    """Rewrite the header of a zstd frame that declares no content size to declare ``size``
    (a 4-byte field): the data then overruns its declaration."""
    fhd = frame[4]
    if fhd >> 6 or fhd & 0x20 or fhd & 0x03:
        raise ValueError(f"unexpected zstd frame header descriptor {fhd:#x}")
    # magic, descriptor with Frame_Content_Size_flag = 2, window descriptor, 4-byte size
    return frame[:4] + bytes([fhd | 0x80]) + frame[5:6] + struct.pack("<I", size) + frame[6:]


def build_rows(b: Bench, flood_s: float) -> list[Row]:
    """Send every class, one row each, in order (appended to ``b.rows``); the valid control
    is last.

    Raises:
        ShardDied: the shard process is gone after a row (the rows so far are kept).
    """
    l0_sock, _ = b.push(b.keys("learner-0"))
    codec_up = b.cfg.sync.codec_up
    shapes0 = b.layout.shapes(0)
    n0 = b.layout.n_values(0)
    limit0 = codec.max_payload_size(n0, codec_up)
    expected_raw = codec.raw_size(n0, codec_up)
    n_frags = b.layout.n_fragments

    def simple(name: str, expected: tuple[str, ...],
               make: Callable[[int], list[list[bytes]]], note: str = "",
               sock: zmq.Socket | None = None, timeout_s: float = ROW_TIMEOUT_S) -> Row:
        row = Row(name, b.next_inc(), expected=expected, note=note)
        msgs = make(row.inc)
        return b.run_row(row, lambda r: send_all(sock or l0_sock, msgs),
                         b.dropped_n(len(msgs)), timeout_s)

    # garbage bytes: 1, 2 and 3 random frames
    def garbage(inc: int) -> list[list[bytes]]:
        return [[b.rng.bytes(int(b.rng.integers(1, 4096))) for _ in range(1 + i % 3)]
                for i in range(24)]
    simple("garbage bytes", ("corrupt", "format_version", "oversized"), garbage,
                       note="24 messages of 1-3 random frames")

    # bit flips in a valid delta's payload: the CRC kept (12) and recomputed (12)
    def flips(inc: int) -> list[list[bytes]]:
        out = []
        for i in range(24):
            frames = b.delta(inc, seq=i + 1)
            payload = bytearray(frames[1])
            start = zstandard.frame_header_size(bytes(payload))
            for _ in range(1 + i % 3):
                j = int(b.rng.integers(start, len(payload) - 4))
                payload[j] ^= 1 << int(b.rng.integers(0, 8))
            if i < 12:
                out.append([frames[0], bytes(payload)])
            else:
                out.append(b.with_payload(wire.decode_header(frames[0]), bytes(payload)))
        return out
    simple("bit flips of a valid delta", ("checksum", "codec", "truncated"),
                       flips, note="1-3 flipped bits in the zstd data; 12 with the original "
                       "CRC, 12 with a recomputed CRC")

    # truncated payload (and the payload frame missing)
    def truncated(inc: int) -> list[list[bytes]]:
        h, p = b.delta(inc)
        return [[h, p[:k]] for k in (0, 1, len(p) // 2, len(p) - 1)] + [[h]]
    simple("truncated payload", ("truncated",), truncated)

    # zstd bombs: payload frames that decompress huge, len and CRC matching
    raw_len = 1 << 30
    unsized = zstd_zeros(raw_len, content_size=False)
    while len(unsized) + 4 > limit0 and raw_len > 1 << 20:
        raw_len //= 2
        unsized = zstd_zeros(raw_len, content_size=False)
    sized = zstd_zeros(raw_len, content_size=True)

    def bombs(inc: int) -> list[list[bytes]]:
        return [b.with_payload(b.header(inc, 1), sized),
                b.with_payload(b.header(inc, 2), unsized),
                b.with_payload(b.header(inc, 3), declare_size(unsized, expected_raw))]
    simple("zstd bomb", ("oversized", "codec"), bombs,
                       note=f"{raw_len >> 20} MiB of zeros in {len(unsized)} bytes: content "
                       f"size declared / undeclared / declared {expected_raw} and overrun")

    simple("wrong run id", ("wrong_run",),
                       lambda inc: [b.delta(inc, run="another-run")])
    simple("unknown format version", ("format_version",),
                       lambda inc: [b.delta(inc, fv=99), b.delta(inc, seq=2, fv=1)])

    # NaN / Inf payloads: hand-built int4 payloads whose first scale is NaN, +Inf or -1
    # (zstd with checksum and content size, as the codec writes them), and fp32 NaNs
    def nan_payload(inc: int) -> list[list[bytes]]:
        raw = codec.quantize(b.small(), codec_up).tobytes()
        cctx = zstandard.ZstdCompressor(level=1, write_checksum=True, write_content_size=True)
        out = []
        for seq, bad in enumerate((float("nan"), float("inf"), -1.0), start=1):
            patched = struct.pack("<f", bad) + raw[4:]
            out.append(b.with_payload(b.header(inc, seq), cctx.compress(patched)))
        nan = [np.full(s, np.nan, np.float32) for s in shapes0]
        out.append(wire.encode(b.header(inc, 4, codec="fp32"), nan))
        return out
    simple("NaN payload", ("codec", "nonfinite", "schema"), nan_payload,
                       note=f"{codec_up} scale NaN / +Inf / -1; fp32 all-NaN")

    # replay of an accepted delta: the original is applied first (setup), then sent again
    row = Row("replay of an accepted delta", b.next_inc(), expected=("duplicate",))
    original = b.delta(row.inc, seq=1)
    setup_since = b.last_event_id()
    v0 = b.version(0)
    l0_sock.send_multipart(original)
    setup_ok = wait_until(lambda: b.merges_with(setup_since, row.inc) >= 1, MERGE_TIMEOUT_S)
    row.note = (f"setup: the original applied {setup_ok} (fragment 0 v{v0} -> "
                f"v{b.version(0)}); replayed twice")
    b.run_row(row, lambda r: send_all(l0_sock, [original, original]),
                          b.dropped_n(2), ROW_TIMEOUT_S)

    # an unregistered sender with a malformed token-fate record: "mallory" in the header of
    # learner-0's key (spoofed), and learner-9, a key in the allow-list that never
    # registered in the run, speaking for itself (bad fate, then a good one)
    security.create_keys(b.keys_dir, "learner-9", overwrite=True)
    l9_sock, _ = b.push(b.keys("learner-9"))
    row = Row("unregistered sender, malformed fate", b.next_inc(),
              expected=("spoofed_sender", "invalid_field", "unknown_sender"))

    def unregistered(r: Row) -> int:
        l0_sock.send_multipart(b.delta(r.inc, sender="mallory", extra={"fate": ["x"]}))
        l9_sock.send_multipart(b.delta(r.inc, sender="learner-9", extra={"fate": ["x"]}))
        l9_sock.send_multipart(b.delta(r.inc, seq=2, sender="learner-9",
                                       extra={"fate": [1, 1, 0, 0]}))
        return 3
    b.run_row(row, unregistered, b.dropped_n(3), ROW_TIMEOUT_S)
    recorded = b.store.received_total("learner-9", row.inc, "shard-0")
    row.note = f"tokens recorded for learner-9 (must be 0): {recorded}"
    if recorded:
        row.applied += 1  # state recorded for a sender that is not in the run

    simple("DELTA without tensors, not-owned fragment", ("not_owned",),
                       lambda inc: [wire.encode(b.header(inc, frag=n_frags + 3, codec=""))],
                       note=f"fragment {n_frags + 3} (the run has {n_frags})")
    simple("DELTA without tensors, owned fragment", ("no_payload",),
                       lambda inc: [wire.encode(b.header(inc, codec=""))])

    # a valid int4 delta near float32 max: filed, its merge refused, the version unchanged
    row = Row("delta near float32 max", b.next_inc(), expected=("merge_refused",))
    huge = wire.encode(b.header(row.inc), [np.full(s, 3.0e38, np.float32) for s in shapes0])
    b.run_row(row, lambda r: send_all(l0_sock, [huge]), b.dropped_n(1),
                          MERGE_TIMEOUT_S)

    simple("implausible token claim", ("implausible_claim",),
                       lambda inc: [b.delta(inc, c_tokens=10**9)], note="c_tokens = 1e9")
    simple("step_time = inf", ("invalid_field",),
                       lambda inc: [b.delta(inc, step_time=float("inf")),
                                    b.delta(inc, seq=2, step_time=float("nan"))],
                       note="and step_time = nan")
    simple("codec other than the manifest's", ("schema",),
                       lambda inc: [b.delta(inc, codec="fp32"),
                                    b.delta(inc, seq=2, codec="int8")],
                       note=f"fp32 and int8; the manifest says {codec_up}")

    l1_sock, _ = b.push(b.keys("learner-1"))
    simple("spoofed sender", ("spoofed_sender",), lambda inc: [b.delta(inc)],
                       sock=l1_sock, note="learner-1's key, header sender learner-0")

    # unkeyed plain TCP: the CURVE handshake fails, nothing reaches the shard
    row = Row("unkeyed plain TCP sender", b.next_inc())

    def plain(r: Row) -> int:
        sock, mon = b.push(None, wait=False)
        sent = try_send(sock, b.delta(r.inc))
        ev = wait_monitor(mon, HANDSHAKE_FAILED | {zmq.EVENT_DISCONNECTED}, ROW_TIMEOUT_S)
        sock.close(linger=0)  # no reconnect attempts after the observation
        r.waited_for = "handshake failure / disconnect"
        r.transport_event = ev is not None
        r.note = f"sender's monitor: {event_name(ev)}"
        return sent
    b.run_row(row, plain, lambda r, d: True, ROW_TIMEOUT_S)

    # a CURVE key outside the allow-list (named learner-0 in its own directory)
    row = Row("CURVE key outside the allow-list", b.next_inc(), expected=("auth:refused",))
    mallory = security.create_keys(b.run_dir / "outsider-keys", "learner-0", overwrite=True)

    def outsider(r: Row) -> int:
        sock, mon = b.push(mallory, wait=False)
        sent = try_send(sock, b.delta(r.inc))
        ev = wait_monitor(mon, HANDSHAKE_FAILED | {zmq.EVENT_HANDSHAKE_SUCCEEDED},
                          ROW_TIMEOUT_S)
        sock.close(linger=0)  # no reconnect attempts after the observation
        r.transport_event = ev == zmq.EVENT_HANDSHAKE_FAILED_AUTH
        r.note = f"sender's monitor: {event_name(ev)}"
        return sent

    def refused(r: Row, d: dict[str, int]) -> bool:
        r.waited_for = "HANDSHAKE_FAILED_AUTH and auth:refused"
        return d.get("auth:refused", 0) >= 1
    b.run_row(row, outsider, refused, ROW_TIMEOUT_S)

    # a message over MAXMSGSIZE on a keyed connection: the shard drops the connection
    max_msg = max_message_bytes(max(b.layout.n_values(p) for p in range(n_frags)))
    row = Row("oversize message (> MAXMSGSIZE)", b.next_inc())

    def oversize(r: Row) -> int:
        sock, mon = b.push(b.keys("learner-0"))
        sock.send_multipart(b.with_payload(b.header(r.inc), bytes(max_msg + 1)))
        ev = wait_monitor(mon, {zmq.EVENT_DISCONNECTED}, ROW_TIMEOUT_S)
        r.waited_for = "DISCONNECTED on the sender's monitor"
        r.transport_event = ev == zmq.EVENT_DISCONNECTED
        r.note = f"payload frame {max_msg + 1} bytes, MAXMSGSIZE {max_msg}"
        sock.close(linger=0)
        return 1
    b.run_row(row, oversize, lambda r, d: True, ROW_TIMEOUT_S)

    flood(b, flood_s)

    # the valid control: learner-0's own key and id, a correct delta -> applied
    row = Row("valid control", b.next_inc())
    v_before = b.version(0)

    def control(r: Row) -> int:
        l0_sock.send_multipart(b.delta(r.inc, seq=1, base=v_before))
        return 1

    def merged(r: Row, d: dict[str, int]) -> bool:
        r.waited_for = "its merge (a new version)"
        return b.merges_with(r.since, r.inc) >= 1
    b.run_row(row, control, merged, MERGE_TIMEOUT_S)
    return b.rows


def flood(b: Bench, flood_s: float) -> Row:
    """1 MB messages as fast as a keyed socket takes them for ``flood_s`` seconds (each a
    learner-0 DELTA with a correct CRC whose payload exceeds the fragment's bound: dropped
    as oversized after the CRC check), then wait for the shard to drain its backlog."""
    row = Row(f"flood of 1 MB frames ({flood_s:g} s)", b.next_inc(), expected=("oversized",))
    sock, _ = b.push(b.keys("learner-0"), hwm=FLOOD_SNDHWM)
    frames = b.with_payload(b.header(row.inc), b.rng.bytes(FLOOD_FRAME_BYTES))
    peak = {"rss": 0.0, "t": 0.0}

    def sample() -> None:
        if time.monotonic() >= peak["t"]:
            peak["rss"] = max(peak["rss"], b.rss_mb())
            peak["t"] = time.monotonic() + 0.25

    def send(r: Row) -> int:
        sent = 0
        t0 = time.monotonic()
        end = t0 + flood_s
        while time.monotonic() < end:
            try:
                sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
                sent += 1
            except zmq.Again:
                sock.poll(50, zmq.POLLOUT)
            sample()
        took = time.monotonic() - t0
        r.note = f"{sent / took:.0f} msg/s = {sent * FLOOD_FRAME_BYTES / 1e6 / took:.0f} MB/s"
        return sent

    def drained(r: Row, d: dict[str, int]) -> bool:
        r.waited_for = "every flood message dropped (drain)"
        sample()
        return d.get("oversized", 0) >= r.sent

    b.run_row(row, send, drained, DRAIN_TIMEOUT_S)
    b.flood_peak_mb = peak["rss"]
    row.note += f"; peak shard RSS {peak['rss']:.1f} MB"
    sock.close(linger=0)
    return row


def render(console: Console, run_id: str, rows: list[Row]) -> None:
    """The rows as a rich table, then each row's note."""
    table = Table(title=f"hostile input vs one shard process (run {run_id})")
    for col in ("class", "sent", "applied", "dropped (reason: n)", "crashed",
                "RSS MB before/after", "version changed", "awaited event"):
        table.add_column(col, justify="right" if col in ("sent", "applied") else "left")
    for r in rows:
        table.add_row(r.name, str(r.sent), str(r.applied),
                      ", ".join(f"{k}: {v}" for k, v in sorted(r.dropped.items())) or "-",
                      "YES" if r.crashed else "no",
                      f"{r.rss_before_mb:.1f} / {r.rss_after_mb:.1f}",
                      f"{r.versions_before} -> {r.versions_after}" if r.version_changed
                      else "no",
                      ("ok" if r.as_expected else "UNEXPECTED") + f": {r.waited_for}")
    console.print(table)
    for r in rows:
        if r.note:
            console.print(f"  {r.name}: {r.note}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description="Hostile input against a real syncer shard.")
    ap.add_argument("--out", type=Path, default=Path("bench-out/hostile"))
    ap.add_argument("--flood-s", type=float, default=60.0)
    ap.add_argument("--config", type=Path, default=Path("configs/ci-tiny.yaml"))
    args = ap.parse_args(argv)
    if not args.config.is_absolute() and not args.config.exists():
        args.config = ROOT / args.config
    args.out.mkdir(parents=True, exist_ok=True)
    console = Console(width=200)
    b = Bench(args)
    try:
        b.wait_ready()
        idle_rss = b.rss_mb()  # cold: right after start-up
        try:
            build_rows(b, args.flood_s)
        except ShardDied as exc:
            console.print(f"[red]the shard died during {exc}[/red]")
        rows = b.rows
        shard_log = b.cluster.log_tail("shard-0", 8000)
    finally:
        b.close()

    flood_row = next((r for r in rows if r.name.startswith("flood")), rows[-1])
    rss_after_flood = flood_row.rss_after_mb
    # Idle: the shard at rest, warmed up (one merge done, the merge path's imports and
    # buffers in place), just before the flood; the cold value right after start-up is
    # reported too (the first merge alone adds tens of MB).
    idle_warm = flood_row.rss_before_mb
    round_bytes = sum(4 * b.layout.n_values(p) for p in range(b.layout.n_fragments)) * \
        b.cfg.run.learners
    bound_mb = 1.5 * idle_warm + round_bytes / 2**20
    bound_cold_mb = 1.5 * idle_rss + round_bytes / 2**20
    rss_ok = rss_after_flood <= bound_mb
    control = rows[-1]
    ok = (control.name == "valid control" and control.applied == 1 and control.version_changed
          and all(r.applied == 0 and not r.version_changed for r in rows[:-1])
          and not any(r.crashed for r in rows))

    render(console, b.run_id, rows)
    console.print(f"RSS bound: after the flood {rss_after_flood:.1f} MB <= 1.5 x idle "
                  f"{idle_warm:.1f} MB + one round's deltas {round_bytes / 2**20:.2f} MB = "
                  f"{bound_mb:.1f} MB: {'ok' if rss_ok else 'EXCEEDED'} (peak during the "
                  f"flood {b.flood_peak_mb:.1f} MB; against the cold idle {idle_rss:.1f} MB "
                  f"right after start-up the bound is {bound_cold_mb:.1f} MB: "
                  f"{'ok' if rss_after_flood <= bound_cold_mb else 'EXCEEDED'})")
    if not ok or any(r.crashed for r in rows):
        console.print("[red]NOT OK[/red]; the shard's log ends with:\n" + shard_log)
    result = {"bench": "hostile", "run_id": b.run_id, "flood_s": args.flood_s,
              "rows": [r.as_json() for r in rows],
              "all_as_expected": all(r.as_expected for r in rows),
              "rss": {"idle_mb": round(idle_warm, 1), "idle_cold_mb": round(idle_rss, 1),
                      "after_flood_mb": round(rss_after_flood, 1),
                      "bound_cold_mb": round(bound_cold_mb, 1),
                      "ok_cold": rss_after_flood <= bound_cold_mb,
                      "flood_peak_mb": round(b.flood_peak_mb, 1),
                      "round_deltas_mb": round(round_bytes / 2**20, 3),
                      "bound_mb": round(bound_mb, 1), "ok": rss_ok},
              "ok": ok}
    (args.out / "hostile.json").write_text(json.dumps(result, indent=2) + "\n")
    print(json.dumps(result))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
