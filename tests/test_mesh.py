"""The mesh: workers average flat steps among themselves (ddpwire.plane.mesh).

Every test runs a real Coordinator and real Workers over loopback TCP, the
workers as threads. The averages are compared bit for bit with the tests'
one reference (tests/session_helpers.py reference_allreduce: a float32 sum
in worker order, then a division; for 16-bit codecs each input and the
average rounded once), independent numpy arithmetic.
"""
from __future__ import annotations

import socket
import threading
import time

import numpy as np
import pytest

from ddpwire import Coordinator, Worker, _core
from ddpwire.plane import mesh as meshmod
from ddpwire.wire.errors import (
    DdpwireError,
    GradientMismatch,
    NonFiniteGradient,
    PeerLost,
    ProtocolError,
    WorkerLost,
)
from ddpwire.wire.extensions import Codec
from ddpwire.session.mesh_control import culprit
from ddpwire.wire.messages import MeshPeers, PeerHello
from ddpwire.wire.channel import Channel

from mesh_session import (ADDR, TIMEOUT, Session, bits, flat_steps, gradients, halted_step,
                          run_flat_steps, untouched_out_step)
from session_helpers import reference_allreduce


@pytest.fixture(autouse=True, params=["links", "shared"])
def data_plane(request, monkeypatch):
    """Every test on both data planes: the links between workers, and (all
    workers being on this host) the shared segment (tests/test_mesh_shm.py
    has what only it does)."""
    monkeypatch.setenv("DDPWIRE_SHM", "0" if request.param == "links" else "1")
    return request.param


@pytest.mark.parametrize("n,count", [(1, 1000), (2, 1), (2, 4097), (3, 2), (3, 100_003),
                                     (4, 1 << 18), (5, 7)])
def test_the_mesh_average_is_the_reference_bits_on_every_worker(n, count):
    grads = gradients(n, count, seed=n + count)
    s = Session(n, flat_steps(grads, 3))
    try:
        assert s.coord.mesh
        for step in range(3):
            r = s.coord.allreduce(step)
            assert r.avg_gradients is None
    finally:
        s.join()
    assert not s.errors, s.errors
    want = reference_allreduce(grads)
    star_loss = np.float32(0)
    for i in range(n):
        star_loss = np.float32(star_loss + np.float32(0.5 + i) * np.float32(10 + i))
    star_loss = float(star_loss / np.float32(sum(10 + i for i in range(n))))
    for i in range(n):
        got, loss = s.results[i]
        assert np.array_equal(bits(got), bits(want))
        assert loss == r.global_loss == pytest.approx(star_loss, rel=0, abs=0)
    assert r.total_samples == sum(10 + i for i in range(n))
    assert r.total_correct == sum(range(n))


def test_the_average_may_land_in_the_gradient_buffer_itself():
    grads = gradients(3, 50_001, seed=3)
    want = reference_allreduce(grads)

    def body(w):
        buf = grads[w.worker_id].copy()
        w.allreduce(0, buf, 1.0, 1, 1, out=buf)
        return buf

    s = Session(3, body)
    try:
        s.coord.allreduce(0)
    finally:
        s.join()
    assert not s.errors
    for i in range(3):
        assert np.array_equal(bits(s.results[i]), bits(want))


def run_16_bit_steps(grads, codec):
    """Two steps with ``compression=codec``: every worker must end with the
    reference's bits, which are returned."""
    n = len(grads)
    s = run_flat_steps(grads, 2, compression=codec)
    want = reference_allreduce(grads, codec=codec)
    for i in range(n):
        assert np.array_equal(bits(s.results[i][0]), bits(want))
    return want


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
@pytest.mark.parametrize("n", [2, 3, 4])
def test_16_bit_codecs_give_every_worker_the_same_rounded_average(codec, n):
    grads = gradients(n, 30_011, seed=n)
    want = run_16_bit_steps(grads, codec)
    exact = reference_allreduce(grads)
    # the documented error: one rounding of each input and of the average
    # (8 bits of precision for bf16, 11 for fp16), relative to the largest value
    err = float(np.abs(want - exact).max()) / float(np.abs(np.stack(grads)).max())
    assert err < (2.0 ** -7 if codec == "bf16" else 2.0 ** -10)
    assert not np.array_equal(bits(want), bits(exact))  # it did travel in 16 bits


