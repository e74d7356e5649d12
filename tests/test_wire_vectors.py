"""Every reference frame decodes to its fields, bit for bit, and every message
re-encodes to exactly the reference bytes."""
from __future__ import annotations

import numpy as np
import pytest

import ddpwire
from ddpwire.wire import messages
from wire_cases import (
    FLOAT_FIELDS,
    STRING_FIELDS,
    VECTORS,
    expected_message,
    f32_bits_from_f64,
    gradient_bits,
)

IDS = [v["name"] for v in VECTORS]


def frame_of(vector) -> bytes:
    return bytes.fromhex(vector["frame_hex"])


def check_fields(msg, spec) -> None:
    """Compare a decoded message with the JSON description field by field."""
    assert type(msg).__name__ == spec["type"]
    assert type(msg).TAG == spec["tag"]
    for field in type(msg).__slots__:
        got = getattr(msg, field)
        want = spec[field]
        if field in STRING_FIELDS:
            assert got == want["value"]
            assert got.encode("utf-8").hex() == want["utf8_hex"]
            assert len(got.encode("utf-8")) == want["byte_len"]
        elif field in FLOAT_FIELDS:
            assert isinstance(got, float)
            assert f32_bits_from_f64(got) == int(want["bits"], 16), field
        elif field == "gradients":
            assert isinstance(got, np.ndarray)
            assert got.dtype == np.float32
            assert got.shape == (len(want),)
            np.testing.assert_array_equal(got.view(np.uint32), gradient_bits(want))
        elif field == "component_sizes":
            assert isinstance(got, np.ndarray)
            assert got.dtype == np.uint32
            assert got.tolist() == want
        else:
            assert type(got) is int, field
            assert got == want, field


@pytest.mark.parametrize("vector", VECTORS, ids=IDS)
def test_frame_decodes_to_its_fields(vector):
    frame = frame_of(vector)
    assert len(frame) == 4 + vector["payload_len"]
    check_fields(ddpwire.decode_frame(frame), vector["message"])


@pytest.mark.parametrize("vector", VECTORS, ids=IDS)
def test_payload_decodes_to_its_fields(vector):
    payload = frame_of(vector)[4:]
    check_fields(ddpwire.decode_payload(payload), vector["message"])
    # any bytes-like object, not only bytes
    check_fields(ddpwire.decode_payload(bytearray(payload)), vector["message"])
    check_fields(ddpwire.decode_payload(memoryview(payload)), vector["message"])


@pytest.mark.parametrize("vector", VECTORS, ids=IDS)
def test_message_encodes_to_reference_bytes(vector):
    msg = expected_message(vector["message"])
    assert ddpwire.encode_frame(msg) == frame_of(vector)


@pytest.mark.parametrize("vector", VECTORS, ids=IDS)
def test_decoded_message_reencodes_bit_exact(vector):
    frame = frame_of(vector)
    decoded = ddpwire.decode_frame(frame)
    assert ddpwire.encode_frame(decoded) == frame
    assert decoded == expected_message(vector["message"])


@pytest.mark.parametrize("vector", VECTORS, ids=IDS)
def test_frame_parts_concatenate_to_the_frame(vector):
    frame = frame_of(vector)
    msg = expected_message(vector["message"])
    head, gradients, tail = ddpwire.encode_frame_parts(msg)
    assert isinstance(head, bytes) and isinstance(tail, bytes)
    if "gradients" in type(msg).__slots__:
        assert isinstance(gradients, memoryview)
        assert gradients.nbytes == 4 * len(vector["message"]["gradients"])
        assert head + gradients.tobytes() + tail == frame
        assert len(tail) == {4: 20, 5: 4}.get(type(msg).TAG, 0)
    else:
        assert gradients is None and tail == b""
        assert head == frame


@pytest.mark.parametrize("vector", VECTORS, ids=IDS)
def test_frame_reader_decodes_the_frame(vector):
    reader = ddpwire.FrameReader()
    got = reader.feed(frame_of(vector))
    assert len(got) == 1
    check_fields(got[0], vector["message"])
    assert reader.pending == 0


def test_every_message_type_has_a_vector_and_its_tag():
    by_tag = {v["message"]["tag"]: v["message"]["type"] for v in VECTORS}
    assert set(by_tag) == set(range(1, 12))
    for tag, name in by_tag.items():
        cls = getattr(ddpwire, name)
        assert cls is getattr(messages, name)
        assert cls.TAG == tag
        assert messages.MESSAGE_TYPES[tag] is cls
