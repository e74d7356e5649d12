"""csrc/sealed.c on its own, under AddressSanitizer with UBSan
(tests/c/sealed_check.c): the resume paths of a sealed link that a session
takes only by chance. Records that a small socket takes a piece at a time,
read in every size of call and with peeks between; a receiver that never
takes a byte of the next record past what it wants; a record that went
nowhere sealed afresh with the caller's new bytes; a caller that changes
its bytes after part of a record went out refused."""
import pathlib
import shutil
import subprocess

import pytest

from ddpwire.wire import seal

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")

LINES = [
    "ok sizes 1", "ok sizes 7", "ok sizes 65536", "ok sizes 65537", "ok sizes 200000",
    "ok sizes 200929", "ok sizes 1000 peek", "ok sizes 65537 peek", "ok want", "ok reseal",
    "ok changed",
]


@pytest.mark.skipif(CC is None, reason="no C compiler on PATH")
def test_sealed_link_paths_under_sanitizer(tmp_path):
    exe = tmp_path / "sealed_check"
    build = subprocess.run(
        [CC, "-std=c99", "-O1", "-g", "-Wall", "-Wextra", "-Werror",
         "-fsanitize=address,undefined", "-fno-sanitize-recover=all", f"-I{CSRC}",
         ROOT / "tests" / "c" / "sealed_check.c",
         *(CSRC / name for name in ("sealed.c", "aead.c", "link.c")),
         "-o", exe, "-ldl"],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([exe, seal.load_libcrypto()], capture_output=True, text=True,
                         timeout=600)
    assert run.returncode == 0, run.stdout[-2000:] + run.stderr[-4000:]
    assert "ERROR" not in run.stderr, run.stderr[-4000:]
    assert run.stdout.splitlines() == LINES
