"""Sealed links: every byte after the join in AES-256-GCM records.

Two parts, each the field's standard, none written here:

- the records are sealed and opened in C (csrc/sealed.c, csrc/aead.c) by
  the OpenSSL libcrypto this Python process already uses for ``hashlib``
  (or the system's), loaded once by :func:`load_libcrypto`;
- the keys come from an ephemeral X25519 exchange at the join, bound to
  the session's token and to both sides' nonces and public keys by
  HKDF-SHA256 (the ``cryptography`` package): a recorded session stays
  secret even if the token leaks later, and a party without the token
  cannot derive them.

Each link has its own pair of keys, one per direction, never used on
another link (:func:`derive`): a record's nonce is its number in its
direction, so a key must never see two streams. What this protects, and
what it does not: docs/security.md; the bytes: docs/extensions.md
("Encryption").
"""
from __future__ import annotations

import ctypes
import ctypes.util
import importlib
import os
import sys
from typing import Iterator, List, Mapping, Optional, Tuple

from .. import _core
from .errors import EncryptionUnavailable, ProtocolError

__all__ = ["ENCRYPT_ENV", "JOIN_LABEL", "KEY_BYTES", "LIBCRYPTO_ENV", "PEER_LABEL", "PUBLIC_BYTES",
           "KeyShare", "derive", "encrypt_from_env", "join_keys", "load_libcrypto"]

#: bytes of one direction's AES-256 key
KEY_BYTES = 32
#: bytes of an X25519 public key (the SEAL extension entry's value)
PUBLIC_BYTES = 32
#: names the libcrypto to load, where the process has none mapped
LIBCRYPTO_ENV = "DDPWIRE_LIBCRYPTO"
#: "off" (or 0, false, no) turns encryption off where no flag reaches: the
#: torch backend, whose ranks read the token from $DDPWIRE_TOKEN too
ENCRYPT_ENV = "DDPWIRE_ENCRYPT"

#: HKDF labels, one per kind of link: a coordinator's link to a worker,
#: and a link between two workers (the mesh, torch rank links)
JOIN_LABEL = b"ddpwire-seal-v1 join"
PEER_LABEL = b"ddpwire-seal-v1 peer"

_SONAMES = ("libcrypto.so.3", "libcrypto.so.1.1", "libcrypto.3.dylib", "libcrypto.dylib")

_loaded: Optional[str] = None


def _mapped() -> List[str]:
    """libcrypto files already mapped into this process: the one Python's
    own hashlib links, so its fixes come with Python's."""
    try:
        importlib.import_module("_hashlib")  # maps libcrypto where hashlib is built on it
    except ImportError:
        pass
    found: List[str] = []
    if sys.platform.startswith("linux"):
        try:
            with open("/proc/self/maps") as f:
                for line in f:
                    fields = line.split(None, 5)
                    if len(fields) == 6:
                        path = fields[5].strip()
                        if os.path.basename(path).startswith("libcrypto.") and path not in found:
                            found.append(path)
        except OSError:
            pass
    elif sys.platform == "darwin":
        dyld = ctypes.CDLL(None)
        dyld._dyld_get_image_name.restype = ctypes.c_char_p
        dyld._dyld_get_image_name.argtypes = [ctypes.c_uint32]
        for i in range(dyld._dyld_image_count()):
            name = dyld._dyld_get_image_name(i)
            path = os.fsdecode(name) if name else ""
            if os.path.basename(path).startswith("libcrypto.") and path not in found:
                found.append(path)
    return found


def encrypt_from_env(env: Optional[Mapping[str, str]] = None) -> bool:
    """Whether ``$DDPWIRE_ENCRYPT`` leaves encryption on (unset: on)."""
    value = (os.environ if env is None else env).get(ENCRYPT_ENV, "").strip().lower()
    if value in ("", "1", "on", "true", "yes"):
        return True
    if value in ("0", "off", "false", "no"):
        return False
    raise ValueError(f"${ENCRYPT_ENV} must be on or off, got {value!r}")


