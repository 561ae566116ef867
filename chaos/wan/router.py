"""A region's router for container deployments: the links of a topology file between a region's
network and the hub's, shaped inside one container (compose.yaml's ``router-*`` services).

``ddiloco run --regions`` shapes links between network namespaces it creates itself
(:mod:`ddiloco.chaos.wan.regions`). In a container deployment each region is a Docker network
holding its learners and one router; the router is also on the hub network (Redis, syncer shards,
evaluator), and learners route the hub's subnet through it. The router applies, for its region
``R`` and the hub ``H`` of the topology:

* rate: an HTB class on each interface's egress, ``link(R, H).rate`` towards the hub (upload)
  and ``link(H, R).rate`` towards the region (download), each over a byte FIFO of the link's
  ``queue`` seconds;
* one-way delay: forwarded packets go to NFQUEUE 0 and :mod:`ddiloco.chaos.wan.delayer` holds them
  for ``link(R, H).delay`` (source in the region's subnet) or ``link(H, R).delay`` (source in the
  hub's), as netem may be missing;
* loss: an nftables ``forward`` rule per direction drops the link's fraction at random;
* source NAT towards the hub, so hub containers need no route back to the region.

Needs ``NET_ADMIN`` in the container, ``net.ipv4.ip_forward=1`` (a compose ``sysctls`` entry),
``ip``, ``tc``, ``nft`` and, for delays, ``iptables`` and the NetfilterQueue package (all in
the project's image). It runs until SIGTERM, or until a run's store asks routers to stop
(``ddiloco finish``); the container's network namespace, and with it every rule, goes away
with the container.
"""

from __future__ import annotations

import ipaddress
import json
import math
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

from ddiloco.chaos.wan.topology import Topology
from ddiloco.pipeline.errors import DDilocoError
from ddiloco.pipeline.waiting import poll_until

__all__ = ["RouterError", "RouterPlan", "interfaces", "plan_router", "router_commands",
           "serve_router"]

READY_FILE = Path("/tmp/ddiloco-router-ready")
"""Written once every rule is in place (the compose healthcheck tests it)."""
_LOSS_SCALE = 1_000_000
"""Loss is drawn as ``numgen random mod _LOSS_SCALE < loss * _LOSS_SCALE`` (1 ppm steps)."""


class RouterError(DDilocoError):
    """The router cannot be set up here (a missing interface, tool or permission)."""


@dataclass(frozen=True)
class RouterPlan:
    """What one region's router applies (pure; :func:`plan_router`).

    Rates in bit/s, delays and queues in seconds, loss as a fraction.
    """

    region: str
    hub: str
    lan: str
    """Interface on the region's network."""
    wan: str
    """Interface on the hub's network."""
    lan_net: str
    wan_net: str
    up_rate: float
    up_delay_s: float
    up_loss: float
    up_queue_bytes: int
    down_rate: float
    down_delay_s: float
    down_loss: float
    down_queue_bytes: int

    @property
    def delays(self) -> dict[str, float]:
        """Delay per source network, the form :class:`ddiloco.chaos.wan.delayer.DelayLine` takes."""
        return {self.lan_net: self.up_delay_s, self.wan_net: self.down_delay_s}


def _queue_bytes(rate_bps: float, queue_s: float) -> int:
    # At least a few full-size packets, so a slow link still passes a burst.
    return max(int(rate_bps * queue_s / 8), 4 * 1514)


def plan_router(topology: Topology, region: str, hub: str,
                ifaces: dict[str, str], lan_net: str, wan_net: str) -> RouterPlan:
    """The rules of ``region``'s router.

    Args:
        topology: the validated topology (:func:`ddiloco.chaos.wan.topology.load_topology`).
        region: this router's region; hub: the region of Redis and the shards.
        ifaces: interface name -> its IPv4 address (:func:`interfaces`).
        lan_net, wan_net: the region's and the hub's subnets (CIDR).

    Raises:
        RouterError: an unknown region, or no interface (or two) in a subnet.
    """
    for name in (region, hub):
        if name not in topology.regions:
            raise RouterError(f"{topology.source}: no region {name!r} "
                              f"(regions: {sorted(topology.regions)})")
    if region == hub:
        raise RouterError(f"region {region!r} is the hub: the hub has no router")

    def one_in(net: str) -> str:
        network = ipaddress.IPv4Network(net)
        found = [i for i, a in ifaces.items() if ipaddress.IPv4Address(a) in network]
        if len(found) != 1:
            raise RouterError(f"expected one interface in {net}, found {found or 'none'} "
                              f"(interfaces: {ifaces})")
        return found[0]

    up, down = topology.link(region, hub), topology.link(hub, region)
    return RouterPlan(
        region=region, hub=hub, lan=one_in(lan_net), wan=one_in(wan_net),
        lan_net=lan_net, wan_net=wan_net,
        up_rate=up.rate_bps, up_delay_s=up.delay_s, up_loss=up.loss,
        up_queue_bytes=_queue_bytes(up.rate_bps, up.queue_s),
        down_rate=down.rate_bps, down_delay_s=down.delay_s, down_loss=down.loss,
        down_queue_bytes=_queue_bytes(down.rate_bps, down.queue_s))


