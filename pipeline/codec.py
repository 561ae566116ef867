"""Payload codecs: per-block quantization, then one zstd frame (DESIGN §4).

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

Error bounds (up to float32 rounding): fp32 is exact; bf16 has relative error at most ``2^-8``
(its unit roundoff; larger for subnormals); int8 and int4 have ``|x - x̂| <= s / 2`` per block.

Validation on decode
--------------------
Sizes are checked from the frame header before anything is allocated: the declared content size
must equal :func:`raw_size` for the expected shapes (missing -> :class:`CodecError`, larger ->
:class:`OversizedFrame`, smaller -> :class:`CodecError`) and the window must fit the cap. Corrupt
frames raise :class:`ChecksumMismatch`, :class:`TruncatedFrame` or :class:`CodecError`; scales
that are negative, non-finite or above the clamp, and codes outside ``[-k, k]``, raise
:class:`CodecError`; NaN or Inf among decoded fp32/bf16 values raises :class:`NonFinite`.
Every one of them is a :class:`~pipeline.errors.WireError`, i.e. a message to drop and count.

Encoding int8/int4 input that holds NaN or Inf raises :class:`NonFinite` (the format cannot carry
them); fp32/bf16 carry them verbatim and the receiver rejects them.

Threading: compressor and decompressor contexts are cached per thread (``threading.local``);
every function here may be called from several threads at once.
"""

from __future__ import annotations

import math
import threading
from collections.abc import Hashable, Sequence
from typing import Any

import ml_dtypes
import numpy as np
import numpy.typing as npt
import zstandard

from pipeline.errors import ChecksumMismatch, CodecError, NonFinite, OversizedFrame, TruncatedFrame

__all__ = [
    "CODECS",
    "DEFAULT_BLOCK",
    "ErrorFeedback",
    "decode",
    "dequantize",
    "encode",
    "encode_and_reconstruct",
    "max_payload_size",
    "quantize",
    "quantize_roundtrip",
    "raw_size",
]

CODECS: tuple[str, ...] = ("fp32", "bf16", "int8", "int4")
"""Codec names, from lossless to smallest."""

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
# Sizes
# --------------------------------------------------------------------------------------------


def _check_codec(codec: str, exc: type[Exception]) -> None:
    if codec not in CODECS:
        raise exc(f"unknown codec {codec!r}; expected one of {CODECS}")


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
        One of :data:`CODECS`.
    block : int
        Values per quantization block (int8/int4 only), ``>= 1``.

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
        One of :data:`CODECS`.
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
        NaN or Inf in the input of int8/int4, which cannot represent them.
    """
    _check_codec(codec, ValueError)
    _check_block(block, ValueError)
    flat = _flatten(arrays)
    if codec == "fp32":
        return flat.astype(_F32, copy=False).view(np.uint8)
    if codec == "bf16":
        return flat.astype(_BF16).view(np.uint16).astype(_U16, copy=False).view(np.uint8)
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
        One of :data:`CODECS`.
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
        or above the clamp, codes outside ``[-k, k]``, a non-zero int4 pad nibble.
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
        One of :data:`CODECS`.
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
        One of :data:`CODECS`.
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
        NaN or Inf in the input of int8/int4.
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
        One of :data:`CODECS`.
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
        zstd data, invalid scales or codes.
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
