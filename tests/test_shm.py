"""The shared-memory allreduce of ranks on one host (csrc/shm.c, ddpwire.plane.shm,
and its use by the "ddpwire" torch backend), in real processes.

The segment tests drive ddpwire.plane.shm.Segment from processes started with
'spawn' (ranks of their own, no service): bits against the tests' one
reference (tests/session_helpers.py), a killed or absent rank named, an
abort, Ctrl-C in a barrier. The backend tests run tests/shm_script.py and
tests/ddp_script.py ranks.
"""
import mmap
import multiprocessing
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import numpy as np
import pytest

from ddpwire import _core
from ddpwire.plane import shm
from ddpwire.plane.collectives import CollectiveAborted, Op
from ddpwire.plane.plan import Plan, slice_bounds

from session_helpers import reference_allreduce

pytestmark = pytest.mark.skipif(shm._posixshmem is None or not os.path.isdir("/dev/shm"),
                                reason="needs POSIX shared memory under /dev/shm")

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "shm_script.py"
LIMIT = 120  # seconds any group of processes may take before the test fails (never a hang)
REGION = 64 << 10  # small: the larger sizes below go in several pieces
SIZES = [1, 5, 17, 16 * 4 + 3, 40000, 100003]  # elements; 100003 > 6 pieces of REGION
NONCE = b"0123456789abcdef"


