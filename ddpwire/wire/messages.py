"""The eleven messages of the DDP wire protocol and ddpwire's extension
messages (docs/extensions.md), as plain Python objects.

Every class here is made at import from the one description of the
messages, csrc/messages.def, as the compiled codec (:mod:`ddpwire._core`)
holds it: name, tag, fields in wire order, docstring. :data:`LAYOUTS` is that
description in Python. Field names and order follow the wire layout (see
docs/protocol-notes.md), except MeshPeers.coordinator_share, which the class
takes last, with a default of 0, so that it may be left out. Each class
carries its wire ``TAG``; the classes only hold values.
tests/test_message_table.py checks the docs against the table.

Value types:

* integers are Python ints (``u8``/``u16``/``u32``/``u64`` on the wire; the
  encoder checks the range);
* strings are ``str`` (UTF-8 on the wire);
* ``loss``, ``global_loss`` and the other ``f32`` fields are Python floats
  holding a float32 value: the decoder widens the wire value bit-exactly (NaN
  payloads included) and the encoder rounds to float32;
* ``gradients`` is a float32 buffer. Decoded messages hold a read-only or
  writable numpy ``float32`` view *into the decoded buffer* (no copy); for
  encoding, any C-contiguous float32 buffer works (numpy array, a CPU
  tensor's ``.numpy()``, ``array.array('f')``, a ``memoryview`` of format
  ``'f'``);
* ``component_sizes`` is decoded as a numpy ``uint32`` view into the buffer;
  for encoding any sequence of ints that fit in u32 works.
* ``extensions`` (JoinRequest, JoinAccepted) is ``None`` (no extension block:
  the reference bytes) or a dict ``{entry type: value bytes}``; decoded
  values are ``bytes``, in wire order. It is not among ``__slots__`` of the
  class (those are the reference fields) but compares like one.
* ``nonce`` and ``proof`` are 32 ``bytes``; ``data`` of the collective
  messages is decoded as a numpy ``uint8`` view into the buffer (no copy;
  ``.view(DType.X.numpy)`` reinterprets it) and for encoding is any
  C-contiguous buffer of ``count`` elements of ``dtype``.

Equality is bit-exact: gradients compare by their float32 bit patterns (so a
NaN equals a NaN with the same bits, and -0.0 differs from 0.0), and the
float fields by their bits as well. Messages are mutable and unhashable.
"""
from __future__ import annotations

import struct
from dataclasses import dataclass
from typing import Any, Callable, ClassVar, Dict, Optional, Sequence, Tuple, Type

import numpy as np

from .. import _core

__all__ = [  # the message classes are added where they are made, below
    "Message",
    "NO_WORKER",
    "NON_BLOCK_COMPONENTS",
    "MESSAGE_TYPES",
    "Layout",
    "LAYOUTS",
]

# A float32 buffer: what a gradients field holds or accepts.
Float32Buffer = Any


def _float32_bits(value: Any) -> np.ndarray:
    return np.asarray(value, dtype=np.float32).reshape(-1).view(np.uint32)


def _same_gradients(a: Any, b: Any) -> bool:
    bits_a = _float32_bits(a)
    bits_b = _float32_bits(b)
    return bits_a.shape == bits_b.shape and bool(np.array_equal(bits_a, bits_b))


def _same_sizes(a: Any, b: Any) -> bool:
    return bool(np.array_equal(np.asarray(a).reshape(-1), np.asarray(b).reshape(-1)))


_double = struct.Struct("d")  # host order: a bit comparison, not a wire format


def _same_float(a: Any, b: Any) -> bool:
    return _double.pack(a) == _double.pack(b)


def _same_bytes(a: Any, b: Any) -> bool:
    # any C-contiguous buffers, compared as their raw bytes
    return memoryview(a).cast("B") == memoryview(b).cast("B")


# how two values of a wire type compare (others with ==)
_COMPARE: Dict[str, Callable[[Any, Any], bool]] = {
    "bytes": _same_bytes,
    "f32vec": _same_gradients,
    "u32list": _same_sizes,
    "f32": _same_float,
}


