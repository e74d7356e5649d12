"""The exceptions ddpwire raises.

Every error derives from :class:`DdpwireError`, so a training loop can catch
one base class. Errors raised while talking to peers carry the context a user
needs to act on them: which worker, which step, and what differed.
"""
from __future__ import annotations

import re
from typing import Mapping, Optional

__all__ = [
    "DdpwireError",
    "OptionError",
    "ProtocolError",
    "FrameTooLarge",
    "UnexpectedMessage",
    "GradientMismatch",
    "NonFiniteGradient",
    "PeerLost",
    "WorkerLost",
    "CoordinatorLost",
    "IntegrityError",
    "CollectiveAborted",
    "JoinTimeout",
    "JoinRefusedError",
    "AuthenticationFailed",
    "ShutdownDuringReduce",
    "DeviceUnavailable",
    "EncryptionUnavailable",
    "MembershipChanged",
    "WorkerDropped",
    "NotACoordinator",
]


class DdpwireError(Exception):
    """Base of every error ddpwire raises.

    ``worker_id`` and ``step`` are ``None`` where they are not known (for
    example a malformed frame decoded outside a session).
    """

    def __init__(
        self,
        message: str,
        *,
        worker_id: Optional[int] = None,
        step: Optional[int] = None,
    ) -> None:
        super().__init__(message)
        self.message = message
        self.worker_id = worker_id
        self.step = step

    def add_context(
        self, *, worker_id: Optional[int] = None, step: Optional[int] = None
    ) -> "DdpwireError":
        """Name the peer and the step where the code that raised did not know
        them (a codec error found while receiving from a worker); returns self."""
        if self.worker_id is None:
            self.worker_id = worker_id
        if self.step is None:
            self.step = step
        return self

    def again(self) -> "DdpwireError":
        """This error once more, for a session call made after it ended the
        session: the same type, text, worker and step, with this one (and
        its traceback, where it first happened) as ``__cause__``.

        A fresh object rather than this one raised again: raising one object
        from every later call would stack each call's frames onto its
        traceback, and hide where the session really ended."""
        cls = type(self)
        twin = cls.__new__(cls, *self.args)
        twin.args = self.args  # OSError's __new__ leaves them to an __init__ not run here
        twin.__dict__.update(self.__dict__)
        twin.__cause__ = self
        return twin

    def __str__(self) -> str:
        context = []
        if self.worker_id is not None:
            context.append(f"worker {self.worker_id}")
        if self.step is not None:
            context.append(f"step {self.step}")
        return f"{self.message} ({', '.join(context)})" if context else self.message


class OptionError(DdpwireError, ValueError):
    """Options that cannot go together, or a value out of range, found
    before anything listens or connects.

    The check is written once, with each option it names as a ``{field}``
    of ``template``; ``spelled`` writes it in the caller's words: Python's
    keywords (``str()``: ``resume``, ``elastic=True``) or, through a map of
    flags, the command line's (``--resume``, ``--elastic``). ``options``
    maps each field to the value it needs or holds (None: just its name).
    """

    def __init__(self, template: str, **options: object) -> None:
        self.template = template
        self.options = options
        super().__init__(self.spelled(None))

    @staticmethod
    def literal(value: object) -> str:
        """``repr(value)`` made safe to put in a template."""
        return repr(value).replace("{", "{{").replace("}", "}}")

    def spelled(self, flags: Optional[Mapping[str, str]]) -> str:
        """The message with each option as a keyword (``flags`` None) or as
        the flag ``flags`` maps it to (``--`` and its dashed name if absent)."""
        def one(name: str, value: object) -> str:
            if flags is None:
                return name if value is None else f"{name}={value!r}"
            flag = flags.get(name, "--" + name.replace("_", "-"))
            return flag if value is None or value is True else f"{flag} {value}"
        return self.template.format(**{k: one(k, v) for k, v in self.options.items()})


