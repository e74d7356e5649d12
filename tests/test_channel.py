"""Channel.send_last: the last frame a side sends, only between two frames;
Channel.send_all: a step's frames in one write."""
from __future__ import annotations

import socket

import pytest

from ddpwire import CoordinatorLost, WorkerLost
from ddpwire.wire.channel import Channel
from ddpwire import encode_frame
from ddpwire.wire.messages import ShardAssignment, ShardScale, Shutdown, StepAborted


@pytest.fixture
def pair():
    with socket.create_server(("127.0.0.1", 0)) as server:
        a = socket.create_connection(server.getsockname())
        b, _ = server.accept()
    near = Channel(a, timeout=5, peer_name="worker", lost=WorkerLost, peer_id=1)
    far = Channel(b, timeout=5, peer_name="coordinator", lost=CoordinatorLost)
    yield near, far
    near.close()
    far.close()


def test_between_frames_it_goes_out_then_the_stream_ends(pair):
    near, far = pair
    msg = StepAborted(step=3, worker_id=1, workers=2)
    assert near.send_last(msg, lock_wait=1.0, timeout=1.0, what="telling")
    assert far.expect([StepAborted], step=3) == msg
    far.conn.sock.settimeout(1.0)
    assert far.conn.sock.recv(1) == b""  # the sending half is shut


def test_inside_a_frame_nothing_goes_out(pair):
    near, far = pair
    near.frame_open = True  # an exception cut a frame short
    assert not near.send_last(Shutdown(), lock_wait=1.0, timeout=1.0, what="stopping")
    far.conn.sock.setblocking(False)
    with pytest.raises(BlockingIOError):
        far.conn.sock.recv(1)


def test_while_another_send_holds_the_connection_it_gives_up(pair):
    near, _ = pair
    with near.send_lock:
        assert not near.send_last(Shutdown(), lock_wait=0.05, timeout=1.0, what="stopping")


def test_a_closed_connection_is_not_written(pair):
    near, _ = pair
    near.close()
    assert not near.send_last(Shutdown(), lock_wait=1.0, timeout=1.0, what="stopping")


def test_send_all_writes_the_frames_back_to_back_in_one_write(pair):
    near, far = pair
    msgs = [ShardAssignment(step=4, shard_start=0, shard_end=24), ShardScale(step=4, scale=0.75)]
    writes = []
    send_parts = near.conn.send_parts

    class Counting:
        """The connection, with its scatter-gather writes counted."""

        def __getattr__(self, name):
            return getattr(near.conn_real, name)

        def send_parts(self, parts, *args, **kwargs):
            writes.append(b"".join(bytes(p) for p in parts))
            return send_parts(parts, *args, **kwargs)
    near.conn_real, near.conn = near.conn, Counting()
    try:
        near.send_all(msgs, step=4)
    finally:
        near.conn = near.conn_real
    assert writes == [encode_frame(msgs[0]) + encode_frame(msgs[1])]  # one write, both frames
    assert far.expect([ShardAssignment], step=4) == msgs[0]
    assert far.expect([ShardScale], step=4) == msgs[1]
    assert not near.frame_open
