"""Compiled wire codec side by side with the pure-Python baseline (pure_codec.py).

Run:  python -m pytest bench/test_bench_codec.py --benchmark-only --benchmark-group-by=group
Each group holds the same work done both ways, so the ratio reads off the table.
"""
from __future__ import annotations

import numpy as np
import pytest

import ddpwire
import pure_codec

SMALL = {
    "JoinRequest": ddpwire.JoinRequest("intel-1234", 2, "wgpu"),
    "ShardAssignment": ddpwire.ShardAssignment(42, 100, 200),
}
CODECS = {"compiled": ddpwire, "pure": pure_codec}
MIB = 1024 * 1024
BIG_LIMIT = 2**32 - 1


def gradient_message(nbytes: int) -> ddpwire.GradientPayload:
    grads = np.random.default_rng(0).standard_normal(nbytes // 4).astype(np.float32)
    return ddpwire.GradientPayload(7, 1, grads, 0.25, 90, 128)


GRADIENTS = {"1MiB": gradient_message(MIB), "64MiB": gradient_message(64 * MIB)}


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("kind", SMALL)
def test_small_encode_decode(benchmark, kind, codec):
    impl = CODECS[codec]
    msg = SMALL[kind]
    benchmark.group = f"{kind} encode+decode"

    def round_trip():
        return impl.decode_frame(impl.encode_frame(msg))

    assert benchmark(round_trip) == msg


@pytest.mark.parametrize("codec", CODECS)
@pytest.mark.parametrize("size", GRADIENTS)
def test_gradient_decode(benchmark, size, codec):
    impl = CODECS[codec]
    msg = GRADIENTS[size]
    frame = ddpwire.encode_frame(msg, max_frame=BIG_LIMIT)
    benchmark.group = f"GradientPayload {size} decode"
    got = benchmark(impl.decode_frame, frame, max_frame=BIG_LIMIT)
    assert got == msg
    assert np.shares_memory(got.gradients, np.frombuffer(frame, np.uint8))


@pytest.mark.parametrize("codec", ["compiled", "compiled parts", "pure"])
@pytest.mark.parametrize("size", GRADIENTS)
def test_gradient_encode(benchmark, size, codec):
    msg = GRADIENTS[size]
    want = ddpwire.encode_frame(msg, max_frame=BIG_LIMIT)
    benchmark.group = f"GradientPayload {size} encode"
    if codec == "compiled parts":  # what a scatter-gather send uses: no copy
        head, grads, tail = benchmark(ddpwire.encode_frame_parts, msg, max_frame=BIG_LIMIT)
        assert len(head) + grads.nbytes + len(tail) == len(want)
        return
    impl = CODECS[codec]
    assert benchmark(impl.encode_frame, msg, max_frame=BIG_LIMIT) == want
