"""csrc/ under clang with warnings as errors: macOS wheels are built by
clang, so every unit and every branch a define selects must compile warning
free with it, for x86_64 and for arm64 (the Linux aarch64 target stands in
for Apple silicon's instruction set; the __APPLE__ header lines themselves
need Apple's SDK and are built by the wheels workflow). The C checks built
with clang also run here.

Needs clang (.ci/run installs it); skips with that reason where absent."""
from __future__ import annotations

import pathlib
import shutil
import subprocess

import pytest

from test_exchange_many import EXCHANGE_CHECK_LINES
from test_threaded_c import CASES, SENDER_CASES

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
CHECKS = ROOT / "tests" / "c"
CLANG = shutil.which("clang")
ARM_HEADERS = pathlib.Path("/usr/aarch64-linux-gnu/include")

pytestmark = pytest.mark.skipif(CLANG is None, reason="needs clang (apt-get install clang)")

FLAGS = ["-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic"]
DEFINES = [[], ["-DDDPW_REDUCE_PORTABLE_ONLY"], ["-DDDPW_REDUCE_NO_THREADS"]]


def compile_unit(target: list, source: str, defines: list, opt: str, out: pathlib.Path) -> None:
    cmd = [CLANG, *target, *FLAGS, opt, *defines, "-c", str(CSRC / source), "-o", str(out)]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(cmd)}\n{proc.stderr}"
    assert proc.stderr == ""


@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.c")))
@pytest.mark.parametrize("defines", DEFINES, ids=["default", "portable-only", "no-threads"])
@pytest.mark.parametrize("opt", ["-O0", "-O3"])
def test_every_unit_compiles_under_clang_werror(tmp_path, source, defines, opt):
    compile_unit([], source, defines, opt, tmp_path / "u.o")


@pytest.mark.skipif(not ARM_HEADERS.is_dir(),
                    reason="no aarch64 C headers (apt-get install gcc-aarch64-linux-gnu)")
@pytest.mark.parametrize("source", sorted(p.name for p in CSRC.glob("*.c")))
@pytest.mark.parametrize("defines", DEFINES, ids=["default", "portable-only", "no-threads"])
def test_every_unit_compiles_under_clang_for_arm64(tmp_path, source, defines):
    out = tmp_path / "u.o"
    compile_unit(["--target=aarch64-linux-gnu"], source, defines, "-O2", out)
    assert out.read_bytes()[18:20] == (183).to_bytes(2, "little")  # EM_AARCH64


def build_and_run(tmp_path: pathlib.Path, name: str, sources: list) -> list:
    exe = tmp_path / name
    cmd = [CLANG, *FLAGS, "-O2", f"-I{CSRC}", *map(str, sources), "-o", str(exe), "-lpthread", "-lm",
           "-ldl"]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    assert proc.returncode == 0, proc.stderr
    run = subprocess.run([str(exe)], capture_output=True, text=True, timeout=600)
    assert run.returncode == 0, run.stderr[-3000:]
    return run.stdout.splitlines()


def test_reduce_checks_pass_when_built_by_clang(tmp_path):
    lines = build_and_run(tmp_path, "reduce_check", [CHECKS / "reduce_check.c", CSRC / "reduce.c"])
    assert "path portable ok" in lines


def test_socket_threads_pass_when_built_by_clang(tmp_path):
    lines = build_and_run(tmp_path, "threaded_check", [
        CHECKS / "threaded_check.c", CSRC / "threaded.c", CSRC / "sender.c", CSRC / "wake.c",
        CSRC / "net.c", CSRC / "reduce.c", CSRC / "link.c"])
    assert len(lines) == CASES + SENDER_CASES and all(line.startswith("ok ") for line in lines)


def test_exchange_many_checks_pass_when_built_by_clang(tmp_path):
    lines = build_and_run(tmp_path, "exchange_check", [
        CHECKS / "exchange_check.c", CSRC / "net.c", CSRC / "reduce.c", CSRC / "link.c",
        CSRC / "sealed.c", CSRC / "aead.c"])
    assert lines == EXCHANGE_CHECK_LINES
