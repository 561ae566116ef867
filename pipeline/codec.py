"""Payload codecs: per-block quantization or per-chunk top-k, then one zstd frame (DESIGN §4).

A payload carries the concatenation of the flattened float32 tensors of one fragment (a delta or
the fragment's values), in the order the caller lists them. The quantized bytes (the *raw*
payload) are compressed into exactly one zstd frame with the content checksum on and the content
size in the frame header, so that a receiver can bound memory before decompressing.

Raw layouts:

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

Validation on decode:

Sizes are checked from the frame header before anything is allocated: the declared content size
must equal :func:`raw_size` for the expected shapes (missing -> :class:`CodecError`, larger ->
:class:`OversizedFrame`, smaller -> :class:`CodecError`) and the window must fit the cap. Corrupt
frames raise :class:`ChecksumMismatch`, :class:`TruncatedFrame` or :class:`CodecError`; scales
that are negative, non-finite or above the clamp, and codes outside ``[-k, k]``, raise
:class:`CodecError`; NaN or Inf among decoded fp32/bf16 values raises :class:`NonFinite`.
A topk chunk whose scale is negative or not finite, whose indices are not strictly increasing
(a gap of 0 after the first) or reach past the chunk, or whose unused code bits are not 0,
raises :class:`CodecError`.
Every one of them is a :class:`~ddiloco.pipeline.errors.WireError`, i.e. a message to drop and
count.

Encoding int8/int4/topk input that holds NaN or Inf raises :class:`NonFinite` (the format cannot
carry them); fp32/bf16 carry them verbatim and the receiver rejects them.

Threading: compressor and decompressor contexts are cached per thread (``threading.local``);
every function here may be called from several threads at once.
"""
from __future__ import annotations

import threading
from collections.abc import Hashable, Sequence

import numpy as np
import numpy.typing as npt
import zstandard

from ddiloco.pipeline.codec_spec import (
    CODECS,
    DEFAULT_BLOCK,
    DENSE_CODECS,
    MIN_WINDOW,
    TOPK_BITS,
    TOPK_CHUNK,
    check_block,
    check_codec,
    is_codec,
    max_payload_size,
    parse_topk,
    raw_size,
    topk_keep,
    unknown_codec_message,
)
from ddiloco.pipeline.errors import (
    ChecksumMismatch,
    CodecError,
    OversizedFrame,
    TruncatedFrame,
)
from ddiloco.pipeline.quantize import (
    check_shapes,
    dequantize,
    quantize,
    quantize_roundtrip,
)

