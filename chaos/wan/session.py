"""Emulated regions for a run's lifetime, and what crossed their links.

Shared by ``ddiloco run --regions`` (:mod:`ddiloco.localrun`), the chaos runner
(:mod:`ddiloco.chaos.runner`) and ``bench/wan.py``: the run's tag (:func:`regions_tag`),
building the regions and placing the workers in them (:func:`enter_regions`), the link byte
counters before and after a mode (:func:`wan_counters`, :func:`wan_traffic`) and their table
(:func:`link_bytes_table`).
"""

from __future__ import annotations

import hashlib
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ddiloco.store.base import ParameterStore
from ddiloco.workers.run.config import Config

LINK_CHECK_S = 0.3
"""Length of each link's pre-run check transfer at its asked rate, seconds (plus 8 RTTs)."""


def regions_tag(run_id: str) -> str:
    """The tag naming everything a run's regions create (``ddl-<tag>-<region>`` namespaces,
    the host's ``ddlh-<tag>`` link, ``/run/ddiloco-*-<tag>*`` files): the first 8 hex digits
    of the SHA-1 of the run id, as names are capped at 15 bytes (Linux interface names)."""
    return hashlib.sha1(run_id.encode()).hexdigest()[:8]


def enter_regions(stack: ExitStack, path: Path, cfg: Config, run_id: str) -> tuple[
        Any, dict[str, tuple[list[str], str | None]], dict[str, Any]]:
    """Build the topology's regions for the run's lifetime under :func:`regions_tag` of
    ``run_id``, measure every link (printed, and kept as ``regions.link_checks`` for the
    report); returns the regions, each worker's placement and the embedded Redis's placement.
    Workers in no region run in this machine's own namespace, attached to the regions' bridge.

    What an earlier, killed incarnation of the same run left under its tag is removed first
    (a resumed run gets the same tag)."""
    from rich.console import Console

    from ddiloco.chaos.wan.netns import cleanup_leftovers
    from ddiloco.chaos.wan.regions import Regions
    from ddiloco.chaos.wan.regions_cli import links_table
    from ddiloco.chaos.wan.topology import load_topology

    topo = load_topology(path)
    tag = regions_tag(run_id)
    stale = cleanup_leftovers(tag)
    if stale:
        Console().print(f"removed {len(stale)} namespace(s) an earlier run {run_id} left: "
                        f"{' '.join(stale)}")
    wan = stack.enter_context(Regions(topo, tag))
    Console().print(f"regions of {topo.name} up under tag {tag} (ddiloco regions down "
                    f"--tag {tag} removes them after a crash)")
    host = wan.attach_host()
    # Before the run: every link, a short bounded transfer each, asked vs achieved.
    wan.link_checks = wan.check_links(seconds=LINK_CHECK_S)
    Console().print(links_table(wan.link_checks, f"{topo.name}: links before the run"))
    names = ([f"shard-{s}" for s in range(cfg.run.shards)] + ["evaluator"]
             + [f"learner-{m}" for m in range(cfg.run.learners)])
    placement: dict[str, tuple[list[str], str | None]] = {}
    for name in names:
        region = topo.workers.get(name)
        placement[name] = ((wan.exec_prefix(region), wan.address(region)) if region
                           else ([], host))
    region = topo.workers.get("redis")
    redis_at = ({"bind": wan.address(region), "prefix": wan.exec_prefix(region)} if region
                else {"bind": host})
    return wan, placement, redis_at


def wan_counters(wan: Any) -> dict[str, Any]:
    """The regions' byte counters now: ``tx`` (each region's eth0, Ethernet headers included)
    and ``links`` (each link's HTB class, :meth:`ddiloco.chaos.wan.regions.Regions.link_bytes`);
    {} without regions."""
    if wan is None:
        return {}
    return {"tx": {r: wan.interface_bytes(r)["tx_bytes"] for r in wan.topology.regions},
            "links": wan.link_bytes()}


def wan_traffic(wan: Any, store: ParameterStore, before: dict[str, Any]) -> dict[str, Any]:
    """What crossed the regions since ``before`` (:func:`wan_counters`), for a mode's report:
    ``region_tx_bytes`` per region and ``link_bytes``, per link its counter against the
    application bytes the learners counted between workers of its two regions
    (:func:`ddiloco.chaos.wan.topology.link_traffic`; a link is ``within_margin`` when they agree
    within :data:`ddiloco.chaos.wan.topology.LINK_OVERHEAD_SHARE` and
    :data:`ddiloco.chaos.wan.topology.LINK_SLACK_BYTES`)."""
    from ddiloco.chaos.wan.topology import link_traffic

    after = wan_counters(wan)
    links = {k: n - before["links"].get(k, 0) for k, n in after["links"].items()}
    rows = link_traffic(wan.topology.workers, store.wire_peers(), links)
    return {"region_tx_bytes": {r: n - before["tx"][r] for r, n in after["tx"].items()},
            "link_bytes": [row.to_json() for row in rows]}


def link_bytes_table(rows: list[dict[str, Any]], title: str) -> Any:
    """A rich table of :func:`wan_traffic`'s ``link_bytes`` rows (links that carried
    something)."""
    from rich.table import Table

    t = Table(title=title)
    for col in ("link", "application bytes", "link bytes", "overhead", "within margin"):
        t.add_column(col, justify="left" if col == "link" else "right")
    for r in rows:
        if r["app_bytes"] or r["link_bytes"]:
            ov = r["overhead"]
            t.add_row(f"{r['src']} -> {r['dst']}", f"{r['app_bytes']:,}", f"{r['link_bytes']:,}",
                      "" if ov is None else f"{ov:+.1%}", "yes" if r["within_margin"] else "NO")
    return t
