"""A coordinator and worker threads running mesh steps, shared by
tests/test_mesh.py and tests/test_mesh_shm.py."""
from __future__ import annotations

import threading

import numpy as np

from ddpwire import Coordinator, Worker

ADDR = ("127.0.0.1", 0)
TIMEOUT = 20.0


def bits(a):
    return np.asarray(a, dtype=np.float32).view(np.uint32)


def gradients(n_workers, count, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(count).astype(np.float32) for _ in range(n_workers)]


class Session:
    """A coordinator and ``n`` worker threads, each running ``body(worker)``;
    ``workers`` maps a worker's thread index to Worker.connect arguments.
    ``planes`` says, for each worker whose body returned, whether its mesh
    was stepping through shared memory then."""

    def __init__(self, n, body, *, coordinator=None, workers=None, timeout=TIMEOUT):
        self.coord = Coordinator(ADDR, n, timeout=timeout, join_timeout=TIMEOUT,
                                 **(coordinator or {}))
        self.results, self.errors, self.planes = {}, {}, {}
        self.threads = []
        for i in range(n):
            kwargs = (workers or {}).get(i, {})
            t = threading.Thread(target=self._run, args=(body, kwargs, timeout), daemon=True)
            self.threads.append(t)
            t.start()
        self.coord.wait_for_workers()

    def _run(self, body, kwargs, timeout):
        w = None
        try:
            w = Worker.connect(self.coord.local_addr, timeout=timeout, **kwargs)
            self.results[w.worker_id] = body(w)
            self.planes[w.worker_id] = w._mesh_step.mesh is not None and w._mesh_step.mesh.plane is not None
        except BaseException as exc:  # handed to the test
            self.errors[w.worker_id if w is not None else -1] = exc
        finally:
            if w is not None:
                w.close()

    def join(self):
        for t in self.threads:
            t.join(3 * TIMEOUT)
            assert not t.is_alive(), "a worker thread hung"
        self.coord.close()


def flat_steps(grads, steps, mesh=True):
    """A body: ``steps`` allreduces of the worker's gradient into one
    buffer; the last average (a copy) and global loss. The worker must be
    on the mesh (``mesh``), or on the star (False)."""
    def body(w):
        g = grads[w.worker_id]
        out = np.empty(len(g), dtype=np.float32)
        for step in range(steps):
            result = w.allreduce(step, g, 0.5 + w.worker_id, w.worker_id, 10 + w.worker_id,
                                 out=out)
        assert w.uses_mesh == mesh
        return out.copy(), result.global_loss
    return body


def run_flat_steps(grads, steps=3, *, mesh=True, **coordinator):
    """A session of len(grads) workers running ``steps`` flat steps, every
    one finished without an error, on the mesh (or, ``mesh`` False, the
    star); the Session, for its results."""
    s = Session(len(grads), flat_steps(grads, steps, mesh), coordinator=coordinator)
    try:
        for step in range(steps):
            s.coord.allreduce(step)
    finally:
        s.join()
    assert not s.errors, s.errors
    return s


def halted_step(n, body, **coordinator):
    """A session of ``n`` workers whose step 0 the coordinator halts: the
    Session (joined) and the coordinator's NonFiniteGradient."""
    from ddpwire.wire.errors import NonFiniteGradient

    s = Session(n, body, coordinator=coordinator)
    try:
        try:
            s.coord.allreduce(0)
        except NonFiniteGradient as exc:
            halted = exc
        else:
            raise AssertionError("the coordinator did not halt step 0")
    finally:
        s.join()
    return s, halted


def untouched_out_step(grads, sentinel):
    """A body: one allreduce into an ``out`` filled with ``sentinel``, which
    must still hold only the sentinel afterwards, however the step ends
    (a halted step applies no element)."""
    def body(w):
        out = np.full(len(grads[0]), sentinel, dtype=np.float32)
        try:
            w.allreduce(0, grads[w.worker_id], 1.0, 1, 1, out=out)
        finally:
            assert (out == sentinel).all()  # not one element applied
    return body


# ---- Mesh objects on links made in-process (no coordinator) ----

def mesh_group(n, codec=None, fractions=None, timeout=TIMEOUT):
    """``n`` Mesh runners (worker ids 0..n-1) over loopback TCP links
    opened here, pair by pair, without the PeerHello (nothing else can
    reach them); ``codec`` a compression name (None: float32)."""
    import socket

    from ddpwire.plane import codecs, mesh as meshmod

    links = [[None] * n for _ in range(n)]
    try:
        for i in range(n):
            for j in range(i + 1, n):
                with socket.create_server(("127.0.0.1", 0)) as server:
                    a = socket.create_connection(server.getsockname()[:2], timeout=timeout)
                    b, _ = server.accept()
                links[i][j] = meshmod._peer_channel(a, j, timeout, 1 << 30)
                links[j][i] = meshmod._peer_channel(b, i, timeout, 1 << 30)
        code = codecs.codec_of(codec).code
        return [meshmod.Mesh(links[r], r, code, timeout, fractions=fractions) for r in range(n)]
    except BaseException:
        for row in links:
            for chan in row:
                if chan is not None:
                    chan.close()
        raise


def mesh_allreduce(meshes, step, grads, op=None):
    """One reduce-scatter and allgather of ``grads[r]`` on each mesh, in
    threads: per worker its result, its SliceOutcome, its error (each None
    where it did not come) and how many elements it averaged itself."""
    import time

    from ddpwire.wire.extensions import ReduceOp

    n = len(meshes)
    outs, outcomes, errors, owned = [None] * n, [None] * n, [None] * n, [None] * n

    def run(r):
        deadline = time.monotonic() + TIMEOUT
        try:
            outcomes[r] = meshes[r].reduce_scatter(step, grads[r], deadline,
                                                   op=ReduceOp.AVG if op is None else op)
            owned[r] = len(meshes[r]._own)
            # 16-bit words in, 16-bit words out (a bfloat16 tensor's); else float32
            out = np.full(len(grads[r]), 7, dtype=np.uint16) if grads[r].dtype == np.uint16 \
                else np.full(len(grads[r]), np.float32(-7.0), dtype=np.float32)
            outs[r] = meshes[r].allgather(step, out, deadline)
        except BaseException as exc:  # handed to the test
            errors[r] = exc
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(3 * TIMEOUT)
        assert not t.is_alive(), "a mesh step hung"
    return outs, outcomes, errors, owned
