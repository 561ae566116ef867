"""The wire format: the one module that encodes and decodes every ddiloco message.

A message is a ZeroMQ multipart message of one or two frames (DESIGN §4):

* frame 0, the header: a msgpack map (at most :data:`MAX_HEADER_BYTES` bytes) with the keys

  ========== ====== ==========================================================================
  key        type   meaning
  ========== ====== ==========================================================================
  fv         int    format version, :data:`FORMAT_VERSION`
  kind       int    :class:`Kind`
  run        str    run id; a receiver drops messages of another run
  sender     str    learner id ("learner-3") or shard id ("shard-0")
  inc        int    sender incarnation (bumped at every process start)
  seq        int    per (sender, incarnation) sequence number, strictly increasing
  frag       int    fragment id p, -1 when the message has no fragment
  base       int    DELTA: version the delta was made against; VERSION (diff): previous version
  ver        int    VERSION: the new version; GRAD/GRAD_AVG: the inner step
  c_steps    int    inner steps since the sender last adopted fragment p
  c_tokens   int    tokens since then
  new_tokens int    tokens not yet reported in an earlier delta of p (token accounting)
  step       int    sender's inner step count
  step_time  float  sender's mean inner step time, seconds
  codec      str    payload codec (``pipeline.codec.is_codec``) or "" without payload
  enc        str    "full" (the tensors) or "diff" (VERSION only: Theta_new - Theta_prev)
  shapes     list   per-tensor shapes, float32 elements
  len        int    payload length, bytes
  crc        int    CRC-32C (Castagnoli) of the payload bytes, :func:`payload_crc`
  t          float  wall-clock send time, seconds since the epoch
  extra      map    small free-form fields (HEARTBEAT, CONTROL)
  ========== ====== ==========================================================================

* frame 1, the payload (only when ``len`` > 0): tensors quantized by the codec, then zstd with
  its content checksum (``pipeline.codec``).

Decoding checks, in order: frame count, header size (before the header frame is copied),
msgpack, field types, format version, kind, run id, codec and shapes against the manifest, the
declared payload length against the manifest's bound (:func:`max_payload_bytes`), the payload
frame's length against the declared one, CRC, then decodes the payload with memory bounded by
those shapes, and finiteness. Any failure raises a named
:class:`ddiloco.pipeline.errors.WireError`; receivers drop and count it. Nothing is ever pickled.

Size bounds and memory:

A message about a fragment of ``n`` float32 values has two frames of at most
:func:`max_frame_bytes` bytes each: the header (<= :data:`MAX_HEADER_BYTES`) and the payload
(<= ``codec.max_payload_size(n, codec)``, zstd's compress bound of the codec's raw size). The
transport sets ZeroMQ's MAXMSGSIZE (a per-frame cap) from it
(:func:`ddiloco.pipeline.transport.max_message_bytes`), so a peer cannot make libzmq allocate
more; this module then refuses a header whose declared ``len`` exceeds the manifest's bound for
its fragment and codec before it reads the payload, so an oversized declaration costs no
allocation beyond the frame already received.

The payload stays one frame on purpose: libzmq delivers a multipart message only once all of
its frames have arrived and caps each frame, not their number, so a payload cut into many frames
would let a peer queue an unbounded message.

Neither side copies the payload frame: :func:`encode` returns the codec's bytes object, which
the sockets send with ``copy=False``; :func:`decode` reads the payload through a memoryview
(the transport hands over views of the received ZeroMQ frames), and CRC and zstd read that view
in place. With ``M`` the payload bytes, ``R = codec.raw_size(n, codec)`` and ``F = 4 n``:

* :func:`encode` holds, besides the caller's ``F`` bytes of input, the codec's quantizer
  output ``R`` and the compressed ``M`` (plus the quantizer's temporaries,
  :mod:`ddiloco.pipeline.quantize`);
* :func:`decode` holds, besides the received ``M``, the decompressed ``R`` and the decoded
  ``F`` (plus the dequantizer's temporaries).

Measured by ``bench/bigmsg.py`` (int4 delta of a 2.03 GB fragment: ``M`` = 250 MB, ``R`` =
1.14 M, ``F`` = 8.1 M): :func:`encode` adds 24.8 M to the sender's RSS (the quantizer's
temporaries, about ``3 F``), :func:`decode` adds 11.3 M (``F + R`` and about ``n`` bytes of
temporaries), the transport ``M`` at the receiver and, with CURVE, ``2 M`` at the sender
while it encrypts (:mod:`ddiloco.pipeline.transport`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterable, Sequence
from dataclasses import asdict, dataclass, field, replace
from enum import IntEnum
from typing import Any

import crc32c
import msgpack
import numpy as np

from ddiloco.pipeline import codec as codec_mod
from ddiloco.pipeline.errors import (
    ChecksumMismatch,
    FrameError,
    OversizedFrame,
    SchemaMismatch,
    TruncatedFrame,
    UnsupportedVersion,
    WrongRun,
)

#: 2: payloads may use the topk codec family (``pipeline.codec``), which version 1 cannot decode.
#: 3: ``crc`` is CRC-32C, computed in hardware (SSE 4.2, ARMv8 CRC) by the ``crc32c`` package,
#: several times the speed of version 2's zlib CRC-32, which cost a syncer about a tenth of its
#: merge CPU at 1B parameters (``bench/scale.py``).
FORMAT_VERSION = 3
#: Upper bound of the msgpack header, bytes (shapes of a fragment fit in far less).
MAX_HEADER_BYTES = 64 * 1024

#: A received or encoded frame: ``bytes``, or a view of a ZeroMQ frame's memory.
Buffer = bytes | bytearray | memoryview


class Kind(IntEnum):
    """Message kinds."""

    DELTA = 1  #: learner -> shard: one fragment's outer gradient
    VERSION = 2  #: shard -> learners: a new fragment version
    HEARTBEAT = 3  #: shard -> learners when idle
    CONTROL = 4  #: shard -> learner: e.g. "resync" after a stale delta
    GRAD = 5  #: data-parallel baseline, learner -> shard: one fragment's gradient
    GRAD_AVG = 6  #: data-parallel baseline, shard -> learners: the averaged gradient


_INT_FIELDS = ("fv", "kind", "inc", "seq", "frag", "base", "ver", "c_steps", "c_tokens",
               "new_tokens", "step", "len", "crc")
_STR_FIELDS = ("run", "sender", "codec", "enc")
_FLOAT_FIELDS = ("step_time", "t")


@dataclass(frozen=True)
class Header:
    """Decoded frame-0 fields (see the module docstring for units)."""

    kind: Kind
    run: str
    sender: str
    inc: int = 0
    seq: int = 0
    frag: int = -1
    base: int = -1
    ver: int = -1
    c_steps: int = 0
    c_tokens: int = 0
    new_tokens: int = 0
    step: int = 0
    step_time: float = 0.0
    codec: str = ""
    enc: str = "full"
    shapes: tuple[tuple[int, ...], ...] = ()
    len: int = 0
    crc: int = 0
    t: float = 0.0
    fv: int = FORMAT_VERSION
    extra: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Message:
    """A decoded message: its header and, when it has a payload, float32 tensors."""

    header: Header
    tensors: list[np.ndarray] | None = None

    @property
    def kind(self) -> Kind:
        """The message kind."""
        return self.header.kind


def payload_crc(payload: bytes | bytearray | memoryview) -> int:
    """The ``crc`` of a payload: CRC-32C of its bytes, an unsigned 32-bit int. Reads the buffer
    in place (any contiguous buffer; no copy)."""
    return int(crc32c.crc32c(payload))


def encode(header: Header, tensors: Sequence[np.ndarray] | None = None,
           *, block: int = codec_mod.DEFAULT_BLOCK) -> list[bytes]:
    """Encode a message into ZeroMQ frames.

    Args:
        header: every field but ``len``, ``crc``, ``shapes`` and ``t`` (filled in here).
        tensors: float32 arrays to send with ``header.codec``; None for no payload.

    Returns:
        ``[header_bytes]`` or ``[header_bytes, payload_bytes]``; the payload is the codec's
        output itself (no copy), at most :func:`max_payload_bytes` bytes.

    Raises:
        ValueError: a payload without a codec, or an unknown codec.
    """
    t = header.t or time.time()
    if tensors is None:
        h = replace(header, len=0, crc=0, shapes=(), t=t)
        return [_pack(h)]
    if not header.codec:
        raise ValueError("wire.encode: a payload needs a codec")
    payload = codec_mod.encode(tensors, header.codec, block=block)
    shapes = tuple(tuple(int(d) for d in np.shape(a)) for a in tensors)
    h = replace(header, len=len(payload), crc=payload_crc(payload), shapes=shapes, t=t)
    return [_pack(h), payload]


def _pack(h: Header) -> bytes:
    d = asdict(h)
    d["kind"] = int(h.kind)
    d["shapes"] = [list(s) for s in h.shapes]
    return msgpack.packb(d, use_bin_type=True)


ShapeCheck = Callable[[Header], Sequence[tuple[int, ...]] | None]


def decode_header(frame: Buffer) -> Header:
    """Decode and type-check frame 0 (no run or manifest checks).

    Args:
        frame: the header frame, bytes-like; its size is checked before it is read.

    Raises:
        OversizedFrame, FrameError, UnsupportedVersion.
    """
    size = memoryview(frame).nbytes
    if size > MAX_HEADER_BYTES:
        raise OversizedFrame(f"header of {size} bytes exceeds {MAX_HEADER_BYTES}")
    try:
        raw = msgpack.unpackb(
            bytes(frame), raw=False, strict_map_key=True, max_str_len=4096, max_bin_len=0,
            max_array_len=4096, max_map_len=64,
        )
    except Exception as exc:  # msgpack raises many unrelated types for garbage input
        raise FrameError(f"header is not valid msgpack: {exc}") from None
    if not isinstance(raw, dict):
        raise FrameError("header is not a map")
    fv = raw.get("fv")
    if fv != FORMAT_VERSION:
        raise UnsupportedVersion(f"format version {fv!r}, this build speaks {FORMAT_VERSION}")
    for k in _INT_FIELDS:
        if k in raw and (not isinstance(raw[k], int) or isinstance(raw[k], bool)):
            raise FrameError(f"header field {k!r} must be an int, got {type(raw[k]).__name__}")
    for k in _STR_FIELDS:
        if k in raw and not isinstance(raw[k], str):
            raise FrameError(f"header field {k!r} must be a str")
    for k in _FLOAT_FIELDS:
        if k in raw and not isinstance(raw[k], (int, float)):
            raise FrameError(f"header field {k!r} must be a number")
    for k in ("kind", "run", "sender"):
        if k not in raw:
            raise FrameError(f"header field {k!r} is missing")
    try:
        kind = Kind(raw["kind"])
    except ValueError:
        raise FrameError(f"unknown message kind {raw['kind']!r}") from None
    shapes_raw = raw.get("shapes", [])
    if not isinstance(shapes_raw, list) or not all(
        isinstance(s, list) and all(isinstance(d, int) and d >= 0 for d in s) for s in shapes_raw
    ):
        raise FrameError("header field 'shapes' must be a list of lists of non-negative ints")
    extra = raw.get("extra", {})
    if not isinstance(extra, dict):
        raise FrameError("header field 'extra' must be a map")
    if raw.get("len", 0) < 0:
        raise FrameError("header field 'len' is negative")
    known = {f for f in Header.__dataclass_fields__}
    kwargs = {k: v for k, v in raw.items() if k in known}
    kwargs["kind"] = kind
    kwargs["shapes"] = tuple(tuple(s) for s in shapes_raw)
    kwargs["step_time"] = float(raw.get("step_time", 0.0))
    kwargs["t"] = float(raw.get("t", 0.0))
    return Header(**kwargs)


def max_payload_bytes(n_values: int, codec: str, block: int = codec_mod.DEFAULT_BLOCK) -> int:
    """The largest payload a message of a fragment of ``n_values`` float32 values may declare
    with ``codec``, bytes (``codec.max_payload_size``: zstd's bound of the raw size).

    Raises:
        ValueError: an unknown codec or a bad block size.
    """
    return codec_mod.max_payload_size(int(n_values), codec, block)


def max_frame_bytes(n_values: int, codecs: Iterable[str],
                    block: int = codec_mod.DEFAULT_BLOCK) -> int:
    """The largest frame, bytes, of any valid message of a fragment of ``n_values`` float32
    values whose payload uses one of ``codecs``: the larger of :data:`MAX_HEADER_BYTES` and
    :func:`max_payload_bytes` of every codec. ``codecs`` may be empty (header-only messages).

    Raises:
        ValueError: an unknown codec or a bad block size.
    """
    return max([MAX_HEADER_BYTES, *(max_payload_bytes(n_values, c, block) for c in codecs)])


def decode(
    frames: Sequence[Buffer],
    *,
    run_id: str,
    expected_shapes: ShapeCheck | None = None,
    allowed_codecs: Sequence[str] | None = None,
    block: int = codec_mod.DEFAULT_BLOCK,
) -> Message:
    """Decode and validate a message.

    Every size is checked before the payload is read: the declared ``len`` against
    :func:`max_payload_bytes` for the manifest's shapes and the header's codec, then the frame's
    length against ``len``; the payload is read in place (no copy). Memory: the decoded
    tensors (``4 n`` bytes) and the codec's raw buffer (``codec.raw_size``) besides the frames.

    Args:
        frames: the ZeroMQ frames, bytes-like (``bytes`` or memoryviews of received frames).
        run_id: this run's id; other runs' messages raise :class:`WrongRun`.
        expected_shapes: returns the manifest's shapes for the header's fragment, or None when the
            fragment id is unknown (-> :class:`SchemaMismatch`). Required for messages with a
            payload.
        allowed_codecs: codecs the manifest allows; None allows every name
            :func:`ddiloco.pipeline.codec.is_codec` accepts.

    Returns:
        The message; its tensors are float32 arrays of the manifest's shapes, fresh memory (not
        views of ``frames``).

    Raises:
        FrameError, OversizedFrame, TruncatedFrame, ChecksumMismatch, UnsupportedVersion,
        WrongRun, SchemaMismatch, CodecError, NonFinite: all
        :class:`ddiloco.pipeline.errors.WireError`. A header declaring a payload larger than
        the manifest allows raises :class:`OversizedFrame` before the payload is touched.
    """
    if len(frames) not in (1, 2):
        raise FrameError(f"expected 1 or 2 frames, got {len(frames)}")
    h = decode_header(frames[0])
    if h.run != run_id:
        raise WrongRun(f"message of run {h.run!r}, this is run {run_id!r}")
    if h.len == 0:
        if len(frames) != 1:
            raise FrameError("payload frame present but header declares len 0")
        return Message(h, None)
    if len(frames) != 2:
        raise TruncatedFrame("header declares a payload but the payload frame is missing")
    if allowed_codecs is None:
        if not codec_mod.is_codec(h.codec):
            raise SchemaMismatch(codec_mod.unknown_codec_message(h.codec))
    elif h.codec not in allowed_codecs:
        raise SchemaMismatch(f"codec {h.codec!r} not allowed (manifest: {list(allowed_codecs)})")
    if expected_shapes is None:
        raise SchemaMismatch("no manifest shapes to check a payload against")
    want = expected_shapes(h)
    if want is None:
        raise SchemaMismatch(f"fragment {h.frag} is not in the manifest")
    want_t = tuple(tuple(s) for s in want)
    if h.shapes != want_t:
        raise SchemaMismatch(f"fragment {h.frag}: shapes {h.shapes} != manifest {want_t}")
    limit = max_payload_bytes(sum(int(np.prod(s)) for s in want_t), h.codec, block)
    if h.len > limit:
        raise OversizedFrame(f"header declares a payload of {h.len} bytes; fragment {h.frag} "
                             f"in {h.codec} allows at most {limit}")
    payload = memoryview(frames[1]).cast("B")
    if payload.nbytes < h.len:
        raise TruncatedFrame(f"payload has {payload.nbytes} bytes, header declares {h.len}")
    if payload.nbytes > h.len:
        raise OversizedFrame(f"payload has {payload.nbytes} bytes, header declares {h.len}")
    if payload_crc(payload) != h.crc:
        raise ChecksumMismatch("payload CRC-32C mismatch")
    tensors = codec_mod.decode(payload, want_t, h.codec, block=block)
    return Message(h, tensors)


def message_nbytes(frames: Sequence[Buffer]) -> int:
    """Bytes of a message on the wire (all frames), for wire accounting."""
    return sum(memoryview(f).nbytes for f in frames)
