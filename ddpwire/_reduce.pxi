"""Compiled glue for csrc/reduce.c: buffer checks in Python, arithmetic in C
without the GIL. The public face is ddpwire.plane.reduce."""
from cpython.buffer cimport PyBuffer_Release
from cpython.mem cimport PyMem_Free, PyMem_Malloc
from libc.float cimport FLT_MAX
from libc.math cimport isfinite
from libc.stdint cimport int64_t, uint16_t, uintptr_t

from ddpwire._buffer cimport acquire_float32, acquire_uint16

from numbers import Real

import numpy

from ddpwire.wire.errors import NonFiniteGradient

cdef str _arg(str name, Py_ssize_t index):
    return name if index < 0 else f"{name}[{index}]"


cdef int _acquire(object obj, Py_buffer *view, bint writable, str name,
                  Py_ssize_t index=-1) except -1:
    return acquire_float32(obj, view, writable, _arg(name, index))


cdef bint _overlap(const Py_buffer *a, const Py_buffer *b) noexcept:
    cdef uintptr_t pa = <uintptr_t>a.buf, pb = <uintptr_t>b.buf
    return a.len > 0 and b.len > 0 and pa < pb + <uintptr_t>b.len and pb < pa + <uintptr_t>a.len


cdef object _value(const Py_buffer *view, int64_t index):
    return (<const float *>view.buf)[index]


def mean(inputs, out=None):
    """Element-wise mean of equal-length float32 buffers, into out.

    Computes ((inputs[0] + inputs[1]) + ...) / len(inputs) in float32, in
    input order, with a true division: bit for bit what the reference
    coordinator computes. out is allocated (1-D numpy float32) when None;
    it must not overlap any input. Returns out.

    Raises NonFiniteGradient (input, index, value) for the first NaN or inf
    by input number then index; out is fully written even then. TypeError
    for a non-buffer or non-float32 argument, ValueError for an empty
    sequence, a non-contiguous or read-only buffer, or mismatched lengths.
    """
    return _reduce_k(inputs, out, True)


def total(inputs, out=None):
    """Element-wise sum of equal-length float32 buffers, into out:
    ((inputs[0] + inputs[1]) + ...) in float32, in input order (the SUM
    collective), in one pass. Arguments, result and errors as :func:`mean`.
    """
    return _reduce_k(inputs, out, False)


cdef object _reduce_k(inputs, out, bint divide):
    cdef Py_ssize_t k, j, n, held = 0
    cdef Py_buffer *views = NULL
    cdef const float **ptrs = NULL
    cdef Py_buffer outview
    cdef bint have_out = False
    cdef size_t bad_input = 0
    cdef int64_t bad
    try:
        seq = tuple(inputs)
    except TypeError:
        raise TypeError(
            f"inputs must be a sequence of float32 buffers, not {type(inputs).__name__}"
        ) from None
    k = len(seq)
    if k == 0:
        raise ValueError(f"inputs is empty: the {'mean' if divide else 'sum'} of no buffers "
                         f"is undefined")
    if <size_t>k > (<size_t>-1) // sizeof(Py_buffer):
        raise MemoryError()
    views = <Py_buffer *>PyMem_Malloc(k * sizeof(Py_buffer))
    ptrs = <const float **>PyMem_Malloc(k * sizeof(float *))
    try:
        if views == NULL or ptrs == NULL:
            raise MemoryError()
        for j in range(k):
            _acquire(seq[j], &views[j], False, "inputs", j)
            held += 1
            ptrs[j] = <const float *>views[j].buf
            if views[j].len != views[0].len:
                raise ValueError(
                    f"inputs[{j}] has {views[j].len // 4} elements, inputs[0] has {views[0].len // 4}"
                )
        n = views[0].len // 4
        if out is None:
            out = numpy.empty(n, dtype=numpy.float32)
        _acquire(out, &outview, True, "out")
        have_out = True
        if outview.len != views[0].len:
            raise ValueError(f"out has {outview.len // 4} elements, inputs have {n}")
        for j in range(k):
            if _overlap(&outview, &views[j]):
                raise ValueError(f"out overlaps inputs[{j}]")
        with nogil:
            if divide:
                bad = ddpw_mean(<float *>outview.buf, ptrs, <size_t>k, <size_t>n, &bad_input)
            else:
                bad = ddpw_total(<float *>outview.buf, ptrs, <size_t>k, <size_t>n, &bad_input)
        if bad >= 0:
            raise NonFiniteGradient(<Py_ssize_t>bad_input, bad, _value(&views[bad_input], bad))
    finally:
        for j in range(held):
            PyBuffer_Release(&views[j])
        if have_out:
            PyBuffer_Release(&outview)
        PyMem_Free(views)
        PyMem_Free(ptrs)
    return out


