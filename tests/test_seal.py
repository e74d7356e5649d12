"""Sealed links (ddpwire/wire/seal.py, csrc/link.c, csrc/sealed.c), with real
sockets: every byte after the join in AES-256-GCM records, the same bits
as in the clear, and a record altered, dropped, replayed, reordered or
injected on the way raising IntegrityError naming the peer and the step,
with no worker applying that step."""
from __future__ import annotations

import logging
import os
import socket
import subprocess
import sys
import threading

import numpy as np
import pytest

import ddpwire
from ddpwire import Coordinator, IntegrityError, Worker, WorkerLost, _core
from ddpwire.wire import seal
from ddpwire.wire.errors import CoordinatorLost, OptionError, PeerLost
from ddpwire.wire.extensions import Extension, RefusalReason
from ddpwire.wire.messages import AuthProof, JoinAccepted, PeerHello

from relay import ALL, DOWN, FULL, UP, Relay, Tamper
from session_helpers import spawn

ADDR = ("127.0.0.1", 0)
TOKEN = "a token for the sealed tests"
N = 300_000  # elements of a step's gradient: several full records


@pytest.fixture(scope="module", autouse=True)
def libcrypto():
    seal.load_libcrypto()


def _pair():
    """Two connected Connections, non-blocking, over loopback TCP."""
    with socket.create_server(ADDR) as lsock:
        a = socket.create_connection(lsock.getsockname())
        b, _ = lsock.accept()
    for s in (a, b):
        s.setblocking(False)
    return _core.Connection(a, peer_name="a"), _core.Connection(b, peer_name="b")


def _sealed_pair():
    a, b = _pair()
    k1, k2 = os.urandom(32), os.urandom(32)
    a.seal(k1, k2)
    b.seal(k2, k1)
    return a, b


# ---- the link ----

