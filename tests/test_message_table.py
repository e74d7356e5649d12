"""The one description of the messages, csrc/messages.def, and what is made
from it: the compiled codec's tables (ddpwire.wire.messages.LAYOUTS reads
them), its bytes (each message encoded by the compiled codec against the
bytes the table's layout gives, written here with struct, and decoded back),
the Python classes, and the tables of docs/extensions.md and
docs/protocol-notes.md, which are prose and so only checked."""
from __future__ import annotations

import inspect
import re
import struct
import typing
from pathlib import Path

import numpy as np
import pytest

from ddpwire import _core, decode_frame, encode_frame
from ddpwire.wire.extensions import CollectiveKind, DType, ReduceOp
from ddpwire.wire import messages
from ddpwire.wire.messages import LAYOUTS, MESSAGE_TYPES

ROOT = Path(__file__).resolve().parent.parent

def _snake(name: str) -> str:
    return re.sub(r"(?<!^)(?=[A-Z])", "_", name).upper()


def _read(path: str) -> str:
    file = ROOT / path
    if not file.exists():
        pytest.skip(f"{path} is not in this tree")  # the wheel's tests run without csrc/ and docs/
    return file.read_text()


def test_the_table_is_in_tag_order_and_names_every_class():
    tags = [lay.tag for lay in LAYOUTS]
    assert tags == sorted(set(tags))
    assert set(tags) == set(MESSAGE_TYPES)
    for lay in LAYOUTS:
        cls = MESSAGE_TYPES[lay.tag]
        assert cls.__name__ == lay.name and cls.TAG == lay.tag
        assert getattr(messages, lay.name) is cls and lay.name in messages.__all__
        assert cls.__slots__ == lay.python_order, lay.name
        assert cls.__doc__ == lay.doc and f"0x{lay.tag:02x}".upper() in lay.doc.upper(), lay.name
        params = list(inspect.signature(cls).parameters)
        assert params == list(lay.python_order) + (["extensions"] if lay.extensible else [])


def test_the_classes_type_hints_resolve():
    for cls in MESSAGE_TYPES.values():
        hints = typing.get_type_hints(cls.__init__)
        assert list(hints) == list(inspect.signature(cls).parameters) + ["return"]
    assert typing.get_type_hints(messages.StepCommit)["global_loss"] is float
    assert typing.get_type_hints(messages.BlockGradientPayload)["component_sizes"] == \
        typing.Sequence[int]


def test_a_field_with_the_last_rule_comes_last_with_a_default_of_0():
    lay = next(lay for lay in LAYOUTS if lay.name == "MeshPeers")
    assert dict(lay.rules) == {"codec": "codec", "shared_memory": "flag",
                               "coordinator_share": "last"}
    assert [n for n, _ in lay.fields].index("coordinator_share") == 3  # on the wire
    assert lay.python_order == ("key", "codec", "shared_memory", "peers", "coordinator_share")
    peers = messages.MeshPeers(bytes(32), 0, 0, "")
    assert peers.coordinator_share == 0


def test_the_stub_is_made_from_the_table():
    # type checkers read messages.pyi for the classes made at import; an
    # edited messages.def regenerates it (the command is in stub()'s docstring)
    pyi = Path(messages.__file__).with_suffix(".pyi")
    assert pyi.read_text() == messages.stub()
    assert "class StepCommit(Message):" in messages.stub()
    compile(messages.stub(), str(pyi), "exec")


def _def_messages(text: str) -> list:
    """(tag, ENUM, Class, fields as (type, name)) of each DDPW_MESSAGE in
    csrc/messages.def, read as text."""
    text = re.sub(r"/\*.*?\*/", "", text, flags=re.S)
    out = []
    for m in re.finditer(r"DDPW_MESSAGE\((0x[0-9A-F]{2}), (\w+), (\w+),(.*?)\n\n", text + "\n\n",
                         re.S):
        fields = re.findall(r"DDPW_F\((\w+), (\w+), (\w+), (\w+)\)", m.group(4))
        out.append((int(m.group(1), 16), m.group(2), m.group(3),
                    [(t.lower(), n) for t, n, _, _ in fields]))
    return out


def test_the_compiled_tables_are_messages_def():
    # a module built from another messages.def than the tree's fails here
    described = _def_messages(_read("csrc/messages.def"))
    assert [(tag, cls) for tag, _, cls, _ in described] == [(lay.tag, lay.name) for lay in LAYOUTS]
    for (tag, enum, cls, fields), lay in zip(described, LAYOUTS):
        assert enum == _snake(cls)
        assert fields == [(k, n) for n, k in lay.fields], cls


def test_the_compiled_codes_are_codes_def():
    # every code family of csrc/codes.def, names, values and dtype sizes, as
    # the compiled module gives them to ddpwire.wire.extensions
    text = re.sub(r"/\*.*?\*/", "", _read("csrc/codes.def"), flags=re.S)
    families = {"EXT": "Extension", "REFUSAL": "RefusalReason", "KIND": "CollectiveKind",
                "OP": "ReduceOp", "DTYPE": "DType", "CODEC": "Codec"}
    described = {name: [] for name in families.values()}
    sizes = {}
    for macro, args in re.findall(r"^DDPW_(EXT|REFUSAL|KIND|OP|DTYPE|CODEC)\((.*)\)$", text, re.M):
        name, enum, value, *size = [a.strip() for a in args.split(",")]
        assert enum == name.upper()
        described[families[macro]].append((name, int(value, 0)))
        if size:
            sizes[int(value, 0)] = int(size[0])
    compiled, compiled_sizes = _core._codes()
    assert {f: sorted(v, key=lambda c: c[1]) for f, v in compiled.items()} == \
        {f: sorted(v, key=lambda c: c[1]) for f, v in described.items()}
    assert compiled_sizes == sizes and len(sizes) == 9