class Message:
    """Base of every wire message. ``TAG`` is the message's tag byte."""

    __slots__ = ()
    TAG: ClassVar[int]
    #: the wire type of each field, by name (set on each class)
    _WIRE_TYPES: ClassVar[Dict[str, str]] = {}

    def __eq__(self, other: object) -> bool:
        if type(other) is not type(self):
            return NotImplemented
        for name in self.__slots__:
            a = getattr(self, name)
            b = getattr(other, name)
            same = _COMPARE.get(self._WIRE_TYPES[name])
            if same is None:
                if a != b:
                    return False
            elif not same(a, b):
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # mutable, and arrays are unhashable

    def __repr__(self) -> str:
        fields = ", ".join(f"{name}={getattr(self, name)!r}" for name in self.__slots__)
        return f"{type(self).__name__}({fields})"


Extensions = Optional[Dict[int, bytes]]


class _Extensible(Message):
    """A reference message that may carry the extension block after its last
    field. ``extensions`` lives in this base's slot so that the subclass's
    ``__slots__`` stay exactly the reference fields."""

    __slots__ = ("extensions",)
    extensions: Extensions

    def __eq__(self, other: object) -> bool:
        same = super().__eq__(other)
        if same is not True:
            return same
        return self.extensions == other.extensions  # type: ignore[attr-defined]

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, extensions={self.extensions!r})"



#: NonBlockGradientPayload.component: the protocol's code for each non-block
#: part of the model, by name (in code order)
NON_BLOCK_COMPONENTS: Dict[str, int] = {"lm_head": 0, "final_norm": 1, "embedding": 2}

#: StepReport.bad_worker / StepCommit.bad_worker when every value was finite
NO_WORKER = 0xFFFFFFFF


@dataclass(frozen=True)
class Layout:
    """One message's place on the wire: its tag, who sends it, and its
    fields in wire order with their wire types (``u8`` ``u16`` ``u32``
    ``u64`` ``f32``; ``string``: u32 byte count and UTF-8; ``f32vec``: u64
    count and float32 elements; ``u32list``: u32 count and u32 elements;
    ``bytes32``: 32 raw bytes; ``bytes``: u64 byte count and the bytes).
    ``extensible``: an extension block may follow the last field.
    ``rules``: the fields with a rule (csrc/wire.h, ddpw_rule), by name:
    what the codec refuses (``codec``, ``flag``, ``scale``, ``dtype``,
    ``count_of_dtype``, ``within_total``), or ``last``, a field the class
    takes last with a default of 0."""

    tag: int
    name: str
    direction: str
    fields: Tuple[Tuple[str, str], ...]
    extensible: bool = False
    rules: Tuple[Tuple[str, str], ...] = ()
    doc: str = ""

    @property
    def python_order(self) -> Tuple[str, ...]:
        """The fields in the order the class takes them."""
        last = {name for name, rule in self.rules if rule == "last"}
        names = [name for name, _ in self.fields]
        return tuple([n for n in names if n not in last] + [n for n in names if n in last])


def _layouts() -> Tuple[Layout, ...]:
    out = []
    for tag, name, direction, extensible, doc, fields in _core.message_layouts():
        out.append(Layout(tag, name, direction, tuple((f, t) for f, t, _ in fields), extensible,
                          tuple((f, r) for f, _, r in fields if r != "none"), doc))
    return tuple(out)


#: The one description of every message's layout, in tag order, as the
#: compiled codec holds it (csrc/messages.def). The classes below are made
#: from it, and tests/test_message_table.py checks the docs against it.
LAYOUTS: Tuple[Layout, ...] = _layouts()

# the Python type of a value of each wire type, as an annotation (a string,
# as every annotation of this module is), and the names those strings use,
# which typing.get_type_hints looks up in this module
_PYTHON_TYPES: Dict[str, str] = {
    "u8": "int", "u16": "int", "u32": "int", "u64": "int", "f32": "float", "string": "str",
    "bytes32": "bytes", "u32list": "Sequence[int]", "f32vec": "Float32Buffer", "bytes": "Any",
}
_ANNOTATION_NAMES = {"Sequence": Sequence, "Float32Buffer": Float32Buffer, "Any": Any}


