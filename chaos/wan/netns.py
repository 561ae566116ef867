"""Network-namespace helpers for emulated regions: naming, commands, processes, leftovers.

Every namespace a run creates is named ``ddl-<tag>-<name>`` (:data:`NS_PREFIX`, :data:`NS_RE`),
and its state and delayer logs live in :data:`STATE_DIR` under the same tag, so the functions
here can list, inspect and delete what any run left without knowing its topology.
:class:`ddiloco.chaos.wan.regions.Regions` builds on them; the ``regions`` command
(:mod:`ddiloco.chaos.wan.regions_cli`) uses them for ``down`` and ``status``.

Everything here needs the ``ip`` command (iproute2); deleting namespaces and signalling the
processes inside them also needs root.
"""

from __future__ import annotations

import json
import re
import shutil
import subprocess
from collections.abc import Mapping
from pathlib import Path

import psutil

from ddiloco.pipeline.errors import DDilocoError

__all__ = [
    "BRIDGE_NAME",
    "CMD_TIMEOUT_S",
    "NS_PREFIX",
    "NS_RE",
    "STATE_DIR",
    "TAG_RE",
    "RegionsError",
    "cleanup_leftovers",
    "delayer_log",
    "interface_address",
    "interface_bytes",
    "list_namespaces",
    "run_command",
    "state_file",
    "terminate_namespace_processes",
]

NS_PREFIX = "ddl-"
"""Prefix of every network namespace a run creates (``ddl-<tag>-<region>``, ``ddl-<tag>-br``)."""
STATE_DIR = Path("/run")
"""Where ``regions up`` writes ``ddiloco-regions-<tag>.json`` and delayers their logs."""
TAG_RE = re.compile(r"^[a-z0-9]{1,8}$")
"""Run tags: 1 to 8 lowercase letters or digits."""
NS_RE = re.compile(r"^ddl-([a-z0-9]{1,8})-(\S+)$")
"""A run's namespace name; groups: the run tag, then the region (or :data:`BRIDGE_NAME`)."""
BRIDGE_NAME = "br"
"""Name part of the bridge namespace, ``ddl-<tag>-br`` (not a valid region name there)."""
CMD_TIMEOUT_S = 20.0
"""Bound on one ``ip``/``tc``/``nft`` command, seconds."""
_KILL_GRACE_S = 3.0


class RegionsError(DDilocoError):
    """Regions cannot be set up or used here (not root, a tool or kernel feature missing...)."""


def run_command(
    cmd: list[str],
    *,
    check: bool = True,
    timeout: float = CMD_TIMEOUT_S,
    env: Mapping[str, str] | None = None,
) -> str:
    """Run ``cmd`` and return its stdout.

    Args:
        cmd: the command and its arguments.
        check: raise when the command exits non-zero (otherwise its stdout is returned anyway).
        timeout: bound on the command, seconds.
        env: its environment; this process's when None.

    Raises:
        RegionsError: the command could not be started, ran past ``timeout``, or (with
            ``check``) failed; the message holds its stderr.
    """
    try:
        proc = subprocess.run(
            cmd, capture_output=True, text=True, timeout=timeout, check=False, env=env
        )
    except (OSError, subprocess.TimeoutExpired) as exc:
        raise RegionsError(f"{' '.join(cmd)}: {exc}") from None
    if check and proc.returncode != 0:
        raise RegionsError(f"{' '.join(cmd)} failed: {proc.stderr.strip() or proc.returncode}")
    return proc.stdout


def list_namespaces(tag: str | None = None) -> list[str]:
    """Names of the network namespaces of ddiloco runs (of run ``tag``, or of every run), sorted.

    Raises:
        RegionsError: ``ip`` is not installed or ``ip netns list`` failed.
    """
    if shutil.which("ip") is None:
        raise RegionsError("the 'ip' command (iproute2) is not installed")
    names = []
    for line in run_command(["ip", "netns", "list"]).splitlines():
        name = line.split(" ", 1)[0]
        match = NS_RE.match(name)
        if match and (tag is None or match.group(1) == tag):
            names.append(name)
    return sorted(names)


