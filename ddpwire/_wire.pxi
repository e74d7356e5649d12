"""Python face of the wire codec in csrc/wire.c.

The byte layout lives in C (csrc/messages.def); this module moves values
between Python message objects (ddpwire.wire.messages, whose classes are
made from the same tables) and the C structs by walking each message's
fields, turns C errors into ProtocolError text, and frames a byte stream
(FrameReader).
"""
from cpython.buffer cimport (
    PyBUF_C_CONTIGUOUS,
    PyBUF_FORMAT,
    PyBUF_SIMPLE,
    PyBuffer_Release,
    PyObject_GetBuffer,
)
from cpython.bytearray cimport PyByteArray_AS_STRING, PyByteArray_FromStringAndSize
from cpython.bytes cimport PyBytes_AS_STRING, PyBytes_FromStringAndSize
from cpython.number cimport PyNumber_Index
from cpython.unicode cimport PyUnicode_DecodeUTF8
from libc.stdint cimport uint8_t, uint16_t, uint32_t, uint64_t
from libc.string cimport memcpy, memset, strcmp

import sys

import numpy as np

from ddpwire.wire.errors import FrameTooLarge, ProtocolError

cdef extern from "Python.h":
    ctypedef struct PyTypeObject
    const char *PyUnicode_AsUTF8AndSize(object s, Py_ssize_t *size) except NULL
    object PyType_GenericNew(PyTypeObject *cls, object args, object kwargs)

cdef tuple _EMPTY = ()


DEFAULT_MAX_FRAME = DDPW_DEFAULT_MAX_FRAME

# Copies and UTF-8 checks above this size run without the GIL; below it,
# releasing the GIL costs more than it lets others do.
cdef enum:
    NOGIL_BYTES = 65536

cdef bint _LITTLE_HOST = sys.byteorder == "little"
cdef object _frombuffer = np.frombuffer
cdef object _F32 = np.dtype("<f4")
cdef object _U32 = np.dtype("<u4")
cdef object _NATIVE_U32 = np.dtype(np.uint32)
cdef object _ndarray = np.ndarray

cdef class _Layout:
    """One message of csrc/messages.def, with its Python class once
    ddpwire.wire.messages has made it."""
    cdef const ddpw_layout *c
    cdef tuple names      # the fields' names, in wire order
    cdef unsigned bulk    # the bulk field's index (field_count: none)
    cdef object cls


# by tag; None where no message has the tag
cdef list _LAYOUT_OF_TAG = [None] * 256
# by message class (register_message_class)
cdef dict _LAYOUT_OF_CLASS = {}


cdef _load_layouts():
    cdef size_t i = 0
    cdef const ddpw_layout *c = ddpw_layout_at(0)
    cdef _Layout lay
    while c != NULL:
        lay = _Layout.__new__(_Layout)
        lay.c = c
        lay.bulk = ddpw_layout_bulk(c)
        lay.names = tuple(sys.intern(c.fields[j].name.decode("ascii"))
                          for j in range(c.field_count))
        _LAYOUT_OF_TAG[c.tag] = lay
        i += 1
        c = ddpw_layout_at(i)


_load_layouts()


def message_layouts():
    """Every message of csrc/messages.def, in tag order, as
    ``(tag, name, direction, extensible, doc, fields)`` with ``fields`` a
    tuple of ``(name, wire type, rule)`` (lower-case names, as
    ddpwire.wire.messages.Layout spells them)."""
    out = []
    cdef _Layout lay
    cdef const ddpw_field *f
    for lay in _LAYOUT_OF_TAG:
        if lay is None:
            continue
        fields = []
        for j in range(lay.c.field_count):
            f = &lay.c.fields[j]
            fields.append((lay.names[j], ddpw_wire_type_name(f.type).decode("ascii"),
                           ddpw_rule_name(f.rule).decode("ascii")))
        out.append((lay.c.tag, lay.c.name.decode("ascii"), lay.c.direction.decode("utf-8"),
                    bool(lay.c.extensible), lay.c.doc.decode("utf-8"), tuple(fields)))
    return tuple(out)


def register_message_class(cls):
    """Make ``cls`` the class that decoding gives for the tag ``cls.TAG``, and
    that encoding accepts (with its subclasses): ddpwire.wire.messages calls
    it for every class it makes from :func:`message_layouts`."""
    cdef _Layout lay = _LAYOUT_OF_TAG[_uint(cls.TAG, 0xFF, "register_message_class", "TAG")]
    if lay is None:
        raise ValueError(f"no message has the tag 0x{cls.TAG:02x}")
    lay.cls = cls
    _LAYOUT_OF_CLASS[cls] = lay


cdef object _U8 = np.dtype(np.uint8)


