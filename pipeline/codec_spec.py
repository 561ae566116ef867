"""Codec names and payload sizes (DESIGN §4): which names are codecs, how many values a topk
codec keeps, and the exact raw and worst-case compressed sizes of a payload, with the name and
block checks the quantizers and the decoder share. The formats are described in
:mod:`ddiloco.pipeline.codec`, which re-exports the public names; the quantizers are in
:mod:`ddiloco.pipeline.quantize`."""

from __future__ import annotations

import functools
import re
from fractions import Fraction
from typing import NamedTuple

__all__ = [
    "CODECS",
    "DEFAULT_BLOCK",
    "DENSE_CODECS",
    "MIN_WINDOW",
    "TOPK_BITS",
    "TOPK_CHUNK",
    "TopKSpec",
    "check_block",
    "check_codec",
    "is_codec",
    "max_payload_size",
    "parse_topk",
    "raw_size",
    "topk_keep",
    "topk_record",
    "topk_spec",
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

# --------------------------------------------------------------------------------------------
# Names
# --------------------------------------------------------------------------------------------

# Canonical spelling only (no "02", no "2.0"): names are compared as strings against the run
# manifest, so two spellings of one codec would look like two codecs.
_TOPK_NAME = re.compile(r"topk-d(0|[1-9][0-9]{0,2})(?:\.([0-9]{0,5}[1-9]))?-b([1-9][0-9]?)")


class TopKSpec(NamedTuple):
    """A topk codec's parameters, as its name gives them."""

    density: Fraction  # percent, exact: k must not depend on float rounding
    bits: int


@functools.lru_cache(maxsize=256)
def topk_spec(name: str) -> TopKSpec | None:
    """The exact parameters of a topk name (density as a :class:`~fractions.Fraction`), or
    None when ``name`` is not a valid topk name (:func:`parse_topk` gives them as floats)."""
    match = _TOPK_NAME.fullmatch(name)
    if match is None:
        return None
    whole, frac, bits = match.groups()
    density = Fraction(f"{whole}.{frac}" if frac else whole)
    if not 0 < density <= 100 or int(bits) not in TOPK_BITS:
        return None
    return TopKSpec(density, int(bits))


def parse_topk(name: object) -> tuple[float, int] | None:
    """Read a topk codec name.

    Args:
        name: a candidate codec name such as ``"topk-d2-b2"``.

    Returns:
        ``(density, bits)``, a float and an int: the percentage of values kept per chunk, in
        ``(0, 100]``, and the code width in bits, one of :data:`TOPK_BITS`; None when ``name`` is
        not a valid topk name (wrong form, density 0 or above 100, other widths, a non-canonical
        spelling such as ``topk-d2.0-b2``, or not a str). Never raises.
    """
    spec = topk_spec(name) if isinstance(name, str) else None
    return None if spec is None else (float(spec.density), spec.bits)


def is_codec(name: object) -> bool:
    """Whether ``name`` is a codec: one of :data:`DENSE_CODECS` or a valid topk name.

    Args:
        name: a candidate codec name.

    Returns:
        False for anything else, including non-str values. Never raises.
    """
    return isinstance(name, str) and (name in DENSE_CODECS or parse_topk(name) is not None)


def unknown_codec_message(name: object) -> str:
    """Error text for a name that :func:`is_codec` rejects, listing the valid forms.

    Args:
        name: the rejected name.

    Returns:
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

    Args:
        codec: a topk name (:func:`parse_topk`).
        length: chunk length, ``0 <= length <= TOPK_CHUNK``.

    Returns:
        ``max(1, ceil(density · length / 100))`` computed exactly, or 0 for an empty chunk.

    Raises:
        ValueError: not a topk name, or ``length`` out of range.
    """
    spec = topk_spec(codec) if isinstance(codec, str) else None
    if spec is None:
        raise ValueError(f"not a topk codec: {codec!r}")
    if isinstance(length, bool) or not isinstance(length, int) or not 0 <= length <= TOPK_CHUNK:
        raise ValueError(f"chunk length must be an int in [0, {TOPK_CHUNK}], got {length!r}")
    return _topk_k(spec, length)


def _topk_k(spec: TopKSpec, length: int) -> int:
    if length == 0:
        return 0
    d = spec.density
    return max(1, -(-(d.numerator * length) // (d.denominator * 100)))


def topk_record(spec: TopKSpec, length: int) -> tuple[int, int]:
    """``(k, bytes)`` of one topk chunk of ``length >= 1`` values (module
    :mod:`ddiloco.pipeline.codec`, "Raw layouts")."""
    k = _topk_k(spec, length)
    return k, 4 + 2 * k + -(-(k * spec.bits) // 8)


# --------------------------------------------------------------------------------------------
# Sizes
# --------------------------------------------------------------------------------------------


def check_codec(codec: str, exc: type[Exception]) -> None:
    """Raise ``exc`` (:func:`unknown_codec_message`) unless :func:`is_codec` accepts ``codec``:
    ``ValueError`` for a sender's mistake, ``CodecError`` for a received payload."""
    if not is_codec(codec):
        raise exc(unknown_codec_message(codec))


def check_block(block: int, exc: type[Exception]) -> None:
    """Raise ``exc`` unless ``block`` is an int >= 1 (a bool is not a block size)."""
    if isinstance(block, bool) or not isinstance(block, int) or block < 1:
        raise exc(f"block must be a positive int, got {block!r}")


def raw_size(n_values: int, codec: str, block: int = DEFAULT_BLOCK) -> int:
    """Exact size of the raw (decompressed) payload.

    Args:
        n_values: total number of float32 values, ``>= 0``.
        codec: a codec name that :func:`is_codec` accepts (see :data:`CODECS`).
        block: values per quantization block (int8/int4 only; checked, unused by the others),
            ``>= 1``.

    Returns:
        Size in bytes, following the layouts in the module docstring.

    Raises:
        ValueError: unknown codec, negative ``n_values`` or a block size below 1.
    """
    check_codec(codec, ValueError)
    check_block(block, ValueError)
    if n_values < 0:
        raise ValueError(f"n_values must be >= 0, got {n_values}")
    if codec == "fp32":
        return 4 * n_values
    if codec == "bf16":
        return 2 * n_values
    spec = topk_spec(codec)
    if spec is not None:
        full, rest = divmod(n_values, TOPK_CHUNK)
        size = full * topk_record(spec, TOPK_CHUNK)[1]
        return size + (topk_record(spec, rest)[1] if rest else 0)
    n_blocks = -(-n_values // block)
    if codec == "int8":
        return 4 * n_blocks + n_values
    return 4 * n_blocks + (n_values + 1) // 2


def max_payload_size(n_values: int, codec: str, block: int = DEFAULT_BLOCK) -> int:
    """Upper bound on the size of the payload :func:`encode` returns, whatever the data.

    This is zstd's ``ZSTD_COMPRESSBOUND`` (lib/zstd.h) of :func:`raw_size`, which covers the frame
    header, block headers and checksum; the wire layer uses it to reject an oversized payload
    before looking inside it.

    Args:
        n_values, codec, block: as in :func:`raw_size`.

    Returns:
        Size in bytes.

    Raises:
        ValueError: as in :func:`raw_size`.
    """
    src = raw_size(n_values, codec, block)
    small = ((128 << 10) - src) >> 11 if src < (128 << 10) else 0
    return src + (src >> 8) + small