def inputs_of(rank, i, n):
    rng = np.random.default_rng(100 * i + rank)
    x = (rng.standard_normal(n) * (rank + 1)).astype(np.float32)
    if i == 3 and rank == 1:
        x[n // 2] = np.inf  # non-finite values propagate as the reference's do
    if i == 4 and rank == 0:
        x[7] = np.nan
    return x


def op_of(i):
    return Op.AVG if i % 2 else Op.SUM


def segment_rank(name, world, rank, results, hold=None):
    plane = shm.rank_plane(shm.Segment.attach(name, world, rank, REGION, NONCE), LIMIT)
    try:
        out = []
        for i, n in enumerate(SIZES):
            x = inputs_of(rank, i, n)
            plane.allreduce(x, op_of(i), timeout=LIMIT)
            out.append(x)
        results.put((rank, out))
    finally:
        plane.close()


def test_segment_allreduce_is_bit_exact_in_rank_order():
    for world in (2, 3, 4):
        seg = shm.Segment.create(world, REGION)
        seg.init(NONCE)
        ctx = multiprocessing.get_context("spawn")
        results = ctx.Queue()
        procs = [ctx.Process(target=segment_rank, args=(seg.name, world, r, results)) for r in range(world)]
        try:
            for p in procs:
                p.start()
            got = dict(results.get(timeout=LIMIT) for _ in range(world))
            for p in procs:
                p.join(LIMIT)
                assert p.exitcode == 0
        finally:
            for p in procs:
                if p.is_alive():
                    p.kill()
            seg.close()
        assert not os.path.exists("/dev/shm" + seg.name)
        for i, n in enumerate(SIZES):
            want = reference(op_of(i), [inputs_of(r, i, n) for r in range(world)])
            for r in range(world):
                assert got[r][i].tobytes() == want.tobytes(), (world, i, r)


def test_stage_refuses_a_slice_outside_the_vector():
    arena = _core.ShmArena(bytearray(_core.shm_size(3, 4096)), 3, 0, 4096)
    arena.init(NONCE)
    x = np.zeros(100, dtype=np.float32)
    for start, count in ((-1, 1), (0, -1), (101, 0), (100, 1), (50, 51)):
        with pytest.raises(ValueError, match="not within"):
            arena.stage(x, Op.AVG, start, count)
    for start, count in ((0, 0), (100, 0), (0, 100), (30, 40)):
        arena.stage(x, Op.AVG, start, count)


def test_attach_refuses_another_nonce():
    seg = shm.Segment.create(2, REGION)
    try:
        seg.init(NONCE)
        with pytest.raises(ValueError, match="nonce"):
            shm.Segment.attach(seg.name, 2, 1, REGION, b"x" * 16)
        with pytest.raises(ValueError):
            shm.Segment.attach(seg.name, 3, 1, REGION, NONCE)  # another layout
        assert os.stat("/dev/shm" + seg.name).st_mode & 0o777 == 0o600
    finally:
        seg.close()
    assert not os.path.exists("/dev/shm" + seg.name)
    with pytest.raises(FileNotFoundError):
        shm.Segment.attach(seg.name, 2, 1, REGION, NONCE)


def test_a_segment_whose_creator_is_gone_is_swept():
    proc = subprocess.run([sys.executable, "-c", (
        "import os; from ddpwire.plane import shm\n"
        "seg = shm.Segment.create(2, 4096)\n"
        "print(seg.name, flush=True)\n"
        "os._exit(0)  # never unlinked, as if killed before the ranks answered\n")],
        cwd=ROOT, env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True, text=True,
        timeout=LIMIT)
    name = proc.stdout.strip()
    assert proc.returncode == 0 and name.startswith("/ddpw-"), proc.stderr
    assert os.path.exists("/dev/shm" + name)
    live = shm.Segment.create(2, 4096)  # creating one sweeps
    try:
        assert not os.path.exists("/dev/shm" + name)
        shm.sweep_stale()
        assert os.path.exists("/dev/shm" + live.name)  # its creator (this process) lives
    finally:
        live.close()


def waiting_rank(name, world, rank, timeout, results, ready=None):
    plane = shm.rank_plane(shm.Segment.attach(name, world, rank, REGION, NONCE), timeout)
    if ready is not None:
        ready.put(rank)
    try:
        plane.allreduce(np.ones(1000, dtype=np.float32), Op.AVG, timeout=timeout)
        results.put((rank, None, None, None))
    except CollectiveAborted as exc:
        results.put((rank, type(exc).__name__, exc.rank, str(exc)))
    finally:
        plane.close()


def idle_rank(name, world, rank, attached, release):
    seg = shm.Segment.attach(name, world, rank, REGION, NONCE)
    attached.set()
    release.wait(LIMIT)
    seg.close()


def test_killed_rank_is_named_and_leaves_no_segment():
    seg = shm.Segment.create(3, REGION)
    seg.init(NONCE)
    ctx = multiprocessing.get_context("spawn")
    results, ready, attached, release = ctx.Queue(), ctx.Queue(), ctx.Event(), ctx.Event()
    victim = ctx.Process(target=idle_rank, args=(seg.name, 3, 2, attached, release))
    procs = [ctx.Process(target=waiting_rank, args=(seg.name, 3, r, 3.0, results, ready)) for r in (0, 1)]
    try:
        victim.start()
        assert attached.wait(LIMIT)
        for p in procs:
            p.start()
        assert sorted(ready.get(timeout=LIMIT) for _ in procs) == [0, 1]
        seg.unlink()  # as the backend does once every rank has attached
        os.kill(victim.pid, signal.SIGKILL)
        got = sorted(results.get(timeout=LIMIT) for _ in procs)
    finally:
        for p in procs + [victim]:
            p.join(LIMIT)
            if p.is_alive():
                p.kill()
        seg.close()
    assert victim.exitcode == -signal.SIGKILL
    for rank, (r, kind, blamed, text) in zip((0, 1), got):
        assert (r, kind, blamed) == (rank, "CollectiveAborted", 2), text
        # the first to time out calls the group off, blaming the same rank
        assert "rank 2 did not reach" in text or "rank 2 is gone" in text, text
    assert any("timed out: rank 2 did not reach" in text for *_, text in got)
    assert not os.path.exists("/dev/shm" + seg.name)


def test_abort_calls_the_waits_off_naming_the_rank():
    seg = shm.Segment.create(3, REGION)
    seg.init(NONCE)
    ctx = multiprocessing.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=waiting_rank, args=(seg.name, 3, r, float(LIMIT), results)) for r in (0, 1)]
    try:
        for p in procs:
            p.start()
        seg.abort(2)  # what a lost connection does; before or during their wait alike
        got = sorted(results.get(timeout=LIMIT) for _ in procs)
    finally:
        for p in procs:
            p.join(LIMIT)
            if p.is_alive():
                p.kill()
        seg.close()
    for rank, (r, kind, blamed, text) in zip((0, 1), got):
        assert (r, kind, blamed) == (rank, "CollectiveAborted", 2), text
        assert "rank 2 is gone" in text


