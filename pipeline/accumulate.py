"""Received payloads kept quantized, and decoded straight into a running float32 sum.

:func:`unpack` takes one zstd frame of :mod:`ddiloco.pipeline.codec` and checks it exactly as
:func:`ddiloco.pipeline.codec.decode` does (same exceptions, same order of checks), but returns
the validated raw layout (:class:`Packed`) instead of float32 tensors: an int4 payload stays at
``0.5625`` bytes per value instead of 4. :func:`add_range` then adds ``coef * x[start:stop]``
into a float32 buffer in one pass (dequantize, scale, add), and :func:`sumsq_range` gives
``sum x[start:stop]^2`` without materialising ``x``.

Exactness: per value, ``add_range`` computes ``out + float32(coef) * x`` in float32 with ``x``
decoded as :func:`ddiloco.pipeline.quantize.dequantize` decodes it (``float32(q) * scale``,
``level * scale`` for topk), the same operations in the same order as
``out += np.float32(coef) * x`` on the decoded array: the results are bit-identical.
``sumsq_range`` accumulates in float64; for int8/int4 it is ``sum over blocks of s^2 * sum(q^2)``
with the codes' squares summed as integers, which differs from the float64 sum of the decoded
float32 values' squares by float32 rounding of ``q * s`` only (relative ``2^-23`` at most).

Threading: the kernels are compiled with numba and release the GIL; calls on disjoint output
ranges may run in parallel threads. A :class:`Packed` is read-only.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from dataclasses import dataclass

import numba
import numpy as np
import numpy.typing as npt

from ddiloco.pipeline import codec as codec_mod
from ddiloco.pipeline.codec_spec import (
    DEFAULT_BLOCK,
    TOPK_CHUNK,
    check_block,
    check_codec,
    raw_size,
    topk_record,
    topk_spec,
)
from ddiloco.pipeline.errors import (
    CodecError,
    NonFinite,
)
from ddiloco.pipeline.quantize import (
    _SCALE_LIMIT,
    _TOPK_LEVELS,
    _U16,
    check_shapes,
    dequantize,
)

__all__ = ["Packed", "add_range", "pack_raw", "sumsq_f32", "sumsq_range", "unpack"]

_FLT_MAX = float(np.finfo(np.float32).max)
#: values per segment of the bf16 scan: each is counted without branches (SIMD), and searched
#: value by value only if it holds a non-finite value
_SCAN = 1 << 14


@dataclass(frozen=True, eq=False)
class Packed:
    """One validated payload in its codec's raw layout (module :mod:`ddiloco.pipeline.codec`).

    Attributes:
        raw: uint8, shape ``(raw_size(n, codec, block),)``, read-only.
        codec: the codec name.
        shapes: the tensors' shapes, in payload order.
        n: total number of values.
        block: values per quantization block (int8/int4).
        sumsq: per tensor, the sum of squares of its decoded values (as :func:`sumsq_range`
            over the tensor's range), float64; computed by :func:`unpack` for int8/int4 in
            the pass that checks the codes, else None.
    """

    raw: npt.NDArray[np.uint8]
    codec: str
    shapes: tuple[tuple[int, ...], ...]
    n: int
    block: int = DEFAULT_BLOCK
    sumsq: tuple[float, ...] | None = None

    @property
    def nbytes(self) -> int:
        """Bytes held."""
        return int(self.raw.nbytes)

    def tensors(self) -> list[np.ndarray]:
        """The decoded float32 tensors (a fresh full copy: for inspection, not the merge)."""
        return dequantize(self.raw, self.shapes, self.codec, self.block)


def pack_raw(raw: npt.NDArray[np.uint8], shapes: Sequence[tuple[int, ...]], codec: str,
             block: int = DEFAULT_BLOCK) -> Packed:
    """Wrap a raw layout this process made itself (e.g. :func:`ddiloco.pipeline.quantize.quantize`
    output); nothing is checked beyond its size.

    Raises:
        ValueError: the size does not match ``shapes``.
    """
    dims, n = check_shapes(shapes)
    if raw.nbytes != raw_size(n, codec, block):
        raise ValueError(f"{codec} raw of {raw.nbytes} bytes for {n} values")
    arr = np.ascontiguousarray(raw).view(np.uint8).reshape(-1)
    arr.flags.writeable = False
    return Packed(arr, codec, tuple(dims), n, block)


# --------------------------------------------------------------------------------------------
# Unpacking: the checks of codec.decode, without the float32 copy
# --------------------------------------------------------------------------------------------


def unpack(payload: bytes | bytearray | memoryview, shapes: Sequence[tuple[int, ...]],
           codec: str, *, block: int = DEFAULT_BLOCK) -> Packed:
    """Decompress and validate one payload; keep it quantized.

    Same checks and exceptions as :func:`ddiloco.pipeline.codec.decode` (frame header sizes before
    allocating, window cap, checksum, then scales, codes, topk indices and pad bits, finiteness
    of fp32/bf16 values).

    Returns:
        The validated raw layout; holds ``raw_size(n, codec, block)`` bytes. For int8/int4,
        with each tensor's sum of squares (:attr:`Packed.sumsq`), taken in the pass that
        checks the codes: the RDA norms of a merge then need no further read of the payload.

    Raises:
        CodecError, OversizedFrame, TruncatedFrame, ChecksumMismatch, NonFinite.
    """
    check_codec(codec, CodecError)
    check_block(block, CodecError)
    dims, n = check_shapes(shapes)
    expected = raw_size(n, codec, block)
    arr = codec_mod.decompress_checked(payload, expected, codec)
    arr.flags.writeable = False
    sums = _validate(arr, n, codec, block, [math.prod(d) for d in dims])
    return Packed(arr, codec, tuple(dims), n, block, sums)


def _validate(raw: npt.NDArray[np.uint8], n: int, codec: str, block: int,
              sizes: Sequence[int] | None = None) -> tuple[float, ...] | None:
    """The value checks of :func:`ddiloco.pipeline.quantize.dequantize`, on the raw layout.

    Returns:
        For int8/int4, the sum of squares of each consecutive range of ``sizes`` values
        (default: all ``n`` values as one), as :func:`sumsq_range`; else None.
    """
    if codec == "fp32":
        vals = raw.view("<f4")
        if n and not (np.isfinite(vals.min()) and np.isfinite(vals.max())):
            bad = int(np.flatnonzero(~np.isfinite(vals))[0])
            raise NonFinite(f"decoded fp32 value {bad} of {n} is not finite")
        return None
    if codec == "bf16":
        bad = _first_bf16_nonfinite(raw.view(_U16))
        if bad >= 0:
            raise NonFinite(f"decoded bf16 value {bad} of {n} is not finite")
        return None
    spec = topk_spec(codec)
    if spec is not None:
        _validate_topk(raw, n, codec)
        return None
    nb = -(-n // block)
    scales = raw[: 4 * nb].view("<f4")
    limit = _SCALE_LIMIT[codec]
    ok = (scales >= 0) & (scales <= limit)
    if not ok.all():
        bad = int(np.flatnonzero(~ok)[0])
        raise CodecError(f"{codec} block {bad} has invalid scale {scales[bad]!r}")
    body = raw[4 * nb :]
    bits = 8 if codec == "int8" else 4
    if bits == 4 and n & 1 and body[-1] >> 4:
        raise CodecError("int4 pad nibble is not zero")
    sums = []
    bad = 0
    start = 0
    for size in (n,) if sizes is None else sizes:
        total, wrong = _sumsq_int(scales, body, bits, block, start, start + size)
        sums.append(float(total))
        bad += wrong
        start += size
    if bad:
        raise CodecError("int8 code below -127" if bits == 8 else "int4 code below -7")
    return tuple(sums)


def _validate_topk(raw: npt.NDArray[np.uint8], n: int, codec: str) -> None:
    spec = topk_spec(codec)
    assert spec is not None
    offset = 0
    full, rest = divmod(n, TOPK_CHUNK)
    for first, rows, length in ((0, full, TOPK_CHUNK), (full, 1 if rest else 0, rest)):
        if rows == 0:
            continue
        k, size = topk_record(spec, length)
        records = raw[offset : offset + rows * size].reshape(rows, size)
        offset += rows * size
        scales = np.ascontiguousarray(records[:, :4]).view("<f4").reshape(rows)
        valid = (scales >= 0) & (scales <= np.float32(_FLT_MAX))
        if not valid.all():
            bad = int(np.flatnonzero(~valid)[0])
            raise CodecError(f"{codec} chunk {first + bad} has invalid scale {scales[bad]!r}")
        gaps = np.ascontiguousarray(records[:, 4 : 4 + 2 * k]).view(_U16).reshape(rows, k)
        if k > 1 and not gaps[:, 1:].all():
            bad = int(np.flatnonzero(~gaps[:, 1:].all(axis=1))[0])
            raise CodecError(f"{codec} chunk {first + bad}: indices not strictly increasing")
        last = gaps.sum(axis=1, dtype=np.int64)
        if int(last.max()) >= length:
            bad = int(np.flatnonzero(last >= length)[0])
            raise CodecError(f"{codec} chunk {first + bad}: index {int(last[bad])} outside a "
                             f"chunk of {length}")
        used = (k * spec.bits) % 8
        body_last = records[:, -1]
        if used and (body_last >> used).any():
            bad = int(np.flatnonzero(body_last >> used)[0])
            raise CodecError(f"{codec} chunk {first + bad}: unused code bits are not zero")


@numba.njit(nogil=True, cache=True)
def _first_bf16_nonfinite(u: npt.NDArray[np.uint16]) -> int:  # pragma: no cover - jit
    e = np.uint16(0x7F80)
    for a in range(0, u.size, _SCAN):
        seg = u[a : a + _SCAN]
        hits = 0
        for i in range(seg.size):
            hits += (seg[i] & e) == e
        if hits:
            for i in range(seg.size):
                if (seg[i] & e) == e:
                    return a + i
    return -1


# --------------------------------------------------------------------------------------------
# Kernels: out[0 : stop - start] += coef * x[start:stop]
# --------------------------------------------------------------------------------------------
# The hot loops run over one whole block (its scale hoisted), index with unsigned integers
# (numba's negative-index wraparound would otherwise block vectorization) and decode an int4
# byte into both of its values without a variable shift, so LLVM emits SIMD code for them.
# Values of a range before its first whole block and after its last go through the per-value
# loops (at most two partial blocks per call).


@numba.njit(nogil=True, cache=True)
def _add_int_values(scales: npt.NDArray[np.float32], body: npt.NDArray[np.uint8], bits: int,
                    block: int, start: int, first: int, stop: int, coef: np.float32,
                    out: npt.NDArray[np.float32]) -> None:  # pragma: no cover - jit
    """``out[i - start] += coef * x[i]`` for ``i`` in ``[first, stop)``, value by value."""
    for i in range(first, stop):
        s = scales[i // block]
        if bits == 8:
            q = np.int32(np.int8(body[i]))
        else:
            q = (np.int32((body[i >> 1] >> ((i & 1) << 2)) & 0xF) ^ 8) - 8
        out[i - start] += coef * (np.float32(q) * s)


@numba.njit(nogil=True, cache=True)
def _add_int(scales: npt.NDArray[np.float32], body: npt.NDArray[np.uint8], bits: int,
             block: int, start: int, stop: int, coef: np.float32,
             out: npt.NDArray[np.float32]) -> None:  # pragma: no cover - jit
    if bits == 4 and block & 1:  # blocks that split a byte: per value
        _add_int_values(scales, body, bits, block, start, start, stop, coef, out)
        return
    head = min(stop, -(-start // block) * block)
    tail = head + (stop - head) // block * block
    _add_int_values(scales, body, bits, block, start, start, head, coef, out)
    for b in range(head // block, tail // block):
        s = scales[b]
        o = np.uint64(b * block - start)
        if bits == 8:
            k0 = np.uint64(b * block)
            for t in range(block):
                u = np.uint64(t)
                out[o + u] += coef * (np.float32(np.int8(body[k0 + u])) * s)
        else:
            k0 = np.uint64(b * block >> 1)
            for t in range(block >> 1):
                u = np.uint64(t)
                v = np.int32(body[k0 + u])
                lo = np.float32(((v & 15) ^ 8) - 8)
                hi = np.float32((((v >> 4) & 15) ^ 8) - 8)
                out[o + u + u] += coef * (lo * s)
                out[o + u + u + np.uint64(1)] += coef * (hi * s)
    _add_int_values(scales, body, bits, block, start, tail, stop, coef, out)


@numba.njit(nogil=True, cache=True)
def _sumsq_int(scales: npt.NDArray[np.float32], body: npt.NDArray[np.uint8], bits: int,
               block: int, start: int, stop: int) -> tuple[float, int]:  # pragma: no cover
    """``(sum over blocks of s^2 * sum(q^2), codes out of range)``: the codes' squares summed
    as integers (exact), one float64 multiply per block; codes -128 (int8) and -8 (int4),
    which the format excludes, counted."""
    total = 0.0
    bad = 0
    j = start
    while j < stop:
        b = j // block
        hi = min(stop, (b + 1) * block)
        acc = np.int64(0)
        if bits == 8:
            k0 = np.uint64(j)
            for t in range(hi - j):
                q = np.int32(np.int8(body[k0 + np.uint64(t)]))
                acc += q * q
                bad += q == -128
        elif (j | hi) & 1:  # a block edge or a range end inside a byte
            for i in range(j, hi):
                q = (np.int32((body[i >> 1] >> ((i & 1) << 2)) & 0xF) ^ 8) - 8
                acc += q * q
                bad += q == -8
        else:
            k0 = np.uint64(j >> 1)
            for t in range((hi - j) >> 1):
                v = np.int32(body[k0 + np.uint64(t)])
                lo = ((v & 15) ^ 8) - 8
                hi4 = (((v >> 4) & 15) ^ 8) - 8
                acc += lo * lo + hi4 * hi4
                bad += (lo == -8) + (hi4 == -8)
        s = np.float64(scales[b])
        total += s * s * np.float64(acc)
        j = hi
    return total, bad


@numba.njit(nogil=True, cache=True)
def _add_f32(vals: npt.NDArray[np.float32], start: int, stop: int, coef: np.float32,
             out: npt.NDArray[np.float32]) -> None:  # pragma: no cover - jit
    o = np.uint64(start)
    for t in range(stop - start):
        u = np.uint64(t)
        out[u] += coef * vals[o + u]


@numba.njit(nogil=True, cache=True)
def _sumsq_f32(vals: npt.NDArray[np.float32], start: int, stop: int) -> float:  # pragma: no cover
    # Eight running sums, value i into sum i % 8: independent chains that LLVM packs into SIMD
    # registers, in an order fixed by the code (not by the vector width of the host).
    a0 = a1 = a2 = a3 = a4 = a5 = a6 = a7 = 0.0
    i = start
    while i + 8 <= stop:
        v = vals[i : i + 8]
        a0 += np.float64(v[0]) * np.float64(v[0])
        a1 += np.float64(v[1]) * np.float64(v[1])
        a2 += np.float64(v[2]) * np.float64(v[2])
        a3 += np.float64(v[3]) * np.float64(v[3])
        a4 += np.float64(v[4]) * np.float64(v[4])
        a5 += np.float64(v[5]) * np.float64(v[5])
        a6 += np.float64(v[6]) * np.float64(v[6])
        a7 += np.float64(v[7]) * np.float64(v[7])
        i += 8
    total = ((a0 + a1) + (a2 + a3)) + ((a4 + a5) + (a6 + a7))
    for j in range(i, stop):
        x = np.float64(vals[j])
        total += x * x
    return total


@numba.njit(nogil=True, cache=True)
def _add_topk(raw: npt.NDArray[np.uint8], n: int, chunk: int, k_full: int, size_full: int,
              k_last: int, size_last: int, bits: int, levels: npt.NDArray[np.float32],
              start: int, stop: int, coef: np.float32, out: npt.NDArray[np.float32],
              square: bool) -> float:  # pragma: no cover - jit
    """``square`` False: out += coef * x over [start, stop); True: return sum x^2 there."""
    total = 0.0
    mask = (1 << bits) - 1
    n_full = n // chunk
    for c in range(start // chunk, (stop - 1) // chunk + 1):
        if c < n_full:
            k, off = k_full, c * size_full
        else:
            k, off = k_last, n_full * size_full
        s = raw[off : off + 4].copy().view(np.float32)[0]
        gaps = off + 4
        body = off + 4 + 2 * k
        idx = np.int64(0)
        base = c * chunk
        for t in range(k):
            idx += np.int64(raw[gaps + 2 * t]) | (np.int64(raw[gaps + 2 * t + 1]) << 8)
            j = base + idx
            if j < start:
                continue
            if j >= stop:
                break
            bit = t * bits
            byte = body + (bit >> 3)
            word = np.int64(raw[byte])
            if (bit & 7) + bits > 8:
                word |= np.int64(raw[byte + 1]) << 8
            code = (word >> (bit & 7)) & mask
            v = np.float32(levels[code] * s)
            if square:
                total += np.float64(v) * np.float64(v)
            else:
                out[j - start] += coef * v
    return total


def add_range(p: Packed, start: int, stop: int, coef: float,
              out: npt.NDArray[np.float32]) -> None:
    """``out[: stop - start] += float32(coef) * x[start:stop]``, ``x`` the decoded values.

    Args:
        p: the payload.
        start, stop: a range of the flattened, concatenated values, ``0 <= start <= stop <= n``.
        coef: the weight (rounded to float32 first).
        out: float32, at least ``stop - start`` values, C-contiguous; updated in place.
    """
    if stop <= start:
        return
    c = np.float32(coef)
    codec = p.codec
    if codec == "fp32":
        _add_f32(p.raw.view(np.float32), start, stop, c, out)
    elif codec == "bf16":
        vals = (p.raw.view(_U16)[start:stop].astype(np.uint32) << 16).view(np.float32)
        out[: stop - start] += c * vals
    elif codec in ("int4", "int8"):
        nb = -(-p.n // p.block)
        _add_int(p.raw[: 4 * nb].view(np.float32), p.raw[4 * nb :], 4 if codec == "int4" else 8,
                 p.block, start, stop, c, out)
    else:
        _topk_call(p, start, stop, c, out, False)


def sumsq_range(p: Packed, start: int, stop: int) -> float:
    """``sum(x[start:stop] ** 2)`` of the decoded values, accumulated in float64."""
    if stop <= start:
        return 0.0
    codec = p.codec
    if codec == "fp32":
        return float(_sumsq_f32(p.raw.view(np.float32), start, stop))
    if codec in ("int4", "int8"):
        nb = -(-p.n // p.block)
        total, _ = _sumsq_int(p.raw[: 4 * nb].view(np.float32), p.raw[4 * nb :],
                              4 if codec == "int4" else 8, p.block, start, stop)
        return float(total)
    if codec == "bf16":
        tmp = np.zeros(stop - start, np.float32)
        add_range(p, start, stop, 1.0, tmp)
        return float(_sumsq_f32(tmp, 0, stop - start))
    return _topk_call(p, start, stop, np.float32(1), np.zeros(1, np.float32), True)


def _topk_call(p: Packed, start: int, stop: int, coef: np.float32,
               out: npt.NDArray[np.float32], square: bool) -> float:
    spec = topk_spec(p.codec)
    assert spec is not None
    k_full, size_full = topk_record(spec, TOPK_CHUNK)
    rest = p.n % TOPK_CHUNK
    k_last, size_last = topk_record(spec, rest) if rest else (0, 0)
    return float(_add_topk(p.raw, p.n, TOPK_CHUNK, k_full, size_full, k_last, size_last,
                           spec.bits, _TOPK_LEVELS[spec.bits], start, stop, coef, out, square))


def sumsq_f32(x: npt.NDArray[np.float32]) -> float:
    """``sum(x ** 2)`` of a 1-D float32 array, accumulated in float64."""
    return float(_sumsq_f32(x, 0, x.size))