def accumulate(acc, src):
    """acc += src element-wise in float32, in place; returns acc.

    Raises NonFiniteGradient(0, index, value) for the first NaN or inf of
    src (acc is not checked); acc is fully updated even then.
    """
    cdef Py_buffer accview, srcview
    cdef int64_t bad
    _acquire(src, &srcview, False, "src")
    try:
        _acquire(acc, &accview, True, "acc")
        try:
            if accview.len != srcview.len:
                raise ValueError(
                    f"acc has {accview.len // 4} elements, src has {srcview.len // 4}"
                )
            if _overlap(&accview, &srcview):
                raise ValueError("acc overlaps src")
            with nogil:
                bad = ddpw_accumulate(<float *>accview.buf, <const float *>srcview.buf,
                                     <size_t>(srcview.len // 4))
            if bad >= 0:
                raise NonFiniteGradient(0, bad, _value(&srcview, bad))
        finally:
            PyBuffer_Release(&accview)
    finally:
        PyBuffer_Release(&srcview)
    return acc


def scale(buf, divisor):
    """buf /= divisor element-wise in float32, in place (a true division by
    divisor rounded to float32); returns buf. Unchecked for non-finite
    values. ValueError unless divisor is finite and non-zero in float32."""
    cdef Py_buffer view
    cdef double wide
    cdef float d
    if not isinstance(divisor, Real):
        raise TypeError(f"divisor must be a real number, not {type(divisor).__name__}")
    wide = float(divisor)
    # range check first: converting an out-of-range double to float is undefined
    if not isfinite(wide) or wide > FLT_MAX or wide < -FLT_MAX or <float>wide == 0.0:
        raise ValueError(f"divisor must be finite and non-zero in float32, got {divisor!r}")
    d = <float>wide
    _acquire(buf, &view, True, "buf")
    try:
        with nogil:
            ddpw_scale(<float *>view.buf, d, <size_t>(view.len // 4))
    finally:
        PyBuffer_Release(&view)
    return buf


def first_non_finite(buf):
    """Index of the first NaN or +/-inf in buf, or None."""
    cdef Py_buffer view
    cdef int64_t bad
    _acquire(buf, &view, False, "buf")
    try:
        with nogil:
            bad = ddpw_first_non_finite(<const float *>view.buf, <size_t>(view.len // 4))
    finally:
        PyBuffer_Release(&view)
    return None if bad < 0 else bad


# ---- 16-bit gradients ----

_CODECS = {"bf16": DDPW_HALF_BF16, "fp16": DDPW_HALF_FP16}


cdef int _codec(object codec) except -1:
    try:
        return _CODECS[codec]
    except (KeyError, TypeError):
        raise ValueError(f"codec must be one of {tuple(_CODECS)}, got {codec!r}") from None


cdef int _acquire16(object obj, Py_buffer *view, bint writable, str name,
                    Py_ssize_t index=-1) except -1:
    return acquire_uint16(obj, view, writable, _arg(name, index))


cdef object _value16(const Py_buffer *view, int64_t index, int codec):
    cdef float wide
    ddpw_from_half(&wide, <const uint16_t *>view.buf + index, 1, codec)
    return wide


def to_half(src, out=None, *, codec):
    """Narrow float32 src to 16-bit bits (codec "bf16" or "fp16"), rounding
    to nearest even, into out (uint16 or float16 elements; a 1-D numpy
    uint16 array is allocated when None). Returns out.

    Non-finite values convert (fp16 overflow gives inf, a NaN stays a quiet
    NaN of its sign) and are not reported: first_non_finite(src) tells.
    """
    cdef int c = _codec(codec)
    cdef Py_buffer srcview, outview
    cdef Py_ssize_t n
    _acquire(src, &srcview, False, "src")
    try:
        n = srcview.len // 4
        if out is None:
            out = numpy.empty(n, dtype=numpy.uint16)
        _acquire16(out, &outview, True, "out")
        try:
            if outview.len // 2 != n:
                raise ValueError(f"out has {outview.len // 2} elements, src has {n}")
            if _overlap(&outview, &srcview):
                raise ValueError("out overlaps src")
            with nogil:
                ddpw_to_half(<uint16_t *>outview.buf, <const float *>srcview.buf, <size_t>n, c)
        finally:
            PyBuffer_Release(&outview)
    finally:
        PyBuffer_Release(&srcview)
    return out


def from_half(src, out=None, *, codec):
    """Widen 16-bit bits src (uint16 or float16 elements; codec "bf16" or
    "fp16") exactly to float32, into out (a 1-D numpy float32 array is
    allocated when None). Returns out. Non-finite values are not reported."""
    cdef int c = _codec(codec)
    cdef Py_buffer srcview, outview
    cdef Py_ssize_t n
    _acquire16(src, &srcview, False, "src")
    try:
        n = srcview.len // 2
        if out is None:
            out = numpy.empty(n, dtype=numpy.float32)
        _acquire(out, &outview, True, "out")
        try:
            if outview.len // 4 != n:
                raise ValueError(f"out has {outview.len // 4} elements, src has {n}")
            if _overlap(&outview, &srcview):
                raise ValueError("out overlaps src")
            with nogil:
                ddpw_from_half(<float *>outview.buf, <const uint16_t *>srcview.buf, <size_t>n, c)
        finally:
            PyBuffer_Release(&outview)
    finally:
        PyBuffer_Release(&srcview)
    return out


def mean_half(inputs, out=None, *, codec):
    """Element-wise mean of equal-length 16-bit buffers (codec "bf16" or
    "fp16"), into out: each element widened to float32, summed in input
    order, divided by len(inputs) and rounded once to nearest even. Bit for
    bit to_half(mean([from_half(x) for x in inputs])). out (uint16 or
    float16 elements) is allocated as 1-D numpy uint16 when None; it must
    not overlap any input. Returns out.

    Raises NonFiniteGradient (input, index, widened value) for the first NaN
    or inf by input number then index; out is fully written even then.
    TypeError for a non-buffer or a wrong element type, ValueError for an
    empty sequence, an unknown codec, a non-contiguous or read-only buffer,
    or mismatched lengths.
    """
    return _half_k(inputs, out, codec, True)


def total_half(inputs, out=None, *, codec):
    """Element-wise sum of equal-length 16-bit buffers (a SUM of bfloat16 or
    float16 values), into out: :func:`mean_half` without the division, bit
    for bit to_half(total([from_half(x) for x in inputs])). Arguments,
    result and errors as :func:`mean_half`."""
    return _half_k(inputs, out, codec, False)


cdef object _half_k(inputs, out, codec, bint divide):
    cdef int c = _codec(codec)
    cdef Py_ssize_t k, j, n, held = 0
    cdef Py_buffer *views = NULL
    cdef const uint16_t **ptrs = NULL
    cdef Py_buffer outview
    cdef bint have_out = False
    cdef size_t bad_input = 0
    cdef int64_t bad
    try:
        seq = tuple(inputs)
    except TypeError:
        raise TypeError(
            f"inputs must be a sequence of uint16 buffers, not {type(inputs).__name__}"
        ) from None
    k = len(seq)
    if k == 0:
        raise ValueError("inputs is empty: the mean of no buffers is undefined")
    if <size_t>k > (<size_t>-1) // sizeof(Py_buffer):
        raise MemoryError()
    views = <Py_buffer *>PyMem_Malloc(k * sizeof(Py_buffer))
    ptrs = <const uint16_t **>PyMem_Malloc(k * sizeof(uint16_t *))
    try:
        if views == NULL or ptrs == NULL:
            raise MemoryError()
        for j in range(k):
            _acquire16(seq[j], &views[j], False, "inputs", j)
            held += 1
            ptrs[j] = <const uint16_t *>views[j].buf
            if views[j].len != views[0].len:
                raise ValueError(
                    f"inputs[{j}] has {views[j].len // 2} elements, inputs[0] has {views[0].len // 2}"
                )
        n = views[0].len // 2
        if out is None:
            out = numpy.empty(n, dtype=numpy.uint16)
        _acquire16(out, &outview, True, "out")
        have_out = True
        if outview.len != views[0].len:
            raise ValueError(f"out has {outview.len // 2} elements, inputs have {n}")
        for j in range(k):
            if _overlap(&outview, &views[j]):
                raise ValueError(f"out overlaps inputs[{j}]")
        with nogil:
            if divide:
                bad = ddpw_mean_half(<uint16_t *>outview.buf, ptrs, <size_t>k, <size_t>n, c,
                                     &bad_input)
            else:
                bad = ddpw_total_half(<uint16_t *>outview.buf, ptrs, <size_t>k, <size_t>n, c,
                                      &bad_input)
        if bad >= 0:
            raise NonFiniteGradient(<Py_ssize_t>bad_input, bad,
                                    _value16(&views[bad_input], bad, c))
    finally:
        for j in range(held):
            PyBuffer_Release(&views[j])
        if have_out:
            PyBuffer_Release(&outview)
        PyMem_Free(views)
        PyMem_Free(ptrs)
    return out


def available_paths():
    """Names of the kernel paths this CPU runs, slowest first; all give the same bits."""
    cdef unsigned mask = ddpw_reduce_paths()
    return [
        ddpw_reduce_path_name(p).decode("ascii")
        for p in range(DDPW_REDUCE_NPATHS)
        if mask & ((<unsigned>1) << p)
    ]


def current_path():
    """Name of the kernel path in use."""
    return ddpw_reduce_path_name(ddpw_reduce_get_path()).decode("ascii")


def _set_path(str name):
    cdef int p
    if name == "auto":
        ddpw_reduce_set_path(DDPW_REDUCE_AUTO)
        return
    for p in range(DDPW_REDUCE_NPATHS):
        if ddpw_reduce_path_name(p).decode("ascii") == name:
            if ddpw_reduce_set_path(p) != 0:
                raise ValueError(
                    f"path {name!r} is not available on this CPU; available: {available_paths()}"
                )
            return
    raise ValueError(f"unknown path {name!r}; available: {available_paths()}")


def current_threads():
    """Most threads one kernel call splits a large buffer over."""
    return ddpw_reduce_get_threads()


def _set_threads(int threads):
    if threads < 0:
        raise ValueError(f"threads must be >= 0 (0 for the default), got {threads}")
    ddpw_reduce_set_threads(threads)
