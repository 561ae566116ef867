"""Tests of pipeline.codec: layouts, error bounds, bounded decoding and error feedback."""

from __future__ import annotations

import math
import tracemalloc
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest
import zstandard

from ddiloco.pipeline import codec
from ddiloco.pipeline import quantize as quantize_mod
from ddiloco.pipeline.codec import (
    CODECS,
    DEFAULT_BLOCK,
    DENSE_CODECS,
    TOPK_CHUNK,
    ErrorFeedback,
    decode,
    dequantize,
    encode,
    encode_and_reconstruct,
    is_codec,
    max_payload_size,
    parse_topk,
    quantize,
    quantize_roundtrip,
    raw_size,
    topk_keep,
    unknown_codec_message,
)
from ddiloco.pipeline.errors import (
    ChecksumMismatch,
    CodecError,
    NonFinite,
    OversizedFrame,
    TruncatedFrame,
    WireError,
)

SHAPE_SETS: list[list[tuple[int, ...]]] = [
    [()],
    [(1,)],
    [(7,)],
    [(63,)],
    [(64,)],
    [(65,)],
    [(129,)],
    [(3, 5)],
    [(8, 16)],
    [(2, 3, 11)],
    [(), (5,), (4, 33), (0,), (2, 2, 2)],
    [(0,)],
    [],
]


def _rand(
    shapes: Sequence[tuple[int, ...]], seed: int = 0, scale: float = 1e-3
) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [(rng.standard_normal(s) * scale).astype(np.float32) for s in shapes]


def _raw(payload: bytes) -> bytes:
    return zstandard.ZstdDecompressor().decompress(payload)


def _frame(raw: bytes | np.ndarray, **kwargs: object) -> bytes:
    params: dict[str, object] = {"level": 1, "write_checksum": True}
    params.update(kwargs)
    data = raw.tobytes() if isinstance(raw, np.ndarray) else raw
    return zstandard.ZstdCompressor(**params).compress(data)  # type: ignore[arg-type]


def _block_bound(x: np.ndarray, k: int, block: int) -> np.ndarray:
    """Per-value bound scale/2 with scale = block max|x| / k, in float64."""
    flat = np.abs(x.astype(np.float64).ravel())
    n_blocks = -(-flat.size // block)
    pad = np.zeros(n_blocks * block)
    pad[: flat.size] = flat
    scale = pad.reshape(n_blocks, block).max(axis=1) / k
    return np.repeat(scale / 2, block)[: flat.size]


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("n", "codec_name", "block", "expected"),
    [
        (0, "fp32", 64, 0),
        (0, "int4", 64, 0),
        (10, "fp32", 64, 40),
        (10, "bf16", 64, 20),
        (10, "int8", 64, 4 + 10),
        (10, "int4", 64, 4 + 5),
        (11, "int4", 64, 4 + 6),
        (64, "int8", 64, 4 + 64),
        (65, "int8", 64, 8 + 65),
        (65, "int4", 64, 8 + 33),
        (1000, "int4", 16, 4 * 63 + 500),
        (1, "int8", 1, 5),
    ],
)
def test_raw_size(n: int, codec_name: str, block: int, expected: int) -> None:
    assert raw_size(n, codec_name, block) == expected


def test_raw_size_rejects_bad_arguments() -> None:
    with pytest.raises(ValueError):
        raw_size(10, "int2")
    with pytest.raises(ValueError):
        raw_size(-1, "fp32")
    with pytest.raises(ValueError):
        raw_size(10, "int8", 0)


@pytest.mark.parametrize("codec_name", CODECS)
@pytest.mark.parametrize("shapes", SHAPE_SETS, ids=str)
def test_raw_size_matches_quantize(codec_name: str, shapes: list[tuple[int, ...]]) -> None:
    n = sum(math.prod(s) for s in shapes)
    raw = quantize(_rand(shapes), codec_name)
    assert raw.dtype == np.uint8
    assert raw.size == raw_size(n, codec_name)
    assert len(_raw(encode(_rand(shapes), codec_name))) == raw_size(n, codec_name)


@pytest.mark.parametrize("codec_name", CODECS)
def test_payload_within_max_payload_size(codec_name: str) -> None:
    # Uniform random bits: incompressible, the worst case for zstd.
    rng = np.random.default_rng(1)
    for n in (0, 1, 1000, 300_000):
        x = rng.uniform(-1, 1, n).astype(np.float32)
        assert len(encode([x], codec_name)) <= max_payload_size(n, codec_name)


# --------------------------------------------------------------------------------------------
# Round trips
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("codec_name", CODECS)
@pytest.mark.parametrize("shapes", SHAPE_SETS, ids=str)
def test_round_trip(codec_name: str, shapes: list[tuple[int, ...]]) -> None:
    xs = _rand(shapes)
    out = decode(encode(xs, codec_name), shapes, codec_name)
    assert len(out) == len(shapes)
    for x, y in zip(xs, out, strict=True):
        assert y.shape == x.shape
        assert y.dtype == np.float32
        assert y.flags.c_contiguous and y.flags.writeable
    # Bit-identical to what the syncer stores.
    for y, r in zip(out, quantize_roundtrip(xs, codec_name), strict=True):
        np.testing.assert_array_equal(y, r)
    payload, rec = encode_and_reconstruct(xs, codec_name)
    assert _raw(payload) == _raw(encode(xs, codec_name))
    for y, r in zip(out, rec, strict=True):
        np.testing.assert_array_equal(y, r)


