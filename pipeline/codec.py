"""Payload codecs: per-block quantization or per-chunk top-k, then one zstd frame (DESIGN §4).

A payload carries the concatenation of the flattened float32 tensors of one fragment (a delta or
the fragment's values), in the order the caller lists them. The quantized bytes (the *raw*
payload) are compressed into exactly one zstd frame with the content checksum on and the content
size in the frame header, so that a receiver can bound memory before decompressing.

Raw layouts
-----------
``n`` is the total number of values, ``b`` the block size (``DEFAULT_BLOCK`` = 64) and
``nb = ceil(n / b)`` the number of blocks; the last block may be partial and has its own scale.
All multi-byte numbers are little endian.

``fp32``  ``4·n`` bytes: the values as IEEE-754 binary32.

``bf16``  ``2·n`` bytes: the values as bfloat16 (the upper 16 bits of binary32), rounded to
          nearest, ties to even (``ml_dtypes.bfloat16``). Magnitudes above the bfloat16 range
          round to Inf and are rejected by :func:`decode`.

``int8``  ``4·nb + n`` bytes: ``nb`` float32 scales, then ``n`` int8 codes. Per block
          ``s = max|x| / 127`` and ``q = round_half_even(x / s)`` in ``[-127, 127]``; the value is
          ``q · s``. Symmetric linear quantization with block-wise absmax scaling, the
          normalisation of Dettmers et al., "8-bit Optimizers via Block-wise Quantization"
          (ICLR 2022), which pair it with a non-linear code; a linear code keeps the error
          bound simple and decoding a multiply.

``int4``  ``4·nb + ceil(n / 2)`` bytes: ``nb`` float32 scales, then the codes packed two per byte,
          value ``2i`` in the low nibble and ``2i + 1`` in the high nibble, each a 4-bit two's
          complement integer. Per block ``s = max|x| / 7`` and ``q`` in ``[-7, 7]``. For odd ``n``
          the unused high nibble of the last byte is 0. Per DESIGN §2 (Decoupled DiLoCo
          paper defaults) int4 outer gradients are nearly lossless.

A block whose ``max|x|`` is 0, or so small that ``k / max|x|`` overflows float32 (below about
``k / 3.4e38``), has scale 0 and decodes to zeros. The encoder clamps scales to the largest value
``s`` for which ``k · s`` is finite, so every valid payload decodes to finite values.

``topk-d<p>-b<w>``  Top-k sparsification with low-bit values, the compressor of SparseLoCo
          (Sarfi, Thérien, Lidin and Belilovsky, "Communication Efficient LLM Pre-training
          with SparseLoCo", arXiv 2508.15706): keep the largest entries of each chunk, send
          them with a few bits each, and let :class:`ErrorFeedback` carry what was dropped to
          the next round. ``p`` is the density in percent, in ``(0, 100]``, written without
          leading zeros or trailing fractional zeros and with at most six decimals
          (``topk-d2-b2``, ``topk-d0.5-b4``), so that one codec has exactly one name; ``w`` is
          the code width in bits, one of :data:`TOPK_BITS`. :func:`parse_topk` reads a name.

          The values are cut into chunks of ``TOPK_CHUNK`` = 4096 (the last may be partial).
          A chunk of ``L`` values keeps ``k = max(1, ceil(p · L / 100))`` entries (computed
          exactly, not in floating point): those with the largest ``|x|``, ties going to the
          lower index. Each chunk, in order, takes ``4 + 2·k + ceil(k·w / 8)`` bytes:

          * a float32 scale ``s``, the chunk's ``max|x|`` (always a kept entry);
          * ``k`` uint16 index *gaps*: the first kept index, then the differences between
            consecutive kept indices, which are increasing, so every gap after the first is
            ``>= 1``. Gaps are small numbers, which zstd compresses better than absolute
            indices (to 57% of their raw size against 86% for Gaussian data at 2%);
          * ``k`` codes ``u`` in ``[0, 2^w)`` packed LSB first: code ``j`` is bits
            ``j·w .. j·w + w - 1`` of the chunk's code bytes read as one little-endian bit
            string; unused high bits of the last byte are 0.

          With ``Q = 2^w - 1`` a code decodes to ``(2u - Q) / Q · s``: ``Q + 1`` levels
          spread evenly over ``[-s, s]`` with no zero level, since every kept value is large
          (a mid-rise quantizer). The encoder picks the nearest level. Entries not kept
          decode to 0. Since ``|level| <= 1``, every finite scale decodes to finite values,
          so the scale needs no clamp beyond being a finite float32.

Error bounds (up to float32 rounding): fp32 is exact; bf16 has relative error at most ``2^-8``
(its unit roundoff; larger for subnormals); int8 and int4 have ``|x - x̂| <= s / 2`` per block.
topk: a kept entry has ``|x - x̂| <= s / Q``; a dropped entry decodes to 0 and has
``|x| <=`` the smallest kept ``|x|`` of its chunk.

Validation on decode
--------------------
Sizes are checked from the frame header before anything is allocated: the declared content size
must equal :func:`raw_size` for the expected shapes (missing -> :class:`CodecError`, larger ->
:class:`OversizedFrame`, smaller -> :class:`CodecError`) and the window must fit the cap. Corrupt
frames raise :class:`ChecksumMismatch`, :class:`TruncatedFrame` or :class:`CodecError`; scales
that are negative, non-finite or above the clamp, and codes outside ``[-k, k]``, raise
:class:`CodecError`; NaN or Inf among decoded fp32/bf16 values raises :class:`NonFinite`.
A topk chunk whose scale is negative or not finite, whose indices are not strictly increasing
(a gap of 0 after the first) or reach past the chunk, or whose unused code bits are not 0,
raises :class:`CodecError`.
Every one of them is a :class:`~pipeline.errors.WireError`, i.e. a message to drop and count.

Encoding int8/int4/topk input that holds NaN or Inf raises :class:`NonFinite` (the format cannot
carry them); fp32/bf16 carry them verbatim and the receiver rejects them.

Threading: compressor and decompressor contexts are cached per thread (``threading.local``);
every function here may be called from several threads at once.
"""

