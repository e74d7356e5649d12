"""The pure parts of bench/cluster (the emulated-cluster benchmark): parameters,
the address plan, the tc and ip command lines, which namespaces count as a
run's leftovers, the kind table, the numpy reference for the 16-bit averages
and the report. Nothing here needs root or torch, or creates a namespace."""
from __future__ import annotations

import ipaddress
import json
import os
import sys

import numpy as np

import pytest

_BENCH = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "bench")
if not os.path.isdir(os.path.join(_BENCH, "cluster")):
    # the sdist ships tests/ but not bench/
    pytest.skip("bench/cluster is not in this tree", allow_module_level=True)
sys.path.insert(0, _BENCH)

import allreduce_procs as procs  # noqa: E402
from cluster import net, params, plan, report, shaping  # noqa: E402


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
    assert d.kinds == ("ddpwire-star", "ddpwire-mesh", "ddpwire-bf16", "gloo")
    p = params.ClusterParams.from_env({"DDPWIRE_CLUSTER_KINDS": " ddpwire-fp16 ,ddpwire-mesh,"})
    assert p.kinds == ("ddpwire-fp16", "ddpwire-mesh")
    assert d.congestion is None
    assert params.ClusterParams.from_env({"DDPWIRE_CLUSTER_TCP": " cubic "}).congestion == "cubic"


