"""Round trips of random messages, zero-copy decoding and encoding, and the
encoder's checks of what it is given."""
from __future__ import annotations

import array
import dataclasses

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ddpwire
from ddpwire import (
    AveragedBlockGradient,
    AveragedGradient,
    AveragedNonBlockGradient,
    BlockGradientPayload,
    FrameReader,
    GradientPayload,
    Heartbeat,
    JoinAccepted,
    JoinRequest,
    NonBlockGradientPayload,
    ProtocolError,
    ShardAssignment,
    Shutdown,
)
from wire_cases import f32_bits_from_f64, f64_from_f32_bits

U8 = st.integers(0, 2**8 - 1)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
TEXT = st.text(max_size=40)  # any code point except lone surrogates (not UTF-8)
F32_BITS = st.integers(0, 2**32 - 1)
F32 = F32_BITS.map(f64_from_f32_bits)  # every binary32 value, NaN payloads included
GRADIENTS = st.lists(F32_BITS, max_size=64).map(
    lambda bits: np.array(bits, dtype=np.uint32).view(np.float32)
)
SIZES = st.lists(U32, max_size=12)

MESSAGES = st.one_of(
    st.builds(JoinRequest, TEXT, U32, TEXT),
    st.builds(JoinAccepted, U32, U32),
    st.builds(ShardAssignment, U64, U64, U64),
    st.builds(GradientPayload, U64, U32, GRADIENTS, F32, U64, U64),
    st.builds(AveragedGradient, U64, GRADIENTS, F32),
    st.builds(Heartbeat, TEXT, U64),
    st.just(Shutdown()),
    st.builds(BlockGradientPayload, U64, U32, U32, U32, SIZES, GRADIENTS),
    st.builds(AveragedBlockGradient, U64, U32, SIZES, GRADIENTS),
    st.builds(NonBlockGradientPayload, U64, U32, U8, GRADIENTS),
    st.builds(AveragedNonBlockGradient, U64, U8, GRADIENTS),
)


def assert_bit_identical(a, b):
    """Field-by-field bit comparison, independent of Message.__eq__."""
    assert type(a) is type(b)
    for field in type(a).__slots__:
        x, y = getattr(a, field), getattr(b, field)
        if field == "gradients":
            np.testing.assert_array_equal(np.asarray(x).view(np.uint32), np.asarray(y).view(np.uint32))
        elif field == "component_sizes":
            assert list(np.asarray(x)) == list(np.asarray(y))
        elif field in ("loss", "global_loss"):
            assert f32_bits_from_f64(x) == f32_bits_from_f64(y)
        else:
            assert x == y and type(x) is type(y)


@settings(max_examples=300, deadline=None)
@given(MESSAGES)
def test_random_message_round_trips(msg):
    frame = ddpwire.encode_frame(msg)
    assert int.from_bytes(frame[:4], "big") == len(frame) - 4
    assert frame[4] == type(msg).TAG
    decoded = ddpwire.decode_frame(frame)
    assert_bit_identical(decoded, msg)
    assert decoded == msg
    assert ddpwire.decode_payload(frame[4:]) == msg
    assert ddpwire.encode_frame(decoded) == frame
    head, gradients, tail = ddpwire.encode_frame_parts(msg)
    assert head + (gradients.tobytes() if gradients is not None else b"") + tail == frame


@settings(max_examples=100, deadline=None)
@given(st.lists(MESSAGES, min_size=1, max_size=8), st.data())
def test_random_streams_reassemble(msgs, data):
    stream = b"".join(ddpwire.encode_frame(m) for m in msgs)
    cuts = sorted(data.draw(st.lists(st.integers(0, len(stream)), max_size=10)))
    reader = FrameReader()
    got, start = [], 0
    for cut in cuts + [len(stream)]:
        got += reader.feed(stream[start:cut])
        start = cut
    assert got == msgs


@settings(max_examples=200, deadline=None)
@given(MESSAGES, st.data())
def test_every_strict_prefix_of_a_payload_is_refused(msg, data):
    payload = ddpwire.encode_frame(msg)[4:]
    cut = data.draw(st.integers(0, len(payload) - 1))
    with pytest.raises(ProtocolError):
        ddpwire.decode_payload(payload[:cut])


# -- float bits ---------------------------------------------------------------

