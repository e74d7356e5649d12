"""GIL-free socket I/O: scatter-gather sends, receives straight into the
caller's buffers, and the coordinator's streaming reduce over many sockets.

Every call here takes an inactivity timeout: it fails only when no byte moved
for that long. A signal (Ctrl-C) interrupts a blocked call: the C side
returns, the handlers run with the GIL held, and the call resumes where it
stopped unless a handler raised.
"""
from cpython.buffer cimport PyObject_GetBuffer, PyBuffer_Release, PyBUF_ANY_CONTIGUOUS
from libc.stdint cimport uint8_t, uint32_t, uint64_t, int64_t
from libc.stdlib cimport malloc, calloc, free
from libc.errno cimport errno
import os
import socket as _socket

from ddpwire._buffer cimport acquire_float32
import time as _time

import numpy as _np

from .wire.errors import PeerLost, DdpwireError, ProtocolError, UnexpectedMessage, integrity_error

cdef extern from "Python.h":
    int PyErr_CheckSignals() except -1

cdef enum:
    MAX_PARTS = 8


cdef int timeout_ms(object timeout) except? -2:
    """Seconds (float) to poll()'s milliseconds; None is not accepted: every
    blocking call in ddpwire has a deadline."""
    if timeout is None:
        raise ValueError("timeout must be a number of seconds, not None")
    t = float(timeout)
    if not t >= 0:  # NaN fails this too: it would wait forever
        raise ValueError(f"timeout must be >= 0, got {timeout!r}")
    if t * 1000.0 > 2147483647:
        return 2147483647
    return <int>(t * 1000.0 + 0.5)


cdef int64_t deadline_ms(object deadline) except? -2:
    """A time.monotonic() deadline (or None: none) on the C layer's clock."""
    if deadline is None:
        return -1
    left = float(deadline) - _time.monotonic()
    if not left == left:
        raise ValueError("deadline must be a number, not NaN")
    return ddpw_net_now_ms() + <int64_t>(max(0.0, min(left, 1e9)) * 1000.0)


cdef HeldBuffer get_float32(object obj, str name, bint writable):
    """Hold obj's buffer after the checks every compiled unit makes (see _buffer.pxd)."""
    cdef HeldBuffer b = HeldBuffer()
    acquire_float32(obj, &b.view, writable, name)
    b.held = True
    return b


cdef HeldBuffer get_bytes(object obj, str name):
    cdef HeldBuffer b = HeldBuffer()
    try:
        PyObject_GetBuffer(obj, &b.view, PyBUF_ANY_CONTIGUOUS)
    except (TypeError, BufferError):
        raise TypeError(f"{name}: expected a contiguous bytes-like object, got {type(obj).__name__}") from None
    b.held = True
    return b


cdef int fill_iov(object parts, iovec *iov, list held) except -1:
    """Point iov at each non-None part (at most MAX_PARTS), keeping their
    buffers held in ``held``; returns the count."""
    cdef int k = 0
    cdef HeldBuffer b
    for part in parts:
        if part is None:
            continue
        if k == MAX_PARTS:
            raise ValueError(f"at most {MAX_PARTS} parts per send")
        b = get_bytes(part, "part")
        held.append(b)
        iov[k].iov_base = b.view.buf
        iov[k].iov_len = <size_t>b.view.len
        k += 1
    return k


cdef int fill_recv_iov(object bufs, iovec *iov, list held) except -1:
    """Point iov at each writable buffer of bufs (at most MAX_PARTS), keeping
    them held in ``held``; returns the count."""
    cdef int m = 0
    cdef HeldBuffer b
    for buf in bufs:
        if m == MAX_PARTS:
            raise ValueError(f"at most {MAX_PARTS} buffers per receive")
        b = get_bytes(buf, "buf")
        if b.view.readonly:
            raise TypeError("buf: expected a writable buffer")
        held.append(b)
        iov[m].iov_base = b.view.buf
        iov[m].iov_len = <size_t>b.view.len
        m += 1
    return m


cdef size_t iov_bytes(const iovec *iov, int k):
    cdef size_t t = 0
    cdef int i
    for i in range(k):
        t += iov[i].iov_len
    return t