def test_an_arrived_rank_wins_over_an_abort():
    # a group whose last rank leaves right after the last barrier ends cleanly
    arena = _core.ShmArena(bytearray(_core.shm_size(1, 4096)), 1, 0, 4096)
    arena.init(NONCE)
    arena.abort(0)
    assert arena.barrier(1, 1.0) == (_core.SHM_OK, -1)
    assert arena.aborted() == 0


# ---- ranks as threads on one in-process mapping: a rank's own slice ----
# Rank r never stages slice r of its vector (nobody else reads it) and reduces
# it from its own buffer. These tests fill or scribble that slice of the
# input regions, so reading it from there would change the bits or reports.

def in_process(world, body, region=REGION, planes=False):
    """``body(arena, rank, inputs)`` on a thread per rank of one mapping
    (``inputs``: the input regions as float32 rows, the layout's last
    world + 1 regions being the inputs then the output); with ``planes``
    each rank's :class:`ddpwire.plane.shm.SharedPlane` in place of its arena."""
    mapping = mmap.mmap(-1, _core.shm_size(world, region))
    segments = [shm.Segment("in-process", mapping, world, r, region, False)
                for r in range(world)]
    arenas = [seg.arena for seg in segments]
    arenas[0].init(NONCE)
    ranks = [shm.rank_plane(seg, LIMIT) for seg in segments] if planes else arenas
    regions = np.frombuffer(mapping, dtype=np.float32, offset=len(mapping) - (world + 1) * region)
    inputs = regions.reshape(world + 1, region // 4)[:world]
    results, errors = {}, {}

    def run(r):
        try:
            results[r] = body(ranks[r], r, inputs)
        except BaseException as exc:  # handed to the test
            errors[r] = exc
            arenas[r].abort(r)

    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(LIMIT)
        assert not t.is_alive(), "a rank hung"
    del regions, inputs
    for a in arenas:
        a.close()
    mapping.close()
    assert not errors, errors
    return results


def reference(op, ins):
    """The tests' one reference (tests/session_helpers.py), SUM or AVG."""
    return reference_allreduce(ins, op)


@pytest.mark.parametrize("world", [2, 3, 4])
def test_allreduce_reads_each_rank_s_own_slice_from_its_buffer(world):
    sizes = [1, 5, 17, 16 * 4 + 3, 4099, REGION // 4]

    def body(plane, rank, inputs):
        out = []
        for i, n in enumerate(sizes):
            x = inputs_of(rank, i, n)
            # only this rank reads this slice of its region: once the last
            # allreduce has returned, nobody else is reading it at all
            start, end = slice_bounds(n, world)[rank]
            count = end - start
            inputs[rank][start:start + count] = np.nan
            plane.allreduce(x, op_of(i), LIMIT)
            assert np.isnan(inputs[rank][start:start + count]).all()  # never staged
            out.append(x)
        return out

    got = in_process(world, body, planes=True)
    for i, n in enumerate(sizes):
        want = reference(op_of(i), [inputs_of(r, i, n) for r in range(world)])
        for r in range(world):
            assert got[r][i].tobytes() == want.tobytes(), (world, i, r)



@pytest.mark.parametrize("world", [2, 3])
@pytest.mark.parametrize("op", [Op.SUM, Op.AVG])
def test_allreduce_writes_the_own_slice_from_the_sum_itself(world, op):
    # Each rank's slice of the result reaches its buffer from the reducing
    # pass, not from the copy out of the output region (which skips it):
    # slices large enough that the kernels split them over threads and
    # stream their stores, with a non-finite inside one (finished anyway).
    n = (1 << 22) * world + 4099
    region = n * 4

    def body(plane, rank, inputs):
        x = inputs_of(rank, 3, n)  # rank 1 holds an inf
        plane.allreduce(x, op, LIMIT)
        return x

    got = in_process(world, body, region, planes=True)
    want = reference(op, [inputs_of(r, 3, n) for r in range(world)])
    for r in range(world):
        assert got[r].tobytes() == want.tobytes(), (world, op, r)

def split_step(arena, rank, x, scribble, inputs, generation=0, fractions=None):
    """A plane's arena calls for one vector, the whole result copied out as
    the mesh copies it, with this rank's own slice (the plan's of
    ``fractions``) of its input region scribbled over between stage and
    reduce: (reduce's report, the gathered average)."""
    start, end = Plan(len(x), arena.world, fractions).slice(rank)
    count = end - start
    arena.stage(x, Op.AVG, start, count)
    assert arena.barrier(generation + 1, LIMIT) == (_core.SHM_OK, -1)
    assert arena.agree() == -1
    inputs[rank][start:start + count] = scribble
    report = arena.reduce(x)
    assert report[:2] == (start, count)
    assert arena.barrier(generation + 2, LIMIT) == (_core.SHM_OK, -1)
    out = np.empty_like(x)
    arena.gather(out)
    return report[2:], out


#: equal fractions (None) for 2 to 4 members, then the same plan as the
#: links with unequal ones: a member with an empty slice still stages its
#: vector for the others and gathers the result
SPLITS = [(2, None), (3, None), (4, None), (2, (1.0, 3.0)), (2, (0.0, 1.0)),
          (4, (0.5, 0.0, 0.25, 0.25)), (3, (0.0, 0.0, 1.0))]


@pytest.mark.parametrize("world,fractions", SPLITS)
def test_the_mesh_s_split_calls_read_the_own_slice_from_the_buffer(world, fractions):
    sizes = [1, 16 * 4 + 3, 12000]

    def body(arena, rank, inputs):
        return [split_step(arena, rank, inputs_of(rank, 10 + i, n), np.float32(1e30), inputs,
                           2 * i, fractions)
                for i, n in enumerate(sizes)]

    got = in_process(world, body)
    for i, n in enumerate(sizes):
        want = reference(Op.AVG, [inputs_of(r, 10 + i, n) for r in range(world)])
        for r in range(world):
            report, out = got[r][i]
            assert report == (-1, 0, 0.0) and out.tobytes() == want.tobytes(), (world, i, r)


def test_a_non_finite_value_in_the_own_slice_is_reported_from_the_buffer():
    world, n = 3, 4800  # slices [0, 1600), [1600, 3200), [3200, 4800)
    xs = [np.arange(n, dtype=np.float32) * (r + 1) for r in range(world)]
    xs[1][2000] = np.inf     # rank 1's own slice: its region never holds it
    xs[2][2500] = np.nan     # also in rank 1's slice, but rank 1 comes first
    xs[2][100] = -np.inf     # rank 0's slice: read from rank 2's region
    xs[2][4000] = np.nan     # rank 2's own slice
    xs[1][4500] = np.inf     # ...where rank 1 comes first: from its region

    def body(arena, rank, inputs):
        # the scribble is finite: a report read from the region would miss
        # the own slice's value or name another
        return split_step(arena, rank, xs[rank], np.float32(123.0), inputs)

    got = in_process(world, body)
    assert [got[r][0] for r in range(world)] == [(2, 100, -np.inf), (1, 2000, np.inf),
                                                  (1, 4500, np.inf)]
    # rank 2's slice with the NaN of its own alone: read from its buffer
    xs[1][4500] = 0.0
    got = in_process(world, body)
    bad_rank, index, value = got[2][0]
    assert (bad_rank, index) == (2, 4000) and np.isnan(value)
    want = reference(Op.AVG, xs)
    for r in range(world):
        assert got[r][1].tobytes() == want.tobytes(), r


def test_reduce_takes_the_staged_buffer_only():
    arena = _core.ShmArena(bytearray(_core.shm_size(1, 4096)), 1, 0, 4096)
    arena.init(NONCE)
    x = np.arange(8, dtype=np.float32)
    with pytest.raises(ValueError, match="stage"):
        arena.reduce(x)  # nothing staged
    with pytest.raises(ValueError, match="neither SUM"):
        arena.stage(x, 7, 0, 8)
    arena.stage(x, Op.AVG, 0, 8)
    for other in (x.copy(), x[:4]):
        with pytest.raises(ValueError, match="stage"):
            arena.reduce(other)
    assert arena.barrier(1, 1.0) == (_core.SHM_OK, -1)
    assert arena.reduce(x) == (0, 8, -1, 0, 0.0)
    assert arena.barrier(2, 1.0) == (_core.SHM_OK, -1)
    out = np.empty_like(x)
    arena.gather(out)
    assert out.tobytes() == x.tobytes()  # a world of one: its own slice is everything
    with pytest.raises(ValueError):
        arena.stage(np.zeros(1025, dtype=np.float32), Op.AVG, 0, 1025)  # over the region


def test_ctrl_c_interrupts_a_barrier(tmp_path):
    seg = shm.Segment.create(2, REGION)
    seg.init(NONCE)
    mark = tmp_path / "waiting"
    code = ("import sys, numpy as np; from ddpwire.plane import shm\n"
            "from ddpwire.plane.collectives import Op\n"
            f"seg = shm.Segment.attach({seg.name!r}, 2, 0, {REGION}, {NONCE!r})\n"
            f"open({str(mark)!r}, 'w').close()\n"
            # rank 1 never comes: only Ctrl-C ends this within the test's limit
            "shm.rank_plane(seg, 3600).allreduce(np.ones(10, dtype=np.float32), Op.SUM, 3600)\n")
    proc = subprocess.Popen([sys.executable, "-c", code], cwd=ROOT, stderr=subprocess.PIPE, text=True,
                            env=dict(os.environ, PYTHONPATH=str(ROOT)))
    try:
        deadline = time.monotonic() + LIMIT
        while not mark.exists() and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.05)
        assert mark.exists(), proc.stderr.read() if proc.poll() is not None else "no start"
        proc.send_signal(signal.SIGINT)
        _, err = proc.communicate(timeout=LIMIT)
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        seg.close()
    assert proc.returncode != 0 and "KeyboardInterrupt" in err, err


# ---- the torch backend ----
# (torch is imported by these tests only: the spawned ranks above import this module)


def _torch():
    return pytest.importorskip("torch")


def start(world, out, extra=None, per_rank=None):
    procs = []
    for rank in range(world):
        env = dict(os.environ, PYTHONPATH=str(ROOT), RANK=str(rank), WORLD_SIZE=str(world),
                   OMP_NUM_THREADS="1", SHM_INIT=f"file://{out}.store", **(extra or {}))
        env.update((per_rank or {}).get(rank, {}))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(out)], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def finish(procs):
    outs = []
    for p in procs:
        try:
            outs.append(p.communicate(timeout=LIMIT)[0])
        except subprocess.TimeoutExpired:
            for q in procs:
                q.kill()
            pytest.fail("a rank hung")
    return [p.returncode for p in procs], outs