@pytest.mark.parametrize("bits", [0x7F800001, 0xFF800001, 0x7FBFFFFF, 0x7FC00001, 0xFFFFFFFF,
                                  0x80000000, 0x00000001, 0x7F800000])
def test_loss_keeps_every_bit_including_signalling_nan(bits):
    msg = GradientPayload(1, 2, np.zeros(0, np.float32), f64_from_f32_bits(bits), 3, 4)
    frame = ddpwire.encode_frame(msg)
    assert int.from_bytes(frame[-20:-16], "little") == bits
    assert f32_bits_from_f64(ddpwire.decode_frame(frame).loss) == bits


def test_loss_is_rounded_to_float32():
    frame = ddpwire.encode_frame(AveragedGradient(0, np.zeros(0, np.float32), 0.1))
    assert int.from_bytes(frame[-4:], "little") == 0x3DCCCCCD
    assert ddpwire.decode_frame(frame).global_loss == float(np.float32(0.1))
    for value, bits in ((1e39, 0x7F800000), (-1e39, 0xFF800000), (3.4028235e38, 0x7F7FFFFF)):
        frame = ddpwire.encode_frame(AveragedGradient(0, np.zeros(0, np.float32), value))
        assert int.from_bytes(frame[-4:], "little") == bits


def test_equality_is_bit_exact():
    nan_a = np.array([0x7FC00001], np.uint32).view(np.float32)
    nan_b = np.array([0x7FC00002], np.uint32).view(np.float32)
    base = AveragedGradient(1, nan_a, float("nan"))
    assert base == AveragedGradient(1, nan_a.copy(), float("nan"))
    assert base != AveragedGradient(1, nan_b, float("nan"))
    zero = AveragedGradient(1, np.zeros(1, np.float32), 0.0)
    assert zero != AveragedGradient(1, -np.zeros(1, np.float32), 0.0)
    assert zero != AveragedGradient(1, np.zeros(1, np.float32), -0.0)
    assert zero != AveragedGradient(1, np.zeros(2, np.float32), 0.0)
    assert zero != AveragedGradient(2, np.zeros(1, np.float32), 0.0)
    assert zero != ShardAssignment(1, 2, 3)
    with pytest.raises(TypeError):
        hash(zero)


# -- zero copy ------------------------------------------------------------------

def test_decoded_gradients_are_views_into_the_buffer():
    grads = np.arange(1000, dtype=np.float32)
    buffer = bytearray(ddpwire.encode_frame(GradientPayload(5, 1, grads, 0.5, 8, 10)))
    msg = ddpwire.decode_frame(buffer)
    as_array = np.frombuffer(buffer, np.uint8)
    assert np.shares_memory(msg.gradients, as_array)
    # the gradient bytes start after prefix, tag, step, worker_id and count
    offset = 4 + 1 + 8 + 4 + 8
    buffer[offset : offset + 4] = np.float32(-7.5).tobytes()
    assert msg.gradients[0] == np.float32(-7.5)
    msg.gradients[1] = 42.0  # writable, since the buffer is
    assert np.frombuffer(buffer, np.float32, count=1, offset=offset + 4)[0] == 42.0


def test_decoded_component_sizes_are_uint32_views():
    msg = AveragedBlockGradient(3, 4, [1, 2, 3], np.ones(6, np.float32))
    payload = bytearray(ddpwire.encode_frame(msg)[4:])
    decoded = ddpwire.decode_payload(payload)
    assert decoded.component_sizes.dtype == np.uint32
    assert decoded.component_sizes.tolist() == [1, 2, 3]
    assert np.shares_memory(decoded.component_sizes, np.frombuffer(payload, np.uint8))


def test_decode_from_a_memoryview_slice_points_into_the_parent():
    msg = NonBlockGradientPayload(1, 2, 0, np.ones(64, np.float32))
    frame = ddpwire.encode_frame(msg)
    parent = bytearray(b"xx" + frame + b"yy")
    decoded = ddpwire.decode_frame(memoryview(parent)[2:-2])
    assert decoded == msg
    assert np.shares_memory(decoded.gradients, np.frombuffer(parent, np.uint8))


