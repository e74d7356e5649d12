"""What sealing costs a link (issue 42), on loopback, side by side in one run:
64 MiB sent from one thread and received by another over a TCP connection
in the clear and sealed (AES-256-GCM records, ddpwire/wire/seal.py), and a
memcpy of the same bytes (numpy's copyto) as the yardstick; and the cipher
alone, sealing 64 KiB records: "aesgcm-links" through the libcrypto the
links load (its EVP calls through ctypes), "aesgcm-cryptography" through
the `cryptography` package, whose wheel carries an OpenSSL of its own
(both versions are in extra_info): what a newer OpenSSL would save.

Each transfer's sender and receiver time their own thread's CPU time
(time.thread_time, which counts the GIL-free C too): the sealed side's
extra CPU seconds per GB over the clear one is what sealing (sender) and
opening (receiver) cost on one core, beside what memcpy costs per GB.

    PYTHONPATH=$PWD python -m pytest bench/test_bench_seal.py \\
        --benchmark-json=bench/results/seal-<commit>.json -q

DDPWIRE_SEAL_MIB sets the size (default 64).
"""
from __future__ import annotations

import ctypes
import functools
import os
import socket
import threading
import time

import numpy as np
import pytest

from ddpwire import _core
from ddpwire.wire import seal

MIB = int(os.environ.get("DDPWIRE_SEAL_MIB", "64"))
SIZE = MIB << 20
GB = 1e9
RECORD = _core.SEALED_RECORD  # the plaintext bytes of one sealed record


def _pair(sealed: bool):
    with socket.create_server(("127.0.0.1", 0)) as lsock:
        a = socket.create_connection(lsock.getsockname())
        b, _ = lsock.accept()
    for s in (a, b):
        s.setblocking(False)
    ca, cb = _core.Connection(a), _core.Connection(b)
    if sealed:
        seal.load_libcrypto()
        k1, k2 = os.urandom(32), os.urandom(32)
        ca.seal(k1, k2)
        cb.seal(k2, k1)
    return ca, cb


def _transfer(ca, cb, data: np.ndarray, out: np.ndarray, cpu: dict) -> None:
    def send() -> None:
        t = time.thread_time()
        ca.send_parts([data], 60)
        cpu["send"] += time.thread_time() - t

    sender = threading.Thread(target=send)
    sender.start()
    t = time.thread_time()
    cb.recv_into(out, 60)
    cpu["recv"] += time.thread_time() - t
    sender.join()


@functools.lru_cache(maxsize=None)
def _links_libcrypto() -> ctypes.CDLL:
    """The libcrypto the links load (ddpwire.wire.seal's choice)."""
    return ctypes.CDLL(seal.load_libcrypto())


def _openssl_versions() -> dict:
    """The OpenSSL the `cryptography` wheel carries, and the libcrypto the links load."""
    from cryptography.hazmat.backends.openssl import backend
    lib = _links_libcrypto()
    lib.OpenSSL_version.restype = ctypes.c_char_p
    lib.OpenSSL_version.argtypes = [ctypes.c_int]
    return {"cryptography_openssl": backend.openssl_version_text(),
            "links_libcrypto": lib.OpenSSL_version(0).decode()}


def _links_sealer():
    """seal(record): AES-256-GCM through the links' libcrypto, as csrc/aead.c calls it."""
    lib = _links_libcrypto()
    p, i = ctypes.c_void_p, ctypes.c_int
    lib.EVP_CIPHER_CTX_new.restype = p
    lib.EVP_aes_256_gcm.restype = p
    lib.EVP_EncryptInit_ex.argtypes = [p, p, p, ctypes.c_char_p, ctypes.c_char_p]
    lib.EVP_EncryptUpdate.argtypes = [p, ctypes.c_char_p, ctypes.POINTER(i), ctypes.c_char_p, i]
    lib.EVP_EncryptFinal_ex.argtypes = [p, ctypes.c_char_p, ctypes.POINTER(i)]
    lib.EVP_CIPHER_CTX_ctrl.argtypes = [p, i, i, ctypes.c_char_p]
    ctx = lib.EVP_CIPHER_CTX_new()
    assert lib.EVP_EncryptInit_ex(ctx, lib.EVP_aes_256_gcm(), None, os.urandom(32), bytes(12))
    out, tag, n = ctypes.create_string_buffer(RECORD), ctypes.create_string_buffer(16), i()

    def seal_one(record: bytes) -> None:
        assert lib.EVP_EncryptInit_ex(ctx, None, None, None, bytes(12))
        assert lib.EVP_EncryptUpdate(ctx, out, ctypes.byref(n), record, len(record))
        assert lib.EVP_EncryptFinal_ex(ctx, out, ctypes.byref(n))
        assert lib.EVP_CIPHER_CTX_ctrl(ctx, 0x10, 16, tag)  # EVP_CTRL_GCM_GET_TAG
    return seal_one


@pytest.mark.parametrize("kind", ["memcpy", "clear", "sealed", "aesgcm-links",
                                  "aesgcm-cryptography"])
def test_seal_cost(benchmark, kind):
    data = np.random.default_rng(0).integers(0, 256, SIZE, dtype=np.uint8)
    out = np.zeros_like(data)
    out[:] = 1  # its pages touched: no round pays their first faults
    cpu = {"send": 0.0, "recv": 0.0}
    benchmark.group = f"{MIB} MiB over loopback"
    if kind == "memcpy":
        def once() -> None:
            t = time.thread_time()
            np.copyto(out, data)
            cpu["send"] += time.thread_time() - t
        benchmark.pedantic(once, rounds=5, warmup_rounds=1)
        rounds = 6
    elif kind.startswith("aesgcm"):
        if kind == "aesgcm-links":
            seal_one = _links_sealer()
        else:
            from cryptography.hazmat.primitives.ciphers.aead import AESGCM
            aead = AESGCM(os.urandom(32))

            def seal_one(record: bytes) -> None:
                aead.encrypt(bytes(12), record, None)
        records = [data[k:k + RECORD].tobytes() for k in range(0, SIZE, RECORD)]

        def once() -> None:
            t = time.thread_time()
            for record in records:
                seal_one(record)
            cpu["send"] += time.thread_time() - t
        benchmark.pedantic(once, rounds=5, warmup_rounds=1)
        rounds = 6
        out[:] = data  # nothing is received: the check below is the others'
        benchmark.extra_info.update(_openssl_versions())
    else:
        ca, cb = _pair(kind == "sealed")
        benchmark.pedantic(lambda: _transfer(ca, cb, data, out, cpu), rounds=5, warmup_rounds=1)
        rounds = 6
        ca.close()
        cb.close()
    assert np.array_equal(out, data)
    gb = rounds * SIZE / GB
    benchmark.extra_info.update(
        kind=kind, bytes=SIZE, cpu_send_s_per_gb=cpu["send"] / gb,
        cpu_recv_s_per_gb=cpu["recv"] / gb, wall_gb_per_s=SIZE / GB / benchmark.stats["median"])
