"""What a worker writes to and reads from the store's blobs: fragment values, outer momentum,
the data-parallel baseline's optimizer state, and the digests that prove two copies equal.

Value and momentum blobs are exact (``fp32`` codec of :mod:`ddiloco.pipeline.codec`: float32, zstd,
checksummed); the store treats them as opaque bytes (DESIGN §3).
"""

from __future__ import annotations

import hashlib
from collections.abc import Mapping, Sequence
from typing import Any

import numpy as np

from ddiloco.pipeline import codec
from ddiloco.pipeline.errors import DDilocoError
from ddiloco.pipeline.fragments import FragmentLayout

__all__ = [
    "BLOB_CODEC",
    "decode_blob",
    "digest",
    "dp_step_of",
    "encode_blob",
    "fragment_tensors",
    "opt_state_bytes",
    "opt_state_from_parts",
]

#: Codec of value and momentum blobs in the store: exact.
BLOB_CODEC = "fp32"


def encode_blob(tensors: Sequence[np.ndarray]) -> bytes:
    """Store blob of a fragment's tensors (fp32, zstd, checksummed)."""
    return codec.encode(tensors, BLOB_CODEC)


def decode_blob(blob: bytes, shapes: Sequence[tuple[int, ...]]) -> list[np.ndarray]:
    """Inverse of :func:`encode_blob`, bounded by the layout's shapes: float32 arrays of
    ``shapes``.

    Raises:
        WireError: the blob is corrupt or does not hold ``shapes`` (a ``DropError``).
    """
    return codec.decode(blob, shapes, BLOB_CODEC)


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
