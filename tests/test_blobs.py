"""Fragment blobs (:mod:`ddiloco.workers.run.blobs`): exact float32 behind a magic and a CRC-32C."""

from __future__ import annotations

import struct

import crc32c
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st
from hypothesis.extra.numpy import arrays

from ddiloco.pipeline import codec
from ddiloco.pipeline.errors import ChecksumMismatch, CodecError
from ddiloco.workers.run.blobs import RAW_MAGIC, blob_parts, decode_blob, encode_blob

SHAPES = [(2, 3), (4,)]
TENSORS = [np.arange(6, dtype=np.float32).reshape(2, 3), np.full(4, -1.5, np.float32)]


def test_layout_is_magic_crc_then_little_endian_float32() -> None:
    blob = encode_blob(TENSORS)
    payload = struct.pack("<6f", 0, 1, 2, 3, 4, 5) + struct.pack("<4f", *[-1.5] * 4)
    assert blob == RAW_MAGIC + struct.pack("<I", crc32c.crc32c(payload)) + payload
    assert len(blob) == 12 + 4 * 10


@settings(max_examples=30, deadline=None)
@given(arrays(np.float32, st.tuples(st.integers(0, 5), st.integers(1, 7)),
              elements=st.floats(width=32, allow_nan=True)))
def test_round_trip_is_bit_exact(a: np.ndarray) -> None:
    got = decode_blob(encode_blob([a, a[:1]]), [a.shape, a[:1].shape])
    assert got[0].tobytes() == a.tobytes() and got[1].tobytes() == a[:1].tobytes()
    assert got[0].flags.writeable  # a shard updates what it loads in place


def test_damage_is_caught_before_any_tensor_is_built() -> None:
    blob = bytearray(encode_blob(TENSORS))
    blob[-1] ^= 0x01
    with pytest.raises(ChecksumMismatch, match="CRC-32C"):
        decode_blob(bytes(blob), SHAPES)
    with pytest.raises(CodecError, match="52 bytes expected"):
        decode_blob(encode_blob(TENSORS)[:-4], SHAPES)
    with pytest.raises(CodecError, match="for shapes"):
        decode_blob(encode_blob(TENSORS), [(2, 3), (5,)])
    with pytest.raises(CodecError, match="not a fragment blob"):
        decode_blob(b"garbage!" * 4, SHAPES)


def test_blobs_of_the_zstd_codec_are_still_read() -> None:
    got = decode_blob(codec.encode(TENSORS, "fp32"), SHAPES)
    assert all(np.array_equal(a, b) for a, b in zip(got, TENSORS, strict=True))


def test_blob_parts_are_the_blob_without_the_joined_copy() -> None:
    value = np.arange(10, dtype=np.float32).reshape(2, 5)
    parts = blob_parts([value, np.ones(3, np.float32)])
    assert b"".join(parts) == encode_blob([value, np.ones(3, np.float32)])
    # the tensor's own memory: no copy of a float32, C-contiguous fragment buffer
    assert np.shares_memory(np.frombuffer(parts[1], np.uint8), value)


def test_an_owned_writable_blob_decodes_to_views_of_it() -> None:
    a = np.arange(12, dtype=np.float32).reshape(3, 4)
    b = np.ones(5, dtype=np.float32)
    blob = encode_blob([a, b])
    buf = bytearray(blob)
    got = decode_blob(buf, [(3, 4), (5,)], own=True)
    np.testing.assert_array_equal(got[0], a)
    np.testing.assert_array_equal(got[1], b)
    assert all(np.shares_memory(g, np.frombuffer(buf, np.uint8)) for g in got)
    got[1][0] = 7.0  # writable: the bytes are the arrays' now
    assert got[1][0] == 7.0
    # without own, or from immutable bytes: a copy, the blob untouched
    for src, own in ((bytearray(blob), False), (blob, True)):
        copy = decode_blob(src, [(3, 4), (5,)], own=own)
        assert not np.shares_memory(copy[0], np.frombuffer(src, np.uint8))
        copy[0][0, 0] = -1.0
        assert bytes(src) == blob