@pytest.mark.parametrize("codec_name", CODECS)
def test_all_zeros(codec_name: str) -> None:
    xs = [np.zeros((3, 70), np.float32), np.zeros((), np.float32)]
    out = decode(encode(xs, codec_name), [(3, 70), ()], codec_name)
    for y in out:
        assert not y.any()
    if codec_name in ("int8", "int4"):
        n_blocks = -(-211 // DEFAULT_BLOCK)
        assert not np.frombuffer(_raw(encode(xs, codec_name)), "<f4", n_blocks).any()


def test_fp32_exact() -> None:
    xs = [*_rand([(5, 7), (13,)], scale=1e30), np.array([0.0, -0.0, 1e-45, 3.4e38], np.float32)]
    out = decode(encode(xs, "fp32"), [x.shape for x in xs], "fp32")
    for x, y in zip(xs, out, strict=True):
        assert x.tobytes() == y.tobytes()


def test_fp32_layout_is_little_endian_values() -> None:
    x = np.array([1.5, -2.0, 3.25], np.float32)
    assert _raw(encode([x], "fp32")) == x.astype("<f4").tobytes()


def test_bf16_layout_and_bound() -> None:
    x = np.array([1.0, 1.0 + 2**-8, 1.0 + 3 * 2**-8, -3.0, 1e-3], np.float32)
    raw = _raw(encode([x], "bf16"))
    assert raw == x.astype(ml_dtypes.bfloat16).view("<u2").tobytes()
    # Ties round to even: 1 + 2^-8 -> 1, 1 + 3·2^-8 -> 1 + 2^-6.
    np.testing.assert_array_equal(
        np.frombuffer(raw, "<u2")[:3], np.array([0x3F80, 0x3F80, 0x3F82], np.uint16)
    )
    y = _rand([(10_000,)], seed=3, scale=1.0)[0]
    (z,) = decode(encode([y], "bf16"), [y.shape], "bf16")
    rel = np.abs(z.astype(np.float64) - y) / np.abs(y.astype(np.float64))
    assert rel.max() <= 2**-8


@pytest.mark.parametrize(("codec_name", "k"), [("int8", 127), ("int4", 7)])
@pytest.mark.parametrize("block", [1, 7, 64, 256])
def test_int_error_bound(codec_name: str, k: int, block: int) -> None:
    rng = np.random.default_rng(4)
    # Mixed magnitudes per block, so that a wrong per-block scale would show.
    x = (rng.standard_normal(5003) * np.exp(rng.uniform(-20, 5, 5003))).astype(np.float32)
    (y,) = decode(encode([x], codec_name, block=block), [x.shape], codec_name, block=block)
    err = np.abs(y.astype(np.float64) - x)
    bound = _block_bound(x, k, block)
    # Slack for float32 rounding of the scale, of x·(k/max) and of q·scale.
    assert (err <= bound * (1 + 1e-6) + np.abs(x) * 2**-22).all()
    # The block max is reproduced within rounding: the scale is not wasted.
    assert np.abs(y).max() == pytest.approx(np.abs(x).max(), rel=1e-6)


def test_int8_hand_computed() -> None:
    # Block 4: [1.27, -0.5, 0.25, 0] -> s = 0.01, q = [127, -50, 25, 0];
    # partial block [0.03, -0.0101] -> s = 0.03/127, q = [127, round(-42.757) = -43].
    x = np.array([1.27, -0.5, 0.25, 0.0, 0.03, -0.0101], np.float32)
    raw = _raw(encode([x], "int8", block=4))
    assert len(raw) == 2 * 4 + 6
    scales = np.frombuffer(raw, "<f4", 2)
    np.testing.assert_allclose(scales, [0.01, 0.03 / 127], rtol=1e-6)
    np.testing.assert_array_equal(
        np.frombuffer(raw, np.int8, offset=8), np.array([127, -50, 25, 0, 127, -43], np.int8)
    )
    (y,) = decode(encode([x], "int8", block=4), [(6,)], "int8", block=4)
    np.testing.assert_allclose(y, [1.27, -0.5, 0.25, 0.0, 0.03, -43 * 0.03 / 127], rtol=1e-6)


def test_int4_hand_computed() -> None:
    # Block 4: [1.4, -1.0, 0.62, 0] -> s = 0.2, q = [7, -5, 3 (3.1), 0];
    # partial block [-0.35, 0.07] -> s = 0.05, q = [-7, 1 (1.4)].
    # Two's complement nibbles 7, B, 3, 0, 9, 1 packed low first -> B7 03 19.
    x = np.array([1.4, -1.0, 0.62, 0.0, -0.35, 0.07], np.float32)
    raw = _raw(encode([x], "int4", block=4))
    assert len(raw) == 2 * 4 + 3
    np.testing.assert_allclose(np.frombuffer(raw, "<f4", 2), [0.2, 0.05], rtol=1e-6)
    assert raw[8:] == bytes([0xB7, 0x03, 0x19])
    (y,) = decode(encode([x], "int4", block=4), [(6,)], "int4", block=4)
    np.testing.assert_allclose(y, [1.4, -1.0, 0.6, 0.0, -0.35, 0.05], rtol=1e-6)


def test_int4_odd_count_pads_with_zero_nibble() -> None:
    x = np.array([-0.7, 0.1, 0.3], np.float32)  # s = 0.1, q = [-7, 1, 3]
    raw = _raw(encode([x], "int4", block=8))
    assert raw[4:] == bytes([0x19, 0x03])


def test_multiple_arrays_concatenate_in_order() -> None:
    a = np.arange(6, dtype=np.float32).reshape(2, 3)
    b = np.arange(6, 10, dtype=np.float32)
    assert _raw(encode([a, b], "fp32")) == np.arange(10, dtype="<f4").tobytes()
    # Non-contiguous inputs are flattened in C order.
    c = np.arange(12, dtype=np.float32).reshape(3, 4).T
    assert _raw(encode([c], "fp32")) == np.ascontiguousarray(c).astype("<f4").tobytes()


def test_concurrent_threads() -> None:
    # Per-thread zstd contexts: concurrent calls must not corrupt each other.
    xs = [_rand([(5000,)], seed=s) for s in range(8)]

    def work(i: int) -> bool:
        name = CODECS[i % len(CODECS)]
        for _ in range(5):
            out = decode(encode(xs[i], name), [(5000,)], name)
            if not np.array_equal(out[0], quantize_roundtrip(xs[i], name)[0]):
                return False
        return True

    with ThreadPoolExecutor(max_workers=4) as pool:
        assert all(pool.map(work, range(8)))


def test_roundtrip_does_not_alias_inputs() -> None:
    x = np.ones(10, np.float32)
    (y,) = quantize_roundtrip([x], "fp32")
    y[0] = 5.0
    assert x[0] == 1.0


def test_tiny_blocks_flush_to_zero() -> None:
    x = np.array([1e-40, -1e-41, 0.0, 1e-45], np.float32)
    for name in ("int8", "int4"):
        (y,) = decode(encode([x], name, block=4), [(4,)], name, block=4)
        assert np.isfinite(y).all()
        assert np.abs(y - x).max() <= 1e-39


def test_huge_values_decode_finite() -> None:
    x = np.array([3.4e38, -3.4e38, 1.0], np.float32)
    for name in ("int8", "int4"):
        (y,) = decode(encode([x], name), [(3,)], name)
        assert np.isfinite(y).all()
        np.testing.assert_allclose(y[:2], x[:2], rtol=1e-6)


def test_encode_rejects_bad_input() -> None:
    x = np.ones(4, np.float32)
    with pytest.raises(ValueError):
        encode([x], "int2")
    with pytest.raises(ValueError):
        encode([x], "int8", block=0)
    with pytest.raises(ValueError):
        encode([x], "int8", level=99)
    with pytest.raises(TypeError):
        encode([np.ones(4, np.float64)], "fp32")
    for name in ("int8", "int4"):
        with pytest.raises(NonFinite):
            encode([np.array([1.0, np.nan], np.float32)], name)
        with pytest.raises(NonFinite):
            quantize_roundtrip([np.array([np.inf], np.float32)], name)


# --------------------------------------------------------------------------------------------
# Bad payloads
# --------------------------------------------------------------------------------------------


@pytest.fixture(params=["one-shot", "streamed"])
def path(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each bad payload goes through both decompression paths: the streamed one (large
    frames, :func:`ddiloco.pipeline.codec.frame_size` first) must refuse what the one-shot
    call refuses, with the same error."""
    if request.param == "streamed":
        monkeypatch.setattr(codec, "STREAM_MIN", 0)
    return str(request.param)


@pytest.fixture
def good(path: str) -> tuple[bytes, list[tuple[int, ...]]]:
    shapes: list[tuple[int, ...]] = [(100, 50), (37,)]
    return encode(_rand(shapes, seed=9), "int4"), shapes


def test_unknown_codec_on_decode(good: tuple[bytes, list[tuple[int, ...]]]) -> None:
    payload, shapes = good
    with pytest.raises(CodecError):
        decode(payload, shapes, "int2")
    with pytest.raises(CodecError):
        decode(payload, shapes, "int4", block=0)
    with pytest.raises(CodecError):
        decode(payload, [(-1, 5)], "int4")


@pytest.mark.parametrize("cut", [1, 5, 100, 4])
def test_truncated(good: tuple[bytes, list[tuple[int, ...]]], cut: int) -> None:
    payload, shapes = good
    with pytest.raises(TruncatedFrame):
        decode(payload[:-cut], shapes, "int4")


@pytest.mark.parametrize("keep", [0, 3, 5])
def test_truncated_header(good: tuple[bytes, list[tuple[int, ...]]], keep: int) -> None:
    payload, shapes = good
    with pytest.raises(TruncatedFrame):
        decode(payload[:keep], shapes, "int4")


def test_flipped_checksum_byte(good: tuple[bytes, list[tuple[int, ...]]]) -> None:
    payload, shapes = good
    bad = payload[:-2] + bytes([payload[-2] ^ 0x40]) + payload[-1:]
    with pytest.raises(ChecksumMismatch):
        decode(bad, shapes, "int4")


def test_flipped_content_byte(path: str) -> None:
    # fp32 noise is stored in raw zstd blocks: a flipped byte there changes the content only.
    x = np.random.default_rng(2).uniform(-1, 1, 4096).astype(np.float32)
    payload = encode([x], "fp32")
    for pos in (len(payload) // 2, len(payload) - 40):
        bad = payload[:pos] + bytes([payload[pos] ^ 0x01]) + payload[pos + 1 :]
        with pytest.raises(ChecksumMismatch):
            decode(bad, [x.shape], "fp32")


@pytest.mark.parametrize("pos", range(0, 400, 37))
def test_any_flipped_byte_is_a_wire_error(
    good: tuple[bytes, list[tuple[int, ...]]], pos: int
) -> None:
    payload, shapes = good
    bad = payload[:pos] + bytes([payload[pos] ^ 0xFF]) + payload[pos + 1 :]
    with pytest.raises(WireError):
        decode(bad, shapes, "int4")


def test_garbage_and_trailing_data(good: tuple[bytes, list[tuple[int, ...]]]) -> None:
    payload, shapes = good
    with pytest.raises(CodecError):
        decode(b"not a zstd frame at all", shapes, "int4")
    with pytest.raises(CodecError):
        decode(payload + b"\x00", shapes, "int4")
    with pytest.raises(CodecError):
        decode(payload + payload, shapes, "int4")


def test_missing_content_size() -> None:
    x = _rand([(300,)])
    raw = quantize(x, "int8")
    with pytest.raises(CodecError, match="content size"):
        decode(_frame(raw, write_content_size=False), [(300,)], "int8")


def test_missing_checksum(path: str) -> None:
    x = _rand([(300,)])
    with pytest.raises(CodecError, match="checksum"):
        decode(_frame(quantize(x, "int8"), write_checksum=False), [(300,)], "int8")


def test_oversized_declared_content() -> None:
    payload = encode(_rand([(100,)]), "fp32")
    with pytest.raises(OversizedFrame):
        decode(payload, [(50,)], "fp32")


def test_smaller_declared_content() -> None:
    payload = encode(_rand([(50,)]), "fp32")
    with pytest.raises(CodecError):
        decode(payload, [(100,)], "fp32")


def test_decompression_bomb_rejected_before_allocating() -> None:
    bomb = _frame(bytes(100 << 20))  # 100 MB of zeros in a few KB
    assert len(bomb) < 100_000
    tracemalloc.start()
    try:
        with pytest.raises(OversizedFrame):
            decode(bomb, [(10,)], "fp32")
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    # Rejected from the declared size, before decompressing: under 1 MB ever allocated (not a
    # wall-clock bound, which a loaded machine would break and a fast one would not need).
    assert peak < 1 << 20


def _with_window(frame: bytes, window_log: int) -> bytes:
    """Rewrite a single-segment frame's header to declare a window of 2**window_log bytes.

    Header layout per RFC 8878 §3.1.1.1: magic, descriptor, window descriptor, FCS field.
    """
    content = zstandard.get_frame_parameters(frame).content_size
    assert 256 <= content < 65536 + 256  # 2-byte FCS field, stored minus 256
    descriptor = (1 << 6) | (1 << 2)  # FCS field size 2, not single segment, checksum
    window = (window_log - 10) << 3
    header = zstandard.MAGIC_NUMBER.to_bytes(4, "little") + bytes([descriptor, window])
    header += (content - 256).to_bytes(2, "little")
    return header + frame[zstandard.frame_header_size(frame) :]


def test_window_above_cap_is_oversized() -> None:
    shapes = [(100,)]
    frame = encode(_rand(shapes), "fp32")
    ok = _with_window(frame, 23)
    assert zstandard.get_frame_parameters(ok).window_size == codec.MIN_WINDOW
    decode(ok, shapes, "fp32")  # the rewrite itself is valid
    big = _with_window(frame, 24)
    with pytest.raises(OversizedFrame, match="window"):
        decode(big, shapes, "fp32")


@pytest.mark.parametrize("name", ["fp32", "bf16"])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_nonfinite_values(name: str, bad: float) -> None:
    x = np.array([1.0, 2.0, bad, 4.0], np.float32)
    payload = encode([x], name)
    with pytest.raises(NonFinite):
        decode(payload, [(4,)], name)
    with pytest.raises(NonFinite):
        quantize_roundtrip([x], name)


def test_bf16_overflow_is_nonfinite() -> None:
    payload = encode([np.array([3.4e38], np.float32)], "bf16")
    with pytest.raises(NonFinite):
        decode(payload, [(1,)], "bf16")


def _int_raw(scales: list[float], codes: bytes) -> bytes:
    return np.array(scales, "<f4").tobytes() + codes


@pytest.mark.parametrize("scale", [-1.0, np.nan, np.inf, -np.inf, 3.0e38, -0.0001])
@pytest.mark.parametrize("name", ["int8", "int4"])
def test_invalid_scale(name: str, scale: float) -> None:
    n = 8
    codes = bytes(n) if name == "int8" else bytes(n // 2)
    raw = _int_raw([0.5, scale], codes)
    with pytest.raises(CodecError):
        decode(_frame(raw), [(n,)], name, block=4)
    with pytest.raises(CodecError):
        dequantize(raw, [(n,)], name, block=4)


def test_negative_zero_scale_is_valid() -> None:
    raw = _int_raw([-0.0], bytes([1, 2]))
    (y,) = dequantize(raw, [(2,)], "int8", block=4)
    assert not y.any()


def test_out_of_range_codes() -> None:
    with pytest.raises(CodecError):
        decode(_frame(_int_raw([1.0], bytes([0, 0x80]))), [(2,)], "int8", block=4)
    with pytest.raises(CodecError):  # nibble 8 = -8
        decode(_frame(_int_raw([1.0], bytes([0x80]))), [(2,)], "int4", block=4)
    with pytest.raises(CodecError):  # odd count: the pad nibble must be 0
        decode(_frame(_int_raw([1.0], bytes([0x11, 0x10]))), [(3,)], "int4", block=4)
    (y,) = decode(_frame(_int_raw([1.0], bytes([0x7F, 0x09]))), [(3,)], "int4", block=4)
    np.testing.assert_array_equal(y, [-1.0, 7.0, -7.0])


def test_dequantize_wrong_raw_size() -> None:
    with pytest.raises(CodecError):
        dequantize(b"\x00" * 7, [(2,)], "fp32")


# --------------------------------------------------------------------------------------------
# topk
# --------------------------------------------------------------------------------------------

TOPK_NAMES = [
    "topk-d1-b2",
    "topk-d2-b2",
    "topk-d5-b4",
    "topk-d0.5-b3",
    "topk-d30-b8",
    "topk-d100-b3",
]


@pytest.mark.parametrize(
    ("name", "parsed"),
    [
        ("topk-d2-b2", (2.0, 2)),
        ("topk-d5-b4", (5.0, 4)),
        ("topk-d0.5-b2", (0.5, 2)),
        ("topk-d100-b8", (100.0, 8)),
        ("topk-d12.25-b3", (12.25, 3)),
        ("topk-d0.000001-b4", (1e-6, 4)),
        ("topk-d99.999999-b2", (99.999999, 2)),
    ],
)
def test_topk_names_accepted(name: str, parsed: tuple[float, int]) -> None:
    assert parse_topk(name) == parsed
    assert is_codec(name)
    raw_size(10, name)  # accepted wherever a codec name is checked


@pytest.mark.parametrize(
    "name",
    [
        "topk-d0-b2",
        "topk-d101-b2",
        "topk-d100.5-b2",
        "topk-d2-b5",
        "topk-d2-b1",
        "topk-d2-b16",
        "topk-x",
        "topk-d2",
        "topk-d-b2",
        "topk-d2-b",
        "topk-d.5-b2",
        "topk-d2.-b2",
        "topk-d2.0-b2",  # one codec, one name: no trailing zeros
        "topk-d02-b2",
        "topk-d0.50-b2",
        "topk-d2-b02",
        "topk-d0.0000001-b2",  # seven decimals
        "topk-d-2-b2",
        "topk-d1e1-b2",
        "TOPK-d2-b2",
        " topk-d2-b2",
        "topk-d2-b2\n",
        "topk-d2-b2-",
        "topk-d٢-b2",  # non-ASCII digit
        "int2",
        "",
    ],
)
def test_topk_names_rejected(name: str) -> None:
    assert parse_topk(name) is None
    assert not is_codec(name)
    with pytest.raises(ValueError, match="topk-d<density %>-b<bits>"):
        raw_size(10, name)
    with pytest.raises(ValueError):
        encode([np.ones(3, np.float32)], name)
    with pytest.raises(CodecError):
        decode(encode([np.ones(3, np.float32)], "fp32"), [(3,)], name)


def test_is_codec_and_message() -> None:
    assert all(is_codec(c) for c in (*DENSE_CODECS, *CODECS))
    assert set(DENSE_CODECS) <= set(CODECS)
    assert any(parse_topk(c) for c in CODECS)  # the documented examples are valid
    for value in (None, 2, b"topk-d2-b2", ["fp32"], 2.5):
        assert not is_codec(value)
        assert parse_topk(value) is None
    msg = unknown_codec_message("int2")
    for part in ("'int2'", "fp32", "bf16", "int8", "int4", "topk-d<density %>-b<bits>", "(0, 100]"):
        assert part in msg
    assert "2, 3, 4, 8" in msg


@pytest.mark.parametrize(
    ("name", "length", "k"),
    [
        ("topk-d2-b2", TOPK_CHUNK, 82),  # ceil(81.92)
        ("topk-d1-b2", TOPK_CHUNK, 41),  # ceil(40.96)
        ("topk-d5-b4", TOPK_CHUNK, 205),  # ceil(204.8)
        ("topk-d25-b4", TOPK_CHUNK, 1024),  # exact
        ("topk-d10-b2", 4090, 409),  # exact; 0.1 * 4090 in floating point is 409.00000000000006
        ("topk-d0.5-b2", TOPK_CHUNK, 21),
        ("topk-d100-b2", TOPK_CHUNK, TOPK_CHUNK),
        ("topk-d100-b2", 7, 7),
        ("topk-d2-b2", 1, 1),  # at least one
        ("topk-d0.000001-b2", TOPK_CHUNK, 1),
        ("topk-d2-b2", 50, 1),
        ("topk-d2-b2", 51, 2),
        ("topk-d2-b2", 0, 0),
    ],
)
def test_topk_keep(name: str, length: int, k: int) -> None:
    assert topk_keep(name, length) == k


def test_topk_keep_rejects_bad_arguments() -> None:
    for name, length in (
        ("int4", 10),
        ("topk-d0-b2", 10),
        ("topk-d2-b2", -1),
        ("topk-d2-b2", TOPK_CHUNK + 1),
    ):
        with pytest.raises(ValueError):
            topk_keep(name, length)


def _record_size(k: int, bits: int) -> int:
    return 4 + 2 * k + math.ceil(k * bits / 8)


@pytest.mark.parametrize("name", TOPK_NAMES)
@pytest.mark.parametrize("n", [0, 1, 7, 4095, 4096, 4097, 3 * 4096 + 500, 1_000_000])
def test_topk_raw_size(name: str, n: int) -> None:
    parsed = parse_topk(name)
    assert parsed is not None
    bits = parsed[1]
    full, rest = divmod(n, TOPK_CHUNK)
    expected = full * _record_size(topk_keep(name, TOPK_CHUNK), bits)
    if rest:
        expected += _record_size(topk_keep(name, rest), bits)
    assert raw_size(n, name) == expected
    if n <= 20_000:
        assert quantize([_rand([(n,)])[0]], name).size == expected


def _reference_keep(chunk: np.ndarray, k: int) -> np.ndarray:
    """Sorted indices of the k largest |x|, ties to the lower index, by a full sort."""
    order = np.lexsort((np.arange(chunk.size), -np.abs(chunk.astype(np.float64))))
    return np.sort(order[:k])


def _chunks(n: int) -> list[tuple[int, int]]:
    return [(s, min(s + TOPK_CHUNK, n)) for s in range(0, n, TOPK_CHUNK)]


@pytest.mark.parametrize("name", TOPK_NAMES)
@pytest.mark.parametrize(
    "shapes", [[(5,)], [(64, 64)], [(3, 4096), (1000,)], [(2, 2), (), (9001,)]], ids=str
)
def test_topk_round_trip_bound(name: str, shapes: list[tuple[int, ...]]) -> None:
    parsed = parse_topk(name)
    assert parsed is not None
    q = 2 ** parsed[1] - 1
    rng = np.random.default_rng(11)
    # Heavy-tailed magnitudes, so that a wrong scale or selection would show.
    xs = [
        (rng.standard_normal(s) * np.exp(rng.uniform(-8, 2, s))).astype(np.float32) for s in shapes
    ]
    out = decode(encode(xs, name), shapes, name)
    assert [y.shape for y in out] == [x.shape for x in xs]
    for y, r in zip(out, quantize_roundtrip(xs, name), strict=True):
        np.testing.assert_array_equal(y, r)
    x = np.concatenate([a.ravel() for a in xs]).astype(np.float64)
    y = np.concatenate([a.ravel() for a in out]).astype(np.float64)
    for start, stop in _chunks(x.size):
        cx, cy = x[start:stop], y[start:stop]
        k = topk_keep(name, stop - start)
        kept = _reference_keep(cx, k)
        # No level is zero, so the decoded non-zeros are exactly the kept entries.
        np.testing.assert_array_equal(np.flatnonzero(cy), kept)
        s = np.abs(cx).max()
        err = np.abs(cx[kept] - cy[kept])
        assert (err <= s / q * (1 + 1e-6) + s * 2**-22).all()
        assert np.abs(cy).max() == pytest.approx(s, rel=1e-6)  # the scale is the chunk max
        dropped = np.setdiff1d(np.arange(cx.size), kept)
        assert (np.abs(cx[dropped]) <= np.abs(cx[kept]).min()).all()


def test_topk_hand_computed() -> None:
    # density 50% of 6 values: k = 3, the largest |x| at indices 1, 4, 2; s = 0.9.
    # 2-bit levels: -1, -1/3, 1/3, 1 (times s). -0.9 -> 0, 0.7 -> 1 (u = 3), 0.3 -> 1/3 (u = 2).
    x = np.array([0.1, -0.9, 0.3, 0.0, 0.7, -0.2], np.float32)
    raw = _raw(encode([x], "topk-d50-b2"))
    assert len(raw) == 4 + 2 * 3 + 1
    assert np.frombuffer(raw, "<f4", 1)[0] == np.float32(0.9)
    np.testing.assert_array_equal(np.frombuffer(raw, "<u2", 3, offset=4), [1, 1, 2])
    assert raw[10:] == bytes([0 | 2 << 2 | 3 << 4])  # LSB first, top 2 bits unused
    (y,) = decode(encode([x], "topk-d50-b2"), [(6,)], "topk-d50-b2")
    np.testing.assert_allclose(y, [0, -0.9, 0.3, 0, 0.9, 0], rtol=1e-6)
    assert y[0] == 0 and y[3] == 0 and y[5] == 0


def _pack_reference(codes: np.ndarray, bits: int) -> bytes:
    stream = np.unpackbits(codes[:, None].astype(np.uint8), axis=1, count=bits, bitorder="little")
    return np.packbits(stream.ravel(), bitorder="little").tobytes()


@pytest.mark.parametrize("bits", [2, 3, 4, 8])
@pytest.mark.parametrize("k", [1, 2, 3, 5, 7, 8, 9, 16, 17, 82])
def test_topk_code_packing(bits: int, k: int) -> None:
    rng = np.random.default_rng(k * 10 + bits)
    codes = rng.integers(0, 2**bits, (3, k), dtype=np.uint8)
    packed = quantize_mod._pack_codes(codes, bits)
    assert packed.shape == (3, math.ceil(k * bits / 8))
    for row in range(3):
        assert packed[row].tobytes() == _pack_reference(codes[row], bits)
    unpacked = quantize_mod._unpack_codes(np.ascontiguousarray(packed), k, bits)
    np.testing.assert_array_equal(unpacked, codes)


def test_topk_density_100_keeps_all() -> None:
    x = _rand([(2 * TOPK_CHUNK + 3,)], seed=12, scale=1.0)[0]
    name = "topk-d100-b8"
    raw = _raw(encode([x], name))
    gaps = np.frombuffer(raw, "<u2", TOPK_CHUNK, offset=4)
    assert gaps[0] == 0 and (gaps[1:] == 1).all()
    (y,) = decode(encode([x], name), [x.shape], name)
    assert np.count_nonzero(y) == x.size
    for start, stop in _chunks(x.size):
        s = float(np.abs(x[start:stop]).max())
        assert (np.abs(y[start:stop] - x[start:stop]) <= s / 255 * (1 + 1e-6)).all()


def test_topk_partial_last_chunk() -> None:
    x = _rand([(TOPK_CHUNK + 10,)], seed=13)[0]
    x[TOPK_CHUNK + 7] = 0.5  # the largest of the 10-value last chunk, which keeps one
    name = "topk-d2-b2"
    (y,) = decode(encode([x], name), [x.shape], name)
    assert np.count_nonzero(y[:TOPK_CHUNK]) == 82
    np.testing.assert_array_equal(np.flatnonzero(y[TOPK_CHUNK:]), [7])
    assert y[TOPK_CHUNK + 7] == np.float32(0.5)  # the chunk max decodes exactly (level 1)
    raw = _raw(encode([x], name))
    tail = raw[_record_size(82, 2) :]
    assert len(tail) == _record_size(1, 2)
    assert np.frombuffer(tail, "<f4", 1)[0] == np.float32(0.5)
    assert np.frombuffer(tail, "<u2", 1, offset=4)[0] == 7


def _kept_indices(raw: bytes, k: int, bits: int, chunk: int = 0) -> np.ndarray:
    offset = chunk * _record_size(k, bits)
    return np.cumsum(np.frombuffer(raw, "<u2", k, offset=offset + 4))


def test_topk_ties_go_to_the_lowest_index() -> None:
    rng = np.random.default_rng(14)
    x = np.full(TOPK_CHUNK, 0.1, np.float32)
    big = rng.choice(TOPK_CHUNK, 50, replace=False)
    x[big] = 1.0
    rest = np.setdiff1d(np.arange(TOPK_CHUNK), big)
    half = rng.choice(rest, 200, replace=False)
    x[half] = -0.5  # |x| ties: 32 of these 200 fit in k = 82
    x *= np.where(rng.random(TOPK_CHUNK) < 0.5, -1, 1).astype(np.float32)
    raw = _raw(encode([x], "topk-d2-b2"))
    expected = np.sort(np.concatenate([big, np.sort(half)[:32]]))
    np.testing.assert_array_equal(_kept_indices(raw, 82, 2), expected)
    # Same bytes on every call, and all-equal magnitudes keep the first k.
    assert _raw(encode([x], "topk-d2-b2")) == raw
    signs = np.where(np.arange(TOPK_CHUNK) % 3 == 0, -2.0, 2.0).astype(np.float32)
    raw = _raw(encode([signs], "topk-d2-b2"))
    np.testing.assert_array_equal(_kept_indices(raw, 82, 2), np.arange(82))


def test_topk_zero_and_tiny_chunks() -> None:
    x = np.zeros(2 * TOPK_CHUNK, np.float32)
    x[TOPK_CHUNK + 5] = 1e-45  # subnormal: 1/s overflows, v/s does not
    x[TOPK_CHUNK + 9] = -1e-45
    name = "topk-d2-b2"
    raw = _raw(encode([x], name))
    assert np.frombuffer(raw, "<f4", 1)[0] == 0
    np.testing.assert_array_equal(_kept_indices(raw, 82, 2), np.arange(82))
    (y,) = decode(encode([x], name), [x.shape], name)
    assert np.isfinite(y).all()
    np.testing.assert_array_equal(y, x)


def test_topk_huge_values_decode_finite() -> None:
    x = np.array([3.4e38, -3.4e38, 1.0, -1e38], np.float32)
    for name in ("topk-d100-b2", "topk-d100-b8", "topk-d50-b3"):
        (y,) = decode(encode([x], name), [(4,)], name)
        assert np.isfinite(y).all()
        np.testing.assert_allclose(y[:2], x[:2], rtol=1e-6)


@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
def test_topk_rejects_nonfinite_input(bad: float) -> None:
    x = _rand([(TOPK_CHUNK + 5,)])[0]
    x[TOPK_CHUNK + 2] = bad
    for name in ("topk-d2-b2", "topk-d100-b8"):
        with pytest.raises(NonFinite):
            encode([x], name)
        with pytest.raises(NonFinite):
            quantize_roundtrip([x], name)


def test_topk_compresses_five_times_more_than_int4() -> None:
    x = _rand([(1_000_000,)], seed=15)[0]
    assert len(encode([x], "topk-d2-b2")) < len(encode([x], "int4")) / 5


# A two-chunk payload: a full chunk (k = 82) and a partial one of 100 values (k = 2).
_BAD_N = TOPK_CHUNK + 100
_BAD_NAME = "topk-d2-b2"
_REC0 = _record_size(82, 2)


def _bad_raw() -> bytearray:
    x = _rand([(_BAD_N,)], seed=16)[0]
    return bytearray(quantize([x], _BAD_NAME).tobytes())


def _set(raw: bytearray, offset: int, value: float | int, dtype: str) -> bytearray:
    raw[offset : offset + np.dtype(dtype).itemsize] = np.array([value], dtype).tobytes()
    return raw


def _expect_codec_error(raw: bytes | bytearray, match: str) -> None:
    with pytest.raises(CodecError, match=match):
        dequantize(bytes(raw), [(_BAD_N,)], _BAD_NAME)
    with pytest.raises(CodecError, match=match):
        decode(_frame(bytes(raw)), [(_BAD_N,)], _BAD_NAME)


@pytest.mark.parametrize("scale", [-1.0, -1e-30, np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("chunk_offset", [0, _REC0])
def test_topk_invalid_scale(scale: float, chunk_offset: int) -> None:
    _expect_codec_error(_set(_bad_raw(), chunk_offset, scale, "<f4"), "scale")


def test_topk_negative_zero_scale_is_valid() -> None:
    raw = _set(_bad_raw(), 0, -0.0, "<f4")
    (y,) = dequantize(bytes(raw), [(_BAD_N,)], _BAD_NAME)
    assert not y[:TOPK_CHUNK].any()


@pytest.mark.parametrize(
    ("offset", "gap", "match"),
    [
        (4 + 2 * 5, 0, "strictly increasing"),  # repeated index in the full chunk
        (_REC0 + 4 + 2, 0, "strictly increasing"),  # ... and in the partial one
        (4, TOPK_CHUNK, "outside"),  # first index = chunk length
        (4, 65535, "outside"),
        (4 + 2 * 81, 65535, "outside"),  # the running sum passes the end
        (_REC0 + 4, 99, "outside"),  # fits a full chunk, not the 100-value one
        (_REC0 + 4 + 2, 100, "outside"),
    ],
)
def test_topk_invalid_indices(offset: int, gap: int, match: str) -> None:
    _expect_codec_error(_set(_bad_raw(), offset, gap, "<u2"), match)


def test_topk_last_index_may_be_chunk_end() -> None:
    raw = _bad_raw()
    # Partial chunk of 100, k = 2: indices 0 and 99 are valid.
    _set(raw, _REC0 + 4, 0, "<u2")
    _set(raw, _REC0 + 6, 99, "<u2")
    (y,) = dequantize(bytes(raw), [(_BAD_N,)], _BAD_NAME)
    assert np.count_nonzero(y[TOPK_CHUNK:]) == 2 and y[TOPK_CHUNK] != 0 and y[-1] != 0


def test_topk_nonzero_pad_bits() -> None:
    # 82 codes of 2 bits fill 20.5 bytes: the top nibble of byte 21 is padding.
    raw = _bad_raw()
    raw[_REC0 - 1] |= 0x10
    _expect_codec_error(raw, "unused code bits")
    raw = _bad_raw()  # the partial chunk: 2 codes, 4 bits used of 1 byte
    raw[-1] |= 0x80
    _expect_codec_error(raw, "unused code bits")


def test_topk_wrong_raw_size() -> None:
    raw = bytes(_bad_raw())
    with pytest.raises(CodecError):
        dequantize(raw[:-1], [(_BAD_N,)], _BAD_NAME)
    with pytest.raises(CodecError):
        dequantize(raw + b"\0", [(_BAD_N,)], _BAD_NAME)
    with pytest.raises(CodecError):
        decode(_frame(raw[:-1]), [(_BAD_N,)], _BAD_NAME)
    with pytest.raises(OversizedFrame):
        decode(_frame(raw + b"\0"), [(_BAD_N,)], _BAD_NAME)
    with pytest.raises(OversizedFrame):  # a payload made for another density
        decode(encode(_rand([(_BAD_N,)]), "topk-d5-b2"), [(_BAD_N,)], _BAD_NAME)


# --------------------------------------------------------------------------------------------
# Error feedback
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("name", ["int4", "int8", "bf16", "topk-d5-b4", "topk-d2-b2"])
def test_error_feedback_reduces_accumulated_error(name: str) -> None:
    rng = np.random.default_rng(5)
    shapes = [(40, 64), (123,)]
    rounds = 50
    ef = ErrorFeedback()
    true_sum = [np.zeros(s, np.float64) for s in shapes]
    with_ef = [np.zeros(s, np.float64) for s in shapes]
    without = [np.zeros(s, np.float64) for s in shapes]
    for _ in range(rounds):
        # A persistent bias plus noise, like outer gradients; the bias is what naive
        # quantization keeps dropping the same way.
        xs = [(rng.standard_normal(s) * 1e-3 + 2e-4).astype(np.float32) for s in shapes]
        sent = ef.compensate("frag", xs)
        rec = quantize_roundtrip(sent, name)
        ef.update("frag", sent, rec)
        plain = quantize_roundtrip(xs, name)
        for i in range(len(shapes)):
            true_sum[i] += xs[i]
            with_ef[i] += rec[i]
            without[i] += plain[i]

    def err(acc: list[np.ndarray]) -> float:
        return max(float(np.abs(a - t).max()) for a, t in zip(acc, true_sum, strict=True))

    assert err(with_ef) < err(without) / 3
    # With feedback the accumulated error is at most the last residual (one round's error).
    residual = ef.residual("frag")
    assert residual is not None
    for a, t, r in zip(with_ef, true_sum, residual, strict=True):
        np.testing.assert_allclose(a + r, t, atol=1e-6)


def test_error_feedback_bookkeeping() -> None:
    ef = ErrorFeedback()
    x = [np.ones((2, 3), np.float32)]
    first = ef.compensate(0, x)
    np.testing.assert_array_equal(first[0], x[0])
    first[0][0, 0] = 9.0
    assert x[0][0, 0] == 1.0  # compensate never returns the caller's arrays
    assert 0 not in ef and len(ef) == 0
    ef.update(0, x, [np.full((2, 3), 0.75, np.float32)])
    assert 0 in ef and len(ef) == 1 and ef.nbytes == 24
    np.testing.assert_array_equal(ef.compensate(0, x)[0], np.full((2, 3), 1.25, np.float32))
    np.testing.assert_array_equal(ef.compensate(1, x)[0], x[0])  # keys are independent
    with pytest.raises(ValueError):
        ef.compensate(0, [np.ones((3, 2), np.float32)])
    with pytest.raises(ValueError):
        ef.update(0, x, [np.ones(6, np.float32)])
    ef.reset(0)
    ef.reset(0)
    assert 0 not in ef
    np.testing.assert_array_equal(ef.compensate(0, x)[0], x[0])


def test_error_feedback_fp32_residual_is_zero() -> None:
    ef = ErrorFeedback()
    xs = _rand([(100,)])
    sent = ef.compensate("k", xs)
    ef.update("k", sent, quantize_roundtrip(sent, "fp32"))
    residual = ef.residual("k")
    assert residual is not None and not residual[0].any()


def _block_types(frame: bytes) -> set[int]:
    """The block types of a zstd frame, by its block headers (RFC 8878 §3.1.1.2)."""
    pos, kinds = zstandard.frame_header_size(frame), set()
    while True:
        word = int.from_bytes(frame[pos:pos + 3], "little")
        kind = (word >> 1) & 3
        kinds.add(kind)
        pos += 3 + (1 if kind == 1 else word >> 3)
        if word & 1:
            return kinds


def test_frame_size_walks_raw_rle_and_compressed_blocks() -> None:
    rng = np.random.default_rng(5)
    # 128 KiB blocks: incompressible noise (raw), one repeated byte (RLE), low-entropy codes
    # (compressed), so one frame holds all three kinds
    content = b"".join([rng.bytes(300_000), bytes(400_000),
                        rng.integers(0, 4, 500_000, dtype=np.uint8).tobytes()])
    frame = zstandard.ZstdCompressor(level=1, write_checksum=True).compress(content)
    assert _block_types(frame) == {0, 1, 2}
    header = zstandard.frame_header_size(frame)
    assert codec.frame_size(frame, header, checksum=True) == len(frame)
    assert codec.frame_size(frame + b"tail", header, checksum=True) == len(frame)
    with pytest.raises(TruncatedFrame):
        codec.frame_size(frame[:-1], header, checksum=True)
    with pytest.raises(TruncatedFrame):
        codec.frame_size(frame[:len(frame) // 2], header, checksum=True)
    no_sum = zstandard.ZstdCompressor(level=1, write_checksum=False).compress(content)
    assert codec.frame_size(no_sum, zstandard.frame_header_size(no_sum),
                            checksum=False) == len(no_sum)


def test_large_frames_decompress_into_a_fresh_numpy_buffer() -> None:
    x = _rand([(1500, 1500)], seed=4)
    payload = encode(x, "int4")
    expected = raw_size(x[0].size, "int4")
    assert expected >= codec.STREAM_MIN  # the streamed path
    a = codec.decompress_checked(payload, expected, "int4")
    b = codec.decompress_checked(payload, expected, "int4")
    assert a.dtype == np.uint8 and a.shape == (expected,) and a.flags.writeable
    assert not np.shares_memory(a, b)
    assert a.tobytes() == zstandard.ZstdDecompressor().decompress(payload)
    np.testing.assert_array_equal(decode(payload, [x[0].shape], "int4")[0],
                                  quantize_roundtrip(x, "int4")[0])
