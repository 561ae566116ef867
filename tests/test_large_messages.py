"""Large messages: the manifest's size bound, refused declarations that cost no allocation, the
socket-level cap, and a 20 MB delta over CURVE sockets."""

from __future__ import annotations

import time
import tracemalloc
from collections.abc import Callable, Iterator
from dataclasses import replace
from pathlib import Path

import numpy as np
import pytest
import zmq

from ddiloco.pipeline import codec, security, wire
from ddiloco.pipeline.errors import CodecError, OversizedFrame, TruncatedFrame
from ddiloco.pipeline.transport import (
    FRAME_OVERHEAD_BYTES,
    PULL_HWM,
    DeltaPush,
    ShardSockets,
    max_message_bytes,
    queue_hwm,
)
from ddiloco.pipeline.wire import Header, Kind
from tests.test_syncer_core import TINY, shard_core

RUN = "run-big"
#: A fragment of 1 M values: its int4 payload is bounded by about 570 KB.
SHAPES = [(1024, 768), (256, 1024)]
N = sum(int(np.prod(s)) for s in SHAPES)


def shapes_for(h: Header) -> list[tuple[int, ...]] | None:
    return SHAPES if h.frag == 0 else None


def delta_header(**kw: object) -> Header:
    base = dict(kind=Kind.DELTA, run=RUN, sender="learner-0", inc=1, seq=1, frag=0, base=0,
                c_steps=4, c_tokens=64, new_tokens=64, step=4, step_time=0.1, codec="int4")
    base.update(kw)
    return Header(**base)  # type: ignore[arg-type]


def declaring(n_bytes: int, payload: bytes, frag: int = 0,
              shapes: list[tuple[int, ...]] = SHAPES) -> list[bytes]:
    """A header frame that declares ``n_bytes`` of payload, with ``payload`` as frame 1."""
    h = replace(delta_header(frag=frag), len=n_bytes, crc=wire.payload_crc(payload),
                shapes=tuple(shapes), t=1.0)
    return [wire._pack(h), payload]


def test_bound_follows_the_manifest_codec() -> None:
    int4 = wire.max_payload_bytes(N, "int4")
    assert int4 == codec.max_payload_size(N, "int4")
    assert wire.max_frame_bytes(N, ["int4"]) == max(int4, wire.MAX_HEADER_BYTES)
    assert wire.max_frame_bytes(N, []) == wire.MAX_HEADER_BYTES
    assert max_message_bytes(N, ["int4"]) == int4 + FRAME_OVERHEAD_BYTES
    # the default bounds every codec: none encodes a value in more than 4 bytes
    assert max_message_bytes(N) >= max(max_message_bytes(N, [c]) for c in codec.CODECS)
    # four float32 tensors of 16384 x 7744 (2.03 GB): int4 frames up to 286.6 MB
    big = 4 * 16384 * 7744
    assert 286_000_000 < max_message_bytes(big, ["int4"]) < 287_000_000
    assert max_message_bytes(big, ["int4"]) >= codec.raw_size(big, "int4")


def test_queues_are_bounded_in_bytes() -> None:
    assert queue_hwm(PULL_HWM, 1 << 20) == PULL_HWM
    assert queue_hwm(PULL_HWM, 300_000_000) == 3
    assert queue_hwm(PULL_HWM, 4_000_000_000) == 1


def test_declared_oversize_is_refused_before_any_allocation() -> None:
    limit = wire.max_payload_bytes(N, "int4")
    junk = np.random.default_rng(0).bytes(limit + 1)
    frames = declaring(limit + 1, junk)
    tracemalloc.start()
    try:
        with pytest.raises(OversizedFrame, match="declares a payload of"):
            wire.decode(frames, run_id=RUN, expected_shapes=shapes_for)
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 64 * 1024, peak  # nothing of the payload's size: no copy, no decompression
    # The declaration is checked before the frame: a huge one with a short frame is oversized,
    # not truncated.
    with pytest.raises(OversizedFrame):
        wire.decode(declaring(1 << 40, b"x"), run_id=RUN, expected_shapes=shapes_for)
    with pytest.raises(TruncatedFrame):
        wire.decode(declaring(limit, b"x"), run_id=RUN, expected_shapes=shapes_for)


def _traced_peak(fn: Callable[[], object]) -> int:
    tracemalloc.start()
    try:
        fn()
        return tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()


