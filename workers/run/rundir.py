"""The run folder of a local run (``ddiloco run --out``): whose run it holds, replacing it,
and never leaving a half-written one behind.

A run folder holds ``run.json`` (run id, configuration, resumes), the embedded Redis's data
(``redis/``), the embedded S3 server's (``s3/``), the report, and per mode (``diloco/``,
``dp/``) the learners' checkpoints, logs, keys and ``commands.sh``:

* a new run in a folder that holds another run is refused unless ``--force``
  (:func:`check_out`), which removes that run's files first (:func:`clear_run`; the JAX
  compilation cache stays: it is not the run's);
* :class:`RunFolder` creates the folder and, when the start fails before the run exists in its
  store, takes back everything it did: a folder it created is removed, files it rewrote get
  their old bytes back, entries it added go.
"""

from __future__ import annotations

import errno
import json
import os
import shutil
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from ddiloco.pipeline.errors import DDilocoError

__all__ = ["OutHoldsRun", "RunFolder", "RunFolderError", "check_out", "clear_run",
           "read_run_info", "run_files"]

#: top-level entries a run writes into its folder
TOP_FILES = ("run.json", "report.json", "report.png", "redis", "s3")
#: per-mode folders; everything in them is the run's but the compilation cache
MODES = ("diloco", "dp")
#: kept by --force: a cache, valid for any run of the same code
KEEP = ("jax_cache",)


class RunFolderError(DDilocoError):
    """``--out`` / ``--resume`` names a folder that cannot be used as asked."""


class OutHoldsRun(RunFolderError):
    """``--out`` holds another run and neither ``--resume`` nor ``--force`` was given."""


def run_files(out: Path, *, top: Sequence[str] = TOP_FILES,
              modes: Sequence[str] = MODES) -> list[Path]:
    """The files and folders of a run in ``out`` (none when ``out`` does not exist): the
    entries ``top`` and the contents of the folders ``modes`` (a chaos run has its own:
    :data:`ddiloco.chaos.runner.CHAOS_TOP`)."""
    found = [out / name for name in top if (out / name).exists()]
    for mode in modes:
        d = out / mode
        if d.is_dir():
            found += sorted(p for p in d.iterdir() if p.name not in KEEP)
    return found


def read_run_info(run_dir: Path, flag: str = "--resume") -> dict[str, Any]:
    """``run_dir/run.json`` as a dict.

    Raises:
        RunFolderError: there is no ``run.json``, or it is not a JSON object with a run id.
    """
    path = run_dir / "run.json"
    try:
        info = json.loads(path.read_text())
    except FileNotFoundError:
        raise RunFolderError(f"{flag} {run_dir}: no run.json there (not a run folder; start "
                             f"a new run with --out {run_dir})") from None
    except (OSError, ValueError) as exc:
        raise RunFolderError(f"{flag} {run_dir}: run.json cannot be read ({exc}); restore it, "
                             "or start a new run with --out NEW") from None
    if not isinstance(info, dict) or not isinstance(info.get("run_id"), str):
        raise RunFolderError(f"{flag} {run_dir}: run.json names no run_id; restore it, or "
                             "start a new run with --out NEW")
    return info


def check_out(out: Path, *, force: bool, top: Sequence[str] = TOP_FILES,
              modes: Sequence[str] = MODES) -> list[Path]:
    """Refuse a new run in a folder that holds another run's files, unless ``force``, or
    one that cannot be created. Returns those files (what :func:`clear_run` would remove).

    Raises:
        OutHoldsRun: ``out`` holds a run (named by its id when ``run.json`` has one).
        RunFolderError: ``out``, or the nearest of its parents that exists, is a file (the
            message :meth:`RunFolder.open` gives): found before a run downloads its corpus or
            starts anything.
    """
    missing = _first_missing(out)
    nearest = out if missing is None else missing.parent
    if nearest.exists() and not nearest.is_dir():
        raise RunFolderError(f"--out {out}: cannot create the run folder "
                             f"({os.strerror(errno.ENOTDIR)}); pick a writable path")
    found = run_files(out, top=top, modes=modes)
    if not found or force:
        return found
    run_id = None
    try:
        run_id = json.loads((out / "run.json").read_text()).get("run_id")
    except (OSError, ValueError, AttributeError):
        pass
    if run_id:
        raise OutHoldsRun(f"{out}: holds run {run_id} (pass --resume {out} to continue it, "
                          "or --force to replace it)")
    names = ", ".join(str(p.relative_to(out)) for p in found[:4])
    raise OutHoldsRun(f"{out}: holds files of an earlier run ({names}) (pass --force to "
                      "replace them, or another --out)")