@pytest.mark.parametrize("compression", [None, "bf16"])
def test_a_worker_without_the_mesh_keeps_the_star_for_everyone(compression, caplog):
    # compression travels on the mesh only: on the star it is off, and said so
    grads = gradients(3, 9_999, seed=9)

    def body(w):
        out = w.allreduce(0, grads[w.worker_id], 1.0, 1, 1)
        return out.gradients.copy(), w.uses_mesh

    with caplog.at_level("WARNING", logger="ddpwire.coordinator"):
        s = Session(3, body, workers={1: dict(mesh=False)},
                    coordinator=dict(compression=compression))
    warned = [r.getMessage() for r in caplog.records if "travels on the mesh only" in r.getMessage()]
    try:
        assert warned == (["compression='bf16' is off: it travels on the mesh only"]
                          if compression else [])
        assert not s.coord.mesh
        r = s.coord.allreduce(0)
    finally:
        s.join()
    assert not s.errors, s.errors
    want = reference_allreduce(grads)
    assert np.array_equal(bits(r.avg_gradients), bits(want))
    for i in range(3):
        got, on_mesh = s.results[i]
        assert np.array_equal(bits(got), bits(want)) and not on_mesh


def test_topology_mesh_refuses_a_worker_that_cannot_join_it():
    coord = Coordinator(ADDR, 2, topology="mesh", timeout=5, join_timeout=TIMEOUT)
    workers = []

    def connect(mesh):
        workers.append(Worker.connect(coord.local_addr, timeout=5, mesh=mesh))

    threads = [threading.Thread(target=connect, args=(m,)) for m in (True, False)]
    for t in threads:
        t.start()
    try:
        with pytest.raises(DdpwireError, match=r"topology 'mesh': worker \d .* did not offer the mesh"):
            coord.wait_for_workers()
    finally:
        for t in threads:
            t.join(TIMEOUT)
        for w in workers:
            w.close()
        coord.close()


def test_argument_errors():
    with pytest.raises(ValueError, match="topology"):
        Coordinator(ADDR, 1, topology="ring")
    with pytest.raises(ValueError, match="compression"):
        Coordinator(ADDR, 1, compression="int4")
    with pytest.raises(ValueError, match="travels on the mesh"):
        Coordinator(ADDR, 1, topology="star", compression="bf16")


@pytest.mark.parametrize("culprits", [(2,), (1, 2)])
def test_a_nan_halts_the_step_before_any_worker_applies_anything(culprits):
    count = 12_000
    grads = gradients(3, count, seed=1)
    for c in culprits:
        grads[c][7_000 + c] = np.nan  # in the slice worker 1 owns
    body = untouched_out_step(grads, np.float32(1234.5))

    s, halted = halted_step(3, body)
    first = min(culprits)
    assert halted.worker_id == first and halted.step == 0
    assert halted.index == 7_000 + first and np.isnan(halted.value)
    assert sorted(s.errors) == [0, 1, 2]
    for exc in s.errors.values():
        assert isinstance(exc, NonFiniteGradient) and exc.worker_id == first and exc.step == 0


