"""The quantizers of the payload codecs (DESIGN §4): float32 values to the raw payload bytes of
fp32, bf16, int8, int4 and topk, and back, with the error bounds and checks that
:mod:`ddiloco.pipeline.codec` documents. No compression here: :func:`ddiloco.pipeline.codec.encode`
wraps these bytes in one zstd frame. :mod:`ddiloco.pipeline.codec` re-exports the public names."""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt

from ddiloco.pipeline.codec_spec import (
    DEFAULT_BLOCK,
    TOPK_BITS,
    TOPK_CHUNK,
    TopKSpec,
    check_block,
    check_codec,
    raw_size,
    topk_record,
    topk_spec,
)
from ddiloco.pipeline.errors import CodecError, NonFinite

__all__ = ["check_shapes", "dequantize", "quantize", "quantize_roundtrip"]

# Explicit little-endian dtypes: the layouts are little endian on every host.
_F32 = np.dtype("<f4")
_U16 = np.dtype("<u2")
_BF16 = np.dtype(ml_dtypes.bfloat16)
_FLT_MAX = float(np.finfo(np.float32).max)

# Largest code magnitude per integer codec.
_QMAX: dict[str, int] = {"int8": 127, "int4": 7}


def _scale_limit(k: int) -> np.float32:
    """Largest float32 ``s`` with ``float32(k) * s`` finite: the clamp that keeps decode finite."""
    s = np.float32(_FLT_MAX / k)
    with np.errstate(over="ignore"):
        while not np.isfinite(np.float32(k) * s):
            s = np.nextafter(s, np.float32(0))
    return np.float32(s)


_SCALE_LIMIT: dict[str, np.float32] = {c: _scale_limit(k) for c, k in _QMAX.items()}


def _int4_lut() -> npt.NDArray[np.uint16]:
    """Byte -> two int8 codes (low nibble first) packed in one little-endian uint16.

    A table lookup with ``np.take`` unpacks about 3x faster than shifting and interleaving.
    """
    lut = np.empty((256, 2), dtype=np.int8)
    nibbles = np.arange(256, dtype=np.int16)
    for col, shift in ((0, 0), (1, 4)):
        v = (nibbles >> shift) & 0xF
        lut[:, col] = np.where(v >= 8, v - 16, v)
    return lut.view(_U16).reshape(256)


_INT4_LUT = _int4_lut()


# --------------------------------------------------------------------------------------------
# Quantization
# --------------------------------------------------------------------------------------------


def _flatten(arrays: Sequence[npt.ArrayLike]) -> npt.NDArray[np.float32]:
    """Concatenate the flattened arrays; a view, not a copy, for one C-contiguous array."""
    xs = [np.asarray(a) for a in arrays]
    for i, x in enumerate(xs):
        if x.dtype != np.float32:
            raise TypeError(f"array {i} has dtype {x.dtype}; codecs take float32 only")
    if len(xs) == 1 and xs[0].flags.c_contiguous:
        return xs[0].reshape(-1)
    out = np.empty(sum(x.size for x in xs), dtype=np.float32)
    offset = 0
    for x in xs:
        out[offset : offset + x.size].reshape(x.shape)[...] = x
        offset += x.size
    return out


def _blockwise_multiply(
    values: npt.NDArray[Any],
    per_block: npt.NDArray[np.float32],
    block: int,
    out: npt.NDArray[np.float32],
) -> None:
    """``out[i] = values[i] * per_block[i // block]`` for 1-D arrays, without repeating scales."""
    n = values.size
    full = n // block
    cut = full * block
    if full:
        np.multiply(
            values[:cut].reshape(full, block),
            per_block[:full, None],
            out=out[:cut].reshape(full, block),
        )
    if cut < n:
        np.multiply(values[cut:], per_block[full], out=out[cut:])


