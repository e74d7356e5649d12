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
from typing import Any, Dict, Optional, Union

from .auth import normalize_token
from .channel import DEFAULT_MAX_FRAME, check_timeout, heartbeat_limit

__all__ = ["SessionOptions", "UNSET", "options_from"]


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
    (seconds, None: off) sends Heartbeat frames at that interval and
    ``heartbeat_timeout`` (default: a few missed heartbeats,
    :func:`ddpwire.channel.heartbeat_limit`) is the silence after which the
    peer is lost. ``max_frame`` bounds one frame's bytes; ``socket_threads``
    streams steps on threads (None: where it pays). ``token`` (str or bytes)
    authenticates both ways. ``samples_per_step``, ``per_block`` and
    ``gradient_length`` describe the training, so that a worker set up for
    another is refused at the join. Frozen: checked values stay checked.
    """

    timeout: float = 120.0
    heartbeat: Optional[float] = None
    heartbeat_timeout: Optional[float] = None
    max_frame: int = DEFAULT_MAX_FRAME
    socket_threads: Optional[bool] = None
    token: Union[str, bytes, None] = None
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
        if self.samples_per_step is not None and self.samples_per_step < 0:
            raise ValueError(f"samples_per_step must be >= 0, got {self.samples_per_step}")
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