# ---------------------------------------------------------------------------
# Errors
# ---------------------------------------------------------------------------

cdef str _name(const char *s):
    return "?" if s == NULL else s.decode("ascii")


cdef float _f32_of_bits(uint32_t bits):
    cdef float f
    memcpy(&f, &bits, 4)
    return f


cdef object wire_error(const ddpw_error *err):
    cdef str where
    cdef ddpw_status st = err.status
    if st == DDPW_ERR_EMPTY:
        return ProtocolError("empty payload")
    if st == DDPW_ERR_UNKNOWN_TAG:
        return ProtocolError(f"unknown message tag: 0x{err.tag:02x}")
    if st == DDPW_ERR_TOO_LARGE:
        return FrameTooLarge(err.have, err.need)
    where = _name(err.message_type)
    if err.field != NULL:
        where = f"{where}.{_name(err.field)}"
    if st == DDPW_ERR_TRUNCATED:
        return ProtocolError(f"truncated {where}: {err.have} of {err.need} bytes")
    if st == DDPW_ERR_UTF8:
        return ProtocolError(
            f"invalid UTF-8 in {where} at byte {err.have} of {err.need}")
    if st == DDPW_ERR_OVERFLOW:
        return ProtocolError(
            f"count overflow in {where}: {err.value} elements have no byte length "
            f"that fits 64 bits")
    if st == DDPW_ERR_TRAILING:
        return ProtocolError(
            f"{err.have - err.need} bytes after the last field of {where}")
    if st == DDPW_ERR_VALUE:
        unit = "bytes" if err.detail == NULL else _name(err.detail)
        return ValueError(f"{where}: {err.have} {unit}, over the wire limit of {err.need}")
    if st == DDPW_ERR_INVALID:
        return ProtocolError(f"invalid {where}: {err.value} ({_name(err.detail)})")
    if st == DDPW_ERR_INVALID_F32:
        value = repr(ddpw_f32_to_f64(_f32_of_bits(<uint32_t>err.value)))
        return ProtocolError(f"invalid {where}: {value} ({_name(err.detail)})")
    if st == DDPW_ERR_MISMATCH:
        return ProtocolError(
            f"{where} length mismatch: {err.have} bytes, count x dtype size is {err.need}")
    if st == DDPW_ERR_BUFFER:
        return ValueError(f"{where}: output buffer of {err.have} bytes, {err.need} needed")
    return ProtocolError(f"wire codec error {<int>st} in {where}")


# ---------------------------------------------------------------------------
# Python values -> C
# ---------------------------------------------------------------------------

cdef class HeldBuffer:
    """Holds a Py_buffer export for as long as C reads from it."""
    cdef Py_buffer view
    cdef bint held

    def __dealloc__(self):
        if self.held:
            PyBuffer_Release(&self.view)


cdef str _describe(object obj):
    if isinstance(obj, _ndarray):
        layout = "" if obj.flags.c_contiguous else ", not C-contiguous"
        return f"numpy.ndarray of dtype {obj.dtype}{layout}"
    try:
        view = memoryview(obj)
    except TypeError:
        return type(obj).__name__
    layout = "" if view.c_contiguous else ", not C-contiguous"
    return f"{type(obj).__name__} of format {view.format!r}{layout}"


cdef bint _is_f32_format(const char *fmt):
    if fmt == NULL:
        return False
    if strcmp(fmt, "f") == 0 or strcmp(fmt, "@f") == 0 or strcmp(fmt, "=f") == 0:
        return True
    return _LITTLE_HOST and strcmp(fmt, "<f") == 0


cdef HeldBuffer _float32_buffer(object obj, str field):
    # field: "GradientPayload.gradients" and the like, as the error names it
    cdef HeldBuffer buf = HeldBuffer.__new__(HeldBuffer)
    try:
        PyObject_GetBuffer(obj, &buf.view, PyBUF_C_CONTIGUOUS | PyBUF_FORMAT)
        buf.held = True
    except (TypeError, BufferError, ValueError):
        pass
    if not buf.held or buf.view.itemsize != 4 or not _is_f32_format(buf.view.format):
        raise TypeError(
            f"{field}: expected a C-contiguous float32 buffer (numpy float32 array, "
            f"tensor.numpy(), array.array('f') or memoryview of format 'f'), "
            f"got {_describe(obj)}")
    return buf


