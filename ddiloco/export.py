"""Export a run's global model to a file, and load it back into the task's parameter tree.

``ddiloco export model.safetensors --out RUN`` writes the latest version of every fragment,
one tensor per leaf path (``blocks/0/attn/kernel/value``; the names of
:class:`ddiloco.workers.task.api.ParamTree`), float32, with the run's metadata. Three formats:

========== ======================== ===================================================
format     suffixes                 file
========== ======================== ===================================================
safetensors ``.safetensors``, ``.st`` ``safetensors`` (the default for other suffixes);
                                    metadata in its header
npz        ``.npz``                 ``numpy.savez``; metadata as a JSON string entry
                                    ``__ddiloco_metadata__``
msgpack    ``.msgpack``, ``.msgpck`` ``flax.serialization.msgpack_serialize`` of
                                    ``{"params": {path: array}, "metadata": {...}}``
========== ======================== ===================================================

:func:`load_params` reads any of them back into a pytree shaped like the task's parameters
(``like``: nested dicts, lists, a Flax NNX ``State``...), checking every leaf's path and shape.
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import numpy as np

from ddiloco.pipeline.errors import DDilocoError
from ddiloco.workers.task.api import ParamTree

__all__ = ["FORMATS", "ExportFormatError", "ParamsMismatch", "export_format", "export_run",
           "load_params", "read_export", "write_export"]

#: format -> the suffixes that choose it
FORMATS: dict[str, tuple[str, ...]] = {
    "safetensors": (".safetensors", ".st"),
    "npz": (".npz",),
    "msgpack": (".msgpack", ".msgpck"),
}
#: the npz entry that holds the metadata (a JSON string: no pickle needed to read it)
NPZ_METADATA = "__ddiloco_metadata__"


class ExportFormatError(DDilocoError):
    """An unknown export format, a file that is not an export of that format, or a format
    whose library is not installed."""


class ParamsMismatch(DDilocoError, ValueError):
    """An exported file does not fit ``like``: a leaf is missing, extra, or shaped
    differently; the message names the leaf path."""


def export_format(path: str | Path, fmt: str | None = None) -> str:
    """The format of ``path``: ``fmt`` when given, else by suffix (``.npz``, ``.msgpack``...),
    else ``"safetensors"``.

    Raises:
        ExportFormatError: ``fmt`` is not one of :data:`FORMATS`.
    """
    if fmt is not None:
        if fmt not in FORMATS:
            raise ExportFormatError(f"export format {fmt!r}: use one of {', '.join(FORMATS)}")
        return fmt
    suffix = Path(path).suffix.lower()
    return next((f for f, sfx in FORMATS.items() if suffix in sfx), "safetensors")


def _flax_serialization() -> Any:
    try:
        from flax import serialization
    except ImportError:
        raise ExportFormatError("the msgpack format uses flax.serialization: pip install "
                                "flax (or 'ddiloco[examples]'), or export as safetensors or "
                                "npz") from None
    return serialization


def write_export(path: str | Path, params: Mapping[str, np.ndarray],
                 metadata: Mapping[str, str] | None = None, fmt: str | None = None) -> str:
    """Write flat parameters ``{leaf path: array}`` to ``path`` (atomically: a temporary file
    in the same folder, renamed; parent folders are created).

    Args:
        path: the file to write.
        params: leaf path -> array (written as float32).
        metadata: string -> string, stored with the tensors.
        fmt: one of :data:`FORMATS`; None: by suffix (:func:`export_format`).

    Returns:
        The format written.

    Raises:
        ExportFormatError: unknown format, or msgpack without flax.
        OSError: the file or its folder cannot be written.
    """
    fmt = export_format(path, fmt)
    path = Path(path)
    meta = {str(k): str(v) for k, v in (metadata or {}).items()}
    # np.array (not ascontiguousarray, which turns a 0-d leaf into shape (1,))
    flat = {name: np.array(v, dtype=np.float32, order="C") for name, v in params.items()}
    if fmt == "safetensors":
        from safetensors.numpy import save

        data = save(flat, metadata=meta)
    elif fmt == "npz":
        buf = io.BytesIO()
        entries: dict[str, Any] = {**flat, NPZ_METADATA: np.asarray(json.dumps(meta))}
        np.savez(buf, **entries)
        data = buf.getvalue()
    else:
        data = _flax_serialization().msgpack_serialize({"params": flat, "metadata": meta})
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
    try:
        tmp.write_bytes(data)
        os.replace(tmp, path)  # never a half-written export under the final name
    finally:
        tmp.unlink(missing_ok=True)
    return fmt


def read_export(path: str | Path, fmt: str | None = None
                ) -> tuple[dict[str, np.ndarray], dict[str, str]]:
    """The flat parameters ``{leaf path: float32 array}`` and the metadata of an export.

    Raises:
        ExportFormatError: the file is not an export of that format (or msgpack without flax).
        OSError: the file cannot be read (FileNotFoundError when it does not exist).
    """
    fmt = export_format(path, fmt)
    data = Path(path).read_bytes()  # OSError here: the file is not there or not readable
    try:
        if fmt == "safetensors":
            from safetensors.numpy import load

            params = load(data)
            meta = _safetensors_metadata(data)
        elif fmt == "npz":
            with np.load(io.BytesIO(data), allow_pickle=False) as z:
                params = {k: z[k] for k in z.files if k != NPZ_METADATA}
                meta = json.loads(str(z[NPZ_METADATA])) if NPZ_METADATA in z.files else {}
        else:
            tree = _flax_serialization().msgpack_restore(data)
            params = {str(k): np.asarray(v) for k, v in tree["params"].items()}
            meta = {str(k): str(v) for k, v in tree.get("metadata", {}).items()}
    except ExportFormatError:
        raise
    except Exception as exc:  # each library raises its own types for a corrupt file
        raise ExportFormatError(f"{path}: not a {fmt} export ({type(exc).__name__}: "
                                f"{' '.join(str(exc).split())[:200]})") from None
    return params, meta


def _safetensors_metadata(data: bytes) -> dict[str, str]:
    """The ``__metadata__`` of a safetensors file's header (8-byte little-endian length, then
    JSON; the format's specification)."""
    size = int.from_bytes(data[:8], "little")
    header = json.loads(data[8:8 + size])
    return {str(k): str(v) for k, v in header.get("__metadata__", {}).items()}