@pytest.mark.parametrize("env", [
    {"DDPWIRE_CLUSTER_SIZES": "0"}, {"DDPWIRE_CLUSTER_SIZES": "x"},
    {"DDPWIRE_CLUSTER_WORKERS": ""}, {"DDPWIRE_CLUSTER_ROUNDS": "0"},
    {"DDPWIRE_CLUSTER_KINDS": "ddpwire,nccl"}, {"DDPWIRE_CLUSTER_WORKER_RATE": "fast"},
    {"DDPWIRE_CLUSTER_TCP": "cubic; reboot"}, {"DDPWIRE_CLUSTER_TCP": "Cubic"},
    {"DDPWIRE_CLUSTER_KINDS": ","},
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


def test_setup_commands_set_every_machines_congestion_control_inside_it():
    p = plan.make_plan(2, 10**9, 10**9, congestion="cubic")
    sysctls = [c for c in net.setup_commands(p) if "sysctl" in c]
    assert sysctls == [net.exec_prefix(m.netns) + [
        "sysctl", "-q", "-w", "net.ipv4.tcp_congestion_control=cubic"] for m in p.machines]
    with pytest.raises(ValueError):
        plan.make_plan(2, 10**9, 10**9, congestion="cubic -w kernel.x=1")
    # a refused sysctl says what to allow on the host; other commands get no hint
    assert "tcp_allowed_congestion_control: add cubic there" in net._hint(sysctls[0])
    assert net._hint(net.setup_commands(p)[0]) == ""


def test_why_unavailable_names_a_reason_or_none():
    reason = net.why_unavailable()
    assert reason is None or isinstance(reason, str) and reason


# ---- the kind table ----

def test_kind_table_rows():
    k = procs.DDPWIRE_KINDS
    # the baseline kinds too: they import $DDPWIRE_BASELINE's checkout
    assert set(params.KINDS) == set(k) | {"gloo"}
    assert k["ddpwire-bf16-baseline"].baseline and k["ddpwire-bf16-baseline"].compression == "bf16"
    assert set(params.DEFAULT_KINDS) <= set(params.KINDS)
    # "ddpwire" stays the library's default: no topology, no compression passed
    assert "topology" not in k["ddpwire"].coordinator and k["ddpwire"].topology == "auto"
    assert k["ddpwire"].compression is None and k["ddpwire"].bytes_per_element == 4
    assert k["ddpwire-star"].coordinator["topology"] == "star"
    assert k["ddpwire-mesh"].topology == "mesh" and k["ddpwire-mesh"].compression is None
    for name, fmt in (("ddpwire-bf16", "bf16"), ("ddpwire-fp16", "fp16")):
        assert k[name].topology == "mesh" and k[name].compression == fmt
        assert k[name].bytes_per_element == 2
    # workers take no new argument for any of these
    for spec in k.values():
        assert not {"topology", "compression"} & set(spec.worker)
    assert not k["ddpwire-classic"].pipelined and k["ddpwire-baseline"].baseline
    with pytest.raises(ValueError, match="nccl"):
        procs.ddpwire_kind("nccl")


def test_construct_names_a_parameter_this_ddpwire_lacks():
    def coordinator(bind, *, timeout=1.0, socket_threads=None):
        return (bind, timeout, socket_threads)

    assert procs._construct("k", "C", coordinator, {"socket_threads": True}, bind=1) == \
        (1, 1.0, True)
    with pytest.raises(TypeError, match=r"kind 'ddpwire-mesh' needs C\(topology=\.\.\.\)"):
        procs._construct("ddpwire-mesh", "C", coordinator, {"topology": "mesh"}, bind=1)


# ---- 16-bit rounding and the expected compressed average ----

def _f32(bits: int) -> np.float32:
    return np.array([bits], dtype=np.uint32).view(np.float32)[0]


@pytest.mark.parametrize("value,bits", [
    (1.0, 0x3F80), (-2.0, 0xC000), (0.0, 0x0000), (-0.0, 0x8000),
    # 1 + 2**-8 is halfway between 1 and 1 + 2**-7: ties go to the even 1
    (1 + 2**-8, 0x3F80),
    # 1 + 3 * 2**-8 is halfway between 1 + 2**-7 and 1 + 2**-6: up to the even one
    (1 + 3 * 2**-8, 0x3F82),
    # just above the tie rounds up
    (1 + 2**-8 + 2**-20, 0x3F81),
    (float("inf"), 0x7F80), (float("-inf"), 0xFF80),
    # float32's largest rounds past bf16's largest, to inf
    (float(np.finfo(np.float32).max), 0x7F80),
    # bf16's largest itself stays
    (float(_f32(0x7F7F0000)), 0x7F7F),
    # the smallest float32 subnormal is below half of bf16's: to zero
    (float(_f32(0x00000001)), 0x0000),
])
def test_bf16_rounding(value, bits):
    assert int(procs.bf16_bits(np.array([value], dtype=np.float32))[0]) == bits


def test_bf16_nan_stays_nan():
    # payloads whose rounding add would carry into the exponent (or wrap)
    nans = np.array([0x7FC00000, 0x7FFFFFFF, 0xFFFFFFFF, 0x7F800001], dtype=np.uint32)
    widened = procs.bf16_widen(procs.bf16_bits(nans.view(np.float32)))
    assert np.isnan(widened).all()
    assert (np.signbit(widened) == [False, False, True, False]).all()


def test_round_half_fp16_and_refusal():
    x = np.array([1 + 2**-11, 1 + 3 * 2**-11, 65520.0, 1e-8], dtype=np.float32)
    # ties to even at fp16's 10-bit mantissa, overflow to inf, underflow to zero
    assert procs.round_half(x, "fp16").tolist() == [1.0, 1 + 2**-9, float("inf"), 0.0]
    with pytest.raises(ValueError):
        procs.round_half(x, "int8")


def test_expected_compressed_average_by_hand():
    a = np.array([1.0, 1 + 2**-8, 3.0], dtype=np.float32)
    b = np.array([2.0, 1.0, 1 + 2**-7], dtype=np.float32)
    c = np.array([4.0, 1.0, 0.0], dtype=np.float32)
    got = procs.expected_compressed_average([a, b, c], "bf16")
    # element 1: 1 + 2**-8 rounds to 1 before the sum, so the average is exactly 1;
    # element 0: 7/3 in float32, then to bf16's 2.328125 (0x4015)
    assert got[1] == 1.0
    assert int(procs.bf16_bits(got)[0]) == 0x4015 and got[0] == np.float32(2.328125)
    # element 2: 3 + (1 + 2**-7) = 4.0078125, / 3 = 1.3359375 exactly in bf16
    assert got[2] == np.float32(1.3359375)
    assert got.dtype == np.float32


def test_expected_compressed_average_sums_in_worker_order():
    # (256 + 2**-30) + -256 is 0 in float32, where the exact sum (or worker 0
    # plus worker 2 first) keeps 2**-30: the reference must add 0, 1, 2 in turn
    ws = [np.array([v], dtype=np.float32) for v in (256.0, 2.0**-30, -256.0)]
    for fmt in ("bf16", "fp16"):
        got = procs.expected_compressed_average(ws, fmt)
        assert got.view(np.uint32)[0] == 0, (fmt, got)
    swapped = procs.expected_compressed_average([ws[0], ws[2], ws[1]], "bf16")
    assert swapped[0] == procs.round_half(np.float32([2.0**-30]) / np.float32(3), "bf16")[0] > 0


def test_compressed_check_accepts_the_reference_and_refuses_one_ulp_off():
    n, count = 3, 4096
    for fmt in ("bf16", "fp16"):
        ref = procs.expected_compressed_average(
            [procs.spread_gradients(r, count) for r in range(n)], fmt)
        ok = procs.compressed_check(ref.copy(), n, fmt)
        assert ok["average_ok"]
        # the error of a 16-bit average is nonzero and well below one percent of the scale
        assert 0 < ok["relative_error"] < 1e-2 and ok["max_abs_error"] > 0
        off = ref.copy()
        off.view(np.uint32)[7] += 1
        assert not procs.compressed_check(off, n, fmt)["average_ok"]
    # bf16 keeps 8 significant bits, fp16 11: bf16's error is the larger
    bf = procs.compressed_check(procs.expected_compressed_average(
        [procs.spread_gradients(r, count) for r in range(n)], "bf16"), n, "bf16")
    fp = procs.compressed_check(procs.expected_compressed_average(
        [procs.spread_gradients(r, count) for r in range(n)], "fp16"), n, "fp16")
    assert bf["relative_error"] > fp["relative_error"]


def test_kind_gradients_follow_compression():
    star, bf16 = procs.DDPWIRE_KINDS["ddpwire-star"], procs.DDPWIRE_KINDS["ddpwire-bf16"]
    assert np.array_equal(procs.kind_gradients(star, 1, 10), procs.worker_gradients(1, 10))
    assert np.array_equal(procs.kind_gradients(bf16, 1, 10), procs.spread_gradients(1, 10))
    avg = (procs.worker_gradients(0, 10) + procs.worker_gradients(1, 10)) / np.float32(2)
    assert procs.check_kind_average(star, avg, 2) == {"average_ok": True}
    assert procs.check_kind_average(star, avg + np.float32(0.5), 2) == {"average_ok": False}


# ---- link figures and the report ----

def test_link_figures():
    s = 16 << 20
    star = report.link_figures("star", 4, 4, s, 1.0, 10**9, 10**9)
    assert star == {"coord_link_bytes_each_way": 4 * s,
                    "coord_link_utilisation": 4 * s * 8 / 10**9}
    assert "coord_link_bytes_each_way" in report.link_figures("auto", 4, 2, s, 1.0, 1, 1)
    mesh = report.link_figures("mesh", 4, 4, s, 0.5, 10**10, 10**9)
    assert mesh["worker_link_bytes_each_way"] == 2 * 3 * s // 4
    assert mesh["worker_link_utilisation"] == 2 * 3 * s // 4 * 8 / 0.5 / 10**9
    # 16-bit elements halve the bytes; gloo's ring moves what the float32 mesh does
    assert report.link_figures("mesh", 2, 4, s, 1, 1, 1)["worker_link_bytes_each_way"] == 3 * s // 4
    assert report.link_figures("ring", 4, 2, s, 1, 1, 1)["worker_link_bytes_each_way"] == s
    # a fifth through the coordinator: each worker link 0.75·0.8·2 + 0.2 = 1.4
    # vectors, the coordinator's link 4·0.2 = 0.8
    shared = report.link_figures("mesh", 4, 4, s, 1.0, 10**9, 10**9, share=0.2)
    assert shared["worker_link_bytes_each_way"] == int(1.4 * s)
    assert shared["coord_link_bytes_each_way"] == int(0.8 * s)
    assert shared["coord_link_utilisation"] == pytest.approx(0.8 * s * 8 / 10**9)


def test_mesh_floor():
    s = 64 << 20
    t = s * 8 / 10**9
    assert report.mesh_floor(4, s, 10**9, 10**9, 0.0) == pytest.approx(report.ring_floor(4, s, 10**9))
    # 1/(N+1) on equal links: the floor (2N-1)/(N+1), 1.4 vectors at 4 workers
    assert report.mesh_floor(4, s, 10**9, 10**9, 0.2) == pytest.approx(1.4 * t)
    # a slow coordinator link makes its part the bottleneck of the reduce-scatter
    assert report.mesh_floor(4, s, 10**8, 10**9, 0.2) == pytest.approx(8 * t + 0.6 * t)


def _info(kind, n, median, **extra):
    size = 16 << 20
    d = {"kind": kind, "workers": n, "size_bytes": size, "step_span_median": median,
         "rounds": 3, "warmup": 1, "coord_rate_bps": 10**9, "worker_rate_bps": 10**9}
    d.update(extra)
    return d


def test_report_table(tmp_path):
    infos = [
        _info("tcp", 1, 0.14, goodput_bps=9.59e8, shaping_accuracy=0.959),
        _info("gloo", 2, 0.150),
        _info("ddpwire-star", 2, 0.300, topology="star", compression=None),
        _info("ddpwire-bf16", 2, 0.075, topology="mesh", compression="bf16",
              max_abs_error=0.0061, relative_error=0.003),
        _info("ddpwire-mesh", 2, 0.145, topology="mesh", compression=None),
        _info("ddpwire-new", 2, 0.2, topology="mesh", compression=None),
        _info("ddpwire-star", 4, 0.600, topology="star", compression=None),
    ]
    path = tmp_path / "run.json"
    path.write_text(json.dumps({"commit_info": {"id": "abcdef123", "dirty": True},
                                "benchmarks": [{"extra_info": i} for i in infos]}))
    text = report.table(str(path))
    assert "commit abcdef1 (dirty)" in text and "| 16 MiB | 140 | 959 | 95.9% |" in text
    rows = [line for line in text.splitlines() if line.startswith("| 2 |") or
            line.startswith("| 4 |")]
    # the table's order, then kinds it does not know rather than dropping them
    assert [r.split(" | ")[1] for r in rows] == [
        "ddpwire-star", "ddpwire-mesh", "ddpwire-bf16", "gloo", "ddpwire-new", "ddpwire-star"]
    star, mesh, bf16, gloo, _, star4 = rows
    # star: 2·16 MiB through the coordinator's 1 Gbit/s in 0.3 s; floor 2·16 MiB at 1 Gbit/s
    assert star == "| 2 | ddpwire-star | 300 | 2.00x | 89% | 45% | 268 | – | – |"
    # mesh: 16 MiB each way per worker at N=2; floor = the ring's
    assert mesh == "| 2 | ddpwire-mesh | 145 | 0.97x | – | 93% | 134 | – | – |"
    assert bf16 == "| 2 | ddpwire-bf16 | 75 | 0.50x | – | 89% | 67 | 0.0061 | 3.00e-03 |"
    assert gloo == "| 2 | gloo | 150 | – | – | 89% | 134 | – | – |"
    # no gloo at N=4 in this file: no ratio
    assert star4.split(" | ")[3] == "–"
    assert report.main(["report.py"]) == 2


def test_the_ddp_step_model_has_the_parameters_it_says():
    import ddp_step
    count = ddp_step.parameter_count()
    assert 15_000_000 < count < 16_500_000  # the 16M-parameter DDP script
    torch = pytest.importorskip("torch")
    assert sum(p.numel() for p in ddp_step._model().parameters()) == count
    assert torch.get_default_dtype() == torch.float32


def test_every_node_target_is_a_body_of_its_module():
    sys.path.insert(0, os.path.join(_BENCH, "cluster"))
    try:
        import node
    finally:
        sys.path.remove(os.path.join(_BENCH, "cluster"))
    for name, module in node.TARGETS.items():
        assert callable(getattr(module, name)), name


def test_ddp_report_table(tmp_path):
    sys.path.insert(0, os.path.join(_BENCH, "cluster"))
    try:
        import report_ddp
    finally:
        sys.path.remove(os.path.join(_BENCH, "cluster"))

    def bench(kind, n, spans):
        return {"extra_info": {"kind": kind, "workers": n, "step_spans": spans,
                               "worker_rate_bps": 10**9}}
    path = tmp_path / "ddp.json"
    path.write_text(json.dumps({"commit_info": {"id": "abcdef0123", "dirty": False}, "benchmarks": [
        bench("ddp-gloo", 4, [1.0, 0.9, 1.1]), bench("ddp-ddpwire", 4, [0.95, 0.9, 0.99]),
        bench("ddp-ddpwire-bf16", 4, [0.5, 0.6, 0.55]), bench("ddp-gloo", 2, [0.7])]}))
    text = report_ddp.table(str(path))
    assert "commit abcdef0, links 1 Gbit/s" in text
    assert "| 4 | 1000 | 950 | 0.95x | 550 | 0.55x |" in text
    assert "| 2 | 700 | – | – | – | – |" in text


def _cluster_module(name):
    sys.path.insert(0, os.path.join(_BENCH, "cluster"))
    try:
        return __import__(name)
    finally:
        sys.path.remove(os.path.join(_BENCH, "cluster"))


def test_diloco_report_table_verdict_and_plot(tmp_path):
    import xml.dom.minidom

    report_diloco = _cluster_module("report_diloco")

    def bench(label, n, loss, tx, wall, averages):
        curve = [{"step": 0, "time_s": 0.0, "held_out_loss": 5.5},
                 {"step": 50, "time_s": wall / 2, "held_out_loss": loss + 0.3},
                 {"step": 100, "time_s": wall, "held_out_loss": loss}]
        return {"extra_info": {"label": label, "workers": n, "held_out_loss": loss,
                               "tx_bytes": [tx, tx + 2], "wall_s": wall, "averages": averages,
                               "vector_bytes": averages * 4 * 1000, "curve": curve,
                               "worker_rate_bps": 10**8, "steps": 100, "batch_per_rank": 64,
                               "parameters": 1000}}
    data = {"commit_info": {"id": "abcdef0123", "dirty": False}, "benchmarks": [
        bench("sync", 2, 2.0, 1000001, 60.0, 100), bench("H10", 2, 2.02, 100001, 12.0, 10),
        bench("H50", 2, 2.1, 20001, 10.0, 2), bench("H50-m0.5", 2, 2.04, 20001, 9.0, 2)]}
    path = tmp_path / "diloco.json"
    path.write_text(json.dumps(data))
    text = report_diloco.table(str(path))
    assert "commit abcdef0, links 100 Mbit/s, 100 inner steps" in text
    assert ("| DiLoCo H=10 (momentum 0.9) | 2 | 10 | 2.0200 | 1.010 | 0.10 | 10.0x | 0.04 | "
            "12.0 | 5.0x |") in text
    assert ("N=2, DiLoCo H=50 (momentum 0.9): loss 1.050 of sync (missed: at most 1.03), "
            "50.0x fewer bytes (met: at least 40x), 6.0x less wall time (met: at least 5x)") in text
    assert ("N=2, DiLoCo H=50, momentum 0.5: loss 1.020 of sync (met: at most 1.03), 50.0x "
            "fewer bytes (met: at least 40x), 6.7x less wall time (met: at least 5x)") in text
    svg = report_diloco.render(data)
    xml.dom.minidom.parseString(svg)
    assert svg.count("<polyline") == 4


def test_diloco_rank_model_and_held_out_files():
    diloco_rank = _cluster_module("diloco_rank")
    train, held, about = diloco_rank.corpus(200_000)
    assert len(train) + len(held) == 200_000 and about["train_bytes"] == len(train)
    assert diloco_rank.corpus(200_000)[2]["sha256"] == about["sha256"]
    torch = pytest.importorskip("torch")
    assert diloco_rank.parameter_count() < 1_000_000
    assert sum(p.numel() for p in diloco_rank.model(torch).parameters()) == \
        diloco_rank.parameter_count()
