"""allreduce_stream with halt_on_nonfinite=False: a NaN or inf is reported
per connection but the reply is finished, so the connections stay in step
(the mesh's coordinator decides the halt later, in StepCommit). Both
engines: the poll loop of csrc/net.c and the socket threads of
csrc/threaded.c. The default, halting at the first bad value, is checked
alongside."""
from __future__ import annotations

import math

import numpy as np
import pytest

import ddpwire
from ddpwire._core import Connection, allreduce_stream
from session_helpers import reference_allreduce
from test_exchange_many import Spawned, tcp_pair

COUNT = 300_003  # many 64 KiB reduce slices and threaded chunks
RING = 64 * 1024  # small rings: the reduce runs while the vectors still arrive
HEAD = b"reply head \x00\x01\x02"
TAIL_LEN = 6
TIMEOUT = 30.0

# per connection, the non-finite values planted: (index, value); the first
# by index is what bad must name
PLANTED = [
    [(5, math.nan), (200_000, math.inf)],
    [(150_000, math.inf), (COUNT - 1, math.nan)],
    [],
]


def grads_for(n, count, seed):
    rng = np.random.default_rng(seed)
    # spread magnitudes so rounding depends on the summation order
    return [(rng.standard_normal(count) * 2.0 ** rng.integers(-8, 12, count)).astype(np.float32)
            for _ in range(n)]


def reference(grads):
    """The tests' one reference (tests/session_helpers.py): the float32 mean."""
    return reference_allreduce(grads)


def tail_of(i, round_):
    return bytes([0x40 + i, round_]) + b"tail"[:TAIL_LEN - 2]


def make_tail_for(calls):
    def make_tail(tails):
        calls.append(list(tails))
        return b"END" + b"".join(tails)
    return make_tail


class Step:
    """n connections whose far ends each send a frame (vector + tail) and
    then read the reply from the coordinator's side."""

    def __init__(self, n):
        pairs = [tcp_pair() for _ in range(n)]
        self.conns = [Connection(a, peer_id=i, lost=ddpwire.WorkerLost)
                      for i, (a, _) in enumerate(pairs)]
        self.peers = [b for _, b in pairs]
        for b in self.peers:
            b.setblocking(True)
            b.settimeout(TIMEOUT)

    def start(self, grads, round_, reply_len):
        """Each peer sends its frame, then reads reply_len bytes (or to EOF
        when reply_len is None)."""
        def peer(i):
            sock = self.peers[i]
            sock.sendall(grads[i].tobytes() + tail_of(i, round_))
            got = bytearray()
            while reply_len is None or len(got) < reply_len:
                chunk = sock.recv(1 << 20 if reply_len is None else reply_len - len(got))
                if not chunk:
                    break
                got += chunk
            return bytes(got)
        return [Spawned(lambda i=i: peer(i)) for i in range(len(self.peers))]

    def close(self):
        for c in self.conns:
            c.close()
        for b in self.peers:
            b.close()


def reply_len(n, count):
    return len(HEAD) + 4 * count + 3 + n * TAIL_LEN


@pytest.mark.parametrize("socket_threads", [False, True], ids=["poll", "threads"])
@pytest.mark.parametrize("n", [1, 2, 3])
def test_a_non_finite_value_is_reported_and_the_reply_finished(n, socket_threads):
    grads = grads_for(n, COUNT, seed=n)
    for i in range(n):
        for index, value in PLANTED[i]:
            grads[i][index] = value
    want = reference(grads)
    finite = np.all(np.isfinite(np.stack(grads)), axis=0)
    assert not finite.all() and finite.sum() > COUNT - 10  # the plant took
    step = Step(n)
    try:
        peers = step.start(grads, 1, reply_len(n, COUNT))
        out = np.empty(COUNT, np.float32)
        calls = []
        tails, bad = allreduce_stream(step.conns, out, TAIL_LEN, HEAD, make_tail_for(calls),
                                      TIMEOUT, ring_bytes=RING, socket_threads=socket_threads,
                                      step=1, halt_on_nonfinite=False)
        replies = [p.join_result() for p in peers]

        expected_tails = [tail_of(i, 1) for i in range(n)]
        assert tails == expected_tails
        assert calls == [expected_tails]
        assert bad is not None and len(bad) == n
        for i in range(n):
            index, value = bad[i]
            if not PLANTED[i]:
                assert index == -1
                continue
            first_index, first_value = min(PLANTED[i])
            assert index == first_index
            if math.isnan(first_value):
                assert math.isnan(value)
            else:
                assert value == first_value
        # every element averaged, bit for bit where the inputs are finite
        assert np.array_equal(out[finite].view(np.uint32), want[finite].view(np.uint32))
        assert np.array_equal(out, want, equal_nan=True)
        for reply in replies:
            assert len(reply) == reply_len(n, COUNT)
            assert reply[:len(HEAD)] == HEAD
            assert reply[len(HEAD):len(HEAD) + 4 * COUNT] == out.tobytes()
            assert reply[len(HEAD) + 4 * COUNT:] == b"END" + b"".join(expected_tails)

        # the streams are in step: the next frame goes through as usual
        grads2 = grads_for(n, 1000, seed=100 + n)
        peers = step.start(grads2, 2, reply_len(n, 1000))
        out2 = np.empty(1000, np.float32)
        calls = []
        tails, bad = allreduce_stream(step.conns, out2, TAIL_LEN, HEAD, make_tail_for(calls),
                                      TIMEOUT, ring_bytes=RING, socket_threads=socket_threads,
                                      step=2)
        replies = [p.join_result() for p in peers]
        assert bad is None and tails == [tail_of(i, 2) for i in range(n)] and len(calls) == 1
        assert np.array_equal(out2.view(np.uint32), reference(grads2).view(np.uint32))
        for reply in replies:
            assert reply == HEAD + out2.tobytes() + b"END" + b"".join(tails)
    finally:
        step.close()