def quantize(
    arrays: Sequence[npt.ArrayLike], codec: str, block: int = DEFAULT_BLOCK
) -> npt.NDArray[np.uint8]:
    """Quantize the concatenation of the flattened arrays into the codec's raw layout.

    Args:
        arrays: the tensors, float32 array_likes of any shapes, concatenated in order after
            C-order flattening.
        codec: a codec name that :func:`is_codec` accepts (see :data:`CODECS`).
        block: values per quantization block (int8/int4).

    Returns:
        The raw payload (module docstring), uint8 of shape ``(raw_size(n, codec, block),)``. For
        fp32 with one C-contiguous input on a little-endian host it is a view of that input, not a
        copy.

    Raises:
        ValueError: unknown codec or bad block size.
        TypeError: an input that is not float32.
        NonFinite: NaN or Inf in the input of int8/int4/topk, which cannot represent them.
    """
    check_codec(codec, ValueError)
    check_block(block, ValueError)
    flat = _flatten(arrays)
    if codec == "fp32":
        return flat.astype(_F32, copy=False).view(np.uint8)
    if codec == "bf16":
        return flat.astype(_BF16).view(np.uint16).astype(_U16, copy=False).view(np.uint8)
    spec = topk_spec(codec)
    if spec is not None:
        return _quantize_topk(flat, codec, spec)
    return _quantize_int(flat, codec, block)