def test_an_int8_session_halts_on_a_non_finite_element_naming_the_worker_and_its_block():
    # int8 carries a NaN or infinity as its whole block's NaN scale: the
    # owner names the first worker whose block holds one, and that block's
    # first element, before any worker applies anything
    count = 12_000
    grads = gradients(3, count, seed=5)
    grads[2][7_000] = np.inf   # block 27 (6912-7167), in worker 1's slice
    grads[1][7_100] = np.nan   # the same block, a lower worker
    body = untouched_out_step(grads, np.float32(-7.5))
    s, halted = halted_step(3, body, topology="mesh", compression="int8")
    assert halted.worker_id == 1 and halted.step == 0
    assert halted.index == 27 * 256 and np.isnan(halted.value)
    for exc in s.errors.values():
        assert isinstance(exc, NonFiniteGradient) and exc.worker_id == 1 and exc.step == 0


def test_an_infinity_in_the_coordinator_side_slice_of_worker_0_is_named():
    grads = gradients(2, 100, seed=2)
    grads[0][3] = -np.inf
    _, halted = halted_step(2, lambda w: w.allreduce(0, grads[w.worker_id], 1.0, 1, 1))
    assert (halted.worker_id, halted.index, halted.value) == (0, 3, -np.inf)


@pytest.mark.parametrize("coordinator", [{}, {"coordinator_share": 0.25}],
                         ids=["mesh", "coordinator-share"])
def test_a_worker_that_leaves_mid_session_is_named_everywhere_within_the_timeout(coordinator):
    grads = gradients(3, 200_000, seed=4)
    steps_done = threading.Barrier(3)

    def body(w):
        g = grads[w.worker_id]
        w.allreduce(0, g, 1.0, 1, 1)
        steps_done.wait(TIMEOUT)
        if w.worker_id == 1:
            return "left"  # closes every link and its coordinator connection
        w.allreduce(1, g, 1.0, 1, 1)

    s = Session(3, body, coordinator=coordinator, timeout=5.0)
    t0 = time.monotonic()
    try:
        s.coord.allreduce(0)
        with pytest.raises(WorkerLost) as info:
            s.coord.allreduce(1)
    finally:
        s.join()
    assert time.monotonic() - t0 < 5.0 * 3  # errors come from the loss, well within timeouts
    assert info.value.worker_id == 1 and info.value.step == 1
    assert s.results[1] == "left"
    assert sorted(s.errors) == [0, 2]
    for wid, exc in s.errors.items():
        assert isinstance(exc, PeerLost), repr(exc)
        assert exc.step == 1
    # at least one survivor saw worker 1's own link fail and names it; with
    # a coordinator share the coordinator, streaming its part, may see the
    # loss first and close on the survivors before their links tell them
    if not s.coord.share:
        assert any(isinstance(e, WorkerLost) and e.worker_id == 1 for e in s.errors.values())


def test_a_worker_that_never_opens_its_links_is_named_after_the_timeout():
    grads = gradients(2, 10, seed=5)
    gave_up = threading.Event()

    def body(w):
        if w.worker_id == 0:
            gave_up.wait(TIMEOUT)  # joined, then silent until worker 1 has given up on it
            return None
        try:
            return w.allreduce(0, grads[1], 1.0, 1, 1)
        finally:
            gave_up.set()

    s = Session(2, body, timeout=1.0)
    try:
        with pytest.raises(PeerLost):
            s.coord.allreduce(0)
    finally:
        gave_up.set()
        s.join()
    exc = s.errors[1]
    assert isinstance(exc, WorkerLost) and exc.worker_id == 0
    assert "worker 0 did not open its mesh link within 1 s" in str(exc)


