"""./install.sh, the README's first command: the torch build it picks for the
machine it runs on (faked: uname, nvidia-smi and a Python without torch
on a PATH of stubs), and as it runs here (a torch that imports is kept)."""
from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path
from typing import List, Optional

import pytest

ROOT = Path(__file__).resolve().parent.parent
SCRIPT = ROOT / "install.sh"

pytestmark = pytest.mark.skipif(not SCRIPT.exists(), reason="the source tree's install.sh")

CPU_INDEX = "--index-url https://download.pytorch.org/whl/cpu"


def _stub(path: Path, body: str) -> None:
    path.write_text("#!/bin/sh\n" + body + "\n")
    path.chmod(0o755)


def run_faked(tmp_path: Path, system: str, gpu: Optional[bool], *args: str) -> List[str]:
    """``install.sh --dry-run`` on a machine that says ``system`` to uname,
    with an NVIDIA GPU (True), an nvidia-smi that finds none (False) or no
    nvidia-smi (None), and a Python without torch: the lines it prints."""
    bin_ = tmp_path / "bin"
    bin_.mkdir()
    _stub(bin_ / "uname", f"echo {system}")
    if gpu is not None:
        _stub(bin_ / "nvidia-smi", "echo 'GPU 0: NVIDIA H100'; exit 0" if gpu else
              "echo 'NVIDIA-SMI has failed' >&2; exit 9")
    # a Python without torch: the import check fails, anything else would run
    _stub(bin_ / "python", 'case "$*" in *"import torch"*) exit 1;; esac; echo "ran $*"')
    for tool in ("sed", "dirname"):  # what the script needs besides the stubs
        found = subprocess.run(["sh", "-c", f"command -v {tool}"], capture_output=True,
                               text=True).stdout.strip()
        os.symlink(found, bin_ / tool)
    proc = subprocess.run(["/bin/sh", str(SCRIPT), "--dry-run", *args], capture_output=True,
                          text=True, timeout=60, env={"PATH": str(bin_), "HOME": str(tmp_path)})
    assert proc.returncode == 0, proc.stderr
    return proc.stdout.splitlines()


def test_linux_without_an_nvidia_gpu_takes_torchs_cpu_build(tmp_path):
    out = run_faked(tmp_path, "Linux", None)
    assert f"+ python -m pip install torch {CPU_INDEX}" in out
    assert out[-1] == "+ python -m pip install -e .[torch]"


def test_an_nvidia_smi_that_finds_no_gpu_is_no_gpu(tmp_path):
    out = run_faked(tmp_path, "Linux", False)
    assert f"+ python -m pip install torch {CPU_INDEX}" in out


def test_linux_with_an_nvidia_gpu_takes_pypis_cuda_build(tmp_path):
    out = run_faked(tmp_path, "Linux", True)
    assert "+ python -m pip install torch" in out
    assert not any(CPU_INDEX in line for line in out)


def test_macos_takes_pypis_torch(tmp_path):
    out = run_faked(tmp_path, "Darwin", None, "--test")
    assert "+ python -m pip install torch" in out
    assert out[-1] == "+ python -m pip install -e .[test,torch]"


def test_an_unknown_option_is_refused_with_exit_2(tmp_path):
    proc = subprocess.run(["/bin/sh", str(SCRIPT), "--cuda"], capture_output=True, text=True,
                          timeout=60)
    assert proc.returncode == 2
    assert "unknown option '--cuda'" in proc.stderr


def test_here_the_installed_torch_is_kept():
    pytest.importorskip("torch")
    import torch
    env = dict(os.environ, PYTHON=sys.executable)
    proc = subprocess.run(["/bin/sh", str(SCRIPT), "--dry-run", "--test"], capture_output=True,
                          text=True, timeout=120, env=env)
    assert proc.returncode == 0, proc.stderr
    lines = proc.stdout.splitlines()
    assert lines[0] == f"torch {torch.__version__} is installed: kept"
    assert lines[1:] == [f"+ {sys.executable} -m pip install -e .[test,torch]"]