def _candidates() -> Iterator[str]:
    """Where libcrypto may be, best first: mapped here already (a mapped
    file since replaced by an upgrade fails to load, and the next is tried),
    then the system's."""
    yield from _mapped()
    system = ctypes.util.find_library("crypto")  # a subprocess: only when needed
    if system:
        yield system
    yield from _SONAMES


def load_libcrypto() -> str:
    """Load libcrypto's AES-256-GCM for sealed links (once) and return the
    file loaded: ``$DDPWIRE_LIBCRYPTO`` when set, else the libcrypto this
    process already maps, else the system's. Raises
    :class:`~ddpwire.EncryptionUnavailable` saying what was tried."""
    global _loaded
    if _loaded is not None:
        return _loaded
    chosen = os.environ.get(LIBCRYPTO_ENV)
    failures: List[str] = []
    for path in [chosen] if chosen else _candidates():
        try:
            _core.load_libcrypto(path)
        except OSError as exc:
            failures.append(str(exc))
            continue
        _loaded = path
        return path
    raise EncryptionUnavailable(
        "sealed links need OpenSSL's libcrypto (1.1 or 3), and none could be loaded ("
        + "; ".join(failures) + f"): install OpenSSL, name its libcrypto in ${LIBCRYPTO_ENV}, "
        "or turn encryption off on every side (--encrypt off, encrypt=False)")


class KeyShare:
    """One side's ephemeral X25519 key for one link: its public half goes
    to the peer in the join, its private half never leaves this object, and
    it serves one link only."""

    def __init__(self) -> None:
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PrivateKey
        from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat

        self._private = X25519PrivateKey.generate()
        #: the public key, PUBLIC_BYTES raw bytes
        self.public = self._private.public_key().public_bytes(Encoding.Raw, PublicFormat.Raw)

    def secret(self, peer_public: bytes) -> bytes:
        """The shared secret with ``peer_public``; ProtocolError for a key
        that is malformed or of low order (its secret would be known)."""
        from cryptography.hazmat.primitives.asymmetric.x25519 import X25519PublicKey

        if not isinstance(peer_public, (bytes, bytearray)) or len(peer_public) != PUBLIC_BYTES:
            raise ProtocolError(f"a seal key share must be {PUBLIC_BYTES} bytes")
        try:
            return self._private.exchange(X25519PublicKey.from_public_bytes(bytes(peer_public)))
        except ValueError:
            raise ProtocolError("the peer's seal key share is of low order") from None


def join_keys(mine: KeyShare, theirs: bytes, token: bytes, worker_nonce: bytes,
              coordinator_nonce: bytes, *, worker: bool) -> Tuple[bytes, bytes]:
    """This side's (send key, receive key) for its connection at the join:
    the exchange of ``mine`` with the peer's public key ``theirs``, bound
    to the token and to what both sides said (the nonces, then the
    worker's public key and the coordinator's). The worker dialed: it is
    the initiator."""
    publics = mine.public + theirs if worker else theirs + mine.public
    return derive(mine.secret(theirs), token, JOIN_LABEL,
                  worker_nonce + coordinator_nonce + publics, initiator=worker)


def derive(secret: bytes, salt: bytes, label: bytes, context: bytes, *,
           initiator: bool) -> Tuple[bytes, bytes]:
    """This side's (send key, receive key) for one link, by HKDF-SHA256 from
    ``secret`` under ``salt`` (the token, at the join), the info being
    ``label`` and ``context`` (what names this link: the nonces and public
    keys both sides saw, or the two workers). The initiator (the side that
    dialed) sends under the first half; the other side gets them swapped."""
    from cryptography.hazmat.primitives import hashes
    from cryptography.hazmat.primitives.kdf.hkdf import HKDF

    okm = HKDF(algorithm=hashes.SHA256(), length=2 * KEY_BYTES, salt=salt or None,
               info=label + context).derive(secret)
    first, second = okm[:KEY_BYTES], okm[KEY_BYTES:]
    return (first, second) if initiator else (second, first)
