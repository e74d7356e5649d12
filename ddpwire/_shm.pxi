"""Compiled glue for csrc/shm.c: one rank's view of a shared mapping (its
buffer held for the view's life, so the mapping cannot be closed under a
running collective). The public face is ddpwire.plane.shm."""
from cpython.buffer cimport PyBUF_SIMPLE, PyBUF_WRITABLE, PyBuffer_Release, PyObject_GetBuffer
from libc.string cimport memcpy, memset
from libc.stdint cimport int64_t, uint8_t, uint32_t, uint64_t

#: ShmArena.barrier results
SHM_OK = DDPW_SHM_OK
SHM_TIMEOUT = DDPW_SHM_TIMEOUT
SHM_ABORTED = DDPW_SHM_ABORTED

# How long one GIL-free wait lasts before the thread looks for a signal:
# short enough that Ctrl-C in a barrier is prompt.
DEF _SHM_SLICE_MS = 100


SHM_OFFER_LEN = DDPW_SHM_OFFER_LEN


def shm_offer_encode(bytes host_id, bytes nonce, uint64_t region_bytes, str name):
    """The offer's bytes (csrc/shm.h) for a segment: where it is and how to
    check it. ``shm_offer_encode(b"", b"", 0, "")`` is the offer of none."""
    cdef ddpw_shm_offer offer
    cdef bytes raw = name.encode("ascii")
    cdef bytes out = bytes(DDPW_SHM_OFFER_LEN)
    if raw and (len(host_id) != DDPW_SHM_HOST_ID or len(nonce) != DDPW_SHM_NONCE):
        raise ValueError(f"a shared-memory offer needs a {DDPW_SHM_HOST_ID}-byte host id and "
                         f"a {DDPW_SHM_NONCE}-byte nonce")
    if len(raw) > DDPW_SHM_NAME_MAX:
        raise ValueError(f"segment name {name!r} is over {DDPW_SHM_NAME_MAX} bytes")
    memset(&offer, 0, sizeof(offer))
    offer.offered = 1 if raw else 0
    if raw:
        memcpy(offer.host_id, <const char *>host_id, DDPW_SHM_HOST_ID)
        memcpy(offer.nonce, <const char *>nonce, DDPW_SHM_NONCE)
        memcpy(offer.name, <const char *>raw, len(raw))
    offer.region_bytes = region_bytes
    ddpw_shm_offer_encode(&offer, <uint8_t *><char *>out)
    return out


def shm_offer_decode(data):
    """(host_id, nonce, region_bytes, name) from an offer's bytes, or None
    for the offer of none; ValueError for bytes that are not an offer."""
    cdef ddpw_shm_offer offer
    cdef bytes raw = bytes(data)
    if ddpw_shm_offer_decode(<const uint8_t *><const char *>raw, len(raw), &offer) != 0:
        raise ValueError(f"not a shared-memory offer ({len(raw)} bytes)")
    if not offer.offered:
        return None
    return (bytes(offer.host_id[:DDPW_SHM_HOST_ID]), bytes(offer.nonce[:DDPW_SHM_NONCE]),
            offer.region_bytes, offer.name.decode("ascii"))


def shm_size(world, region_bytes):
    """Bytes of a mapping for ``world`` ranks and regions of ``region_bytes``
    (0 when impossible)."""
    return ddpw_shm_size(<uint32_t>world, <uint64_t>region_bytes)