cdef class Connection:
    """One TCP connection to a peer, with the peer's identity for error messages.

    ``lost`` is the PeerLost subclass raised when the peer disconnects or stays
    silent (WorkerLost on the coordinator's side, CoordinatorLost on a worker's).
    """
    cdef readonly object sock
    cdef readonly int fd
    # how bytes move on fd (csrc/link.h): plain until seal()
    cdef ddpw_link link
    cdef public object peer_id
    cdef public object lost
    cdef public str peer_name
    # GIL-free calls using fd right now (this thread or others); close()
    # defers the real close until the last one has left
    cdef int busy
    cdef bint closing

    def __cinit__(self):
        ddpw_link_plain(&self.link, -1)

    def __dealloc__(self):
        ddpw_link_release(&self.link)

    def __init__(self, sock, *, peer_id=None, lost=PeerLost, peer_name="peer"):
        self.sock = sock
        self.fd = sock.fileno()
        ddpw_link_plain(&self.link, self.fd)
        self.busy = 0
        self.closing = False
        self.peer_id = peer_id
        self.lost = lost
        self.peer_name = peer_name
        # Small frames (shard assignments, heads) must not wait for Nagle.
        sock.setsockopt(_socket.IPPROTO_TCP, _socket.TCP_NODELAY, 1)

    def fileno(self):
        return self.fd

    def seal(self, send_key, recv_key):
        """From here on every byte either way goes in AES-256-GCM records
        under these 32-byte keys (csrc/sealed.c); the peer seals its side
        at the same byte of each stream, with the keys swapped. A record
        that fails to open raises IntegrityError naming the peer. Needs
        libcrypto loaded (ddpwire.wire.seal) and no call in flight."""
        cdef const uint8_t *tx
        cdef const uint8_t *rx
        cdef int rc
        if not isinstance(send_key, bytes) or not isinstance(recv_key, bytes) or \
                len(send_key) != DDPW_AEAD_KEY_BYTES or len(recv_key) != DDPW_AEAD_KEY_BYTES:
            raise ValueError(f"seal: two keys of {DDPW_AEAD_KEY_BYTES} bytes are needed")
        if not ddpw_aead_ready():
            raise RuntimeError("seal: libcrypto is not loaded (ddpwire.wire.seal.load_libcrypto)")
        self.check_open()
        if self.busy:
            raise RuntimeError("seal: a call is using the connection")
        tx = <const uint8_t *>(<bytes>send_key)
        rx = <const uint8_t *>(<bytes>recv_key)
        rc = ddpw_link_seal(&self.link, self.fd, tx, rx)
        if rc == DDPW_NET_NOMEM:
            raise MemoryError("seal")
        if rc != DDPW_NET_OK:
            raise RuntimeError("seal: libcrypto refused the key")

    @property
    def sealed(self):
        """Whether the connection's bytes go in sealed records."""
        return bool(ddpw_link_sealed(&self.link))

    def held(self):
        """Bytes received and opened but not yet taken: a wait on the
        socket would not see them, so whoever polls fileno() looks here first."""
        return ddpw_link_held(&self.link)

    def close(self):
        """Close the connection. A call blocked on it in another thread (the
        GIL is released there) is woken by a shutdown and fails with the
        ``lost`` error; the descriptor itself is closed only when the last
        such call has returned, so its number cannot be reused under it."""
        if self.fd < 0 or self.closing:
            return
        if self.busy == 0:
            self.close_now()
            return
        self.closing = True
        try:
            self.sock.shutdown(_socket.SHUT_RDWR)
        except OSError:
            pass

    cdef close_now(self):
        self.fd = -1
        ddpw_link_release(&self.link)
        try:
            self.sock.close()
        except OSError:
            pass

    cdef int enter(self) except -1:
        """Before a call uses fd without the GIL; pair with leave()."""
        self.check_open()
        self.busy += 1
        return 0

    cdef leave(self):
        self.busy -= 1
        if self.closing and self.busy == 0:
            self.close_now()

    cdef fail(self, int rc, int err, object step, str what, int ms, object deadline=None,
              bint sending=False):
        if rc == DDPW_NET_TIMEOUT:
            if deadline is not None and _time.monotonic() >= deadline - 0.001:
                if sending:
                    # a reader that takes a byte now and then is not silent
                    raise self.lost(f"{self.peer_name} read too slowly: {what} was not done "
                                    f"by the deadline", worker_id=self.peer_id, step=step)
                raise self.lost(f"{self.peer_name} silent (heartbeats aside) past the deadline "
                                f"while {what}", worker_id=self.peer_id, step=step)
            raise self.lost(f"{self.peer_name} silent for {ms / 1000.0:g} s while {what}",
                            worker_id=self.peer_id, step=step)
        if rc == DDPW_NET_EOF:
            raise self.lost(f"{self.peer_name} disconnected while {what}",
                            worker_id=self.peer_id, step=step)
        if rc == DDPW_NET_NOMEM:
            raise MemoryError(what)
        if rc == DDPW_NET_INTEGRITY:
            raise integrity_error(self.lost)(
                f"{self.peer_name}: a sealed record failed authentication while {what} (altered, "
                f"replayed, reordered, dropped or injected on the way); nothing of it was used",
                worker_id=self.peer_id, step=step)
        raise self.lost(f"{self.peer_name} connection failed while {what}: {os.strerror(err)}",
                        worker_id=self.peer_id, step=step)

    cdef check_open(self):
        if self.fd < 0 or self.closing:
            raise self.lost(f"{self.peer_name} connection is closed", worker_id=self.peer_id)

    def recv_into(self, buf, timeout, *, deadline=None, bint check_finite=False, step=None,
                  str what="receiving"):
        """Fill the whole writable buffer ``buf`` from the socket (GIL released).

        ``timeout`` bounds silence; ``deadline`` (a time.monotonic() value)
        bounds the whole receive, however the bytes trickle in. With
        ``check_finite`` the buffer's float32 elements are checked as they
        land, and the index of the first NaN or +/-inf (or None) is returned."""
        cdef HeldBuffer b = get_bytes(buf, "buf")
        cdef size_t done = 0
        cdef int err = 0, rc, ms = timeout_ms(timeout)
        cdef int64_t until = deadline_ms(deadline)
        cdef ddpw_finite_watch watch
        if b.view.readonly:
            raise TypeError("buf: expected a writable buffer")
        watch.base = <const uint8_t *>b.view.buf
        watch.len = <size_t>b.view.len if check_finite else 0
        watch.checked = 0
        watch.bad = -1
        self.enter()
        try:
            while True:
                with nogil:
                    rc = ddpw_net_recv_exact(&self.link, b.view.buf, <size_t>b.view.len, &done, ms,
                                             until, &watch, &err)
                if rc == DDPW_NET_EINTR:
                    PyErr_CheckSignals()
                    continue
                if rc != DDPW_NET_OK:
                    self.fail(rc, err, step, f"{what} ({done} of {b.view.len} bytes)", ms,
                              deadline)
                return watch.bad if watch.bad >= 0 else None
        finally:
            self.leave()

    cdef Py_ssize_t peek(self, uint8_t *buf, size_t cap) except -1:
        """Bytes already received, copied to buf and left in the socket."""
        cdef size_t got = 0
        cdef int err = 0, rc
        self.check_open()  # no wait: nothing to enter
        while True:
            rc = ddpw_link_peek(&self.link, buf, cap, &got, &err)
            if rc == DDPW_NET_EINTR:
                PyErr_CheckSignals()
                continue
            if rc == DDPW_NET_EOF:
                return 0  # the receive that follows reports it, with context
            if rc != DDPW_NET_OK:
                self.fail(rc, err, None, "receiving", 0)
            return <Py_ssize_t>got

    def recv_exact(self, Py_ssize_t n, timeout, *, step=None, str what="receiving"):
        """Receive exactly n bytes and return them."""
        out = bytearray(n)
        self.recv_into(out, timeout, step=step, what=what)
        return bytes(out)

    def send_parts(self, parts, timeout, *, deadline=None, step=None, str what="sending"):
        """Send the concatenation of ``parts`` (bytes-like objects, at most 8)
        with scatter-gather writes: no part is copied (GIL released).
        ``timeout`` bounds a peer that takes no byte; ``deadline`` (a
        time.monotonic() value) the whole send, however slowly it reads."""
        cdef iovec iov[MAX_PARTS]
        cdef int k = 0, err = 0, rc, ms = timeout_ms(timeout)
        cdef int64_t until = deadline_ms(deadline)
        cdef size_t done = 0
        cdef list held = []
        k = fill_iov(parts, iov, held)
        self.enter()
        try:
            while True:
                with nogil:
                    rc = ddpw_net_send_iov(&self.link, iov, k, &done, ms, until, &err)
                if rc == DDPW_NET_EINTR:
                    PyErr_CheckSignals()
                    continue
                if rc != DDPW_NET_OK:
                    self.fail(rc, err, step, what, ms, deadline, True)
                return
        finally:
            self.leave()


