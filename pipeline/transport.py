"""ZeroMQ transport: learner -> shard PUSH/PULL, shard -> learners PUB/SUB (DESIGN §4).

Every socket gets LINGER 0 (closing never hangs on a dead peer) and MAXMSGSIZE from the manifest
(a peer cannot make us buffer an arbitrarily large frame: :func:`max_message_bytes`). Dead peers
are noticed in seconds, not at the TCP timeout, by the kernel: every socket carries TCP
keepalives (an idle connection to a dead host is dropped after about 15 s) and a TCP user
timeout (``ZMQ_TCP_MAXRT``, :data:`TCP_MAXRT_MS`: data left unacknowledged that long drops it).
No socket carries ZMTP heartbeats. libzmq aborts the process when a connection is cut while
the receiving socket's input is stopped by its high-water mark (``Assertion failed:
_input_stopped`` or ``!_io_error``, zeromq/libzmq#3937, #4364, #4767). A ZMTP heartbeat
timeout is such a cut, and it fires on any receiver that stops reading for longer than the
timeout: a learner decoding a broadcast of a 1B-parameter fragment, a learner on a saturated
10 Mbit/s link, a shard busy merging. The kernel answers keepalives and zero-window probes of a
live but busy receiver, so backpressure alone never cuts a connection. Sends from learners
never block: :meth:`DeltaPush.send` returns False when the queue is full and the caller folds
the unsent delta into its next one.

CURVE (:mod:`ddiloco.pipeline.security`, on by default): shard sockets are CURVE servers, learner
sockets CURVE clients; every message is encrypted and the shard knows which worker's key
sent it (:attr:`ShardSockets.last_peer`).

Sockets are not thread safe: each object here is owned by one thread.

Memory with large messages:

A message is a header frame and one payload frame (:mod:`ddiloco.pipeline.wire`); ``B`` below is
the socket's MAXMSGSIZE, the largest frame a message of the run's largest fragment can have.
Queues are bounded in bytes, not only in messages: every high-water mark is capped at
``QUEUE_BUDGET_BYTES // B`` messages (at least 1), so with fragments of hundreds of MB a queue
holds a few messages, not 64 or 256 of them. Payloads are never copied in Python: sends pass
the encoded bytes with ``copy=False`` and receives return memoryviews of the ZeroMQ frames.

* Sender: the message (``M`` bytes) is shared with libzmq until it is written out. With CURVE,
  libzmq encrypts each frame into a new buffer through a plaintext copy: while a message is
  being encrypted the sender holds ``3 M`` (``M`` plus ``2 M`` measured); plain TCP writes the
  frame in place (no copy measured).
* Receiver: libzmq allocates each frame at its declared size once the size has passed the
  MAXMSGSIZE check, so a frame in flight costs at most ``B`` per connection. A received message
  costs ``M``, plain or CURVE (measured: the receive adds ``1.00 M``). Queued messages add at
  most their high-water mark times ``B`` (plus their headers). A header that declares more
  than the manifest allows is refused by ``wire.decode`` before its payload is read.

Measured by ``bench/bigmsg.py``: one int4 delta of a 2.03 GB fp32 fragment, ``M`` = 250 MB.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping, Sequence
from typing import cast

import zmq

from ddiloco.pipeline import security, wire
from ddiloco.pipeline.codec_spec import DEFAULT_BLOCK
from ddiloco.pipeline.security import ClientKeys, KeyPair

#: TCP user timeout of every socket, milliseconds: a connection whose sent data stays
#: unacknowledged this long is dropped (a dead host; a live one acknowledges, or advertises a
#: zero window, however slowly it reads).
TCP_MAXRT_MS = 30_000
#: TCP keepalive of every socket: idle seconds, probe interval seconds, probes (a dead
#: peer is dropped after about 5 + 2 * 5 = 15 s).
KEEPALIVE_IDLE_S = 5
KEEPALIVE_INTVL_S = 2
KEEPALIVE_CNT = 5
#: Messages queued per PUSH peer before sends report "would block".
PUSH_HWM = 4
#: Version broadcasts queued per subscriber; PUB drops beyond it (last value wins anyway).
PUB_HWM = 256
#: Messages queued from each learner connection at a shard's PULL before libzmq stops reading
#: it (TCP backpressure): a flood cannot grow the shard's memory without bound.
PULL_HWM = 64
#: Bytes of messages one socket's queue may hold (per peer), bytes: every high-water mark is
#: capped at ``QUEUE_BUDGET_BYTES // MAXMSGSIZE`` messages (:func:`queue_hwm`).
QUEUE_BUDGET_BYTES = 1 << 30
#: What a frame grows by on the wire beyond its content, bytes: CURVE's MESSAGE command adds 33
#: (command name, nonce, MAC, flags), and libzmq checks MAXMSGSIZE on that wire frame.
FRAME_OVERHEAD_BYTES = 256


class Pacer:
    """Keeps a sender's average rate at or below ``rate_bps``: after a message of ``n`` bytes,
    the next may go ``8 n / rate_bps`` seconds later (no burst allowance).

    A learner on a shared wide-area link paces its deltas so that at most about one message
    sits in the link's queue: the heartbeats and the other tenants' traffic behind it wait for
    one fragment, not for a backlog. A delta that may not go yet stays in the outbox, where a
    newer delta of the same fragment replaces it (deltas are cumulative since adoption).

    Args:
        rate_bps: bits per second (payload bytes as counted by ``wire.message_nbytes``).
        clock: monotonic clock, seconds (injectable for tests).

    Raises:
        ValueError: ``rate_bps`` is not > 0.
    """

    def __init__(self, rate_bps: float, clock: Callable[[], float] = time.monotonic) -> None:
        if not rate_bps > 0:
            raise ValueError(f"rate_bps must be > 0, got {rate_bps!r}")
        self.rate_bps = float(rate_bps)
        self.clock = clock
        self.next_t = -float("inf")

    def ready(self) -> bool:
        """Whether a message may be sent now."""
        return self.clock() >= self.next_t

    def wait_s(self) -> float:
        """Seconds until :meth:`ready` (0 when ready)."""
        return max(0.0, self.next_t - self.clock())

    def sent(self, nbytes: int) -> None:
        """Account a message of ``nbytes`` bytes handed to the socket now."""
        self.next_t = max(self.next_t, self.clock()) + nbytes * 8 / self.rate_bps


def configure(sock: zmq.Socket, max_msg_bytes: int) -> zmq.Socket:
    """Apply the options every ddiloco socket carries (module doc). Returns the socket."""
    sock.setsockopt(zmq.LINGER, 0)
    sock.setsockopt(zmq.TCP_KEEPALIVE, 1)
    sock.setsockopt(zmq.TCP_KEEPALIVE_IDLE, KEEPALIVE_IDLE_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_INTVL, KEEPALIVE_INTVL_S)
    sock.setsockopt(zmq.TCP_KEEPALIVE_CNT, KEEPALIVE_CNT)
    sock.setsockopt(zmq.TCP_MAXRT, TCP_MAXRT_MS)
    sock.setsockopt(zmq.MAXMSGSIZE, int(max_msg_bytes))
    return sock


def max_message_bytes(largest_fragment_values: int, codecs: Sequence[str] = ("fp32",),
                      block: int = DEFAULT_BLOCK) -> int:
    """MAXMSGSIZE for a run, bytes: the largest frame of a message of the run's largest
    fragment (``largest_fragment_values`` float32 values) with a payload in one of ``codecs``
    (:func:`ddiloco.pipeline.wire.max_frame_bytes`), plus :data:`FRAME_OVERHEAD_BYTES`.

    The default, fp32, bounds every codec (none encodes a value in more than 4 bytes); a
    receiver that knows which codecs its peers use (the manifest's ``sync.codec_up`` at a
    shard's PULL, ``sync.codec_down`` and ``sync.codec_dp`` at a learner's SUB) passes them for a
    tighter cap: e.g. a 2.03 GB fp32 fragment sent in int4 allows frames of 286 MB.

    Raises:
        ValueError: an unknown codec or a bad block size.
    """
    return wire.max_frame_bytes(largest_fragment_values, codecs, block) + FRAME_OVERHEAD_BYTES


def queue_hwm(default: int, max_msg_bytes: int) -> int:
    """A high-water mark, messages: ``default``, capped so that the queue holds at most about
    :data:`QUEUE_BUDGET_BYTES` of messages of up to ``max_msg_bytes`` bytes (at least 1)."""
    return max(1, min(int(default), QUEUE_BUDGET_BYTES // max(1, int(max_msg_bytes))))


def _views(frames: Sequence[zmq.Frame]) -> list[bytes]:
    # A copy of a frame of hundreds of MB would double the receiver's peak memory; the
    # decoders only need the buffer protocol, so hand them views that keep the frames alive.
    return cast(list[bytes], [f.buffer for f in frames])


class _Connector:
    """Keeps one socket connected to a changing set of endpoints (CURVE: each connection
    with its server's key)."""

    def __init__(self, sock: zmq.Socket, curve: ClientKeys | None = None) -> None:
        self.sock = sock
        self.curve = curve
        self.endpoints: dict[int, str] = {}

    def update(self, endpoints: Mapping[int, str]) -> bool:
        """Connect new endpoints, disconnect vanished/changed ones. Returns True on change."""
        changed = False
        for key, ep in list(self.endpoints.items()):
            if endpoints.get(key) != ep:
                try:
                    self.sock.disconnect(ep)
                except zmq.ZMQError:
                    pass  # already gone: nothing to undo
                del self.endpoints[key]
                changed = True
        for key, ep in endpoints.items():
            if key not in self.endpoints:
                if self.curve is not None:
                    # libzmq copies the options into each connection at connect time
                    security.client(self.sock, self.curve.keys, self.curve.server_key(key))
                self.sock.connect(ep)
                self.endpoints[key] = ep
                changed = True
        return changed


class DeltaPush:
    """One PUSH socket per syncer shard (so a slow shard cannot hold back another's traffic)."""

    def __init__(self, ctx: zmq.Context, max_msg_bytes: int,
                 curve: ClientKeys | None = None) -> None:
        self._ctx = ctx
        self._max = max_msg_bytes
        self._curve = curve
        self._socks: dict[int, zmq.Socket] = {}
        self._eps: dict[int, str] = {}

    def update(self, endpoints: Mapping[int, str]) -> None:
        """Point shard s at ``endpoints[s]`` (a restarted shard may have a new port)."""
        for shard, ep in endpoints.items():
            if self._eps.get(shard) == ep:
                continue
            old = self._socks.pop(shard, None)
            if old is not None:
                old.close(linger=0)
            sock = configure(self._ctx.socket(zmq.PUSH), self._max)
            sock.setsockopt(zmq.SNDHWM, queue_hwm(PUSH_HWM, self._max))
            if self._curve is not None:
                security.client(sock, self._curve.keys, self._curve.server_key(shard))
            sock.connect(ep)
            self._socks[shard] = sock
            self._eps[shard] = ep

    def has(self, shard: int) -> bool:
        """True when an endpoint for ``shard`` is known."""
        return shard in self._socks

    def send(self, shard: int, frames: Sequence[bytes]) -> bool:
        """Queue a message without blocking. False: unknown shard or queue full."""
        sock = self._socks.get(shard)
        if sock is None:
            return False
        try:
            sock.send_multipart(frames, flags=zmq.NOBLOCK, copy=False)
        except zmq.Again:
            return False
        return True

    def close(self, linger_ms: int = 0) -> None:
        """Close every socket. ``linger_ms``: how long queued messages may still go out
        (closing the context waits for them); 0 drops them at once."""
        for sock in self._socks.values():
            sock.close(linger=linger_ms)
        self._socks.clear()
        self._eps.clear()


class VersionSub:
    """A SUB socket connected to every shard's PUB, subscribed to everything."""

    def __init__(self, ctx: zmq.Context, max_msg_bytes: int,
                 curve: ClientKeys | None = None) -> None:
        self.sock = configure(ctx.socket(zmq.SUB), max_msg_bytes)
        self.sock.setsockopt(zmq.RCVHWM, queue_hwm(PUB_HWM, max_msg_bytes))
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self._conn = _Connector(self.sock, curve)

    def update(self, endpoints: Mapping[int, str]) -> bool:
        """Follow the shards' announced PUB endpoints."""
        return self._conn.update(endpoints)

    def recv(self, timeout_ms: int) -> list[bytes] | None:
        """One message's frames, or None after ``timeout_ms`` milliseconds.

        The frames are memoryviews of the received ZeroMQ frames (no copy; typed ``bytes`` for
        the decoders, which read them through the buffer protocol): a broadcast of ``M`` bytes
        costs ``M`` here, not ``2 M``.
        """
        if self.sock.poll(timeout_ms, zmq.POLLIN):
            return _views(self.sock.recv_multipart(copy=False))
        return None

    def close(self) -> None:
        """Close the socket (LINGER 0)."""
        self.sock.close(linger=0)


class ShardSockets:
    """A syncer shard's PULL (deltas in) and PUB (versions out), bound to ``host``.

    Port 0 binds an ephemeral port; :attr:`pull_endpoint`/:attr:`pub_endpoint` give the bound
    addresses with ``advertise_host`` substituted, for announcing in the store.

    Args:
        curve: this shard's keys: both sockets are CURVE servers (the context needs a running
            :class:`ddiloco.pipeline.security.Authenticator`); None: plain TCP.
    """

    def __init__(self, ctx: zmq.Context, max_msg_bytes: int, host: str = "127.0.0.1",
                 pull_port: int = 0, pub_port: int = 0,
                 advertise_host: str | None = None, curve: KeyPair | None = None) -> None:
        self.pull = configure(ctx.socket(zmq.PULL), max_msg_bytes)
        self.pull.setsockopt(zmq.RCVHWM, queue_hwm(PULL_HWM, max_msg_bytes))
        self.pub = configure(ctx.socket(zmq.PUB), max_msg_bytes)
        self.pub.setsockopt(zmq.SNDHWM, queue_hwm(PUB_HWM, max_msg_bytes))
        if curve is not None:
            security.server(self.pull, curve)
            security.server(self.pub, curve)
        #: the authenticated worker id of the last message :meth:`recv` returned (CURVE), or
        #: None on plain TCP
        self.last_peer: str | None = None
        self.pull_endpoint = self._bind(self.pull, host, pull_port, advertise_host)
        self.pub_endpoint = self._bind(self.pub, host, pub_port, advertise_host)
        self.poller = zmq.Poller()
        self.poller.register(self.pull, zmq.POLLIN)

    @staticmethod
    def _bind(sock: zmq.Socket, host: str, port: int, advertise: str | None) -> str:
        if port:
            sock.bind(f"tcp://{host}:{port}")
        else:
            sock.bind(f"tcp://{host}:*")
        ep = sock.getsockopt_string(zmq.LAST_ENDPOINT)
        if advertise:
            bound_port = ep.rsplit(":", 1)[1]
            ep = f"tcp://{advertise}:{bound_port}"
        return ep

    def recv(self, timeout_ms: int) -> list[bytes] | None:
        """One delta's frames, or None after ``timeout_ms`` milliseconds; sets
        :attr:`last_peer`.

        The frames are memoryviews of the received ZeroMQ frames (no copy; typed ``bytes`` for
        the shard core, which reads them through the buffer protocol).
        """
        if self.poller.poll(timeout_ms):
            frames = self.pull.recv_multipart(copy=False)
            peer: str | None = None
            try:
                if frames:
                    peer = str(frames[0].get("User-Id")) or None
            except zmq.ZMQError:
                peer = None  # plain TCP: no ZAP User-Id
            self.last_peer = peer
            return _views(frames)
        return None

    def publish(self, frames: Sequence[bytes]) -> None:
        """Broadcast to every subscriber; PUB never blocks (it drops at the HWM)."""
        self.pub.send_multipart(frames, copy=False)

    def close(self) -> None:
        """Close both sockets (LINGER 0)."""
        self.pull.close(linger=0)
        self.pub.close(linger=0)
