"""Topologies (pure) and emulated regions (real namespaces, HTB and nftables; needs root).

The kernel tests carry the ``root`` marker: off-root they are skipped with the command that runs
them (tests/conftest.py). As root they fail, not skip, when ``ip``, ``tc`` or ``nft`` is missing:
CI runs them as root with nftables installed.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from ddiloco.chaos.wan import regions as regions_mod
from ddiloco.chaos.wan import regions_cli
from ddiloco.chaos.wan.regions import Regions, RegionsError, cleanup_leftovers
from ddiloco.chaos.wan.topology import (
    LINK_SLACK_BYTES,
    LinkSpec,
    LinkTraffic,
    Topology,
    TopologyError,
    link_traffic,
    load_topology,
    parse_loss,
    parse_rate,
    parse_topology,
)

MBIT = 1e6

EXAMPLE = """\
name: four-regions
defaults: {rate: 100mbit, delay: 0ms, loss: 0%}
regions:
  hub:  {workers: [redis, shard-0, shard-1, evaluator]}
  us:   {workers: [learner-0]}
  eu:   {workers: [learner-1], rate: 100mbit}
  asia: {workers: [learner-2, learner-3], rate: 10mbit, loss: 0.5%}
links:
  - {from: us, to: eu, rate: 50mbit}
