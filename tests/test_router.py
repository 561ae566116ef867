"""A region router's rules (chaos/wan/router.py), computed from a topology; pure."""

from __future__ import annotations

import pytest

from ddiloco.chaos.wan.router import RouterError, loss_ruleset, plan_router, router_commands
from ddiloco.chaos.wan.topology import parse_topology

TOPO = parse_topology({
    "name": "t",
    "defaults": {"rate": "100mbit", "delay": "25ms"},
    "regions": {"hub": {"workers": ["redis", "shard-0"]},
                "a": {"workers": ["learner-0"]},
                "c": {"workers": ["learner-1"], "rate": "10mbit", "loss": "1%"}},
    "links": [{"from": "hub", "to": "c", "delay": "40ms", "oneway": True}],
})
IFACES = {"eth0": "172.28.0.7", "eth1": "172.28.3.2"}


def test_plan_takes_each_direction_from_the_topology() -> None:
    plan = plan_router(TOPO, "c", "hub", IFACES, "172.28.3.0/24", "172.28.0.0/24")
    assert (plan.lan, plan.wan) == ("eth1", "eth0")
    assert (plan.up_rate, plan.up_delay_s, plan.up_loss) == (10e6, 0.025, 0.01)
    # hub -> c: the one-way link entry sets the delay; rate and loss from region c
    assert (plan.down_rate, plan.down_delay_s, plan.down_loss) == (10e6, 0.040, 0.01)
    # 250 ms of buffer at 10 Mbit/s = 312,500 bytes
    assert plan.up_queue_bytes == 312_500
    assert plan.delays == {"172.28.3.0/24": 0.025, "172.28.0.0/24": 0.040}


def test_commands_shape_both_egresses_nat_and_queue() -> None:
    plan = plan_router(TOPO, "a", "hub", IFACES | {"eth1": "172.28.1.2"}, "172.28.1.0/24",
                       "172.28.0.0/24")
    cmds = [" ".join(c) for c in router_commands(plan)]
    assert cmds[0] == "iptables -w -t nat -A POSTROUTING -o eth0 -j MASQUERADE"
    assert "tc class add dev eth0 parent 1: classid 1:1 htb rate 100000000bit " \
           "ceil 100000000bit" in cmds
    assert "tc class add dev eth1 parent 1: classid 1:1 htb rate 100000000bit " \
           "ceil 100000000bit" in cmds
    assert cmds[-1] == "iptables -w -A FORWARD -j NFQUEUE --queue-num 0"
    assert loss_ruleset(plan) is None  # region a has no loss


def test_loss_rules_per_direction() -> None:
    plan = plan_router(TOPO, "c", "hub", IFACES, "172.28.3.0/24", "172.28.0.0/24")
    rules = loss_ruleset(plan)
    assert rules is not None
    assert 'iifname "eth1" oifname "eth0" numgen random mod 1000000 < 10000 drop' in rules
    assert 'iifname "eth0" oifname "eth1" numgen random mod 1000000 < 10000 drop' in rules


def test_bad_plans_are_named() -> None:
    with pytest.raises(RouterError, match="no region 'x'"):
        plan_router(TOPO, "x", "hub", IFACES, "172.28.3.0/24", "172.28.0.0/24")
    with pytest.raises(RouterError, match="is the hub"):
        plan_router(TOPO, "hub", "hub", IFACES, "172.28.3.0/24", "172.28.0.0/24")
    with pytest.raises(RouterError, match=r"one interface in 172\.28\.9\.0/24"):
        plan_router(TOPO, "c", "hub", IFACES, "172.28.9.0/24", "172.28.0.0/24")