def _message_class(layout: Layout) -> Type[Message]:
    """The class of one message: slots for its fields, an ``__init__`` that
    takes them in :attr:`Layout.python_order` (a ``last`` field defaults to
    0; ``extensions`` to None where the message is extensible), its TAG and
    its docstring."""
    order = layout.python_order
    last = {name for name, rule in layout.rules if rule == "last"}
    params = [f"{n}=0" if n in last else n for n in order]
    names = list(order)
    if layout.extensible:
        params.append("extensions=None")
        names.append("extensions")
    body = "".join(f"    self.{n} = {n}\n" for n in names) or "    pass\n"
    # generated as source, as dataclasses and namedtuple do: a plain
    # __init__ costs a small message no more than a hand-written one
    scope: Dict[str, Any] = {}
    exec(f"def __init__({', '.join(['self', *params])}):\n{body}", globals(), scope)
    init = scope["__init__"]
    wire = dict(layout.fields)
    annotations = {n: _PYTHON_TYPES[wire[n]] for n in order}
    init.__annotations__ = {**annotations,
                            **({"extensions": "Extensions"} if layout.extensible else {}),
                            "return": "None"}
    init.__qualname__ = f"{layout.name}.__init__"
    namespace = {
        "__slots__": order,
        "__doc__": layout.doc,
        "__module__": __name__,
        "__qualname__": layout.name,
        "__annotations__": {"TAG": "ClassVar[int]", **annotations},
        "__init__": init,
        "TAG": layout.tag,
        "_WIRE_TYPES": wire,
    }
    cls = type(layout.name, (_Extensible if layout.extensible else Message,), namespace)
    # a dataclass, so that a user's @dataclass subclass takes the same fields
    cls = dataclass(eq=False, init=False, repr=False)(cls)
    _core.register_message_class(cls)
    return cls


#: tag -> message class, for every tag the protocol and its extensions define
MESSAGE_TYPES: Dict[int, Type[Message]] = {lay.tag: _message_class(lay) for lay in LAYOUTS}

# each class under its name here, as `from ddpwire.wire.messages import
# StepCommit` expects
globals().update({cls.__name__: cls for cls in MESSAGE_TYPES.values()})
__all__ += [cls.__name__ for cls in MESSAGE_TYPES.values()]


def stub() -> str:
    """The text of messages.pyi, which gives type checkers the classes this
    module makes at run time; tests/test_message_table.py checks that the
    file is this text. Regenerate with ``python -c "from ddpwire.wire.messages
    import stub; print(stub(), end='')" > ddpwire/wire/messages.pyi``."""
    out = [
        "# Made from csrc/messages.def by ddpwire.wire.messages.stub(): do not edit.",
        "from typing import Any, ClassVar, Dict, Optional, Sequence, Tuple, Type",
        "",
        "Float32Buffer = Any",
        "Extensions = Optional[Dict[int, bytes]]",
        "NO_WORKER: int",
        "NON_BLOCK_COMPONENTS: Dict[str, int]",
        "",
        "class Message:",
        "    TAG: ClassVar[int]",
        "    def __eq__(self, other: object) -> bool: ...",
        "",
        "class Layout:",
        "    tag: int",
        "    name: str",
        "    direction: str",
        "    fields: Tuple[Tuple[str, str], ...]",
        "    extensible: bool",
        "    rules: Tuple[Tuple[str, str], ...]",
        "    doc: str",
        "    @property",
        "    def python_order(self) -> Tuple[str, ...]: ...",
        "",
        "LAYOUTS: Tuple[Layout, ...]",
        "MESSAGE_TYPES: Dict[int, Type[Message]]",
    ]
    for lay in LAYOUTS:
        cls = MESSAGE_TYPES[lay.tag]
        hints = {n: _PYTHON_TYPES[t] for n, t in lay.fields}
        last = {n for n, rule in lay.rules if rule == "last"}
        params = [f"{n}: {hints[n]}" + (" = ..." if n in last else "") for n in lay.python_order]
        doc = lay.doc.replace("\n", "\n    ").replace("\n    \n", "\n\n")
        out += ["", f"class {cls.__name__}(Message):", f'    """{doc}"""', ""]
        out += [f"    {n}: {hints[n]}" for n in lay.python_order]
        if lay.extensible:
            out.append("    extensions: Extensions")
            params.append("extensions: Extensions = ...")
        out.append(f"    def __init__(self{''.join(', ' + p for p in params)}) -> None: ...")
    return "\n".join(out) + "\n"