def kill_all(procs):
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            p.kill()
            p.wait()


def expected(world, rounds, sizes):
    torch = _torch()
    want = []
    for i in range(rounds):
        for j, n in enumerate(sizes):
            ins = [(torch.randn(n, generator=torch.Generator().manual_seed(1000 * (10 * i + j) + r))
                    * (r + 1)).numpy() for r in range(world)]
            want.append(reference(Op.AVG if (i + j) % 2 else Op.SUM, ins))
            want.append(np.full(3, float(i % world), dtype=np.float32))
    return want


def load(out, rank):
    return _torch().load(f"{out}.rank{rank}.pt", weights_only=False)


@pytest.mark.slow
def test_backend_allreduces_in_shared_memory_in_issue_order(tmp_path):
    _torch()  # the ranks run the torch backend
    out, world = tmp_path / "run", 3
    # a small region: the 300001-element allreduce goes in pieces
    codes, outs = finish(start(world, out, {"DDPWIRE_SHM_REGION_BYTES": str(256 << 10)}))
    assert codes == [0] * world, "\n".join(outs)
    want = expected(world, 3, [70000, 5, 300001])
    for r in range(world):
        rec = load(out, r)
        assert rec["shared_memory"]
        # every allreduce went through the segment, the 5-element one too
        assert rec["shm_collectives"] == 3 * 3
        if r == 0:  # rank 0 unlinks the name before its init returns
            assert rec["linked_after_init"] is False
        assert rec["order"] == list(range(len(want)))
        for k, (got, w) in enumerate(zip(rec["results"], want)):
            assert got.numpy().tobytes() == w.tobytes(), (r, k)
        assert not os.path.exists("/dev/shm" + rec["name"])


