"""The coordinator's share of a mesh step (MeshPeers.coordinator_share):
the coordinator averages the vector's last elements itself, streamed like
the star, while the workers average the rest among themselves.

Every test runs a real Coordinator and real Workers over loopback TCP with
the links as the data plane (a share needs them), the share given
explicitly since "auto" takes none with workers on the coordinator's host.
"""
from __future__ import annotations

import threading

import numpy as np
import pytest

from ddpwire import Coordinator, _core
from ddpwire.plane import mesh as meshmod
from ddpwire.plane import plan as planmod
from ddpwire.wire.errors import (GradientMismatch, NonFiniteGradient, PeerLost, ProtocolError,
                            WorkerLost)
from ddpwire.wire.extensions import Codec
from ddpwire.wire.messages import MeshPeers

from mesh_session import (ADDR, TIMEOUT, Session, bits, flat_steps, gradients, halted_step,
                          run_flat_steps, untouched_out_step)
from session_helpers import reference_allreduce


@pytest.fixture(autouse=True)
def links(monkeypatch):
    monkeypatch.setenv("DDPWIRE_SHM", "0")


def star_loss(n):
    loss = np.float32(0)
    for i in range(n):
        loss = np.float32(loss + np.float32(0.5 + i) * np.float32(10 + i))
    return float(loss / np.float32(sum(10 + i for i in range(n))))


def test_the_part_is_the_vector_s_last_elements_rounded_down():
    assert planmod.coordinator_part(1000, 0) == 0
    assert planmod.coordinator_part(1000, 1 << 15) == 500
    assert planmod.coordinator_part(3, 1 << 15) == 1
    assert planmod.coordinator_part(1, 0xFFFF) == 0
    assert planmod.coordinator_part(1 << 40, 13107) == (13107 << 40) >> 16
    assert meshmod.share_value(0.2) == 13107 and meshmod.share_value(0) == 0
    assert meshmod.share_value(0.99999999) == 0xFFFF
    for bad in (-0.1, 1.0, float("nan"), "0.2", None):
        with pytest.raises(ValueError, match="coordinator_share"):
            meshmod.share_value(bad)


def test_auto_share_leaves_the_coordinator_link_slack_and_lowers_the_floor():
    assert meshmod.auto_share(1) == meshmod.auto_share(2) == 0.0
    assert meshmod.auto_share(4) == pytest.approx(0.15)
    for n in (3, 4, 8, 32):
        x = meshmod.auto_share(n)
        # the reduce-scatter: a worker's link against the coordinator's,
        # which finishes its N·x first (where equal links would balance,
        # 1/(N+1), it would not)
        worker = (n - 1) / n * (1 - x) + x
        assert 0 < n * x < worker
        # and the step's floor is below the plain mesh's
        assert worker + (n - 1) / n * (1 - x) < 2 * (n - 1) / n


@pytest.mark.parametrize("n,count,share", [
    (2, 1, 0.3), (2, 4097, 0.3), (3, 2, 0.25), (3, 100_003, 0.25), (4, 1 << 18, 0.2),
    (4, 10, 0.99), (5, 7, 0.5), (1, 1000, 0.5)])
def test_the_average_is_the_reference_bits_on_every_worker(n, count, share):
    grads = gradients(n, count, seed=n + count)
    s = run_flat_steps(grads, 3, coordinator_share=share, topology="mesh")
    assert s.coord.share == meshmod.share_value(share)
    want = reference_allreduce(grads)
    for i in range(n):
        got, loss = s.results[i]
        assert np.array_equal(bits(got), bits(want))
        assert loss == pytest.approx(star_loss(n), rel=0, abs=0)


def test_collect_then_broadcast_with_a_share():
    grads = gradients(3, 5000, seed=9)
    s = Session(3, flat_steps(grads, 2), coordinator={"coordinator_share": 0.25})
    try:
        for step in range(2):
            r = s.coord.collect_and_reduce(step)
            assert r.avg_gradients is None and r.total_samples == 33
            s.coord.broadcast_averaged(step, r)
    finally:
        s.join()
    assert not s.errors, s.errors
    for i in range(3):
        assert np.array_equal(bits(s.results[i][0]), bits(reference_allreduce(grads)))