def export_run(store: Any, path: str | Path, fmt: str | None = None) -> dict[str, Any]:
    """Write the latest global model of the run in ``store`` to ``path``.

    The metadata holds ``format`` ("ddiloco"), ``model`` (the built-in GPT's shape, or the
    task reference), ``versions`` (per fragment), ``run_id`` and ``loss_unit`` (JSON strings).

    Returns:
        ``{"path", "format", "tensors", "versions"}``.

    Raises:
        DDilocoError: no manifest, or a fragment without a version yet.
        ExportFormatError: unknown format, or msgpack without flax.
        OSError: the file cannot be written.
    """
    from dataclasses import asdict

    from ddiloco.report import load_global_params
    from ddiloco.workers.task.api import manifest_loss_unit

    params, cfg = load_global_params(store)
    manifest = store.get_manifest()
    versions = [h.version if h else -1 for h in store.heads(len(manifest["layout"]))]
    model = (asdict(cfg.model_config_obj()) if cfg.model.task is None
             else {"task": cfg.model.task})
    meta = {"format": "ddiloco", "model": json.dumps(model), "versions": json.dumps(versions),
            "run_id": str(store.run_id), "loss_unit": manifest_loss_unit(manifest)}
    written = write_export(path, params, meta, fmt)
    return {"path": str(path), "format": written, "tensors": len(params), "versions": versions}


def _as_leaf(value: np.ndarray, like_leaf: Any) -> Any:
    """``value`` as ``like_leaf``'s kind of array (jax or numpy) and dtype."""
    dtype = np.dtype(getattr(like_leaf, "dtype", np.asarray(like_leaf).dtype))
    if isinstance(like_leaf, np.ndarray) or np.isscalar(like_leaf):
        return np.asarray(value, dtype=dtype)
    import jax.numpy as jnp

    return jnp.asarray(value, dtype=dtype)


def load_params(path: str | Path, like: Any, *, format: str | None = None) -> Any:
    """Load an export (``ddiloco export``) into a pytree with the structure of ``like``.

    Args:
        path: a file written by ``ddiloco export`` (or :func:`write_export`).
        like: a pytree of the task's parameters, e.g. the task's initial ``params`` (nested
            dicts, lists, a Flax NNX ``State``); only its structure, leaf shapes and dtypes
            are used.
        format: ``safetensors``, ``npz`` or ``msgpack``; None: by suffix (safetensors for
            any other suffix).

    Returns:
        A pytree with the structure of ``like``: every leaf holds the exported values, in
        ``like``'s leaf dtype, as a jax array (a numpy array where ``like``'s leaf is one).

    Raises:
        ParamsMismatch: a leaf path of ``like`` is missing from the file, the file has a leaf
            ``like`` lacks, or a leaf's shape differs (the message names the leaf).
        ExportFormatError: the file is not an export of that format.
        OSError: the file cannot be read.
        ddiloco.TaskError: ``like`` is not a parameter tree (non-float leaves, no leaves).
    """
    tree = ParamTree.of(like)
    flat, _ = read_export(path, format)
    missing = [n for n in tree.names if n not in flat]
    extra = sorted(set(flat) - set(tree.names))
    if missing:
        raise ParamsMismatch(f"{path}: leaf {missing[0]!r} of `like` is not in the file"
                             + (f" ({len(missing)} missing)" if len(missing) > 1 else "")
                             + f"; the file's leaves look like {sorted(flat)[:3]}")
    if extra:
        raise ParamsMismatch(f"{path}: leaf {extra[0]!r} of the file is not in `like`"
                             + (f" ({len(extra)} extra)" if len(extra) > 1 else "")
                             + "; pass the task's parameters as `like`")
    for name in tree.names:
        shape = tuple(np.shape(flat[name]))
        if shape != tree.shapes[name]:
            raise ParamsMismatch(f"{path}: leaf {name!r} has shape {shape} in the file and "
                                 f"{tree.shapes[name]} in `like`")
    like_leaves = tree.flatten(like)
    return tree.unflatten({n: _as_leaf(flat[n], like_leaves[n]) for n in tree.names})
