"""The C core on aarch64 (Linux arm64 wheels, and the Apple-silicon branch
of reduce.c's dispatch): cross-compiled with gcc-aarch64-linux-gnu under
-Werror, and its C checks run under qemu-user. The probe's answers on every
reference frame must be byte-identical to the native build's, so the wire
codec reads the same on both architectures.

Needs the Debian packages gcc-aarch64-linux-gnu and qemu-user (.ci/run
installs them); skips with that reason where they are absent."""
from __future__ import annotations

import json
import pathlib
import shutil
import subprocess

import pytest

from test_threaded_c import CASES, NAN_CASES, SENDER_CASES

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
CHECKS = ROOT / "tests" / "c"
CROSS = shutil.which("aarch64-linux-gnu-gcc")
QEMU = shutil.which("qemu-aarch64") or shutil.which("qemu-aarch64-static")
NATIVE = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")

pytestmark = pytest.mark.skipif(
    CROSS is None or QEMU is None,
    reason="needs aarch64-linux-gnu-gcc and qemu-aarch64 "
           "(apt-get install gcc-aarch64-linux-gnu qemu-user)")

FLAGS = ["-std=c99", "-O2", "-Wall", "-Wextra", "-Werror", "-pedantic", f"-I{CSRC}"]


def build(cc: str, sources: list, out: pathlib.Path, static: bool) -> pathlib.Path:
    # static, so qemu needs no aarch64 sysroot to load it
    cmd = [cc, *FLAGS, *map(str, sources), "-o", str(out), "-lpthread", "-lm"]
    if static:
        cmd.insert(1, "-static")
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr}"
    assert proc.stderr == ""
    return out


def emulate(exe: pathlib.Path, *args: str, stdin: bytes = b"") -> subprocess.CompletedProcess:
    return subprocess.run([QEMU, str(exe), *args], input=stdin, capture_output=True, timeout=600)


@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.c")))
@pytest.mark.parametrize("defines", [[], ["-DDDPW_REDUCE_PORTABLE_ONLY"], ["-DDDPW_REDUCE_NO_THREADS"]],
                         ids=["default", "portable-only", "no-threads"])
def test_every_unit_cross_compiles_without_warnings(tmp_path, source, defines):
    proc = subprocess.run([CROSS, *FLAGS, *defines, "-c", str(CSRC / source), "-o", str(tmp_path / "u.o")],
                          capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    assert proc.stderr == ""
    # an aarch64 object, not a host one that slipped through
    assert (tmp_path / "u.o").read_bytes()[18:20] == (183).to_bytes(2, "little")  # EM_AARCH64


def test_reduce_checks_pass_on_aarch64(tmp_path):
    exe = build(CROSS, [CHECKS / "reduce_check.c", CSRC / "reduce.c"], tmp_path / "reduce_check", True)
    proc = emulate(exe)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    lines = proc.stdout.decode().splitlines()
    assert "path portable ok" in lines
    # no x86 kernel may be offered on arm64
    assert not any("avx" in line for line in lines), lines


def test_socket_threads_pass_on_aarch64(tmp_path):
    sources = [CHECKS / "threaded_check.c", CSRC / "threaded.c", CSRC / "sender.c", CSRC / "wake.c",
               CSRC / "net.c", CSRC / "reduce.c", CSRC / "link.c"]
    exe = build(CROSS, sources, tmp_path / "threaded_check", True)
    proc = emulate(exe)
    assert proc.returncode == 0, proc.stderr.decode()[-3000:]
    lines = proc.stdout.decode().splitlines()
    assert len(lines) == CASES + SENDER_CASES and all(line.startswith("ok ") for line in lines), lines
    assert sum(" nan" in line for line in lines) == NAN_CASES


@pytest.mark.skipif(NATIVE is None, reason="no native C compiler to compare against")
def test_wire_probe_answers_match_the_native_build(tmp_path):
    sources = [CHECKS / "head_probe.c", CSRC / "wire.c"]
    arm = build(CROSS, sources, tmp_path / "probe_arm", True)
    host = build(NATIVE, sources, tmp_path / "probe_host", False)
    vectors = json.loads((ROOT / "tests" / "data" / "vectors.json").read_text())["vectors"]
    assert vectors
    for vector in vectors:
        payload = bytes.fromhex(vector["frame_hex"])[4:]
        want = subprocess.run([str(host), "0"], input=payload, capture_output=True, timeout=60)
        got = emulate(arm, "0", stdin=payload)
        assert want.returncode == 0 and got.returncode == 0, (vector["name"], got.stderr)
        assert b"head " in want.stdout
        assert got.stdout == want.stdout, vector["name"]