cdef uint64_t _uint(object value, uint64_t limit, object owner, str field) except? 0xFFFFFFFFFFFFFFFF:
    # owner: the message (or a name) that errors mention; its type name is
    # looked up only on failure, so the common path stays cheap.
    cdef uint64_t out
    cdef str type_name
    if type(value) is not int:
        try:
            value = PyNumber_Index(value)
        except TypeError:
            type_name = _owner_name(owner)
            raise TypeError(
                f"{type_name}.{field}: expected an int, got {type(value).__name__}") from None
    try:
        out = value
    except OverflowError:  # negative, or over 2^64 - 1
        type_name = _owner_name(owner)
        raise ValueError(f"{type_name}.{field} must be in 0..{limit}, got {value}") from None
    if out > limit:
        type_name = _owner_name(owner)
        raise ValueError(f"{type_name}.{field} must be in 0..{limit}, got {value}")
    return out


cdef str _owner_name(object owner):
    return owner if isinstance(owner, str) else type(owner).__name__


cdef float _f32(object value, object owner, str field) except? -1.0:
    cdef double d
    try:
        d = value
    except TypeError:
        raise TypeError(
            f"{_owner_name(owner)}.{field}: expected a float, got {type(value).__name__}") from None
    return ddpw_f64_to_f32(d)


cdef ddpw_str _utf8(object value, object owner, str field) except *:
    cdef ddpw_str s
    cdef Py_ssize_t n
    if not isinstance(value, str):
        raise TypeError(f"{_owner_name(owner)}.{field}: expected a str, got {type(value).__name__}")
    try:
        s.data = <const uint8_t *>PyUnicode_AsUTF8AndSize(value, &n)
    except UnicodeEncodeError as exc:
        raise ValueError(f"{_owner_name(owner)}.{field}: not encodable as UTF-8: {exc}") from None
    s.len = <size_t>n
    return s


cdef object _u32_array(object value, str type_name, str field):
    """component_sizes as a C-contiguous host-order uint32 array."""
    cdef uint32_t[::1] out_view
    cdef Py_ssize_t i, n
    cdef uint64_t v
    if isinstance(value, _ndarray):
        arr = value.reshape(-1)
        if arr.dtype == _NATIVE_U32:
            return np.ascontiguousarray(arr)
        if arr.size == 0:
            return np.empty(0, dtype=_NATIVE_U32)
        if arr.dtype.kind not in "iu":
            raise TypeError(
                f"{type_name}.{field}: expected integers, got an array of dtype {arr.dtype}")
        if arr.min() < 0 or arr.max() > 0xFFFFFFFF:
            raise ValueError(f"{type_name}.{field}: every size must be in 0..4294967295")
        return arr.astype(_NATIVE_U32)
    try:
        n = len(value)
    except TypeError:
        raise TypeError(
            f"{type_name}.{field}: expected a sequence of ints, got {type(value).__name__}") from None
    out = np.empty(n, dtype=_NATIVE_U32)
    out_view = out
    for i in range(n):
        v = _uint(value[i], 0xFFFFFFFF, type_name, f"{field}[{i}]")
        out_view[i] = <uint32_t>v
    return out


cdef ddpw_span _u32_span(object value, object msg, str field, list keep) except *:
    cdef str type_name = type(msg).__name__
    cdef ddpw_span span
    sizes = _u32_array(value, type_name, field)
    if sizes.shape[0] > 0xFFFFFFFF:
        raise ValueError(f"{type_name}.{field}: more than 4294967295 entries")
    cdef HeldBuffer buf = HeldBuffer.__new__(HeldBuffer)
    PyObject_GetBuffer(sizes, &buf.view, PyBUF_C_CONTIGUOUS)
    buf.held = True
    keep.append(buf)
    span.data = buf.view.buf
    span.count = <uint64_t>sizes.shape[0]
    return span


cdef HeldBuffer _bytes_buffer(object obj, object owner, str field):
    """Any C-contiguous buffer, read as its raw bytes."""
    cdef HeldBuffer buf = HeldBuffer.__new__(HeldBuffer)
    try:
        PyObject_GetBuffer(obj, &buf.view, PyBUF_C_CONTIGUOUS)
        buf.held = True
    except (TypeError, BufferError, ValueError):
        raise TypeError(
            f"{_owner_name(owner)}.{field}: expected a C-contiguous buffer, "
            f"got {_describe(obj)}") from None
    return buf


cdef const uint8_t *_auth_bytes(object value, object msg, str field, list keep) except NULL:
    cdef HeldBuffer buf = _bytes_buffer(value, msg, field)
    if buf.view.len != DDPW_AUTH_BYTES:
        raise ValueError(
            f"{type(msg).__name__}.{field}: expected {DDPW_AUTH_BYTES} bytes, got {buf.view.len}")
    keep.append(buf)
    return <const uint8_t *>buf.view.buf


