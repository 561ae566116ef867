"""The embedded S3 server's ports: none whose SeaweedFS socket another server left behind."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest

from ddiloco.store import embedded_s3
from ddiloco.store.embedded_s3 import _free_ports, _remove_own_sockets


def test_ports_with_a_stale_socket_are_skipped(monkeypatch: pytest.MonkeyPatch) -> None:
    seen: list[int] = []

    def stale_first_three(port: int) -> list[Path]:
        seen.append(port)
        return [Path(f"/tmp/seaweedfs-master-grpc-{port}.sock")] if len(seen) <= 3 else []

    monkeypatch.setattr(embedded_s3, "_weed_sockets", stale_first_three)
    ports = _free_ports(4)
    assert len(set(ports)) == 4
    assert not set(ports) & set(seen[:3])


def test_no_ports_without_stale_sockets_is_a_named_error(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded_s3, "_weed_sockets", lambda port: [Path("/tmp/x.sock")])
    with pytest.raises(embedded_s3.StoreUnavailable, match="stale SeaweedFS socket"):
        _free_ports(2)


def test_own_sockets_are_removed_and_other_files_kept() -> None:
    port = _free_ports(1)[0]
    sock_path = Path(f"/tmp/seaweedfs-test-{port}.sock")
    plain = Path(f"/tmp/seaweedfs-plain-{port}.sock")
    s = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
        s.bind(str(sock_path))
        plain.write_text("not a socket")
        _remove_own_sockets([port])
        assert not sock_path.exists() and plain.exists()
    finally:
        s.close()
        sock_path.unlink(missing_ok=True)
        plain.unlink(missing_ok=True)