def _quantize_int(flat: npt.NDArray[np.float32], codec: str, block: int) -> npt.NDArray[np.uint8]:
    k = _QMAX[codec]
    n = flat.size
    n_blocks = -(-n // block)
    raw = np.empty(raw_size(n, codec, block), dtype=np.uint8)
    scales = raw[: 4 * n_blocks].view(_F32)
    if n == 0:
        return raw

    work = np.abs(flat)
    # reduceat handles the partial last block, and is ~2x faster than max(axis=1) on short rows.
    absmax = np.maximum.reduceat(work, np.arange(0, n, block))
    if not np.isfinite(absmax).all():
        bad = int(np.flatnonzero(~np.isfinite(absmax))[0])
        raise NonFinite(f"{codec} cannot encode NaN/Inf (first in block {bad})")
    with np.errstate(divide="ignore", over="ignore"):
        inv = (np.float32(k) / absmax).astype(np.float32, copy=False)
    # Zero blocks, and blocks so small that k/max overflows, are sent as scale 0 (all codes 0).
    flush = ~np.isfinite(inv)
    inv[flush] = 0
    np.divide(absmax, np.float32(k), out=scales)
    scales[flush] = 0
    np.minimum(scales, _SCALE_LIMIT[codec], out=scales)

    # x * (k / max) stays within k·(1 + 2^-23) < k + 1/2, so rounding needs no clip.
    _blockwise_multiply(flat, inv, block, out=work)
    np.rint(work, out=work)
    if codec == "int8":
        np.copyto(raw[4 * n_blocks :].view(np.int8), work, casting="unsafe")
        return raw
    codes = np.empty(n + (n & 1), dtype=np.int8)
    codes[-1] = 0  # the pad nibble of an odd count
    np.copyto(codes[:n], work, casting="unsafe")
    # Each pair is one little-endian uint16: low byte = even value, high byte = odd value.
    pairs = codes.view(_U16)
    packed = (pairs & 0x000F) | ((pairs >> 4) & 0x00F0)
    np.copyto(raw[4 * n_blocks :], packed, casting="unsafe")
    return raw


def _topk_levels(bits: int) -> npt.NDArray[np.float32]:
    """Code -> level in ``[-1, 1]``; the ends are exactly -1 and 1, so ``|level · s| <= s``."""
    q = (1 << bits) - 1
    return ((2 * np.arange(q + 1, dtype=np.float64) - q) / q).astype(np.float32)


_TOPK_LEVELS: dict[int, npt.NDArray[np.float32]] = {b: _topk_levels(b) for b in TOPK_BITS}


def _topk_chunks(n: int) -> list[tuple[int, int, int]]:
    """``(start, rows, length)`` of the full chunks (as one 2-D block) and the partial one."""
    full, rest = divmod(n, TOPK_CHUNK)
    parts = [(0, full, TOPK_CHUNK)] if full else []
    if rest:
        parts.append((full * TOPK_CHUNK, 1, rest))
    return parts


def _quantize_topk(
    flat: npt.NDArray[np.float32], codec: str, spec: TopKSpec
) -> npt.NDArray[np.uint8]:
    n = flat.size
    raw = np.empty(raw_size(n, codec), dtype=np.uint8)
    if n == 0:
        return raw
    mag = np.abs(flat)
    # max propagates NaN: one reduction instead of an n-sized isfinite mask.
    if not np.isfinite(mag.max()):
        bad = int(np.flatnonzero(~np.isfinite(flat))[0])
        raise NonFinite(f"{codec} cannot encode NaN/Inf (first at value {bad})")
    offset = 0
    for start, rows, length in _topk_chunks(n):
        k, size = topk_record(spec, length)
        stop = start + rows * length
        _topk_encode_rows(
            flat[start:stop].reshape(rows, length),
            mag[start:stop].reshape(rows, length),
            k,
            spec.bits,
            raw[offset : offset + rows * size].reshape(rows, size),
        )
        offset += rows * size
    return raw


def _topk_encode_rows(
    x: npt.NDArray[np.float32],
    mag: npt.NDArray[np.float32],
    k: int,
    bits: int,
    out: npt.NDArray[np.uint8],
) -> None:
    """Encode each row of ``x`` (shape ``(rows, L)``, ``|x|`` in ``mag``) as one chunk record."""
    rows, length = x.shape
    if k == length:
        vals = x
        gaps = np.ones((rows, k), dtype=_U16)
        gaps[:, 0] = 0
    else:
        # The k-th largest magnitude per row; everything at or above it is a candidate.
        thresh = np.partition(mag, length - k, axis=1)[:, length - k, None]
        keep = mag >= thresh
        tied = np.flatnonzero(np.count_nonzero(keep, axis=1) > k)
        if tied.size:
            # More than k candidates: the threshold value is repeated. Keep all values above it
            # and its first occurrences, so the choice does not depend on partition internals.
            m, t = mag[tied], thresh[tied]
            above = m > t
            equal = m == t
            room = k - np.count_nonzero(above, axis=1)
            keep[tied] = above | (equal & (np.cumsum(equal, axis=1) <= room[:, None]))
        # Flat positions in row-major order: each row's kept columns come out sorted, and a 1-D
        # nonzero is about twice as fast as a 2-D one.
        pos = np.flatnonzero(keep).reshape(rows, k)
        vals = x.reshape(-1)[pos]
        pos -= (np.arange(rows) * length)[:, None]
        gaps = np.diff(pos, axis=1, prepend=0).astype(_U16)
    scales = np.abs(vals).max(axis=1)
    # Divide rather than multiply by 1/s: 1/s overflows for subnormal s, |v/s| <= 1 never does.
    safe = np.where(scales > 0, scales, np.float32(1))
    q = (1 << bits) - 1
    level = (vals / safe[:, None] + np.float32(1)) * np.float32(q / 2)
    codes = np.clip(np.rint(level, out=level), 0, q, out=level).astype(np.uint8)

    out[:, :4] = scales.astype(_F32).view(np.uint8).reshape(rows, 4)
    out[:, 4 : 4 + 2 * k] = gaps.view(np.uint8).reshape(rows, 2 * k)
    out[:, 4 + 2 * k :] = _pack_codes(codes, bits)


def _code_groups(bits: int) -> tuple[int, int]:
    """``(codes, bytes)`` of the smallest run of codes that fills whole bytes: (4, 1) for 2 bits,
    (8, 3) for 3, (2, 1) for 4, (1, 1) for 8. A group fits in a uint32, so packing is a few
    shifts over whole arrays instead of a bit-level unpack and repack."""
    per = 8 // math.gcd(bits, 8)
    return per, bits * per // 8


def _pack_codes(codes: npt.NDArray[np.uint8], bits: int) -> npt.NDArray[np.uint8]:
    """``(rows, k)`` codes below ``2^bits`` -> ``(rows, ceil(k·bits / 8))`` bytes, LSB first."""
    rows, k = codes.shape
    per, nbytes = _code_groups(bits)
    if per == 1:
        return codes
    groups = -(-k // per)
    flat = np.zeros((rows, groups * per), dtype=np.uint32)  # the pad codes are the zero bits
    flat[:, :k] = codes
    grouped = flat.reshape(rows, groups, per)
    word = grouped[:, :, 0].copy()
    for j in range(1, per):
        word |= grouped[:, :, j] << np.uint32(j * bits)
    packed = word.astype("<u4").view(np.uint8).reshape(rows, groups, 4)[:, :, :nbytes]
    return packed.reshape(rows, groups * nbytes)[:, : -(-(k * bits) // 8)]


def _unpack_codes(body: npt.NDArray[np.uint8], k: int, bits: int) -> npt.NDArray[np.uint8]:
    """Inverse of :func:`_pack_codes`; the caller has checked the pad bits."""
    rows = body.shape[0]
    per, nbytes = _code_groups(bits)
    if per == 1:
        return body
    groups = -(-k // per)
    flat = np.zeros((rows, groups * nbytes), dtype=np.uint32)
    flat[:, : body.shape[1]] = body
    grouped = flat.reshape(rows, groups, nbytes)
    word = grouped[:, :, 0].copy()
    for j in range(1, nbytes):
        word |= grouped[:, :, j] << np.uint32(8 * j)
    codes = np.empty((rows, groups, per), dtype=np.uint8)
    mask = np.uint32((1 << bits) - 1)
    for j in range(per):
        codes[:, :, j] = (word >> np.uint32(j * bits)) & mask
    return codes.reshape(rows, groups * per)[:, :k]


def _dequantize_topk(
    buf: memoryview, n: int, codec: str, spec: TopKSpec
) -> npt.NDArray[np.float32]:
    body = np.frombuffer(buf, dtype=np.uint8)
    out = np.zeros(n, dtype=np.float32)
    offset = 0
    for start, rows, length in _topk_chunks(n):
        k, size = topk_record(spec, length)
        records = body[offset : offset + rows * size].reshape(rows, size)
        _topk_decode_rows(
            records,
            k,
            spec.bits,
            out[start : start + rows * length].reshape(rows, length),
            codec,
            start // TOPK_CHUNK,
        )
        offset += rows * size
    return out


def _topk_decode_rows(
    records: npt.NDArray[np.uint8],
    k: int,
    bits: int,
    out: npt.NDArray[np.float32],
    codec: str,
    first: int,
) -> None:
    """Validate ``(rows, size)`` chunk records and scatter their values into ``out`` (zeros)."""
    rows, length = out.shape
    scales = np.ascontiguousarray(records[:, :4]).view(_F32).reshape(rows)
    # (s >= 0) is False for NaN; <= max rejects Inf. -0.0 passes and decodes to zeros.
    valid = (scales >= 0) & (scales <= np.float32(_FLT_MAX))
    if not valid.all():
        bad = int(np.flatnonzero(~valid)[0])
        raise CodecError(f"{codec} chunk {first + bad} has invalid scale {scales[bad]!r}")
    gaps = np.ascontiguousarray(records[:, 4 : 4 + 2 * k]).view(_U16).reshape(rows, k)
    if k > 1 and not gaps[:, 1:].all():
        bad = int(np.flatnonzero(~gaps[:, 1:].all(axis=1))[0])
        raise CodecError(f"{codec} chunk {first + bad}: indices not strictly increasing")
    # k gaps below 2^16 sum to less than 2^31: int32 cannot overflow.
    cols = np.cumsum(gaps, axis=1, dtype=np.int32)
    last = cols[:, -1]
    if int(last.max()) >= length:
        bad = int(np.flatnonzero(last >= length)[0])
        raise CodecError(
            f"{codec} chunk {first + bad}: index {int(last[bad])} outside a chunk of {length}"
        )
    body = records[:, 4 + 2 * k :]
    used = (k * bits) % 8
    if used and (body[:, -1] >> used).any():
        bad = int(np.flatnonzero(body[:, -1] >> used)[0])
        raise CodecError(f"{codec} chunk {first + bad}: unused code bits are not zero")
    codes = _unpack_codes(body, k, bits)
    vals = _TOPK_LEVELS[bits][codes]
    vals *= scales[:, None]
    if k == length:
        out[...] = vals  # strictly increasing indices below k: all of them, in order
    else:
        np.put_along_axis(out, cols, vals, axis=1)


def check_shapes(shapes: Sequence[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], int]:
    """The shapes as tuples of int and their total number of values.

    Raises:
        CodecError: a shape that is not a tuple or list, or has non-integer or negative dimensions.
    """
    out: list[tuple[int, ...]] = []
    total = 0
    for shape in shapes:
        if not isinstance(shape, tuple | list):
            raise CodecError(f"shape {shape!r} is not a tuple")
        dims = tuple(shape)
        if not all(isinstance(d, int | np.integer) and not isinstance(d, bool) for d in dims):
            raise CodecError(f"shape {shape!r} has non-integer dimensions")
        if any(d < 0 for d in dims):
            raise CodecError(f"shape {shape!r} has negative dimensions")
        dims = tuple(int(d) for d in dims)
        out.append(dims)
        total += math.prod(dims)
    return out, total


def _split(flat: npt.NDArray[np.float32], shapes: list[tuple[int, ...]]) -> list[np.ndarray]:
    # Views of one buffer: each is C-contiguous and writable, and they do not overlap.
    result = []
    offset = 0
    for shape in shapes:
        size = math.prod(shape)
        result.append(flat[offset : offset + size].reshape(shape))
        offset += size
    return result


def dequantize(
    raw: bytes | bytearray | memoryview | npt.NDArray[np.uint8],
    shapes: Sequence[tuple[int, ...]],
    codec: str,
    block: int = DEFAULT_BLOCK,
) -> list[np.ndarray]:
    """Inverse of :func:`quantize`: raw payload -> float32 tensors, validated.

    Args:
        raw: the raw payload, bytes-like, of length ``raw_size(sum of sizes, codec, block)``.
        shapes: shapes of the tensors, in payload order.
        codec: a codec name that :func:`is_codec` accepts (see :data:`CODECS`).
        block: values per quantization block (int8/int4).

    Returns:
        Float32 arrays of the given shapes: C-contiguous, writable, non-overlapping views of one
        fresh buffer.

    Raises:
        CodecError: unknown codec, bad block or shapes, wrong raw size, scales that are negative,
            non-finite or above the clamp, codes outside ``[-k, k]``, a non-zero int4 pad nibble;
            for topk, indices that are not strictly increasing or fall outside their chunk, or
            non-zero unused code bits.
        NonFinite: NaN or Inf among decoded fp32/bf16 values.
    """
    check_codec(codec, CodecError)
    check_block(block, CodecError)
    dims, n = check_shapes(shapes)
    expected = raw_size(n, codec, block)
    if isinstance(raw, np.ndarray):
        buf = np.ascontiguousarray(raw).data.cast("B")
    else:
        buf = memoryview(raw).cast("B")
    if buf.nbytes != expected:
        raise CodecError(f"{codec} raw payload of {buf.nbytes} bytes; expected {expected}")

    if codec in ("fp32", "bf16"):
        if codec == "fp32":
            out = np.frombuffer(buf, dtype=_F32).astype(np.float32)
        else:
            out = np.frombuffer(buf, dtype=_U16).astype(np.uint16, copy=False)
            out = out.view(_BF16).astype(np.float32)
        # min/max propagate NaN and are vectorised reductions: no n-sized temporary.
        if n and not (np.isfinite(out.min()) and np.isfinite(out.max())):
            bad = int(np.flatnonzero(~np.isfinite(out))[0])
            raise NonFinite(f"decoded {codec} value {bad} of {n} is not finite")
        return _split(out, dims)

    spec = topk_spec(codec)
    if spec is not None:
        return _split(_dequantize_topk(buf, n, codec, spec), dims)

    k = _QMAX[codec]
    n_blocks = -(-n // block)
    scales = np.frombuffer(buf, dtype=_F32, count=n_blocks)
    # (s >= 0) is False for NaN, so this rejects NaN, negatives, Inf and values above the clamp.
    if not ((scales >= 0) & (scales <= _SCALE_LIMIT[codec])).all():
        bad = int(np.flatnonzero(~((scales >= 0) & (scales <= _SCALE_LIMIT[codec])))[0])
        raise CodecError(f"{codec} block {bad} has invalid scale {scales[bad]!r}")
    body = np.frombuffer(buf, dtype=np.uint8, offset=4 * n_blocks)
    if codec == "int8":
        codes = body.view(np.int8)
    else:
        if n & 1 and body[-1] >> 4:
            raise CodecError("int4 pad nibble is not zero")
        codes = np.take(_INT4_LUT, body).view(np.int8)[:n]
    if n and int(codes.min()) < -k:
        raise CodecError(f"{codec} code below {-k}")  # -128/-8: never written by quantize
    out = np.empty(n, dtype=np.float32)
    _blockwise_multiply(codes, scales, block, out=out)
    return _split(out, dims)


def quantize_roundtrip(
    arrays: Sequence[npt.ArrayLike], codec: str, block: int = DEFAULT_BLOCK
) -> list[np.ndarray]:
    """``dequantize(quantize(x))`` without zstd: bit-identical to ``decode(encode(x))``.

    The syncer stores this so that its state equals what learners reconstruct.

    Args:
        arrays: the tensors, float32 array_likes.
        codec: a codec name that :func:`is_codec` accepts (see :data:`CODECS`).
        block: values per quantization block (int8/int4).

    Returns:
        Float32 arrays of the same shapes as ``arrays``; C-contiguous, writable, never aliasing
        the inputs.

    Raises:
        ValueError, TypeError, NonFinite: as :func:`quantize`; :class:`NonFinite` also for NaN/Inf
            in fp32/bf16 input (or bf16 overflow), as :func:`decode` would raise.
    """
    shapes = [np.shape(a) for a in arrays]
    return dequantize(quantize(arrays, codec, block), shapes, codec, block)