from __future__ import annotations

import functools
import math
import re
import threading
from collections.abc import Hashable, Sequence
from fractions import Fraction
from typing import Any, NamedTuple

import ml_dtypes
import numpy as np
import numpy.typing as npt
import zstandard

from ddiloco.pipeline.errors import (
    ChecksumMismatch,
    CodecError,
    NonFinite,
    OversizedFrame,
    TruncatedFrame,
)

__all__ = [
    "CODECS",
    "DEFAULT_BLOCK",
    "DENSE_CODECS",
    "TOPK_BITS",
    "TOPK_CHUNK",
    "ErrorFeedback",
    "decode",
    "dequantize",
    "encode",
    "encode_and_reconstruct",
    "is_codec",
    "max_payload_size",
    "parse_topk",
    "quantize",
    "quantize_roundtrip",
    "raw_size",
    "topk_keep",
    "unknown_codec_message",
]

DENSE_CODECS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")
"""Codecs that send every value, from lossless to smallest."""

CODECS: tuple[str, ...] = (*DENSE_CODECS, "topk-d2-b2", "topk-d5-b4")
"""The dense codecs and two topk examples. Not exhaustive: any name :func:`is_codec` accepts is
a codec, e.g. ``topk-d0.5-b3``; test names with :func:`is_codec`, not membership here."""

TOPK_CHUNK = 4096
"""Values per topk chunk. Below 65536, so that an index (and a gap) fits a uint16."""

TOPK_BITS: tuple[int, ...] = (2, 3, 4, 8)
"""Code widths, in bits, that topk names may ask for."""

DEFAULT_BLOCK = 64
"""Values per quantization block: one float32 scale per 64 values costs 0.5 bit per value."""

MIN_WINDOW = 1 << 23
"""Smallest zstd window (bytes) :func:`decode` accepts whatever the payload size (8 MiB)."""

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
# Names
# --------------------------------------------------------------------------------------------

# Canonical spelling only (no "02", no "2.0"): names are compared as strings against the run
# manifest, so two spellings of one codec would look like two codecs.
_TOPK_NAME = re.compile(r"topk-d(0|[1-9][0-9]{0,2})(?:\.([0-9]{0,5}[1-9]))?-b([1-9][0-9]?)")