@pytest.mark.parametrize("size", [1, 4095, FULL - 1, FULL, FULL + 1, 3 * FULL + 17, 3_000_000])
def test_any_size_arrives_whole_through_records(size):
    a, b = _sealed_pair()
    data = np.random.default_rng(size).integers(0, 256, size, dtype=np.uint8)
    t = spawn(lambda: a.send_parts([b"head", data, b"tail"], 10))
    got = bytearray(size + 8)
    # in pieces that cut records anywhere: what a record holds past a
    # receive is kept for the next
    cut = sorted({min(x, size + 8) for x in (0, 3, 7, size // 3 + 5, size + 8)})
    for lo, hi in zip(cut, cut[1:]):
        b.recv_into(memoryview(got)[lo:hi], 10)
    t.join_result()
    assert bytes(got) == b"head" + data.tobytes() + b"tail"
    assert b.held() == 0
    a.close(), b.close()


def test_a_frame_head_is_read_from_a_record_and_its_elements_after_it():
    """read_frame_head peeks at the opened record and takes exactly the head:
    the elements stay held for the receive that follows."""
    a, b = _sealed_pair()
    grads = np.arange(50_000, dtype=np.float32)
    msg = ddpwire.GradientPayload(step=3, worker_id=1, gradients=grads, loss=0.5, correct=1,
                                  total=2)
    t = spawn(lambda: a.send_parts(ddpwire.encode_frame_parts(msg), 10))
    head = _core.read_frame_head(b, 10, 1 << 30)
    assert head.step == 3 and head.gradient_count == len(grads)
    assert b.held() > 0  # the rest of the first record
    out = np.empty_like(grads)
    b.recv_into(out, 10)
    b.recv_into(bytearray(head.tail_len), 10)
    t.join_result()
    assert np.array_equal(out, grads)
    a.close(), b.close()


def test_the_streaming_average_gives_the_same_bits_sealed_as_in_the_clear():
    rng = np.random.default_rng(1)
    vectors = [rng.standard_normal(N).astype(np.float32) for _ in range(3)]
    results = {}
    for sealed in (False, True):
        for threads in (False, True):
            pairs = [_sealed_pair() if sealed else _pair() for _ in vectors]
            senders = [spawn(lambda p=p, v=v: p[0].send_parts([v, b"tl"], 10))
                       for p, v in zip(pairs, vectors)]
            out = np.empty(N, np.float32)
            tails, bad = _core.reduce_stream([p[1] for p in pairs], out, 2, 10,
                                             socket_threads=threads)
            for s in senders:
                s.join_result()
            assert bad is None and tails == [b"tl"] * 3
            results[sealed, threads] = out
    for key, out in results.items():
        assert np.array_equal(out.view(np.uint32), results[False, False].view(np.uint32)), key


def test_a_broadcast_and_an_exchange_go_sealed():
    a, b = _sealed_pair()
    c, d = _sealed_pair()
    payload = np.arange(200_000, dtype=np.float32)
    _core.send_many([a, c], [b"x", payload], 10)
    for conn in (b, d):
        got = bytearray(1 + payload.nbytes)
        conn.recv_into(got, 10)
        assert bytes(got) == b"x" + payload.tobytes()
    # both ends send a large frame before reading: the exchange never deadlocks
    ex = _core.Exchange(a, [payload], 10)
    other = spawn(lambda: _core.Exchange(b, [payload * 2], 10, send_thread=True))
    out = np.empty_like(payload)
    ex.recv_into(out)
    ex.finish()
    exb = other.join_result()
    back = np.empty_like(payload)
    exb.recv_into(back)
    exb.finish()
    assert np.array_equal(out, payload * 2) and np.array_equal(back, payload)
    for conn in (a, b, c, d):
        conn.close()


def test_records_are_aes_256_gcm_as_docs_extensions_md_writes_them():
    """The bytes on the wire, against another AES-GCM (the cryptography
    package's): u32 LE length, ciphertext and tag, the nonce 4 zero bytes
    and the record's number (u64 LE), the length as additional data."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    sealed, plain = _pair()
    key = bytes(range(32))
    sealed.seal(key, os.urandom(32))
    first, second = b"ddpwire", bytes(range(256)) * 300  # the second spans two records
    sealed.send_parts([first], 10)
    sealed.send_parts([second], 10)
    wire = bytearray(len(first) + len(second) + 3 * (4 + 16))
    plain.recv_into(wire, 10)
    records = []
    for number, text in enumerate([first, second[:FULL], second[FULL:]]):
        head = len(text).to_bytes(4, "little")
        nonce = bytes(4) + number.to_bytes(8, "little")
        records.append(head + AESGCM(key).encrypt(nonce, text, head))
    assert bytes(wire) == b"".join(records)
    sealed.close(), plain.close()


@pytest.mark.parametrize("length", [0, FULL + 1, 0xFFFFFFFF])
def test_a_record_length_out_of_bounds_is_refused_before_anything_is_read(length):
    plain, sealed = _pair()
    sealed.seal(os.urandom(32), os.urandom(32))
    plain.send_parts([length.to_bytes(4, "little") + bytes(64)], 10)
    with pytest.raises(IntegrityError, match="failed authentication"):
        sealed.recv_into(bytearray(8), 10)
    # the first failure stays: the link is dead either way
    with pytest.raises(IntegrityError):
        sealed.recv_into(bytearray(8), 10)
    plain.close(), sealed.close()


def test_integrity_errors_are_the_peers_own_lost_error():
    cls = ddpwire.wire.errors.integrity_error(WorkerLost)
    assert issubclass(cls, IntegrityError) and issubclass(cls, WorkerLost)
    assert ddpwire.wire.errors.integrity_error(WorkerLost) is cls
    assert issubclass(ddpwire.wire.errors.integrity_error(CoordinatorLost), CoordinatorLost)


def test_keys_are_checked_before_a_link_is_sealed():
    a, b = _pair()
    with pytest.raises(ValueError, match="32 bytes"):
        a.seal(b"short", os.urandom(32))
    assert not a.sealed
    a.close(), b.close()


def test_a_missing_libcrypto_says_what_to_do():
    code = ("import ddpwire.wire.seal as s\n"
            "try:\n s.load_libcrypto()\nexcept Exception as e:\n print(type(e).__name__, e)\n")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env=dict(os.environ, DDPWIRE_LIBCRYPTO="/nonexistent/libcrypto.so"),
                         timeout=60)
    assert out.stdout.startswith("EncryptionUnavailable"), out
    assert "/nonexistent/libcrypto.so" in out.stdout and "--encrypt off" in out.stdout


def test_the_environment_turns_encryption_off_or_is_refused():
    assert seal.encrypt_from_env({}) is True
    assert seal.encrypt_from_env({seal.ENCRYPT_ENV: "off"}) is False
    with pytest.raises(ValueError, match="DDPWIRE_ENCRYPT"):
        seal.encrypt_from_env({seal.ENCRYPT_ENV: "maybe"})


def test_a_low_order_key_share_is_refused():
    share = seal.KeyShare()
    with pytest.raises(ddpwire.ProtocolError, match="low order"):
        share.secret(bytes(32))


# ---- sessions ----

def _session_step(coord, workers, step=0, n=N):
    """One flat step on every worker (gradient w+1 everywhere) and the
    coordinator: each worker's outcome (its average or its exception), and
    the coordinator's."""
    coord.send_shard_assignments(step)
    runs = [spawn(lambda w=w: (w.receive_shard(),
                               w.allreduce(step, np.full(n, w.worker_id + 1.25, np.float32),
                                           1.0, 1, 2)))
            for w in workers]
    try:
        mine = coord.allreduce(step)
    except BaseException as exc:  # handed to the test
        mine = exc
        # as a program's ``with`` block would on the way out: a star
        # connection stays open for a Shutdown until then (docs/sessions.md)
        coord.close()
    outs = []
    for r in runs:
        try:
            outs.append(r.join_result()[1])
        except BaseException as exc:
            outs.append(exc)
    return outs, mine


def _join(coord, relay_for=None, **kw):
    """Two workers with the token; worker 0 through a relay when
    ``relay_for`` (the relay's arguments) is given."""
    relay = None
    addr0 = coord.local_addr
    if relay_for is not None:
        clear = {UP: AuthProof.TAG, DOWN: JoinAccepted.TAG} if kw.get("encrypt", True) \
            else {UP: ALL, DOWN: ALL}
        relay = Relay(coord.local_addr, clear, **relay_for)
        addr0 = relay.addr
    join = spawn(coord.wait_for_workers)
    # one after the other: the one behind the relay is worker 0
    w0 = Worker.connect(addr0, node_id="w0", timeout=15, token=TOKEN, **kw)
    w1 = Worker.connect(coord.local_addr, node_id="w1", timeout=15, token=TOKEN, **kw)
    join.join_result()
    return [w0, w1], relay


def test_a_session_with_a_token_is_sealed_and_gives_the_same_bits():
    results = {}
    for encrypt in (True, False):
        with Coordinator(ADDR, expect_workers=2, token=TOKEN, topology="star",
                         encrypt=encrypt) as coord:
            workers, _ = _join(coord, encrypt=encrypt)
            assert all(w.channel.conn.sealed is encrypt for w in workers)
            assert all((Extension.SEAL in w.extensions) is encrypt for w in workers)
            coord.set_total_samples(4)
            outs, mine = _session_step(coord, workers)
            results[encrypt] = mine.avg_gradients
            for w in workers:
                w.close()
    assert np.array_equal(results[True], results[False])


def test_a_capture_of_a_sealed_step_holds_none_of_its_values():
    """The bytes a relay forwards during a step: in the clear they hold the
    gradients and the average (the check can fail), sealed none of them."""
    marks = {}
    for encrypt in (False, True):
        with Coordinator(ADDR, expect_workers=2, token=TOKEN, topology="star",
                         encrypt=encrypt) as coord:
            workers, relay = _join(coord, relay_for={}, encrypt=encrypt)
            coord.set_total_samples(4)
            outs, mine = _session_step(coord, workers)
            assert not isinstance(mine, BaseException), mine
            for w in workers:
                w.close()
        captured = bytes(relay.captured[UP]) + bytes(relay.captured[DOWN])
        relay.close()
        # worker 0's gradient (1.25 everywhere) and the average (1.75), two in a row
        marks[encrypt] = [captured.count(np.full(2, v, np.float32).tobytes()) for v in (1.25, 1.75)]
    assert min(marks[False]) > 1000
    assert marks[True] == [0, 0]


@pytest.mark.parametrize("action", ["flip", "drop", "replay", "reorder", "inject"])
def test_a_record_tampered_on_the_way_to_the_coordinator_stops_the_step(action):
    with Coordinator(ADDR, expect_workers=2, token=TOKEN, topology="star", timeout=15) as coord:
        tamper = Tamper(action, UP)
        workers, relay = _join(coord, relay_for={"tamper": tamper})
        coord.set_total_samples(4)
        outs, mine = _session_step(coord, workers, step=0)
        assert tamper.done.is_set()
        assert isinstance(mine, IntegrityError) and isinstance(mine, WorkerLost), mine
        assert mine.worker_id == 0 and mine.step == 0, mine
        assert "worker 0" in str(mine) and "failed authentication" in str(mine)
        # no worker applies the step: none gets an average
        assert all(isinstance(o, PeerLost) for o in outs), outs
        for w in workers:
            w.close()
        relay.close()


def test_a_record_tampered_on_the_way_to_a_worker_is_named_there():
    with Coordinator(ADDR, expect_workers=2, token=TOKEN, topology="star", timeout=15) as coord:
        tamper = Tamper("flip", DOWN)
        workers, relay = _join(coord, relay_for={"tamper": tamper})
        coord.set_total_samples(4)
        outs, mine = _session_step(coord, workers, step=0)
        assert tamper.done.is_set()
        assert isinstance(outs[0], IntegrityError) and isinstance(outs[0], CoordinatorLost)
        assert outs[0].step == 0 and "coordinator" in str(outs[0])
        for w in workers:
            w.close()
        relay.close()


def test_require_encryption_refuses_a_worker_in_the_clear(caplog):
    with Coordinator(ADDR, expect_workers=1, token=TOKEN, require_encryption=True,
                     join_timeout=15) as coord:
        join = spawn(coord.wait_for_workers)
        with pytest.raises(ddpwire.JoinRefusedError, match="requires encryption") as info:
            Worker.connect(coord.local_addr, timeout=10, token=TOKEN, encrypt=False)
        assert info.value.reason == RefusalReason.MISMATCH
        good = Worker.connect(coord.local_addr, timeout=10, token=TOKEN)
        assert good.channel.conn.sealed
        join.join_result()
        good.close()
    with pytest.raises(OptionError, match="require_encryption"):
        Coordinator(ADDR, require_encryption=True)


def test_a_worker_in_the_clear_beside_sealed_ones_is_said_once(caplog):
    with caplog.at_level(logging.WARNING, logger="ddpwire"):
        with Coordinator(ADDR, expect_workers=1, token=TOKEN, join_timeout=15) as coord:
            join = spawn(coord.wait_for_workers)
            w = Worker.connect(coord.local_addr, timeout=10, token=TOKEN, encrypt=False)
            join.join_result()
            assert not w.channel.conn.sealed
            w.close()
    said = [r.getMessage() for r in caplog.records if "in the clear" in r.getMessage()]
    assert len(said) == 1 and "worker 0" in said[0], said


def test_taking_the_seal_offer_out_on_the_way_fails_the_proofs():
    """A relay that strips the worker's offer would leave the session in the
    clear: the proofs cover the offer, so the worker refuses the coordinator."""
    from ddpwire.wire import auth
    token = TOKEN.encode()
    share = seal.KeyShare()
    w, c = os.urandom(32), os.urandom(32)
    stripped = auth.coordinator_proof(token, w, c)  # what it proves for a request without it
    assert not auth.proof_matches(auth.coordinator_proof(token, w, c, share.public), stripped)


# ---- links between workers ----

def _relayed_peers(monkeypatch, module, tamper, relays):
    """Route the link worker (rank) 0 dials to 1 through a relay: its
    PeerHellos in the clear, then sealed records."""
    from ddpwire.plane import mesh as _mesh
    real = _mesh.parse_peers

    def parse(text, world):
        peers = real(text, world)
        if not relays:
            relays.append(Relay(peers[1], {UP: PeerHello.TAG, DOWN: PeerHello.TAG},
                                tamper=tamper))
        return [relays[0].addr if j == 1 else p for j, p in enumerate(peers)]
    monkeypatch.setattr(module, "parse_peers", parse)


@pytest.mark.parametrize("action", ["flip", "drop", "replay", "reorder", "inject"])
def test_the_mesh_links_are_sealed_and_a_tampered_slice_is_named(monkeypatch, action):
    from ddpwire.plane import mesh as _mesh
    relays: list = []
    tamper = Tamper(action, UP)
    _relayed_peers(monkeypatch, _mesh, tamper, relays)
    with Coordinator(ADDR, expect_workers=2, token=TOKEN, topology="mesh", shared_memory=False,
                     timeout=15) as coord:
        workers, _ = _join(coord)
        coord.set_total_samples(4)
        outs, mine = _session_step(coord, workers, step=0)
        assert tamper.done.is_set() and relays[0].records[UP] > 0
        # worker 1 reads worker 0's slice through the relay: it names worker 0
        assert isinstance(outs[1], IntegrityError), outs
        assert outs[1].worker_id == 0 and outs[1].step == 0, outs[1]
        assert "mesh link" in str(outs[1])
        # no worker applies the step, and the coordinator never lets it go on
        assert all(isinstance(o, BaseException) for o in outs), outs
        assert isinstance(mine, BaseException), mine
        for w in workers:
            w.close()
    relays[0].close()


def test_the_mesh_links_carry_none_of_the_values_sealed(monkeypatch):
    from ddpwire.plane import mesh as _mesh
    relays: list = []
    _relayed_peers(monkeypatch, _mesh, None, relays)
    with Coordinator(ADDR, expect_workers=2, token=TOKEN, topology="mesh", shared_memory=False,
                     timeout=15) as coord:
        workers, _ = _join(coord)
        assert all(link.conn.sealed for w in workers for link in [w.channel])
        coord.set_total_samples(4)
        outs, mine = _session_step(coord, workers, step=0)
        assert not isinstance(mine, BaseException), mine
        assert np.array_equal(outs[0].gradients, np.full(N, 1.75, np.float32))
        for w in workers:
            w.close()
    captured = bytes(relays[0].captured[UP]) + bytes(relays[0].captured[DOWN])
    assert relays[0].records[UP] > 4 and relays[0].records[DOWN] > 4
    for v in (1.25, 2.25, 1.75):
        assert captured.count(np.full(2, v, np.float32).tobytes()) == 0
    relays[0].close()


@pytest.mark.parametrize("action", ["flip", "drop", "replay", "reorder", "inject"])
def test_the_rank_links_are_sealed_and_a_tampered_bucket_is_named(monkeypatch, action):
    pytest.importorskip("torch")
    from ddpwire.plane.collectives import Op
    from ddpwire.plane import rank_links as _links
    from rank_group import form_all, loopback

    relays: list = []
    tamper = Tamper(action, UP)
    _relayed_peers(monkeypatch, _links._mesh, tamper, relays)
    ranks = form_all(3, lambda r: dict(loopback(r), sealed=True))
    assert all(isinstance(r, _links.RankLinks) for r in ranks), ranks
    n = 600_000
    bufs = [np.full(n, r + 0.5, np.float32) for r in range(3)]
    errors: list = [None] * 3

    def run(r):
        try:
            ranks[r].allreduce(bufs[r], Op.SUM)
        except BaseException as exc:  # handed to the test
            errors[r] = exc
    threads = [threading.Thread(target=run, args=(r,), daemon=True) for r in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert tamper.done.is_set()
    # rank 1 receives rank 0's slice through the relay: it names rank 0
    assert isinstance(errors[1], IntegrityError), errors
    assert errors[1].rank == 0 and errors[1].seq == 0, errors[1]
    assert all(e is not None for e in errors), errors  # no rank has the sum
    for r in ranks:
        r.close()
    relays[0].close()


def test_ranks_that_disagree_on_sealing_keep_to_the_service(caplog):
    pytest.importorskip("torch")
    from rank_group import form_all, loopback

    with caplog.at_level(logging.WARNING, logger="ddpwire.torch.links"):
        got = form_all(3, lambda r: dict(loopback(r), sealed=r != 2))
    assert got == [None, None, None]
    assert "in the clear" in caplog.text


# ---- the state hand-over of an elastic session ----

def _relayed(make_body, tamper, relays):
    """``make_body(addr)`` run against a relay in front of ``addr``."""
    def make(addr):
        relay = Relay(addr, {UP: AuthProof.TAG, DOWN: JoinAccepted.TAG}, tamper=tamper)
        relays.append(relay)
        return make_body(relay.addr)
    return make


def _small_state(monkeypatch):
    """The hand-over tests' state at 1 MiB (16 records), not 16: what is
    tested is the records, and a sanitizer's slowness stays inside the
    session's 6 s timeout."""
    import test_elastic_handover as eh
    monkeypatch.setattr(eh, "STATE", bytes(range(256)) * 4096)
    return eh


def test_a_state_tampered_on_the_way_to_the_joiner_fails_the_joiner_alone(monkeypatch):
    eh = _small_state(monkeypatch)
    relays: list = []
    tamper = Tamper("drop", DOWN)

    def joiner(addr):
        def body():
            w = Worker.connect(addr, 0, "cpu", timeout=eh.TIMEOUT, samples_per_step=eh.T,
                               token=TOKEN)
            try:
                return w.receive_state()
            except BaseException as exc:  # handed to the test
                return exc
            finally:
                w.close()
        return body
    steps = 12
    sealed = lambda a: eh.session_worker(a, token=TOKEN)  # noqa: E731
    coord, result, outs, _ = eh.run(
        [sealed, sealed, lambda a: eh.session_worker(a, leave_at=1, token=TOKEN)], steps,
        eh.joins_at(1, _relayed(joiner, tamper, relays)), token=TOKEN)
    assert tamper.done.is_set()
    assert isinstance(result, list), result  # the run went on to its end
    eh.check_survivors(outs, [0, 1], steps)
    assert isinstance(outs[3], IntegrityError) and isinstance(outs[3], CoordinatorLost), outs[3]
    # the joiner is turned away while its state still goes out, or, when
    # the coordinator had sent it all, leaves at the next step: never in
    events = [(e.worker_id, e.joined) for e in coord.membership]
    assert events[0] == (2, False) and events[-1] == (2, False), events
    eh.check_every_sample_once(coord, steps)
    for r in relays:
        r.close()


def test_a_state_tampered_on_its_way_from_the_source_drops_the_source_not_the_joiner(monkeypatch):
    eh = _small_state(monkeypatch)
    relays: list = []
    tamper = Tamper("flip", UP)  # the source's first full record: a piece of its state
    steps = 12

    def late(addr):
        def body():
            for attempt in range(3):
                w = Worker.connect(addr, 0, "cpu", timeout=eh.TIMEOUT, samples_per_step=eh.T,
                                   token=TOKEN)
                try:
                    got = w.receive_state()
                except ddpwire.WorkerDropped:
                    w.close()
                    continue
                try:
                    out = eh.train(w, eh.N, None, None)
                    out["joined_with"] = got
                    return out
                finally:
                    w.close()
            raise AssertionError("turned away three times")
        return body
    coord, result, outs, _ = eh.run(
        [_relayed(lambda a: eh.session_worker(a, token=TOKEN), tamper, relays),
         lambda a: eh.session_worker(a, token=TOKEN),
         lambda a: eh.session_worker(a, leave_at=1, token=TOKEN)],
        steps, eh.joins_at(1, late), token=TOKEN)
    assert tamper.done.is_set()
    assert isinstance(result, list), result
    at = outs[3]["joined_with"][0]
    assert outs[3]["joined_with"] == (at, eh.state_of(at))  # worker 1's, whole
    eh.check_survivors(outs, [1], steps)
    assert (0, False) in [(e.worker_id, e.joined) for e in coord.membership]
    for r in relays:
        r.close()


def test_a_worker_in_the_clear_keeps_a_sealed_session_off_the_mesh(caplog):
    """Its mesh links could not be sealed (the mesh key would reach it in
    the clear): the flat steps take the star, and say why; topology "mesh"
    refuses such a session."""
    with caplog.at_level(logging.INFO, logger="ddpwire"):
        with Coordinator(ADDR, expect_workers=2, token=TOKEN, shared_memory=False,
                         timeout=15) as coord:
            join = spawn(coord.wait_for_workers)
            sealed = Worker.connect(coord.local_addr, node_id="w0", timeout=15, token=TOKEN)
            clear = Worker.connect(coord.local_addr, node_id="w1", timeout=15, token=TOKEN,
                                   encrypt=False)
            join.join_result()
            assert not coord.mesh
            coord.set_total_samples(4)
            outs, mine = _session_step(coord, [sealed, clear], n=1000)
            assert not isinstance(mine, BaseException), mine
            assert np.array_equal(outs[0].gradients, np.full(1000, 1.75, np.float32))
            for w in (sealed, clear):
                w.close()
    assert "its link in the clear, and the others' are sealed" in caplog.text
