"""ddpwire.plane.p2p without torch: the mailbox (order, tags, any source, the
bound on held bytes, timeouts, failure), the service's relay of SEND
requests (kind 6) with its checks, and the direct links over a socket pair."""
import queue
import socket
import threading

import numpy as np
import pytest

from ddpwire.wire.channel import Channel
from ddpwire.plane.collectives import CollectiveAborted, DType, Kind, Op
from ddpwire.wire.errors import WorkerLost
from ddpwire.plane.collectives import DEPARTED_TAG, relayed_seq, split_relayed_seq
from ddpwire.plane.p2p import (Mailbox, Message, PeerLinks, PointToPointError,
                         PointToPointMismatch, PointToPointOverflow, PointToPointTimeout,
                         ServiceRoute, check_tag)
from ddpwire.wire.messages import CollectiveRequest

from test_collectives import group, run

WAIT = 10.0  # the longest any event here is waited for; none should need it


def msg(src, tag, values, dtype=np.float32):
    data = np.asarray(values, dtype=dtype)
    code = {np.float32: DType.FLOAT32, np.int64: DType.INT64, np.uint8: DType.UINT8}[dtype]
    return Message(src, tag, int(code), data.size, data.view(np.uint8))


def values(message, dtype=np.float32):
    return message.data.view(dtype).tolist()


class Box:
    """A deliver callback that records what it got, and can be waited for."""

    def __init__(self):
        self.got = queue.Queue()

    def __call__(self, message, error):
        self.got.put((message, error))

    def take(self):
        return self.got.get(timeout=WAIT)

    def empty(self):
        return self.got.empty()


def test_one_source_and_tag_keeps_the_send_order():
    box = Mailbox(0, 3)
    for v in (1, 2, 3):
        box.put(msg(1, 7, [v]))
    assert box.held == 12
    assert [values(box.receive(1, 7, WAIT)) for _ in range(3)] == [[1], [2], [3]]
    assert box.held == 0


def test_tags_match_exactly():
    box = Mailbox(0, 2)
    box.put(msg(1, 1, [10]))
    box.put(msg(1, 2, [20]))
    assert values(box.receive(1, 2, WAIT)) == [20]
    assert values(box.receive(1, 1, WAIT)) == [10]
    waiting = Box()
    box.post(1, 3, waiting)
    box.put(msg(1, 4, [40]))  # another tag: the receive still waits
    assert waiting.empty() and box.waiting() == 1 and box.held == 4


def test_a_receive_posted_first_gets_the_message_when_it_comes():
    box = Mailbox(1, 2)
    first, second = Box(), Box()
    box.post(0, 5, first)
    box.post(0, 5, second)
    box.put(msg(0, 5, [1.5]))
    message, error = first.take()
    assert error is None and values(message) == [1.5] and second.empty()
    box.put(msg(0, 5, [2.5]))
    assert values(second.take()[0]) == [2.5]
    assert box.held == 0 and box.waiting() == 0


def test_any_source_takes_the_earliest_arrival_and_names_its_sender():
    box = Mailbox(0, 4)
    box.put(msg(3, 9, [3]))
    box.put(msg(1, 9, [1]))
    box.put(msg(2, 8, [2]))
    got = box.receive(None, 9, WAIT)
    assert (got.src, values(got)) == (3, [3])
    assert box.receive(None, 9, WAIT).src == 1
    # posted receives are served in posting order, whichever source they name
    specific, anyone = Box(), Box()
    box.post(2, 11, specific)
    box.post(None, 11, anyone)
    box.put(msg(2, 11, [20]))
    assert specific.take()[0].src == 2 and anyone.empty()
    box.put(msg(1, 11, [10]))
    assert anyone.take()[0].src == 1


def test_unclaimed_bytes_past_the_bound_fail_the_mailbox():
    box = Mailbox(0, 2, max_held=16)
    box.put(msg(1, 0, [1, 2, 3]))  # 12 bytes held
    waiting = Box()
    box.post(1, 5, waiting)
    with pytest.raises(PointToPointOverflow, match="over the limit of 16") as info:
        box.put(msg(1, 0, [4, 5]))  # 20 bytes would be held
    assert (info.value.src, info.value.dst, info.value.tag) == (1, 0, 0)
    assert isinstance(info.value, PointToPointError)
    # every receive, waiting or later, says why: a message was lost
    assert isinstance(waiting.take()[1], PointToPointOverflow)
    with pytest.raises(PointToPointOverflow):
        box.receive(1, 0, WAIT)
    assert box.held == 0


def test_a_message_given_to_a_receive_is_not_counted_against_the_bound():
    box = Mailbox(0, 2, max_held=4)
    waiting = Box()
    box.post(1, 0, waiting)
    box.put(msg(1, 0, [1, 2, 3, 4]))  # 16 bytes, straight into the receive
    assert values(waiting.take()[0]) == [1, 2, 3, 4] and box.held == 0


