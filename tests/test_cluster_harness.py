"""The pure parts of bench/cluster (the emulated-cluster benchmark): parameters,
the address plan, the tc and ip command lines and which namespaces count as a
run's leftovers. Nothing here needs root or creates a namespace."""
from __future__ import annotations

import ipaddress
import os
import sys

import pytest

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if not os.path.isdir(os.path.join(_BENCH, "cluster")):
    # the sdist ships tests/ but not bench/
    pytest.skip("bench/cluster is not in this tree", allow_module_level=True)
sys.path.insert(0, _BENCH)

from cluster import net, params, plan, shaping  # noqa: E402


@pytest.mark.parametrize("text,bits", [
    ("1gbit", 10**9), ("10gbit", 10**10), ("500mbit", 5 * 10**8), ("2.5GBIT", 2_500_000_000),
    ("1000000", 10**6), (" 1 gbit ", 10**9),
])
def test_parse_rate(text, bits):
    assert params.parse_rate(text) == bits


@pytest.mark.parametrize("text", ["", "gbit", "1gbps", "1 gib", "-1gbit", "10kbit", "1e9"])
def test_parse_rate_refuses(text):
    with pytest.raises(ValueError):
        params.parse_rate(text)


def test_params_defaults_and_env():
    assert params.ClusterParams.from_env({}) == params.ClusterParams()
    d = params.ClusterParams()
    assert (d.sizes_mib, d.workers, d.coord_rate, d.worker_rate) == ((16, 64), (2, 4), 10**9, 10**9)
    p = params.ClusterParams.from_env({
        "DDPWIRE_CLUSTER_SIZES": "16", "DDPWIRE_CLUSTER_WORKERS": "2,3,4",
        "DDPWIRE_CLUSTER_COORD_RATE": "10gbit", "DDPWIRE_CLUSTER_ROUNDS": "5",
        "DDPWIRE_CLUSTER_KINDS": "ddpwire,gloo"})
    assert p.sizes_mib == (16,) and p.workers == (2, 3, 4) and p.max_workers == 4
    assert p.coord_rate == 10**10 and p.worker_rate == 10**9 and p.rounds == 5
    assert p.kinds == ("ddpwire", "gloo")


@pytest.mark.parametrize("env", [
    {"DDPWIRE_CLUSTER_SIZES": "0"}, {"DDPWIRE_CLUSTER_SIZES": "x"},
    {"DDPWIRE_CLUSTER_WORKERS": ""}, {"DDPWIRE_CLUSTER_ROUNDS": "0"},
    {"DDPWIRE_CLUSTER_KINDS": "ddpwire,nccl"}, {"DDPWIRE_CLUSTER_WORKER_RATE": "fast"},
])
def test_params_refuse(env):
    with pytest.raises(ValueError):
        params.ClusterParams.from_env(env)


def test_plan_names_and_addresses():
    p = plan.make_plan(4, 10**10, 10**9)
    assert p.coordinator.netns == "ddpw-c" and p.coordinator.rate == 10**10
    assert [w.netns for w in p.workers] == ["ddpw-w0", "ddpw-w1", "ddpw-w2", "ddpw-w3"]
    assert all(w.rate == 10**9 for w in p.workers)
    addrs = [m.address for m in p.machines]
    assert len(set(addrs)) == len(addrs)
    subnet = ipaddress.ip_network(plan.SUBNET)
    assert all(ipaddress.ip_address(a) in subnet for a in addrs)
    # no machine takes the network or broadcast address
    assert not {str(subnet.network_address), str(subnet.broadcast_address)} & set(addrs)
    assert p.namespaces[-1] == "ddpw-br"
    assert len({m.port for m in p.machines}) == len(p.machines)


def test_plan_limits():
    with pytest.raises(ValueError):
        plan.make_plan(0, 10**9, 10**9)
    with pytest.raises(ValueError):
        plan.make_plan(250, 10**9, 10**9)
    with pytest.raises(ValueError):
        plan.make_plan(2, 10**9, 10**9, prefix="bad prefix")


@pytest.mark.parametrize("name,ours", [
    ("ddpw-c", True), ("ddpw-br", True), ("ddpw-w0", True), ("ddpw-w12", True),
    ("ddpw-w", False), ("ddpw-wx", False), ("ddpw-c2", False), ("ddpw-other", False),
    ("xddpw-c", False), ("ddpw-c ", False), ("ddpw", False), ("other-c", False),
])
def test_leftover_matching(name, ours):
    assert plan.is_ours(name) is ours


def test_leftover_matching_other_prefix():
    assert plan.is_ours("t1-w3", prefix="t1") and not plan.is_ours("ddpw-w3", prefix="t1")


def test_tbf_burst():
    # 1 ms at the rate, never below 64 KiB
    assert shaping.burst_bytes(10**9) == 125_000
    assert shaping.burst_bytes(10**10) == 1_250_000
    assert shaping.burst_bytes(10**8) == 64 * 1024


def test_tbf_command():
    assert shaping.tbf_command("ddpw-w0", "eth0", 10**9) == [
        "tc", "-n", "ddpw-w0", "qdisc", "replace", "dev", "eth0", "root", "tbf",
        "rate", "1000000000bit", "burst", "125000", "latency", f"{shaping.LATENCY_MS}ms"]


def test_setup_commands_shape_both_directions_of_every_link():
    p = plan.make_plan(2, 10**10, 10**9)
    cmds = net.setup_commands(p)
    tbf = [c for c in cmds if c[0] == "tc"]
    # one qdisc on each end of each pair: the machine's eth0 and its bridge port
    assert len(tbf) == 2 * len(p.machines)
    for m in p.machines:
        assert shaping.tbf_command(m.netns, plan.MACHINE_IF, m.rate) in tbf
        assert shaping.tbf_command(p.bridge_netns, m.port, m.rate) in tbf
    # every namespace is created before anything refers to it
    adds = [c[3] for c in cmds if c[:3] == ["ip", "netns", "add"]]
    assert adds == [p.bridge_netns] + [m.netns for m in p.machines]
    assert all(c[:3] == ["ip", "netns", "add"] for c in cmds[:len(adds)])
    # nothing acts on the root namespace: every other ip/tc call names a namespace of the plan
    for c in cmds[len(adds):]:
        assert c[1] == "-n" and c[2] in p.namespaces, c


def test_why_unavailable_names_a_reason_or_none():
    reason = net.why_unavailable()
    assert reason is None or isinstance(reason, str) and reason
