"""Where one side of a session stands, and the failure that ended it.

A :class:`~ddpwire.Worker` and a :class:`~ddpwire.Coordinator` each keep a
:class:`Lifecycle`: a state from the side's own enum, changed only by
:meth:`Lifecycle.move` along the side's table of moves, so the phase is
never guessed from which attributes happen to be set; and the first
failure, kept so that every call after it raises that failure again rather
than whatever a closed socket says then ("connection is closed", with no
step). What each side closes when it fails is the side's own business (its
``_fail``); this module only keeps the books.
"""
from __future__ import annotations

import contextlib
import enum
import threading
from typing import AbstractSet, Callable, Generic, Iterator, Mapping, Optional, TypeVar

from ..wire.errors import DdpwireError, MembershipChanged

__all__ = ["Lifecycle", "LifecycleOwner"]

S = TypeVar("S", bound=enum.Enum)
_Owner = TypeVar("_Owner", bound="LifecycleOwner")  # type: ignore[type-arg]


class Lifecycle(Generic[S]):
    """A session side's state and first failure.

    ``moves`` maps each state to those it may become; anything else is
    refused, so a side that has ``failed`` or ``closed`` never comes back to
    life. ``owner`` names the side in errors ("worker 2", "the
    coordinator"). :attr:`lock` (reentrant) is held by every move; a side
    holds it across its whole failure path too, so that a concurrent close
    waits until everything is closed instead of racing it.
    """

    def __init__(self, initial: S, moves: Mapping[S, AbstractSet[S]], *, failed: S, closed: S,
                 owner: str) -> None:
        self._state = initial
        self._moves = moves
        self._failed = failed
        self._closed = closed
        self.owner = owner
        self.lock = threading.RLock()
        #: the error that ended the session, None while none has
        self.failure: Optional[DdpwireError] = None

    @property
    def state(self) -> S:
        return self._state

    @property
    def ended(self) -> bool:
        """Whether the session has failed or been closed."""
        return self._state is self._failed or self._state is self._closed

    def move(self, new: S) -> None:
        """Become ``new``: the one place the state changes. Staying put is
        no move. A move the table does not allow is refused: from an ended
        session (another thread failed it under this call) by raising its
        error; otherwise the code is wrong, and AssertionError says so."""
        with self.lock:
            old = self._state
            if new is old:
                return
            if new not in self._moves[old]:
                if self.ended:
                    raise self.error()
                raise AssertionError(f"{self.owner}: state {old.name} cannot become {new.name}")
            self._state = new

    def record(self, cause: BaseException, *, step: Optional[int],
               worker_id: Optional[int]) -> bool:
        """Keep ``cause`` as the session's failure and move to the failed
        state, if the session has not ended yet: True then. The failure
        names ``worker_id`` and ``step`` where ``cause`` does not. A cause
        that is no DdpwireError (a Ctrl-C or a MemoryError in the middle of
        a frame) is kept as a DdpwireError saying so, with it as
        ``__cause__``. Call with :attr:`lock` held across the closing that
        follows."""
        with self.lock:
            if self.ended:
                return False
            if isinstance(cause, DdpwireError):
                kept = cause.add_context(worker_id=worker_id, step=step)
            else:
                where = "" if step is None else f" in step {step}"
                kept = DdpwireError(f"{self.owner}'s session ended{where}: "
                                    f"{type(cause).__name__} cut a frame short",
                                    worker_id=worker_id, step=step)
                kept.__cause__ = cause
            self.failure = kept
            self.move(self._failed)
            return True

    def error(self) -> DdpwireError:
        """What a call on the ended session raises: its failure once more
        (:meth:`DdpwireError.again`), or, after a close with no failure,
        an error saying it is closed."""
        if self.failure is not None:
            return self.failure.again()
        return DdpwireError(f"{self.owner} is closed")

    def check(self) -> None:
        """Raise :meth:`error` when the session has ended."""
        if self.ended:
            raise self.error()

    @contextlib.contextmanager
    def failing(self, fail: Callable[[BaseException], object], *,
                any_error: bool = False) -> Iterator[None]:
        """Where a session call talks to its peers: a DdpwireError raised
        there (but MembershipChanged) ends the session through ``fail``
        (the side's own failure path), and so does any exception with
        ``any_error``, for a part that an interruption leaves inside a
        frame. The first failure propagates as raised; an error that only
        followed it (a socket another thread's failure closed) is replaced
        by the first one."""
        try:
            yield
        except BaseException as exc:
            # a membership change is the session going on without a worker
            if isinstance(exc, MembershipChanged) or \
                    (not any_error and not isinstance(exc, DdpwireError)):
                raise
            fail(exc)
            first = self.failure
            if first is None or exc is first or exc is first.__cause__ \
                    or exc.__cause__ is first:
                raise  # the first failure itself, or a close with no failure
            raise self.error()  # its __cause__ is the first: the chain shown is that one


class LifecycleOwner(Generic[S]):
    """What a session side built on a :class:`Lifecycle` (its ``_life``)
    shows of it: the Worker and the Coordinator alike."""

    _life: Lifecycle[S]

    @property
    def state(self) -> S:
        """Where the session stands (the side's state enum)."""
        return self._life.state

    @property
    def failure(self) -> Optional[DdpwireError]:
        """The error that ended the session (None while none has): every
        call after it raises it again, naming the same worker and step."""
        return self._life.failure

    def close(self) -> None:
        """Each side's own: closes everything; ``with`` calls it on the way out."""
        raise NotImplementedError

    def __enter__(self: _Owner) -> _Owner:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def _set_state(self, new: S) -> None:
        """The one place the state changes (:meth:`Lifecycle.move`: forward
        only; a session another thread ended raises its failure here)."""
        self._life.move(new)
