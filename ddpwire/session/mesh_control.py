"""The coordinator's side of the mesh: choosing it, and each step's control.

In a mesh session (:mod:`ddpwire.plane.mesh`) the workers average among
themselves; the coordinator chooses the mesh at the join (MeshPeers),
optionally averages a part of each vector itself over its own link, and
collects every worker's StepReport before the go-ahead (StepCommit) that
lets them apply: a non-finite element or a failed worker halts the step
before any worker applies any of it, and the worker to blame is named.
"""
from __future__ import annotations

import selectors
import time
from typing import AbstractSet, List, Optional, Sequence, Set, Tuple, cast

from ..plane import codecs as _codecs
from ..plane import mesh as _mesh
from ..plane import plan as _plan
from ..plane import shm as _shm
from .admission import Admitted
from ..wire.errors import DdpwireError, GradientMismatch, ProtocolError, WorkerLost
from ..wire.extensions import Extension
from .launch import is_loopback
from ..wire.messages import NO_WORKER, CollectiveError, MeshPeers, StepCommit, StepReport
from .options import CoordinatorOptions
from ..wire.channel import SIDE_MESSAGES
from ..plane.deadlines import accusation_wait
from .results import ReduceResult
from .roster import Roster, log
from .star import FLAT, Star, halting

__all__ = ["MESH_BLAME_GRACE", "MeshControl", "choose_share", "culprit"]

#: How long a mesh step's collect keeps listening, past the point where a
#: worker's heartbeats showed it was lost, for the others' reports (they may
#: name a worker to blame before it), and the window within which a silent
#: worker counts as still heard from when heartbeats are off. Capped at the
#: timeout. The wait for a waiting worker's accusation is
#: :func:`accusation_wait`, not this.
MESH_BLAME_GRACE = 1.0


Part = Tuple[int, Optional[list]]


def choose_share(admitted: Sequence[Admitted], hosts: Sequence[Optional[bytes]],
                 setting: object) -> int:
    """MeshPeers.coordinator_share for a mesh over the links, from the
    coordinator's ``coordinator_share`` (a fraction, or "auto")."""
    if setting != "auto":
        return _plan.share_value(setting)  # type: ignore[arg-type]
    here = _shm.host_id()
    for a, host in zip(admitted, hosts):
        if host == here or is_loopback(a.address[0]) or \
                a.address[0] == a.sock.getsockname()[0]:
            log.info("worker %d runs on this host: the mesh takes no coordinator share",
                     a.worker_id)
            return 0
    return _plan.share_value(_mesh.auto_share(len(admitted)))


def culprit(answers: List[object], step: int, silent: AbstractSet[int] = frozenset(),
            alive: AbstractSet[int] = frozenset(), *, final: bool = True) -> Optional[WorkerLost]:
    """The error for a mesh step some worker could not finish, naming
    the worker to blame: the one place that chooses it.

    ``answers[w]`` is worker w's StepReport, its CollectiveError (it is
    alive, and blames the worker it names, or itself), or a WorkerLost:
    it vanished (disconnected, or its heartbeats stopped), or, for w in
    ``silent``, it sent nothing by the deadline; ``alive`` are the silent
    workers still heard from (heartbeats). When one worker fails, those
    linked to it fail too and close their links, so a worker may blame
    one that only gave up after it. The culprit is the first of:

    1. a worker that did not answer and that some CollectiveError blames;
    2. a worker that vanished;
    3. a silent worker not heard from;
    4. a silent worker still heard from;
    5. a blamed worker (every worker answered);

    the lowest-numbered within the first of these that has any. With
    ``final`` False the answers may not be all in: None when the choice
    is not sure yet, that is when it would be one of several silent
    workers (3 or 4), of which a live one may still name another."""
    unanswered = [w for w, a in enumerate(answers) if isinstance(a, WorkerLost)]
    blamed = {w: (w if a.worker_id == NO_WORKER else a.worker_id)
              for w, a in enumerate(answers) if isinstance(a, CollectiveError)}
    named = sorted(set(blamed.values()))
    tiers = [[w for w in named if w in unanswered],
             [w for w in unanswered if w not in silent],
             [w for w in unanswered if w in silent and w not in alive],
             [w for w in unanswered if w in silent and w in alive],
             named]
    rank, tier = next((k, t) for k, t in enumerate(tiers) if t)
    if not final and rank in (2, 3) and len(tier) > 1:
        return None
    chosen = tier[0]
    reporter = next((w for w, b in sorted(blamed.items()) if b == chosen), None)
    if reporter is not None:
        detail = answers[reporter].detail  # type: ignore[union-attr]
        # the worker that left first, then how the one that saw it says so
        return WorkerLost(f"worker {chosen} dropped out of the step (as worker {reporter} saw "
                          f"it: {detail})", worker_id=chosen, step=step)
    exc = answers[chosen]
    assert isinstance(exc, WorkerLost)
    return exc


