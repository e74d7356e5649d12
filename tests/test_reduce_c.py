"""csrc/reduce.c on its own: strict C99 without warnings, and its C API under
AddressSanitizer and UBSan (float-aligned pointers, every path, thread splits)."""
import pathlib
import shutil
import subprocess

import pytest

ROOT = pathlib.Path(__file__).resolve().parent.parent
CSRC = ROOT / "csrc"
CC = shutil.which("cc") or shutil.which("gcc") or shutil.which("clang")

pytestmark = pytest.mark.skipif(CC is None, reason="no C compiler on PATH")


def run(args, cwd):
    proc = subprocess.run(args, cwd=cwd, capture_output=True, text=True)
    assert proc.returncode == 0, f"{' '.join(map(str, args))}\n{proc.stdout}\n{proc.stderr}"
    return proc


@pytest.mark.parametrize(
    "defines",
    [[], ["-DDDPW_REDUCE_PORTABLE_ONLY"], ["-DDDPW_REDUCE_NO_THREADS"]],
    ids=["default", "portable-only", "no-threads"],
)
@pytest.mark.parametrize("opt", ["-O0", "-O3"])
def test_reduce_c_compiles_as_strict_c99(tmp_path, defines, opt):
    proc = run(
        [CC, "-std=c99", "-Wall", "-Wextra", "-Werror", "-pedantic", opt, *defines,
         "-c", CSRC / "reduce.c", "-o", tmp_path / "reduce.o"],
        tmp_path,
    )
    assert proc.stderr == ""
    assert (tmp_path / "reduce.o").stat().st_size > 0


def test_c_api_under_sanitizers(tmp_path):
    exe = tmp_path / "reduce_check"
    run(
        [CC, "-std=c99", "-O1", "-g", "-Wall", "-Wextra", "-Werror",
         "-fsanitize=address,undefined", "-fno-sanitize-recover=all", f"-I{CSRC}",
         ROOT / "tests" / "c" / "reduce_check.c", CSRC / "reduce.c",
         "-o", exe, "-lpthread", "-lm"],
        tmp_path,
    )
    proc = run([exe], tmp_path)
    assert "path portable ok" in proc.stdout


def test_kernel_settings_are_process_wide():
    """The kernels' SIMD path and threads live in one compiled module, so what
    ddpwire.plane.reduce sets is what the socket layer's streaming reduce uses."""
    import glob
    import os

    import ddpwire
    from ddpwire import _core
    from ddpwire.plane import reduce

    here = os.path.dirname(ddpwire.__file__)
    compiled = sorted(os.path.basename(p).split(".")[0]
                      for p in glob.glob(os.path.join(here, "*.so")) + glob.glob(os.path.join(here, "*.pyd")))
    assert compiled == ["_core"]
    before = reduce.current_path()
    try:
        reduce.use_path("portable")
        assert _core.current_path() == "portable"
    finally:
        reduce.use_path(before)
