"""The extension frames of tests/data/extension_vectors.json (bytes written
from docs/extensions.md with struct, not by ddpwire) decode to their fields
and re-encode byte for byte; the inputs of extension_malformed.json are
ProtocolErrors with the expected text."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Dict

import numpy as np
import pytest

import ddpwire
from ddpwire import ProtocolError
from ddpwire.wire import messages

DATA = Path(__file__).parent / "data"
VECTORS = json.loads((DATA / "extension_vectors.json").read_text())["vectors"]
MALFORMED = json.loads((DATA / "extension_malformed.json").read_text())["cases"]


def frame_of(vector: Dict[str, Any]) -> bytes:
    data = bytes.fromhex(vector["frame_hex"])
    assert len(data) == 4 + vector["payload_len"]
    return data


def expected(spec: Dict[str, Any]) -> messages.Message:
    """The message a JSON description names, built without the codec."""
    cls = getattr(messages, spec["type"])
    values: Dict[str, Any] = {}
    for key, raw in spec.items():
        if key in ("type", "tag"):
            continue
        if key.endswith("_hex"):
            values[key[:-4]] = bytes.fromhex(raw)
        elif isinstance(raw, dict):
            values[key] = bytes.fromhex(raw["utf8_hex"]).decode("utf-8")
        elif key == "extensions":
            values[key] = None if raw is None else {
                e["type"]: bytes.fromhex(e["value_hex"]) for e in raw}
        else:
            values[key] = raw
    return cls(**values)


def check_fields(msg: messages.Message, spec: Dict[str, Any]) -> None:
    assert type(msg).__name__ == spec["type"] and type(msg).TAG == spec["tag"]
    for key, want in spec.items():
        if key in ("type", "tag"):
            continue
        if key == "data_hex":
            assert isinstance(msg.data, np.ndarray) and msg.data.dtype == np.uint8
            assert msg.data.tobytes().hex() == want
        elif key.endswith("_hex"):
            got = getattr(msg, key[:-4])
            assert type(got) is bytes and got.hex() == want
        elif isinstance(want, dict):
            assert getattr(msg, key) == want["value"]
        elif key == "extensions":
            if want is None:
                assert msg.extensions is None
            else:
                # wire order kept, values as bytes
                assert [(t, v.hex()) for t, v in msg.extensions.items()] == [
                    (e["type"], e["value_hex"]) for e in want]
                assert all(type(v) is bytes for v in msg.extensions.values())
        elif isinstance(want, float):
            # float32 fields: the vectors hold values float32 represents exactly
            got = getattr(msg, key)
            assert type(got) is float and got == want, key
        else:
            got = getattr(msg, key)
            assert type(got) is int and got == want, key


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_frame_decodes_to_its_fields(vector):
    check_fields(ddpwire.decode_frame(frame_of(vector)), vector["message"])
    check_fields(ddpwire.decode_payload(bytearray(frame_of(vector)[4:])), vector["message"])


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_fields_encode_to_the_frame(vector):
    msg = expected(vector["message"])
    assert ddpwire.encode_frame(msg) == frame_of(vector)
    head, bulk, tail = ddpwire.encode_frame_parts(msg)
    if "data_hex" in vector["message"]:
        assert isinstance(bulk, memoryview) and tail == b""
        assert bulk.nbytes == len(vector["message"]["data_hex"]) // 2
        assert head + bulk.tobytes() == frame_of(vector)
    else:
        assert bulk is None and tail == b"" and head == frame_of(vector)


@pytest.mark.parametrize("vector", VECTORS, ids=[v["name"] for v in VECTORS])
def test_decoded_message_reencodes_byte_for_byte(vector):
    frame = frame_of(vector)
    decoded = ddpwire.decode_frame(frame)
    assert decoded == expected(vector["message"])
    assert ddpwire.encode_frame(decoded) == frame
    got = ddpwire.FrameReader().feed(frame)
    assert len(got) == 1 and got[0] == decoded


def test_the_vectors_cover_every_shape():
    names = {v["message"]["type"] for v in VECTORS}
    assert {"AuthChallenge", "AuthProof", "JoinRefused", "CollectiveRequest",
            "CollectiveResult", "CollectiveError", "MeshPeers", "PeerHello", "StepReport",
            "StepCommit", "StepTiming", "ShardScale", "StepAborted", "StateRequest",
            "ModelState"} <= names
    for type_name in ("JoinRequest", "JoinAccepted"):
        blocks = [v["message"]["extensions"] for v in VECTORS
                  if v["message"]["type"] == type_name]
        sizes = {None if b is None else min(len(b), 2) for b in blocks}
        assert sizes == {None, 0, 1, 2}, type_name
        known = {int(e) for e in ddpwire.Extension}
        assert any(e["type"] not in known for b in blocks if b for e in b)
    # check_fields compares only the fields a vector names, so a MeshPeers
    # vector without coordinator_share would let a misplaced u16 through
    mesh = [v["message"] for v in VECTORS if v["message"]["type"] == "MeshPeers"]
    assert all("coordinator_share" in m for m in mesh)
    assert {m["coordinator_share"] != 0 for m in mesh} == {True, False}


def test_reference_vectors_still_have_no_block():
    from wire_cases import VECTORS as REFERENCE
    for vector in REFERENCE:
        if vector["message"]["type"] in ("JoinRequest", "JoinAccepted"):
            frame = bytes.fromhex(vector["frame_hex"])
            msg = ddpwire.decode_frame(frame)
            assert msg.extensions is None
            assert ddpwire.encode_frame(msg) == frame


@pytest.mark.parametrize("case", MALFORMED, ids=[c["name"] for c in MALFORMED])
def test_malformed_is_a_protocol_error_with_its_text(case):
    payload = bytes.fromhex(case["input_hex"])
    assert len(payload) == case["input_len"]
    with pytest.raises(ProtocolError, match=case["error"]):
        ddpwire.decode_payload(payload)
    frame = len(payload).to_bytes(4, "big") + payload
    with pytest.raises(ProtocolError, match=case["error"]):
        ddpwire.FrameReader().feed(frame)


@pytest.mark.parametrize("case", MALFORMED, ids=[c["name"] for c in MALFORMED])
def test_allow_trailing_forgives_only_bytes_that_are_not_a_block(case):
    payload = bytes.fromhex(case["input_hex"])
    if case["name"] in ("trailing_not_magic", "short_trailing_magic_prefix",
                        "data_trailing", "proof_trailing", "peer_hello_trailing",
                        "step_commit_trailing", "step_timing_trailing",
                        "shard_scale_trailing", "step_aborted_trailing",
                        "state_request_trailing", "model_state_trailing"):
        msg = ddpwire.decode_payload(payload, allow_trailing=True)
        assert getattr(msg, "extensions", None) is None
    else:
        with pytest.raises(ProtocolError):
            ddpwire.decode_payload(payload, allow_trailing=True)