@pytest.mark.slow
def test_off_switch_on_one_rank_keeps_the_group_on_tcp(tmp_path):
    _torch()  # the ranks run the torch backend
    out, world = tmp_path / "run", 2
    procs = start(world, out, {"SHM_ROUNDS": "1"}, per_rank={1: {"DDPWIRE_SHM": "0"}})
    codes, outs = finish(procs)
    assert codes == [0] * world, "\n".join(outs)
    want = expected(world, 1, [70000, 5, 300001])
    for r in range(world):
        rec = load(out, r)
        assert rec["shared_memory"] is False
        for got, w in zip(rec["results"], want):
            assert got.numpy().tobytes() == w.tobytes()
    # rank 0 offered a segment, rank 1 declined: it is gone all the same
    assert not [f for f in os.listdir("/dev/shm") if f.startswith(f"ddpw-{procs[0].pid:x}-")]


@pytest.mark.slow
def test_killed_rank_fails_the_others_naming_it(tmp_path):
    _torch()  # the ranks run the torch backend
    out, world = tmp_path / "run", 3
    # the group timeout is long: the lost connection, not the deadline, ends the waits
    procs = start(world, out, {"SHM_KILL_AT": "2:1", "SHM_TIMEOUT": "600", "SHM_ROUNDS": "4"})
    try:
        codes, outs = finish(procs)
    finally:
        kill_all(procs)
    assert codes[2] == 17
    name = None
    for r in (0, 1):
        rec = load(out, r)
        name = rec["name"]
        assert codes[r] == 3, outs[r]
        assert rec["error"] == "CollectiveAborted" and rec["error_rank"] == 2, rec
    assert name is not None and not os.path.exists("/dev/shm" + name)