def test_decode_of_64_mib_does_not_copy():
    grads = np.ones(16 * 1024 * 1024, np.float32)
    frame = ddpwire.encode_frame(AveragedGradient(1, grads, 0.0), max_frame=2**32 - 1)
    msg = ddpwire.decode_frame(frame, max_frame=2**32 - 1)
    assert msg.gradients.base is not None
    assert np.shares_memory(msg.gradients, np.frombuffer(frame, np.uint8))
    assert not msg.gradients.flags.writeable  # a view of immutable bytes


def test_frame_parts_gradients_share_the_callers_memory():
    grads = np.linspace(-1, 1, 4096, dtype=np.float32)
    msg = GradientPayload(7, 3, grads, 1.5, 100, 128)
    head, view, tail = ddpwire.encode_frame_parts(msg)
    assert np.shares_memory(np.frombuffer(view, np.float32), grads)
    assert view.format == "B" and view.nbytes == grads.nbytes
    assert len(head) == 4 + 1 + 8 + 4 + 8 and len(tail) == 20
    assert head + view.tobytes() + tail == ddpwire.encode_frame(msg)
    grads[0] = 99.0  # no copy was taken
    assert np.frombuffer(view, np.float32)[0] == 99.0


@pytest.mark.parametrize(
    "msg",
    [
        BlockGradientPayload(1, 2, 3, 4, [2, 2], np.ones(4, np.float32)),
        AveragedBlockGradient(1, 3, (4,), np.ones(4, np.float32)),
        NonBlockGradientPayload(1, 2, 1, np.ones(3, np.float32)),
        AveragedNonBlockGradient(1, 2, np.ones(3, np.float32)),
        AveragedGradient(1, np.ones(3, np.float32), 0.25),
    ],
    ids=lambda m: type(m).__name__,
)
def test_frame_parts_of_every_gradient_message(msg):
    head, view, tail = ddpwire.encode_frame_parts(msg)
    assert head + view.tobytes() + tail == ddpwire.encode_frame(msg)
    assert np.shares_memory(np.frombuffer(view, np.float32), msg.gradients)


def test_frame_parts_of_a_message_without_gradients():
    msg = Heartbeat("node", 12)
    assert ddpwire.encode_frame_parts(msg) == (ddpwire.encode_frame(msg), None, b"")


# -- what the encoder accepts -------------------------------------------------

def test_encoder_accepts_any_contiguous_float32_buffer():
    torch = pytest.importorskip("torch")
    values = [1.0, -2.0, 0.5]
    want = ddpwire.encode_frame(AveragedNonBlockGradient(1, 0, np.array(values, np.float32)))
    sources = [
        array.array("f", values),
        memoryview(array.array("f", values)),
        memoryview(np.array(values, np.float32).tobytes()).cast("f"),
        torch.tensor(values, dtype=torch.float32).numpy(),
        np.array([values], np.float32),  # 2-D: sent as its flat elements
        np.array(values, "<f4"),
    ]
    for source in sources:
        assert ddpwire.encode_frame(AveragedNonBlockGradient(1, 0, source)) == want


@pytest.mark.parametrize(
    "bad, described",
    [
        (np.zeros(3, np.float64), "dtype float64"),
        (np.zeros(6, np.float32)[::2], "not C-contiguous"),
        (np.zeros((3, 3), np.float32).T, "not C-contiguous"),
        (array.array("d", [1.0]), "format 'd'"),
        (b"\0\0\0\0", "format 'B'"),
        ([1.0, 2.0], "list"),
        (np.zeros(3, ">f4"), "dtype >f4"),
    ],
)
def test_encoder_refuses_other_buffers_naming_the_field(bad, described):
    msg = GradientPayload(1, 2, bad, 0.0, 0, 0)
    with pytest.raises(TypeError) as info:
        ddpwire.encode_frame(msg)
    text = str(info.value)
    assert "GradientPayload.gradients" in text
    assert "C-contiguous float32" in text
    assert described in text
    with pytest.raises(TypeError, match="GradientPayload.gradients"):
        ddpwire.encode_frame_parts(msg)


