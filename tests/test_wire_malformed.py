"""Every input the reference refuses (or crashes on) is a ProtocolError here,
never a crash, a hang or a huge allocation."""
from __future__ import annotations

import tracemalloc

import numpy as np
import pytest

import ddpwire
from ddpwire import FrameTooLarge, ProtocolError
from wire_cases import MALFORMED, expected_message

PAYLOAD_CASES = [c for c in MALFORMED if c["layer"] == "payload"]
FRAME_CASES = [c for c in MALFORMED if c["layer"] == "frame"]
SMALL_FRAME_CASES = [c for c in FRAME_CASES if not c.get("input_hex_is_prefix")]
REFUSED = ("error", "panic")


def ids(cases):
    return [c["name"] for c in cases]


def input_of(case) -> bytes:
    data = bytes.fromhex(case["input_hex"])
    assert len(data) == case["input_len"]
    return data


def test_the_data_has_what_the_tests_rely_on():
    outcomes = {c["result"]["outcome"] for c in MALFORMED}
    assert outcomes == {"ok", "error", "panic"}
    assert len([c for c in PAYLOAD_CASES if c["name"].startswith("trailing_bytes_")]) == 11
    assert any(c.get("input_hex_is_prefix") for c in FRAME_CASES)


# -- payload layer ----------------------------------------------------------

@pytest.mark.parametrize(
    "case", [c for c in PAYLOAD_CASES if c["result"]["outcome"] in REFUSED],
    ids=ids([c for c in PAYLOAD_CASES if c["result"]["outcome"] in REFUSED]),
)
def test_refused_payload_is_a_protocol_error(case):
    with pytest.raises(ProtocolError):
        ddpwire.decode_payload(input_of(case))
    # accepting trailing bytes must not make any of these acceptable
    with pytest.raises(ProtocolError):
        ddpwire.decode_payload(input_of(case), allow_trailing=True)


@pytest.mark.parametrize(
    "case", [c for c in PAYLOAD_CASES if c["result"]["outcome"] == "panic"],
    ids=ids([c for c in PAYLOAD_CASES if c["result"]["outcome"] == "panic"]),
)
def test_reference_crashes_are_errors_naming_the_gradients(case):
    """The reference panics on element counts near 2^62; here they are errors
    naming the message and the field."""
    with pytest.raises(ProtocolError) as info:
        ddpwire.decode_payload(input_of(case))
    message = str(info.value)
    type_name = case["description"].split()[0]
    assert f"{type_name}.gradients" in message


def test_count_of_two_to_the_62_is_an_overflow_error():
    case = next(c for c in PAYLOAD_CASES if c["name"] == "grad_len_overflow_GradientPayload_2pow62")
    with pytest.raises(ProtocolError, match=r"count overflow in GradientPayload\.gradients: "
                                            r"4611686018427387904 elements"):
        ddpwire.decode_payload(input_of(case))


def test_count_just_below_overflow_is_a_truncation():
    case = next(c for c in PAYLOAD_CASES if c["name"] == "grad_len_overflow_GradientPayload_0x3fff")
    with pytest.raises(ProtocolError,
                       match=r"truncated GradientPayload\.gradients: 20 of 18446744073709551612"):
        ddpwire.decode_payload(input_of(case))


@pytest.mark.parametrize(
    "name, pattern",
    [
        ("empty_payload", r"^empty payload$"),
        ("unknown_tag_0x0c_with_body", r"^unknown message tag: 0x0c$"),
        ("unknown_tag_0xff", r"^unknown message tag: 0xff$"),
        ("grad_len_exceeds_data_GradientPayload",
         r"^truncated GradientPayload\.gradients: 28 of 4000 bytes$"),
        ("string_len_u32_max", r"^truncated Heartbeat\.node_id: 8 of 4294967295 bytes$"),
        ("truncated_last_byte_JoinRequest_empty_backend",
         r"^truncated JoinRequest\.backend length: 3 of 4 bytes$"),
        ("truncated_last_byte_GradientPayload", r"^truncated GradientPayload\.total: 7 of 8 bytes$"),
        ("tag_only_BlockGradientPayload", r"^truncated BlockGradientPayload\.step: 0 of 8 bytes$"),
        ("component_count_exceeds_data_AveragedBlockGradient",
         r"^truncated AveragedBlockGradient\.component_sizes: 8 of 17179869180 bytes$"),
        ("invalid_utf8_join_node_id_truncated_seq",
         r"^invalid UTF-8 in JoinRequest\.node_id at byte 1 of 3$"),
        ("invalid_utf8_join_backend_overlong", r"^invalid UTF-8 in JoinRequest\.backend at byte 0"),
        ("invalid_utf8_join_node_id_surrogate", r"^invalid UTF-8 in JoinRequest\.node_id at byte 0"),
    ],
)
def test_error_text_names_the_message_the_field_and_the_sizes(name, pattern):
    case = next(c for c in MALFORMED if c["name"] == name)
    with pytest.raises(ProtocolError, match=pattern):
        ddpwire.decode_payload(input_of(case))


def test_truncated_tail_names_its_field():
    frame = ddpwire.encode_frame(ddpwire.AveragedGradient(1, np.zeros(2, np.float32), 0.5))
    with pytest.raises(ProtocolError, match=r"^truncated AveragedGradient\.global_loss: 2 of 4 bytes$"):
        ddpwire.decode_payload(frame[4:-2])


# -- trailing bytes: rejected by default, accepted on request ---------------

TRAILING = [c for c in PAYLOAD_CASES if c["name"].startswith("trailing_bytes_")]