# The codecs' public front: encode/decode here, names, sizes and quantizers from the two
# modules beside it.
__all__ = [
    "CODECS",
    "DEFAULT_BLOCK",
    "DENSE_CODECS",
    "MIN_WINDOW",
    "TOPK_BITS",
    "TOPK_CHUNK",
    "ErrorFeedback",
    "decode",
    "decompress_checked",
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

    Args:
        arrays: the tensors, float32 array_likes of any shapes, concatenated in order after
            C-order flattening.
        codec: a codec name that :func:`is_codec` accepts (see :data:`CODECS`).
        block: values per quantization block (int8/int4).
        level: zstd level; 1 is the fast default, negative levels are faster still.

    Returns:
        One zstd frame, content checksum on and content size declared; at most
        :func:`max_payload_size` bytes.

    Raises:
        ValueError: unknown codec, bad block size or level.
        TypeError: an input that is not float32.
        NonFinite: NaN or Inf in the input of int8/int4/topk.
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

    Raises:
        ValueError, TypeError, NonFinite: as :func:`encode` and :func:`quantize_roundtrip`.
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

    Args:
        payload: one zstd frame as written by :func:`encode`, bytes-like; nothing may follow it.
        shapes: expected tensor shapes (from the run manifest), in payload order.
        codec: a codec name that :func:`is_codec` accepts (see :data:`CODECS`).
        block: values per quantization block (int8/int4).

    Returns:
        Float32 arrays of the given shapes: C-contiguous, writable, non-overlapping views of one
        fresh buffer.

    Raises:
        CodecError: unknown codec, bad block or shapes, a frame without declared content size or
            checksum, a declared size smaller than expected, a dictionary frame, trailing bytes,
            undecodable zstd data, invalid scales, codes or topk indices (as :func:`dequantize`).
        OversizedFrame: a declared content size larger than the shapes allow, or a window above the
            cap (``max(8 MiB, next power of two >= expected size)``).
        TruncatedFrame: the frame ends early (including a header cut short).
        ChecksumMismatch: the zstd content checksum does not match.
        NonFinite: NaN or Inf among decoded fp32/bf16 values.
    """
    check_codec(codec, CodecError)
    check_block(block, CodecError)
    _, n = check_shapes(shapes)
    expected = raw_size(n, codec, block)
    raw = decompress_checked(payload, expected, codec)
    return dequantize(raw, shapes, codec, block)


#: Frames that decompress to at least this many bytes are written into a numpy buffer, which
#: the kernel backs with huge pages where it can (numpy asks for them): a fragment-sized
#: ``bytes`` result costs a page fault per 4 KiB. A 47 MB int4 delta took 56 ms into
#: ``bytes``, 41 ms into a new numpy buffer. Smaller ones take the one-shot call, as quick
#: for them.
STREAM_MIN = 1 << 20
#: Compressed bytes handed to the decompressor per call on the streamed path.
_STREAM_READ = 4 << 20
#: zstd block types (RFC 8878 §3.1.1.2.2): raw, RLE, compressed; 3 is reserved.
_RLE_BLOCK, _RESERVED_BLOCK = 1, 3


def frame_size(payload: bytes | bytearray | memoryview, header: int, checksum: bool) -> int:
    """Bytes of the zstd frame at the start of ``payload``, from its block headers
    (RFC 8878 §3.1.1: the frame header of ``header`` bytes, then blocks of a 3-byte header each
    (last-block flag, type, size) and a body of ``size`` bytes (one for an RLE block), then
    the 4-byte content checksum when ``checksum``). Reads the block headers only.

    Raises:
        TruncatedFrame: the frame runs past the end of ``payload``.
        CodecError: a reserved block type.
    """
    view = memoryview(payload).cast("B")
    end, size = header, view.nbytes
    while True:
        if end + 3 > size:
            raise TruncatedFrame(f"zstd frame ends early: block header at {end} of {size} bytes")
        word = view[end] | view[end + 1] << 8 | view[end + 2] << 16
        kind = (word >> 1) & 3
        if kind == _RESERVED_BLOCK:
            raise CodecError(f"corrupt zstd frame: reserved block type at byte {end}")
        end += 3 + (1 if kind == _RLE_BLOCK else word >> 3)
        if word & 1:
            break
    end += 4 if checksum else 0
    if end > size:
        raise TruncatedFrame(f"zstd frame ends early: it needs {end} bytes, has {size}")
    return end


def decompress_checked(payload: bytes | bytearray | memoryview, expected: int,
                       codec: str) -> npt.NDArray[np.uint8]:
    """The raw layout in one zstd frame, checked before anything is allocated: the frame must
    declare exactly ``expected`` bytes, a content checksum, no dictionary and a window within
    the cap for that size, and end where ``payload`` ends; then decompressed in one pass.

    Returns:
        uint8, shape ``(expected,)``, not shared with any other caller. Below
        :data:`STREAM_MIN` bytes a read-only view of the decompressor's ``bytes``; from it on
        numpy's allocation (huge pages where the kernel grants them), filled by the streamed
        decompressor with no intermediate copy.

    Raises:
        TruncatedFrame, OversizedFrame, ChecksumMismatch, CodecError.
    """
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
        if expected < STREAM_MIN:
            raw = _decompressor(cap).decompress(
                payload, max_output_size=expected, allow_extra_data=False
            )
            return np.frombuffer(raw, np.uint8)
        return _decompress_into(payload, expected, cap)
    except zstandard.ZstdError as exc:
        msg = str(exc)
        if "checksum" in msg:
            raise ChecksumMismatch(f"zstd content checksum: {msg}") from exc
        if "did not decompress full frame" in msg:
            raise TruncatedFrame(f"zstd frame ends early: {msg}") from exc
        raise CodecError(f"corrupt zstd frame: {msg}") from exc


def _decompress_into(payload: bytes | bytearray | memoryview, expected: int,
                     cap: int) -> npt.NDArray[np.uint8]:
    """:func:`decompress_checked`'s streamed path. The stream reader neither notices bytes
    after the frame nor a frame cut inside its checksum, so the frame's extent is read from
    its block headers first (:func:`frame_size`)."""
    header = zstandard.frame_header_size(payload)
    end = frame_size(payload, header, checksum=True)
    if end != memoryview(payload).nbytes:
        raise CodecError(f"{memoryview(payload).nbytes - end} bytes after the zstd frame")
    out = np.empty(expected, np.uint8)
    view = memoryview(out.data)
    got = 0
    reader = _decompressor(cap).stream_reader(payload, read_size=_STREAM_READ,
                                              read_across_frames=False)
    with reader:
        while got < expected:
            n = reader.readinto(view[got:])
            if not n:
                break
            got += n
        if got < expected:
            raise TruncatedFrame(f"zstd frame ends early: {got} of {expected} bytes")
        if reader.read(1):
            raise CodecError("zstd frame holds more than it declares")
    return out


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

        Args:
            key: stream identifier (hashable), e.g. fragment id.
            arrays: the values about to be sent, float32 array_likes.

        Returns:
            Float32 arrays of the same shapes as ``arrays``; copies when there is no residual yet.

        Raises:
            ValueError: the number of arrays or their shapes differ from the stored residual's.
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

        Args:
            key: stream identifier (hashable).
            sent: what was encoded, float32 array_likes: the output of :meth:`compensate`.
            reconstructed: what receivers decode from it, float32 array_likes
                (:func:`quantize_roundtrip` or :func:`encode_and_reconstruct`).

        Raises:
            ValueError: ``sent`` and ``reconstructed`` differ in count or shapes.
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