class _TopK(NamedTuple):
    density: Fraction  # percent, exact: k must not depend on float rounding
    bits: int


@functools.lru_cache(maxsize=256)
def _topk_spec(name: str) -> _TopK | None:
    match = _TOPK_NAME.fullmatch(name)
    if match is None:
        return None
    whole, frac, bits = match.groups()
    density = Fraction(f"{whole}.{frac}" if frac else whole)
    if not 0 < density <= 100 or int(bits) not in TOPK_BITS:
        return None
    return _TopK(density, int(bits))


def parse_topk(name: object) -> tuple[float, int] | None:
    """Read a topk codec name.

    Parameters
    ----------
    name : object
        A candidate codec name such as ``"topk-d2-b2"``.

    Returns
    -------
    (float, int) or None
        ``(density, bits)``: the percentage of values kept per chunk, in ``(0, 100]``, and the
        code width in bits, one of :data:`TOPK_BITS`; None when ``name`` is not a valid topk name
        (wrong form, density 0 or above 100, other widths, a non-canonical spelling such as
        ``topk-d2.0-b2``, or not a str). Never raises.
    """
    spec = _topk_spec(name) if isinstance(name, str) else None
    return None if spec is None else (float(spec.density), spec.bits)


def is_codec(name: object) -> bool:
    """Whether ``name`` is a codec: one of :data:`DENSE_CODECS` or a valid topk name.

    Parameters
    ----------
    name : object
        A candidate codec name.

    Returns
    -------
    bool
        False for anything else, including non-str values. Never raises.
    """
    return isinstance(name, str) and (name in DENSE_CODECS or parse_topk(name) is not None)


def unknown_codec_message(name: object) -> str:
    """Error text for a name that :func:`is_codec` rejects, listing the valid forms.

    Parameters
    ----------
    name : object
        The rejected name.

    Returns
    -------
    str
        One line, e.g. ``unknown codec 'int2'; expected fp32, bf16, int8, int4 or
        topk-d<density %>-b<bits> ...``.
    """
    bits = ", ".join(str(b) for b in TOPK_BITS)
    return (
        f"unknown codec {name!r}; expected {', '.join(DENSE_CODECS[:-1])} or {DENSE_CODECS[-1]}, "
        f"or topk-d<density %>-b<bits> with density in (0, 100] (at most 6 decimals, no "
        f"leading or trailing zeros) and bits in {{{bits}}}, e.g. topk-d2-b2 or topk-d0.5-b4"
    )


def topk_keep(codec: str, length: int) -> int:
    """Number of values a topk codec keeps in a chunk of ``length`` values.

    Parameters
    ----------
    codec : str
        A topk name (:func:`parse_topk`).
    length : int
        Chunk length, ``0 <= length <= TOPK_CHUNK``.

    Returns
    -------
    int
        ``max(1, ceil(density · length / 100))`` computed exactly, or 0 for an empty chunk.

    Raises
    ------
    ValueError
        Not a topk name, or ``length`` out of range.
    """
    spec = _topk_spec(codec) if isinstance(codec, str) else None
    if spec is None:
        raise ValueError(f"not a topk codec: {codec!r}")
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= TOPK_CHUNK:
        raise ValueError(f"chunk length must be an int in [0, {TOPK_CHUNK}], got {length!r}")
    return _topk_k(spec, length)


