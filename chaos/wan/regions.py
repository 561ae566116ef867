"""Emulated regions on one Linux machine: network namespaces, a bridge, HTB rates, nft loss.

:class:`Regions` turns a :class:`~ddiloco.chaos.wan.topology.Topology` into network namespaces:

* one namespace per region, ``ddl-<tag>-<region>``, holding ``eth0`` with the address
  ``10.<x>.<y>.<n>/24`` (``x``, ``y`` derived from the run tag, ``n`` = 1 + the region's index)
  and ``lo``;
* one bridge namespace ``ddl-<tag>-br`` holding the Linux bridge ``br0`` and the other end of
  every region's veth pair (``v-<region>``);
* rates: an HTB qdisc on each bridge port ``v-<region>`` (traffic towards that region) with one
  class per source region (a u32 filter on the source address) at the rate of that link, each
  with a byte FIFO of the link's ``queue`` (seconds at its rate): the bottleneck queue is in the
  "network", as on a real path, so bulk flows can fill it;
* loss and partitions: an nftables ``bridge`` table in the bridge namespace: per ordered pair with
  loss, ``ip saddr A ip daddr B numgen random mod 10000 < N drop`` (loss resolution 0.01 %), and
  a set of partitioned address pairs dropped in both directions;
* one-way delay (this kernel has no ``netem``): in a region with a delayed incoming link, an
  ``iptables`` INPUT rule per delayed source sends its packets to NFQUEUE 0, where a
  :mod:`ddiloco.chaos.wan.delayer` process running in that namespace holds each packet for the
  link's delay before accepting it (after the sender's shaper, as propagation follows
  serialization; see :mod:`ddiloco.chaos.wan.delayer` for why not at the sender). A link's round
  trip is the sum of its two directions' delays. The delayer copies only IPv4 headers to user space;
  :meth:`Regions.check_links` measures the achieved round trip against the asked one.

Everything carries the run tag, so parallel runs do not collide and :func:`cleanup_leftovers`
finds what a crashed run left. Deleting the namespaces removes the veths, qdiscs and rules;
processes still inside a namespace (delayers, workers of a crashed run) are terminated first.

Needs root, ``ip``, ``tc`` and ``nft``, and for delays also ``iptables`` and the
``NetfilterQueue`` package (``pip install 'ddiloco[wan]'``); without them, or without a kernel
feature (veth, bridge, HTB, nftables bridge family, NFQUEUE), :meth:`Regions.up` raises
:class:`RegionsError` saying what is missing before it creates anything.

Around this module: :mod:`ddiloco.chaos.wan.netns` names, lists, inspects and deletes namespaces
(and defines :class:`RegionsError`, re-exported here with the netns names callers use),
:mod:`ddiloco.chaos.wan.probes` holds the link probes :meth:`Regions.measure_link` and
:meth:`Regions.congest` start inside the namespaces, and :mod:`ddiloco.chaos.wan.regions_cli`
(which imports this module, never the other way) the ``ddiloco regions`` command and the link
tables.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import re
import secrets
import select
import shutil
import subprocess
import sys
from dataclasses import dataclass
from types import TracebackType
from typing import Any

from ddiloco.chaos.wan import netns
from ddiloco.chaos.wan.netns import (
    BRIDGE_NAME,
    CMD_TIMEOUT_S,
    NS_PREFIX,
    STATE_DIR,
    TAG_RE,
    RegionsError,
    cleanup_leftovers,
    delayer_log,
    list_namespaces,
    run_command,
    state_file,
    terminate_namespace_processes,
)
from ddiloco.chaos.wan.topology import LinkSpec, Topology

__all__ = [
    "NS_PREFIX",
    "STATE_DIR",
    "TAG_RE",
    "LinkCheck",
    "LinkMeasurement",
    "Regions",
    "RegionsError",
    "cleanup_leftovers",
    "list_namespaces",
]

_TABLE = "ddl"
_CHAIN = "wan"
_SET = "partitioned"
_DELAYER_READY_S = 15.0
_PROBES = "ddiloco.chaos.wan.probes"
"""The module of the link probes run inside the namespaces (``python -m MODULE``)."""


#: ``tc -s class show`` of an HTB class: its handle and the bytes it has sent.
_HTB_SENT = re.compile(r"^class htb (\S+) .*\n\s*Sent (\d+) bytes", re.MULTILINE)


@dataclass(frozen=True)
class LinkMeasurement:
    """One bounded TCP transfer and a ping-pong over one direction of a link."""

    rate_bps: float
    """TCP payload rate in bit/s over the second half of the transfer, once slow start is over
    (about 95 % of the shaped wire rate: headers are shaped too)."""
    rtt_s: float
    """Median round-trip time of 1-byte ping-pongs on the idle link, seconds."""
    nbytes: int
    """Bytes transferred."""
    seconds: float
    """Duration of the transfer, seconds."""


@dataclass(frozen=True)
class LinkCheck:
    """Asked versus achieved for the direction ``src -> dst``."""

    src: str
    dst: str
    asked: LinkSpec
    measured: LinkMeasurement

    asked_rtt_s: float = 0.0
    """Round trip asked: the one-way delays of ``src -> dst`` and ``dst -> src``, seconds."""

    @property
    def ratio(self) -> float:
        """Achieved TCP payload rate over the asked rate."""
        return self.measured.rate_bps / self.asked.rate_bps


def _subnet(tag: str) -> tuple[int, int]:
    """The ``x``, ``y`` of the run's ``10.x.y.0/24``, spread over 10.64-10.191 by the tag's hash
    so that concurrent runs rarely share a subnet."""
    digest = hashlib.sha256(tag.encode()).digest()
    return 64 + digest[0] % 128, digest[1]


class Regions:
    """The namespaces, bridge, shapers and filters of one topology, for one run tag.

    Use as a context manager (``with Regions(topo) as r: ...``): entering calls :meth:`up`,
    leaving calls :meth:`down`, also on an exception.

    Args:
        topology: the validated topology.
        tag: run tag (``[a-z0-9]{1,8}``) naming everything created; random when omitted.
    """

    def __init__(self, topology: Topology, tag: str | None = None) -> None:
        self.topology = topology
        self.tag = tag if tag is not None else secrets.token_hex(3)
        if not TAG_RE.match(self.tag):
            raise RegionsError(f"run tag {self.tag!r} must match [a-z0-9]{{1,8}}")
        x, y = _subnet(self.tag)
        self._prefix = f"10.{x}.{y}"
        self._index = {name: i for i, name in enumerate(topology.regions)}
        if len(self._index) > 250:
            raise RegionsError(f"{len(self._index)} regions: at most 250 fit one /24")
        self._partitions: set[tuple[str, str]] = set()
        self._delayers: list[subprocess.Popen[bytes]] = []
        self.delayer_summaries: dict[str, dict[str, Any]] = {}
        #: the latest :meth:`check_links` result a caller chose to keep (e.g. before a run)
        self.link_checks: list[LinkCheck] = []
        """After :meth:`down`: each delayer's exit summary (packets held, lateness in ms)."""
        self._up = False

    # ---- names --------------------------------------------------------------------------

    def namespace(self, region: str) -> str:
        """The network namespace of ``region`` (``ddl-<tag>-<region>``)."""
        self._check_region(region)
        return f"{NS_PREFIX}{self.tag}-{region}"

    @property
    def bridge_namespace(self) -> str:
        """The namespace holding the bridge (``ddl-<tag>-br``)."""
        return f"{NS_PREFIX}{self.tag}-{BRIDGE_NAME}"

    def namespaces(self) -> list[str]:
        """Every namespace of this run: the bridge's, then the regions' in file order."""
        return [self.bridge_namespace, *(self.namespace(r) for r in self.topology.regions)]

    def address(self, region: str) -> str:
        """The IPv4 address of ``region``'s ``eth0`` (without the /24)."""
        self._check_region(region)
        return f"{self._prefix}.{self._index[region] + 1}"

    def exec_prefix(self, region: str) -> list[str]:
        """Command prefix that runs a command inside ``region``'s namespace."""
        return ["ip", "netns", "exec", self.namespace(region)]

    def _probe_command(self, region: str, *args: str) -> list[str]:
        """Command that runs ``python -m ddiloco.chaos.wan.probes ARGS`` inside ``region``'s
        namespace (the installed package is found from any working directory)."""
        return [*self.exec_prefix(region), sys.executable, "-m", _PROBES, *args]

    def _check_region(self, region: str) -> None:
        if region not in self.topology.regions:
            known = ", ".join(self.topology.regions)
            raise KeyError(f"unknown region {region!r} (one of {known})")

    # ---- lifecycle ----------------------------------------------------------------------

    def __enter__(self) -> Regions:
        self.up()
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.down()

    def preflight(self) -> None:
        """Check root, the tools and the kernel features; creates nothing that outlives it.

        Kernel features are probed in a scratch namespace ``ddl-<tag>-_probe``, deleted after.

        Raises:
            RegionsError: what is missing, or this tag is already in use.
        """
        if os.geteuid() != 0:
            raise RegionsError("emulated regions need root (network namespaces, tc, nft)")
        missing = [tool for tool in ("ip", "tc", "nft") if shutil.which(tool) is None]
        if missing:
            raise RegionsError(
                f"missing command(s): {', '.join(missing)} (install iproute2 and nftables)"
            )
        taken = list_namespaces(self.tag)
        if taken:
            raise RegionsError(
                f"run tag {self.tag!r} is in use ({', '.join(taken)}); pick another tag or "
                f"run 'ddiloco regions down --tag {self.tag}'"
            )
        delay = any(self.topology.link(a, b).delay_s > 0 for a, b in self.topology.pairs())
        if delay and shutil.which("iptables") is None:
            raise RegionsError(
                f"{self.topology.source}: a link asks for a delay > 0, which needs the 'iptables' "
                "command (NFQUEUE rules; install the iptables package)"
            )
        if delay and importlib.util.find_spec("netfilterqueue") is None:
            raise RegionsError(
                f"{self.topology.source}: a link asks for a delay > 0, which needs the "
                "NetfilterQueue package: pip install 'ddiloco[wan]' (it builds against "
                "libnetfilter-queue-dev)"
            )
        probe = f"{NS_PREFIX}{self.tag}-_probe"
        try:
            run_command(["ip", "netns", "add", probe])
        except RegionsError as exc:
            raise RegionsError(f"cannot create a network namespace: {exc}") from None
        try:
            steps = [
                ("a veth pair", ["ip", "-n", probe, "link", "add", "p0", "type", "veth",
                                 "peer", "name", "p1"]),
                ("a Linux bridge", ["ip", "-n", probe, "link", "add", "b0", "type", "bridge"]),
                ("the HTB qdisc (sch_htb)", ["tc", "-n", probe, "qdisc", "add", "dev", "p0",
                                             "root", "handle", "1:", "htb", "default", "1"]),
                ("an HTB class", ["tc", "-n", probe, "class", "add", "dev", "p0", "parent", "1:",
                                  "classid", "1:1", "htb", "rate", "1mbit"]),
                ("a byte FIFO (sch_fifo)", ["tc", "-n", probe, "qdisc", "add", "dev", "p0",
                                            "parent", "1:1", "bfifo", "limit", "65536"]),
                ("u32 filters (cls_u32)", ["tc", "-n", probe, "filter", "add", "dev", "p0",
                                           "parent", "1:", "protocol", "ip", "prio", "1", "u32",
                                           "match", "ip", "src", "10.0.0.1/32", "flowid", "1:1"]),
            ]  # fmt: skip
            for what, cmd in steps:
                try:
                    run_command(cmd)
                except RegionsError as exc:
                    raise RegionsError(f"this kernel cannot create {what}: {exc}") from None
            try:
                self._nft(probe, self._ruleset(probe_only=True))
            except RegionsError as exc:
                raise RegionsError(
                    f"nftables bridge-family filtering (numgen, concatenated sets) is "
                    f"unavailable: {exc}"
                ) from None
            if delay:
                self._preflight_delay(probe)
        finally:
            run_command(["ip", "netns", "del", probe], check=False)

    @staticmethod
    def _preflight_delay(probe: str) -> None:
        """An NFQUEUE rule must be accepted in a namespace (xt_NFQUEUE or nft queue)."""
        try:
            run_command(["ip", "netns", "exec", probe, "iptables", "-w", "-A", "INPUT", "-s",
                         "10.0.0.2/32", "-j", "NFQUEUE", "--queue-num", "0"])  # fmt: skip
        except RegionsError as exc:
            raise RegionsError(
                f"one-way delay needs netfilter queueing (NFQUEUE), which this kernel refused: "
                f"{exc}"
            ) from None

    def up(self) -> None:
        """Create the namespaces, bridge, veths, addresses, shapers and filters.

        On a failure half-way, everything created so far is removed before the error is raised.

        Raises:
            RegionsError: see :meth:`preflight`, or a command failed.
        """
        self.preflight()
        self._up = True
        try:
            self._create()
        except BaseException:
            self.down()
            raise

    def _create(self) -> None:
        br = self.bridge_namespace
        for ns in self.namespaces():
            run_command(["ip", "netns", "add", ns])
            run_command(["ip", "-n", ns, "link", "set", "lo", "up"])
        run_command(["ip", "-n", br, "link", "add", "br0", "type", "bridge"])
        run_command(["ip", "-n", br, "link", "set", "br0", "up"])
        for region in self.topology.regions:
            ns, port = self.namespace(region), f"v-{region}"
            run_command(["ip", "-n", br, "link", "add", port, "type", "veth",
                         "peer", "name", "eth0", "netns", ns])  # fmt: skip
            run_command(["ip", "-n", br, "link", "set", port, "master", "br0", "up"])
            run_command(["ip", "-n", ns, "addr", "add", f"{self.address(region)}/24",
                         "dev", "eth0"])  # fmt: skip
            run_command(["ip", "-n", ns, "link", "set", "eth0", "up"])
            self._shape(region)
        self._nft(br, self._ruleset())
        for region in self.topology.regions:
            self._delay(region)

    def delays(self, region: str) -> dict[str, float]:
        """One-way delay in seconds into ``region`` from each other region's address, for the
        links with a delay > 0."""
        return {
            self.address(src): self.topology.link(src, region).delay_s
            for src in self.topology.regions
            if src != region and self.topology.link(src, region).delay_s > 0
        }

    def _delay(self, region: str) -> None:
        """Start ``region``'s delayer, wait until it holds NFQUEUE 0, then route the packets of
        its delayed sources to the queue (without a consumer the kernel would drop them)."""
        delays = self.delays(region)
        if not delays:
            return
        read_fd, write_fd = os.pipe()
        cmd = [*self.exec_prefix(region), sys.executable, "-m", "ddiloco.chaos.wan.delayer",
               "--tag", self.tag, "--region", region, "--ready-fd", str(write_fd)]  # fmt: skip
        for addr, seconds in delays.items():
            cmd += ["--delay", f"{addr}={seconds!r}"]
        log_path = delayer_log(self.tag, region)
        with open(log_path, "wb") as log:
            try:
                proc = subprocess.Popen(
                    cmd, pass_fds=(write_fd,), stdin=subprocess.DEVNULL, stdout=log,
                    stderr=subprocess.STDOUT,
                    start_new_session=True,  # outlives `regions up`; `down` ends it
                )  # fmt: skip
            finally:
                os.close(write_fd)
        try:
            ready, _, _ = select.select([read_fd], [], [], _DELAYER_READY_S)
            ok = bool(ready) and os.read(read_fd, 1) == b"1"
        finally:
            os.close(read_fd)
        if not ok:
            proc.kill()
            proc.wait()
            raise RegionsError(
                f"the delayer of region {region!r} did not start: "
                f"{log_path.read_text(errors='replace').strip()}"
            )
        self._delayers.append(proc)
        for addr in delays:
            run_command([*self.exec_prefix(region), "iptables", "-w", "-A", "INPUT", "-i", "eth0",
                         "-s", f"{addr}/32", "-j", "NFQUEUE", "--queue-num", "0"])  # fmt: skip

    def _shape(self, region: str) -> None:
        """HTB on the bridge port towards ``region``: class 1:1 (default) and 1:<10+j> for
        traffic from region j, at the rate of the link j -> region, each with a byte FIFO of
        the link's ``queue_s`` at that rate. The bottleneck queue sits in the bridge namespace,
        as a router's does, so bulk TCP flows fill it (a queue on the sender's own interface
        would be kept short by TCP small queues)."""
        br, port = self.bridge_namespace, f"v-{region}"
        others = [r for r in self.topology.regions if r != region]
        links = {src: self.topology.link(src, region) for src in others}
        default_bps = max((ln.rate_bps for ln in links.values()), default=1e9)
        tc = ["tc", "-n", br]
        run_command([*tc, "qdisc", "add", "dev", port, "root", "handle", "1:", "htb",
                     "default", "1"])  # fmt: skip
        classes = [("1:1", default_bps, 0.25, None)] + [
            (f"1:{10 + self._index[src]:x}", ln.rate_bps, ln.queue_s, src)
            for src, ln in links.items()]
        for cls, rate, queue_s, src in classes:
            run_command([*tc, "class", "add", "dev", port, "parent", "1:", "classid", cls, "htb",
                         "rate", f"{int(rate)}bit", "quantum", "1514"])  # fmt: skip
            limit = max(64 * 1024, int(rate / 8 * queue_s))
            run_command([*tc, "qdisc", "add", "dev", port, "parent", cls, "bfifo", "limit",
                         str(limit)])  # fmt: skip
            if src is not None:
                run_command([*tc, "filter", "add", "dev", port, "parent", "1:", "protocol", "ip",
                             "prio", "1", "u32", "match", "ip", "src", f"{self.address(src)}/32",
                             "flowid", cls])  # fmt: skip

    def _ruleset(self, probe_only: bool = False) -> str:
        lines = [
            f"table bridge {_TABLE} {{",
            f"  set {_SET} {{ type ipv4_addr . ipv4_addr; }}",
            f"  chain {_CHAIN} {{",
            "    type filter hook forward priority 0; policy accept;",
            f"    ip saddr . ip daddr @{_SET} counter drop",
        ]
        if probe_only:
            lines.append(
                "    ip saddr 10.0.0.1 ip daddr 10.0.0.2 numgen random mod 10000 < 1 counter drop"
            )
        else:
            for src, dst in self.topology.pairs():
                loss = self.topology.link(src, dst).loss
                threshold = round(loss * 10000)
                if threshold > 0:
                    lines.append(
                        f"    ip saddr {self.address(src)} ip daddr {self.address(dst)} "
                        f"numgen random mod 10000 < {threshold} counter drop"
                    )
        lines += ["  }", "}"]
        return "\n".join(lines) + "\n"

    @staticmethod
    def _nft(ns: str, ruleset: str) -> None:
        try:
            proc = subprocess.run(
                ["ip", "netns", "exec", ns, "nft", "-f", "-"],
                input=ruleset, capture_output=True, text=True, timeout=CMD_TIMEOUT_S,
                check=False,
            )  # fmt: skip
        except (OSError, subprocess.TimeoutExpired) as exc:
            raise RegionsError(f"nft in {ns}: {exc}") from None
        if proc.returncode != 0:
            raise RegionsError(f"nft in {ns} failed: {proc.stderr.strip()}")

    @property
    def host_address(self) -> str:
        """The address of this machine's own namespace on the regions' bridge (after
        :meth:`attach_host`)."""
        return f"{self._prefix}.254"

    def attach_host(self) -> str:
        """Connect this machine's own network namespace to the bridge, unshaped, so a local
        orchestrator can reach every region (Redis in one region, say). Deleting the bridge
        namespace in :meth:`down` removes the link. Returns :attr:`host_address`.

        Raises:
            RegionsError: the regions are not up, or a command failed.
        """
        if not self._up:
            raise RegionsError("attach_host: the regions are not up")
        name = f"ddlh-{self.tag}"
        run_command(["ip", "link", "add", name, "type", "veth", "peer", "name", "v-host",
                     "netns", self.bridge_namespace])  # fmt: skip
        run_command(["ip", "-n", self.bridge_namespace, "link", "set", "v-host", "master", "br0",
                     "up"])  # fmt: skip
        run_command(["ip", "addr", "add", f"{self.host_address}/24", "dev", name])
        run_command(["ip", "link", "set", name, "up"])
        return self.host_address

    def down(self) -> None:
        """Delete every namespace of this run (which removes its veths, qdiscs and rules).

        Idempotent; also removes the state file of this tag if there is one.
        """
        names = list_namespaces(self.tag)
        terminate_namespace_processes(names)
        for proc in self._delayers:
            proc.wait()  # reap; terminate_namespace_processes ended them
        self._delayers.clear()
        for ns in names:
            run_command(["ip", "netns", "del", ns], check=False)
        self.delayer_summaries = self._read_delayer_summaries()
        for path in STATE_DIR.glob(f"ddiloco-delayer-{self.tag}-*.log"):
            path.unlink(missing_ok=True)
        state_file(self.tag).unlink(missing_ok=True)
        self._partitions.clear()
        self._up = False

    def _read_delayer_summaries(self) -> dict[str, dict[str, Any]]:
        out: dict[str, dict[str, Any]] = {}
        for region in self.topology.regions:
            path = delayer_log(self.tag, region)
            if not path.exists():
                continue
            for line in path.read_text(errors="replace").splitlines():
                if line.startswith("{"):
                    try:
                        out[region] = json.loads(line)
                    except ValueError:
                        pass
        return out

    # ---- faults -------------------------------------------------------------------------

    def _set_elements(self, verb: str, a: str, b: str) -> None:
        pa, pb = self.address(a), self.address(b)
        run_command(["ip", "netns", "exec", self.bridge_namespace, "nft", verb, "element", "bridge",
                     _TABLE, _SET, f"{{ {pa} . {pb}, {pb} . {pa} }}"])  # fmt: skip

    def partition(self, a: str, b: str) -> None:
        """Drop every packet between regions ``a`` and ``b`` (both directions) until healed."""
        if a == b:
            raise ValueError(f"a partition separates two different regions, got {a!r} twice")
        pair = (min(a, b), max(a, b))
        if pair not in self._partitions:
            self._set_elements("add", *pair)
            self._partitions.add(pair)

    def heal(self, a: str, b: str) -> None:
        """Undo :meth:`partition` of ``a`` and ``b`` (a no-op if they are not partitioned)."""
        pair = (min(a, b), max(a, b))
        if pair in self._partitions:
            self._set_elements("delete", *pair)
            self._partitions.discard(pair)

    def congest(self, a: str, b: str, flows: int = 8) -> list[subprocess.Popen[str]]:
        """Fill the links between ``a`` and ``b`` in both directions with bulk TCP traffic
        (``flows`` connections each way, sending as fast as the shapers let them), the way other
        tenants of a WAN link would, until :meth:`uncongest`.

        Returns:
            The flood processes (pass them to :meth:`uncongest`).

        Raises:
            RegionsError: a flood process did not start.
        """
        if a == b:
            raise ValueError(f"congestion needs two different regions, got {a!r} twice")
        procs: list[subprocess.Popen[str]] = []
        try:
            for src, dst in ((a, b), (b, a)):
                sink = subprocess.Popen(
                    self._probe_command(dst, "flood", "sink", self.address(dst)),
                    stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
                )  # fmt: skip
                procs.append(sink)
                assert sink.stdout is not None
                port = sink.stdout.readline().strip()
                if not port.isdigit():
                    raise RegionsError(f"the flood sink in {dst!r} did not start")
                procs.append(subprocess.Popen(
                    self._probe_command(src, "flood", "send", self.address(dst), port, str(flows)),
                    stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, text=True,
                ))  # fmt: skip
        except BaseException:
            self.uncongest(procs)
            raise
        return procs

    @staticmethod
    def uncongest(procs: list[subprocess.Popen[str]]) -> None:
        """Stop the flood processes of :meth:`congest`."""
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
        for proc in procs:
            proc.wait()

    # ---- observation --------------------------------------------------------------------

    def interface_bytes(self, region: str) -> dict[str, int]:
        """Counters of ``region``'s ``eth0``: ``tx_bytes``, ``rx_bytes``, ``tx_packets``,
        ``rx_packets`` (bytes include Ethernet headers)."""
        return netns.interface_bytes(self.namespace(region))

    def link_bytes(self) -> dict[tuple[str, str], int]:
        """Bytes that crossed each shaped link ``(src, dst)`` so far: the ``Sent`` counter of
        the HTB class for ``src`` on the bridge port towards ``dst`` (Ethernet frames, headers
        included; what the link dropped, by loss, partition or a full buffer, is not counted).

        Raises:
            RegionsError: ``tc`` failed or printed no counter for a link.
        """
        index = {f"1:{10 + i:x}": r for r, i in self._index.items()}
        out: dict[tuple[str, str], int] = {}
        for dst in self.topology.regions:
            text = run_command(["tc", "-n", self.bridge_namespace, "-s", "class", "show", "dev",
                                f"v-{dst}"])  # fmt: skip
            for cls, sent in _HTB_SENT.findall(text):
                src = index.get(cls)
                if src is not None and src != dst:
                    out[(src, dst)] = int(sent)
        missing = [p for p in self.topology.pairs() if p not in out]
        if missing:
            raise RegionsError(f"no HTB counter for the links {missing}")
        return out

    def measure_link(
        self, a: str, b: str, nbytes: int | None = None, timeout_s: float = 15.0,
        seconds: float = 1.0,
    ) -> LinkMeasurement:
        """Measure the direction ``b -> a``: a TCP server in ``b`` sends to a client in ``a``.

        Args:
            a: the receiving region.
            b: the sending region.
            nbytes: bytes to send; by default about ``seconds`` at the asked rate of
                ``b -> a`` plus 8 round trips (so that TCP slow start ends in the first half,
                which the rate leaves out), within [64 KiB, 64 MiB].
            timeout_s: bound on the whole measurement, seconds.

        Returns:
            The achieved TCP payload rate (bit/s) and the median RTT (seconds) of 20
            ping-pongs made before the transfer.

        Raises:
            RegionsError: the transfer failed or timed out (e.g. the regions are partitioned).
        """
        if nbytes is None:
            asked = self.topology.link(b, a).rate_bps
            rtt = self.topology.link(a, b).delay_s + self.topology.link(b, a).delay_s
            nbytes = int(min(max(asked / 8 * (seconds + 8 * rtt), 64 * 1024), 64 * 1024 * 1024))
        rounds = 20
        server = subprocess.Popen(
            self._probe_command(b, "server", self.address(b), str(nbytes), str(rounds),
                                str(timeout_s)),
            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
        )  # fmt: skip
        try:
            assert server.stdout is not None
            port = server.stdout.readline().strip()
            if not port.isdigit():
                _, err = server.communicate(timeout=timeout_s)
                raise RegionsError(f"measurement server in {b!r} did not start: {err.strip()}")
            try:
                out = run_command(
                    self._probe_command(a, "client", self.address(b), port, str(nbytes),
                                        str(rounds), str(timeout_s)),
                    timeout=timeout_s,
                )  # fmt: skip
            except RegionsError as exc:
                raise RegionsError(f"measuring {b} -> {a}: {exc}") from None
        finally:
            if server.poll() is None:
                server.kill()
            server.wait()
        result = json.loads(out)
        if result["nbytes"] != nbytes:
            raise RegionsError(f"measuring {b} -> {a}: got {result['nbytes']} of {nbytes} bytes")
        seconds = float(result["seconds"])
        tail_s = float(result["tail_s"])
        return LinkMeasurement(
            rate_bps=int(result["tail_bytes"]) * 8 / tail_s if tail_s > 0 else nbytes * 8 / seconds,
            rtt_s=float(result["rtt_s"]),
            nbytes=nbytes,
            seconds=seconds,
        )

    def check_links(self, seconds: float = 1.0) -> list[LinkCheck]:
        """Measure every ordered pair ``src -> dst`` (a bounded transfer of about ``seconds``
        at its asked rate, see :meth:`measure_link`); asked versus achieved, in file order.

        Raises:
            RegionsError: a link could not be measured.
        """
        return [
            LinkCheck(
                src, dst, self.topology.link(src, dst),
                self.measure_link(dst, src, seconds=seconds),
                asked_rtt_s=self.topology.link(src, dst).delay_s
                + self.topology.link(dst, src).delay_s,
            )
            for src, dst in self.topology.pairs()
        ]  # fmt: skip

    def state(self) -> dict[str, Any]:
        """JSON-ready description: tag, topology, and per region its namespace and address."""
        return {
            "tag": self.tag,
            "topology": self.topology.name,
            "source": self.topology.source,
            "bridge_namespace": self.bridge_namespace,
            "regions": {
                r: {"namespace": self.namespace(r), "address": self.address(r)}
                for r in self.topology.regions
            },
        }
