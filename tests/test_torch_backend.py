"""The "ddpwire" torch.distributed backend, in real processes against gloo.

Each test starts the ranks of tests/ddp_script.py (a plain DDP script) with
the environment torchrun gives them, or with a tcp:// init_method, and runs
gloo and ddpwire in the same processes, one after the other.
"""
import os
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

torch = pytest.importorskip("torch")

pytestmark = pytest.mark.slow

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = Path(__file__).resolve().parent / "ddp_script.py"
LIMIT = 120  # seconds a whole run of ranks may take before the test fails (never a hang)


def free_ports(n):
    """n distinct free ports (held open together, so none repeats)."""
    socks = [socket.socket() for _ in range(n)]
    try:
        for s in socks:
            s.bind(("127.0.0.1", 0))
        return [s.getsockname()[1] for s in socks]
    finally:
        for s in socks:
            s.close()


def start_ranks(world, out, backends, *, torchrun_env, extra=None):
    """Start ``world`` ranks of the DDP script, running ``backends`` in turn.

    The first run rendezvouses through torchrun's environment or tcp://;
    later ones through a file store, because a port picked now may be taken
    by the first run's gloo sockets by the time a later run binds it.
    """
    port = free_ports(1)[0]
    first = "env://" if torchrun_env else f"tcp://127.0.0.1:{port}"
    methods = [first] + [f"file://{out}.store{i}" for i in range(1, len(backends))]
    procs = []
    for rank in range(world):
        env = dict(os.environ, PYTHONPATH=str(ROOT), RANK=str(rank), WORLD_SIZE=str(world),
                   OMP_NUM_THREADS="1", DDP_INIT=",".join(methods), **(extra or {}))
        if torchrun_env:
            env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), LOCAL_RANK=str(rank))
        procs.append(subprocess.Popen([sys.executable, str(SCRIPT), str(out), *backends], env=env,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    return procs


def native_stacks(pid: int) -> str:
    """Every thread's C stack of a hung rank, when gdb is there: a hang in
    torch's or gloo's C++ shows no Python frame."""
    if shutil.which("gdb") is None:
        return ""
    try:
        return subprocess.run(["gdb", "-p", str(pid), "-batch", "-ex", "thread apply all bt 25"],
                              capture_output=True, text=True, timeout=60).stdout
    except subprocess.TimeoutExpired:
        return f"gdb timed out on {pid}"


def finish(procs, limit=LIMIT):
    outputs = []
    deadline = time.monotonic() + limit
    for p in procs:
        try:
            out, _ = p.communicate(timeout=max(1.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            stacks = []
            for q in procs:
                if q.poll() is None:
                    q.send_signal(signal.SIGUSR1)  # faulthandler: every thread's stack
                    stacks.append(native_stacks(q.pid))
            time.sleep(1.0)
            for q in procs:
                q.kill()
                stacks.append(q.communicate()[0])
            pytest.fail(f"ranks still running after {limit} s:\n" + "\n".join(stacks))
        outputs.append(out)
    return [p.returncode for p in procs], outputs


def run_script_ranks(script, args, world, **env):
    """``world`` ranks of a torch.distributed script (``script`` with
    ``args``), rendezvous from a torchrun-like environment (and ``env``);
    every rank must exit 0 within the limit (:func:`finish`)."""
    port = free_ports(1)[0]
    procs = [subprocess.Popen(
        [sys.executable, str(script), *map(str, args)],
        env=dict(os.environ, PYTHONPATH=str(ROOT), RANK=str(r), LOCAL_RANK=str(r), NODE_RANK="0",
                 WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                 OMP_NUM_THREADS="1", **env),
        stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True) for r in range(world)]
    codes, outputs = finish(procs)
    assert codes == [0] * world, "\n".join(outputs)


def load(out, backend, rank):
    return torch.load(f"{out}.{backend}.rank{rank}.pt", weights_only=False)


@pytest.mark.parametrize("world,torchrun_env", [(2, True), (3, False)],
                         ids=["2-ranks-torchrun-env", "3-ranks-tcp-init"])
def test_unmodified_ddp_script_matches_gloo(tmp_path, world, torchrun_env):
    out = tmp_path / "run"
    codes, outputs = finish(start_ranks(world, out, ["ddpwire", "gloo"], torchrun_env=torchrun_env))
    assert codes == [0] * world, "\n".join(outputs)
    gloo = [load(out, "gloo", r) for r in range(world)]
    wire = [load(out, "ddpwire", r) for r in range(world)]
    params = [name for name, v in wire[0]["state"].items()
              if "running" not in name and "num_batches" not in name]
    assert len(params) == 10
    for name in params:
        for r in range(1, world):  # DDP keeps parameters identical on every rank: bit for bit
            assert torch.equal(wire[r]["state"][name], wire[0]["state"][name]), (name, r)
        # gloo sums in its own order: equal within float32 rounding
        torch.testing.assert_close(wire[0]["state"][name], gloo[0]["state"][name], rtol=1e-5, atol=1e-6)
    for r in range(world):  # BatchNorm buffers are each rank's own, broadcast from rank 0
        for name, value in wire[r]["state"].items():
            torch.testing.assert_close(value, gloo[r]["state"][name], rtol=1e-5, atol=1e-6)
        assert wire[r]["gathered"] == gloo[r]["gathered"]
        assert wire[r]["gathered"][world - 1] == {"rank": world - 1, "name": f"r{world - 1}",
                                                  "sq": [world - 1] * (world - 1)}
        assert wire[r]["objs"] == gloo[r]["objs"] == ["from 1", {"k": 1}]
        assert torch.equal(wire[r]["max"], gloo[r]["max"])
        _same_collectives(wire[r]["collectives"], gloo[r]["collectives"])
        assert wire[r]["max"].tolist() == [3 * (world - 1) - 4, 2 ** 40 + world - 1, 0]


def _same_collectives(wire, gloo):
    """ddpwire answers every op on every dtype (but AVG on integers and
    bool, which it refuses by name), and gives gloo's answer wherever gloo
    gives one: exactly, or within one rounding of the half types."""
    assert len(wire) == 9 * 7 + 1  # 9 dtypes (int8 a byte copy for broadcast, as gloo's)
    for key, value in wire.items():
        dtype, op = key
        if op == "avg" and dtype in ("torch.int32", "torch.int64", "torch.uint8", "torch.int8",
                                     "torch.bool"):
            assert value == "NotImplementedError", key
            continue
        assert isinstance(value, torch.Tensor), (key, value)
        theirs = gloo[key]
        if not isinstance(theirs, torch.Tensor):
            continue  # gloo refuses it (AVG, some dtypes): nothing to compare with
        if dtype in ("torch.float16", "torch.bfloat16"):
            torch.testing.assert_close(value.float(), theirs.float(), rtol=1e-2, atol=1e-2)
        else:
            assert torch.equal(value, theirs), key


def test_killed_rank_fails_every_other_rank_within_the_timeout(tmp_path):
    timeout = 30.0
    procs = start_ranks(3, tmp_path / "run", ["ddpwire"], torchrun_env=False,
                        extra={"DDP_KILL_AT": "2:3", "DDP_TIMEOUT": str(timeout), "DDP_STEPS": "50"})
    t0 = time.monotonic()
    procs[2].wait(timeout=LIMIT)  # rank 2 leaves abruptly at step 3
    died = time.monotonic()
    codes, outputs = finish(procs, limit=timeout)
    assert time.monotonic() - died < timeout, "the others outlived the group timeout"
    assert codes[2] == 17
    for rank in (0, 1):
        # `except CollectiveAborted` around the loop catches it (not a
        # RuntimeError out of backward), before the failed step is applied
        assert codes[rank] == 23, outputs[rank]
        assert "caught CollectiveAborted (rank 2) after " in outputs[rank], outputs[rank]
        assert "rank 2 is gone" in outputs[rank], outputs[rank]
        taken = int(outputs[rank].split("caught CollectiveAborted (rank 2) after ")[1].split()[0])
        assert taken <= 3, outputs[rank]  # rank 2 left before its step 3
    assert time.monotonic() - t0 < LIMIT


def test_ctrl_c_on_rank_0_ends_every_rank(tmp_path):
    timeout = 60.0
    procs = start_ranks(3, tmp_path / "run", ["ddpwire"], torchrun_env=False,
                        extra={"DDP_TIMEOUT": str(timeout), "DDP_STEPS": "100000",
                               "DDP_MARK": str(tmp_path / "mark")})
    try:
        _wait_training(procs, 0, tmp_path / "mark")
        os.kill(procs[0].pid, signal.SIGINT)  # rank 0 hosts the coordinator: the hard case
        interrupted = time.monotonic()
        codes, outputs = finish(procs, limit=timeout)
        took = time.monotonic() - interrupted
    finally:
        _kill_all(procs)
    assert "KeyboardInterrupt" in outputs[0], outputs[0]
    for rank in (1, 2):
        assert codes[rank] == 23, (codes, outputs[rank])
        assert "caught CollectiveAborted (rank 0)" in outputs[rank], (codes, outputs[rank])
    assert took < timeout / 2, took


def _wait_training(procs, rank, mark):
    """Wait until ``rank`` has trained two steps (it leaves a file then)."""
    deadline = time.monotonic() + LIMIT
    while time.monotonic() < deadline:
        if Path(f"{mark}.rank{rank}").exists():
            return
        if any(p.poll() is not None for p in procs):
            pytest.fail("a rank ended before training:\n" + "\n".join(finish(procs)[1]))
        time.sleep(0.2)
    pytest.fail(f"rank {rank} did not start training within {LIMIT} s")


def _kill_all(procs):
    for p in procs:
        if p.poll() is None:
            os.kill(p.pid, signal.SIGCONT)
            os.kill(p.pid, signal.SIGKILL)
            p.wait()


def test_stalled_rank_is_named_within_the_timeout(tmp_path):
    # short, but long enough for every rank to start and join on a loaded machine
    timeout = 10.0
    procs = start_ranks(2, tmp_path / "run", ["ddpwire"], torchrun_env=False,
                        extra={"DDP_TIMEOUT": str(timeout), "DDP_STEPS": "100000",
                               "DDP_MARK": str(tmp_path / "mark")})
    try:
        # let both ranks get into training, then freeze rank 1
        _wait_training(procs, 1, tmp_path / "mark")
        os.kill(procs[1].pid, signal.SIGSTOP)
        stopped = time.monotonic()
        out0, _ = procs[0].communicate(timeout=LIMIT)
        took = time.monotonic() - stopped
    finally:
        _kill_all(procs)
    assert procs[0].returncode != 0
    assert "CollectiveAborted" in out0 and "rank 1" in out0, out0
    # the group timeout, plus the time to notice: far from gloo's 30 minutes
    assert took < 3 * timeout, took


def test_wait_returns_only_after_the_futures_callbacks_ran():
    # A work completes on one of the group's daemon threads, which runs the
    # future's callbacks inside torch's C++. Were wait() to return first, a
    # program that waits and exits would finalise with that thread still in
    # C++, which aborts the process ("terminate called without an active
    # exception"): seen once in a dozen runs of the shared-memory tests.
    import threading
    from ddpwire.torch.backend import DdpwireWork

    work = DdpwireWork(torch.futures.Future(), 10.0, 0, "test", lambda exc: None)
    ran = []
    work.get_future().then(lambda fut: (time.sleep(0.3), ran.append(threading.current_thread())))
    finisher = threading.Thread(target=work._finish, args=(None, None))
    finisher.start()
    assert work.wait()
    assert ran == [finisher]  # ran on the completing thread, before wait returned
    finisher.join(10)


EXIT_SCRIPT = r"""
import os, sys, time
from datetime import timedelta
import torch
import torch.distributed as dist
import ddpwire.torch  # registers the backend

dist.init_process_group("ddpwire", init_method="file://" + sys.argv[1], rank=0, world_size=1,
                        timeout=timedelta(seconds=30))
t = torch.ones(1 << 20)
work = dist.all_reduce(t, async_op=True)
work.get_future().then(lambda fut: time.sleep(0.3))
work.wait()
print("exiting", flush=True)
"""


def test_a_script_that_waits_and_exits_ends_cleanly(tmp_path):
    for attempt in range(3):
        store = tmp_path / f"store{attempt}"
        proc = subprocess.run([sys.executable, "-c", EXIT_SCRIPT, str(store)], cwd=ROOT,
                              env=dict(os.environ, PYTHONPATH=str(ROOT)), capture_output=True,
                              text=True, timeout=LIMIT)
        assert proc.returncode == 0, proc.stdout + proc.stderr
        assert "exiting" in proc.stdout and "Fatal Python error" not in proc.stderr


ONE_RANK = """
import sys
import torch
import torch.distributed as dist
import ddpwire.torch  # noqa: F401
dist.init_process_group("ddpwire", init_method=f"tcp://127.0.0.1:{sys.argv[1]}", rank=0,
                        world_size=1)
t = torch.tensor([-3, 7, 127], dtype=torch.int8)
dist.broadcast(t, src=0)
dist.all_reduce(t, op=dist.ReduceOp.MAX)
print("int8", t.tolist())
sparse = torch.sparse_coo_tensor([[2, 0, 2]], [1.0, 2.0, 4.0], (4,))
dist.all_reduce(sparse)
print("sparse sum", sparse.is_coalesced(), sparse.to_dense().tolist())
for name, call in (("broadcast", lambda: dist.broadcast(sparse, src=0)),
                   ("max", lambda: dist.all_reduce(sparse, op=dist.ReduceOp.MAX))):
    try:
        call()
    except NotImplementedError as exc:
        print(f"sparse {name}:", exc)
dist.destroy_process_group()
"""


def test_int8_travels_and_a_sparse_tensor_is_summed_and_refused_elsewhere_by_name():
    proc = subprocess.run([sys.executable, "-c", ONE_RANK, str(free_ports(1)[0])],
                          capture_output=True, text=True, timeout=LIMIT)
    assert proc.returncode == 0, proc.stderr
    assert "int8 [-3, 7, 127]" in proc.stdout
    # one rank: the sum is the tensor itself, coalesced (duplicate indices added)
    assert "sparse sum True [2.0, 0.0, 5.0, 0.0]" in proc.stdout, proc.stdout
    assert ("sparse broadcast: ddpwire broadcast: torch.sparse_coo tensors are not supported "
            "(dense, and sparse COO in allreduce SUM): pass t.to_dense()") in proc.stdout, proc.stdout
    assert ("sparse max: ddpwire allreduce: a sparse tensor is summed only (ReduceOp.SUM), "
            "as on gloo") in proc.stdout, proc.stdout


def test_a_groups_failure_is_raised_once_at_the_next_step_and_not_after_it_is_closed():
    import torch

    from ddpwire.plane.collectives import CollectiveAborted
    from ddpwire.torch.backend import _Pending

    pending, net = _Pending(), torch.nn.Linear(2, 2)
    opt = torch.optim.SGD(net.parameters(), lr=0.1)
    before = [p.detach().clone() for p in net.parameters()]
    net(torch.ones(1, 2)).sum().backward()
    pending.arm(CollectiveAborted("rank 2 is gone", rank=2, seq=7), owner="group a")
    with pytest.raises(CollectiveAborted, match="rank 2 is gone") as info:
        opt.step()
    assert info.value.rank == 2
    assert all(torch.equal(a, p) for a, p in zip(before, net.parameters()))  # not applied
    opt.step()  # raised once: the hooks are gone
    net(torch.ones(1, 2))
    pending.arm(CollectiveAborted("rank 1 is gone", rank=1, seq=9), owner="group b")
    pending.disarm("group a")  # another group's close: still armed
    with pytest.raises(CollectiveAborted):
        net(torch.ones(1, 2))
    pending.arm(CollectiveAborted("rank 1 is gone", rank=1, seq=9), owner="group b")
    pending.disarm("group b")
    net(torch.ones(1, 2))
    opt.step()
