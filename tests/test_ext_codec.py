"""Extension block and extension messages: random round trips, zero copy,
the encoder's checks, the codes, per-tag limits and FrameReader's
allowed_tags."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import ddpwire
from ddpwire import (
    AuthChallenge,
    AuthProof,
    CollectiveError,
    MeshPeers,
    PeerHello,
    ShardScale,
    StepAborted,
    StateRequest,
    ModelState,
    StepCommit,
    StepReport,
    StepTiming,
    CollectiveKind,
    CollectiveRequest,
    CollectiveResult,
    DType,
    Extension,
    FrameReader,
    FrameTooLarge,
    JoinAccepted,
    JoinRefused,
    JoinRequest,
    ProtocolError,
    RefusalReason,
    ReduceOp,
    tag_max_payload,
)
from ddpwire._core import _codes

U8 = st.integers(0, 2**8 - 1)
U32 = st.integers(0, 2**32 - 1)
U64 = st.integers(0, 2**64 - 1)
TEXT = st.text(max_size=40)
B32 = st.binary(min_size=32, max_size=32)
# every float32 bit pattern, NaN payloads included: the codec moves bits
F32 = st.integers(0, 2**32 - 1).map(lambda b: float(np.array([b], np.uint32).view(np.float32)[0]))
# every float32 bit pattern ShardScale.scale may hold: +0.0 up to the largest
# finite value, and -0.0
SCALE = st.one_of(st.integers(0, 0x7F7FFFFF), st.just(0x80000000)).map(
    lambda b: float(np.array([b], np.uint32).view(np.float32)[0]))
# at most 64 unique types, block under 4096 bytes: 64 * (6 + 40) + 7 < 4096
EXTENSIONS = st.one_of(st.none(), st.dictionaries(st.integers(0, 0xFFFF),
                                                  st.binary(max_size=40), max_size=64))
DTYPES = st.sampled_from(list(DType))


@st.composite
def collective_data(draw):
    dtype = draw(DTYPES)
    raw = draw(st.binary(max_size=64))
    count = len(raw) // dtype.itemsize
    return dtype, count, np.frombuffer(raw[: count * dtype.itemsize], np.uint8)


@st.composite
def collective_request(draw):
    dtype, count, data = draw(collective_data())
    return CollectiveRequest(draw(U64), draw(U8), draw(U8), int(dtype), draw(U32), count, data)


@st.composite
def collective_result(draw):
    dtype, count, data = draw(collective_data())
    return CollectiveResult(draw(U64), draw(U8), int(dtype), count, data)


MESSAGES = st.one_of(
    st.builds(JoinRequest, TEXT, U32, TEXT, EXTENSIONS),
    st.builds(JoinAccepted, U32, U32, EXTENSIONS),
    st.builds(AuthChallenge, B32, B32),
    st.builds(AuthProof, B32),
    st.builds(JoinRefused, U8, TEXT),
    collective_request(),
    collective_result(),
    st.builds(CollectiveError, U64, U32, TEXT),
    st.builds(MeshPeers, key=B32, codec=st.integers(0, 2), shared_memory=st.integers(0, 1),
              peers=TEXT, coordinator_share=st.integers(0, 0xFFFF)),
    st.builds(PeerHello, U32, B32),
    st.builds(StepReport, U64, U32, U64, F32, U64, U64, U32, U64, F32),
    st.builds(StepCommit, U64, F32, U32, U64, F32),
    st.builds(StepTiming, U64, U64),
    st.builds(ShardScale, U64, SCALE),
    st.builds(StepAborted, U64, U32, U32),
    st.builds(StateRequest, U64),
    st.binary(max_size=300).flatmap(lambda d: st.builds(
        ModelState, U64, st.integers(len(d), 2**64 - 1), B32, st.just(d))),
)


@settings(max_examples=300, deadline=None)
@given(MESSAGES)
def test_round_trip(msg):
    frame = ddpwire.encode_frame(msg)
    decoded = ddpwire.decode_frame(frame)
    assert decoded == msg
    assert ddpwire.encode_frame(decoded) == frame
    head, bulk, tail = ddpwire.encode_frame_parts(msg)
    assert head + (b"" if bulk is None else bulk.tobytes()) + tail == frame


@settings(max_examples=100, deadline=None)
@given(MESSAGES, st.integers(1, 7))
def test_frame_reader_any_chunking(msg, chunk):
    frame = ddpwire.encode_frame(msg)
    reader = FrameReader()
    got = []
    for i in range(0, len(frame), chunk):
        got += reader.feed(frame[i:i + chunk])
    assert got == [msg] and reader.pending == 0


@settings(max_examples=200, deadline=None)
@given(MESSAGES, st.data())
def test_every_cut_is_refused(msg, data):
    payload = ddpwire.encode_frame(msg)[4:]
    cut = data.draw(st.integers(0, len(payload) - 1))
    plain = _without_block(msg)
    if plain is not None and cut == len(ddpwire.encode_frame(plain)) - 4:
        # cut exactly where its extension block starts, a join message is the
        # reference message: valid, and without extensions
        assert ddpwire.decode_payload(payload[:cut]) == plain
        return
    with pytest.raises(ProtocolError):
        ddpwire.decode_payload(payload[:cut])


def test_a_join_message_cut_at_its_block_is_the_reference_message():
    """The one cut that is not an error (found by the property above)."""
    msg = JoinRequest("00", 0, "0" * 15, {})
    payload = ddpwire.encode_frame(msg)[4:]
    assert ddpwire.decode_payload(payload[:-7]) == JoinRequest("00", 0, "0" * 15)
    with pytest.raises(ProtocolError):
        ddpwire.decode_payload(payload[:-1])


def _without_block(msg):
    """The same join message without its extension block (None for any
    message that has no block)."""
    if isinstance(msg, JoinRequest) and msg.extensions is not None:
        return JoinRequest(msg.node_id, msg.gpu_count, msg.backend)
    if isinstance(msg, JoinAccepted) and msg.extensions is not None:
        return JoinAccepted(msg.worker_id, msg.total_workers)
    return None


def test_extensions_none_is_the_reference_bytes():
    plain = ddpwire.encode_frame(JoinRequest("w", 1, "cpu"))
    assert ddpwire.encode_frame(JoinRequest("w", 1, "cpu", None)) == plain
    with_block = ddpwire.encode_frame(JoinRequest("w", 1, "cpu", {}))
    assert len(with_block) == len(plain) + 7 and with_block[4:-7] == plain[4:]
    assert JoinRequest("w", 1, "cpu") != JoinRequest("w", 1, "cpu", {})
    assert JoinAccepted(1, 2, {1: b""}) == JoinAccepted(1, 2, {1: bytearray()})
    assert JoinAccepted.__slots__ == ("worker_id", "total_workers")
    assert JoinRequest(node_id="a", gpu_count=1, backend="b").extensions is None


def test_collective_data_is_a_zero_copy_view():
    values = np.array([1.5, -2.0, 3.25], np.float32)
    msg = CollectiveRequest(1, CollectiveKind.ALLREDUCE, ReduceOp.SUM, DType.FLOAT32, 0, 3, values)
    head, bulk, tail = ddpwire.encode_frame_parts(msg)
    assert bulk.obj is values or np.shares_memory(np.asarray(bulk.obj), values)
    frame = bytearray(ddpwire.encode_frame(msg))
    decoded = ddpwire.decode_frame(frame)
    assert decoded.data.dtype == np.uint8 and decoded.data.nbytes == 12
    np.testing.assert_array_equal(decoded.data.view(DType.FLOAT32.numpy), values)
    decoded.data[:] = 0  # a view into frame, not a copy
    assert frame[-12:] == bytes(12)


def test_collective_data_takes_any_contiguous_buffer():
    ints = np.arange(6, dtype=np.int64).reshape(2, 3)
    msg = CollectiveResult(2, CollectiveKind.ALLGATHER, DType.INT64, 6, ints)
    assert ddpwire.decode_frame(ddpwire.encode_frame(msg)).data.view("<i8").tolist() == list(range(6))
    with pytest.raises(TypeError, match=r"CollectiveResult\.data: expected a C-contiguous buffer"):
        ddpwire.encode_frame(CollectiveResult(2, 1, DType.INT64, 3, ints[:, ::2]))


@pytest.mark.parametrize("msg, pattern", [
    (CollectiveRequest(1, 1, 0, 0, 0, 3, bytes(8)),
     r"CollectiveRequest\.data length mismatch: 8 bytes, count x dtype size is 12"),
    (CollectiveResult(1, 1, 99, 1, bytes(1)), r"invalid CollectiveResult\.dtype: 99"),
    (AuthChallenge(bytes(31), bytes(32)), r"AuthChallenge\.nonce: expected 32 bytes, got 31"),
    (AuthProof(bytes(33)), r"AuthProof\.proof: expected 32 bytes, got 33"),
    (JoinRequest("w", 1, "cpu", {i: b"" for i in range(65)}),
     r"JoinRequest\.extensions: 65 entries, over the wire limit of 64"),
    (JoinAccepted(1, 2, {1: bytes(4090)}),
     r"JoinAccepted\.extensions: 4103 bytes, over the wire limit of 4096"),
    (JoinAccepted(1, 2, {70000: b""}), r"JoinAccepted\.extensions key must be in 0\.\.65535"),
    (JoinRefused(256, ""), r"JoinRefused\.reason must be in 0\.\.255"),
    (MeshPeers(bytes(32), 0, 0, "", coordinator_share=65536),
     r"MeshPeers\.coordinator_share must be in 0\.\.65535"),
    (StepTiming(0, 2**64), r"StepTiming\.compute_us must be in 0\.\.18446744073709551615"),
    (StepTiming(-1, 0), r"StepTiming\.step must be in 0\.\.18446744073709551615"),
    (ShardScale(1, float("nan")), r"^invalid ShardScale\.scale: nan \(not finite\)$"),
    (ShardScale(1, -2.0), r"^invalid ShardScale\.scale: -2\.0 \(negative\)$"),
    (ShardScale(1, 1e39), r"^invalid ShardScale\.scale: inf \(not finite\)$"),  # inf in float32
])
def test_encoder_refuses_what_the_decoder_would(msg, pattern):
    with pytest.raises(ValueError, match=pattern):
        ddpwire.encode_frame(msg)


@pytest.mark.parametrize("bits, why", [
    (0x7FC00000, "not finite"),  # quiet NaN
    (0x7F800001, "not finite"),  # signalling NaN
    (0xFFC00000, "not finite"),  # negative NaN
    (0x7F800000, "not finite"),  # +inf
    (0xFF800000, "not finite"),  # -inf
    (0xBF800000, "negative"),    # -1.0
    (0x80000001, "negative"),    # the smallest negative subnormal
])
def test_shard_scale_refuses_a_scale_that_is_not_finite_or_is_negative(bits, why):
    scale = float(np.array([bits], np.uint32).view(np.float32)[0])
    pattern = r"^invalid ShardScale\.scale: .+ \(%s\)$" % why
    payload = bytes([ShardScale.TAG]) + (3).to_bytes(8, "little") + bits.to_bytes(4, "little")
    with pytest.raises(ProtocolError, match=pattern):
        ddpwire.decode_payload(payload)
    with pytest.raises(ProtocolError, match=pattern):
        ddpwire.decode_payload(payload, allow_trailing=True)
    with pytest.raises(ProtocolError, match=pattern):
        FrameReader(allowed_tags={ShardScale.TAG}).feed(len(payload).to_bytes(4, "big") + payload)
    with pytest.raises(ProtocolError, match=pattern):  # the encoder refuses it too
        ddpwire.encode_frame(ShardScale(3, scale))


@pytest.mark.parametrize("scale", [0.0, -0.0, 1.0, 0.25, 2.0**-149, 3.4028234663852886e38])
def test_shard_scale_takes_zero_and_every_finite_positive_scale(scale):
    frame = ddpwire.encode_frame(ShardScale(4, scale))
    assert frame[4:] == bytes([0x4B]) + (4).to_bytes(8, "little") + np.float32(scale).tobytes()
    assert ddpwire.decode_frame(frame) == ShardScale(4, scale)


def test_encoder_type_errors_name_the_field():
    with pytest.raises(TypeError, match=r"JoinRequest\.extensions: expected None or a dict"):
        ddpwire.encode_frame(JoinRequest("w", 1, "cpu", [(1, b"")]))
    with pytest.raises(TypeError, match=r"JoinRequest\.extensions\[1\]"):
        ddpwire.encode_frame(JoinRequest("w", 1, "cpu", {1: "text"}))


def test_codes_come_from_the_codec():
    families, sizes = _codes()
    assert {name for name, _ in families["Extension"]} == {"auth", "samples", "collectives", "mesh",
                                                           "per_block", "gradient_length", "steps",
                                                           "balance", "elastic", "seal"}
    assert [(m.name.lower(), int(m)) for m in Extension] == families["Extension"]
    for enum, family in ((RefusalReason, "RefusalReason"), (CollectiveKind, "CollectiveKind"),
                         (ReduceOp, "ReduceOp"), (DType, "DType")):
        assert [(m.name.lower(), int(m)) for m in enum] == families[family]
    assert Extension.AUTH == 1 and RefusalReason.FULL == 1 and ReduceOp.SUM == 0
    assert CollectiveKind.ALLREDUCE == 1 and DType.FLOAT32 == 0
    for dtype in DType:
        assert dtype.itemsize == sizes[int(dtype)] == dtype.numpy.itemsize


def test_tag_max_payload():
    limits = {0x03: 25, 0x07: 1, 0x40: 65, 0x41: 33, 0x47: 37, 0x48: 57, 0x49: 29, 0x4A: 17,
              0x4B: 13, 0x4C: 17, 0x4D: 9}
    for tag in range(256):
        got = tag_max_payload(tag, 1000)
        cls = ddpwire.wire.messages.MESSAGE_TYPES.get(tag)
        if cls is None:
            assert got == 0, tag
        elif tag in limits:
            assert got == limits[tag]
        elif tag in (0x01, 0x02, 0x06, 0x42, 0x45, 0x46):  # small variable ones
            assert got == 65536
        else:
            assert got == 1000, cls.__name__  # gradient, collective messages, ModelState
    # a fixed size is exact: the encoder produces exactly that many bytes
    assert len(ddpwire.encode_frame(AuthChallenge(bytes(32), bytes(32)))) - 4 == 65
    assert len(ddpwire.encode_frame(AuthProof(bytes(32)))) - 4 == 33
    assert len(ddpwire.encode_frame(PeerHello(0, bytes(32)))) - 4 == 37
    assert len(ddpwire.encode_frame(StepReport(0, 0, 0, 0.0, 0, 0, 0, 0, 0.0))) - 4 == 57
    assert len(ddpwire.encode_frame(StepCommit(0, 0.0, 0, 0, 0.0))) - 4 == 29
    assert len(ddpwire.encode_frame(StepTiming(0, 0))) - 4 == 17
    assert len(ddpwire.encode_frame(ShardScale(0, 0.0))) - 4 == 13
    assert len(ddpwire.encode_frame(StepAborted(0, 0, 0))) - 4 == 17


def test_allowed_tags_refuse_an_oversized_join_before_allocating():
    reader = FrameReader(allowed_tags={JoinRequest.TAG, AuthProof.TAG})
    prefix = (99_999_999).to_bytes(4, "big") + bytes([JoinRequest.TAG])
    tracemalloc.start()
    try:
        with pytest.raises(FrameTooLarge, match=r"99999999 bytes \(limit 65536 for JoinRequest\)"):
            reader.feed(prefix[:4])
            assert reader.pending == 4  # nothing allocated yet
            reader.feed(prefix[4:])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000
    with pytest.raises(ProtocolError, match="unusable"):
        reader.feed(b"\x00")


def test_allowed_tags_refuse_other_tags():
    reader = FrameReader(allowed_tags=[0x01, 0x41])
    frame = ddpwire.encode_frame(ddpwire.Heartbeat("w", 5))
    with pytest.raises(ProtocolError, match=r"^Heartbeat \(tag 0x06\) not allowed here$"):
        reader.feed(frame)
    with pytest.raises(ProtocolError, match=r"^unknown message tag: 0x4f$"):
        FrameReader(allowed_tags=[0x01]).feed(b"\x00\x00\x00\x01\x4f")
    # the balance messages are refused where they are not allowed, like any other
    with pytest.raises(ProtocolError, match=r"^ShardScale \(tag 0x4b\) not allowed here$"):
        FrameReader(allowed_tags=[0x01]).feed(ddpwire.encode_frame(ShardScale(0, 1.0)))
    with pytest.raises(FrameTooLarge, match=r"18 bytes \(limit 17 for StepTiming\)"):
        FrameReader(allowed_tags=[0x4A]).feed((18).to_bytes(4, "big") + b"\x4a")
    # a frame over a fixed size is refused too
    with pytest.raises(FrameTooLarge, match=r"34 bytes \(limit 33 for AuthProof\)"):
        FrameReader(allowed_tags=[0x41]).feed((34).to_bytes(4, "big") + b"\x41")


def test_allowed_tags_pass_allowed_frames_byte_by_byte():
    msgs = [JoinRequest("w", 1, "cpu", {Extension.AUTH: bytes(32)}), AuthProof(bytes(range(32))),
            ddpwire.Shutdown()]
    stream = b"".join(ddpwire.encode_frame(m) for m in msgs)
    reader = FrameReader(allowed_tags={m.TAG for m in msgs})
    got = []
    for i in range(len(stream)):
        got += reader.feed(stream[i:i + 1])
    assert got == msgs and reader.pending == 0
    assert reader.allowed_tags == frozenset({0x01, 0x41, 0x07})
    reader.close()
    # the prefix limit still applies first
    with pytest.raises(FrameTooLarge, match=r"frame too large: 11 bytes \(limit 10\)$"):
        FrameReader(10, allowed_tags={1}).feed((11).to_bytes(4, "big"))