def load_libcrypto(path):
    """Load libcrypto's AES-256-GCM from ``path`` for sealed links
    (ddpwire.wire.seal.load_libcrypto chooses the file); OSError saying what is
    missing. Once loaded, later calls do nothing."""
    cdef char why[512]
    cdef bytes name = os.fsencode(path)
    if ddpw_aead_load(name, why, sizeof(why)) != 0:
        raise OSError((<bytes>why).decode("utf-8", "replace"))


def libcrypto_loaded():
    """Whether load_libcrypto succeeded."""
    return bool(ddpw_aead_ready())


SEALED_RECORD = DDPW_SEALED_RECORD


def send_many(list conns, parts, timeout, *, step=None, str what="broadcasting"):
    """Send the same parts to every connection at once (GIL released): each
    socket is written as soon as it can take bytes, so one slow reader does
    not serialise the broadcast."""
    cdef iovec iov[MAX_PARTS]
    cdef int k = 0, err = 0, rc, ms = timeout_ms(timeout)
    cdef size_t n = len(conns), failed = 0, i
    cdef list held = []
    cdef Connection c
    cdef ddpw_link **links = NULL
    cdef size_t *done = NULL
    cdef size_t entered = 0
    k = fill_iov(parts, iov, held)
    if n == 0:
        return
    links = <ddpw_link **>malloc(n * sizeof(ddpw_link *))
    done = <size_t *>malloc(n * sizeof(size_t))
    try:
        if links is NULL or done is NULL:
            raise MemoryError()
        for i in range(n):
            c = conns[i]
            c.enter()
            entered += 1
            links[i] = &c.link
            done[i] = 0
        while True:
            with nogil:
                rc = ddpw_net_send_many(links, n, iov, k, done, ms, &failed, &err)
            if rc == DDPW_NET_EINTR:
                PyErr_CheckSignals()
                continue
            if rc != DDPW_NET_OK:
                (<Connection>conns[failed]).fail(rc, err, step, what, ms)
            return
    finally:
        for i in range(entered):
            (<Connection>conns[i]).leave()
        free(links)
        free(done)


def set_kernel_chunk(size_t elements):
    """How many elements exchange_many's kernels narrow ahead and reduce or
    widen per call at least (0: the defaults). A few make every phase run
    them in many short ranges, for tests; not while an exchange runs."""
    ddpw_net_set_kernel_chunk(elements)


cdef void *_kernel_floats(object buf, str name, size_t i, bint writable, const iovec *iov,
                          int cnt, str side, list held) except? NULL:
    """The float32 buffer that connection i's one 16-bit send or receive is
    narrowed from or widened into, held; its element count must match."""
    cdef HeldBuffer h = get_float32(buf, name, writable)
    held.append(h)
    if cnt != 1 or h.view.len // 4 * 2 != <Py_ssize_t>iov[0].iov_len:
        raise ValueError(f"exchange_many: {name}[{i}] has {h.view.len // 4} elements, its "
                         f"{side} {iov_bytes(iov, cnt)} bytes")
    return h.view.buf


cdef HeldBuffer _held16(object obj, str name, bint writable):
    cdef HeldBuffer b = HeldBuffer()
    acquire_uint16(obj, &b.view, writable, name)
    b.held = True
    return b