def state_file(tag: str) -> Path:
    """The JSON file ``regions up`` writes for run ``tag`` (under :data:`STATE_DIR`)."""
    return STATE_DIR / f"ddiloco-regions-{tag}.json"


def delayer_log(tag: str, region: str) -> Path:
    """The log (stdout and stderr, ending with its JSON summary) of ``region``'s delayer."""
    return STATE_DIR / f"ddiloco-delayer-{tag}-{region}.log"


def cleanup_leftovers(tag: str | None = None) -> list[str]:
    """Delete the namespaces (and state file) of run ``tag``, or of every ddiloco run.

    Processes still inside them are terminated first (see
    :func:`terminate_namespace_processes`); a namespace that cannot be deleted is skipped.

    Returns:
        The namespace names deleted.

    Raises:
        RegionsError: the namespaces could not be listed.
    """
    names = list_namespaces(tag)
    terminate_namespace_processes(names)
    removed = []
    for name in names:
        run_command(["ip", "netns", "del", name], check=False)
        removed.append(name)
    for pattern in (f"ddiloco-regions-{tag or '*'}.json", f"ddiloco-delayer-{tag or '*'}-*.log"):
        for path in STATE_DIR.glob(pattern):
            path.unlink(missing_ok=True)
    return removed


def _namespace_pids(names: list[str]) -> list[int]:
    pids: list[int] = []
    for name in names:
        out = run_command(["ip", "netns", "pids", name], check=False)
        pids += [int(tok) for tok in out.split() if tok.isdigit()]
    return pids


def terminate_namespace_processes(names: list[str], grace_s: float = _KILL_GRACE_S) -> None:
    """SIGTERM every process inside the namespaces ``names``, SIGKILL what is left after
    ``grace_s`` seconds (``psutil.wait_procs``). A namespace's processes would keep it alive
    after ``ip netns del``.

    Processes that exit meanwhile are skipped; nothing is raised for them.
    """
    procs: list[psutil.Process] = []
    for pid in _namespace_pids(names):
        try:
            proc = psutil.Process(pid)
            proc.terminate()
            procs.append(proc)
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=grace_s)
    for proc in alive:
        try:
            # A zombie has exited (only its parent has yet to reap it): it needs no SIGKILL.
            if proc.status() != psutil.STATUS_ZOMBIE:
                proc.kill()
        except psutil.NoSuchProcess:
            pass


def interface_bytes(ns: str) -> dict[str, int]:
    """Counters of ``eth0`` in namespace ``ns``: ``tx_bytes``, ``rx_bytes``, ``tx_packets``,
    ``rx_packets`` (bytes include Ethernet headers).

    Raises:
        RegionsError: ``ip`` failed (no such namespace or interface).
        LookupError, ValueError: ``ip`` printed no counters in the expected JSON form.
    """
    data = json.loads(run_command(["ip", "-n", ns, "-s", "-j", "link", "show", "eth0"]))
    stats = data[0]["stats64"]
    return {
        "tx_bytes": int(stats["tx"]["bytes"]),
        "rx_bytes": int(stats["rx"]["bytes"]),
        "tx_packets": int(stats["tx"]["packets"]),
        "rx_packets": int(stats["rx"]["packets"]),
    }


def interface_address(ns: str) -> str | None:
    """The IPv4 address of ``eth0`` in namespace ``ns`` as ``a.b.c.d/len``, or None when it has
    none (or there is no such namespace or interface)."""
    try:
        data = json.loads(run_command(["ip", "-n", ns, "-j", "addr", "show", "eth0"]))
    except RegionsError:
        return None
    for info in data[0].get("addr_info", []) if data else []:
        if info.get("family") == "inet":
            return f"{info['local']}/{info['prefixlen']}"
    return None