cdef class ShmArena:
    """Rank ``rank`` of ``world`` on a mapping (any writable buffer of
    ``shm_size(world, region_bytes)`` bytes)."""

    cdef Py_buffer _view
    cdef bint _held
    # a close() while a call runs without the GIL waits for its end:
    # the mapping must outlive every C call on it
    cdef int _busy
    cdef bint _close_pending
    cdef readonly uint32_t rank
    cdef readonly uint32_t world
    cdef readonly uint64_t region_bytes
    # what stage() was given: reduce() reads this rank's slice from it (only
    # its address and length, to refuse another buffer), the op posted and
    # this rank's slice, which reduce() and gather(skip_own) take
    cdef const void *_staged
    cdef Py_ssize_t _staged_len
    cdef uint32_t _staged_op
    cdef size_t _own_start
    cdef size_t _own_count

    def __cinit__(self):
        self._held = False
        self._busy = 0
        self._close_pending = False
        self._staged = NULL
        self._staged_len = -1
        self._staged_op = DDPW_SHM_AVG
        self._own_start = 0
        self._own_count = 0

    def __init__(self, mapping, world, rank, region_bytes):
        if not 0 < world <= DDPW_SHM_MAX_WORLD or not 0 <= rank < world:
            raise ValueError(f"rank {rank} of {world} is not a shared-memory rank")
        PyObject_GetBuffer(mapping, &self._view, PyBUF_SIMPLE | PyBUF_WRITABLE)
        self._held = True
        self.world, self.rank, self.region_bytes = world, rank, region_bytes
        if <size_t>self._view.len != ddpw_shm_size(self.world, self.region_bytes):
            self.close()
            raise ValueError(f"a mapping of {world} regions of {region_bytes} bytes needs "
                             f"{shm_size(world, region_bytes)} bytes")

    def __dealloc__(self):
        if self._held:
            PyBuffer_Release(&self._view)

    def close(self):
        """Let go of the mapping's buffer, at once or, while an allreduce
        runs, when it returns. True when let go now."""
        if self._busy:
            self._close_pending = True
            return False
        if self._held:
            self._held = False
            PyBuffer_Release(&self._view)
        return True

    cdef void *_base(self) except NULL:
        if not self._held:
            raise ValueError("the shared-memory arena is closed")
        return self._view.buf

    def init(self, bytes nonce):
        """Fill the control block (the creator, on a zeroed mapping)."""
        if len(nonce) != DDPW_SHM_NONCE:
            raise ValueError(f"the nonce is {DDPW_SHM_NONCE} bytes")
        if ddpw_shm_init(self._base(), self._view.len, self.world, self.region_bytes,
                         <const uint8_t *><char *>nonce) != 0:
            raise ValueError("the mapping does not fit the layout")

    def check(self, bytes nonce):
        """True when the mapping is the one announced with ``nonce``."""
        if len(nonce) != DDPW_SHM_NONCE:
            return False
        return ddpw_shm_check(self._base(), self._view.len, self.world, self.region_bytes,
                              <const uint8_t *><char *>nonce) == 0

    cdef int _wait(self, uint32_t generation, double timeout, uint32_t *missing) except -1:
        cdef void *base = self._base()
        cdef int64_t deadline = ddpw_shm_now_ms() + <int64_t>(timeout * 1000.0)
        cdef int64_t until
        cdef int status
        while True:
            with nogil:
                until = ddpw_shm_now_ms() + _SHM_SLICE_MS
                if until > deadline:
                    until = deadline
                status = ddpw_shm_barrier(base, self.rank, self.world, generation, until, missing)
            if status != DDPW_SHM_TIMEOUT or ddpw_shm_now_ms() >= deadline:
                return status
            PyErr_CheckSignals()

    def barrier(self, generation, timeout):
        """Arrive at ``generation`` and wait for every rank, at most
        ``timeout`` seconds: (SHM_OK, -1), (SHM_TIMEOUT, first missing rank)
        or (SHM_ABORTED, the rank blamed)."""
        cdef uint32_t missing = 0
        cdef int status = self._wait(<uint32_t>generation, timeout, &missing)
        return status, (-1 if status == DDPW_SHM_OK else <int>missing)

    def abort(self, rank):
        """Call the group off, blaming ``rank`` (the first blame stays)."""
        ddpw_shm_abort(self._base(), self.world, <uint32_t>rank)

    def aborted(self):
        """The rank blamed by an abort, or -1."""
        return ddpw_shm_aborted(self._base())

    # ---- one allreduce, cut at its barriers (csrc/shm.h's steps 1, 3 and
    # 5), so that a caller may act between them: the mesh hears the
    # coordinator's verdict between the reduce and the copy out ----

    cdef int _enter(self, buf, Py_buffer *view, uint64_t limit, int flags) except -1:
        PyObject_GetBuffer(buf, view, flags)
        if view.len % 4 or <uint64_t>view.len > limit:
            PyBuffer_Release(view)
            raise ValueError(f"{view.len} bytes are not float32 elements within "
                             f"the {limit}-byte region")
        self._busy += 1
        return 0

    cdef void _leave(self, Py_buffer *view):
        PyBuffer_Release(view)
        self._busy -= 1
        if self._busy == 0 and self._close_pending:
            self.close()

    def stage(self, buf, op, Py_ssize_t start, Py_ssize_t count):
        """Copy ``buf`` (float32 bytes) into this rank's input region, all
        but this rank's own slice (elements [start, start + count), the
        cut every rank computes alike: ddpwire.plane.plan), and post its element
        count and ``op`` (SUM 0, AVG 1) for :meth:`agree`. :meth:`reduce`
        reduces that slice, reading it from ``buf`` itself: it must not
        change until then."""
        cdef Py_buffer view
        cdef void *base = self._base()
        cdef int staged
        cdef uint32_t cop = op
        cdef size_t n
        if cop != DDPW_SHM_SUM and cop != DDPW_SHM_AVG:
            raise ValueError(f"op {op} is neither SUM (0) nor AVG (1)")
        self._enter(buf, &view, self.region_bytes, PyBUF_SIMPLE)
        try:
            self._staged = NULL
            self._staged_len = -1
            n = <size_t>view.len // 4
            if start < 0 or count < 0 or <size_t>start > n or <size_t>count > n - <size_t>start:
                raise ValueError(f"slice [{start}, {start + count}) is not within the "
                                 f"{n} elements staged")
            with nogil:
                staged = ddpw_shm_stage(base, self.rank, self.world, <const float *>view.buf,
                                        n, cop, <size_t>start, <size_t>count)
            if staged != 0:
                raise ValueError(f"{n} elements cannot be staged in this arena")
            self._staged, self._staged_len, self._staged_op = view.buf, view.len, cop
            self._own_start, self._own_count = <size_t>start, <size_t>count
        finally:
            self._leave(&view)

    def agree(self):
        """After the first barrier: -1 when every rank staged as many
        elements as rank 0, else the first rank that did not."""
        return ddpw_shm_agree(self._base(), self.world)

    def reduce(self, buf, bint into_own=False):
        """Reduce this rank's slice of the vector (the one :meth:`stage` was
        given) with the op it posted, into the output region and, with
        ``into_own``, into ``buf``'s own slice too (in the same pass); ``buf`` is the vector
        :meth:`stage` was given (unchanged since: its own slice, never
        staged, is read from it). Returns (start, count, the lowest rank
        holding a non-finite element of the slice or -1, that element's
        index in the vector, its value)."""
        cdef Py_buffer view
        cdef void *base = self._base()
        cdef size_t start = self._own_start, count = self._own_count
        cdef uint32_t bad_rank = 0
        cdef int64_t bad
        cdef const float *own
        cdef float *result = NULL
        cdef float value
        self._enter(buf, &view, self.region_bytes,
                    PyBUF_SIMPLE | (PyBUF_WRITABLE if into_own else 0))
        try:
            if view.buf != self._staged or view.len != self._staged_len:
                raise ValueError("reduce takes the buffer stage() was given")
            own = <const float *>view.buf
            if into_own:
                result = <float *>view.buf
            with nogil:
                bad = ddpw_shm_reduce(base, self.world, start, count, self._staged_op, own,
                                      self.rank, result, &bad_rank)
            if bad < 0:
                return start, count, -1, 0, 0.0
            # the own rank's input is buf, its region holds stale bytes
            if bad_rank == self.rank:
                value = own[bad]
            else:
                value = ddpw_shm_input(base, bad_rank)[bad]
            return start, count, <int>bad_rank, bad, value
        finally:
            self._leave(&view)

    def gather(self, buf, bint skip_own=False):
        """Copy the output region's first len(buf) bytes into ``buf``; with
        ``skip_own``, all but this rank's own slice of them (the one
        :meth:`stage` was given, which :meth:`reduce` wrote into it
        already)."""
        cdef Py_buffer view
        cdef void *base = self._base()
        cdef size_t n, start = self._own_start, count = self._own_count
        self._enter(buf, &view, self.region_bytes, PyBUF_SIMPLE | PyBUF_WRITABLE)
        try:
            n = <size_t>view.len // 4
            if skip_own and (start > n or count > n - start):
                raise ValueError(f"the staged slice [{start}, {start + count}) is not within "
                                 f"the {n} elements to gather")
            with nogil:
                if skip_own:
                    memcpy(view.buf, ddpw_shm_output(base), start * 4)
                    memcpy(<float *>view.buf + start + count,
                           ddpw_shm_output(base) + start + count, (n - start - count) * 4)
                else:
                    memcpy(view.buf, ddpw_shm_output(base), n * 4)
        finally:
            self._leave(&view)
