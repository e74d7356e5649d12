"""The coordinator's listening socket and what arrives on it, stage by stage.

Until every worker slot is filled, each connection is a handshake of the
join (:class:`~ddpwire.session.admission.Admission`, which a call of
``wait_for_workers`` may leave part done for the next). Once the join
completes, each new connection is refused at once
(:class:`~ddpwire.session.admission.Refuser`), but in an elastic session, whose
join goes on between steps (:class:`ddpwire.session.elastic.Membership` takes the
Admission over).
"""
from __future__ import annotations

import errno
import logging
import socket
import time
from typing import List, Optional, Tuple

from ..wire import seal
from .._text import counted
from .admission import Admission, Admitted, Refuser
from ..wire.auth import TOKEN_ENV
from .launch import is_loopback
from .options import CoordinatorOptions, SessionOptions

__all__ = ["Intake"]

log = logging.getLogger("ddpwire.coordinator")


def _bind(bind: Tuple[str, int], backlog: int) -> socket.socket:
    host, port = bind
    try:
        family = socket.AF_INET6 if ":" in host else socket.AF_INET
        return socket.create_server((host, port), family=family, backlog=backlog)
    except OSError as exc:
        if exc.errno == errno.EADDRINUSE:
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: address already in use") from None
        if isinstance(exc, socket.gaierror) or exc.errno == errno.EADDRNOTAVAIL:
            raise OSError(exc.errno, f"cannot listen on {host}:{port}: no such local address") from None
        raise


class Intake:
    """Listens on ``bind`` for a session of ``expect_workers`` workers (a
    port already taken, or an address this host does not have, is an
    OSError saying so) and runs its first join. Without a token on an
    address other hosts reach, a warning says that anyone may join."""

    def __init__(self, bind: Tuple[str, int], expect_workers: int, options: SessionOptions,
                 config: CoordinatorOptions) -> None:
        self.expect_workers = expect_workers
        self._options, self._config = options, config
        self._grants = config.grants(options.per_block)
        if options.token is not None and options.encrypt:
            seal.load_libcrypto()  # before listening: EncryptionUnavailable says what to do
        self.listener = _bind(bind, backlog=max(16, expect_workers))
        self._admission: Optional[Admission] = None
        self._refuser: Optional[Refuser] = None
        if options.token is None and not is_loopback(bind[0]):
            # $DDPWIRE_TOKEN is what both commands and torch.distributed read
            # (a flag would exist under one of them only)
            log.warning("listening on %s:%d without a token: any host that reaches this port can "
                        "join as a worker and change the averages, and every frame travels "
                        "in the clear (set %s to one secret on every machine, or pass token= "
                        "in Python: links are then sealed too; see docs/security.md)",
                        *self.local_addr, TOKEN_ENV)

    @property
    def local_addr(self) -> Tuple[str, int]:
        """The (host, port) listened on (the real port when bound to 0)."""
        host, port = self.listener.getsockname()[:2]
        return host, port

    @property
    def joined(self) -> int:
        """Workers admitted by a join still under way (0 before or after one)."""
        if self._admission is None:
            return 0
        return sum(slot is not None for slot in self._admission.slots)

    def admit(self, limit: float, want: int, samples: Optional[int]) -> List[Admitted]:
        """Run the join until ``want`` workers are in or ``limit`` seconds
        pass (:class:`~ddpwire.JoinTimeout`), picking up where an earlier
        call left it. Returns every worker admitted so far."""
        if self._admission is None:
            opts, config = self._options, self._config
            self._admission = Admission(
                self.listener, expect_workers=self.expect_workers, token=opts.token,
                grants=self._grants, samples=samples,
                handshake_timeout=config.handshake_timeout, max_frame=opts.max_frame,
                per_block=opts.per_block, gradient_length=opts.gradient_length,
                elastic=config.elastic, resume=config.resume,
                encrypt=opts.encrypt,
                require_encryption=config.require_encryption)  # type: ignore[arg-type]
        return self._admission.run(time.monotonic() + limit, limit, want)

    def complete(self) -> Optional[Admission]:
        """The join filled every slot: in an elastic session, returns the
        Admission to go on between steps; otherwise every later connection
        is refused from here on (and None is returned)."""
        admission, self._admission = self._admission, None
        assert admission is not None
        if self._config.elastic:
            return admission
        self._refuser = Refuser(admission.handshakes,
                                detail=f"training has started with "
                                       f"{counted(self.expect_workers, 'worker')}")
        return None

    def close(self) -> None:
        """Stop refusing, drop a join under way and close the listener."""
        if self._refuser is not None:
            self._refuser.close()
        if self._admission is not None:
            self._admission.handshakes.close_all()
            for slot in self._admission.slots:
                if slot is not None:
                    slot.sock.close()
        self.listener.close()