def _topk_k(spec: _TopK, length: int) -> int:
    if length == 0:
        return 0
    d = spec.density
    return max(1, -(-(d.numerator * length) // (d.denominator * 100)))


def _topk_record(spec: _TopK, length: int) -> tuple[int, int]:
    """``(k, bytes)`` of one chunk of ``length >= 1`` values."""
    k = _topk_k(spec, length)
    return k, 4 + 2 * k + -(-(k * spec.bits) // 8)


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


def _check_codec(codec: str, exc: type[Exception]) -> None:
    if not is_codec(codec):
        raise exc(unknown_codec_message(codec))


def _check_block(block: int, exc: type[Exception]) -> None:
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise exc(f"block must be a positive int, got {block!r}")


def raw_size(n_values: int, codec: str, block: int = DEFAULT_BLOCK) -> int:
    """Exact size of the raw (decompressed) payload.

    Parameters
    ----------
    n_values : int
        Total number of float32 values, ``>= 0``.
    codec : str
        A codec name that :func:`is_codec` accepts (see :data:`CODECS`).
    block : int
        Values per quantization block (int8/int4 only; checked, unused by the others), ``>= 1``.

    Returns
    -------
    int
        Size in bytes, following the layouts in the module docstring.

    Raises
    ------
    ValueError
        Unknown codec, negative ``n_values`` or a block size below 1.
    """
    _check_codec(codec, ValueError)
    _check_block(block, ValueError)
    if n_values < 0:
        raise ValueError(f"n_values must be >= 0, got {n_values}")
    if codec == "fp32":
        return 4 * n_values
    if codec == "bf16":
        return 2 * n_values
    spec = _topk_spec(codec)
    if spec is not None:
        full, rest = divmod(n_values, TOPK_CHUNK)
        size = full * _topk_record(spec, TOPK_CHUNK)[1]
        return size + (_topk_record(spec, rest)[1] if rest else 0)
    n_blocks = -(-n_values // block)
    if codec == "int8":
        return 4 * n_blocks + n_values
    return 4 * n_blocks + (n_values + 1) // 2


def max_payload_size(n_values: int, codec: str, block: int = DEFAULT_BLOCK) -> int:
    """Upper bound on the size of the payload :func:`encode` returns, whatever the data.

    This is zstd's ``ZSTD_COMPRESSBOUND`` (lib/zstd.h) of :func:`raw_size`, which covers the frame
    header, block headers and checksum; the wire layer uses it to reject an oversized payload
    before looking inside it.

    Parameters
    ----------
    n_values, codec, block
        As in :func:`raw_size`.

    Returns
    -------
    int
        Size in bytes.

    Raises
    ------
    ValueError
        As in :func:`raw_size`.
    """
    src = raw_size(n_values, codec, block)
    small = ((128 << 10) - src) >> 11 if src < (128 << 10) else 0
    return src + (src >> 8) + small


# --------------------------------------------------------------------------------------------
# Per-thread zstd contexts: creating one allocates its work space, and they are not thread safe.
# --------------------------------------------------------------------------------------------

_local = threading.local()


def _compressor(level: int) -> zstandard.ZstdCompressor:
    cache: dict[int, zstandard.ZstdCompressor] = _local.__dict__.setdefault("c", {})
    cctx = cache.get(level)
    if cctx is None:
        cctx = zstandard.ZstdCompressor(level=level, write_checksum=True, write_content_size=True)
        cache[level] = cctx
    return cctx


def _decompressor(max_window: int) -> zstandard.ZstdDecompressor:
    cache: dict[int, zstandard.ZstdDecompressor] = _local.__dict__.setdefault("d", {})
    dctx = cache.get(max_window)
    if dctx is None:
        dctx = zstandard.ZstdDecompressor(max_window_size=max_window)
        cache[max_window] = dctx
    return dctx


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

    Parameters
    ----------
    arrays : sequence of array_like, float32, any shapes
        The tensors, concatenated in order after C-order flattening.
    codec : str
        A codec name that :func:`is_codec` accepts (see :data:`CODECS`).
    block : int
        Values per quantization block (int8/int4).

    Returns
    -------
    numpy.ndarray, uint8, shape (raw_size(n, codec, block),)
        The raw payload (module docstring). For fp32 with one C-contiguous input on a
        little-endian host it is a view of that input, not a copy.

    Raises
    ------
    ValueError
        Unknown codec or bad block size.
    TypeError
        An input that is not float32.
    NonFinite
        NaN or Inf in the input of int8/int4/topk, which cannot represent them.
    """
    _check_codec(codec, ValueError)
    _check_block(block, ValueError)
    flat = _flatten(arrays)
    if codec == "fp32":
        return flat.astype(_F32, copy=False).view(np.uint8)
    if codec == "bf16":
        return flat.astype(_BF16).view(np.uint16).astype(_U16, copy=False).view(np.uint8)
    spec = _topk_spec(codec)
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


def _quantize_topk(flat: npt.NDArray[np.float32], codec: str, spec: _TopK) -> npt.NDArray[np.uint8]:
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
        k, size = _topk_record(spec, length)
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


def _dequantize_topk(buf: memoryview, n: int, codec: str, spec: _TopK) -> npt.NDArray[np.float32]:
    body = np.frombuffer(buf, dtype=np.uint8)
    out = np.zeros(n, dtype=np.float32)
    offset = 0
    for start, rows, length in _topk_chunks(n):
        k, size = _topk_record(spec, length)
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


def _shapes(shapes: Sequence[tuple[int, ...]]) -> tuple[list[tuple[int, ...]], int]:
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

    Parameters
    ----------
    raw : bytes-like, length raw_size(sum of sizes, codec, block)
        The raw payload.
    shapes : sequence of tuple of int
        Shapes of the tensors, in payload order.
    codec : str
        A codec name that :func:`is_codec` accepts (see :data:`CODECS`).
    block : int
        Values per quantization block (int8/int4).

    Returns
    -------
    list of numpy.ndarray, float32, the given shapes
        C-contiguous, writable, non-overlapping views of one fresh buffer.

    Raises
    ------
    CodecError
        Unknown codec, bad block or shapes, wrong raw size, scales that are negative, non-finite
        or above the clamp, codes outside ``[-k, k]``, a non-zero int4 pad nibble; for topk,
        indices that are not strictly increasing or fall outside their chunk, or non-zero
        unused code bits.
    NonFinite
        NaN or Inf among decoded fp32/bf16 values.
    """
    _check_codec(codec, CodecError)
    _check_block(block, CodecError)
    dims, n = _shapes(shapes)
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

    spec = _topk_spec(codec)
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

    Parameters
    ----------
    arrays : sequence of array_like, float32
        The tensors.
    codec : str
        A codec name that :func:`is_codec` accepts (see :data:`CODECS`).
    block : int
        Values per quantization block (int8/int4).

    Returns
    -------
    list of numpy.ndarray, float32
        Same shapes as ``arrays``; C-contiguous, writable, never aliasing the inputs.

    Raises
    ------
    ValueError, TypeError, NonFinite
        As :func:`quantize`; :class:`NonFinite` also for NaN/Inf in fp32/bf16 input (or bf16
        overflow), as :func:`decode` would raise.
    """
    shapes = [np.shape(a) for a in arrays]
    return dequantize(quantize(arrays, codec, block), shapes, codec, block)


# --------------------------------------------------------------------------------------------
# zstd
# --------------------------------------------------------------------------------------------


def encode(
    arrays: Sequence[npt.ArrayLike],
    codec: str,
    *,
    block: int = DEFAULT_BLOCK,
    level: int = 1,
) -> bytes:
    """Quantize the concatenation of the flattened arrays, then compress it into one zstd frame.

    Parameters
    ----------
    arrays : sequence of array_like, float32, any shapes
        The tensors, concatenated in order after C-order flattening.
    codec : str
        A codec name that :func:`is_codec` accepts (see :data:`CODECS`).
    block : int
        Values per quantization block (int8/int4).
    level : int
        zstd level; 1 is the fast default, negative levels are faster still.

    Returns
    -------
    bytes
        One zstd frame, content checksum on and content size declared; at most
        :func:`max_payload_size` bytes.

    Raises
    ------
    ValueError
        Unknown codec, bad block size or level.
    TypeError
        An input that is not float32.
    NonFinite
        NaN or Inf in the input of int8/int4/topk.
    """
    _check_level(level)
    return _compressor(level).compress(quantize(arrays, codec, block).data)


def encode_and_reconstruct(
    arrays: Sequence[npt.ArrayLike],
    codec: str,
    *,
    block: int = DEFAULT_BLOCK,
    level: int = 1,
) -> tuple[bytes, list[np.ndarray]]:
    """``(encode(x), quantize_roundtrip(x))`` with a single quantization pass.

    For a sender with error feedback, which needs both the payload and what receivers decode.

    Raises
    ------
    ValueError, TypeError, NonFinite
        As :func:`encode` and :func:`quantize_roundtrip`.
    """
    _check_level(level)
    raw = quantize(arrays, codec, block)
    shapes = [np.shape(a) for a in arrays]
    reconstructed = dequantize(raw, shapes, codec, block)
    return _compressor(level).compress(raw.data), reconstructed


def _check_level(level: int) -> None:
    if isinstance(level, bool) or not isinstance(level, int):
        raise ValueError(f"zstd level must be an int, got {level!r}")
    if not -(1 << 17) <= level <= zstandard.MAX_COMPRESSION_LEVEL:
        raise ValueError(f"zstd level {level} out of range")


def _window_cap(expected: int) -> int:
    return max(MIN_WINDOW, 1 << max(0, expected - 1).bit_length())


def decode(
    payload: bytes | bytearray | memoryview,
    shapes: Sequence[tuple[int, ...]],
    codec: str,
    *,
    block: int = DEFAULT_BLOCK,
) -> list[np.ndarray]:
    """Inverse of :func:`encode`, bounding memory before allocating.

    Parameters
    ----------
    payload : bytes-like
        One zstd frame as written by :func:`encode`; nothing may follow it.
    shapes : sequence of tuple of int
        Expected tensor shapes (from the run manifest), in payload order.
    codec : str
        A codec name that :func:`is_codec` accepts (see :data:`CODECS`).
    block : int
        Values per quantization block (int8/int4).

    Returns
    -------
    list of numpy.ndarray, float32, the given shapes
        C-contiguous, writable, non-overlapping views of one fresh buffer.

    Raises
    ------
    CodecError
        Unknown codec, bad block or shapes, a frame without declared content size or checksum,
        a declared size smaller than expected, a dictionary frame, trailing bytes, undecodable
        zstd data, invalid scales, codes or topk indices (as :func:`dequantize`).
    OversizedFrame
        A declared content size larger than the shapes allow, or a window above the cap
        (``max(8 MiB, next power of two >= expected size)``).
    TruncatedFrame
        The frame ends early (including a header cut short).
    ChecksumMismatch
        The zstd content checksum does not match.
    NonFinite
        NaN or Inf among decoded fp32/bf16 values.
    """
    _check_codec(codec, CodecError)
    _check_block(block, CodecError)
    _, n = _shapes(shapes)
    expected = raw_size(n, codec, block)
    try:
        params = zstandard.get_frame_parameters(payload)
    except zstandard.ZstdError as exc:
        if "not enough data" in str(exc):
            raise TruncatedFrame(f"zstd frame header cut short: {exc}") from exc
        raise CodecError(f"not a zstd frame: {exc}") from exc
    size = params.content_size
    if size == zstandard.CONTENTSIZE_UNKNOWN:
        raise CodecError("zstd frame does not declare its content size")
    if size > expected:
        raise OversizedFrame(f"zstd frame declares {size} bytes; {codec} shapes allow {expected}")
    if size < expected:
        raise CodecError(f"zstd frame declares {size} bytes; {codec} shapes need {expected}")
    if params.dict_id:
        raise CodecError(f"zstd frame needs dictionary {params.dict_id}")
    if not params.has_checksum:
        raise CodecError("zstd frame has no content checksum")
    cap = _window_cap(expected)
    # Single-pass decompression does not enforce max_window_size itself; check it here.
    if params.window_size > cap:
        raise OversizedFrame(f"zstd window {params.window_size} bytes exceeds cap {cap}")
    try:
        raw = _decompressor(cap).decompress(
            payload, max_output_size=expected, allow_extra_data=False
        )
    except zstandard.ZstdError as exc:
        msg = str(exc)
        if "checksum" in msg:
            raise ChecksumMismatch(f"zstd content checksum: {msg}") from exc
        if "did not decompress full frame" in msg:
            raise TruncatedFrame(f"zstd frame ends early: {msg}") from exc
        raise CodecError(f"corrupt zstd frame: {msg}") from exc
    return dequantize(raw, shapes, codec, block)


# --------------------------------------------------------------------------------------------
# Error feedback
# --------------------------------------------------------------------------------------------


class ErrorFeedback:
    """Error feedback for lossy codecs: what quantization dropped is added to the next send.

    Keeps one float32 residual per key (e.g. fragment id) and per tensor. A sender does::

        xs = ef.compensate(key, delta)             # delta + residual
        payload, sent = encode_and_reconstruct(xs, codec)
        ef.update(key, xs, sent)                   # residual = xs - sent

    so the sum of what receivers decode over rounds tracks the sum of the true deltas, with an
    error bounded by one round's quantization error instead of growing with the number of rounds.
    Source: 1-bit SGD with error feedback, Seide et al., Interspeech 2014; analysed for
    compressed SGD as EF-SGD by Karimireddy et al., "Error Feedback Fixes SignSGD and other
    Gradient Compression Schemes", ICML 2019.

    With a topk codec the residual also holds every entry a chunk did not keep, which is sent
    once it has grown large enough to be selected: the error feedback of SparseLoCo (arXiv
    2508.15706), which in addition decays the residual as a stand-in for outer momentum; this
    class does not decay it.

    Memory: one float32 copy of each tensor per key. For fp32 the residual is exactly zero and
    feedback can be skipped. Not thread safe: use one instance per sending thread or a lock.
    """

    def __init__(self) -> None:
        self._residuals: dict[Hashable, list[np.ndarray]] = {}

    def compensate(self, key: Hashable, arrays: Sequence[npt.ArrayLike]) -> list[np.ndarray]:
        """Return ``arrays + residual[key]`` as new float32 arrays (inputs are not modified).

        Parameters
        ----------
        key : hashable
            Stream identifier, e.g. fragment id.
        arrays : sequence of array_like, float32
            The values about to be sent.

        Returns
        -------
        list of numpy.ndarray, float32
            Same shapes as ``arrays``; copies when there is no residual yet.

        Raises
        ------
        ValueError
            The number of arrays or their shapes differ from the stored residual's.
        """
        xs = [np.asarray(a, dtype=np.float32) for a in arrays]
        residual = self._residuals.get(key)
        if residual is None:
            return [x.copy() for x in xs]
        self._check(key, xs, residual)
        return [x + r for x, r in zip(xs, residual, strict=True)]

    def update(
        self,
        key: Hashable,
        sent: Sequence[npt.ArrayLike],
        reconstructed: Sequence[npt.ArrayLike],
    ) -> None:
        """Store ``sent - reconstructed`` as the residual of ``key``.

        Parameters
        ----------
        key : hashable
            Stream identifier.
        sent : sequence of array_like, float32
            What was encoded: the output of :meth:`compensate`.
        reconstructed : sequence of array_like, float32
            What receivers decode from it (:func:`quantize_roundtrip` or
            :func:`encode_and_reconstruct`).

        Raises
        ------
        ValueError
            ``sent`` and ``reconstructed`` differ in count or shapes.
        """
        xs = [np.asarray(a, dtype=np.float32) for a in sent]
        ys = [np.asarray(a, dtype=np.float32) for a in reconstructed]
        self._check(key, xs, ys)
        self._residuals[key] = [
            np.subtract(x, y, dtype=np.float32) for x, y in zip(xs, ys, strict=True)
        ]

    def reset(self, key: Hashable) -> None:
        """Forget the residual of ``key`` (e.g. after a resync from the store); no-op if absent."""
        self._residuals.pop(key, None)

    def residual(self, key: Hashable) -> list[np.ndarray] | None:
        """The stored residual of ``key`` (not a copy), or None."""
        return self._residuals.get(key)

    def __contains__(self, key: object) -> bool:
        return key in self._residuals

    def __len__(self) -> int:
        return len(self._residuals)

    @property
    def nbytes(self) -> int:
        """Memory held by all residuals, in bytes."""
        return sum(r.nbytes for rs in self._residuals.values() for r in rs)

    @staticmethod
    def _check(key: Hashable, xs: Sequence[np.ndarray], ys: Sequence[np.ndarray]) -> None:
        if [x.shape for x in xs] != [y.shape for y in ys]:
            raise ValueError(
                f"error feedback {key!r}: shapes {[x.shape for x in xs]} "
                f"do not match {[y.shape for y in ys]}"
            )
