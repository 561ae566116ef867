"""CURVE security for ddiloco's ZeroMQ sockets: keys, the allow-list and the ZAP handler.

Every worker has a CURVE key pair (libzmq CurveZMQ: Curve25519 keys, encrypted and
authenticated connections). A key directory holds

* ``<dir>/<name>.key``: the public certificates of the run's workers, named by worker id
  (``learner-0``, ``shard-1``): the allow-list;
* ``<dir>/private/<name>.key_secret``: secret certificates, each readable by its owner only.

Both are written by :func:`zmq.auth.create_certificates` (ZPL certificate files) with mode
0600 (the private folder 0700). A shard is a CURVE server on its PULL and PUB sockets; its
ZAP handler (:class:`Authenticator`, a :class:`zmq.auth.Authenticator` in a thread) admits
only public keys in the allow-list of the roles it serves and names each connection by the
worker id of its key (the ZMQ ``User-Id`` of every message), so a shard can check that a
header's sender is the key's owner. Learners are CURVE clients that know each shard's public
key: they talk to no one else, and everything they send and receive is encrypted.

Rotation: a new certificate file in the directory is admitted at its first connection (the
handler re-reads the directory on an unknown key, at most once a second); a removed one is
refused for new connections (existing ones keep their session until they reconnect).
"""

from __future__ import annotations

import asyncio
import os
import stat
import threading
import time
from collections.abc import Callable, Collection
from dataclasses import dataclass
from pathlib import Path

import zmq
import zmq.auth
from zmq.utils import z85

from ddiloco.pipeline.errors import ConfigError

#: ZAP domain of every ddiloco server socket.
ZAP_DOMAIN = "ddiloco"
PRIVATE = "private"
#: Least time between two re-reads of the key directory on unknown keys, seconds.
RELOAD_EVERY_S = 1.0


@dataclass(frozen=True)
class KeyPair:
    """One worker's CURVE keys, Z85 text (40 bytes each)."""

    name: str
    public: bytes
    secret: bytes


def _check_name(name: str) -> None:
    if not name or not all(c.isalnum() or c in "-_." for c in name) or name.startswith("."):
        raise ConfigError(f"key name {name!r}: use letters, digits, '-', '_' and '.'")


def create_keys(keys_dir: Path | str, name: str, *, overwrite: bool = False) -> KeyPair:
    """Create worker ``name``'s key pair in ``keys_dir`` (module doc layout), mode 0600.

    Raises:
        ConfigError: a bad name, or keys for ``name`` exist and ``overwrite`` is False.
    """
    _check_name(name)
    root = Path(keys_dir)
    private = root / PRIVATE
    private.mkdir(parents=True, exist_ok=True)
    os.chmod(root, 0o755)
    os.chmod(private, 0o700)
    public_path, secret_path = root / f"{name}.key", private / f"{name}.key_secret"
    if not overwrite and (public_path.exists() or secret_path.exists()):
        raise ConfigError(f"keys for {name!r} exist in {root} (pass --force to replace them, "
                          "or --exist-ok to keep them)")
    old = os.umask(0o077)
    try:
        pub, sec = zmq.auth.create_certificates(str(private), name)
    finally:
        os.umask(old)
    os.replace(pub, public_path)
    for p in (public_path, Path(sec)):
        os.chmod(p, 0o600)
    return load_keys(root, name)