class MeshControl:
    """The mesh's choice and its steps' control, over ``roster``'s workers.

    ``topology``, ``codec`` (:class:`ddpwire.plane.mesh.Codec`), ``shared_memory``
    and ``coordinator_share`` are the coordinator's; :attr:`on` and
    :attr:`share` are what the join decided.
    """

    def __init__(self, roster: Roster, star: Star, config: CoordinatorOptions):
        self.roster = roster
        self.star = star
        self.topology = config.topology
        self.elastic = config.elastic
        self.codec = _codecs.codec_of(config.compression).code
        self.shared_memory = config.shared_memory
        self.coordinator_share = config.coordinator_share
        #: whether flat steps run on the mesh (decided when the join completes)
        self.on = False
        #: MeshPeers.coordinator_share in effect (65536ths of each vector)
        self.share = 0

    def announce(self, admitted: Sequence[Admitted], *, per_block: bool) -> None:
        """Choose the star or the mesh for flat steps and tell every worker
        that was granted the mesh which (an empty MeshPeers keeps the star);
        with ``per_block`` steps no worker was granted it."""
        if per_block:
            log.info("per-block steps run on the star, through this coordinator")
        else:
            self._tell(admitted)
        if self.codec != _mesh.Codec.FLOAT32 and not self.on:
            log.warning("compression=%r is off: it travels on the mesh only",
                        self.codec.name.lower())

    def _tell(self, admitted: Sequence[Admitted]) -> None:
        addresses: List[Optional[Tuple[str, int]]] = []
        hosts: List[Optional[bytes]] = []
        for a in admitted:
            value = a.granted.get(Extension.MESH) is not None and \
                (a.join.extensions or {}).get(Extension.MESH)
            try:
                addresses.append((a.address[0], _mesh.peer_port(value)) if value else None)
                hosts.append(_mesh.peer_host(value) if value else None)
            except ProtocolError as exc:
                log.warning("worker %d: %s; it takes the star", a.worker_id, exc)
                addresses.append(None)
                hosts.append(None)
        why = {a.worker_id: "did not offer the mesh" for a, addr in zip(admitted, addresses)
               if addr is None}
        if any(a.keys is not None for a in admitted):
            # a worker seals its mesh links when its own link is sealed
            # (the mesh key travels on it): one in the clear cannot link
            for i, a in enumerate(admitted):
                if a.keys is None and addresses[i] is not None:
                    why[a.worker_id] = "has its link in the clear, and the others' are sealed"
                    log.warning("worker %d (%s) takes no part in the mesh: it %s", a.worker_id,
                                a.name(), why[a.worker_id])
                    addresses[i] = None
        outsiders = [a.worker_id for a, addr in zip(admitted, addresses) if addr is None]
        if self.topology == "mesh" and outsiders:
            raise DdpwireError(f"topology 'mesh': worker {outsiders[0]} "
                               f"({admitted[outsiders[0]].join.node_id}) {why[outsiders[0]]}")
        self.on = not outsiders
        if self.on:
            # Shared memory carries float32 only: 16-bit words save wire
            # bytes, and with no wire they would only cost precision.
            shared = (self.shared_memory and len(admitted) > 1 and _shm.enabled()
                      and self.codec == _mesh.Codec.FLOAT32
                      and hosts[0] is not None and all(h == hosts[0] for h in hosts))
            self.share = 0 if shared or self.codec != _mesh.Codec.FLOAT32 else \
                choose_share(admitted, hosts, self.coordinator_share)
            table = MeshPeers(key=_mesh.new_key(), codec=int(self.codec),
                              shared_memory=int(shared), coordinator_share=self.share,
                              peers=_mesh.format_peers(addresses))  # type: ignore[arg-type]
            log.info("flat steps run on the mesh %s (%s%s%s)",
                     f"between the {len(admitted)} workers" if len(admitted) > 1
                     else "of its 1 worker", self.codec.name.lower(),
                     ", in shared memory" if shared else "",
                     f", {self.share / 65536:.1%} through the coordinator" if self.share else "")
        else:
            table = MeshPeers(key=bytes(32), codec=0, shared_memory=0, peers="")
            log.info("flat steps run on the star, through this coordinator: %s",
                     self._why_star(next(a for a in admitted if a.worker_id == outsiders[0])))
        for chan, a in zip(self.roster.channels, admitted):
            if Extension.MESH in a.granted:
                chan.send(table)

    def _why_star(self, outsider: Admitted) -> str:
        # the cause the user chose comes first: an elastic session grants
        # no worker the mesh, and then each is an outsider
        if self.elastic:
            return "an elastic session averages there, so that a lost worker's step can be redone"
        if self.topology == "star":
            return "topology 'star' was chosen"
        return f"worker {outsider.worker_id} ({outsider.name()}) does not take part in a mesh"

    def step(self, step: int, reply: bool) -> ReduceResult:
        """The coordinator's part of a mesh step: its share of the vector,
        every worker's StepReport, and with ``reply`` the go-ahead."""
        part = self._part(step) if self.share else None
        with self.roster.talking(step, mesh=True):
            result = self._reports(step, part)
        if reply:
            self.commit(step, result.global_loss)
        return result

    def commit(self, step: int, global_loss: float) -> None:
        """The go-ahead: every worker exchanges its averaged slice and applies."""
        with self.roster.talking(step, any_error=True, mesh=True):
            self.roster.broadcast(StepCommit(step=step, global_loss=global_loss,
                                             bad_worker=NO_WORKER, bad_index=0, bad_value=0.0),
                                  step)

    def _part(self, step: int) -> Part:
        """This coordinator's part of a mesh step's reduce-scatter: every
        worker's GradientPayload of the vector's last elements, averaged as
        the star averages and streamed back while it arrives. A non-finite
        element does not cut the reply short (the workers hold it until the
        StepCommit, which halts the step). Returns the part's length and,
        when some element was not finite, each worker's first (index in the
        part, value), index -1 for none."""
        # the workers are inside their reduce-scatter: cut short, it is over
        with self.roster.talking(step, any_error=True, mesh=True):
            result, bad = self.star.stream(FLAT, step, None, None, True, pinned=False,
                                           halt=False)
        return len(result.avg_gradients), bad

    def _reports(self, step: int, part: Optional[Part]) -> ReduceResult:
        """Every worker's StepReport for a mesh step: their slices are
        averaged, none applied. A worker that fails the step is named as
        :meth:`_answers` and :func:`culprit` find it, and every connection
        closes. A non-finite element anywhere (``part``: the coordinator's
        own part, from :meth:`_part`) halts the step here: every worker
        hears which, the connections close."""
        roster = self.roster
        t0 = time.perf_counter()
        reports: List[StepReport] = []
        answers, silent, alive = self._answers(step)
        if not all(isinstance(a, StepReport) for a in answers):
            blame = culprit(answers, step, silent, alive)
            assert blame is not None
            raise blame
        for chan, msg in zip(roster.channels, cast(List[StepReport], answers)):
            wid = chan.peer_id
            if msg.step != step:
                raise GradientMismatch("step", step, msg.step, worker_id=wid, step=step)
            if msg.worker_id != wid:
                raise GradientMismatch("worker_id", wid, msg.worker_id, worker_id=wid, step=step)
            want = roster.lengths.get((FLAT, None), reports[0].count if reports else msg.count)
            if msg.count != want:
                raise GradientMismatch("gradients length", want, msg.count, worker_id=wid,
                                       step=step)
            if part is not None and _plan.coordinator_part(msg.count, self.share) != part[0]:
                raise GradientMismatch("coordinator's part length (for its gradients' length)",
                                       _plan.coordinator_part(msg.count, self.share), part[0],
                                       worker_id=wid, step=step)
            reports.append(msg)
        t1 = time.perf_counter()
        bad = [(r.bad_worker, r.bad_index, r.bad_value) for r in reports
               if r.bad_worker != NO_WORKER]
        if part is not None and part[1] is not None:
            start = reports[0].count - part[0]
            bad += [(w, start + index, value) for w, (index, value) in enumerate(part[1])
                    if index >= 0]
        if bad:
            self._halt(step, *min(bad, key=lambda b: (b[0], b[1])))
        roster.lengths.setdefault((FLAT, None), reports[0].count)
        self.star.check_totals(step, [r.total for r in reports])
        result = self.star.result(FLAT, step, None, [], None,  # type: ignore[arg-type]
                                  [(r.loss, r.correct, r.total) for r in reports], t1 - t0)
        result.reduce_time = time.perf_counter() - t1
        return result  # type: ignore[return-value]

    def _halt(self, step: int, bad_worker: int, bad_index: int, bad_value: float) -> None:
        """Tell every worker which element halts the step, and raise it."""
        # even an interrupted halt ends the session: its frames are cut short
        with self.roster.talking(step, any_error=True, mesh=True):
            try:
                self.roster.broadcast(StepCommit(step=step, global_loss=0.0,
                                                 bad_worker=bad_worker, bad_index=bad_index,
                                                 bad_value=bad_value), step)
            except DdpwireError as exc:
                # the halt is the cause; a worker not told hears the close
                log.warning("step %d: the halt did not reach every worker: %s", step, exc)
            raise halting(bad_worker, bad_index, bad_value, step)

    def _answers(self, step: int) -> Tuple[List[object], Set[int], Set[int]]:
        """Every worker's answer to a mesh step, all watched at once: a
        StepReport, a CollectiveError, or the WorkerLost of a worker that
        disconnected, went quiet for ``heartbeat_timeout`` (with heartbeats)
        or sent nothing by the deadline, ``timeout`` from now.

        Returns (answers, silent, alive): ``silent`` the workers that sent
        nothing but heartbeats by the deadline (and its grace), ``alive``
        those of them that were heard (a Heartbeat) within the last
        ``heartbeat_timeout`` (or :data:`MESH_BLAME_GRACE`) before the end.
        When at the deadline the answers do not yet single out a culprit
        (:func:`culprit`), the silent workers are listened to for up to
        :func:`accusation_wait` longer: a live one waiting on a peer
        reports that peer by then."""
        chans = self.roster.channels
        timeout = self.roster.timeout
        what = "waiting for StepReport or CollectiveError"
        start = time.monotonic()
        deadline = start + timeout
        end = deadline
        grace = min(MESH_BLAME_GRACE, timeout)
        hb = self.roster.heartbeat_timeout
        window = hb if hb is not None else grace
        answers: List[object] = [None] * len(chans)
        heard: List[Optional[float]] = [None] * len(chans)  # each one's last frame in this wait
        silent: Set[int] = set()

        def quiet_since(w: int) -> float:
            last = heard[w]
            return start if last is None else last

        def alive(now: float) -> Set[int]:
            return {w for w in silent if heard[w] is not None and now - quiet_since(w) < window}

        def settle(w: int, answer: object) -> None:
            answers[w] = answer
            silent.discard(w)
            sel.unregister(chans[w].conn.sock)

        def sure(now: float) -> bool:
            return culprit(answers, step, silent, alive(now), final=False) is not None

        sel = selectors.DefaultSelector()
        in_grace = False
        try:
            for w, chan in enumerate(chans):
                if chan.conn.fileno() < 0:
                    answers[w] = WorkerLost(f"{chan.conn.peer_name} connection is closed",
                                            worker_id=chan.peer_id, step=step)
                else:
                    sel.register(chan.conn.sock, selectors.EVENT_READ, w)
            while sel.get_map():
                now = time.monotonic()
                if now >= end:
                    if in_grace:
                        break
                    for key in sel.get_map().values():
                        w, chan = key.data, chans[key.data]
                        silent.add(w)
                        answers[w] = WorkerLost(
                            f"{chan.conn.peer_name} silent (heartbeats aside) past the deadline "
                            f"({timeout:g} s) while {what}", worker_id=chan.peer_id, step=step)
                    if sure(now):
                        break
                    in_grace, end = True, deadline + accusation_wait(timeout)
                    continue
                # wake at the end, or when a quiet worker reaches its heartbeat limit
                wake = end
                for key in sel.get_map().values():
                    limit = chans[key.data].heartbeat_timeout
                    if limit is not None:
                        wake = min(wake, quiet_since(key.data) + limit)
                for key, _ in sel.select(max(0.0, wake - now)):
                    w = key.data
                    try:
                        msg = chans[w].read_frame([StepReport, CollectiveError], step=step,
                                                  what=what, deadline=end)
                    except WorkerLost as exc:
                        settle(w, exc)
                        continue
                    heard[w] = time.monotonic()
                    if not isinstance(msg, SIDE_MESSAGES):
                        settle(w, msg)
                        if isinstance(msg, StepReport) and self.roster.shards is not None:
                            self.roster.shards.reported(chans[w].peer_id, msg.step,
                                                        time.perf_counter())
                now = time.monotonic()
                for key in list(sel.get_map().values()):
                    w, chan = key.data, chans[key.data]
                    limit = chan.heartbeat_timeout
                    if limit is not None and now - quiet_since(w) >= limit:
                        settle(w, WorkerLost(f"{chan.conn.peer_name} silent for {limit:g} s while "
                                             f"{what}", worker_id=chan.peer_id, step=step))
                        # the step cannot end well: the live workers, waiting
                        # on this one as long as the timeout, get the grace
                        # to report, not the rest of the timeout
                        end = min(end, now + grace)
                # in the grace, stop as soon as the answers single out the culprit
                if in_grace and sure(now):
                    break
        finally:
            sel.close()
        return answers, silent, alive(time.monotonic())