def test_a_receive_that_times_out_is_withdrawn():
    box = Mailbox(2, 3)
    with pytest.raises(PointToPointTimeout, match="timed out: rank 2 received nothing from "
                       "rank 1 with tag 4") as info:
        box.receive(1, 4, 0.05)
    assert (info.value.src, info.value.dst, info.value.tag) == (1, 2, 4)
    assert box.waiting() == 0
    box.put(msg(1, 4, [7]))  # held for the next receive, not lost to the old one
    assert values(box.receive(1, 4, WAIT)) == [7]


def test_fail_ends_every_receive_now_and_later():
    box = Mailbox(0, 3)
    a, b = Box(), Box()
    box.post(1, 0, a)
    box.post(None, 0, b)
    box.put(msg(2, 3, [1]))
    error = CollectiveAborted("rank 1 is gone", rank=1, seq=None)
    box.fail(error)
    assert a.take()[1] is error and b.take()[1] is error
    assert box.held == 0
    with pytest.raises(CollectiveAborted) as info:
        box.receive(2, 3, WAIT)
    assert info.value.rank == 1
    box.put(msg(1, 0, [1]))  # dropped: nothing takes it
    assert box.held == 0


def test_a_source_gone_fails_its_receives_after_its_last_messages():
    box = Mailbox(0, 3)
    box.put(msg(1, 0, [5]))
    waiting, anyone = Box(), Box()
    box.post(1, 6, waiting)
    box.post(None, 6, anyone)
    gone = CollectiveAborted("rank 1 left", rank=1, seq=None)
    box.source_gone(1, gone)
    assert waiting.take()[1] is gone
    assert anyone.empty()  # rank 2 may still send
    assert values(box.receive(1, 0, WAIT)) == [5]  # what came before it left
    with pytest.raises(CollectiveAborted):
        box.receive(1, 0, WAIT)
    box.source_gone(2, CollectiveAborted("rank 2 left", rank=2, seq=None))
    assert anyone.take()[1].rank == 2  # now no rank can send it


def test_tags_and_relayed_seq():
    assert check_tag(0, "send") == 0 and check_tag(2 ** 31 - 1, "send") == 2 ** 31 - 1
    for bad in (-1, 2 ** 31):
        with pytest.raises(ValueError, match="tag"):
            check_tag(bad, "send")
    assert split_relayed_seq(relayed_seq(5, 123)) == (5, 123)
    assert relayed_seq(2, DEPARTED_TAG) == (2 << 32) | 0xFFFFFFFF
    assert int(Kind.SEND) == 6 and Kind(6).name == "SEND"


# ---- through the service ----

def routes(world):
    service, clients, ends = group(world)
    return service, clients, ends, [ServiceRoute(c, Mailbox(r, world)) for r, c in enumerate(clients)]


def send(route, dst, tag, data, dtype=DType.FLOAT32):
    done = queue.Queue()
    route.send(dst, tag, dtype, np.asarray(data).view(np.uint8), done.put)
    return done


def test_the_service_relays_in_order_without_taking_collective_numbers():
    service, clients, ends, rs = routes(3)
    try:
        sent = [send(rs[0], 2, 5, np.array([float(v)], dtype=np.float32)) for v in range(4)]
        sent.append(send(rs[1], 2, 5, np.array([9.0], dtype=np.float32)))
        assert all(s.get(timeout=WAIT) is None for s in sent)
        got = [rs[2].mailbox.receive(0, 5, WAIT) for _ in range(4)]
        assert [values(m) for m in got] == [[0.0], [1.0], [2.0], [3.0]]
        assert {m.src for m in got} == {0} and got[0].dtype == int(DType.FLOAT32)
        assert values(rs[2].mailbox.receive(None, 5, WAIT)) == [9.0]
        # the first collective after them is still collective 0
        boxes = [run(c, Kind.BARRIER, Op.SUM, DType.UINT8, 0, b"") for c in clients]
        for b in boxes:
            result, error = b.get(timeout=WAIT)
            assert error is None
        assert service.answered == 1 and service.failure is None
    finally:
        for c in clients:
            c.close()
        service.stop()


def test_a_message_that_comes_before_the_route_is_set_up_waits_for_it():
    service, clients, ends = group(2)
    try:
        route0 = ServiceRoute(clients[0], Mailbox(0, 2))
        assert send(route0, 1, 3, np.array([4, 5], dtype=np.int64), DType.INT64).get(
            timeout=WAIT) is None
        # rank 1's route is set up after the message may have come
        boxes = [run(c, Kind.BARRIER, Op.SUM, DType.UINT8, 0, b"") for c in clients]
        assert all(b.get(timeout=WAIT)[1] is None for b in boxes)
        route1 = ServiceRoute(clients[1], Mailbox(1, 2))
        got = route1.mailbox.receive(0, 3, WAIT)
        assert values(got, np.int64) == [4, 5]
    finally:
        for c in clients:
            c.close()
        service.stop()


