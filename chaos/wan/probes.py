"""Link probes that :class:`ddiloco.chaos.wan.regions.Regions` runs inside region namespaces.

Each probe is a separate process started with
``ip netns exec NS python -m ddiloco.chaos.wan.probes ...``, so that its sockets live in that
region's network namespace. Standard library only: a probe starts in well under a second and
needs nothing of the training stack.

``server ADDR NBYTES ROUNDS TIMEOUT_S``
    Listens on ``ADDR`` (a free port), prints the port on one line, accepts one client, answers
    ``ROUNDS`` one-byte ping-pongs, then on ``g`` sends ``NBYTES`` bytes and waits for the
    client to close. Exits 1 on a protocol error.
``client ADDR PORT NBYTES ROUNDS TIMEOUT_S``
    Connects, makes ``ROUNDS`` ping-pongs, asks for the transfer and receives it; prints one JSON
    line ``{"nbytes", "seconds", "rtt_s", "tail_bytes", "tail_s"}`` (bytes received, the whole
    transfer's duration, the median ping-pong round trip, and the bytes and seconds of the
    transfer's second half). Exits 1 on a protocol error.
``flood sink ADDR``
    Listens on ``ADDR``, prints the port on one line, and discards whatever any number of
    clients send, until killed.
``flood send ADDR PORT FLOWS``
    Keeps ``FLOWS`` TCP connections to ``ADDR:PORT`` sending as fast as the network lets them,
    reconnecting after an error (a partition, a reset), until killed.

Timeouts are in seconds; a socket timeout or connection error ends ``server`` and ``client``
with a traceback on stderr and exit status 1.
"""

from __future__ import annotations

import json
import socket
import statistics
import sys
import threading
import time
from typing import NoReturn

__all__ = ["client", "flood_send", "flood_sink", "main", "server"]

_CHUNK = 65536
_RECV_BUF = 1 << 20
_RECONNECT_S = 0.2


def server(addr: str, nbytes: int, rounds: int, timeout_s: float) -> int:
    """Serve one measurement client (see the module docstring); returns the exit status.

    Raises:
        OSError: a socket error or timeout (``timeout_s``, per accept and per receive).
    """
    srv = socket.socket()
    srv.bind((addr, 0))
    srv.listen(1)
    srv.settimeout(timeout_s)
    print(srv.getsockname()[1], flush=True)
    conn, _ = srv.accept()
    conn.settimeout(timeout_s)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    for _ in range(rounds):
        if conn.recv(1) != b"p":
            return 1
        conn.sendall(b"p")
    if conn.recv(1) != b"g":
        return 1
    chunk = memoryview(bytes(_CHUNK))
    left = nbytes
    while left:
        left -= conn.send(chunk[: min(left, len(chunk))])
    conn.shutdown(socket.SHUT_WR)
    # Wait for the client's close, so the last bytes are not lost to a reset.
    conn.recv(1)
    return 0


def client(addr: str, port: int, nbytes: int, rounds: int, timeout_s: float) -> int:
    """Measure from ``addr:port`` (see the module docstring); prints the JSON result line and
    returns the exit status.

    Raises:
        OSError: a socket error or timeout (``timeout_s``, per connect and per receive).
    """
    conn = socket.create_connection((addr, port), timeout=timeout_s)
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    rtts = []
    for _ in range(rounds):
        t0 = time.perf_counter()
        conn.sendall(b"p")
        if conn.recv(1) != b"p":
            return 1
        rtts.append(time.perf_counter() - t0)
    buf = bytearray(_RECV_BUF)
    got = 0
    half: tuple[int, float] | None = None
    t0 = time.perf_counter()
    conn.sendall(b"g")
    while got < nbytes:
        k = conn.recv_into(buf)
        if not k:
            break
        got += k
        # The rate is taken over the second half only, once TCP slow start is over.
        if half is None and got >= nbytes // 2:
            half = (got, time.perf_counter())
    t1 = time.perf_counter()
    conn.close()
    if half is None:
        print(f"the server closed after {got} of {nbytes} bytes", file=sys.stderr)
        return 1
    print(json.dumps({"nbytes": got, "seconds": t1 - t0, "rtt_s": statistics.median(rtts),
                      "tail_bytes": got - half[0], "tail_s": t1 - half[1]}))  # fmt: skip
    return 0


def _drain(conn: socket.socket) -> None:
    buf = bytearray(_RECV_BUF)
    while conn.recv_into(buf):
        pass


def flood_sink(addr: str) -> NoReturn:
    """Accept and discard bulk traffic on ``addr`` (a free port, printed first) until killed.

    Raises:
        OSError: the listening socket failed.
    """
    srv = socket.socket()
    srv.bind((addr, 0))
    srv.listen(16)
    print(srv.getsockname()[1], flush=True)
    while True:
        conn, _ = srv.accept()
        threading.Thread(target=_drain, args=(conn,), daemon=True).start()


def _pump(addr: str, port: int) -> None:
    chunk = b"\0" * _RECV_BUF
    while True:
        try:
            conn = socket.create_connection((addr, port), timeout=5)
            conn.settimeout(None)
            while True:
                conn.sendall(chunk)
        except OSError:
            time.sleep(_RECONNECT_S)  # partitioned or reset: try again


def flood_send(addr: str, port: int, flows: int) -> NoReturn:
    """Send bulk traffic to ``addr:port`` over ``flows`` connections until killed."""
    for _ in range(flows):
        threading.Thread(target=_pump, args=(addr, port), daemon=True).start()
    while True:
        time.sleep(3600)


def main(argv: list[str]) -> int:
    """Run the probe named by ``argv`` (the arguments after ``-m ddiloco.chaos.wan.probes``, see
    the module docstring); returns the exit status, 2 for a usage error."""
    match argv:
        case ["server", addr, nbytes, rounds, timeout_s]:
            return server(addr, int(nbytes), int(rounds), float(timeout_s))
        case ["client", addr, port, nbytes, rounds, timeout_s]:
            return client(addr, int(port), int(nbytes), int(rounds), float(timeout_s))
        case ["flood", "sink", addr]:
            flood_sink(addr)
        case ["flood", "send", addr, port, flows]:
            flood_send(addr, int(port), int(flows))
    print(f"usage: python -m ddiloco.chaos.wan.probes server|client|flood ... (got {argv})",
          file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
