"""The ``ddiloco regions up|down|status`` command and the link tables it and runs print.

:func:`regions_command` is the command itself; :func:`links_table`, :func:`link_checks_json` and
:func:`fmt_rate` render :meth:`ddiloco.chaos.wan.regions.Regions.check_links` results (also for
``ddiloco run --regions``, chaos runs and ``bench/wan.py``). This module imports
:mod:`ddiloco.chaos.wan.regions`, never the other way round.
"""

from __future__ import annotations

import json
from dataclasses import asdict
from pathlib import Path
from typing import Any

from ddiloco.chaos.wan.netns import (
    BRIDGE_NAME,
    NS_RE,
    TAG_RE,
    RegionsError,
    cleanup_leftovers,
    interface_address,
    interface_bytes,
    list_namespaces,
    state_file,
)
from ddiloco.chaos.wan.regions import LinkCheck, Regions
from ddiloco.chaos.wan.topology import TopologyError, load_topology

__all__ = ["fmt_rate", "link_checks_json", "links_table", "regions_command"]


def fmt_rate(bps: float) -> str:
    """``95.6 Mbit/s`` and the like, from a rate in bit/s (3 significant digits, powers of
    1000)."""
    for unit, scale in (("Gbit/s", 1e9), ("Mbit/s", 1e6), ("kbit/s", 1e3)):
        if bps >= scale:
            return f"{bps / scale:.3g} {unit}"
    return f"{bps:.3g} bit/s"


def link_checks_json(checks: list[LinkCheck]) -> list[dict[str, Any]]:
    """JSON-ready asked-versus-achieved rows (rates in bit/s, times in seconds)."""
    return [
        {"src": c.src, "dst": c.dst, "asked": c.asked.model_dump(),
         "asked_rtt_s": c.asked_rtt_s, "measured": asdict(c.measured), "ratio": c.ratio}
        for c in checks
    ]  # fmt: skip


def links_table(checks: list[LinkCheck], title: str) -> Any:
    """A rich table of asked versus achieved rate and round trip per link."""
    from rich.table import Table

    table = Table(title=title)
    for col in ("link", "asked", "achieved", "ratio", "loss", "RTT asked", "RTT achieved"):
        table.add_column(col, justify="left" if col == "link" else "right")
    for c in checks:
        table.add_row(
            f"{c.src} -> {c.dst}", fmt_rate(c.asked.rate_bps), fmt_rate(c.measured.rate_bps),
            f"{c.ratio:.2f}", f"{c.asked.loss * 100:g}%", f"{c.asked_rtt_s * 1e3:.1f} ms",
            f"{c.measured.rtt_s * 1e3:.2f} ms",
        )  # fmt: skip
    return table


def _status() -> list[dict[str, Any]]:
    """Every ddiloco namespace: its tag and name, and for a region its address and counters."""
    rows = []
    for ns in list_namespaces():
        match = NS_RE.match(ns)
        assert match is not None
        row: dict[str, Any] = {"namespace": ns, "tag": match.group(1), "name": match.group(2)}
        if match.group(2) != BRIDGE_NAME:
            row["address"] = interface_address(ns)
            try:
                row.update(interface_bytes(ns))
            except (RegionsError, LookupError, ValueError):
                pass  # e.g. the probe namespace of a concurrent preflight: no eth0
        rows.append(row)
    return rows


def regions_command(action: str, topology: Path | None, tag: str | None, json_out: bool) -> int:
    """``ddiloco regions up|down|status [FILE]``.

    * ``up FILE``: create the regions of the topology under ``tag`` (random if None), measure
      every link, print asked versus achieved rate and RTT, write
      ``/run/ddiloco-regions-<tag>.json``; the namespaces stay up until ``down``.
    * ``down``: delete the namespaces of run ``tag``, or of every ddiloco run if None.
    * ``status``: every ddiloco namespace with its address and eth0 byte counters.

    Args:
        action: ``up``, ``down`` or ``status``.
        topology: the topology file (``up`` only).
        tag: run tag, ``[a-z0-9]{1,8}``.
        json_out: print JSON instead of a table.

    Returns:
        0 on success, 1 if a link could not be measured, 2 on bad input or a machine that
        cannot emulate regions.
    """
    from rich.console import Console
    from rich.markup import escape
    from rich.table import Table

    console = Console()
    err = Console(stderr=True)
    try:
        if tag is not None and not TAG_RE.match(tag):
            raise RegionsError(f"run tag {tag!r} must match [a-z0-9]{{1,8}}")
        if action == "down":
            removed = cleanup_leftovers(tag)
            if json_out:
                print(json.dumps({"removed": removed}))
            else:
                console.print(f"removed {len(removed)} namespace(s): {' '.join(removed) or '-'}")
            return 0
        if action == "status":
            rows = _status()
            if json_out:
                print(json.dumps({"namespaces": rows}, indent=2))
                return 0
            table = Table(title="ddiloco regions")
            for col in ("tag", "namespace", "address", "tx bytes", "rx bytes"):
                table.add_column(col)
            for row in rows:
                table.add_row(
                    row["tag"], row["namespace"], row.get("address") or "-",
                    str(row.get("tx_bytes", "-")), str(row.get("rx_bytes", "-")),
                )  # fmt: skip
            console.print(table)
            return 0
        if action != "up":
            raise RegionsError(f"unknown action {action!r} (up, down, status)")
        if topology is None:
            raise RegionsError("regions up needs a topology file")
        regions = Regions(load_topology(topology), tag)
        regions.up()
        try:
            checks = regions.check_links()
        except RegionsError as exc:
            err.print(f"[red]error:[/red] {escape(str(exc))} "
                      f"(regions of tag {regions.tag} left up)")
            return 1
        state = regions.state()
        state["links"] = link_checks_json(checks)
        state_file(regions.tag).write_text(json.dumps(state, indent=2) + "\n")
    except (RegionsError, TopologyError) as exc:
        err.print(f"[red]error:[/red] {escape(str(exc))}")
        return 2
    if json_out:
        print(json.dumps(state, indent=2))
        return 0
    table = links_table(checks, f"regions {regions.tag} ({regions.topology.name}): asked vs "
                                "achieved")
    console.print(table)
    console.print(
        f"state: {state_file(regions.tag)}; run a command in a region with "
        f"'ip netns exec {regions.namespace(next(iter(regions.topology.regions)))} CMD'"
    )
    return 0
