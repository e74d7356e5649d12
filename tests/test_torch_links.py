"""The torch backend's rank-to-rank links (ddpwire/plane/rank_links.py): DDP's
buckets reduce-scattered and allgathered between the ranks, with the bits
the service computes, and a group that keeps to the service, never hangs,
when the links cannot open."""
from __future__ import annotations

import logging
import os
import signal
import socket
import threading
import time
from pathlib import Path

import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ddpwire.plane.collectives import CollectiveAborted, Op  # noqa: E402
from ddpwire.plane import rank_links as _links  # noqa: E402

import test_torch_backend as tb  # noqa: E402
# the fake set-up collectives: shared with tests/test_flat_matrix.py
from rank_group import form_all as _form_all, loopback as _loopback  # noqa: E402
from session_helpers import reference_allreduce  # noqa: E402

# loopback ranks on the links: no shared memory, every float32 bucket large
# enough; or through the service, every bucket too small for the links
ON_LINKS = {"DDPWIRE_SHM": "0", "DDPWIRE_LINKS_MIN_BYTES": "4"}
ON_SERVICE = {"DDPWIRE_SHM": "0", "DDPWIRE_LINKS_MIN_BYTES": str(1 << 40)}


def _linked(world, per_rank):
    """form_all's ranks, every one of which must have opened its links."""
    ranks = _form_all(world, per_rank)
    assert all(isinstance(r, _links.RankLinks) for r in ranks), ranks
    return ranks


def _run(tmp_path, label, backend, extra, world=3):
    out = tmp_path / label
    codes, outputs = tb.finish(tb.start_ranks(world, out, [backend, "gloo"], torchrun_env=False,
                                              extra=extra))
    assert codes == [0] * world, "\n".join(outputs)
    return ([tb.load(out, backend, r) for r in range(world)],
            [tb.load(out, "gloo", r) for r in range(world)])


def _params(state):
    return [n for n in state if "running" not in n and "num_batches" not in n]


@pytest.mark.slow
@pytest.mark.parametrize("backend", ["ddpwire", "ddpwire+bf16", "ddpwire+int8"])
def test_ddp_on_the_links_gives_the_services_bits(tmp_path, backend):
    links, gloo = _run(tmp_path, "links", backend, ON_LINKS)
    service, _ = _run(tmp_path, "service", backend, ON_SERVICE)
    assert [r["plane"] for r in links] == ["links"] * 3
    for name in links[0]["state"]:
        for r in range(3):
            assert torch.equal(links[r]["state"][name], service[r]["state"][name]), (name, r)
    tol = {"ddpwire": dict(rtol=1e-5, atol=1e-6), "ddpwire+bf16": dict(rtol=1e-2, atol=2e-3),
           "ddpwire+int8": dict(rtol=5e-2, atol=2e-2)}[backend]
    for name in _params(links[0]["state"]):
        for r in range(1, 3):  # DDP keeps the parameters identical on every rank
            assert torch.equal(links[r]["state"][name], links[0]["state"][name]), (name, r)
        torch.testing.assert_close(links[0]["state"][name], gloo[0]["state"][name], **tol)
    for r in range(3):  # the other collectives still go through the service
        tb._same_collectives(links[r]["collectives"], gloo[r]["collectives"])


@pytest.mark.slow
def test_a_killed_rank_is_named_on_the_links(tmp_path):
    procs = tb.start_ranks(3, tmp_path / "run", ["ddpwire"], torchrun_env=False,
                           extra={**ON_LINKS, "DDP_KILL_AT": "2:3", "DDP_TIMEOUT": "30",
                                  "DDP_STEPS": "50"})
    codes, outputs = tb.finish(procs, limit=tb.LIMIT)
    assert codes[2] == 17
    for rank in (0, 1):
        assert codes[rank] != 0
        assert "CollectiveAborted" in outputs[rank] and "rank 2" in outputs[rank], outputs[rank]


