# cython: language_level=3
# Checked float32 buffers for the compiled units that take them as arguments
# (the kernels, the socket layer): one set of rules and one wording of the
# errors. Inline, so a unit that cimports it needs nothing more at run time.
from cpython.buffer cimport PyBUF_FORMAT, PyBUF_STRIDES, PyBuffer_IsContiguous, PyBuffer_Release, PyObject_GetBuffer
from libc.string cimport strcmp


cdef inline bint is_native_float32(const char *fmt) noexcept:
    # native byte order only: the C reads the elements in place
    cdef int one = 1
    cdef bint little = (<char *>&one)[0] == 1
    if fmt == NULL:
        return False
    if strcmp(fmt, b"f") == 0 or strcmp(fmt, b"@f") == 0 or strcmp(fmt, b"=f") == 0:
        return True
    if little:
        return strcmp(fmt, b"<f") == 0
    return strcmp(fmt, b">f") == 0 or strcmp(fmt, b"!f") == 0


ctypedef bint (*format_check)(const char *fmt) noexcept


cdef inline int acquire_typed(object obj, Py_buffer *view, bint writable, str name,
                              Py_ssize_t itemsize, format_check native, str holds,
                              str examples) except -1:
    """Fill view with obj's buffer, checked: elements of ``itemsize`` bytes in
    a format ``native`` accepts, C-contiguous, and writable when asked. On
    failure nothing is held and the error names the argument."""
    cdef bytes fmt
    try:
        PyObject_GetBuffer(obj, view, PyBUF_FORMAT | PyBUF_STRIDES)
    except (TypeError, BufferError):
        raise TypeError(f"{name} must be a buffer of {holds} ({examples}), "
                        f"not {type(obj).__name__}") from None
    if view.itemsize != itemsize or not native(view.format):
        fmt = b"B" if view.format == NULL else <bytes>view.format
        PyBuffer_Release(view)
        raise TypeError(
            f"{name} must hold native {holds} elements, "
            f"got format {fmt.decode('ascii', 'replace')!r} of {view.itemsize} bytes"
        )
    if not PyBuffer_IsContiguous(view, b"C"):
        PyBuffer_Release(view)
        raise ValueError(f"{name} must be C-contiguous")
    if writable and view.readonly:
        PyBuffer_Release(view)
        raise ValueError(f"{name} is read-only")
    return 0


cdef inline int acquire_float32(object obj, Py_buffer *view, bint writable, str name) except -1:
    """acquire_typed for float32 elements."""
    return acquire_typed(obj, view, writable, name, 4, is_native_float32, "float32",
                         "numpy array, a CPU tensor's .numpy(), memoryview, array.array('f')")


cdef inline bint is_native_16bit(const char *fmt) noexcept:
    # the bits of a 16-bit float travel as uint16; numpy.float16 ('e') holds
    # the same bits for fp16, so either layout is accepted, native order only
    cdef int one = 1
    cdef bint little = (<char *>&one)[0] == 1
    cdef const char *body
    if fmt == NULL:
        return False
    body = fmt
    if fmt[0] == b"@" or fmt[0] == b"=" or (little and fmt[0] == b"<") or \
            (not little and (fmt[0] == b">" or fmt[0] == b"!")):
        body = fmt + 1
    return strcmp(body, b"H") == 0 or strcmp(body, b"e") == 0


cdef inline int acquire_uint16(object obj, Py_buffer *view, bint writable, str name) except -1:
    """acquire_typed for 16-bit float bits (uint16 or float16 elements)."""
    return acquire_typed(obj, view, writable, name, 2, is_native_16bit, "uint16 (or float16)",
                         "numpy uint16 or float16 array, memoryview, array.array('H')")


cdef inline bint is_bytes(const char *fmt) noexcept:
    # encoded words are raw bytes: unsigned or signed, any order (one byte)
    return fmt == NULL or strcmp(fmt, b"B") == 0 or strcmp(fmt, b"b") == 0 or \
        strcmp(fmt, b"@B") == 0 or strcmp(fmt, b"=B") == 0 or strcmp(fmt, b"<B") == 0


cdef inline int acquire_bytes(object obj, Py_buffer *view, bint writable, str name) except -1:
    """acquire_typed for a codec's encoded bytes (uint8 or int8 elements)."""
    return acquire_typed(obj, view, writable, name, 1, is_bytes, "bytes",
                         "numpy uint8 array, bytes, bytearray, memoryview")
