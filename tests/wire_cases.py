"""Reference frames and malformed inputs from tests/data, turned into Python values.

The JSON files were produced by the Rust reference implementation; their
f32 values carry exact ``bits``, which are what the tests compare.
"""
from __future__ import annotations

import json
import struct
from pathlib import Path
from typing import Any, Dict, List

import numpy as np

import ddpwire.wire.messages as messages

DATA = Path(__file__).parent / "data"

VECTORS: List[Dict[str, Any]] = json.loads((DATA / "vectors.json").read_text())["vectors"]
MALFORMED: List[Dict[str, Any]] = json.loads((DATA / "malformed.json").read_text())["cases"]

STRING_FIELDS = ("node_id", "backend")
FLOAT_FIELDS = ("loss", "global_loss")


def f64_from_f32_bits(bits: int) -> float:
    """The double that holds binary32 ``bits`` exactly (NaN payloads included),
    widened by hand: a conversion instruction would quiet a signalling NaN."""
    sign = (bits >> 31) & 1
    exponent = (bits >> 23) & 0xFF
    mantissa = bits & 0x7FFFFF
    if exponent == 0xFF and mantissa:
        wide = (sign << 63) | (0x7FF << 52) | (mantissa << 29)
        return struct.unpack("<d", struct.pack("<Q", wide))[0]
    return struct.unpack("<f", struct.pack("<I", bits))[0]


def f32_bits_from_f64(value: float) -> int:
    """Inverse of f64_from_f32_bits for doubles that hold a binary32 value."""
    wide = struct.unpack("<Q", struct.pack("<d", value))[0]
    if (wide >> 52) & 0x7FF == 0x7FF and wide & ((1 << 52) - 1):
        return ((wide >> 63) << 31) | (0xFF << 23) | ((wide >> 29) & 0x7FFFFF)
    return struct.unpack("<I", struct.pack("<f", value))[0]


def gradient_bits(entries: List[Dict[str, Any]]) -> np.ndarray:
    return np.array([int(e["bits"], 16) for e in entries], dtype=np.uint32)


def expected_message(spec: Dict[str, Any]) -> messages.Message:
    """Build the message a JSON ``message``/``decoded`` object describes."""
    cls = getattr(messages, spec["type"])
    values = {}
    for field in cls.__slots__:
        raw = spec[field]
        if field in STRING_FIELDS:
            values[field] = bytes.fromhex(raw["utf8_hex"]).decode("utf-8")
        elif field in FLOAT_FIELDS:
            values[field] = f64_from_f32_bits(int(raw["bits"], 16))
        elif field == "gradients":
            values[field] = gradient_bits(raw).view(np.float32)
        elif field == "component_sizes":
            values[field] = list(raw)
        else:
            values[field] = raw
    return cls(**values)