@pytest.mark.slow
def test_stalled_rank_is_named_by_the_barrier_deadline(tmp_path):
    out, world = tmp_path / "run", 2
    procs = start(world, out, {"SHM_STALL": "1", "SHM_TIMEOUT": "5"})
    try:
        out0, _ = procs[0].communicate(timeout=LIMIT)
    finally:
        kill_all(procs)
    rec = load(out, 0)
    assert procs[0].returncode == 3, out0
    assert rec["error"] == "CollectiveAborted" and rec["error_rank"] == 1, rec


@pytest.mark.slow
def test_unmodified_ddp_script_in_shared_memory_matches_gloo(tmp_path):
    # every float32 SUM/AVG allreduce of the script through shared memory
    # (the default: a scalar's too)
    torch = _torch()
    import test_torch_backend as tb

    out, world = tmp_path / "run", 3
    codes, outputs = tb.finish(tb.start_ranks(world, out, ["ddpwire", "gloo"], torchrun_env=False))
    assert codes == [0] * world, "\n".join(outputs)
    gloo = [tb.load(out, "gloo", r) for r in range(world)]
    wire = [tb.load(out, "ddpwire", r) for r in range(world)]
    for name, value in wire[0]["state"].items():
        if "running" in name or "num_batches" in name:
            continue  # BatchNorm's statistics are each rank's own
        for r in range(1, world):
            assert torch.equal(wire[r]["state"][name], value), (name, r)
        torch.testing.assert_close(value, gloo[0]["state"][name], rtol=1e-5, atol=1e-6)
    for r in range(world):
        tb._same_collectives(wire[r]["collectives"], gloo[r]["collectives"])


def test_the_offer_codec_round_trips_and_refuses_what_it_did_not_write():
    from ddpwire import _core
    offer = _core.shm_offer_encode(bytes(range(16)), bytes(range(16, 32)), 1 << 33, "/ddpwire-x")
    assert len(offer) == _core.SHM_OFFER_LEN == 81
    assert offer[0] == 1 and offer[33:41] == (1 << 33).to_bytes(8, "little")
    assert _core.shm_offer_decode(offer) == (bytes(range(16)), bytes(range(16, 32)), 1 << 33,
                                             "/ddpwire-x")
    none = _core.shm_offer_encode(b"", b"", 0, "")
    assert none == bytes(81) and _core.shm_offer_decode(none) is None
    for bad in (offer[:-1], offer + b"\0", b"\x02" + offer[1:],
                offer[:41] + b"/a\0b" + bytes(36)):
        with pytest.raises(ValueError, match="not a shared-memory offer"):
            _core.shm_offer_decode(bad)
    with pytest.raises(ValueError, match="over 40 bytes"):
        _core.shm_offer_encode(bytes(16), bytes(16), 1, "/" + "x" * 40)
    with pytest.raises(ValueError, match="16-byte host id"):
        _core.shm_offer_encode(b"short", bytes(16), 1, "/a")