@pytest.mark.parametrize("case", TRAILING, ids=ids(TRAILING))
def test_trailing_bytes_rejected_by_default(case):
    assert case["result"]["outcome"] == "ok"  # the reference ignores them
    type_name = case["result"]["decoded"]["type"]
    with pytest.raises(ProtocolError, match=rf"^2 bytes after the last field of {type_name}$"):
        ddpwire.decode_payload(input_of(case))


@pytest.mark.parametrize("case", TRAILING, ids=ids(TRAILING))
def test_trailing_bytes_accepted_like_the_reference(case):
    got = ddpwire.decode_payload(input_of(case), allow_trailing=True)
    assert got == expected_message(case["result"]["decoded"])


@pytest.mark.parametrize("case", TRAILING, ids=ids(TRAILING))
def test_trailing_bytes_through_frames_and_reader(case):
    payload = input_of(case)
    frame = len(payload).to_bytes(4, "big") + payload
    want = expected_message(case["result"]["decoded"])
    with pytest.raises(ProtocolError, match="after the last field"):
        ddpwire.decode_frame(frame)
    assert ddpwire.decode_frame(frame, allow_trailing=True) == want
    with pytest.raises(ProtocolError, match="after the last field"):
        ddpwire.FrameReader().feed(frame)
    assert ddpwire.FrameReader(allow_trailing=True).feed(frame) == [want]


# -- frame layer --------------------------------------------------------------

@pytest.mark.parametrize("case", SMALL_FRAME_CASES, ids=ids(SMALL_FRAME_CASES))
def test_frame_case_through_decode_frame(case):
    data = input_of(case)
    if case["result"]["outcome"] == "ok":
        assert ddpwire.decode_frame(data) == expected_message(case["result"]["decoded"])
    else:
        with pytest.raises(ProtocolError):
            ddpwire.decode_frame(data)


@pytest.mark.parametrize("case", SMALL_FRAME_CASES, ids=ids(SMALL_FRAME_CASES))
def test_frame_case_through_frame_reader(case):
    """The reference reads one frame then sees EOF. A FrameReader either
    refuses the bytes, or is left holding an incomplete frame, which
    ``pending`` shows and ``close()`` refuses."""
    data = input_of(case)
    reader = ddpwire.FrameReader()
    if case["result"]["outcome"] == "ok":
        assert reader.feed(data) == [expected_message(case["result"]["decoded"])]
        reader.close()
        return
    if case["name"] == "frame_eof_immediately":
        # No byte at all: the stream ended on a frame boundary, so there is no
        # partial frame; the reference's error is "no message", as here.
        assert reader.feed(data) == []
        assert reader.pending == 0
        reader.close()
        return
    try:
        got = reader.feed(data)
    except ProtocolError:
        return
    assert got == []
    assert reader.pending == len(data)
    with pytest.raises(ProtocolError, match="stream ended inside a frame"):
        reader.close()


def test_over_limit_length_is_frame_too_large():
    for name, length in (("frame_len_over_limit_100000001", 100_000_001),
                         ("frame_len_over_limit_u32_max", 0xFFFFFFFF)):
        data = input_of(next(c for c in FRAME_CASES if c["name"] == name))
        with pytest.raises(FrameTooLarge) as info:
            ddpwire.FrameReader().feed(data)
        assert (info.value.length, info.value.limit) == (length, 100_000_000)
        with pytest.raises(FrameTooLarge):
            ddpwire.decode_frame(data)


# -- the two 100 MB frames, built from their descriptions ---------------------

def heartbeat_frame(case) -> bytes:
    """A Heartbeat whose node_id is 'a' * N, as the case describes; the
    encoder must produce the prefix the reference wrote."""
    node_len = case["input_len"] - 4 - 1 - 4 - 8
    frame = ddpwire.encode_frame(ddpwire.Heartbeat("a" * node_len, 7), max_frame=2**32 - 1)
    assert len(frame) == case["input_len"]
    assert frame.startswith(bytes.fromhex(case["input_hex"]))
    return frame


def test_frame_of_exactly_the_limit_is_accepted():
    case = next(c for c in FRAME_CASES if c["name"] == "frame_len_exactly_100000000_valid")
    frame = heartbeat_frame(case)
    want = case["result"]["decoded"]
    for msg in (ddpwire.decode_frame(frame), *ddpwire.FrameReader().feed(frame)):
        assert isinstance(msg, ddpwire.Heartbeat)
        assert len(msg.node_id) == want["node_id_byte_len"]
        assert msg.node_id == "a" * want["node_id_byte_len"]
        assert msg.timestamp_ms == want["timestamp_ms"]
    # the encoder's default limit is the reference's: one byte more is refused
    ddpwire.encode_frame(ddpwire.Heartbeat("a" * want["node_id_byte_len"], 7))
    with pytest.raises(FrameTooLarge):
        ddpwire.encode_frame(ddpwire.Heartbeat("a" * (want["node_id_byte_len"] + 1), 7))


def test_frame_one_over_the_limit_is_refused_before_allocating():
    case = next(c for c in FRAME_CASES if c["name"] == "frame_len_100000001_valid_payload")
    frame = heartbeat_frame(case)
    with pytest.raises(FrameTooLarge):
        ddpwire.decode_frame(frame)
    with pytest.raises(FrameTooLarge):
        ddpwire.FrameReader().feed(frame)
    # only the length prefix is needed to refuse it, and nothing big is allocated
    reader = ddpwire.FrameReader()
    tracemalloc.start()
    try:
        with pytest.raises(FrameTooLarge):
            reader.feed(frame[:4])
        _, peak = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert peak < 1_000_000
    # a larger configured limit takes it
    assert len(ddpwire.FrameReader(max_frame=100_000_001).feed(frame)[0].node_id) == 99_999_988
