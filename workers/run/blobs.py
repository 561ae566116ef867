"""What a worker writes to and reads from the store's blobs: fragment values, outer momentum,
the data-parallel baseline's optimizer state, and the digests that prove two copies equal.

Value and momentum blobs are exact: the tensors' float32 bytes behind a magic and a CRC-32C
(:data:`BLOB_CODEC` ``raw32``). The store treats them as opaque bytes (DESIGN §3).

Why not compressed: ``bench/blobs.py`` measures it. zstd saves about 8% of trained float32
weights (their exponent bytes repeat, their mantissas do not) at well under 1 GB/s per core,
while a CRC-32C pass runs at several GB/s. Compression pays only when it encodes faster than
``rate / saving``: at 8% saving and a 1 GB/s disk that is 12.5 GB/s, far above zstd's speed. So
a blob costs one copy and one checksum. Blobs written by older versions (the ``fp32`` wire
codec: zstd frames) are still read.
"""

from __future__ import annotations

import hashlib
import math
import struct
from collections.abc import Mapping, Sequence
from typing import Any

import crc32c
import numpy as np

from ddiloco.pipeline import codec
from ddiloco.pipeline.errors import ChecksumMismatch, CodecError, DDilocoError
from ddiloco.pipeline.fragments import FragmentLayout

__all__ = [
    "BLOB_CODEC",
    "blob_parts",
    "decode_blob",
    "digest",
    "dp_step_of",
    "encode_blob",
    "fragment_tensors",
    "opt_state_bytes",
    "opt_state_from_parts",
]

#: Encoding of value and momentum blobs in the store: exact float32, uncompressed.
BLOB_CODEC = "raw32"
#: First bytes of a ``raw32`` blob; then the payload's CRC-32C (uint32, little-endian).
RAW_MAGIC = b"ddl-f32\x01"
_HEAD = struct.Struct("<8sI")
#: The codec of blobs written before ``raw32`` (zstd frames), still read.
LEGACY_BLOB_CODEC = "fp32"


def blob_parts(tensors: Sequence[np.ndarray]) -> list[memoryview]:
    """The store blob of a fragment's tensors (:func:`encode_blob`) as its parts, without
    joining them: the 12-byte header, then a view of each tensor's float32 bytes (the
    tensors' own memory when they are float32 and C-contiguous: keep them unchanged until the
    parts are written). Cost: one checksum pass.
    """
    arrays = [np.ascontiguousarray(t, dtype="<f4") for t in tensors]
    crc = 0
    for a in arrays:
        crc = crc32c.crc32c(a.data, crc)
    return [memoryview(_HEAD.pack(RAW_MAGIC, crc)),
            *(a.reshape(-1).view(np.uint8).data for a in arrays)]


def encode_blob(tensors: Sequence[np.ndarray]) -> bytes:
    """Store blob of a fragment's tensors: :data:`RAW_MAGIC`, the CRC-32C of the payload, then
    each tensor's float32 values (little-endian, C order) in payload order.

    Size: ``12 + 4 * sum(t.size)`` bytes. Cost: one copy and one checksum pass.
    """
    # join copies each buffer once into the result: no zero-filled staging buffer
    return b"".join(blob_parts(tensors))


def decode_blob(blob: bytes | bytearray, shapes: Sequence[tuple[int, ...]], *,
                own: bool = False) -> list[np.ndarray]:
    """Inverse of :func:`encode_blob`, bounded by the layout's shapes: writable float32 arrays
    of ``shapes``, a copy of the payload; with ``own`` and a writable ``blob`` (a
    ``bytearray``, as an object store reads large objects) views of it instead: the caller
    gives the blob's bytes to the arrays and decodes it no more (a 1B model's rejoin saves a
    4 GB copy). Reads the older zstd blobs too.

    Raises:
        CodecError: the blob's length does not match ``shapes``, or it is not a blob.
        ChecksumMismatch: the payload's CRC-32C differs from the recorded one.
        WireError: a legacy blob is corrupt (both are ``DropError``).
    """
    if not blob.startswith(RAW_MAGIC):
        if blob[:4] == b"\x28\xb5\x2f\xfd":  # a zstd frame: the legacy codec
            return codec.decode(blob, shapes, LEGACY_BLOB_CODEC)
        raise CodecError(f"not a fragment blob (starts {bytes(blob[:8])!r})")
    sizes = [math.prod(s) for s in shapes]
    want = _HEAD.size + 4 * sum(sizes)
    if len(blob) != want:
        raise CodecError(f"blob of {len(blob)} bytes for shapes {list(shapes)} "
                         f"({want} bytes expected)")
    _, crc = _HEAD.unpack_from(blob, 0)
    view = memoryview(blob)[_HEAD.size:]
    got = crc32c.crc32c(view)
    if got != crc:
        raise ChecksumMismatch(f"blob CRC-32C {got:08x}, recorded {crc:08x}")
    flat = np.frombuffer(view, dtype="<f4")
    if not own or view.readonly or flat.dtype != np.float32:
        flat = flat.astype(np.float32, copy=True)
    out, at = [], 0
    for shape, n in zip(shapes, sizes, strict=True):
        out.append(flat[at:at + n].reshape(shape))
        at += n
    return out


def digest(tensors: Sequence[np.ndarray]) -> str:
    """Short content hash of float32 tensors (16 hex digits; proves two copies are
    bit-identical)."""
    h = hashlib.blake2b(digest_size=8)
    for t in tensors:
        h.update(np.ascontiguousarray(t, dtype=np.float32).tobytes())
    return h.hexdigest()


def fragment_tensors(params: Mapping[str, Any], layout: FragmentLayout,
                     p: int) -> list[np.ndarray]:
    """Host copies (float32, owned) of fragment ``p``'s tensors in payload order."""
    return [np.array(params[n], dtype=np.float32, copy=True) for n in layout.names(p)]


def opt_state_bytes(state: Any) -> bytes:
    """Serialise an optax state (safetensors; keys are the leaves' tree paths).

    The data-parallel baseline stores each fragment's AdamW state with its checkpointed value, so
    a restarted job resumes bit-exactly (DESIGN §2, baseline). Nothing is pickled.
    """
    import jax
    from safetensors.numpy import save

    flat = jax.tree_util.tree_flatten_with_path(state)[0]
    return save({jax.tree_util.keystr(path): np.ascontiguousarray(np.asarray(leaf))
                 for path, leaf in flat})


def opt_state_from_parts(template: Any, parts: Sequence[bytes]) -> Any:
    """Build an optax state shaped like ``template`` from the :func:`opt_state_bytes` of
    several fragments (their leaves are keyed by parameter name; shared counters by path).

    Raises:
        DDilocoError: a leaf of ``template`` is in none of ``parts``, or has another shape.
    """
    import jax
    from safetensors.numpy import load

    found: dict[str, np.ndarray] = {}
    for part in parts:
        found.update(load(part))
    flat, treedef = jax.tree_util.tree_flatten_with_path(template)
    leaves = []
    for path, leaf in flat:
        key = jax.tree_util.keystr(path)
        # safetensors stores a 0-d array as shape (1,): compare sizes, then restore the shape.
        if key not in found or found[key].size != np.size(leaf):
            raise DDilocoError(f"optimizer state leaf {key} missing or of another shape")
        leaves.append(jax.numpy.asarray(found[key].reshape(np.shape(leaf))))
    return jax.tree_util.tree_unflatten(treedef, leaves)


def dp_step_of(meta: Mapping[str, Any]) -> int:
    """The data-parallel step a stored version is the state after (-1: initial value)."""
    return int(meta.get("dp_step", -1))
