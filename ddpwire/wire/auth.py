"""Token authentication for the join: proofs both ways, never the token itself.

Each side proves it knows the shared token by an HMAC-SHA256 over both
sides' fresh nonces, with a label per role so that one side's proof can never
be reflected back as the other's (docs/extensions.md, "Authentication").
What this protects, and what it does not: docs/security.md.
"""
from __future__ import annotations

import hashlib
import hmac
import os
from typing import Mapping, Optional, Union

__all__ = ["NONCE_BYTES", "TOKEN_ENV", "coordinator_proof", "load_token", "new_nonce",
           "normalize_token", "proof_matches", "worker_proof"]

NONCE_BYTES = 32
TOKEN_ENV = "DDPWIRE_TOKEN"

_COORDINATOR_LABEL = b"ddpwire-auth-v1 coordinator"
_WORKER_LABEL = b"ddpwire-auth-v1 worker"


def normalize_token(token: Union[str, bytes, None]) -> Optional[bytes]:
    """The token as bytes (a str is UTF-8 encoded), or None for no token.
    An empty token is refused: it would authenticate anyone."""
    if token is None:
        return None
    if isinstance(token, str):
        token = token.encode("utf-8")
    if not isinstance(token, (bytes, bytearray)):
        raise TypeError(f"token must be str or bytes, not {type(token).__name__}")
    if not token:
        raise ValueError("token is empty")
    return bytes(token)


def load_token(path: Optional[str] = None, env: Mapping[str, str] = os.environ) -> Optional[bytes]:
    """The token from ``path`` (one line; surrounding whitespace dropped) or,
    without a path, from $DDPWIRE_TOKEN; None when neither is given. Read from
    a file or the environment so that it never shows on a command line."""
    if path is not None:
        try:
            with open(path, "rb") as f:
                text = f.read()
        except OSError as exc:
            raise ValueError(f"cannot read the token file {path}: {exc.strerror}") from None
        token = text.strip()
        if not token:
            raise ValueError(f"the token file {path} is empty")
        return token
    value = env.get(TOKEN_ENV)
    if value is None:
        return None
    return normalize_token(value.strip())


def new_nonce() -> bytes:
    """A fresh nonce from the operating system's CSPRNG."""
    return os.urandom(NONCE_BYTES)


def _mac(token: bytes, label: bytes, worker_nonce: bytes, coordinator_nonce: bytes,
         bound: bytes) -> bytes:
    return hmac.new(token, label + worker_nonce + coordinator_nonce + bound,
                    hashlib.sha256).digest()


def coordinator_proof(token: bytes, worker_nonce: bytes, coordinator_nonce: bytes,
                      bound: bytes = b"") -> bytes:
    """What the coordinator sends in AuthChallenge. ``bound``: the worker's
    seal key share when it offered one (ddpwire.wire.seal), so that an offer
    taken out on the way fails the proofs instead of leaving the session in
    the clear."""
    return _mac(token, _COORDINATOR_LABEL, worker_nonce, coordinator_nonce, bound)


def worker_proof(token: bytes, worker_nonce: bytes, coordinator_nonce: bytes,
                 bound: bytes = b"") -> bytes:
    """What the worker sends in AuthProof (``bound`` as for coordinator_proof)."""
    return _mac(token, _WORKER_LABEL, worker_nonce, coordinator_nonce, bound)


def proof_matches(expected: bytes, received: bytes) -> bool:
    """Constant-time comparison: timing reveals nothing of the expected proof."""
    return hmac.compare_digest(expected, received)