@pytest.mark.parametrize("socket_threads", [False, True], ids=["poll", "threads"])
def test_by_default_a_non_finite_value_stops_the_reply(socket_threads):
    n, bad_at = 2, 100_000
    grads = grads_for(n, COUNT, seed=7)
    grads[1][bad_at] = math.nan
    want = reference(grads)
    step = Step(n)
    try:
        peers = step.start(grads, 1, None)
        out = np.empty(COUNT, np.float32)
        calls = []
        try:
            tails, bad = allreduce_stream(step.conns, out, TAIL_LEN, HEAD, make_tail_for(calls),
                                          TIMEOUT, ring_bytes=RING,
                                          socket_threads=socket_threads, step=1)
        finally:
            # a halted reply is cut short: only closing tells the peers
            for c in step.conns:
                c.close()
        replies = [p.join_result() for p in peers]
        assert tails == [tail_of(i, 1) for i in range(n)]
        assert calls == []
        assert bad[0][0] == -1
        assert bad[1][0] == bad_at and math.isnan(bad[1][1])
        for reply in replies:
            # nothing holding the NaN went out; what did is the true average
            assert len(reply) <= len(HEAD) + 4 * bad_at
            assert reply[:len(HEAD)] == HEAD[:len(reply)]
            sent = reply[len(HEAD):]
            assert sent == want[:(len(sent) + 3) // 4].tobytes()[:len(sent)]
    finally:
        step.close()


@pytest.mark.parametrize("socket_threads", [False, True], ids=["poll", "threads"])
def test_scales_weight_each_connection_as_a_peer_that_applies_its_own(socket_threads):
    """``scales`` (the sample weights of reference workers, ddpwire.session.balance):
    each connection's elements multiplied once in float32 before the sum,
    the bits of the peers multiplying their own; checked before the weight,
    so a non-finite value is named as sent; a scale of 1 changes nothing."""
    n = 3
    grads = grads_for(n, COUNT, seed=11)
    scales = [1.6, 1.0, 0.4]
    grads[2][7] = math.inf
    want = reference([g * np.float32(s) for g, s in zip(grads, scales)])
    step = Step(n)
    try:
        peers = step.start(grads, 2, None)
        out = np.empty(COUNT, np.float32)
        tails, bad = allreduce_stream(step.conns, out, TAIL_LEN, None, None, TIMEOUT,
                                      ring_bytes=RING, socket_threads=socket_threads, step=2,
                                      halt_on_nonfinite=False, scales=scales)
        assert bad is not None and bad[2][0] == 7 and bad[2][1] == math.inf
        assert [b[0] for b in bad[:2]] == [-1, -1]
        assert np.array_equal(out.view(np.uint32), want.view(np.uint32))
    finally:
        for c in step.conns:
            c.close()  # the peers read to the end of the stream
        for p in peers:
            p.join_result()
        step.close()


@pytest.mark.parametrize("scales,match", [
    ([1.0, 1.0], "one per connection"),
    ([1.0, -0.5, 1.0], r"scales\[1\]"),
    ([1.0, math.nan, 1.0], r"scales\[1\]"),
    ([math.inf, 1.0, 1.0], r"scales\[0\]"),
])
def test_bad_scales_are_refused_before_a_byte_is_read(scales, match):
    step = Step(3)
    try:
        with pytest.raises(ValueError, match=match):
            allreduce_stream(step.conns, np.empty(8, np.float32), TAIL_LEN, None, None, TIMEOUT,
                             scales=scales)
    finally:
        step.close()