@pytest.mark.parametrize(
    "msg, error, pattern",
    [
        (JoinAccepted(-1, 1), ValueError, r"JoinAccepted\.worker_id must be in 0\.\.4294967295, got -1"),
        (JoinAccepted(2**32, 1), ValueError, r"JoinAccepted\.worker_id"),
        (ShardAssignment(2**64, 0, 0), ValueError, r"ShardAssignment\.step"),
        (ShardAssignment(1.0, 0, 0), TypeError, r"ShardAssignment\.step: expected an int, got float"),
        (NonBlockGradientPayload(0, 0, 256, np.zeros(0, np.float32)), ValueError,
         r"NonBlockGradientPayload\.component must be in 0\.\.255"),
        (JoinRequest(b"bytes", 1, "cpu"), TypeError, r"JoinRequest\.node_id: expected a str"),
        (Heartbeat("\ud800", 1), ValueError, r"Heartbeat\.node_id: not encodable as UTF-8"),
        (GradientPayload(0, 0, np.zeros(0, np.float32), "x", 0, 0), TypeError,
         r"GradientPayload\.loss: expected a float"),
        (AveragedBlockGradient(0, 0, [1, -1], np.zeros(0, np.float32)), ValueError,
         r"AveragedBlockGradient\.component_sizes\[1\] must be in 0\.\.4294967295"),
        (AveragedBlockGradient(0, 0, [2**32], np.zeros(0, np.float32)), ValueError,
         r"AveragedBlockGradient\.component_sizes\[0\]"),
        (AveragedBlockGradient(0, 0, np.array([1.5]), np.zeros(0, np.float32)), TypeError,
         r"AveragedBlockGradient\.component_sizes: expected integers"),
        (AveragedBlockGradient(0, 0, np.array([-1]), np.zeros(0, np.float32)), ValueError,
         r"AveragedBlockGradient\.component_sizes"),
        (AveragedBlockGradient(0, 0, 7, np.zeros(0, np.float32)), TypeError,
         r"AveragedBlockGradient\.component_sizes: expected a sequence of ints"),
    ],
)
def test_encoder_checks_values(msg, error, pattern):
    with pytest.raises(error, match=pattern):
        ddpwire.encode_frame(msg)


def test_component_sizes_accept_any_integer_sequence():
    grads = np.zeros(0, np.float32)
    want = ddpwire.encode_frame(AveragedBlockGradient(1, 2, [3, 4, 2**32 - 1], grads))
    for sizes in ((3, 4, 2**32 - 1), np.array([3, 4, 2**32 - 1], np.int64),
                  np.array([3, 4, 2**32 - 1], np.uint32), [np.int8(3), True + 3, 2**32 - 1]):
        assert ddpwire.encode_frame(AveragedBlockGradient(1, 2, sizes, grads)) == want


def test_encoder_refuses_non_messages_and_accepts_subclasses():
    with pytest.raises(TypeError, match="expected a ddpwire message, got dict"):
        ddpwire.encode_frame({"tag": 7})

    @dataclasses.dataclass(eq=False)
    class MyHeartbeat(Heartbeat):
        __slots__ = ()

    assert ddpwire.encode_frame(MyHeartbeat("n", 1)) == ddpwire.encode_frame(Heartbeat("n", 1))


def test_encoder_limit_is_configurable():
    msg = AveragedGradient(0, np.zeros(10, np.float32), 0.0)
    size = len(ddpwire.encode_frame(msg)) - 4
    assert len(ddpwire.encode_frame(msg, max_frame=size)) == size + 4
    with pytest.raises(ddpwire.FrameTooLarge, match=rf"frame too large: {size} bytes \(limit {size - 1}\)"):
        ddpwire.encode_frame(msg, max_frame=size - 1)
    with pytest.raises(ddpwire.FrameTooLarge):
        ddpwire.encode_frame_parts(msg, max_frame=size - 1)


def test_decode_refuses_non_buffers_and_wrong_frame_sizes():
    with pytest.raises(TypeError, match="bytes-like"):
        ddpwire.decode_payload("07")
    frame = ddpwire.encode_frame(Shutdown())
    with pytest.raises(ProtocolError, match="1 bytes after the frame"):
        ddpwire.decode_frame(frame + b"\0")
    with pytest.raises(ProtocolError, match="truncated frame: payload 0 of 1 bytes"):
        ddpwire.decode_frame(frame[:4])
    with pytest.raises(ProtocolError, match="length prefix 3 of 4 bytes"):
        ddpwire.decode_frame(frame[:3])
