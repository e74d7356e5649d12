"""csrc/threaded.c and csrc/sender.c on their own: the coordinator's socket
threads and the worker's sending thread driven over socketpairs
(tests/c/threaded_check.c) under ThreadSanitizer, and under AddressSanitizer
with UBSan: bit-identical means, NaN halts that send nothing holding the NaN,
replies finished past a NaN when asked to, a peer closing mid-stream named, a
send called off while blocked, with no data race."""
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler on PATH")

SOURCES = [ROOT / "tests" / "c" / "threaded_check.c", CSRC / "threaded.c", CSRC / "sender.c",
           CSRC / "wake.c", CSRC / "net.c", CSRC / "reduce.c", CSRC / "link.c"]
CASES = 42  # run_case calls in threaded_check.c's main
SENDER_CASES = 4  # run_sender_case calls
NAN_CASES = 8  # run_case calls with a NaN
FINISH_CASES = 4  # of those, the ones that finish the reply past it


@pytest.mark.parametrize("sanitizer", ["thread", "address,undefined"])
def test_socket_threads_under_sanitizer(tmp_path, sanitizer):
    exe = tmp_path / "threaded_check"
    build = subprocess.run(
        [CC, "-std=c99", "-O1", "-g", "-Wall", "-Wextra", "-Werror", f"-fsanitize={sanitizer}",
         "-fno-sanitize-recover=all", f"-I{CSRC}", *SOURCES, "-o", exe, "-lpthread", "-lm"],
        capture_output=True, text=True)
    assert build.returncode == 0, build.stderr
    run = subprocess.run([exe], capture_output=True, text=True, timeout=600)
    # a sanitizer report fails the run (exit code) and is printed on stderr
    assert run.returncode == 0, run.stderr[-4000:]
    assert "WARNING" not in run.stderr and "ERROR" not in run.stderr, run.stderr[-4000:]
    lines = run.stdout.splitlines()
    assert len(lines) == CASES + SENDER_CASES, run.stdout
    assert all(line.startswith("ok ") for line in lines), run.stdout
    assert sum(" nan" in line for line in lines) == NAN_CASES
    assert sum(" finish" in line for line in lines) == FINISH_CASES
    assert sum(" cut" in line for line in lines) == 2
    assert sum(line.startswith("ok sender") for line in lines) == SENDER_CASES
    assert sum(" stopped" in line for line in lines) == 1
