"""Files installed with the package and named without a checkout: run configs and topologies
(``configs/*.yaml``, ``configs/*.toml``, installed as ``ddiloco.workers.configs``) and chaos
scripts (``chaos/scripts/*.yaml``, installed as ``ddiloco.chaos.scripts``).

``ddiloco run --config ci-tiny`` and ``ddiloco syncer --config ci-tiny`` read
``configs/ci-tiny.yaml`` of the installed package; a path that exists wins over a bundled name.
The resolution lives here, in the workers layer, because the worker commands and
:func:`ddiloco.workers.run.config.load_config` need it; the chaos scripts' :data:`Bundle` is defined
one layer up (``ddiloco.bundled``) with the same class. A package folder is found by its import
spec, so the same code reads a wheel's site-packages and an editable checkout.
"""

from __future__ import annotations

import difflib
import importlib.util
import re
from dataclasses import dataclass
from pathlib import Path

from ddiloco.pipeline.errors import ConfigError

__all__ = ["CONFIGS", "Bundle", "UnknownBundledName", "bundled_configs", "resolve_config"]


class UnknownBundledName(ConfigError):
    """A name is neither an existing file nor a bundled file's name."""


@dataclass(frozen=True)
class Bundle:
    """A folder of files installed with the package, addressed by file stem.

    Attributes:
        kind: what a file is, in messages ("config", "chaos script").
        package: the dotted package the folder installs as.
        folder: the folder as the checkout and the docs spell it (``configs``): a path
            ``configs/ci-tiny.yaml`` that does not exist here resolves to the bundled file.
        suffixes: the file suffixes that count, preferred first.
        lister: the command line that lists the names (named in the unknown-name error).
        checkout: the folder in a source checkout, read when ``package`` cannot be found
            (an editable install made before the package was declared).
    """

    kind: str
    package: str
    folder: str
    suffixes: tuple[str, ...]
    lister: str
    checkout: Path | None = None

    def directories(self) -> list[Path]:
        """The folders that hold the bundled files (empty when none is found)."""
        try:
            spec = importlib.util.find_spec(self.package)
        except ModuleNotFoundError:
            spec = None
        dirs = [Path(p) for p in (spec.submodule_search_locations or [])] if spec else []
        if not dirs and self.checkout is not None and self.checkout.is_dir():
            dirs = [self.checkout]
        return dirs

    def files(self) -> dict[str, Path]:
        """Bundled name (file stem) -> file, sorted by name; on a stem with two suffixes the
        first of :attr:`suffixes` wins."""
        found: dict[str, Path] = {}
        for folder in self.directories():
            for suffix in reversed(self.suffixes):
                for path in folder.glob(f"*{suffix}"):
                    if path.is_file():
                        found[path.stem] = path
        return dict(sorted(found.items()))

    def resolve(self, name_or_path: str | Path) -> Path:
        """The file a command line names: an existing path as it is, else the bundled file of
        that name (``gentle``, ``gentle.yaml`` or ``chaos/scripts/gentle.yaml``).

        Raises:
            UnknownBundledName: a bare name (no folder, no known suffix) that is not bundled;
                the message suggests the closest names. A path-like argument that does not
                exist is returned unchanged, for the reader's own "no such file" error.
        """
        path = Path(name_or_path)
        if path.exists():
            return path
        parent = path.parent.as_posix()
        bare = parent == "." and path.suffix not in self.suffixes
        # only the docs' relative spelling (configs/ci-tiny.yaml): an absolute or other path
        # that does not exist is the user's file gone missing, not a bundled one
        if parent in (".", self.folder):
            stem = path.stem if path.suffix in self.suffixes else path.name
            files = self.files()
            if stem in files:
                return files[stem]
            if bare:
                raise UnknownBundledName(self.unknown_message(str(name_or_path), list(files)))
        return path

    def unknown_message(self, name: str, names: list[str]) -> str:
        """``unknown chaos script 'gentel'; did you mean 'gentle'? (LISTER lists them)``."""
        close = difflib.get_close_matches(name, names, n=1, cutoff=0.6)
        hint = f"; did you mean {close[0]!r}?" if close else (
            f": not a file here, nor one of {', '.join(names)}" if names
            else ": not a file here, and no bundled ones are installed")
        return f"unknown {self.kind} {name!r}{hint} ({self.lister} lists them)"


#: run configs and region topologies (``configs/``; not its grafana/ and prometheus/ folders)
CONFIGS = Bundle(
    kind="config", package="ddiloco.workers.configs", folder="configs",
    suffixes=(".yaml", ".yml", ".toml"), lister="ddiloco chaos scripts --configs",
    checkout=Path(__file__).resolve().parents[2] / "configs")


def resolve_config(name_or_path: str | Path) -> Path:
    """The config file ``--config`` names: an existing path, else a bundled config's name
    (``ci-tiny``, ``default``, ``regions-4``).

    Raises:
        UnknownBundledName: a bare name that is neither a file nor bundled.
    """
    return CONFIGS.resolve(name_or_path)


def first_sentence(text: str, limit: int = 160) -> str:
    """The first sentence of ``text`` on one line, cut at a word before ``limit`` characters
    (with "...")."""
    flat = " ".join(text.split())
    match = re.match(r"(.+?[.!?])(\s|$)", flat)
    line = match.group(1) if match else flat
    if len(line) <= limit:
        return line
    return line[: limit - 3].rsplit(" ", 1)[0].rstrip(" ,;:") + "..."


def config_description(path: Path) -> str:
    """A config file's one-line description: the first sentence of its leading comment."""
    lines: list[str] = []
    for raw in path.read_text().splitlines():
        stripped = raw.strip()
        if not stripped.startswith("#"):
            break
        lines.append(stripped.lstrip("#").strip())
    return first_sentence(" ".join(lines)) if lines else ""


def bundled_configs() -> dict[str, str]:
    """Every bundled config by name, with its one-line description (from its leading
    comment), e.g. ``{"ci-tiny": "A very small model for integration tests and quick smoke
    runs.", ...}``; ``--config NAME`` reads it."""
    return {name: config_description(path) for name, path in CONFIGS.files().items()}
