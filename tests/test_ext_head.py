"""The streaming head decoder (ddpw_decode_head) on messages with a bulk
field: CollectiveRequest/CollectiveResult are read up to their data with
every check done before the data arrives, and the gradient messages report
their elements as the bulk too."""
from __future__ import annotations

import os
import subprocess
from pathlib import Path

import pytest

import ddpwire
from test_ext_vectors import MALFORMED as EXT_MALFORMED
from test_ext_vectors import VECTORS as EXT_VECTORS
from test_wire_c import CSRC, compiler
from wire_cases import VECTORS as REFERENCE

PROBE_SRC = Path(__file__).parent / "c" / "bulk_probe.c"
BULK_TAGS = {0x43, 0x44}
GRADIENT_TAGS = {4, 5, 8, 9, 10, 11}


@pytest.fixture(scope="module")
def probe(tmp_path_factory) -> Path:
    out = tmp_path_factory.mktemp("bulk") / "bulk_probe"
    base = [*compiler(), "-std=c99", "-Wall", "-Wextra", "-Werror", "-g", "-I", str(CSRC),
            str(CSRC / "wire.c"), str(PROBE_SRC), "-o", str(out)]
    sanitized = subprocess.run(base + ["-fsanitize=address,undefined", "-fno-sanitize-recover=all"],
                               capture_output=True, text=True)
    if sanitized.returncode != 0:
        plain = subprocess.run(base, capture_output=True, text=True)
        assert plain.returncode == 0, plain.stderr
    return out


def run(probe: Path, payload: bytes, flags: int = 0) -> list:
    result = subprocess.run([str(probe), str(flags)], input=payload, capture_output=True,
                            env={**os.environ, "ASAN_OPTIONS": "detect_leaks=1"})
    assert result.returncode == 0, result.stderr.decode()
    assert result.stderr == b""
    return result.stdout.decode().split()


HEAD_FIELDS = ("avail", "tag", "has_gradients", "has_bulk", "seq", "kind", "op", "dtype", "root",
               "count", "bulk_offset", "bulk_len", "tail_len", "trailing_len")


def head_of(words: list) -> dict:
    assert words[0] == "head", words
    return dict(zip(HEAD_FIELDS, (int(w) for w in words[1:])))


COLLECTIVE = [v for v in EXT_VECTORS if v["message"]["tag"] in BULK_TAGS]


@pytest.mark.parametrize("vector", COLLECTIVE, ids=[v["name"] for v in COLLECTIVE])
def test_collective_head_stops_where_the_data_starts(probe, vector):
    payload = bytes.fromhex(vector["frame_hex"])[4:]
    msg = ddpwire.decode_payload(payload)
    head = head_of(run(probe, payload))
    assert head["has_gradients"] == 0 and head["has_bulk"] == 1
    assert head["avail"] == head["bulk_offset"] == len(payload) - msg.data.nbytes
    assert head["bulk_len"] == msg.data.nbytes and head["tail_len"] == 0
    assert head["trailing_len"] == 0
    for field in ("seq", "kind", "dtype", "count"):
        assert head[field] == getattr(msg, field), field
    if msg.TAG == 0x43:
        assert (head["op"], head["root"]) == (msg.op, msg.root)


@pytest.mark.parametrize("vector", REFERENCE, ids=[v["name"] for v in REFERENCE])
def test_gradient_elements_are_the_bulk(probe, vector):
    payload = bytes.fromhex(vector["frame_hex"])[4:]
    head = head_of(run(probe, payload))
    if payload[0] in GRADIENT_TAGS:
        msg = ddpwire.decode_payload(payload)
        assert head["has_bulk"] == 1 and head["has_gradients"] == 1
        assert head["bulk_len"] == 4 * len(msg.gradients)
        assert head["bulk_offset"] + head["bulk_len"] + head["tail_len"] == len(payload)
    else:
        assert head["has_bulk"] == 0 and head["avail"] == 1


BAD = [c for c in EXT_MALFORMED if int(c["input_hex"][:2], 16) in BULK_TAGS]


@pytest.mark.parametrize("case", BAD, ids=[c["name"] for c in BAD])
def test_bad_collective_heads_are_errors_before_the_data(probe, case):
    payload = bytes.fromhex(case["input_hex"])
    words = run(probe, payload)
    if case["name"] == "data_trailing":
        assert words[0] == "error"
        lenient = head_of(run(probe, payload, flags=1))
        assert lenient["trailing_len"] == 2 and lenient["bulk_len"] == 4
        return
    assert words[0] == "error", words
    # found with the head only: the data (if any) never had to arrive
    with pytest.raises(ddpwire.ProtocolError):
        ddpwire.decode_payload(payload)


def test_read_frame_head_leaves_collective_data_in_the_socket():
    import socket

    import numpy as np

    from ddpwire import _core

    values = np.arange(5, dtype=np.float64)
    msg = ddpwire.CollectiveResult(3, ddpwire.CollectiveKind.BROADCAST, ddpwire.DType.FLOAT64, 5,
                                   values)
    server = socket.create_server(("127.0.0.1", 0))
    a = socket.create_connection(server.getsockname())
    b, _ = server.accept()
    server.close()
    try:
        sender, receiver = _core.Connection(a), _core.Connection(b)
        head, bulk, tail = ddpwire.encode_frame_parts(msg)
        sender.send_parts([head, bulk, tail, ddpwire.encode_frame(msg)], 5.0)
        fh = _core.read_frame_head(receiver, 5.0, ddpwire.DEFAULT_MAX_FRAME,
                                   collective_heads=True)
        assert (fh.tag, fh.seq, fh.kind, fh.dtype, fh.count) == (0x44, 3, 2, 1, 5)
        assert fh.bulk_len == 40 and fh.tail_len == 0 and fh.message_type == "CollectiveResult"
        out = np.empty(5, np.float64)  # the caller's own buffer
        receiver.recv_into(out, 5.0)
        np.testing.assert_array_equal(out, values)
        # without the flag the same frame is decoded whole, as before
        assert _core.read_frame_head(receiver, 5.0, ddpwire.DEFAULT_MAX_FRAME) == msg
    finally:
        a.close()
        b.close()