cdef int _set_extensions(ddpw_message *out, object msg, list keep) except -1:
    cdef object ext = msg.extensions
    cdef Py_ssize_t i = 0, n
    cdef ddpw_ext_entry *entries
    cdef HeldBuffer buf
    if ext is None:
        return 0
    if not isinstance(ext, dict):
        raise TypeError(
            f"{type(msg).__name__}.extensions: expected None or a dict {{int: bytes}}, "
            f"got {type(ext).__name__}")
    n = len(ext)
    # checked before anything is sized from n
    if n > DDPW_EXT_MAX_ENTRIES:
        raise ValueError(f"{type(msg).__name__}.extensions: {n} entries, over the wire limit "
                         f"of {DDPW_EXT_MAX_ENTRIES}")
    storage = bytearray(max(n, 1) * sizeof(ddpw_ext_entry))
    keep.append(storage)
    entries = <ddpw_ext_entry *><char *>storage
    for key, value in ext.items():
        entries[i].type = <uint16_t>_uint(key, 0xFFFF, msg, "extensions key")
        buf = _bytes_buffer(value, msg, f"extensions[{key}]")
        keep.append(buf)
        if <size_t>buf.view.len > DDPW_EXT_MAX_BLOCK:
            raise ValueError(f"{type(msg).__name__}.extensions[{key}]: {buf.view.len} bytes, "
                             f"over the block limit of {DDPW_EXT_MAX_BLOCK}")
        entries[i].len = <uint32_t>buf.view.len
        entries[i].value = <const uint8_t *>buf.view.buf
        i += 1
    out.has_ext = 1
    out.ext_count = <uint16_t>n
    out.ext_entries = entries
    return 0


cdef _Layout _layout_of_message(object msg):
    cdef object lay = _LAYOUT_OF_CLASS.get(type(msg))
    if lay is None:
        for cls in type(msg).__mro__:  # a subclass of a message class
            lay = _LAYOUT_OF_CLASS.get(cls)
            if lay is not None:
                break
        else:
            raise TypeError(f"expected a ddpwire message, got {type(msg).__name__}")
    return <_Layout>lay