def test_short_kernel_ranges_give_the_reference_bits():
    _core.set_kernel_chunk(2)
    try:
        grads = gradients(4, 101, seed=3)
        s = run_flat_steps(grads, 2, coordinator_share=0.3)
    finally:
        _core.set_kernel_chunk(0)
    for i in range(4):
        assert np.array_equal(bits(s.results[i][0]), bits(reference_allreduce(grads)))


def test_heartbeats_never_land_inside_the_part():
    # a worker heartbeat every millisecond: one inside its GradientPayload
    # would be read as gradient bytes by the coordinator. The silence limit
    # stays long: left at 3 heartbeats (3 ms), a busy machine that parks a
    # worker's thread for 3 ms fails the step with WorkerLost, which is not
    # what this test is about
    grads = gradients(3, 300_000, seed=6)
    beat = {"heartbeat": 0.001, "heartbeat_timeout": TIMEOUT}
    s = Session(3, flat_steps(grads, 4), coordinator={"coordinator_share": 0.25, **beat},
                workers={i: dict(beat) for i in range(3)})
    try:
        for step in range(4):
            s.coord.allreduce(step)
    finally:
        s.join()
    assert not s.errors, s.errors
    for i in range(3):
        assert np.array_equal(bits(s.results[i][0]), bits(reference_allreduce(grads)))


@pytest.mark.parametrize("where", ["part", "part and slice", "part only worker 2"])
def test_a_non_finite_element_in_the_part_halts_the_step_everywhere(where):
    count = 12_000
    grads = gradients(3, count, seed=1)
    # share 1/4: the coordinator's part is [9000, 12000)
    if where == "part":
        grads[1][11_000] = np.nan
        grads[2][9_500] = np.inf
        want = (1, 11_000)
    elif where == "part and slice":
        grads[1][11_000] = np.nan
        grads[1][100] = -np.inf  # in worker 0's slice, a lower index of the same worker
        want = (1, 100)
    else:
        grads[2][9_000] = -np.inf
        want = (2, 9_000)
    s, halted = halted_step(3, untouched_out_step(grads, np.float32(-7.25)),
                            coordinator_share=0.25)
    assert (halted.worker_id, halted.index, halted.step) == (*want, 0)
    assert halted.value == grads[want[0]][want[1]] or np.isnan(halted.value)
    assert sorted(s.errors) == [0, 1, 2]
    for exc in s.errors.values():
        assert isinstance(exc, NonFiniteGradient), repr(exc)
        assert (exc.worker_id, exc.index, exc.step) == (*want, 0)


def test_gradients_of_different_lengths_are_a_typed_error():
    grads = [np.ones(1000, np.float32), np.ones(1001, np.float32), np.ones(1000, np.float32)]
    s = Session(3, lambda w: w.allreduce(0, grads[w.worker_id], 1.0, 1, 1),
                coordinator={"coordinator_share": 0.25})
    try:
        with pytest.raises((WorkerLost, GradientMismatch)):
            s.coord.allreduce(0)
    finally:
        s.join()
    # worker 1's slices are cut from 751 elements, the others' from 750:
    # worker 2 is sent 251 where 250 were due
    assert isinstance(s.errors[2], GradientMismatch), repr(s.errors[2])
    assert sorted(s.errors) == [0, 1, 2]


def test_auto_takes_no_share_with_workers_on_this_host():
    grads = gradients(3, 100, seed=2)
    s = run_flat_steps(grads, 1)
    assert s.coord.mesh and s.coord.share == 0


@pytest.mark.parametrize("coordinator", [{"compression": "bf16"},
                                         {"shared_memory": True, "topology": "mesh"}])