class ProtocolError(DdpwireError, ValueError):
    """Bytes that do not form a valid message: truncation, unknown tag, bad UTF-8,
    a count that overflows, bytes after the last field, an oversized frame."""


class FrameTooLarge(ProtocolError):
    """A frame whose length prefix exceeds the configured limit (checked before
    anything is allocated)."""

    def __init__(self, length: int, limit: int, *, message_type: Optional[str] = None,
                 **context: Optional[int]) -> None:
        self.length = length
        self.limit = limit
        self.message_type = message_type
        where = "" if message_type is None else f" for {message_type}"
        super().__init__(f"frame too large: {length} bytes (limit {limit}{where})", **context)


class UnexpectedMessage(ProtocolError):
    """A well-formed message of the wrong type at this point of the session."""

    def __init__(self, expected: str, got: str, **context: Optional[int]) -> None:
        self.expected = expected
        self.got = got
        super().__init__(f"expected {expected}, got {got}", **context)


class GradientMismatch(ProtocolError):
    """A gradient message whose step, block_idx, component, length or component
    sizes differ from what the receiver expects."""

    def __init__(self, field: str, expected: object, got: object, **context: Optional[int]) -> None:
        self.field = field
        self.expected = expected
        self.got = got
        super().__init__(f"{field} mismatch: expected {expected}, got {got}", **context)


class NonFiniteGradient(DdpwireError, ValueError):
    """A NaN or +/-inf in a gradient (or, on a worker, in the average it
    received). Training halts: no worker applies an average holding it
    (docs/sessions.md, "Halting").

    ``input`` is the position of the offending buffer among the inputs (for the
    coordinator, the worker_id) and ``index`` the element index inside it.
    ``source`` is "gradient", or "average" for an average a worker received.
    """

    def __init__(
        self,
        input: int,
        index: int,
        value: float,
        *,
        worker_id: Optional[int] = None,
        step: Optional[int] = None,
        source: str = "gradient",
    ) -> None:
        self.input = input
        self.index = index
        self.value = value
        self.source = source
        where = f"input {input}" if worker_id is None else source
        super().__init__(
            f"non-finite gradient: {value!r} at element {index} of {where}",
            worker_id=worker_id,
            step=step,
        )


class PeerLost(DdpwireError, ConnectionError):
    """The peer disconnected, or stayed silent past the timeout."""


#: how far into a frame a lost peer went ("(0 of 4 bytes)"): for the debug
#: log; a user needs who was lost, and while waiting for what
_FRAME_PROGRESS = re.compile(r" \(\d+ of \d+ bytes\)")


def without_frame_progress(text: str) -> str:
    """A PeerLost's text for a user: without how far into a frame it was."""
    return _FRAME_PROGRESS.sub("", text)


class WorkerLost(PeerLost):
    """A worker disconnected or stayed silent past the timeout."""


class CoordinatorLost(PeerLost):
    """The coordinator disconnected or stayed silent past the timeout."""


class IntegrityError(PeerLost):
    """A record on a sealed link failed authentication: altered, replayed,
    reordered, dropped or injected on the way (docs/security.md). Nothing
    of it was used, and the link is dead: its peer is lost."""


_INTEGRITY: "dict[type, type]" = {}


def integrity_error(lost: type) -> type:
    """IntegrityError that is also ``lost`` (WorkerLost, CoordinatorLost...),
    so that whoever handles that peer's loss handles this one too."""
    if issubclass(lost, IntegrityError):
        return lost
    cls = _INTEGRITY.get(lost)
    if cls is None:
        cls = type("IntegrityError", (IntegrityError, lost), {"__module__": __name__,
                                                               "__doc__": IntegrityError.__doc__})
        _INTEGRITY[lost] = cls
    return cls


