"""The wire format: round trips and every bad frame, each a named error."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import zstandard

from ddiloco.pipeline import codec, wire
from ddiloco.pipeline.errors import (
    ChecksumMismatch,
    CodecError,
    FrameError,
    NonFinite,
    OversizedFrame,
    SchemaMismatch,
    TruncatedFrame,
    UnsupportedVersion,
    WireError,
    WrongRun,
)
from ddiloco.pipeline.wire import Header, Kind

RUN = "run-test"
SHAPES = [(4, 8), (8,)]


def shapes_for(h: Header) -> list[tuple[int, ...]] | None:
    return SHAPES if h.frag == 3 else None


def delta_header(**kw: object) -> Header:
    base = dict(kind=Kind.DELTA, run=RUN, sender="learner-1", inc=2, seq=7, frag=3, base=5,
                c_steps=24, c_tokens=49152, new_tokens=49152, step=240, step_time=0.05,
                codec="int4")
    base.update(kw)
    return Header(**base)  # type: ignore[arg-type]


def tensors() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.normal(size=s).astype(np.float32) for s in SHAPES]


@pytest.mark.parametrize("codec", ["fp32", "bf16", "int8", "int4"])
def test_round_trip(codec: str) -> None:
    ts = tensors()
    frames = wire.encode(delta_header(codec=codec), ts)
    assert len(frames) == 2
    msg = wire.decode(frames, run_id=RUN, expected_shapes=shapes_for)
    h = msg.header
    assert (h.kind, h.sender, h.inc, h.seq, h.frag, h.base) == (Kind.DELTA, "learner-1", 2, 7, 3, 5)
    assert (h.c_steps, h.c_tokens, h.codec, h.shapes) == (24, 49152, codec, tuple(SHAPES))
    assert h.len == len(frames[1]) and h.crc == wire.payload_crc(frames[1])
    assert msg.tensors is not None
    tol = {"fp32": 0, "bf16": 1e-2, "int8": 2e-2, "int4": 0.5}[codec]
    for a, b in zip(ts, msg.tensors, strict=True):
        assert a.shape == b.shape
        np.testing.assert_allclose(a, b, atol=tol * float(np.abs(a).max()) + 1e-7)


@pytest.mark.parametrize("name", ["topk-d2-b2", "topk-d50-b3", "topk-d0.5-b8"])
def test_topk_round_trip(name: str) -> None:
    # Any valid topk name passes the default codec check, not only the examples in CODECS.
    ts = tensors()
    msg = wire.decode(wire.encode(delta_header(codec=name), ts), run_id=RUN,
                      expected_shapes=shapes_for)
    assert msg.header.codec == name and msg.tensors is not None
    for a, b in zip(codec.quantize_roundtrip(ts, name), msg.tensors, strict=True):
        np.testing.assert_array_equal(a, b)


def test_unknown_codec_is_a_schema_mismatch() -> None:
    for name in ("int2", "topk-d0-b2", "topk-d2.0-b2"):
        with pytest.raises(SchemaMismatch, match="codec"):
            wire.decode(with_header(codec=name), run_id=RUN, expected_shapes=shapes_for)
    with pytest.raises(SchemaMismatch, match="not allowed"):
        wire.decode(wire.encode(delta_header(codec="topk-d2-b2"), tensors()), run_id=RUN,
                    expected_shapes=shapes_for, allowed_codecs=("topk-d5-b4",))


def test_no_payload_messages() -> None:
    frames = wire.encode(Header(kind=Kind.HEARTBEAT, run=RUN, sender="shard-0",
                                extra={"versions": {"0": 3}}))
    assert len(frames) == 1
    msg = wire.decode(frames, run_id=RUN)
    assert msg.tensors is None and msg.header.extra == {"versions": {"0": 3}}


def good() -> list[bytes]:
    return wire.encode(delta_header(), tensors())


def with_header(**changes: object) -> list[bytes]:
    frames = good()
    h = msgpack.unpackb(frames[0])
    h.update(changes)
    return [msgpack.packb(h), frames[1]]


@pytest.mark.parametrize(
    ("frames", "error"),
    [
        ([], FrameError),
        ([b"a", b"b", b"c"], FrameError),
        ([b"\xc1\xc1garbage"], FrameError),
        ([msgpack.packb([1, 2, 3])], FrameError),
        ([b"x" * (wire.MAX_HEADER_BYTES + 1)], OversizedFrame),
    ],
)
def test_garbage_frames(frames: list[bytes], error: type[WireError]) -> None:
    with pytest.raises(error):
        wire.decode(frames, run_id=RUN, expected_shapes=shapes_for)


def test_unknown_format_version() -> None:
    with pytest.raises(UnsupportedVersion):
        wire.decode(with_header(fv=99), run_id=RUN, expected_shapes=shapes_for)
    # Version 1 predates the topk codecs, version 2 checksums with zlib's CRC-32.
    assert wire.FORMAT_VERSION == 3
    for old in (1, 2):
        with pytest.raises(UnsupportedVersion):
            wire.decode(with_header(fv=old), run_id=RUN, expected_shapes=shapes_for)


def test_the_payload_checksum_is_crc32c() -> None:
    # The CRC-32C check value (RFC 3720, B.4): "123456789" -> 0xE3069283.
    assert wire.payload_crc(b"123456789") == 0xE3069283
    assert wire.payload_crc(memoryview(b"123456789")) == 0xE3069283


def test_other_run() -> None:
    with pytest.raises(WrongRun):
        wire.decode(good(), run_id="another-run", expected_shapes=shapes_for)


def test_wrong_types_and_kind() -> None:
    with pytest.raises(FrameError, match="seq"):
        wire.decode(with_header(seq="7"), run_id=RUN, expected_shapes=shapes_for)
    with pytest.raises(FrameError, match="kind"):
        wire.decode(with_header(kind=42), run_id=RUN, expected_shapes=shapes_for)
    with pytest.raises(FrameError, match="shapes"):
        wire.decode(with_header(shapes=[[-1]]), run_id=RUN, expected_shapes=shapes_for)


def test_truncated_and_missing_payload() -> None:
    frames = good()
    with pytest.raises(TruncatedFrame):
        wire.decode([frames[0], frames[1][:-5]], run_id=RUN, expected_shapes=shapes_for)
    with pytest.raises(TruncatedFrame):
        wire.decode([frames[0]], run_id=RUN, expected_shapes=shapes_for)
    with pytest.raises(OversizedFrame):
        wire.decode([frames[0], frames[1] + b"\0"], run_id=RUN, expected_shapes=shapes_for)


def test_corrupt_payload_checksum() -> None:
    frames = good()
    bad = bytearray(frames[1])
    bad[len(bad) // 2] ^= 0xFF
    with pytest.raises(ChecksumMismatch):
        wire.decode([frames[0], bytes(bad)], run_id=RUN, expected_shapes=shapes_for)


def test_shape_and_fragment_not_in_manifest() -> None:
    with pytest.raises(SchemaMismatch):
        wire.decode(wire.encode(delta_header(frag=9), tensors()), run_id=RUN,
                    expected_shapes=shapes_for)
    wrong = [np.zeros((4, 9), np.float32), np.zeros(8, np.float32)]
    with pytest.raises(SchemaMismatch):
        wire.decode(wire.encode(delta_header(), wrong), run_id=RUN, expected_shapes=shapes_for)
    with pytest.raises(SchemaMismatch, match="codec"):
        wire.decode(good(), run_id=RUN, expected_shapes=shapes_for, allowed_codecs=("fp32",))


def test_decompression_bomb_is_refused() -> None:
    # A valid frame whose declared content is 64 MiB of zeros: tiny on the wire.
    bomb = zstandard.ZstdCompressor(write_content_size=True).compress(b"\0" * (64 << 20))
    frames = with_header(len=len(bomb), crc=wire.payload_crc(bomb), codec="fp32")
    with pytest.raises((OversizedFrame, CodecError)):
        wire.decode([frames[0], bomb], run_id=RUN, expected_shapes=shapes_for)


def test_oversized_declared_payload() -> None:
    big = b"\0" * 100_000
    frames = with_header(len=len(big), crc=wire.payload_crc(big))
    with pytest.raises(OversizedFrame):
        wire.decode([frames[0], big], run_id=RUN, expected_shapes=shapes_for)


def test_nan_payload() -> None:
    ts = tensors()
    ts[0][0, 0] = np.nan
    frames = wire.encode(delta_header(codec="fp32"), ts)
    with pytest.raises(NonFinite):
        wire.decode(frames, run_id=RUN, expected_shapes=shapes_for)