def router_commands(plan: RouterPlan) -> list[list[str]]:
    """The ``tc``/``iptables`` commands of ``plan``, in order (pure). The nftables loss rules
    are :func:`loss_ruleset`."""
    cmds: list[list[str]] = [["iptables", "-w", "-t", "nat", "-A", "POSTROUTING", "-o", plan.wan,
                              "-j", "MASQUERADE"]]
    for dev, rate, queue in ((plan.wan, plan.up_rate, plan.up_queue_bytes),
                             (plan.lan, plan.down_rate, plan.down_queue_bytes)):
        bits = f"{max(int(rate), 8000)}bit"
        cmds += [["tc", "qdisc", "replace", "dev", dev, "root", "handle", "1:", "htb",
                  "default", "1"],
                 ["tc", "class", "add", "dev", dev, "parent", "1:", "classid", "1:1", "htb",
                  "rate", bits, "ceil", bits],
                 ["tc", "qdisc", "add", "dev", dev, "parent", "1:1", "handle", "10:", "bfifo",
                  "limit", str(queue)]]
    if plan.up_delay_s > 0 or plan.down_delay_s > 0:
        cmds.append(["iptables", "-w", "-A", "FORWARD", "-j", "NFQUEUE", "--queue-num", "0"])
    return cmds


def loss_ruleset(plan: RouterPlan) -> str | None:
    """An nftables ruleset dropping each direction's loss fraction, or None without loss."""
    rules = []
    for iif, oif, loss in ((plan.lan, plan.wan, plan.up_loss),
                           (plan.wan, plan.lan, plan.down_loss)):
        if loss > 0:
            threshold = max(1, round(loss * _LOSS_SCALE))
            rules.append(f'    iifname "{iif}" oifname "{oif}" numgen random mod {_LOSS_SCALE} '
                         f"< {threshold} drop")
    if not rules:
        return None
    body = "\n".join(rules)
    return ("table inet ddiloco_router {\n  chain forward {\n"
            "    type filter hook forward priority -10; policy accept;\n"
            f"{body}\n  }}\n}}\n")


def interfaces() -> dict[str, str]:
    """IPv4 address of every interface of this network namespace but loopback.

    Raises:
        RouterError: ``ip`` is missing or failed.
    """
    try:
        out = subprocess.run(["ip", "-j", "-4", "addr", "show"], check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError) as exc:
        raise RouterError(f"ip -j addr: {exc}") from None
    found: dict[str, str] = {}
    for link in json.loads(out):
        for info in link.get("addr_info", []):
            if info.get("family") == "inet" and link["ifname"] != "lo":
                found[link["ifname"]] = info["local"]
    return found


def _run(cmd: Sequence[str], stdin: str | None = None) -> None:
    proc = subprocess.run(list(cmd), input=stdin, capture_output=True, text=True)
    if proc.returncode != 0:
        raise RouterError(f"{' '.join(cmd)}: {proc.stderr.strip() or proc.returncode} "
                          "(the router needs NET_ADMIN and net.ipv4.ip_forward=1)")


def serve_router(topology: Topology, region: str, hub: str, lan_net: str, wan_net: str, *,
                 stop_requested: Callable[[], bool] | None = None,
                 say: Callable[[str], None] = print) -> int:
    """Apply ``region``'s links and forward until SIGTERM or ``stop_requested()``; returns the
    exit code (0).

    Raises:
        RouterError: a rule could not be applied, or the delay line failed to start.
    """
    plan = plan_router(topology, region, hub, interfaces(), lan_net, wan_net)
    try:
        forwarding = Path("/proc/sys/net/ipv4/ip_forward").read_text().strip()
    except OSError:
        forwarding = "?"
    if forwarding != "1":
        raise RouterError("net.ipv4.ip_forward is not 1 in this container (compose: "
                          "sysctls: [net.ipv4.ip_forward=1])")
    for cmd in router_commands(plan):
        _run(cmd)
    ruleset = loss_ruleset(plan)
    if ruleset is not None:
        _run(["nft", "-f", "-"], stdin=ruleset)
    delayer: subprocess.Popen[bytes] | None = None
    if plan.up_delay_s > 0 or plan.down_delay_s > 0:
        delayer = subprocess.Popen(
            [sys.executable, "-m", "ddiloco.chaos.wan.delayer", "--tag", "router",
             "--region", region,
             *[f"--delay={net}={d}" for net, d in plan.delays.items()]])
        time.sleep(0.5)
        if delayer.poll() is not None:
            raise RouterError(f"the delay line exited at once (code {delayer.returncode})")
    stopping = {"flag": False}

    def _stop(signum: int, frame: Any) -> None:
        stopping["flag"] = True

    signal.signal(signal.SIGTERM, _stop)
    signal.signal(signal.SIGINT, _stop)
    READY_FILE.write_text(json.dumps(asdict(plan)))
    say(json.dumps({"router": region, **asdict(plan)}))
    last = [0.0]

    def should_stop() -> bool:
        if delayer is not None and delayer.poll() is not None:
            raise RouterError(f"the delay line exited (code {delayer.returncode})")
        if stop_requested is not None and time.monotonic() - last[0] > 1.0:
            last[0] = time.monotonic()
            try:
                stopping["flag"] |= stop_requested()
            except (DDilocoError, OSError) as exc:  # Redis away: keep routing, ask again
                say(f"store check failed: {exc}")
        return stopping["flag"]

    try:
        poll_until(should_stop, timeout_s=None, interval_s=0.2)
    finally:
        if delayer is not None and delayer.poll() is None:
            delayer.terminate()
            try:
                delayer.wait(timeout=5)
            except subprocess.TimeoutExpired:
                delayer.kill()
        READY_FILE.unlink(missing_ok=True)
    return 0


def describe(plan: RouterPlan) -> str:
    """One line per direction, for logs."""
    def mbit(r: float) -> str:
        return f"{r / 1e6:g} Mbit/s" if math.isfinite(r) else "unlimited"
    return (f"{plan.region}->{plan.hub}: {mbit(plan.up_rate)}, {plan.up_delay_s * 1e3:g} ms, "
            f"{plan.up_loss:.2%} loss; {plan.hub}->{plan.region}: {mbit(plan.down_rate)}, "
            f"{plan.down_delay_s * 1e3:g} ms, {plan.down_loss:.2%} loss")