class CollectiveAborted(PeerLost):
    """A process group (:mod:`ddpwire.plane.collectives`) cannot go on: ``rank``
    (None when no single rank is at fault) died, stayed silent past the
    timeout, or issued a different collective. ``seq`` is the collective
    that failed."""

    def __init__(self, detail: str, *, rank: Optional[int], seq: Optional[int]) -> None:
        self.rank = rank
        self.seq = seq
        self.detail = detail
        super().__init__(detail, worker_id=rank, step=seq)

    def __str__(self) -> str:
        where = f"rank {self.rank}" if self.rank is not None else "no single rank"
        return f"collective {self.seq} aborted ({where}): {self.detail}"


class JoinTimeout(DdpwireError, TimeoutError):
    """Not every expected worker joined (or the coordinator never answered)
    before the join deadline."""


class JoinRefusedError(DdpwireError, ConnectionRefusedError):
    """The coordinator refused this worker: every slot is taken, training has
    started, the token is missing or wrong, or an offered value (such as the
    samples per step) disagrees. ``reason`` is the JoinRefused reason code
    (:class:`ddpwire.wire.extensions.RefusalReason`), ``detail`` the coordinator's
    words. ``by_worker`` is True where this worker itself ended the join
    (the coordinator could not prove the token): the text then says so
    instead of blaming the coordinator."""

    def __init__(self, reason: int, detail: str, *, by_worker: bool = False,
                 **context: Optional[int]) -> None:
        self.reason = reason
        self.detail = detail
        self.by_worker = by_worker
        super().__init__(detail if by_worker else
                         f"the coordinator refused to admit this worker: {detail}", **context)


class AuthenticationFailed(JoinRefusedError):
    """Token authentication failed: this side has no token or the wrong one,
    or the peer could not prove that it knows the token (``by_worker``: this
    worker gave up on the coordinator, rather than being refused by it)."""


class MembershipChanged(DdpwireError):
    """An elastic session (``Coordinator(elastic=True)``) lost ``lost`` (the
    worker ids) during ``step``: nobody applied any of that step, and the
    ``workers`` left compute it again on new shards. Not a failure: the
    session goes on, and the next ShardAssignment is the same step's. The
    coordinator's :meth:`~ddpwire.Coordinator.allreduce` and every
    survivor's raise it; :class:`~ddpwire.torch.DataParallelTrainer` and
    :func:`ddpwire.cli.serve.serve` redo the step themselves."""

    def __init__(self, lost: "list[int]", workers: int, *, step: int,
                 worker_id: Optional[int] = None, why: str = "") -> None:
        self.lost = list(lost)
        self.workers = workers
        self.why = why
        names = ", ".join(str(w) for w in self.lost)
        text = (f"worker{'s' if len(self.lost) > 1 else ''} {names} left"
                f"{': ' + why if why else ''}; the step is computed again by "
                f"{workers} worker{'s' if workers != 1 else ''}")
        super().__init__(text, worker_id=worker_id, step=step)


class WorkerDropped(PeerLost):
    """This worker was dropped from an elastic session during ``step``: it
    stalled or went silent past the coordinator's timeout (a stopped
    process, a machine asleep) and the others went on without it. Its
    connection is closed; none of its gradients from that step were used."""


class ShutdownDuringReduce(DdpwireError):
    """The coordinator sent Shutdown while this worker waited for an average."""


class EncryptionUnavailable(DdpwireError, RuntimeError):
    """Links were to be sealed (a token is set and encryption is on) and
    this machine cannot: no OpenSSL libcrypto could be loaded."""


class DeviceUnavailable(DdpwireError, RuntimeError):
    """A device was asked for (argument or ``DDPWIRE_DEVICE``) that this machine
    cannot provide, such as ``cuda:1`` on a box with one GPU."""