def test_the_cython_mirror_names_only_tags_messages_def_has():
    enums = {f"DDPW_{enum}" for _, enum, _, _ in _def_messages(_read("csrc/messages.def"))}
    pxd = _read("ddpwire/includes/wire.pxd")
    mirror = re.search(r"ctypedef enum ddpw_tag:\n((?:\s+DDPW_\w+\n)+)", pxd).group(1).split()
    assert mirror and set(mirror) <= enums


# ---- the bytes: the table's layout, written here with struct ----

_SCALARS = {"u8": "<B", "u16": "<H", "u32": "<I", "u64": "<Q", "f32": "<f"}


def _field_bytes(kind: str, value) -> bytes:
    if kind in _SCALARS:
        return struct.pack(_SCALARS[kind], value)
    if kind == "string":
        raw = value.encode()
        return struct.pack("<I", len(raw)) + raw
    if kind == "f32vec":
        return struct.pack("<Q", len(value)) + np.asarray(value, "<f4").tobytes()
    if kind == "u32list":
        return struct.pack("<I", len(value)) + np.asarray(value, "<u4").tobytes()
    if kind == "bytes32":
        assert len(value) == 32
        return bytes(value)
    if kind == "bytes":
        raw = np.asarray(value).tobytes()
        return struct.pack("<Q", len(raw)) + raw
    raise AssertionError(f"the table names an unknown wire type {kind!r}")


def _sample(name: str, kind: str, i: int):
    """A value of ``kind`` for field ``name``, distinct per field, and valid
    where the codec checks (codes, a count that matches the data)."""
    valid = {"kind": int(CollectiveKind.ALLREDUCE), "op": int(ReduceOp.SUM),
             "dtype": int(DType.UINT8), "count": 6, "codec": 1, "shared_memory": 1, "reason": 2,
             "component": 3}
    if name in valid:
        return valid[name]
    return {"u8": 5 + i, "u16": 0x1234 + i, "u32": 0x01020304 + i, "u64": (1 << 40) + i,
            "f32": 1.5 + i, "string": f"név-{i}", "f32vec": np.array([1.0, -2.5, 3.25], np.float32),
            "u32list": [3, 1, 4], "bytes32": bytes(range(i, i + 32)),
            "bytes": np.arange(6, dtype=np.uint8)}[kind]


@pytest.mark.parametrize("lay", LAYOUTS, ids=lambda lay: lay.name)
def test_the_codec_writes_and_reads_the_tables_bytes(lay):
    values = {n: _sample(n, k, i) for i, (n, k) in enumerate(lay.fields)}
    if lay.name == "MeshPeers":
        values["peers"] = "10.0.0.1:29500,10.0.0.2:29500"
    msg = MESSAGE_TYPES[lay.tag](**values)
    payload = bytes([lay.tag]) + b"".join(_field_bytes(k, values[n]) for n, k in lay.fields)
    frame = struct.pack(">I", len(payload)) + payload
    assert encode_frame(msg) == frame
    assert decode_frame(frame) == msg


def _md_rows(text: str, header: str) -> list:
    """The rows of the markdown table whose header line starts with ``header``."""
    lines = text.splitlines()
    start = next(i for i, line in enumerate(lines) if line.startswith(header))
    rows = []
    for line in lines[start + 2:]:
        if not line.startswith("|"):
            break
        rows.append([c.strip() for c in line.strip().strip("|").split("|")])
    return rows


def _doc_type(kind: str) -> str:
    return {"bytes32": "32 bytes"}.get(kind, kind)


def test_docs_extensions_table_has_the_tables_extension_messages():
    rows = _md_rows(_read("docs/extensions.md"), "| tag | message | direction | body, in order |")
    want = [[f"`0x{lay.tag:02x}`", lay.name, lay.direction,
             ", ".join(f"{n}: {_doc_type(k)}" for n, k in lay.fields)]
            for lay in LAYOUTS if lay.tag >= 0x40]
    # a field's note in parentheses is the doc's own: the layout is the rest
    got = [[tag, name, direction, re.sub(r" \([^)]*\)", "", body)]
           for tag, name, direction, body in rows]
    assert got == want


def test_docs_extensions_constructor_table_names_the_python_fields():
    rows = _md_rows(_read("docs/extensions.md"), "| message | fields (constructor order) |")
    for name, args in rows:
        lay = next(lay for lay in LAYOUTS if lay.name == name)
        listed = [a.split("=")[0].strip() for a in re.sub(r"\(.*?\)", "", args).strip("` ").split(",")]
        listed = [a.strip("` ") for a in listed if a.strip("` ")]
        fields = list(lay.python_order)
        if lay.extensible:
            fields.append("extensions")
        assert listed == fields, name


def test_protocol_notes_name_the_tag_ranges_the_table_has():
    text = _read("docs/protocol-notes.md")
    low, high, ext_low, ext_high = re.search(
        r"tag outside 0x([0-9A-F]{2})\.\.0x([0-9A-F]{2}) and 0x([0-9A-F]{2})\.\.0x([0-9A-F]{2})",
        text).groups()
    reference = [lay.tag for lay in LAYOUTS if lay.tag < 0x40]
    extension = [lay.tag for lay in LAYOUTS if lay.tag >= 0x40]
    assert (int(low, 16), int(high, 16)) == (min(reference), max(reference))
    assert (int(ext_low, 16), int(ext_high, 16)) == (min(extension), max(extension))