def load_keys(keys_dir: Path | str, name: str) -> KeyPair:
    """Worker ``name``'s key pair from ``keys_dir``.

    Raises:
        ConfigError: the secret certificate is missing, unreadable, or readable by others.
    """
    secret_path = Path(keys_dir) / PRIVATE / f"{name}.key_secret"
    if not secret_path.is_file():
        raise ConfigError(f"no secret key for {name!r} at {secret_path} "
                          f"(create one with `ddiloco keys new {name} --dir {keys_dir}`)")
    mode = stat.S_IMODE(secret_path.stat().st_mode)
    if mode & 0o077:
        raise ConfigError(f"{secret_path} has mode {mode:o}: a secret key must not be "
                          "readable by group or others (chmod 600)")
    try:
        public, secret = zmq.auth.load_certificate(str(secret_path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{secret_path}: not a CURVE secret certificate: {exc}") from None
    if secret is None:
        raise ConfigError(f"{secret_path} holds no secret key")
    return KeyPair(name, public, secret)


def public_key(keys_dir: Path | str, name: str) -> bytes:
    """Worker ``name``'s public key (Z85) from the allow-list.

    Raises:
        ConfigError: no certificate for ``name``.
    """
    path = Path(keys_dir) / f"{name}.key"
    try:
        public, _ = zmq.auth.load_certificate(str(path))
    except (OSError, ValueError) as exc:
        raise ConfigError(f"no public key for {name!r} at {path}: {exc}") from None
    return public


def allow_list(keys_dir: Path | str) -> dict[bytes, str]:
    """{public key (Z85): worker id} of every ``*.key`` certificate in ``keys_dir``; an
    unreadable file is skipped (it admits nobody)."""
    out: dict[bytes, str] = {}
    for path in sorted(Path(keys_dir).glob("*.key")):
        try:
            public, _ = zmq.auth.load_certificate(str(path))
        except (OSError, ValueError):
            continue
        out[public] = path.name[: -len(".key")]
    return out


class Authenticator(zmq.auth.Authenticator):
    """A shard's ZAP handler: admits the allow-list's keys of the given roles only.

    It serves ZAP requests in its own thread with a level-triggered ``zmq.Poller``.
    (:class:`zmq.auth.thread.ThreadAuthenticator` polls with asyncio on the socket's
    edge-triggered file descriptor: when ZAP requests queue up, e.g. a refused client
    reconnecting while a learner connects, it can sit on them until the next wake-up and stall
    every handshake; we measured 20 s stalls.)

    Args:
        ctx: the shard's ZeroMQ context (the handler serves every socket in it).
        keys_dir: the key directory (module doc).
        roles: worker-id prefixes admitted, e.g. ``("learner-",)``.
        on_refused: called (in the handler's thread) with the worker id, or None for an
            unknown key, of every refused connection attempt: e.g. a store counter.
    """

    def __init__(self, ctx: zmq.Context, keys_dir: Path | str,
                 roles: Collection[str] = ("learner-",),
                 on_refused: Callable[[str | None], None] | None = None) -> None:
        super().__init__(ctx)
        self.on_refused = on_refused
        self.keys_dir = Path(keys_dir)
        self.roles = tuple(roles)
        self._lock = threading.Lock()
        self._names = allow_list(self.keys_dir)
        self._loaded_at = time.monotonic()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        #: refused connection attempts (unknown key or a role not served)
        self.refused = 0

    def start(self) -> None:
        """Bind the ZAP socket, install the key callback for :data:`ZAP_DOMAIN` and start
        serving requests in a daemon thread."""
        super().start()
        self.configure_curve_callback(ZAP_DOMAIN, credentials_provider=self)
        self._thread = threading.Thread(target=self._serve, name="zap", daemon=True)
        self._thread.start()

    def stop(self) -> None:
        """Stop the thread and close the ZAP socket."""
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
        super().stop()

    def _serve(self) -> None:
        loop = asyncio.new_event_loop()
        poller = zmq.Poller()
        poller.register(self.zap_socket, zmq.POLLIN)
        try:
            while not self._stop.is_set():
                if not poller.poll(100):
                    continue
                try:
                    msg = self.zap_socket.recv_multipart(zmq.NOBLOCK)
                except zmq.Again:
                    continue
                try:
                    loop.run_until_complete(self.handle_zap_message(msg))
                except Exception:  # a malformed request must not stop authentication
                    self.log.exception("ZAP request failed")
        finally:
            loop.close()

    def name_of(self, z85_key: bytes) -> str | None:
        """The worker id of a public key, re-reading the directory (rate-limited) on a miss."""
        with self._lock:
            name = self._names.get(z85_key)
            if name is None and time.monotonic() - self._loaded_at >= RELOAD_EVERY_S:
                self._names = allow_list(self.keys_dir)
                self._loaded_at = time.monotonic()
                name = self._names.get(z85_key)
        return name

    def callback(self, domain: str, key: bytes) -> bool:
        """zmq.auth credentials provider: is this client key admitted?"""
        name = self.name_of(key)
        ok = name is not None and name.startswith(self.roles)
        if not ok:
            self.refused += 1
            if self.on_refused is not None:
                try:
                    self.on_refused(name)
                except Exception:  # a counter must not stop authentication
                    self.log.exception("on_refused hook failed")
        return ok

    def curve_user_id(self, client_public_key: bytes) -> str:
        """The User-Id of an admitted connection: the worker id its key is registered as."""
        return self.name_of(z85.encode(client_public_key)) or "?"


def server(sock: zmq.Socket, keys: KeyPair) -> zmq.Socket:
    """Make ``sock`` a CURVE server (before bind); clients are checked by the context's ZAP
    handler under :data:`ZAP_DOMAIN`."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_server = True
    sock.zap_domain = ZAP_DOMAIN.encode()
    return sock


def client(sock: zmq.Socket, keys: KeyPair, server_public: bytes) -> zmq.Socket:
    """Make ``sock`` a CURVE client of the server with key ``server_public`` (before
    connect; a socket connecting to several servers sets it before each connect)."""
    sock.curve_secretkey = keys.secret
    sock.curve_publickey = keys.public
    sock.curve_serverkey = server_public
    return sock


@dataclass(frozen=True)
class ClientKeys:
    """What a CURVE client socket needs: its own keys and each shard's public key."""

    keys: KeyPair
    keys_dir: Path

    def server_key(self, shard: int) -> bytes:
        """Shard ``shard``'s public key from the allow-list.

        Raises:
            ConfigError: no certificate ``shard-<shard>.key``.
        """
        return public_key(self.keys_dir, f"shard-{shard}")


def is_loopback(host: str) -> bool:
    """True for an address only this machine can reach (plain TCP is allowed only there)."""
    return host in ("127.0.0.1", "::1", "localhost") or host.startswith("127.")