class NotACoordinator(ProtocolError):
    """The peer a worker joined answered with bytes that cannot begin a
    ddpwire frame: another service listens at ``address`` (a wrong port or
    host). ``service`` names it where its first bytes say ("SSH", "HTTP",
    "TLS", ...; None otherwise), ``head`` holds those bytes (at most
    :attr:`HEAD_BYTES`).

    Told apart from a coordinator's broken frame by the bytes alone: the
    first frame of a coordinator (JoinAccepted, AuthChallenge, JoinRefused
    or a Heartbeat) is at most 64 KiB, so its length prefix starts with a
    zero byte, and its tag is one of the protocol's."""

    #: the first bytes of a connection kept to name its protocol (the
    #: worker's of the peer it joined, the coordinator's of each stranger)
    HEAD_BYTES = 64

    #: first bytes -> the service that sends them first (a server's banner,
    #: its answer to a JoinRequest, or a client's first request)
    _SIGNATURES = (
        (b"SSH-", "SSH"),
        (b"HTTP/", "HTTP"),
        (b"PRI * HTTP/2", "HTTP/2"),
        (b"-ERR", "Redis"),
        (b"-NOAUTH", "Redis"),
        (b"-DENIED", "Redis"),
        (b"* OK", "IMAP"),
        (b"RFB ", "VNC"),
    )
    _HTTP_METHODS = (b"GET ", b"POST ", b"HEAD ", b"PUT ", b"DELETE ", b"OPTIONS ",
                     b"PATCH ", b"CONNECT ", b"TRACE ")

    def __init__(self, address: str, head: bytes, **context: Optional[int]) -> None:
        self.address = address
        self.head = bytes(head[:self.HEAD_BYTES])
        self.service = self.service_of(self.head)
        shown = self.shown(self.head)
        what = (f"it answered like {self.service}: {shown}" if self.service
                else f"it sent bytes that are not a ddpwire frame: {shown}")
        super().__init__(f"{address} is not a ddpwire coordinator ({what})", **context)

    @classmethod
    def service_of(cls, head: bytes) -> Optional[str]:
        """The protocol whose first bytes ``head`` are, or None."""
        head = bytes(head)
        for start, name in cls._SIGNATURES:
            if head.startswith(start):
                return name
        if head.startswith(cls._HTTP_METHODS) or (len(head) >= 4 and any(
                m.startswith(head) for m in cls._HTTP_METHODS)):
            return "HTTP"
        # a TLS record: handshake (a ClientHello, a ServerHello) or alert
        # (a server's answer to bytes that are not TLS), version 3.x
        if len(head) >= 3 and head[0] in (0x15, 0x16) and head[1] == 0x03 and head[2] <= 0x04:
            return "TLS"
        line = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
        if head[:4] in (b"220 ", b"220-"):
            upper = line.upper()
            return "FTP" if b"FTP" in upper else "SMTP" if b"SMTP" in upper else "SMTP or FTP"
        if head.startswith(b"+OK"):
            return "POP3" if b"POP3" in line.upper() else "Redis"
        if head.startswith(b"+") and b"\r\n" in head and _printable(line):
            return "Redis"
        # a MySQL server's greeting: a 3-byte length, sequence 0, protocol 10
        if len(head) >= 5 and head[3] == 0 and head[4] == 0x0A and 0 < head[0] | head[1] << 8:
            return "MySQL"
        return None

    @staticmethod
    def shown(head: bytes, limit: int = 60) -> str:
        """``head`` as a log or an error can show it, short and printable:
        its first line quoted where it is text, else its first bytes in hex."""
        head = bytes(head)
        line = head.split(b"\r\n", 1)[0].split(b"\n", 1)[0]
        if line and _printable(line[:limit]):
            text = line[:limit].decode("ascii")
            return repr(text + ("..." if len(line) > limit else ""))
        first = head[:12]
        return " ".join(f"{b:02x}" for b in first) + (" ..." if len(head) > len(first) else "")


def _printable(data: bytes) -> bool:
    """Printable ASCII (tabs included), nothing else."""
    return all(32 <= b < 127 or b == 9 for b in data)