cdef _Layout message_to_c(object msg, ddpw_message *out, list keep):
    """Every field of ``msg`` into ``out``, as its layout (returned) says;
    ``keep`` holds what the pointers in ``out`` point into."""
    cdef _Layout lay = _layout_of_message(msg)
    cdef const ddpw_field *f
    cdef char *at
    cdef HeldBuffer buf
    cdef uint8_t t
    cdef Py_ssize_t j
    memset(out, 0, sizeof(ddpw_message))
    out.tag = lay.c.tag
    for j in range(lay.c.field_count):
        f = &lay.c.fields[j]
        name = lay.names[j]
        value = getattr(msg, name)
        at = <char *>out + f.offset
        t = f.type
        if t == DDPW_WT_U8:
            (<uint8_t *>at)[0] = <uint8_t>_uint(value, 0xFF, msg, name)
        elif t == DDPW_WT_U16:
            (<uint16_t *>at)[0] = <uint16_t>_uint(value, 0xFFFF, msg, name)
        elif t == DDPW_WT_U32:
            (<uint32_t *>at)[0] = <uint32_t>_uint(value, 0xFFFFFFFF, msg, name)
        elif t == DDPW_WT_U64:
            (<uint64_t *>at)[0] = _uint(value, 0xFFFFFFFFFFFFFFFF, msg, name)
        elif t == DDPW_WT_F32:
            (<float *>at)[0] = _f32(value, msg, name)
        elif t == DDPW_WT_STRING:
            keep.append(value)
            (<ddpw_str *>at)[0] = _utf8(value, msg, name)
        elif t == DDPW_WT_BYTES32:
            (<const uint8_t **>at)[0] = _auth_bytes(value, msg, name, keep)
        elif t == DDPW_WT_U32LIST:
            (<ddpw_span *>at)[0] = _u32_span(value, msg, name, keep)
        elif t == DDPW_WT_F32VEC:
            buf = _float32_buffer(value, f"{type(msg).__name__}.{name}")
            keep.append(buf)
            (<ddpw_span *>at).data = buf.view.buf
            (<ddpw_span *>at).count = <uint64_t>(buf.view.len // 4)
        else:  # DDPW_WT_BYTES
            buf = _bytes_buffer(value, msg, name)
            keep.append(buf)
            (<ddpw_span *>at).data = buf.view.buf
            (<ddpw_span *>at).count = <uint64_t>buf.view.len
    if lay.c.extensible:
        _set_extensions(out, msg, keep)
    return lay


# ---------------------------------------------------------------------------
# C -> Python values
# ---------------------------------------------------------------------------

cdef inline str _text(ddpw_str s):
    return PyUnicode_DecodeUTF8(<const char *>s.data, <Py_ssize_t>s.len, NULL)


cdef inline object _float(float f):
    return ddpw_f32_to_f64(f)


cdef inline object _view(const ddpw_span *span, object dtype, uint64_t count, object owner,
                        const uint8_t *base):
    # count elements of dtype at span.data, a view into owner (no copy)
    return _frombuffer(owner, dtype, <Py_ssize_t>count,
                       <Py_ssize_t>(<const uint8_t *>span.data - base))


cdef object _extensions(const ddpw_message *m):
    cdef dict out
    cdef size_t pos = 0
    cdef ddpw_ext_entry e
    if not m.has_ext:
        return None
    out = {}
    while ddpw_ext_next(m.ext_block, m.ext_block_len, &pos, &e):
        out[e.type] = PyBytes_FromStringAndSize(<const char *>e.value, <Py_ssize_t>e.len)
    return out


cdef inline object _new(object cls):
    # Decoding skips the dataclass __init__ (which only stores the fields)
    # and stores them itself: it halves the cost of a small message.
    return PyType_GenericNew(<PyTypeObject *>cls, _EMPTY, None)


cdef object message_from_c(const ddpw_message *m, object owner, const uint8_t *base):
    """The message in ``m`` as an object of its class; its arrays are views
    into ``owner``, whose bytes start at ``base``."""
    cdef object lay_obj = _LAYOUT_OF_TAG[m.tag]
    cdef _Layout lay
    cdef const ddpw_field *f
    cdef const char *at
    cdef uint8_t t
    cdef Py_ssize_t j
    if lay_obj is None or (<_Layout>lay_obj).cls is None:
        raise ProtocolError(f"unknown message tag: 0x{m.tag:02x}")
    lay = <_Layout>lay_obj
    o = _new(lay.cls)
    for j in range(lay.c.field_count):
        f = &lay.c.fields[j]
        at = <const char *>m + f.offset
        t = f.type
        if t == DDPW_WT_U8:
            value = (<const uint8_t *>at)[0]
        elif t == DDPW_WT_U16:
            value = (<const uint16_t *>at)[0]
        elif t == DDPW_WT_U32:
            value = (<const uint32_t *>at)[0]
        elif t == DDPW_WT_U64:
            value = (<const uint64_t *>at)[0]
        elif t == DDPW_WT_F32:
            value = _float((<const float *>at)[0])
        elif t == DDPW_WT_STRING:
            value = _text((<const ddpw_str *>at)[0])
        elif t == DDPW_WT_BYTES32:
            value = PyBytes_FromStringAndSize(<const char *>(<const uint8_t **>at)[0],
                                              DDPW_AUTH_BYTES)
        elif t == DDPW_WT_U32LIST:
            if (<const ddpw_span *>at).count == 0:
                value = np.empty(0, dtype=_NATIVE_U32)
            else:
                value = _view(<const ddpw_span *>at, _U32, (<const ddpw_span *>at).count, owner,
                              base)
        elif t == DDPW_WT_F32VEC:
            value = _view(<const ddpw_span *>at, _F32, (<const ddpw_span *>at).count, owner, base)
        else:  # DDPW_WT_BYTES
            value = _view(<const ddpw_span *>at, _U8, (<const ddpw_span *>at).count, owner, base)
        setattr(o, lay.names[j], value)
    if lay.c.extensible:
        o.extensions = _extensions(m)
    return o


# ---------------------------------------------------------------------------
# Public API
# ---------------------------------------------------------------------------

cdef HeldBuffer _input_buffer(object buffer):
    cdef HeldBuffer buf = HeldBuffer.__new__(HeldBuffer)
    try:
        PyObject_GetBuffer(buffer, &buf.view, PyBUF_SIMPLE)
    except (TypeError, BufferError) as exc:
        raise TypeError(
            f"expected a C-contiguous bytes-like object, got {type(buffer).__name__}: {exc}"
        ) from None
    buf.held = True
    return buf


cdef object _decode(object owner, const uint8_t *base, const uint8_t *p, size_t n, int flags):
    cdef ddpw_message m
    cdef ddpw_error err
    cdef ddpw_status st
    if n > NOGIL_BYTES:
        with nogil:
            st = ddpw_decode_payload(p, n, flags, &m, &err)
    else:
        st = ddpw_decode_payload(p, n, flags, &m, &err)
    if st != DDPW_OK:
        raise wire_error(&err)
    return message_from_c(&m, owner, base)


def decode_payload(buffer, *, bint allow_trailing=False):
    """Decode one payload (tag byte + body, no length prefix) into a message.

    Gradient and component-size arrays are views into ``buffer`` (no copy):
    keep ``buffer`` unchanged while the message is in use.
    Bytes after the last field raise ProtocolError unless ``allow_trailing``.
    """
    cdef int flags = DDPW_ALLOW_TRAILING if allow_trailing else 0
    cdef const uint8_t *p
    if type(buffer) is bytes:  # immutable and contiguous: no buffer export needed
        p = <const uint8_t *>PyBytes_AS_STRING(buffer)
        return _decode(buffer, p, p, <size_t>len(<bytes>buffer), flags)
    cdef HeldBuffer buf = _input_buffer(buffer)
    p = <const uint8_t *>buf.view.buf
    return _decode(buffer, p, p, <size_t>buf.view.len, flags)


def decode_frame(buffer, *, bint allow_trailing=False, max_frame=DEFAULT_MAX_FRAME):
    """Decode exactly one frame (big-endian length prefix + payload).

    A length over ``max_frame`` raises FrameTooLarge; a buffer shorter or
    longer than the frame raises ProtocolError.
    """
    cdef HeldBuffer buf
    cdef const uint8_t *p
    cdef size_t n
    cdef ddpw_error err
    cdef uint64_t length
    cdef uint64_t limit = _max_frame(max_frame)
    if type(buffer) is bytes:  # immutable and contiguous: no buffer export needed
        p = <const uint8_t *>PyBytes_AS_STRING(buffer)
        n = <size_t>len(<bytes>buffer)
    else:
        buf = _input_buffer(buffer)
        p = <const uint8_t *>buf.view.buf
        n = <size_t>buf.view.len
    if n < DDPW_PREFIX_LEN:
        raise ProtocolError(f"truncated frame: length prefix {n} of 4 bytes")
    length = ddpw_read_prefix(p)
    if ddpw_check_frame_len(length, limit, &err) != DDPW_OK:
        raise wire_error(&err)
    if n - DDPW_PREFIX_LEN < length:
        raise ProtocolError(f"truncated frame: payload {n - DDPW_PREFIX_LEN} of {length} bytes")
    if n - DDPW_PREFIX_LEN > length:
        raise ProtocolError(
            f"{n - DDPW_PREFIX_LEN - length} bytes after the frame "
            f"(decode_frame takes exactly one frame; use FrameReader for a stream)")
    return _decode(buffer, p, p + DDPW_PREFIX_LEN, <size_t>length,
                   DDPW_ALLOW_TRAILING if allow_trailing else 0)


cdef uint64_t _max_frame(object max_frame) except 0:
    if max_frame is DEFAULT_MAX_FRAME:
        return DDPW_DEFAULT_MAX_FRAME
    # No frame can announce more than 2^32 - 1 bytes, so larger limits clamp.
    value = PyNumber_Index(max_frame)
    if value < 1:
        raise ValueError(f"max_frame must be at least 1 byte, got {value}")
    return <uint64_t>min(value, 0xFFFFFFFF)


cdef uint64_t _checked_size(const ddpw_message *m, object max_frame) except? 0:
    cdef ddpw_error err
    cdef uint64_t size
    if ddpw_payload_size(m, &size, &err) != DDPW_OK:
        raise wire_error(&err)
    limit = _max_frame(max_frame)
    if size > limit:
        raise FrameTooLarge(size, limit)
    return size


def encode_frame(msg, *, max_frame=DEFAULT_MAX_FRAME):
    """Encode a message into one frame: the big-endian length prefix and payload.

    A payload over ``max_frame`` bytes raises FrameTooLarge (the reference
    refuses frames over 100,000,000 bytes).
    """
    cdef ddpw_message m
    cdef ddpw_error err
    cdef ddpw_status st
    cdef list keep = []
    cdef size_t written
    message_to_c(msg, &m, keep)
    cdef size_t frame_len = <size_t>(DDPW_PREFIX_LEN + _checked_size(&m, max_frame))
    out = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>frame_len)
    cdef uint8_t *dst = <uint8_t *>PyBytes_AS_STRING(out)
    if frame_len > NOGIL_BYTES:
        with nogil:
            st = ddpw_encode_frame(&m, dst, frame_len, &written, &err)
    else:
        st = ddpw_encode_frame(&m, dst, frame_len, &written, &err)
    if st != DDPW_OK:
        raise wire_error(&err)
    return out


