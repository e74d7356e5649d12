"""Every place that describes a message agrees with the one table,
ddpwire.wire.messages.LAYOUTS: the C codec's tags (csrc/wire.h and its Cython
mirror), its bytes (each message encoded by the compiled codec against the
bytes the table's layout gives, and decoded back), the Python classes, and
the tables of docs/extensions.md and docs/protocol-notes.md. A message
changed in one place and not the others fails here."""
from __future__ import annotations

import re
import struct
from pathlib import Path

import numpy as np
import pytest

from ddpwire import decode_frame, encode_frame
from ddpwire.wire.extensions import CollectiveKind, DType, ReduceOp
from ddpwire.wire.messages import LAYOUTS, MESSAGE_TYPES

ROOT = Path(__file__).resolve().parent.parent

# the Python constructors keep wire order, but for MeshPeers, whose
# coordinator_share comes last so that it may be left out
PYTHON_ORDER = {"MeshPeers": ("key", "codec", "shared_memory", "peers", "coordinator_share")}


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
        names = tuple(n for n, _ in lay.fields)
        assert cls.__slots__ == PYTHON_ORDER.get(lay.name, names), lay.name


def _c_enum(text: str, enum: str) -> dict:
    body = re.search(r"typedef enum %s \{(.*?)\} %s;" % (enum, enum), text, re.S).group(1)
    body = re.sub(r"/\*.*?\*/", "", body, flags=re.S)
    return {name: int(value, 16) for name, value in re.findall(r"(DDPW_\w+) = (0x[0-9A-Fa-f]+)", body)}


def test_the_c_header_and_its_cython_mirror_have_the_tables_tags():
    tags = _c_enum(_read("csrc/wire.h"), "ddpw_tag")
    assert tags == {f"DDPW_{_snake(lay.name)}": lay.tag for lay in LAYOUTS}
    pxd = _read("ddpwire/includes/wire.pxd")
    mirror = re.search(r"ctypedef enum ddpw_tag:\n((?:\s+DDPW_\w+\n)+)", pxd).group(1).split()
    assert mirror == list(tags)


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
        fields = list(PYTHON_ORDER.get(name, [n for n, _ in lay.fields]))
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