def test_the_links_sum_and_average_in_rank_order_as_the_service_does():
    world, n = 3, 100_003
    ranks = _linked(world, _loopback)
    rng = np.random.default_rng(5)
    inputs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    inputs[1][77] = np.nan  # passed on, as gloo does
    try:
        for op in (Op.SUM, Op.AVG):
            want = reference_allreduce(inputs, op)
            bufs = [x.copy() for x in inputs]
            threads = [threading.Thread(target=ranks[r].allreduce, args=(bufs[r], op))
                       for r in range(world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
            for r in range(world):
                assert np.array_equal(bufs[r].view(np.uint32), want.view(np.uint32)), (op, r)
    finally:
        for r in ranks:
            r.close()


@pytest.mark.slow
def test_half_tensors_reduce_scatters_and_all_gathers_take_the_links_with_the_service_s_bits(
        tmp_path):
    script = Path(__file__).resolve().parent / "links_script.py"

    def run(label, env):
        tb.run_script_ranks(script, [tmp_path / label], 3, **env)
        return [torch.load(tmp_path / f"{label}.rank{r}.pt") for r in range(3)]

    links, service = run("links", ON_LINKS), run("service", ON_SERVICE)
    # 4 half allreduces, 4 reduce-scatters, 3 all-gathers and 3 broadcasts
    # on every rank's links
    assert [r["links"] for r in links] == [14] * 3
    assert [r["links"] for r in service] == [0] * 3
    for r in range(3):
        for key, value in links[r]["got"].items():
            assert value.dtype == service[r]["got"][key].dtype
            assert torch.equal(value.view(-1).view(torch.uint8),
                               service[r]["got"][key].view(-1).view(torch.uint8)), (key, r)
            assert torch.equal(value, links[0]["got"][key]) or key[0] == "reduce_scatter_tensor"
    for key, value in links[0]["got"].items():
        if key[0] == "broadcast":  # the root's values, every rank alike, not rank 0's own
            assert not torch.equal(value, torch.zeros_like(value))


def _each_rank(ranks, call):
    """call(r) on every rank at once; their results in rank order."""
    out = [None] * len(ranks)

    def one(r):
        out[r] = call(r)
    threads = [threading.Thread(target=one, args=(r,)) for r in range(len(ranks))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
        assert not t.is_alive(), "a rank's collective hung"
    return out


@pytest.mark.parametrize("fractions", [None, (0.0, 1.0, 2.0)])
def test_the_links_reduce_scatter_and_all_gather_in_equal_chunks_as_the_service(fractions):
    # whatever fractions the group's allreduces are cut by, a reduce-scatter
    # hands rank r the r-th equal chunk and an all-gather lays the ranks'
    # data out in rank order, with the service's bits (float32 in rank order)
    world, chunk = 3, 33_335
    ranks = _linked(world, lambda r: dict(_loopback(r), fractions=fractions))
    rng = np.random.default_rng(9)
    inputs = [rng.standard_normal(world * chunk).astype(np.float32) for _ in range(world)]
    inputs[2][chunk + 5] = np.inf  # passed on, as gloo does
    try:
        for op in (Op.SUM, Op.AVG):
            want = reference_allreduce(inputs, op)
            got = _each_rank(ranks, lambda r: ranks[r].reduce_scatter(inputs[r].copy(), op))
            for r in range(world):
                assert np.array_equal(got[r].view(np.uint32),
                                      want[r * chunk:(r + 1) * chunk].view(np.uint32)), (op, r)
        mine = [x[:chunk].copy() for x in inputs]
        got = _each_rank(ranks, lambda r: ranks[r].allgather(mine[r]))
        for r in range(world):
            assert np.array_equal(got[r].view(np.uint32), np.concatenate(mine).view(np.uint32))
        # and the allreduces still follow the group's fractions, on the same links
        bufs = [x.copy() for x in inputs]
        _each_rank(ranks, lambda r: ranks[r].allreduce(bufs[r], Op.AVG))
        assert all(np.array_equal(b.view(np.uint32),
                                  reference_allreduce(inputs, Op.AVG).view(np.uint32))
                   for b in bufs)
    finally:
        for r in ranks:
            r.close()


def test_a_rank_that_cannot_listen_keeps_every_rank_on_the_service(caplog):
    taken = socket.socket()
    taken.bind(("127.0.0.1", 0))
    taken.listen(1)
    port = taken.getsockname()[1]
    try:
        with caplog.at_level(logging.WARNING, logger="ddpwire.torch.links"):
            got = _form_all(3, lambda r: dict(_loopback(r), **({"ports": (port, port)}
                                                               if r == 1 else {})))
    finally:
        taken.close()
    assert got == [None, None, None]
    assert "go through rank 0" in caplog.text and f"every port of {port}-{port}" in caplog.text


def test_a_rank_nobody_can_reach_keeps_every_rank_on_the_service(caplog):
    # rank 2 listens on 127.0.0.2 but says 127.0.0.1: nobody can dial it
    def where(rank):
        return dict(listen_host="127.0.0.2" if rank == 2 else "127.0.0.1", advertise="127.0.0.1")
    with caplog.at_level(logging.WARNING, logger="ddpwire.torch.links"):
        got = _form_all(3, where)
    assert got == [None, None, None]
    assert "go through rank 0" in caplog.text and "cannot reach worker 2" in caplog.text


def test_the_listening_port_is_pinned_to_the_range_asked(monkeypatch):
    probe = socket.socket()
    probe.bind(("127.0.0.1", 0))
    base = probe.getsockname()[1]
    probe.close()
    lo, hi = base, min(base + 40, 65535)
    seen = []
    real_listen = _links._mesh.listen

    def listen(host, backlog=64, **kw):
        sock = real_listen(host, backlog, **kw)
        seen.append(sock.getsockname()[1])
        return sock
    monkeypatch.setattr(_links._mesh, "listen", listen)
    monkeypatch.setenv(_links.PORTS_ENV, f"{lo}-{hi}")
    ranks = _form_all(2, lambda r: dict(_loopback(r), ports=_links.ports_from_env()))
    try:
        assert all(isinstance(r, _links.RankLinks) for r in ranks), ranks
        assert len(seen) == 2 and all(lo <= p <= hi for p in seen), (seen, lo, hi)
    finally:
        for r in ranks:
            r.close()


def test_a_port_range_is_parsed_or_refused():
    from ddpwire.plane.mesh import parse_ports
    assert parse_ports("29600-29700") == (29600, 29700)
    assert parse_ports("29600") == (29600, 29600)
    for bad in ("x", "5-2", "0-10", "1-70000"):
        with pytest.raises(ValueError, match="FIRST-LAST"):
            parse_ports(bad)


def test_after_a_failure_every_later_call_raises_the_first_cause():
    ranks = _linked(2, _loopback)
    ranks[1].close()  # rank 1 leaves
    buf = np.ones(1000, dtype=np.float32)
    with pytest.raises(CollectiveAborted) as first:
        ranks[0].allreduce(buf, Op.SUM)
    assert first.value.rank == 1
    with pytest.raises(CollectiveAborted) as again:
        ranks[0].allreduce(buf, Op.SUM)
    assert again.value is first.value
    ranks[0].close()


@pytest.mark.parametrize("root", [0, 2])
def test_the_links_broadcast_the_root_s_bytes_whatever_the_group_s_fractions(root):
    world = 3
    ranks = _linked(world, lambda r: dict(_loopback(r), fractions=(0.0, 1.0, 2.0)))
    rng = np.random.default_rng(root)
    mine = [rng.standard_normal(50_001).astype(np.float32) for _ in range(world)]
    mine[root][17] = np.nan  # bytes, whatever they hold
    want = mine[root].copy()
    try:
        _each_rank(ranks, lambda r: ranks[r].broadcast(mine[r], root))
        for r in range(world):
            assert np.array_equal(mine[r].view(np.uint32), want.view(np.uint32)), r
    finally:
        for r in ranks:
            r.close()


@pytest.mark.parametrize("collective", ["reduce_scatter", "allgather", "allreduce_words",
                                        "broadcast"])
def test_a_rank_that_leaves_is_named_in_a_reduce_scatter_or_all_gather_too(collective):
    # two ranks: with three, a survivor may see the other survivor's links
    # close (it gave up on the same rank) before the leaver's
    ranks = _linked(2, _loopback)
    ranks[1].close()  # rank 1 leaves
    calls = {"reduce_scatter": lambda r: r.reduce_scatter(np.ones(3000, np.float32), Op.SUM),
             "allgather": lambda r: r.allgather(np.ones(1000, np.float32)),
             "allreduce_words": lambda r: r.allreduce(np.ones(3000, np.uint16), Op.AVG,
                                                      compression="bf16"),
             "broadcast": lambda r: r.broadcast(np.ones(3000, np.float32), 0)}
    try:
        with pytest.raises(CollectiveAborted) as first:
            calls[collective](ranks[0])
        assert first.value.rank == 1
        # and every later collective raises the same first error
        with pytest.raises(CollectiveAborted) as again:
            ranks[0].allgather(np.ones(10, np.float32))
        assert again.value is first.value
    finally:
        for r in ranks:
            r.close()


def _beating(rank):
    # heartbeats every 50 ms, a peer silent for 0.5 s lost; the group's
    # deadline far beyond both
    return {**_loopback(rank), "heartbeat": 0.05, "silence": 0.5}


def test_a_rank_computing_past_the_silence_limit_is_waited_for():
    # rank 1 joins the allreduce 2 s late, four times the silence limit:
    # its heartbeats on the idle links keep it alive, and the result is exact
    world, n = 2, 50_000
    ranks = _linked(world, _beating)
    rng = np.random.default_rng(9)
    inputs = [rng.standard_normal(n).astype(np.float32) for _ in range(world)]
    bufs = [x.copy() for x in inputs]
    errors = []

    def run(r, delay):
        try:
            threading.Event().wait(delay)
            for _ in range(2):  # a second allreduce after the heartbeats: frames intact
                ranks[r].allreduce(bufs[r], Op.SUM)
        except BaseException as exc:  # handed to the test
            errors.append((r, exc))
    try:
        threads = [threading.Thread(target=run, args=(r, 2.0 * r)) for r in range(world)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(60)
        assert errors == []
        once = reference_allreduce(inputs, Op.SUM)
        want = reference_allreduce([once, once], Op.SUM)
        for r in range(world):
            assert np.array_equal(bufs[r].view(np.uint32), want.view(np.uint32)), r
    finally:
        for r in ranks:
            r.close()


def test_a_rank_gone_silent_is_named_within_the_silence_limit_not_the_deadline():
    # rank 1's machine goes quiet (its heartbeats stop, it never joins the
    # allreduce, its links stay open): rank 0 names it after the 0.5 s of
    # silence, where the group's deadline is 60 s away
    ranks = _linked(2, lambda r: {**_beating(r), "timeout": 60.0})
    ranks[1]._beats.stop(5.0)
    buf = np.ones(1000, dtype=np.float32)
    started = time.monotonic()
    try:
        with pytest.raises(CollectiveAborted) as lost:
            ranks[0].allreduce(buf, Op.SUM)
        took = time.monotonic() - started
        assert lost.value.rank == 1, lost.value
        assert took < 30.0, took  # named by its silence: the deadline was 60 s off
    finally:
        for r in ranks:
            r.close()


@pytest.mark.slow
def test_a_frozen_rank_is_named_by_its_silence_on_the_links(tmp_path):
    # a group timeout of 120 s: the links' silence limit is 20 s
    # (ddpwire.torch.rendezvous.HEARTBEAT_LIMIT), so rank 0 names the frozen
    # rank long before the deadline of the allreduce it waits in
    from ddpwire.torch.rendezvous import HEARTBEAT_LIMIT

    timeout = 120.0
    procs = tb.start_ranks(2, tmp_path / "run", ["ddpwire"], torchrun_env=False,
                           extra={**ON_LINKS, "DDP_TIMEOUT": str(timeout),
                                  "DDP_STEPS": "100000", "DDP_MARK": str(tmp_path / "mark")})
    try:
        tb._wait_training(procs, 1, tmp_path / "mark")
        os.kill(procs[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        out0, _ = procs[0].communicate(timeout=tb.LIMIT)
        took = time.monotonic() - stopped
    finally:
        tb._kill_all(procs)
    assert procs[0].returncode != 0
    assert "CollectiveAborted" in out0 and "rank 1" in out0, out0
    assert took < timeout / 2, took  # the silence named it; the deadline was 120 s away
    assert took >= HEARTBEAT_LIMIT / 2, took  # not before the limit: heartbeats kept it alive