def encode_frame_parts(msg, *, max_frame=DEFAULT_MAX_FRAME):
    """Encode a message as (head, bulk, tail) for a scatter-gather send.

    head is the length prefix and every field before the bulk field, bulk a
    byte memoryview on the caller's own buffer (no copy): the float32
    gradients of a gradient message or the ``data`` of CollectiveRequest /
    CollectiveResult; None for any other message. tail is the fields after
    the bulk (empty for the collectives).
    ``head + bulk + tail == encode_frame(msg)``.
    """
    cdef ddpw_message m
    cdef ddpw_error err
    cdef list keep = []
    cdef size_t written
    cdef _Layout lay = message_to_c(msg, &m, keep)
    _checked_size(&m, max_frame)
    cdef size_t head_len = ddpw_head_size(&m)
    head = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>head_len)
    if ddpw_encode_head(&m, <uint8_t *>PyBytes_AS_STRING(head), head_len, &written, &err) != DDPW_OK:
        raise wire_error(&err)
    if lay.bulk == lay.c.field_count:
        return head, None, b""
    bulk = memoryview(getattr(msg, lay.names[lay.bulk])).cast("B")
    if lay.c.fields[lay.bulk].type == DDPW_WT_F32VEC and not _LITTLE_HOST:
        # the wire is little-endian: only here does sending need a copy (raw
        # bytes go in the sender's own order: the codes name the dtype, not
        # its byte order)
        bulk = memoryview(np.frombuffer(bulk, np.float32).astype(_F32).tobytes())
    cdef size_t tail_len = ddpw_tail_len(m.tag)
    if tail_len == 0:
        return head, bulk, b""
    tail = PyBytes_FromStringAndSize(NULL, <Py_ssize_t>tail_len)
    if ddpw_encode_tail(&m, <uint8_t *>PyBytes_AS_STRING(tail), tail_len, &written, &err) != DDPW_OK:
        raise wire_error(&err)
    return head, bulk, tail