"""


def _topo(**fields: Any) -> dict[str, Any]:
    data: dict[str, Any] = {"name": "t", "regions": {"a": {}, "b": {}}}
    data.update(fields)
    return data


def _error(data: Any) -> str:
    with pytest.raises(TopologyError) as info:
        parse_topology(data, "wan.yaml")
    return str(info.value)


# --------------------------------------------------------------------------------------------
# Topology: units, validation, link resolution (pure)
# --------------------------------------------------------------------------------------------


def test_units() -> None:
    assert parse_rate("100mbit") == 100e6
    assert parse_rate("1.5gbit") == 1.5e9
    assert parse_rate("64kbit") == 64e3
    assert parse_rate(2_000_000) == 2e6
    assert parse_rate("5e6") == 5e6
    assert parse_loss("0.5%") == pytest.approx(0.005)
    assert parse_loss("0%") == 0.0
    for bad in ("10 mbps", "fast", True, "-1mbit", "200gbit", 10):
        with pytest.raises(TopologyError):
            parse_rate(bad)
    for bad_loss in (0.5, "0.5", "101%", "-1%"):
        with pytest.raises(TopologyError):
            parse_loss(bad_loss)


def test_example_loads_and_resolves(tmp_path: Path) -> None:
    path = tmp_path / "wan.yaml"
    path.write_text(EXAMPLE)
    topo = load_topology(path)
    assert topo.source == str(path)
    assert list(topo.regions) == ["hub", "us", "eu", "asia"]
    assert topo.region_of("learner-3") == "asia"
    assert topo.region_of("redis") == "hub"
    with pytest.raises(KeyError, match="learner-9"):
        topo.region_of("learner-9")
    # the explicit link, both directions (symmetric)
    assert topo.link("us", "eu") == LinkSpec(rate_bps=50e6, delay_s=0.0, loss=0.0)
    assert topo.link("eu", "us").rate_bps == 50e6
    # neither region sets anything: defaults
    assert topo.link("hub", "us") == LinkSpec(rate_bps=100e6, delay_s=0.0, loss=0.0)
    # only one end sets the rate/loss: that value, whichever end it is
    assert topo.link("hub", "asia") == LinkSpec(rate_bps=10e6, delay_s=0.0, loss=0.005)
    assert topo.link("asia", "hub") == LinkSpec(rate_bps=10e6, delay_s=0.0, loss=0.005)
    # both ends set the rate: the lower one
    assert topo.link("eu", "asia").rate_bps == 10e6
    with pytest.raises(ValueError, match="two different regions"):
        topo.link("us", "us")
    with pytest.raises(KeyError, match="mars"):
        topo.link("us", "mars")
    assert len(topo.pairs()) == 12


def test_resolution_rule_field_by_field() -> None:
    topo = parse_topology(
        {
            "name": "rule",
            "defaults": {"rate": "1mbit", "delay": "5ms", "loss": "1%"},
            "regions": {
                "a": {"rate": "20mbit", "delay": "10ms"},
                "b": {"rate": "30mbit", "loss": "2%"},
                "c": {},
            },
            "links": [{"from": "a", "to": "b", "loss": "7%", "oneway": True}],
        }
    )
    # a -> b: loss from the one-way link; rate: lower of the two regions; delay: only a sets it
    assert topo.link("a", "b") == LinkSpec(rate_bps=20e6, delay_s=0.010, loss=0.07)
    # b -> a: the link is one-way, so loss comes from the regions (only b sets it)
    assert topo.link("b", "a") == LinkSpec(rate_bps=20e6, delay_s=0.010, loss=0.02)
    # c sets nothing: the other end's values, then the defaults
    assert topo.link("c", "a") == LinkSpec(rate_bps=20e6, delay_s=0.010, loss=0.01)
    assert topo.link("b", "c") == LinkSpec(rate_bps=30e6, delay_s=0.005, loss=0.02)
    # no defaults at all: 1 gbit, 0 s, 0 %
    bare = parse_topology(_topo())
    assert bare.link("a", "b") == LinkSpec(rate_bps=1e9, delay_s=0.0, loss=0.0, queue_s=0.25)
    deep = parse_topology({"name": "q", "defaults": {"queue": "500ms"},
                           "regions": {"a": {"queue": "2s"}, "b": {}, "c": {}},
                           "links": [{"from": "b", "to": "c", "queue": 0.1}]})
    assert deep.link("a", "b").queue_s == 2.0  # the deeper end
    assert deep.link("c", "b").queue_s == 0.1  # the link entry
    assert deep.link("c", "a").queue_s == 2.0


@pytest.mark.parametrize(
    ("data", "expected"),
    [
        ([1, 2], "wan.yaml: top level must be a mapping"),
        ({"regions": {"a": {}}}, "wan.yaml: name: required"),
        (_topo(regions={}), "wan.yaml: regions: "),
        (_topo(regions={"Asia": {}}), "wan.yaml: regions.Asia: 'Asia' is not a region name"),
        (_topo(regions={"a" * 13: {}}), "is not a region name"),
        (_topo(regions={"br": {}}), "wan.yaml: regions.br: region name 'br' is reserved"),
        (
            _topo(regions={"a": {"workers": ["w"]}, "b": {"workers": ["v", "w"]}}),
            "wan.yaml: regions.b.workers[1]: worker 'w' is in two regions ('a' and 'b')",
        ),
        (
            _topo(regions={"a": {"workers": ["w", "w"]}}),
            "wan.yaml: regions.a.workers[1]: worker 'w' is listed twice",
        ),
        (_topo(regions={"a": {"workers": [""]}}), "regions.a.workers[0]: a worker name must"),
        (_topo(regions={"a": {"rate": "10 mbps"}}), "wan.yaml: regions.a.rate: '10 mbps' is not"),
        (_topo(regions={"a": {"loss": 0.5}}), "regions.a.loss: 0.5 is not a loss percentage"),
        (_topo(regions={"a": {"delay": "soon"}}), "regions.a.delay: 'soon' is not a delay"),
        (_topo(regions={"a": {"delay": "-1ms"}}), "regions.a.delay: must be >= 0"),
        (_topo(regions={"a": {"delay": "11s"}}), "regions.a.delay: must be <= 10"),
        (_topo(regions={"a": {"queue": "0ms"}}), "regions.a.queue: must be > 0"),
        (_topo(regions={"a": {"speed": 1}}), "wan.yaml: regions.a.speed: unknown key"),
        (_topo(defaults={"rate": "1tbit"}), "wan.yaml: defaults.rate: "),
        (
            _topo(links=[{"from": "a", "to": "mars", "rate": "1mbit"}]),
            "wan.yaml: links[0].to: unknown region 'mars' (one of a, b)",
        ),
        (
            _topo(links=[{"from": "a", "to": "a", "rate": "1mbit"}]),
            "wan.yaml: links[0].to: a link joins two different regions",
        ),
        (
            _topo(links=[{"from": "a", "to": "b"}]),
            "wan.yaml: links[0]: a link entry must set at least one of rate, delay, loss, queue",
        ),
        (
            _topo(
                links=[
                    {"from": "a", "to": "b", "rate": "1mbit", "oneway": True},
                    {"from": "b", "to": "a", "rate": "2mbit"},
                ]
            ),
            "wan.yaml: links[1]: link a -> b is already set by links[0]",
        ),
        (_topo(links=[{"to": "b", "rate": "1mbit"}]), "wan.yaml: links[0].from: required"),
    ],
)
def test_validation_errors(data: Any, expected: str) -> None:
    assert expected in _error(data)


def test_one_way_links_in_both_directions_are_fine() -> None:
    topo = parse_topology(
        _topo(
            links=[
                {"from": "a", "to": "b", "rate": "1mbit", "oneway": True},
                {"from": "b", "to": "a", "rate": "2mbit", "oneway": True},
            ]
        )
    )
    assert (topo.link("a", "b").rate_bps, topo.link("b", "a").rate_bps) == (1e6, 2e6)


def test_load_errors(tmp_path: Path) -> None:
    with pytest.raises(TopologyError, match="cannot read topology"):
        load_topology(tmp_path / "missing.yaml")
    empty = tmp_path / "empty.yaml"
    empty.write_text("")
    with pytest.raises(TopologyError, match="empty topology"):
        load_topology(empty)
    dup = tmp_path / "dup.yaml"
    dup.write_text("name: x\nname: y\nregions: {a: {}}\n")
    with pytest.raises(TopologyError, match="duplicate key"):
        load_topology(dup)
    bad = tmp_path / "bad.yaml"
    bad.write_text("name: x\nregions: {a: {rate: fast}}\n")
    with pytest.raises(TopologyError, match=rf"^{bad}: regions\.a\.rate: 'fast' is not a rate"):
        load_topology(bad)


def test_regions_refuses_bad_tags() -> None:
    topo = parse_topology(_topo())
    with pytest.raises(RegionsError, match="run tag"):
        Regions(topo, tag="Bad-Tag")
    r = Regions(topo, tag="abc")
    assert r.namespace("a") == "ddl-abc-a"
    assert r.bridge_namespace == "ddl-abc-br"
    assert r.exec_prefix("b") == ["ip", "netns", "exec", "ddl-abc-b"]
    assert r.address("a").startswith("10.") and r.address("b").endswith(".2")
    assert r.address("a").rsplit(".", 1)[0] == r.address("b").rsplit(".", 1)[0]
    with pytest.raises(KeyError, match="mars"):
        r.address("mars")


def test_not_root_or_no_tool_is_refused_before_anything(monkeypatch: pytest.MonkeyPatch) -> None:
    topo = parse_topology(_topo())
    monkeypatch.setattr(regions_mod.os, "geteuid", lambda: 1000)
    with pytest.raises(RegionsError, match="need root"):
        Regions(topo, tag="nr").up()
    monkeypatch.setattr(regions_mod.os, "geteuid", lambda: 0)
    real_which = shutil.which
    monkeypatch.setattr(
        regions_mod.shutil, "which", lambda tool: None if tool == "nft" else real_which(tool)
    )
    with pytest.raises(RegionsError, match=r"missing command.*nft"):
        Regions(topo, tag="nn").up()


# --------------------------------------------------------------------------------------------
# Emulated regions (root, ip, tc, nft)
# --------------------------------------------------------------------------------------------

_TAG = f"t{os.getpid() % 100000}"


def _require_kernel_tools() -> None:
    missing = [tool for tool in ("ip", "tc", "nft") if shutil.which(tool) is None]
    if missing:
        pytest.fail(f"region tests need {', '.join(missing)} (install iproute2 and nftables)")


def _left(tag: str) -> list[str]:
    out = subprocess.run(["ip", "netns", "list"], capture_output=True, text=True, check=True)
    return [line for line in out.stdout.splitlines() if line.startswith(f"ddl-{tag}-")]


THREE = {
    "name": "three",
    "defaults": {"rate": "10mbit"},
    "regions": {
        "a": {"workers": ["learner-0"]},
        "b": {"workers": ["learner-1"]},
        "c": {"workers": ["redis"]},
    },
    "links": [
        {"from": "a", "to": "c", "rate": "100mbit"},
        {"from": "b", "to": "c", "loss": "30%", "oneway": True},
    ],
}


@pytest.fixture(scope="module")
def three() -> Iterator[Regions]:
    """a-b at 10 mbit, a-c at 100 mbit, b -> c with 30 % loss."""
    _require_kernel_tools()
    with Regions(parse_topology(THREE, "three"), tag=f"{_TAG}m") as r:
        yield r
    assert _left(r.tag) == []


_UDP_RECV = r"""
import socket, sys
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
s.bind((sys.argv[1], 0))
print(s.getsockname()[1], flush=True)
s.settimeout(1.0)
n = 0
try:
    while True:
        s.recv(64)
        n += 1