@pytest.mark.parametrize("dst", [0, 7])
def test_a_send_to_itself_or_no_rank_fails_the_group_naming_the_sender(dst):
    service, clients, ends, rs = routes(3)
    try:
        waiting = Box()
        rs[2].mailbox.post(1, 0, waiting)
        req = CollectiveRequest(seq=1, kind=int(Kind.SEND), op=0, dtype=int(DType.UINT8),
                                root=dst, count=1, data=np.ones(1, dtype=np.uint8))
        clients[0].submit_send(req, lambda error: None)
        message, error = waiting.take()
        assert isinstance(error, CollectiveAborted) and error.rank == 0, error
        assert f"rank 0 sent a point-to-point message to rank {dst}: not another rank of 3" \
            in str(error)
        assert service.failure is not None and service.failure.rank == 0
    finally:
        for c in clients:
            c.close()
        service.stop()


def test_a_rank_that_leaves_fails_the_receives_waiting_for_it():
    service, clients, ends, rs = routes(3)
    try:
        assert send(rs[1], 2, 0, np.array([1.0], dtype=np.float32)).get(timeout=WAIT) is None
        waiting = Box()
        rs[2].mailbox.post(1, 1, waiting)
        ends[1][1].close()  # rank 1's connection ends
        message, error = waiting.take()
        assert isinstance(error, CollectiveAborted) and error.rank == 1, error
        # what rank 1 sent before it left is still there
        assert values(rs[2].mailbox.receive(1, 0, WAIT)) == [1.0]
        assert service.failure is None  # leaving is no failure of the group
    finally:
        for c in clients:
            c.close()
        service.stop()


# ---- direct links ----

def linked_pair(**kw):
    with socket.create_server(("127.0.0.1", 0)) as listener:
        a = socket.create_connection(listener.getsockname(), timeout=WAIT)
        b, _ = listener.accept()
    chans = []
    for sock, peer in ((a, 1), (b, 0)):
        sock.setblocking(False)
        chans.append(Channel(sock, timeout=WAIT, lost=WorkerLost, peer_id=peer,
                             peer_name=f"rank {peer} (test link)"))
    boxes = [Mailbox(0, 2), Mailbox(1, 2)]
    links = [PeerLinks([None, chans[0]], 0, boxes[0], WAIT, **kw),
             PeerLinks([chans[1], None], 1, boxes[1], WAIT, **kw)]
    return links, boxes


def test_direct_links_carry_messages_both_ways_in_order():
    links, boxes = linked_pair(heartbeat=0.05, silence=WAIT)
    try:
        done = queue.Queue()
        for v in range(3):
            links[0].send(1, 2, DType.INT64, np.array([v, -v], dtype=np.int64).view(np.uint8),
                          done.put)
        links[1].send(0, 2, DType.FLOAT32, np.array([0.5], dtype=np.float32).view(np.uint8),
                      done.put)
        assert [done.get(timeout=WAIT) for _ in range(4)] == [None] * 4
        assert [values(boxes[1].receive(0, 2, WAIT), np.int64) for _ in range(3)] == \
            [[0, 0], [1, -1], [2, -2]]
        assert values(boxes[0].receive(1, 2, WAIT)) == [0.5]
        with pytest.raises(ValueError, match="this rank"):
            links[0].send(0, 0, DType.UINT8, np.zeros(1, dtype=np.uint8), done.put)
    finally:
        for link in links:
            link.close(WAIT)


def test_closing_a_link_fails_the_peers_receives_and_its_own():
    links, boxes = linked_pair()
    peer_waits, own_waits = Box(), Box()
    boxes[1].post(0, 0, peer_waits)
    boxes[0].post(1, 0, own_waits)
    links[0].close(WAIT)
    message, error = peer_waits.take()
    assert isinstance(error, CollectiveAborted) and error.rank == 0, error
    assert isinstance(own_waits.take()[1], CollectiveAborted)
    done = threading.Event()
    errors = []
    links[1].send(0, 0, DType.UINT8, np.zeros(1, dtype=np.uint8),
                  lambda e: (errors.append(e), done.set()))
    assert done.wait(WAIT) and isinstance(errors[0], CollectiveAborted)
    links[1].close(WAIT)


def test_mismatch_error_is_a_value_error_naming_ranks_and_tag():
    error = PointToPointMismatch("x", src=1, dst=2, tag=3)
    assert isinstance(error, ValueError) and (error.src, error.dst, error.tag) == (1, 2, 3)


def test_a_message_over_one_frame_is_refused_before_it_is_sent():
    from ddpwire.plane.p2p import MAX_MESSAGE_BYTES, check_size

    check_size(MAX_MESSAGE_BYTES, "send")
    with pytest.raises(ValueError, match="send it in parts"):
        check_size(MAX_MESSAGE_BYTES + 1, "send")