def test_a_share_is_only_taken_for_float32_over_the_links(monkeypatch, coordinator):
    monkeypatch.setenv("DDPWIRE_SHM", "1")
    grads = gradients(3, 1000, seed=2)
    s = run_flat_steps(grads, 1, coordinator_share=0.25, **coordinator)
    assert s.coord.share == 0


def test_coordinator_share_argument_is_checked():
    for bad in (-0.5, 1.0, "half"):
        with pytest.raises(ValueError, match="coordinator_share"):
            Coordinator(ADDR, 1, coordinator_share=bad)


def test_a_table_with_a_share_for_16_bit_words_is_refused():
    listener = meshmod.listen("127.0.0.1")
    table = MeshPeers(key=bytes(32), codec=int(Codec.BF16), shared_memory=0,
                      peers="127.0.0.1:1", coordinator_share=100)
    with pytest.raises(ProtocolError, match="coordinator_share"):
        meshmod.Mesh.connect(listener, table, 0, 1, timeout=1.0, max_frame=1 << 20)
    assert listener.fileno() == -1  # closed, not leaked


def test_a_worker_that_never_opens_its_links_is_named_by_the_others():
    # workers 1 and 2 give up on worker 0 before their reduce-scatter and
    # tell the coordinator, which is waiting for their part's payloads
    grads = gradients(3, 10, seed=5)
    gave_up = threading.Event()

    def body(w):
        if w.worker_id == 0:
            gave_up.wait(TIMEOUT)
            return None
        return w.allreduce(0, grads[w.worker_id], 1.0, 1, 1)

    s = Session(3, body, coordinator={"coordinator_share": 0.25}, timeout=1.0)
    try:
        with pytest.raises(PeerLost) as info:
            s.coord.allreduce(0)
    finally:
        gave_up.set()
        s.join()
    assert info.value.worker_id == 0 and info.value.step == 0
    for wid in (1, 2):
        exc = s.errors[wid]
        assert isinstance(exc, WorkerLost) and exc.worker_id == 0, repr(exc)


class _Admitted:
    """What _choose_share reads of an admitted worker: its address as the
    coordinator saw it and the coordinator's end of its connection."""

    def __init__(self, worker_id, address, local):
        self.worker_id = worker_id
        self.address = (address, 40000 + worker_id)

        class _Sock:
            @staticmethod
            def getsockname():
                return (local, 9000)
        self.sock = _Sock()


@pytest.mark.parametrize("n,addresses,hosts,want", [
    # three or four machines of their own: three quarters of 1/(N+1)
    (3, ["10.0.0.2", "10.0.0.3", "10.0.0.4"], [None] * 3, meshmod.share_value(0.1875)),
    (4, ["10.0.0.2", "10.0.0.3", "10.0.0.4", "10.0.0.5"], [b"a" * 16, b"b" * 16, None, None],
     meshmod.share_value(0.15)),
    # one worker reaches the coordinator from the coordinator's own address
    (3, ["10.0.0.2", "10.0.0.1", "10.0.0.4"], [None] * 3, 0),
    # one on loopback
    (3, ["10.0.0.2", "127.0.0.1", "10.0.0.4"], [None] * 3, 0),
    # one that offered this host's id (another address of this machine)
    (3, ["10.0.0.2", "192.168.1.7", "10.0.0.4"], [None, "here", None], 0),
    # two workers: no gain to take
    (2, ["10.0.0.2", "10.0.0.3"], [None] * 2, 0),
])
def test_auto_share_is_taken_only_from_machines_of_their_own(n, addresses, hosts, want):
    from ddpwire.plane import shm
    from ddpwire.session.mesh_control import choose_share
    admitted = [_Admitted(i, a, "10.0.0.1") for i, a in enumerate(addresses)]
    hosts = [shm.host_id() if h == "here" else h for h in hosts]
    assert choose_share(admitted, hosts, "auto") == want
    # a fraction given is taken as it is
    assert choose_share(admitted, hosts, 0.3) == meshmod.share_value(0.3)