except socket.timeout:
    pass
print(n, flush=True)
"""

_UDP_SEND = r"""
import socket, sys, time
s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
for i in range(int(sys.argv[3])):
    s.sendto(b"x" * 32, (sys.argv[1], int(sys.argv[2])))
    if i % 50 == 49:
        time.sleep(0.001)
"""

_TCP_ACCEPT = r"""
import socket, sys
s = socket.socket()
s.bind((sys.argv[1], 0))
s.listen(4)
print(s.getsockname()[1], flush=True)
s.settimeout(float(sys.argv[2]))
try:
    while True:
        s.accept()[0].close()
except socket.timeout:
    pass
"""

_TCP_CONNECT = r"""
import socket, sys
try:
    socket.create_connection((sys.argv[1], int(sys.argv[2])), timeout=float(sys.argv[3])).close()
except OSError:
    sys.exit(3)
"""


def _start(r: Regions, region: str, code: str, *args: str) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [*r.exec_prefix(region), sys.executable, "-c", code, *args],
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout is not None
    return proc, proc.stdout.readline().strip()


def _connects(r: Regions, src: str, dst: str, port: str) -> bool:
    code = subprocess.run(
        [*r.exec_prefix(src), sys.executable, "-c", _TCP_CONNECT, r.address(dst), port, "1.0"],
        timeout=10,
        check=False,
    ).returncode
    return code == 0


@pytest.mark.integration
@pytest.mark.root
@pytest.mark.timeout(60)
def test_rates_are_shaped(three: Regions) -> None:
    slow = three.measure_link("a", "b")  # b -> a, 10 mbit
    fast = three.measure_link("a", "c")  # c -> a, 100 mbit
    print(f"10mbit: {slow}\n100mbit: {fast}")
    assert 7.5 * MBIT <= slow.rate_bps <= 12.5 * MBIT
    assert fast.rate_bps / slow.rate_bps > 3
    assert 0 < slow.rtt_s < 0.05 and 0 < fast.rtt_s < 0.05


@pytest.mark.integration
@pytest.mark.root
@pytest.mark.timeout(60)
def test_loss_drops_a_known_fraction_of_datagrams(three: Regions) -> None:
    sent = 3000
    rates = {}
    for src in ("a", "b"):  # a -> c: no loss; b -> c: 30 %
        recv, port = _start(three, "c", _UDP_RECV, three.address("c"))
        subprocess.run(
            [*three.exec_prefix(src), sys.executable, "-c", _UDP_SEND, three.address("c"), port,
             str(sent)],
            timeout=20, check=True,
        )  # fmt: skip
        out, _ = recv.communicate(timeout=20)
        rates[src] = int(out.strip()) / sent
    print(f"delivered: {rates}")
    assert rates["a"] > 0.99
    assert 0.65 <= rates["b"] <= 0.75  # 0.70 expected; sd of the fraction is 0.008


@pytest.mark.integration
@pytest.mark.root
@pytest.mark.timeout(60)
def test_partition_blocks_tcp_and_heal_restores(three: Regions) -> None:
    server, port = _start(three, "b", _TCP_ACCEPT, three.address("b"), "8.0")
    other, other_port = _start(three, "c", _TCP_ACCEPT, three.address("c"), "8.0")
    try:
        assert _connects(three, "a", "b", port)
        three.partition("a", "b")
        three.partition("b", "a")  # idempotent
        assert not _connects(three, "a", "b", port)
        assert _connects(three, "a", "c", other_port)  # other pairs unaffected
        three.heal("b", "a")
        three.heal("a", "b")  # a no-op
        assert _connects(three, "a", "b", port)
    finally:
        for proc in (server, other):
            proc.kill()
            proc.wait()
    three.partition("a", "c")
    with pytest.raises(RegionsError, match="c -> a"):
        three.measure_link("a", "c", timeout_s=2.0)
    three.heal("a", "c")


@pytest.mark.integration
@pytest.mark.root
@pytest.mark.timeout(60)
def test_interface_counters_count_the_transfer(three: Regions) -> None:
    before_a, before_c = three.interface_bytes("a"), three.interface_bytes("c")
    m = three.measure_link("a", "c", nbytes=2_000_000)
    after_a, after_c = three.interface_bytes("a"), three.interface_bytes("c")
    assert after_a["rx_bytes"] - before_a["rx_bytes"] >= m.nbytes
    assert after_c["tx_bytes"] - before_c["tx_bytes"] >= m.nbytes


@pytest.mark.integration
@pytest.mark.root
@pytest.mark.timeout(60)
def test_link_counters_count_each_link_on_its_own(three: Regions) -> None:
    before = three.link_bytes()
    assert set(before) == set(three.topology.pairs())
    m = three.measure_link("a", "c", nbytes=2_000_000)  # c sends to a; a only acknowledges
    after = three.link_bytes()
    moved = {k: after[k] - before[k] for k in after}
    print(f"link bytes during a 2 MB transfer c -> a: {moved}")
    # The payload plus Ethernet/IP/TCP headers (about 5 % at full-sized frames).
    assert m.nbytes <= moved[("c", "a")] <= 1.08 * m.nbytes + 64 * 1024
    assert 0 < moved[("a", "c")] < 0.05 * m.nbytes  # ACKs and the ping-pongs
    for pair in (("a", "b"), ("b", "a"), ("b", "c"), ("c", "b")):
        assert moved[pair] < 4096, pair  # pairs that took no part (stray ARP at most)


@pytest.mark.integration
@pytest.mark.root
@pytest.mark.timeout(60)
def test_teardown_leaves_nothing_even_after_an_exception() -> None:
    _require_kernel_tools()
    tag = f"{_TAG}x"
    topo = parse_topology(_topo(), "two")
    with pytest.raises(RuntimeError, match="boom"):
        with Regions(topo, tag=tag) as r:
            assert sorted(_left(tag)) == sorted(r.namespaces())
            raise RuntimeError("boom")
    assert _left(tag) == []


@pytest.mark.integration
@pytest.mark.root
@pytest.mark.timeout(60)
def test_failure_half_way_rolls_back(monkeypatch: pytest.MonkeyPatch) -> None:
    _require_kernel_tools()
    tag = f"{_TAG}h"
    r = Regions(parse_topology(_topo(), "two"), tag=tag)

    def fail(region: str) -> None:
        raise RegionsError("shaper failed")

    monkeypatch.setattr(r, "_shape", fail)
    with pytest.raises(RegionsError, match="shaper failed"):
        r.up()
    assert _left(tag) == []


def _require_delay_tools() -> None:
    _require_kernel_tools()
    if shutil.which("iptables") is None:
        pytest.fail("delay tests need the iptables command (apt-get install iptables)")
    if importlib.util.find_spec("netfilterqueue") is None:
        pytest.fail(
            "delay tests need NetfilterQueue: apt-get install libnetfilter-queue-dev, then "
            "pip install -e '.[wan]'"
        )


def _delayers(tag: str) -> list[str]:
    out = subprocess.run(["ps", "-eo", "args"], capture_output=True, text=True, check=True)
    needle = f"ddiloco.chaos.wan.delayer --tag {tag} "
    return [line for line in out.stdout.splitlines() if needle in line]


@pytest.mark.integration
@pytest.mark.root
@pytest.mark.timeout(90)
def test_rate_and_delay_are_both_in_force() -> None:
    _require_delay_tools()
    tag = f"{_TAG}d"
    # a -> b: 30 ms, b -> a: 20 ms (a one-way link entry), so the round trip asked is 50 ms
    topo = parse_topology(
        _topo(
            defaults={"rate": "20mbit", "delay": "20ms"},
            links=[{"from": "a", "to": "b", "delay": "30ms", "oneway": True}],
        ),
        "slow.yaml",
    )
    assert topo.link("a", "b").delay_s == 0.030 and topo.link("b", "a").delay_s == 0.020
    with Regions(topo, tag=tag) as r:
        assert len(_delayers(tag)) == 2
        checks = r.check_links()
    for c in checks:
        print(f"{c.src} -> {c.dst}: asked rtt {c.asked_rtt_s * 1e3:.1f} ms, {c.measured}")
        assert c.asked_rtt_s == pytest.approx(0.050)
        # the delayer releases late by scheduling jitter only; veth and Python add little
        assert 0.050 <= c.measured.rtt_s <= 0.065
        assert 0.75 <= c.ratio <= 1.1
    assert _left(tag) == [] and _delayers(tag) == []
    assert not list(regions_mod.STATE_DIR.glob(f"ddiloco-delayer-{tag}-*"))
    held = {region: s["packets"] for region, s in r.delayer_summaries.items()}
    print(r.delayer_summaries)
    assert held["a"] > 100 and held["b"] > 100  # each side delayed the other's packets


@pytest.mark.integration
@pytest.mark.root
@pytest.mark.timeout(60)
def test_delay_without_its_tools_is_refused_before_anything(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    _require_kernel_tools()
    tag = f"{_TAG}e"
    topo = parse_topology(_topo(regions={"a": {"delay": "20ms"}, "b": {}}), "slow.yaml")
    monkeypatch.setattr(regions_mod.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(RegionsError, match=r"slow\.yaml: a link asks for a delay > 0.*Netfilter"):
        Regions(topo, tag=tag).up()
    real_which = shutil.which
    monkeypatch.setattr(
        regions_mod.shutil, "which", lambda tool: None if tool == "iptables" else real_which(tool)
    )
    with pytest.raises(RegionsError, match="'iptables' command"):
        Regions(topo, tag=tag).up()
    assert _left(tag) == []
    Regions(parse_topology(_topo(defaults={"delay": "0ms"})), tag=tag).down()  # 0 is fine


@pytest.mark.integration
@pytest.mark.root
@pytest.mark.timeout(60)
def test_command_up_status_and_cleanup_leftovers(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], request: pytest.FixtureRequest
) -> None:
    _require_kernel_tools()
    tag = f"{_TAG}c"
    request.addfinalizer(lambda: cleanup_leftovers(tag))
    path = tmp_path / "two.yaml"
    path.write_text("name: two\ndefaults: {rate: 20mbit, delay: 5ms}\nregions: {a: {}, b: {}}\n")
    # `up` measures every link and leaves the regions up, like a crashed run would
    assert regions_cli.regions_command("up", path, tag, True) == 0
    state = json.loads(capsys.readouterr().out)
    assert state["tag"] == tag and set(state["regions"]) == {"a", "b"}
    assert [(c["src"], c["dst"]) for c in state["links"]] == [("a", "b"), ("b", "a")]
    for c in state["links"]:
        print(f"{c['src']} -> {c['dst']}: {c['measured']}")
        assert 0.75 <= c["measured"]["rate_bps"] / c["asked"]["rate_bps"] <= 1.25
        assert c["asked_rtt_s"] == pytest.approx(0.010)
        assert 0.010 <= c["measured"]["rtt_s"] <= 0.025
    assert len(_delayers(tag)) == 2  # the delayers outlive `up`, as the namespaces do
    assert json.loads(regions_mod.STATE_DIR.joinpath(f"ddiloco-regions-{tag}.json").read_text())
    assert regions_cli.regions_command("up", path, tag, False) == 2  # tag in use
    capsys.readouterr()
    assert regions_cli.regions_command("status", None, None, True) == 0
    rows = json.loads(capsys.readouterr().out)["namespaces"]
    mine = {row["name"]: row for row in rows if row["tag"] == tag}
    assert mine["a"]["address"] == state["regions"]["a"]["address"] + "/24"
    assert mine["b"]["tx_bytes"] > 0 and "address" not in mine["br"]
    removed = cleanup_leftovers(tag)
    assert sorted(removed) == [f"ddl-{tag}-{n}" for n in ("a", "b", "br")]
    assert _left(tag) == [] and _delayers(tag) == []
    assert not regions_mod.STATE_DIR.joinpath(f"ddiloco-regions-{tag}.json").exists()
    assert regions_cli.regions_command("up", tmp_path / "missing.yaml", tag, False) == 2
    assert regions_cli.regions_command("up", None, "BAD", False) == 2
    assert regions_cli.regions_command("sideways", None, None, False) == 2
    assert regions_cli.regions_command("down", None, tag, True) == 0
    assert json.loads(capsys.readouterr().out.splitlines()[-1]) == {"removed": []}


def test_link_traffic_sums_worker_pairs_by_region() -> None:
    workers = {"redis": "hub", "shard-0": "hub", "shard-1": "hub", "learner-0": "hub",
               "learner-1": "far", "learner-2": "far", "learner-3": "eu"}
    peer = {
        "learner-1>shard-0": 1000, "learner-1>shard-1": 500, "learner-2>shard-0": 250,
        "shard-0>learner-1": 4000, "redis>learner-1": 3000, "shard-1>learner-2": 100,
        "learner-0>shard-0": 9999,  # both in the hub: crosses no link
        "?>learner-1": 77, "learner-9>shard-0": 5,  # unknown sender, worker in no region
        "learner-3>shard-0": 10,
    }
    links = {("hub", "far"): 7500, ("far", "hub"): 1900, ("hub", "eu"): 0, ("eu", "hub"): 60,
             ("far", "eu"): 0, ("eu", "far"): 0}
    rows = {(r.src, r.dst): r for r in link_traffic(workers, peer, links)}
    assert list(rows) == list(links)
    assert rows[("far", "hub")].app_bytes == 1750  # 1000 + 500 + 250
    assert rows[("hub", "far")].app_bytes == 7100  # 4000 + 3000 + 100
    assert rows[("eu", "hub")].app_bytes == 10 and rows[("hub", "eu")].app_bytes == 0
    assert rows[("far", "hub")].overhead == pytest.approx(1900 / 1750 - 1)
    assert rows[("hub", "eu")].overhead is None
    assert all(r.within_margin for r in rows.values())
    with pytest.raises(ValueError, match="src>dst"):
        link_traffic(workers, {"learner-1": 5}, links)


def test_link_traffic_margin_edges() -> None:
    app = 1_000_000
    hi = int(1.25 * app + LINK_SLACK_BYTES)
    assert LinkTraffic("a", "b", app, hi).within_margin
    assert not LinkTraffic("a", "b", app, hi + 1).within_margin
    assert LinkTraffic("a", "b", app, app - LINK_SLACK_BYTES).within_margin
    assert not LinkTraffic("a", "b", app, app - LINK_SLACK_BYTES - 1).within_margin
    assert LinkTraffic("a", "b", 0, LINK_SLACK_BYTES).to_json() == {
        "src": "a", "dst": "b", "app_bytes": 0, "link_bytes": LINK_SLACK_BYTES,
        "overhead": None, "within_margin": True}


def test_a_runs_regions_tag_comes_from_its_run_id() -> None:
    from ddiloco.chaos.wan.regions import TAG_RE
    from ddiloco.chaos.wan.session import regions_tag

    tag = regions_tag("run-20261123-044005-8a34")
    assert tag == hashlib.sha1(b"run-20261123-044005-8a34").hexdigest()[:8]
    assert TAG_RE.match(tag) and len(f"ddlh-{tag}") <= 15  # a Linux interface name
    assert regions_tag("run-20261123-044005-8a34") == tag != regions_tag("run-x")


def test_topology_type_is_exported() -> None:
    assert isinstance(parse_topology(_topo()), Topology)