def float32_gradients(obj, str field="GradientPayload.gradients"):
    """``obj`` as a 1-D float32 numpy array over the same memory, after the
    very check the encoder makes before it sends gradients: every path that
    sends a buffer (the star's frames, the mesh's slices, shared memory)
    refuses what it cannot send with this one TypeError, naming ``field``
    and what ``obj`` is, before a byte goes out."""
    _float32_buffer(obj, field)
    return np.frombuffer(obj, dtype=np.float32)


def tag_max_payload(tag, max_frame):
    """The most payload bytes (tag included) a frame with ``tag`` may carry:
    the exact size of a fixed-size message, 65,536 for a small variable one,
    ``max_frame`` for a bulk one (gradients, collective data), 0 for an
    unknown tag."""
    cdef uint8_t t = <uint8_t>_uint(tag, 0xFF, "tag_max_payload", "tag")
    return ddpw_tag_max_payload(t, _uint(max_frame, 0xFFFFFFFFFFFFFFFF, "tag_max_payload",
                                         "max_frame"))


def _codes():
    """{family: [(name, value), ...]} for every code csrc/wire.h defines, and
    {dtype value: size}: what ddpwire.wire.extensions builds its enums from."""
    cdef unsigned v
    cdef const char *name
    families = {
        "Extension": (DDPW_CODES_EXTENSION, 0x10000),
        "RefusalReason": (DDPW_CODES_REFUSAL, 0x100),
        "CollectiveKind": (DDPW_CODES_COLLECTIVE_KIND, 0x100),
        "ReduceOp": (DDPW_CODES_REDUCE_OP, 0x100),
        "DType": (DDPW_CODES_DTYPE, 0x100),
        "Codec": (DDPW_CODES_CODEC, 0x100),
    }
    out = {}
    for family, (code, end) in families.items():
        names = []
        for v in range(<unsigned>end):
            name = ddpw_code_name(<ddpw_code_family>code, v)
            if name != NULL:
                names.append((name.decode("ascii"), v))
        out[family] = names
    sizes = {v: ddpw_dtype_size(<uint8_t>v) for _, v in out["DType"]}
    return out, sizes


