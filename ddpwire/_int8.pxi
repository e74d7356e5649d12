"""Compiled glue for csrc/int8.c, the int8 wire codec: buffer checks in
Python, the codec in C without the GIL. The public face is
ddpwire.plane.reduce; csrc/int8.h has the layout and the arithmetic."""
from libc.stdint cimport uint8_t

from ddpwire._buffer cimport acquire_bytes

#: elements that share one float32 scale in the int8 codec
INT8_BLOCK = DDPW_INT8_BLOCK


def int8_size(Py_ssize_t n):
    """Bytes ``n`` elements take in the int8 codec: ``n`` codes and 4 bytes
    of scale per :data:`INT8_BLOCK` elements (a trailing partial block too)."""
    if n < 0:
        raise ValueError(f"n must not be negative, got {n}")
    cdef size_t size = ddpw_int8_size(<size_t>n)
    if n and (size == 0 or size > <size_t>(<size_t>-1 >> 1)):
        raise OverflowError(f"{n} elements do not fit an int8 encoding")
    return size


cdef Py_ssize_t _int8_count(Py_ssize_t nbytes, str name) except -1:
    """The element count whose encoding is ``nbytes`` long (unique: the
    size grows strictly with the count), or ValueError."""
    cdef Py_ssize_t blocks = (nbytes + DDPW_INT8_BLOCK + 3) // (DDPW_INT8_BLOCK + 4)
    cdef Py_ssize_t n = nbytes - 4 * blocks
    if n < 0 or <Py_ssize_t>ddpw_int8_size(<size_t>n) != nbytes:
        raise ValueError(f"{name} is {nbytes} bytes, which no int8 encoding is "
                         f"(n elements take n + 4 per {DDPW_INT8_BLOCK})")
    return n


def int8_encode(src, out=None):
    """Encode float32 ``src`` in the int8 codec into ``out`` (uint8 or int8
    elements, :func:`int8_size` of src's length; a 1-D numpy uint8 array is
    allocated when None). Returns out. A block holding a NaN or an infinity
    is encoded as a NaN scale (the whole block decodes to NaN), not
    reported: first_non_finite(src) tells."""
    cdef Py_buffer srcview, outview
    cdef Py_ssize_t n, size
    acquire_float32(src, &srcview, False, "src")
    try:
        n = srcview.len // 4
        size = int8_size(n)
        if out is None:
            out = numpy.empty(size, dtype=numpy.uint8)
        acquire_bytes(out, &outview, True, "out")
        try:
            if outview.len != size:
                raise ValueError(f"out is {outview.len} bytes, {n} elements encode to {size}")
            if _overlap(&outview, &srcview):
                raise ValueError("out overlaps src")
            with nogil:
                ddpw_int8_encode(<uint8_t *>outview.buf, <const float *>srcview.buf, <size_t>n)
        finally:
            PyBuffer_Release(&outview)
    finally:
        PyBuffer_Release(&srcview)
    return out


def int8_decode(src, out=None):
    """Decode the int8 codec's bytes ``src`` into float32 ``out`` (its
    element count is the one src's length names; a 1-D numpy float32 array
    is allocated when None). Returns out. Non-finite values are not
    reported."""
    cdef Py_buffer srcview, outview
    cdef Py_ssize_t n
    acquire_bytes(src, &srcview, False, "src")
    try:
        n = _int8_count(srcview.len, "src")
        if out is None:
            out = numpy.empty(n, dtype=numpy.float32)
        acquire_float32(out, &outview, True, "out")
        try:
            if outview.len // 4 != n:
                raise ValueError(f"out has {outview.len // 4} elements, src encodes {n}")
            if _overlap(&outview, &srcview):
                raise ValueError("out overlaps src")
            with nogil:
                ddpw_int8_decode(<float *>outview.buf, <const uint8_t *>srcview.buf, <size_t>n)
        finally:
            PyBuffer_Release(&outview)
    finally:
        PyBuffer_Release(&srcview)
    return out


def int8_mean(inputs, out=None, *, bint divide=True):
    """Element-wise mean (``divide``) or sum of equal-length int8
    encodings, into float32 ``out``: each element decoded, summed in
    float32 in input order, divided by len(inputs) with a true division.
    Bit for bit ``mean([int8_decode(x) for x in inputs])``. out is
    allocated (1-D numpy float32) when None; it must not overlap any
    input. Returns out.

    Raises NonFiniteGradient (input, index, decoded value) for the first
    non-finite decoded element by input number then index; out is fully
    written even then. TypeError for a non-buffer or a wrong element type,
    ValueError for an empty sequence, a length no encoding has, or
    mismatched lengths.
    """
    cdef Py_ssize_t k, j, n, held = 0
    cdef Py_buffer *views = NULL
    cdef const uint8_t **ptrs = NULL
    cdef Py_buffer outview
    cdef bint have_out = False
    cdef size_t bad_input = 0
    cdef int64_t bad
    try:
        seq = tuple(inputs)
    except TypeError:
        raise TypeError(
            f"inputs must be a sequence of byte buffers, not {type(inputs).__name__}"
        ) from None
    k = len(seq)
    if k == 0:
        raise ValueError("inputs is empty: the mean of no buffers is undefined")
    if <size_t>k > (<size_t>-1) // sizeof(Py_buffer):
        raise MemoryError()
    views = <Py_buffer *>PyMem_Malloc(k * sizeof(Py_buffer))
    ptrs = <const uint8_t **>PyMem_Malloc(k * sizeof(uint8_t *))
    try:
        if views == NULL or ptrs == NULL:
            raise MemoryError()
        for j in range(k):
            acquire_bytes(seq[j], &views[j], False, _arg("inputs", j))
            held += 1
            ptrs[j] = <const uint8_t *>views[j].buf
            if views[j].len != views[0].len:
                raise ValueError(f"inputs[{j}] is {views[j].len} bytes, "
                                 f"inputs[0] is {views[0].len}")
        n = _int8_count(views[0].len, "inputs[0]")
        if out is None:
            out = numpy.empty(n, dtype=numpy.float32)
        _acquire(out, &outview, True, "out")
        have_out = True
        if outview.len // 4 != n:
            raise ValueError(f"out has {outview.len // 4} elements, inputs encode {n}")
        for j in range(k):
            if _overlap(&outview, &views[j]):
                raise ValueError(f"out overlaps inputs[{j}]")
        with nogil:
            bad = ddpw_int8_mean(<float *>outview.buf, ptrs, <size_t>k, <size_t>n, divide,
                                 &bad_input)
        if bad >= 0:
            raise NonFiniteGradient(<Py_ssize_t>bad_input, bad, _int8_value(ptrs[bad_input], bad))
    finally:
        for j in range(held):
            PyBuffer_Release(&views[j])
        if have_out:
            PyBuffer_Release(&outview)
        PyMem_Free(views)
        PyMem_Free(ptrs)
    return out


cdef float _int8_value(const uint8_t *encoded, int64_t index) noexcept:
    """Element ``index`` of an encoding, decoded."""
    cdef size_t start = <size_t>(index - index % DDPW_INT8_BLOCK)
    cdef const uint8_t *block = encoded + ddpw_int8_size(start)
    cdef float out[DDPW_INT8_BLOCK]
    ddpw_int8_decode(out, block, <size_t>(index % DDPW_INT8_BLOCK) + 1)
    return out[index % DDPW_INT8_BLOCK]