def test_a_worker_held_up_before_its_step_is_named_not_the_one_waiting_for_it():
    # worker 1 does not start step 1 until the coordinator has given up;
    # worker 0 computes for longer than the coordinator's grace and then
    # waits for worker 1's slice. Its wait counts from the coordinator's last
    # message (step 0's go-ahead), as the coordinator's does, so it names
    # worker 1 to the coordinator in time, though both are silent at the
    # coordinator's deadline.
    from ddpwire.session.mesh_control import MESH_BLAME_GRACE

    grads = gradients(2, 1000, seed=9)
    release = threading.Event()

    def body(w):
        w.allreduce(0, grads[w.worker_id], 1.0, 1, 1)
        if w.worker_id == 1:
            release.wait(TIMEOUT)
            return "held"
        time.sleep(MESH_BLAME_GRACE + 0.2)
        w.allreduce(1, grads[0], 1.0, 1, 1)

    s = Session(2, body, timeout=2.0)
    try:
        s.coord.allreduce(0)
        with pytest.raises(WorkerLost) as info:
            s.coord.allreduce(1)
    finally:
        release.set()
        s.join()
    assert info.value.worker_id == 1 and info.value.step == 1, info.value
    assert "as worker 0 saw it" in str(info.value)
    exc = s.errors[0]
    assert isinstance(exc, WorkerLost) and exc.worker_id == 1 and exc.step == 1, repr(exc)


def test_a_worker_that_comes_to_its_step_past_the_deadline_is_the_one_named():
    # worker 0 computes past the timeout (counted from step 0's go-ahead);
    # worker 1, waiting for its slice, names it to the coordinator, and
    # worker 0 names itself rather than the peer that waited for it
    grads = gradients(2, 1000, seed=10)

    def body(w):
        w.allreduce(0, grads[w.worker_id], 1.0, 1, 1)
        if w.worker_id == 0:
            time.sleep(1.3)
        w.allreduce(1, grads[w.worker_id], 1.0, 1, 1)

    s = Session(2, body, timeout=1.0)
    try:
        s.coord.allreduce(0)
        with pytest.raises(WorkerLost) as info:
            s.coord.allreduce(1)
    finally:
        s.join()
    assert info.value.worker_id == 0 and info.value.step == 1, info.value
    assert "as worker 1 saw it" in str(info.value)
    assert isinstance(s.errors[1], WorkerLost) and s.errors[1].worker_id == 0
    late = s.errors[0]
    assert isinstance(late, WorkerLost) and late.worker_id == 0 and late.step == 1, repr(late)
    assert "after the coordinator's last message" in str(late)


def test_gradients_of_different_lengths_are_a_typed_error():
    grads = [np.ones(1000, np.float32), np.ones(1001, np.float32)]
    s = Session(2, lambda w: w.allreduce(0, grads[w.worker_id], 1.0, 1, 1))
    try:
        with pytest.raises((WorkerLost, GradientMismatch)) as info:
            s.coord.allreduce(0)
    finally:
        s.join()
    assert any(isinstance(e, GradientMismatch) for e in s.errors.values()), s.errors
    # each text names its worker and step once: a worker's error travels to
    # the coordinator without the context the coordinator adds again
    for exc in [info.value, *s.errors.values()]:
        assert str(exc).count("step 0)") == 1, str(exc)


def test_per_block_steps_keep_the_star_in_a_mesh_session():
    blocks = gradients(2, 300, seed=6)

    def body(w):
        w.send_block_gradient(0, 1, 2, blocks[w.worker_id], [100, 200])
        return w.receive_averaged_block().gradients.copy()

    s = Session(2, body)
    try:
        assert s.coord.mesh
        r = s.coord.allreduce_block(0, 1)
    finally:
        s.join()
    assert not s.errors, s.errors
    want = reference_allreduce(blocks)
    assert np.array_equal(bits(r.avg_gradients), bits(want))
    for i in range(2):
        assert np.array_equal(bits(s.results[i]), bits(want))


def test_collect_then_broadcast_is_the_reports_then_the_commit():
    grads = gradients(2, 5_000, seed=8)
    s = Session(2, flat_steps(grads, 1))
    try:
        r = s.coord.collect_and_reduce(0)
        assert r.avg_gradients is None and r.total_samples == 21
        s.coord.broadcast_averaged(0, r)
        with pytest.raises(ValueError, match="stays on the workers"):
            s.coord.allreduce(1, out=np.empty(5_000, np.float32))
    finally:
        s.join()
    assert not s.errors
    assert np.array_equal(bits(s.results[0][0]), bits(reference_allreduce(grads)))