def test_a_valid_payload_is_decoded_without_copying_it() -> None:
    rng = np.random.default_rng(1)
    ts = [rng.normal(scale=1e-3, size=s).astype(np.float32) for s in SHAPES]
    frames = wire.encode(delta_header(), ts)
    views = [memoryview(f) for f in frames]
    msg = wire.decode(views, run_id=RUN, expected_shapes=shapes_for)
    assert msg.tensors is not None
    np.testing.assert_allclose(msg.tensors[0], ts[0], atol=1e-3)
    # what the codec needs to decode (raw buffer, tensors, its temporaries), and no second
    # copy of the payload on top
    codec_peak = _traced_peak(lambda: codec.decode(frames[1], SHAPES, "int4"))
    wire_peak = _traced_peak(lambda: wire.decode(views, run_id=RUN, expected_shapes=shapes_for))
    assert wire_peak < codec_peak + len(frames[1]) // 4, (wire_peak, codec_peak, len(frames[1]))
    assert wire.message_nbytes(views) == wire.message_nbytes(frames)


def test_shard_counts_a_declared_oversize() -> None:
    with shard_core({**TINY, "sync.codec_up": "int4"}) as (core, store, _):
        shapes = core.layout.shapes(0)
        n = core.layout.n_values(0)
        limit = wire.max_payload_bytes(n, "int4")
        frames = declaring(limit + 1, bytes(limit + 1), frag=0, shapes=shapes)
        frames[0] = wire._pack(replace(wire.decode_header(frames[0]), run=core.run_id))
        assert core.handle(frames) == []
        assert core.drops == {"oversized": 1}
        assert store.counters("drops") == {"oversized": 1}


@pytest.fixture
def curve_pair(tmp_path: Path) -> Iterator[tuple[zmq.Context, Path]]:
    keys_dir = tmp_path / "keys"
    for name in ("shard-0", "learner-0"):
        security.create_keys(keys_dir, name)
    ctx = zmq.Context()
    auth = security.Authenticator(ctx, keys_dir)
    auth.start()
    try:
        yield ctx, keys_dir
    finally:
        auth.stop()
        ctx.destroy(linger=0)


def _ends(ctx: zmq.Context, keys_dir: Path, max_msg: int) -> tuple[ShardSockets, DeltaPush]:
    socks = ShardSockets(ctx, max_msg, curve=security.load_keys(keys_dir, "shard-0"))
    push = DeltaPush(ctx, max_msg, security.ClientKeys(
        security.load_keys(keys_dir, "learner-0"), keys_dir))
    push.update({0: socks.pull_endpoint})
    return socks, push


def _send(push: DeltaPush, frames: list[bytes]) -> None:
    for _ in range(5000):  # a PUSH has no peer to queue for until the handshake is done
        if push.send(0, frames):
            return
        time.sleep(0.002)
    raise AssertionError("the PUSH socket never took the message")


def test_a_20_mb_delta_round_trips_over_curve(curve_pair: tuple[zmq.Context, Path]) -> None:
    ctx, keys_dir = curve_pair
    shapes = [(2800, 2000)]  # 5.6 M values: 22.4 MB as fp32, about 20.7 MB compressed
    rng = np.random.default_rng(2)
    ts = [rng.normal(size=s).astype(np.float32) for s in shapes]
    frames = wire.encode(delta_header(codec="fp32"), ts)
    assert len(frames[1]) > 20_000_000
    socks, push = _ends(ctx, keys_dir, max_message_bytes(5_600_000, ["fp32"]))
    try:
        _send(push, frames)
        got = socks.recv(30_000)
        assert got is not None and socks.last_peer == "learner-0"
        assert all(isinstance(f, memoryview) for f in got)  # handed over without a copy
        msg = wire.decode(got, run_id=RUN, expected_shapes=lambda h: shapes,
                          allowed_codecs=["fp32"])
        assert msg.tensors is not None
        np.testing.assert_array_equal(msg.tensors[0], ts[0])
    finally:
        push.close()
        socks.close()


def test_maxmsgsize_is_the_socket_cap_over_curve(curve_pair: tuple[zmq.Context, Path]) -> None:
    ctx, keys_dir = curve_pair
    max_msg = max_message_bytes(N, ["int4"])
    bound = wire.max_frame_bytes(N, ["int4"])
    socks, push = _ends(ctx, keys_dir, max_msg)
    try:
        # a frame of exactly the manifest's bound arrives (and then fails the codec's checks)
        edge = declaring(bound, bytes(bound))
        _send(push, edge)
        got = socks.recv(30_000)
        assert got is not None and memoryview(got[1]).nbytes == bound
        with pytest.raises(CodecError):
            wire.decode(got, run_id=RUN, expected_shapes=shapes_for)
        # a frame beyond MAXMSGSIZE never reaches the application: libzmq drops the connection
        # (the sender reconnects), and the next message is the one that arrives
        _send(push, declaring(max_msg + 1, bytes(max_msg + 1)))
        time.sleep(0.5)
        small = wire.encode(Header(kind=Kind.CONTROL, run=RUN, sender="learner-0", inc=1,
                                   seq=2, frag=0, extra={"action": "join"}))
        _send(push, small)
        got = socks.recv(30_000)
        assert got is not None and wire.decode(got, run_id=RUN).kind == Kind.CONTROL
    finally:
        push.close()
        socks.close()