cdef class FrameReader:
    """Cut a byte stream into frames and decode each into a message.

    ``feed`` accepts chunks of any size (down to one byte) and returns the
    messages completed by that chunk. Each frame's payload gets its own
    buffer, allocated only after its length prefix passed ``max_frame``, so
    decoded gradient views stay valid after later feeds.

    Any ProtocolError leaves the stream without a reliable frame boundary:
    the reader then refuses further input. ``pending`` counts the bytes of an
    unfinished frame; ``close()`` raises ProtocolError when the stream ended
    inside a frame. One reader serves one stream from one thread at a time.

    ``allowed_tags`` (a set of tag values), for a peer not yet trusted:
    once the length prefix and the tag byte of a frame have arrived, a tag
    outside the set is a ProtocolError, and a length over that tag's limit
    (``tag_max_payload``) a FrameTooLarge naming the message, both before
    the payload buffer is allocated.
    """
    cdef readonly uint64_t max_frame
    cdef readonly bint allow_trailing
    cdef readonly object allowed_tags
    cdef uint8_t _prefix[5]
    cdef Py_ssize_t _want
    cdef Py_ssize_t _prefix_len
    cdef bytearray _payload
    cdef Py_ssize_t _payload_len
    cdef Py_ssize_t _filled
    cdef object _failure

    def __init__(self, max_frame=DEFAULT_MAX_FRAME, *, bint allow_trailing=False,
                 allowed_tags=None):
        self.max_frame = _max_frame(max_frame)
        self.allow_trailing = allow_trailing
        if allowed_tags is None:
            self.allowed_tags = None
            self._want = DDPW_PREFIX_LEN
        else:
            self.allowed_tags = frozenset(
                <int>_uint(t, 0xFF, "FrameReader", "allowed_tags") for t in allowed_tags)
            self._want = DDPW_PREFIX_LEN + 1
        self._prefix_len = 0
        self._payload = None
        self._payload_len = 0
        self._filled = 0
        self._failure = None

    @property
    def pending(self):
        """Bytes received of a frame not yet complete, length prefix included
        (0 between frames)."""
        if self._payload is None:
            return self._prefix_len
        return DDPW_PREFIX_LEN + self._filled

    cdef _fail(self, exc):
        self._failure = exc
        self._payload = None
        self._payload_len = 0
        self._filled = 0
        self._prefix_len = 0
        return exc

    cdef int _check_tag(self, uint8_t tag, uint32_t length) except -1:
        cdef const char *name = ddpw_message_type(tag)
        cdef uint64_t limit
        if name == NULL:
            raise ProtocolError(f"unknown message tag: 0x{tag:02x}")
        if tag not in self.allowed_tags:
            raise ProtocolError(f"{_name(name)} (tag 0x{tag:02x}) not allowed here")
        limit = ddpw_tag_max_payload(tag, self.max_frame)
        if length > limit:
            raise FrameTooLarge(length, limit, message_type=_name(name))
        return 0

    def feed(self, data):
        """Take the next chunk of the stream; return the messages it completed."""
        if self._failure is not None:
            raise ProtocolError(f"FrameReader unusable after an earlier error: {self._failure}")
        cdef HeldBuffer buf = _input_buffer(data)
        cdef const uint8_t *src = <const uint8_t *>buf.view.buf
        cdef Py_ssize_t n = buf.view.len
        cdef Py_ssize_t pos = 0, take
        cdef ddpw_error err
        cdef uint32_t length
        cdef uint8_t *dst
        cdef const uint8_t *p
        cdef list out = []
        while pos < n:
            if self._payload is None:
                take = min(self._want - self._prefix_len, n - pos)
                memcpy(self._prefix + self._prefix_len, src + pos, <size_t>take)
                self._prefix_len += take
                pos += take
                if self._prefix_len < <Py_ssize_t>DDPW_PREFIX_LEN:
                    break
                length = ddpw_read_prefix(self._prefix)
                # checked as soon as the prefix is complete, tag or no tag
                if ddpw_check_frame_len(length, self.max_frame, &err) != DDPW_OK:
                    raise self._fail(wire_error(&err))
                if self._prefix_len < self._want:
                    break
                if self._want > <Py_ssize_t>DDPW_PREFIX_LEN:
                    try:
                        self._check_tag(self._prefix[DDPW_PREFIX_LEN], length)
                    except ProtocolError as exc:
                        raise self._fail(exc)
                self._payload = PyByteArray_FromStringAndSize(NULL, <Py_ssize_t>length)
                self._payload_len = length
                # the tag byte, when it was read ahead, is the payload's first
                self._filled = self._prefix_len - <Py_ssize_t>DDPW_PREFIX_LEN
                if self._filled:
                    (<uint8_t *>PyByteArray_AS_STRING(self._payload))[0] = self._prefix[DDPW_PREFIX_LEN]
                self._prefix_len = 0
            take = min(self._payload_len - self._filled, n - pos)
            payload = self._payload  # keeps it alive while the GIL is released
            dst = <uint8_t *>PyByteArray_AS_STRING(payload) + self._filled
            if take > NOGIL_BYTES:
                with nogil:
                    memcpy(dst, src + pos, <size_t>take)
            else:
                memcpy(dst, src + pos, <size_t>take)
            self._filled += take
            pos += take
            if self._filled == self._payload_len:
                self._payload = None
                self._filled = 0
                p = <const uint8_t *>PyByteArray_AS_STRING(payload)
                try:
                    out.append(_decode(payload, p, p, <size_t>self._payload_len,
                                       DDPW_ALLOW_TRAILING if self.allow_trailing else 0))
                except ProtocolError as exc:
                    raise self._fail(exc)
        return out

    def close(self):
        """End of stream: raise ProtocolError if it ended inside a frame."""
        if self._payload is not None:
            have, need = self._filled, self._payload_len
            self._fail(ProtocolError("stream closed"))
            raise ProtocolError(
                f"stream ended inside a frame: payload {have} of {need} bytes")
        if self._prefix_len:
            have = self._prefix_len
            self._fail(ProtocolError("stream closed"))
            raise ProtocolError(
                f"stream ended inside a frame: length prefix {have} of 4 bytes")