def clear_run(out: Path, *, top: Sequence[str] = TOP_FILES,
              modes: Sequence[str] = MODES) -> list[str]:
    """Remove the run files of ``out`` (:func:`run_files`); returns their paths relative to
    ``out``.

    Raises:
        RunFolderError: a file could not be removed (the message names it).
    """
    removed = []
    for p in run_files(out, top=top, modes=modes):
        try:
            if p.is_dir() and not p.is_symlink():
                shutil.rmtree(p)
            else:
                p.unlink()
        except OSError as exc:
            raise RunFolderError(f"--force: cannot remove {p} ({exc.strerror}); remove it by "
                                 "hand or pick another --out") from None
        removed.append(str(p.relative_to(out)))
    return removed


def _first_missing(path: Path) -> Path | None:
    """The outermost ancestor of ``path`` (or ``path``) that does not exist."""
    missing = None
    for p in [path, *path.parents]:
        if p.exists():
            break
        missing = p
    return missing


@dataclass
class RunFolder:
    """A run folder being started; :meth:`rollback` takes the start back.

    Args:
        path: the folder.
        created: the outermost folder this start created (None: it existed).
        before: the folder's top-level entries before the start.
    """

    path: Path
    created: Path | None = None
    before: frozenset[str] = frozenset()
    #: files rewritten by the start -> their bytes before it
    saved: dict[Path, bytes] = field(default_factory=dict)
    #: set once the run exists in its store: a later failure is the run's, not the start's
    started: bool = False

    @classmethod
    def open(cls, path: Path, flag: str = "--out") -> RunFolder:
        """Create ``path`` (with its parents) if needed and check that it is writable.

        Raises:
            RunFolderError: it cannot be created or written (the OS's reason and the flag
                are named).
        """
        created = _first_missing(path)
        before = frozenset(p.name for p in path.iterdir()) if path.is_dir() else frozenset()
        try:
            path.mkdir(parents=True, exist_ok=True)
        except OSError as exc:
            raise RunFolderError(f"{flag} {path}: cannot create the run folder "
                                 f"({exc.strerror}); pick a writable path") from None
        if not os.access(path, os.W_OK | os.X_OK):
            raise RunFolderError(f"{flag} {path}: the run folder is not writable; pick a "
                                 "writable path")
        return cls(path, created, before)

    def keep(self, names: Sequence[str]) -> None:
        """Remember the bytes of these files of the folder, to put back on :meth:`rollback`
        (files the start itself made are removed instead)."""
        for name in names:
            p = self.path / name
            if name.split("/")[0] in self.before and p.is_file() and p not in self.saved:
                self.saved[p] = p.read_bytes()

    def write(self, name: str, text: str) -> None:
        """Write a file of the folder (its old bytes kept for :meth:`rollback`).

        Raises:
            RunFolderError: the file cannot be written.
        """
        self.keep([name])
        try:
            (self.path / name).write_text(text)
        except OSError as exc:
            raise RunFolderError(f"{self.path / name}: cannot be written ({exc.strerror}); "
                                 "pick a writable --out") from None

    def rollback(self) -> None:
        """Take the start back: remove the folder if this start created it; otherwise remove
        the entries it added and put back the files it rewrote. Best effort: errors are
        ignored (the start's own error is the one to report)."""
        if self.created is not None:
            shutil.rmtree(self.created, ignore_errors=True)
            return
        if not self.path.is_dir():
            return
        for p in self.path.iterdir():
            if p.name not in self.before:
                if p.is_dir() and not p.is_symlink():
                    shutil.rmtree(p, ignore_errors=True)
                else:
                    p.unlink(missing_ok=True)
        for p, data in self.saved.items():
            try:
                p.write_bytes(data)
            except OSError:
                pass