def exchange_many(list conns, sends, recvs, timeout, *, deadline=None, step=None,
                  str what="exchanging", codec=None, narrow_from=None, widen_into=None,
                  reduce=None):
    """Send ``sends[i]`` to ``conns[i]`` while filling ``recvs[i]`` from it, for
    every i at once, in one GIL-free poll loop: the data plane of a mesh
    reduce, where every worker sends to every other one. Receiving never
    waits for sending, so peers that all send before they read cannot
    deadlock. A ``None`` connection is an empty slot (the caller itself).

    ``sends[i]`` is a list of bytes-like objects (None entries skipped) and
    ``recvs[i]`` one of writable buffers, at most 8 each, each list taken as
    one concatenation (None: nothing). ``timeout`` bounds silence on every socket together;
    ``deadline`` (time.monotonic()) the whole call. A failure is the failing
    connection's ``lost`` error, naming that peer.

    Kernels run on the elements as they move, so that no pass over a
    vector waits for its last byte or holds up its first (csrc/net.h,
    ddpw_net_kernels). ``codec`` ("bf16", "fp16"; None: float32) is the
    elements' wire format. ``narrow_from[i]`` (float32; None: nothing) is
    narrowed into ``sends[i]``'s one part (uint16) just ahead of its bytes
    going out; ``recvs[i]``'s one buffer (uint16) is widened into
    ``widen_into[i]`` (float32) as it arrives. ``reduce`` is ``(inputs,
    sources, out, divide, own_from)``: ``out`` becomes the mean (``divide``;
    in 16 bits always) or the sum of ``inputs`` in order, range by range as
    they arrive: ``inputs[j]`` is ``recvs[sources[j]]``'s one buffer, or
    with ``sources[j]`` None this member's own, narrowed from ``own_from``
    (16 bits; None: already there) just before its range is reduced.
    Returns the first non-finite input element of the reduce as (input,
    index), or None."""
    cdef size_t n = len(conns), i, failed = 0, k = 0, width = 4
    cdef int err = 0, rc, ms = timeout_ms(timeout)
    cdef int64_t until = deadline_ms(deadline)
    cdef ddpw_net_peer_io *peers = NULL
    cdef iovec *iovs = NULL
    cdef ddpw_net_kernels kern
    cdef ddpw_net_kernels *use = NULL
    cdef size_t *cursors = NULL
    cdef void **ptrs = NULL
    cdef size_t *froms = NULL
    cdef const float **narrows = NULL
    cdef float **widens = NULL
    cdef const void **ins = NULL
    cdef list held = []
    cdef list entered = []
    cdef Connection c
    cdef HeldBuffer h
    if <size_t>len(sends) != n or <size_t>len(recvs) != n:
        raise ValueError(f"exchange_many: {n} connections but {len(sends)} sends and "
                         f"{len(recvs)} receives")
    if n > DDPW_NET_MAX_PEERS:
        raise ValueError(f"exchange_many: at most {DDPW_NET_MAX_PEERS} peers, got {n}")
    memset(&kern, 0, sizeof(kern))
    kern.bad_index = -1
    if codec is not None:
        kern.codec = _codec(codec)
        width = 2
    for name, arg in (("narrow_from", narrow_from), ("widen_into", widen_into)):
        if arg is not None and (codec is None or <size_t>len(arg) != n):
            raise ValueError(f"exchange_many: {name} needs a 16-bit codec and one entry "
                             f"per connection")
    if reduce is not None:
        inputs, sources, out, divide, own_from = reduce
        k = len(inputs)
        if <size_t>len(sources) != k or k > DDPW_NET_MAX_PEERS + 1:
            raise ValueError(f"exchange_many: {k} reduce inputs, {len(sources)} sources")
    if n == 0 and k == 0:
        return None
    peers = <ddpw_net_peer_io *>calloc(n + 1, sizeof(ddpw_net_peer_io))
    iovs = <iovec *>calloc(2 * (n + 1) * MAX_PARTS, sizeof(iovec))
    # the kernels' arrays: cursors (narrowed, widened, from) and pointers
    # (narrow_from, widen_into, inputs)
    cursors = <size_t *>calloc(2 * (n + 1) + k + 1, sizeof(size_t))
    ptrs = <void **>calloc(2 * (n + 1) + k + 1, sizeof(void *))
    try:
        if peers is NULL or iovs is NULL or cursors is NULL or ptrs is NULL:
            raise MemoryError()
        # every buffer is held before any connection is entered
        for i in range(n):
            peers[i].link = NULL
            if conns[i] is None:
                continue
            c = <Connection?>conns[i]
            peers[i].out_iov = &iovs[2 * i * MAX_PARTS]
            peers[i].out_cnt = fill_iov(() if sends[i] is None else sends[i], &iovs[2 * i * MAX_PARTS], held)
            peers[i].in_iov = &iovs[(2 * i + 1) * MAX_PARTS]
            peers[i].in_cnt = fill_recv_iov(() if recvs[i] is None else recvs[i],
                                             &iovs[(2 * i + 1) * MAX_PARTS], held)
        if narrow_from is not None or widen_into is not None or k or codec is not None:
            use = &kern
            kern.narrowed = cursors
            kern.widened = cursors + (n + 1)
            froms = cursors + 2 * (n + 1)
            kern.from_ = froms
            if narrow_from is not None:
                narrows = <const float **>ptrs
                kern.narrow_from = narrows
                for i in range(n):
                    if narrow_from[i] is not None and conns[i] is not None:
                        narrows[i] = <const float *>_kernel_floats(
                            narrow_from[i], "narrow_from", i, False, peers[i].out_iov,
                            peers[i].out_cnt, "send", held)
            if widen_into is not None:
                widens = <float **>(ptrs + (n + 1))
                kern.widen_into = widens
                for i in range(n):
                    if widen_into[i] is not None and conns[i] is not None:
                        widens[i] = <float *>_kernel_floats(
                            widen_into[i], "widen_into", i, True, peers[i].in_iov,
                            peers[i].in_cnt, "receive", held)
            if k:
                kern.k = k
                ins = <const void **>(ptrs + 2 * (n + 1))
                kern.inputs = ins
                kern.divide = 1 if divide else 0
                h = get_float32(out, "out", True) if codec is None else _held16(out, "out", True)
                held.append(h)
                kern.out = h.view.buf
                kern.count = <size_t>(h.view.len // <Py_ssize_t>width)
                for i in range(k):
                    h = get_float32(inputs[i], "input", True) if codec is None else \
                        _held16(inputs[i], "input", True)
                    held.append(h)
                    if <size_t>(h.view.len // <Py_ssize_t>width) != kern.count:
                        raise ValueError(f"exchange_many: reduce input {i} has "
                                         f"{h.view.len // <Py_ssize_t>width} elements, out "
                                         f"{kern.count}")
                    ins[i] = h.view.buf
                    if sources[i] is None:
                        froms[i] = DDPW_NET_OWN
                    else:
                        froms[i] = <size_t>sources[i]
                        if froms[i] >= n or conns[froms[i]] is None:
                            raise ValueError(f"exchange_many: reduce input {i} arrives from "
                                             f"no connection ({sources[i]})")
                        # the C loop reads it as its bytes land there
                        if peers[froms[i]].in_cnt != 1 or \
                                peers[froms[i]].in_iov[0].iov_base != h.view.buf:
                            raise ValueError(f"exchange_many: reduce input {i} is not the "
                                             f"buffer received from connection {sources[i]}")
                if own_from is not None:
                    h = get_float32(own_from, "own_from", False)
                    held.append(h)
                    if <size_t>(h.view.len // 4) != kern.count:
                        raise ValueError(f"exchange_many: own_from has {h.view.len // 4} "
                                         f"elements, out {kern.count}")
                    kern.own_from = <const float *>h.view.buf
        for i in range(n):
            if conns[i] is None:
                continue
            c = conns[i]
            c.enter()
            entered.append(c)
            peers[i].link = &c.link
        while True:
            with nogil:
                rc = ddpw_net_exchange_kernels(peers, n, use, ms, until, &failed, &err)
            if rc == DDPW_NET_EINTR:
                PyErr_CheckSignals()
                continue
            if rc == DDPW_NET_NOMEM:
                raise MemoryError(what)
            if rc != DDPW_NET_OK:
                i = failed
                (<Connection>conns[i]).fail(
                    rc, err, step,
                    f"{what} (sent {peers[i].sent} of "
                    f"{iov_bytes(peers[i].out_iov, peers[i].out_cnt)} bytes, received "
                    f"{peers[i].received} of {iov_bytes(peers[i].in_iov, peers[i].in_cnt)} bytes)",
                    ms, deadline)
            return None if kern.bad_index < 0 else (int(kern.bad_input), int(kern.bad_index))
    finally:
        for c in entered:
            c.leave()
        free(peers)
        free(iovs)
        free(cursors)
        free(ptrs)


def reduce_stream(list conns, out, size_t tail_len, timeout, *, size_t ring_bytes=1 << 20,
                  bint socket_threads=False, step=None, str what="receiving gradients",
                  scales=None):
    """Receive one float32 vector of len(out) elements from every connection,
    followed by ``tail_len`` bytes each, and average them into ``out`` as the
    bytes arrive: the sum in connection order, then a division by the count.

    Returns ``(tails, bad)``: the tail bytes of each connection, and None or,
    per connection, ``(index, value)`` of its first non-finite element (index
    -1 if it had none).
    When bad is not None, ``out`` holds no meaningful result.

    With ``socket_threads`` each connection gets its own receiving thread
    (see allreduce_stream); the result is the same, bit for bit. ``scales``
    as for allreduce_stream.
    """
    return allreduce_stream(conns, out, tail_len, None, None, timeout, ring_bytes=ring_bytes,
                            socket_threads=socket_threads, step=step, what=what, scales=scales)


def allreduce_stream(list conns, out, size_t tail_len, head, make_tail, timeout, *,
                     size_t ring_bytes=1 << 20, bint socket_threads=False, step=None,
                     str what="averaging gradients", bint halt_on_nonfinite=True,
                     scales=None):
    """reduce_stream fused with the broadcast of its result.

    While the vectors arrive, every connection is sent ``head`` (the reply's
    frame up to its elements) and then each range of ``out`` as soon as it is
    averaged; reads never wait for writes. Once every connection's tail is
    in, ``make_tail(tails)`` is called (GIL held) for the bytes that end the
    reply, and they go out too. All in GIL-free poll loops.

    Returns ``(tails, bad)`` as reduce_stream does. When bad is not None,
    sending stopped at the first non-finite value, make_tail was not called,
    and every reply is cut short: the caller must close the connections.
    With ``head`` None nothing is sent (that is reduce_stream).

    With ``halt_on_nonfinite`` False a non-finite value stops nothing: it
    is still reported in bad (each connection's first, as above), but every
    element is averaged (where an input is NaN or inf, the result is what
    float32 arithmetic gives), make_tail is called and every reply is
    completed, so the connections stay usable. For callers that let the
    peers hold the reply until a later message says whether the step halted.

    ``socket_threads`` gives every connection a receiving and a sending
    thread (csrc/threaded.c) instead of one poll loop for all, so the
    kernel's copies in and out of the sockets spread over the cores; same
    bytes, same result.

    ``scales`` (None, or a float per connection) multiplies each
    connection's elements, rounded once in float32 and after they are
    checked, before they are summed: the sample weights of peers that do
    not apply their own (ddpwire.session.balance). A scale of 1 changes nothing.
    """
    cdef HeldBuffer o = get_float32(out, "out", True)
    cdef HeldBuffer h = get_bytes(head if head is not None else b"", "head")
    cdef bint reply = head is not None
    cdef HeldBuffer t
    cdef size_t n = len(conns), failed = 0, i
    cdef int err = 0, rc, ms = timeout_ms(timeout)
    cdef ddpw_net_reduce_state st
    cdef ddpw_link **links = NULL
    cdef Connection c
    cdef size_t *sent = NULL
    cdef size_t entered = 0
    cdef bytearray tails = bytearray(n * tail_len)
    cdef uint8_t *tails_p = <uint8_t *>(<char *>tails) if n * tail_len > 0 else NULL
    cdef float *out_p = <float *>o.view.buf
    cdef const uint8_t *head_p = <const uint8_t *>h.view.buf
    cdef size_t head_len = <size_t>h.view.len
    cdef iovec iov[3]
    cdef float[::1] weights
    if n == 0:
        raise ValueError("conns: at least one connection is needed")
    if scales is not None:
        # float32, as the peers that weight their own gradients round it
        weights = _np.asarray(scales, dtype=_np.float32).reshape(-1).copy()
        if <size_t>weights.shape[0] != n:
            raise ValueError(f"scales: one per connection ({n}), got {weights.shape[0]}")
        for i in range(n):
            if not (weights[i] >= 0.0 and isfinite(weights[i])):
                raise ValueError(f"scales[{i}]: a finite factor >= 0, got {scales[i]!r}")
    rc = ddpw_net_reduce_init(&st, n, <size_t>o.view.len, tail_len, ring_bytes)
    if rc != DDPW_NET_OK:
        raise MemoryError("allreduce_stream: could not allocate receive rings")
    st.finish_on_nonfinite = 0 if halt_on_nonfinite else 1
    if scales is not None:
        st.scales = &weights[0]
    links = <ddpw_link **>malloc(n * sizeof(ddpw_link *))
    sent = <size_t *>calloc(n, sizeof(size_t))
    try:
        if links is NULL or sent is NULL:
            raise MemoryError()
        for i in range(n):
            (<Connection>conns[i]).enter()
            entered += 1
            c = conns[i]
            links[i] = &c.link
        if socket_threads:
            rc = run_threaded(&st, links, out_p, tails_p, head_p, head_len,
                              sent if reply else NULL, ms, &failed, &err)
        else:
            while True:
                with nogil:
                    rc = ddpw_net_allreduce_stream(&st, links, out_p, tails_p, head_p, head_len,
                                                   sent if reply else NULL, ms, &failed, &err)
                if rc == DDPW_NET_EINTR:
                    PyErr_CheckSignals()
                    continue
                break
        if rc != DDPW_NET_OK and rc != DDPW_NET_NONFINITE:
            progress = f"{st.recv[failed]} of {st.grad_bytes + st.tail_len} bytes"
            if reply:
                progress += f" in, {sent[failed]} of {head_len + st.grad_bytes} out"
            try:
                (<Connection>conns[failed]).fail(rc, err, step, f"{what} ({progress})", ms)
            except PeerLost as exc:
                # how far each connection got: the bytes of the others' frames
                # still to read, for a caller that goes on without the one lost
                exc.received = [st.recv[i] for i in range(n)]
                raise
        tail_list = [bytes(tails[i * tail_len:(i + 1) * tail_len]) for i in range(n)]
        # a finishing call comes back OK with the findings in st
        bad = [(st.bad_index[i], st.bad_value[i]) for i in range(n)] if st.nonfinite else None
        if rc == DDPW_NET_NONFINITE or not reply:
            return tail_list, bad
        t = get_bytes(make_tail(tail_list), "make_tail()")
        iov[0].iov_base = <void *>head_p
        iov[0].iov_len = head_len
        iov[1].iov_base = <void *>out_p
        iov[1].iov_len = st.grad_bytes
        iov[2].iov_base = t.view.buf
        iov[2].iov_len = <size_t>t.view.len
        while True:
            with nogil:
                rc = ddpw_net_send_many(links, n, iov, 3, sent, ms, &failed, &err)
            if rc == DDPW_NET_EINTR:
                PyErr_CheckSignals()
                continue
            if rc != DDPW_NET_OK:
                (<Connection>conns[failed]).fail(rc, err, step, f"{what} (sending the end of the reply)", ms)
            return tail_list, bad
    finally:
        for i in range(entered):
            (<Connection>conns[i]).leave()
        free(links)
        free(sent)
        ddpw_net_reduce_free(&st)


cdef int run_threaded(ddpw_net_reduce_state *st, ddpw_link **links, float *out_p, uint8_t *tails_p,
                      const uint8_t *head_p, size_t head_len, size_t *sent, int ms,
                      size_t *failed, int *err) except? -100:
    """ddpw_net_allreduce_stream's work on a receiving and a sending thread
    per socket; a handler that raises (Ctrl-C) stops and joins the threads
    before it propagates."""
    cdef ddpw_threaded *h = NULL
    cdef int rc
    with nogil:
        rc = ddpw_threaded_start(&h, st, links, out_p, tails_p, head_p, head_len, sent, ms, err)
    if rc != DDPW_NET_OK:
        if rc == DDPW_NET_NOMEM:
            raise MemoryError("allreduce_stream: could not start the socket threads")
        raise OSError(err[0], f"allreduce_stream: could not start the socket threads: {os.strerror(err[0])}")
    try:
        while True:
            with nogil:
                rc = ddpw_threaded_wait(h, failed, err)
            if rc == DDPW_NET_EINTR:
                PyErr_CheckSignals()
                continue
            return rc
    finally:
        with nogil:
            ddpw_threaded_stop(h)


cdef class Exchange:
    """One frame going out on a connection while the reply comes in.

    Each ``recv_into`` fills the given buffers from the connection and,
    meanwhile, sends as much of the frame as the socket takes, in one GIL-free
    poll loop; reading never waits for sending. ``finish()`` sends whatever
    is left once the reply is in. Errors are the connection's ``lost`` class.

    With ``send_thread`` the frame goes out from a thread of its own
    (csrc/sender.c) while ``recv_into`` only receives, so the kernel's copies
    into and out of the socket run on two cores at once; ``finish()`` then
    waits for that thread. Call ``abandon()`` before closing the connection
    on an error: it stops the thread (dropping the Exchange does too).
    """
    cdef Connection conn
    cdef iovec iov[MAX_PARTS]
    cdef int k
    cdef int ms
    cdef list held
    cdef size_t sent_bytes
    cdef size_t total
    cdef object step
    cdef str what
    cdef ddpw_sender *sender
    cdef bint holding  # the sending thread uses conn's link: conn.enter() taken for it

    def __init__(self, Connection conn, parts, timeout, *, step=None, str what="sending",
                 bint send_thread=False):
        cdef int i, rc, err = 0
        self.conn = conn
        self.ms = timeout_ms(timeout)
        self.held = []
        self.k = fill_iov(parts, self.iov, self.held)
        self.total = 0
        for i in range(self.k):
            self.total += self.iov[i].iov_len
        self.sent_bytes = 0
        self.step = step
        self.what = what
        if send_thread:
            conn.enter()
            self.holding = True
            with nogil:
                rc = ddpw_sender_start(&self.sender, &conn.link, self.iov, self.k, 0, self.ms, &err)
            if rc != DDPW_NET_OK:
                self.release()
            if rc == DDPW_NET_NOMEM:
                raise MemoryError("Exchange: could not start the sending thread")
            if rc != DDPW_NET_OK:
                raise OSError(err, f"Exchange: could not start the sending thread: {os.strerror(err)}")

    def __dealloc__(self):
        if self.sender is not NULL:
            with nogil:
                ddpw_sender_stop(self.sender)
            self.sender = NULL
        self.release()

    cdef release(self):
        if self.holding:
            self.holding = False
            self.conn.leave()

    def abandon(self):
        """Stop sending (the frame stays cut short): the connection may then be closed."""
        if self.sender is not NULL:
            self.sent_bytes = ddpw_sender_progress(self.sender)
            with nogil:
                ddpw_sender_stop(self.sender)
            self.sender = NULL
        self.release()

    @property
    def sent(self):
        """Bytes of the frame sent so far."""
        if self.sender is not NULL:
            return ddpw_sender_progress(self.sender)
        return self.sent_bytes

    @property
    def done(self):
        """Whether the whole frame has been sent."""
        return self.sent >= self.total

    def recv_into(self, *bufs, str what="receiving", deadline=None, bint check_finite=False):
        """Fill every writable buffer of ``bufs`` in turn (at most 8) from the
        connection, sending meanwhile; ``deadline`` (time.monotonic()) bounds
        the receive however the bytes trickle in. With ``check_finite`` the
        float32 elements of the first buffer are checked as they land, and
        the index of the first NaN or +/-inf (or None) is returned."""
        cdef ddpw_finite_watch watch
        cdef iovec in_iov[MAX_PARTS]
        cdef list held = []
        cdef int m = 0, err = 0, rc
        cdef size_t received = 0, in_total = 0, sent = self.sent_bytes
        cdef int64_t until = deadline_ms(deadline)
        m = fill_recv_iov(bufs, in_iov, held)
        in_total = iov_bytes(in_iov, m)
        watch.base = <const uint8_t *>in_iov[0].iov_base if m else NULL
        watch.len = in_iov[0].iov_len if (m and check_finite) else 0
        watch.checked = 0
        watch.bad = -1
        # with a sending thread this loop only receives: it sends nothing
        # (an empty frame), and the thread's progress is reported instead
        cdef int out_k = 0 if self.sender is not NULL else self.k
        self.conn.enter()
        try:
            while True:
                with nogil:
                    rc = ddpw_net_exchange(&self.conn.link, self.iov, out_k, &sent,
                                           in_iov, m, &received, self.ms, until, &watch, &err)
                if self.sender is NULL:
                    self.sent_bytes = sent
                if rc == DDPW_NET_EINTR:
                    PyErr_CheckSignals()
                    continue
                if rc != DDPW_NET_OK:
                    self.abandon()
                    self.conn.fail(rc, err, self.step,
                                   f"{self.what} ({self.sent} of {self.total} bytes) and {what} "
                                   f"({received} of {in_total} bytes)", self.ms, deadline)
                return watch.bad if watch.bad >= 0 else None
        finally:
            self.conn.leave()

    def finish(self):
        """Send what is left of the frame (nothing, normally, once the reply is in)."""
        cdef int err = 0, rc
        cdef size_t sent
        if self.sender is not NULL:
            while True:
                with nogil:
                    rc = ddpw_sender_wait(self.sender, &err)
                if rc == DDPW_NET_EINTR:
                    PyErr_CheckSignals()
                    continue
                break
            self.abandon()  # joined: it has ended
            if rc != DDPW_NET_OK:
                self.conn.fail(rc, err, self.step,
                               f"{self.what} ({self.sent_bytes} of {self.total} bytes)", self.ms)
            return
        sent = self.sent_bytes
        if sent >= self.total:
            return
        self.conn.enter()
        try:
            while True:
                with nogil:
                    rc = ddpw_net_send_iov(&self.conn.link, self.iov, self.k, &sent, self.ms, -1, &err)
                self.sent_bytes = sent
                if rc == DDPW_NET_EINTR:
                    PyErr_CheckSignals()
                    continue
                if rc != DDPW_NET_OK:
                    self.conn.fail(rc, err, self.step,
                                   f"{self.what} ({sent} of {self.total} bytes)", self.ms)
                return
        finally:
            self.conn.leave()


# ---- frames over a connection ----

cdef class FrameHead:
    """What precedes the gradient elements of a frame being received: the
    elements themselves are still in the socket, to be received straight into
    their final buffer. ``component_sizes`` is a uint32 array (a compact
    copy: a hostile count costs 4 bytes an entry, not a Python int each)."""
    cdef readonly int tag
    cdef readonly str message_type
    cdef readonly unsigned long long step
    cdef readonly unsigned int worker_id
    cdef readonly unsigned int block_idx
    cdef readonly unsigned int num_blocks
    cdef readonly int component
    cdef readonly object component_sizes
    cdef readonly unsigned long long gradient_count
    cdef readonly size_t tail_len
    # the bulk field still in the socket: the gradient elements, or the data
    # of CollectiveRequest/CollectiveResult (read with collective_heads=True)
    cdef readonly unsigned long long bulk_len
    cdef readonly unsigned long long seq
    cdef readonly int kind
    cdef readonly int op
    cdef readonly int dtype
    cdef readonly unsigned int root
    cdef readonly unsigned long long count

    def __repr__(self):
        return (f"FrameHead({self.message_type}, step={self.step}, "
                f"gradient_count={self.gradient_count})")


# A frame head is decoded from one look at the socket when it fits here
# (every head but a block gradient's with hundreds of components).
DEF PEEK_BYTES = 512


def read_frame_head(Connection conn, timeout, uint64_t max_frame, *, deadline=None, expect=None,
                    step=None, str what="receiving", bint collective_heads=False):
    """Receive one frame up to its gradient elements (bytes after the last
    field are refused, as everywhere in a session).

    Returns a FrameHead for a gradient message, whose elements and tail are
    left in the socket, or the whole decoded message for any other.
    ``timeout`` bounds silence and ``deadline`` (time.monotonic()) the whole
    frame head. ``expect``, a sequence of message classes, refuses any other
    tag (UnexpectedMessage) before a byte of its body is allocated. With
    ``collective_heads``, CollectiveRequest/CollectiveResult also come back
    as a FrameHead (seq, kind, op, dtype, root, count), their ``bulk_len``
    data bytes left in the socket.
    """
    cdef uint8_t look[PEEK_BYTES]
    cdef Py_ssize_t got = conn.peek(look, PEEK_BYTES)
    cdef object fast = None
    if got >= 5:
        fast = head_from_peek(conn, look, <size_t>got, timeout, max_frame, expect, step, what,
                              collective_heads)
    if fast is not None:
        return fast
    return read_head_with(lambda view: conn.recv_into(view, timeout, deadline=deadline, step=step,
                                                      what=what),
                          max_frame, expect, conn.peer_id, step, collective_heads)


def exchange_frame_head(Exchange exchange, uint64_t max_frame, *, deadline=None, expect=None,
                        peer_id=None, step=None, str what="receiving",
                        bint collective_heads=False):
    """read_frame_head for the receiving side of an Exchange (its send goes on
    meanwhile)."""
    return read_head_with(lambda view: exchange.recv_into(view, what=what, deadline=deadline),
                          max_frame, expect, peer_id, step, collective_heads)


cdef int check_tag(uint8_t tag, uint32_t payload_len, uint64_t max_frame, object expect,
                   object peer_id, object step) except -1:
    """Refuse a frame by its tag and declared length, before its body is
    received or allocated: a tag the session does not expect here, or a
    length over that message's own limit."""
    cdef ddpw_error err
    cdef uint64_t limit
    if expect is not None and tag not in [cls.TAG for cls in expect]:
        name = ddpw_message_type(tag)
        got = (<bytes>name).decode("ascii") if name is not NULL else f"unknown message tag 0x{tag:02x}"
        # Heartbeats (and a timed worker's StepTiming) are allowed almost
        # everywhere: naming them would only add noise
        raise UnexpectedMessage(" or ".join(cls.__name__ for cls in expect
                                            if cls.TAG != DDPW_HEARTBEAT
                                            and cls.TAG != DDPW_STEP_TIMING), got,
                                worker_id=peer_id, step=step)
    limit = ddpw_tag_max_payload(tag, max_frame)
    if limit and payload_len > limit:
        ddpw_check_frame_len(payload_len, limit, &err)
        raise with_context(wire_error(&err), peer_id, step)
    return 0


cdef object head_from_peek(Connection conn, const uint8_t *look, size_t got, timeout,
                           uint64_t max_frame, object expect, object step, str what,
                           bint collective_heads):
    """The frame head decoded from bytes peeked at the socket, then taken from
    it (one receive, exactly the head's bytes); None when the head is not all
    there yet (the caller reads it piece by piece)."""
    cdef uint32_t payload_len = ddpw_read_prefix(look)
    cdef ddpw_error err
    cdef ddpw_head head
    cdef ddpw_status st
    if ddpw_check_frame_len(payload_len, max_frame, &err) != DDPW_OK:
        raise with_context(wire_error(&err), conn.peer_id, step)
    check_tag(look[4], payload_len, max_frame, expect, conn.peer_id, step)
    st = ddpw_decode_head(look + 4, got - 4, payload_len, 0, &head, &err)
    if st == DDPW_NEED_MORE:
        return None
    if st != DDPW_OK:
        raise with_context(wire_error(&err), conn.peer_id, step)
    if not head.has_gradients and not (collective_heads and head.has_bulk):
        if 4 + <size_t>payload_len > got:
            return None
        msg = decode_or_raise(bytearray(look[4:4 + payload_len]), conn.peer_id, step)
        conn.recv_into(bytearray(4 + payload_len), timeout, step=step, what=what)
        return msg
    fh = make_head(&head)
    conn.recv_into(bytearray(4 + head.bulk_offset),
                   timeout, step=step, what=what)
    return fh


cdef object read_head_with(object fill, uint64_t max_frame, object expect, object peer_id,
                           object step, bint collective_heads=False):
    """The frame-head reader over ``fill(view)``, which receives exactly
    len(view) bytes into view: the C decoder says how many bytes it needs
    next, so nothing past the head is taken from the socket."""
    cdef uint8_t prefix[4]
    cdef uint32_t payload_len
    cdef ddpw_error err
    cdef ddpw_head head
    cdef ddpw_status st
    cdef bytearray buf
    cdef size_t have = 0, need = 1
    cdef const uint8_t *p
    fill(<uint8_t[:4]>prefix)
    payload_len = ddpw_read_prefix(prefix)
    if ddpw_check_frame_len(payload_len, max_frame, &err) != DDPW_OK:
        raise with_context(wire_error(&err), peer_id, step)
    buf = bytearray()
    while True:
        if need > <size_t>len(buf):
            buf.extend(bytes(need - len(buf)))
        if need > have:
            fill(memoryview(buf)[have:need])
            if have == 0:
                check_tag(buf[0], payload_len, max_frame, expect, peer_id, step)
            have = need
        p = <const uint8_t *><char *>buf
        st = ddpw_decode_head(p, have, payload_len, 0, &head, &err)
        if st == DDPW_NEED_MORE:
            need = head.need
            continue
        if st != DDPW_OK:
            raise with_context(wire_error(&err), peer_id, step)
        break
    if not head.has_gradients and not (collective_heads and head.has_bulk):
        if payload_len > have:
            buf.extend(bytes(payload_len - len(buf)))
            fill(memoryview(buf)[have:])
        return decode_or_raise(buf, peer_id, step)
    return make_head(&head)


cdef object decode_or_raise(bytearray payload, object peer_id, object step):
    try:
        return decode_payload(payload)
    except ProtocolError as exc:
        raise with_context(exc, peer_id, step) from None


cdef FrameHead make_head(const ddpw_head *head):
    cdef FrameHead fh = FrameHead()
    cdef const ddpw_message *m = &head.msg
    cdef uint32_t[::1] sizes
    fh.tag = m.tag
    fh.message_type = (<bytes>ddpw_message_type(m.tag)).decode("ascii")
    fh.step = m.step
    fh.worker_id = m.worker_id
    fh.block_idx = m.block_idx
    fh.num_blocks = m.num_blocks
    fh.component = m.component
    fh.component_sizes = _np.empty(m.component_sizes.count, dtype=_np.uint32)
    if m.component_sizes.count:
        sizes = fh.component_sizes
        ddpw_load_u32s(<const uint8_t *>m.component_sizes.data, m.component_sizes.count, &sizes[0])
    fh.gradient_count = m.gradients.count
    fh.tail_len = head.tail_len
    fh.bulk_len = head.bulk_len
    fh.seq = m.seq
    fh.kind = m.kind
    fh.op = m.op
    fh.dtype = m.dtype
    fh.root = m.root
    fh.count = m.count
    return fh


cdef object with_context(object exc, object peer_id, object step):
    """The codec's error, naming the peer and step it came from."""
    if isinstance(exc, DdpwireError):
        exc.add_context(worker_id=peer_id, step=step)
    return exc


def decode_tail(int tag, tail):
    """(loss, correct, total, global_loss) from the bytes after a gradient
    message's elements (fields the message lacks are 0)."""
    cdef ddpw_message t
    cdef ddpw_error err
    cdef const uint8_t[::1] view = tail
    memset(&t, 0, sizeof(ddpw_message))
    if ddpw_decode_tail(<uint8_t>tag, &view[0] if len(view) else NULL, len(view), &t, &err) != DDPW_OK:
        raise wire_error(&err)
    return (ddpw_f32_to_f64(t.loss), t.correct, t.total, ddpw_f32_to_f64(t.global_loss))


def read_tail(Connection conn, FrameHead head, timeout, *, step=None):
    """Receive and decode the fields after a frame's gradient elements."""
    tail = conn.recv_exact(head.tail_len, timeout, step=step,
                           what=f"receiving the end of {head.message_type}")
    return decode_tail(head.tag, tail)
