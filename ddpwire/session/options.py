"""The options both sides of a session take alike, checked once.

A :class:`~ddpwire.Coordinator` and :meth:`~ddpwire.Worker.connect` share
these (gloo keeps its ``AllreduceOptions`` the same way): build one
:class:`SessionOptions` and hand it to both, or keep passing the keywords,
which are turned into one here. Either way every value is checked in one
place, and the heartbeat timeout's default is computed in one place.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any, Dict, Mapping, Optional, Tuple, Union

from ..plane import incast as _incast
from ..plane import codecs as _codecs
from ..plane import plan as _plan
from ..wire.auth import normalize_token
from ..wire.channel import DEFAULT_MAX_FRAME, check_timeout, heartbeat_limit
from ..wire.errors import OptionError
from ..wire.extensions import Extension, decode_u64

__all__ = ["CoordinatorOptions", "SessionOptions", "UNSET", "options_from"]


class _Unset:
    """A keyword the caller did not pass (so ``options=`` may be used)."""

    def __repr__(self) -> str:
        return "UNSET"


#: the default of every shared keyword of Coordinator and Worker.connect
UNSET: Any = _Unset()


@dataclass(frozen=True)
class SessionOptions:
    """Options of one session, the same on the coordinator and its workers.

    ``timeout`` bounds every wait on the peer (seconds); ``heartbeat``
    (seconds, None: off) sends Heartbeat frames at that interval on an idle
    connection (leave it off beside a reference peer, which does not speak
    them) and ``heartbeat_timeout`` (default: a few missed heartbeats,
    :func:`ddpwire.wire.channel.heartbeat_limit`) is the silence after which the
    peer is lost. ``max_frame`` bounds one frame's bytes. ``socket_threads``
    streams a step from a sending and a receiving thread per connection
    (None: for a megabyte or more where there are cores for them); the bits
    are the same either way. ``token`` (str or bytes) authenticates both
    ways (docs/security.md); with a token, ``encrypt`` (on unless turned
    off) seals every frame after the join in AES-256-GCM records, under
    keys from an X25519 exchange bound to the token
    (:mod:`ddpwire.wire.seal`). ``samples_per_step``, ``per_block`` and
    ``gradient_length`` describe the training, so that a worker set up for
    another is refused at the join (where one is None on the coordinator,
    the first worker's sets it). Frozen: checked values stay checked.
    """

    timeout: float = 120.0
    heartbeat: Optional[float] = None
    heartbeat_timeout: Optional[float] = None
    max_frame: int = DEFAULT_MAX_FRAME
    socket_threads: Optional[bool] = None
    token: Union[str, bytes, None] = None
    encrypt: bool = True
    samples_per_step: Optional[int] = None
    per_block: Optional[bool] = None
    gradient_length: Optional[int] = None

    def __post_init__(self) -> None:
        put = object.__setattr__  # frozen: the checked values replace the given ones
        put(self, "timeout", check_timeout("timeout", self.timeout))
        heartbeat = None if self.heartbeat is None else check_timeout("heartbeat", self.heartbeat)
        put(self, "heartbeat", heartbeat)
        put(self, "heartbeat_timeout", heartbeat_limit(heartbeat, self.heartbeat_timeout))
        if not isinstance(self.max_frame, int) or self.max_frame < 1:
            raise ValueError(f"max_frame must be a positive number of bytes, got {self.max_frame!r}")
        put(self, "token", normalize_token(self.token))
        if not isinstance(self.encrypt, bool):
            raise ValueError(f"encrypt must be True or False, got {self.encrypt!r}")
        if self.samples_per_step is not None and self.samples_per_step < 0:
            raise OptionError(f"{{samples_per_step}} must be >= 0, got {self.samples_per_step}",
                              samples_per_step=None)
        if self.gradient_length is not None and self.gradient_length < 1:
            raise ValueError(f"gradient_length must be at least 1, got {self.gradient_length}")

    def replace(self, **changes: Any) -> "SessionOptions":
        """A copy with ``changes``, checked again."""
        return dataclasses.replace(self, **changes)


_FIELDS = tuple(f.name for f in dataclasses.fields(SessionOptions))


def options_from(options: Optional[SessionOptions], keywords: Dict[str, Any]) -> SessionOptions:
    """``options``, or the shared keywords a caller passed (those not
    :data:`UNSET`) made into one; passing both is a TypeError, since one
    of them would be silently ignored."""
    given = {k: v for k, v in keywords.items() if v is not UNSET}
    unknown = set(given) - set(_FIELDS)
    if unknown:
        raise TypeError(f"not session options: {', '.join(sorted(unknown))}")
    if options is None:
        return SessionOptions(**given)
    if not isinstance(options, SessionOptions):
        raise TypeError(f"options must be a SessionOptions, got {type(options).__name__}")
    if given:
        raise TypeError(f"pass either options= or {', '.join(sorted(given))}, not both "
                        f"(options.replace({next(iter(sorted(given)))}=...) changes one)")
    return options


@dataclass(frozen=True)
class CoordinatorOptions:
    """What only a :class:`~ddpwire.Coordinator` chooses: its keywords
    beside the :class:`SessionOptions`, checked once. Frozen.

    ``join_timeout`` bounds :meth:`~ddpwire.Coordinator.wait_for_workers`
    as a whole, and ``handshake_timeout`` each worker's handshake within it
    (they all run at once). ``node_id`` names the coordinator in its
    Heartbeats; ``extensions`` maps extension types
    (:class:`ddpwire.wire.extensions.Extension`) to the value granted to a
    worker that offers them. Gradients are averaged as they stream in,
    through a ring of ``ring_bytes`` per worker.

    ``topology`` chooses how flat steps are averaged: "auto" (the default)
    lets the workers average among themselves, the mesh of
    :mod:`ddpwire.plane.mesh`, when every worker is a ddpwire worker that offers
    it, and keeps the star through the coordinator whenever a reference
    worker takes part; "star" always keeps the star; "mesh" refuses a
    session where some worker cannot join the mesh. Either way the bits of
    the average are the reference's, and a NaN or +/-inf halts the step
    before any worker applies any of it. Block and non-block messages
    always take the star. ``compression`` ("bf16" or "fp16", mesh only)
    sends gradients and averages as 16-bit words, summed in float32 in
    worker order (docs/sessions.md gives the error this adds).

    ``shared_memory`` lets a mesh whose workers all offered the same host
    (:func:`ddpwire.plane.shm.host_id`) move its steps through one shared segment
    instead of loopback links, with the same bits and checks; it needs
    float32 (no ``compression``) and is off when ``DDPWIRE_SHM=0`` on the
    coordinator or on any worker.

    ``coordinator_share`` is the part of each mesh step's vector (a
    fraction in [0, 1), or "auto") that the coordinator averages itself
    over its own link, which a mesh otherwise leaves idle: the workers send
    it their last elements during the reduce-scatter and it streams the
    average back, as the star does, held by the workers until the step's
    go-ahead. "auto" takes three quarters of 1/(N+1) of the vector (where
    equal links would finish together; :func:`ddpwire.plane.mesh.auto_share`)
    with 3 or more workers on the links, none of them on the coordinator's
    host (whose link they would share), and float32; else none. A
    coordinator whose link is slower than the workers' should pass 0.

    ``receive_window`` bounds, in bytes, what each worker may have in
    flight towards the coordinator: under the star all of them stream into
    its link at once and, left to the kernel, overrun the buffer in front
    of it (:mod:`ddpwire.plane.incast`). "auto" (the default) sizes a window for
    each worker of a star session from the round trip measured at the
    join, leaving alone a single worker, a loopback one, a long path and
    mesh sessions; an int sets that window on every worker connection;
    None leaves every connection to the kernel.

    ``balance`` sizes each step's shards by a fitted model of each
    worker's step, a fixed part plus a part per sample
    (:mod:`ddpwire.session.balance`), so a faster machine computes more of each
    step and nobody waits, and averages the sample-weighted mean
    ``sum(c_i * g_i) / sum(c_i)``. A ddpwire worker reports its compute
    time; the reference does not: True balances any session (a reference
    worker's speed seen from when its gradient arrives, its weight applied
    in the star's sum); "auto" only one where every worker reports (the
    reference's ``T // n`` otherwise), and with a guard that tries equal
    and nudged shards now and then and keeps whatever the measured steps
    show is faster (ddpwire.session.balance); False (the default) always keeps
    ``T // n`` and the plain mean.

    ``elastic`` keeps the session going when a worker is lost (it
    disconnects, or stays silent past ``timeout`` or ``heartbeat_timeout``):
    the step it was lost in is called off on every survivor before any of
    them applies any of it, and redone by the survivors with all of its
    samples (:mod:`ddpwire.session.elastic`). Below ``min_workers`` (default 1) the
    session ends with the WorkerLost as without ``elastic``. It needs flat
    steps on the star (``topology`` becomes "star") and every worker able
    to redo a step (a ddpwire worker: a reference worker is refused at the
    join). ``resume`` (with ``elastic``) is a coordinator restarted after
    the last one was lost: its workers kept their state and join it again,
    each saying the step it goes on from.

    ``require_encryption`` refuses at the join a worker that cannot seal
    its link (encryption off, or a peer without the extension); it needs a
    token and ``encrypt``.
    """

    join_timeout: float = 300.0
    handshake_timeout: float = 10.0
    ring_bytes: int = 1 << 20
    node_id: str = "coordinator"
    extensions: Optional[Mapping[int, bytes]] = None
    topology: str = "auto"
    compression: Optional[str] = None
    shared_memory: bool = True
    coordinator_share: Union[str, float] = "auto"
    receive_window: Union[str, int, None] = "auto"
    balance: Union[bool, str] = False
    elastic: bool = False
    min_workers: Optional[int] = None
    resume: bool = False
    require_encryption: bool = False

    def __post_init__(self) -> None:
        put = object.__setattr__
        put(self, "require_encryption", bool(self.require_encryption))
        if self.topology not in ("auto", "star", "mesh"):
            raise ValueError(f"topology must be 'auto', 'star' or 'mesh', got {self.topology!r}")
        if self.balance not in (True, False, "auto"):
            raise ValueError(f"balance must be True, False or 'auto', got {self.balance!r}")
        if self.elastic:
            if self.topology == "mesh" or self.compression is not None:
                raise OptionError("{elastic} averages on the star: {topology} and {compression} "
                                  "are for sessions that end when a worker is lost",
                                  elastic=True, topology="mesh", compression=None)
            put(self, "topology", "star")
        if self.resume and not self.elastic:
            raise OptionError("{resume} picks up an elastic session's run: it needs {elastic}",
                              resume=None, elastic=True)
        _codecs.codec_of(self.compression)
        if self.compression is not None and self.topology == "star":
            raise OptionError("{compression} travels on the mesh: it cannot go with {topology}",
                              compression=None, topology="star")
        if self.coordinator_share != "auto":
            _plan.share_value(self.coordinator_share)  # type: ignore[arg-type]
        # below a few dozen segments TCP stalls on its own delayed ACKs
        # (4 KiB took seconds per megabyte on loopback)
        window = self.receive_window
        if window not in ("auto", None) and (
                not isinstance(window, int) or isinstance(window, bool)
                or not _incast.FLOOR <= window <= 1 << 30):
            raise ValueError(f"receive_window must be 'auto', None or a number of bytes from "
                             f"{_incast.FLOOR} to 2**30, got {window!r}")
        put(self, "join_timeout", check_timeout("join_timeout", self.join_timeout))
        put(self, "handshake_timeout", check_timeout("handshake_timeout", self.handshake_timeout))
        put(self, "elastic", bool(self.elastic))
        put(self, "resume", bool(self.resume))
        put(self, "shared_memory", bool(self.shared_memory))

    @classmethod
    def split(cls, options: Optional[SessionOptions], expect_workers: int,
              parameters: Dict[str, Any]) -> Tuple[SessionOptions, CoordinatorOptions]:
        """A Coordinator's parameters (its ``locals()`` on entry) made into
        the session's options and its own, each checked once, then checked
        together: its keywords are the two objects' fields
        (tests/test_options.py), beside ``bind``, ``expect_workers`` and
        ``options``."""
        keywords = {k: v for k, v in parameters.items()
                    if k not in ("self", "__class__", "bind", "expect_workers", "options")}
        shared = {k: keywords.pop(k) for k in list(keywords) if k in _FIELDS}
        session = options_from(options, shared)
        config = cls(**keywords)
        config.check(expect_workers, session.per_block)
        if config.require_encryption and (session.token is None or not session.encrypt):
            raise OptionError("{require_encryption} seals links with keys bound to the token: "
                              "it needs {token} and {encrypt}", require_encryption=True,
                              token=None, encrypt=True)
        return session, config

    def grants(self, per_block: Optional[bool]) -> Dict[int, bytes]:
        """The extensions a ddpwire worker that offers them is granted."""
        grants = dict(self.extensions or {})
        if self.topology != "star" and not per_block:
            grants[Extension.MESH] = b""
        # granted whether or not the shards follow it: the timings show where
        # each step's time went (Shards.timings, the progress table)
        grants[Extension.BALANCE] = b""
        if self.elastic:
            grants[Extension.ELASTIC] = b""
        return grants

    def planned_steps(self) -> Optional[int]:
        """The run's steps, as its steps entry grants them (docs/extensions.md
        "The run's length"); None where not known."""
        granted = (self.extensions or {}).get(Extension.STEPS)
        return decode_u64(bytes(granted)) or None if granted else None

    def check(self, expect_workers: int, per_block: Optional[bool]) -> None:
        """What these options need of the session's size and steps."""
        if expect_workers < 1:
            raise OptionError(f"{{expect_workers}} must be at least 1, got {expect_workers}",
                              expect_workers=None)
        if per_block and self.topology == "mesh":
            raise OptionError("{per_block} steps always take the star: {topology} needs "
                              "flat steps", per_block=True, topology="mesh")
        if per_block and self.elastic:
            raise OptionError("{elastic} runs flat steps: it cannot go with {per_block}",
                              elastic=True, per_block=True)
        steps = (self.extensions or {}).get(Extension.STEPS)
        if steps and len(steps) != 8:
            raise OptionError(f"{{extensions}}: the steps entry is empty or the run's steps as "
                              f"a u64 (encode_u64), got {len(steps)} bytes", extensions=None)
        least = self.min_workers
        if least is not None and not self.elastic:
            raise OptionError("{min_workers} ends an elastic run early: it needs {elastic}",
                              min_workers=None, elastic=True)
        if least is not None and (isinstance(least, bool) or not isinstance(least, int) or
                                  not 1 <= least <= expect_workers):
            raise OptionError(f"{{min_workers}} must be from 1 to {{expect_workers}} "
                              f"({expect_workers}), got {OptionError.literal(least)}",
                              min_workers=None, expect_workers=None)