# ---- the links ----

def test_peer_table_parsing():
    text = meshmod.format_peers([("10.0.0.1", 5), ("::1", 6)])
    assert text == "10.0.0.1:5,[::1]:6"
    assert meshmod.parse_peers(text, 2) == [("10.0.0.1", 5), ("::1", 6)]
    for bad in ("10.0.0.1:5", "host:5,10.0.0.1:6", "10.0.0.1:0,10.0.0.1:1", "10.0.0.1,x"):
        with pytest.raises(ProtocolError):
            meshmod.parse_peers(bad, 2)


def test_a_stranger_on_a_mesh_port_is_dropped_and_the_mesh_still_forms():
    key = bytes(range(32))
    listeners = [meshmod.listen("127.0.0.1") for _ in range(2)]
    table = MeshPeers(key=key, codec=int(Codec.FLOAT32), shared_memory=0,
                      peers=meshmod.format_peers([l.getsockname()[:2] for l in listeners]))
    # before worker 0 dials: one hello with a wrong proof, one replaying worker 1's own direction
    strangers = []
    for proof in (bytes(32), meshmod.hello_proof(key, 1, 0)):
        sock = socket.create_connection(listeners[1].getsockname()[:2])
        chan = Channel(sock, timeout=5, peer_name="stranger", lost=PeerLost)
        chan.send(PeerHello(worker_id=0, proof=proof))
        strangers.append(chan)
    meshes = {}

    def connect(i):
        meshes[i] = meshmod.Mesh.connect(listeners[i], table, i, 2, timeout=10, max_frame=1 << 20)

    threads = [threading.Thread(target=connect, args=(i,)) for i in (1, 0)]
    threads[0].start()
    time.sleep(0)  # either order must work; the strangers are queued first anyway
    threads[1].start()
    for t in threads:
        t.join(TIMEOUT)
    try:
        assert set(meshes) == {0, 1}
        for chan in strangers:  # dropped: closed without a reply
            assert chan.conn.sock.recv(1) == b""
        grads = gradients(2, 101, seed=11)
        outs = [np.empty(101, np.float32) for _ in range(2)]

        def step(i):
            meshes[i].reduce_scatter(0, grads[i], time.monotonic() + 10)
            meshes[i].allgather(0, outs[i], time.monotonic() + 10)

        threads = [threading.Thread(target=step, args=(i,)) for i in range(2)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(TIMEOUT)
        want = reference_allreduce(grads)
        assert all(np.array_equal(bits(o), bits(want)) for o in outs)
    finally:
        for m in meshes.values():
            m.close()
        for chan in strangers:
            chan.close()


# ---- the kernels in short ranges ----

@pytest.fixture
def tiny_ranges():
    """The exchange's kernels narrow 3 elements ahead of the bytes and
    reduce or widen 3 at least per call, so every slice below is sent in
    many small writes and its kernels run in many ranges, some uneven."""
    _core.set_kernel_chunk(3)
    yield
    _core.set_kernel_chunk(0)


def helper_threads():
    return [t for t in threading.enumerate() if t.name.startswith("ddpwire-mesh")]


@pytest.mark.parametrize("n,count", [(2, 1), (2, 13), (3, 7), (3, 31), (4, 5), (5, 1),
                                     (7, 23), (8, 64)])
def test_split_ranges_give_the_reference_bits(tiny_ranges, n, count):
    grads = gradients(n, count, seed=100 + n + count)
    s = run_flat_steps(grads, 2)
    want = reference_allreduce(grads)
    for i in range(n):
        assert np.array_equal(bits(s.results[i][0]), bits(want))
    assert not helper_threads()  # a mesh runs no thread of its own


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
@pytest.mark.parametrize("n,count", [(2, 1), (3, 17), (4, 3), (6, 101)])
def test_split_ranges_give_the_16_bit_bits(tiny_ranges, codec, n, count):
    run_16_bit_steps(gradients(n, count, seed=200 + n + count), codec)


@pytest.mark.parametrize("codec", [None, "bf16"])
@pytest.mark.parametrize("bad", [
    # (worker, index): worker 2 early and worker 1 late in worker 1's slice
    [(2, 40), (1, 75)],
    # worker 1 early, worker 2 late: still worker 1
    [(2, 75), (1, 40)],
    # one worker twice, in two ranges: its lowest index
    [(1, 76), (1, 41), (2, 40)],
])
def test_the_first_non_finite_element_is_found_across_ranges(tiny_ranges, codec, bad):
    count = 120  # worker 1 owns [40, 80), reduced 3 elements or more at a time
    grads = gradients(3, count, seed=7)
    for w, i in bad:
        grads[w][i] = np.inf if i % 2 else np.nan
    body = untouched_out_step(grads, np.float32(-7.0))

    s, halted = halted_step(3, body, **(dict(compression=codec) if codec else {}))
    worker, index = min(bad)
    assert (halted.worker_id, halted.index) == (worker, index)
    assert np.isnan(halted.value) if index % 2 == 0 else halted.value == np.inf
    for exc in s.errors.values():
        assert isinstance(exc, NonFiniteGradient) and (exc.worker_id, exc.index) == (worker, index)


def test_a_lost_worker_is_named_with_short_ranges_and_no_thread_is_left(tiny_ranges):
    grads = gradients(3, 3_000, seed=12)
    steps_done = threading.Barrier(3)

    def body(w):
        w.allreduce(0, grads[w.worker_id], 1.0, 1, 1)
        steps_done.wait(TIMEOUT)
        if w.worker_id == 2:
            return "left"
        w.allreduce(1, grads[w.worker_id], 1.0, 1, 1)

    s = Session(3, body, timeout=5.0)
    try:
        s.coord.allreduce(0)
        with pytest.raises(WorkerLost) as info:
            s.coord.allreduce(1)
    finally:
        s.join()
    assert info.value.worker_id == 2
    assert sorted(s.errors) == [0, 1]
    assert any(isinstance(e, WorkerLost) and e.worker_id == 2 for e in s.errors.values())
    assert not helper_threads()


def test_the_coordinator_names_the_worker_that_vanished_not_one_that_gave_up_after_it():
    from ddpwire.wire.messages import CollectiveError, StepReport, NO_WORKER as NONE
    report = StepReport(1, 0, 10, 0.0, 0, 0, NONE, 0, 0.0)
    # worker 2 vanished; worker 1 lost its link to 2 and closed its links;
    # worker 0 saw worker 1's link close first and blamed 1
    answers = [CollectiveError(1, 1, "worker 1 closed its mesh link"),
               CollectiveError(1, 2, "worker 2 closed its mesh link"),
               WorkerLost("worker 2 disconnected", worker_id=2, step=1)]
    exc = culprit(answers, 1)
    assert exc.worker_id == 2 and exc.step == 1 and "as worker 1 saw it" in str(exc)
    # nobody vanished: the lowest blamed worker
    exc = culprit([report, CollectiveError(1, 2, "wrong head"),
                                     CollectiveError(1, 0, "wrong head")], 1)
    assert exc.worker_id == 0
    # nobody blamed: the silent one
    lost = WorkerLost("worker 1 silent", worker_id=1, step=1)
    assert culprit([report, lost, report], 1) is lost
    # a blame without a worker names the worker that sent it
    assert culprit([CollectiveError(1, NONE, "x"), report], 1).worker_id == 0


def test_a_silent_worker_still_heard_from_is_not_named_for_one_that_is_not():
    from ddpwire.wire.messages import CollectiveError, StepReport, NO_WORKER as NONE
    report = StepReport(2, 0, 10, 0.0, 0, 0, NONE, 0, 0.0)
    silent = [WorkerLost(f"worker {w} silent past the deadline", worker_id=w, step=2)
              for w in range(3)]
    # both silent at the deadline, worker 0 still heartbeating: worker 1
    assert culprit(silent[:2], 2, {0, 1}, {0}) is silent[1]
    assert culprit(silent[:2], 2, {0, 1}, {0}, final=False) is silent[1]
    # nothing tells them apart: not sure yet (a live one may still name the
    # peer it waits for), and at the very end the lowest
    assert culprit(silent[:2], 2, {0, 1}, set(), final=False) is None
    assert culprit(silent[:2], 2, {0, 1}, {0, 1}, final=False) is None
    assert culprit(silent[:2], 2, {0, 1}, set()) is silent[0]
    # worker 0 names the peer it waits for: that one, with worker 0's words
    waits = CollectiveError(2, 1, "worker 1 (mesh link) silent past the deadline")
    exc = culprit([waits, silent[1]], 2, {1}, set(), final=False)
    assert exc.worker_id == 1 and exc.step == 2
    assert "as worker 0 saw it" in str(exc) and "worker 1 (mesh link)" in str(exc)
    # a worker whose heartbeats stopped (or that disconnected) before one
    # merely silent, heard or not
    stopped = WorkerLost("worker 1 silent for 1.5 s", worker_id=1, step=2)
    assert culprit([silent[0], stopped], 2, {0}, {0}, final=False) is stopped
    assert culprit([silent[0], stopped], 2, {0}, set()) is stopped
    # one silent, the rest answered: sure at once
    assert culprit([report, silent[1], report], 2, {1}, set(), final=False) is silent[1]
    # three silent, two heard from: the third, however numbered
    assert culprit(silent, 2, {0, 1, 2}, {0, 2}, final=False) is silent[1]


def _congestion_of(sock):
    return sock.getsockopt(socket.IPPROTO_TCP, socket.TCP_CONGESTION, 16).split(b"\0")[0].decode()


def _kernel(what):
    with open(f"/proc/sys/net/ipv4/tcp_{what}") as f:
        return f.read().split()


@pytest.mark.skipif(not hasattr(socket, "TCP_CONGESTION"), reason="the kernel choice of "
                    "congestion control is Linux's (the option is skipped elsewhere)")
@pytest.mark.parametrize("asked", ["default", "reno", None, "no-such-cc"])
def test_mesh_links_send_under_the_congestion_control_asked_for(asked, caplog):
    available = _kernel("available_congestion_control")
    system = _kernel("congestion_control")[0]
    want = {"default": meshmod.DEFAULT_CONGESTION, "reno": "reno", None: system,
            "no-such-cc": system}[asked]
    if want not in available:
        pytest.skip(f"this kernel has no {want} ({available})")
    kwargs = {} if asked == "default" else {"tcp_congestion": asked}
    grads = gradients(3, 1000, seed=9)

    def body(w):
        w.allreduce(0, grads[w.worker_id], 1.0, 1, 1)
        links = [c.conn.sock for c in w._mesh_step.mesh.links if c is not None]
        return [_congestion_of(s) for s in links], _congestion_of(w.channel.conn.sock)

    caplog.set_level("INFO", logger="ddpwire")
    s = Session(3, body, workers={i: kwargs for i in range(3)})
    try:
        s.coord.allreduce(0)
    finally:
        s.join()
    assert not s.errors, s.errors
    for links, coordinator_link in s.results.values():
        assert links == [want, want]
        assert coordinator_link == system  # only the mesh links are chosen for
    if asked == "no-such-cc":
        assert "no-such-cc unavailable" in caplog.text


@pytest.mark.parametrize("name", ["cu bic", "x" * 16, "ü", 5])
def test_a_malformed_congestion_control_name_is_refused_before_joining(name):
    with pytest.raises(ValueError, match="tcp_congestion"):
        Worker.connect(("127.0.0.1", 9), timeout=1.0, tcp_congestion=name)
