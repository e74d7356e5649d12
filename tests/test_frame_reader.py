"""FrameReader: frames reassemble from chunks of any size, errors stop the
stream, and decoded views stay valid."""
from __future__ import annotations

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ddpwire
from ddpwire import FrameReader, FrameTooLarge, ProtocolError
from wire_cases import VECTORS

FRAMES = [bytes.fromhex(v["frame_hex"]) for v in VECTORS]
STREAM = b"".join(FRAMES)
EXPECTED = [ddpwire.decode_frame(f) for f in FRAMES]


def feed_in_chunks(reader: FrameReader, data: bytes, cuts) -> list:
    out = []
    start = 0
    for cut in sorted(cuts) + [len(data)]:
        out += reader.feed(data[start:cut])
        start = cut
    return out


@pytest.mark.parametrize("index", range(len(FRAMES)), ids=[v["name"] for v in VECTORS])
def test_frame_split_at_every_byte_position(index):
    frame = FRAMES[index]
    for cut in range(len(frame) + 1):
        reader = FrameReader()
        first = reader.feed(frame[:cut])
        assert first == [] or (cut == len(frame) and first == [EXPECTED[index]])
        if not first:
            assert reader.pending == cut
        got = first + reader.feed(frame[cut:])
        assert got == [EXPECTED[index]], cut
        assert reader.pending == 0
        reader.close()


def test_one_byte_at_a_time():
    reader = FrameReader()
    got = []
    for i in range(len(STREAM)):
        got += reader.feed(STREAM[i : i + 1])
    assert got == EXPECTED
    reader.close()


def test_whole_stream_in_one_chunk():
    assert FrameReader().feed(STREAM) == EXPECTED


@settings(max_examples=60, deadline=None)
@given(st.lists(st.integers(0, len(STREAM)), max_size=30))
def test_random_chunking_reassembles_every_frame(cuts):
    reader = FrameReader()
    assert feed_in_chunks(reader, STREAM, cuts) == EXPECTED
    assert reader.pending == 0


def test_accepts_any_bytes_like_chunk():
    frame = FRAMES[0]
    for chunk in (bytearray(frame), memoryview(frame), np.frombuffer(frame, np.uint8)):
        assert FrameReader().feed(chunk) == [EXPECTED[0]]
    with pytest.raises(TypeError):
        FrameReader().feed("not bytes")


def test_pending_and_close_report_an_unfinished_frame():
    frame = FRAMES[0]
    reader = FrameReader()
    reader.feed(frame[:2])
    assert reader.pending == 2
    with pytest.raises(ProtocolError, match=r"length prefix 2 of 4 bytes"):
        reader.close()

    reader = FrameReader()
    reader.feed(frame[:-3])
    assert reader.pending == len(frame) - 3
    with pytest.raises(ProtocolError, match=rf"payload {len(frame) - 7} of {len(frame) - 4} bytes"):
        reader.close()


def test_max_frame_is_configurable_and_checked_on_the_prefix():
    big = ddpwire.encode_frame(ddpwire.GradientPayload(0, 0, np.zeros(100, np.float32), 0.0, 0, 0))
    payload_len = len(big) - 4
    assert FrameReader(max_frame=payload_len).feed(big)[0].gradients.shape == (100,)
    reader = FrameReader(max_frame=payload_len - 1)
    assert reader.max_frame == payload_len - 1
    with pytest.raises(FrameTooLarge) as info:
        reader.feed(big[:4])
    assert (info.value.length, info.value.limit) == (payload_len, payload_len - 1)
    with pytest.raises(ValueError):
        FrameReader(max_frame=0)
    assert FrameReader().max_frame == ddpwire.DEFAULT_MAX_FRAME == 100_000_000


def test_an_error_stops_the_reader():
    reader = FrameReader()
    with pytest.raises(ProtocolError, match="unknown message tag: 0x0c"):
        reader.feed(b"\x00\x00\x00\x01\x0c" + FRAMES[0])
    with pytest.raises(ProtocolError, match="unusable after an earlier error"):
        reader.feed(FRAMES[0])


def test_empty_frame_is_refused():
    with pytest.raises(ProtocolError, match="empty payload"):
        FrameReader().feed(b"\x00\x00\x00\x00")


def test_decoded_gradients_survive_later_feeds():
    """Each frame gets its own buffer: a view from one frame is not
    overwritten by the next."""
    reader = FrameReader()
    a = ddpwire.GradientPayload(1, 0, np.arange(1000, dtype=np.float32), 0.5, 1, 2)
    b = ddpwire.GradientPayload(2, 0, np.full(1000, -1.0, dtype=np.float32), 0.5, 1, 2)
    (first,) = reader.feed(ddpwire.encode_frame(a))
    (second,) = reader.feed(ddpwire.encode_frame(b))
    assert first == a and second == b
    assert not np.shares_memory(first.gradients, second.gradients)
    # views into the reader's own buffer are writable (averaging in place)
    assert first.gradients.flags.writeable


def test_large_frame_in_many_chunks():
    grads = np.random.default_rng(0).standard_normal(300_000).astype(np.float32)
    msg = ddpwire.AveragedGradient(9, grads, 1.25)
    frame = ddpwire.encode_frame(msg)
    reader = FrameReader()
    got = []
    for start in range(0, len(frame), 65_521):  # a prime, so chunks straddle every field
        got += reader.feed(memoryview(frame)[start : start + 65_521])
    assert got == [msg]
