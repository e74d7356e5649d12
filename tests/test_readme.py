"""The README's first screen as written: its two commands are the ones CI
runs and the ones that work here, through ./install.sh (which picks the
machine's torch build: tests/test_install_script.py)."""
from __future__ import annotations

import importlib.util
import re
import shlex
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
README = ROOT / "README.md"
CI = ROOT / ".ci" / "run"

pytestmark = pytest.mark.skipif(not CI.exists(), reason="the source tree's README and .ci/run")


def first_screen() -> list:
    """The commands of the README's first code block (comments left out)."""
    block = re.search(r"```bash\n(.*?)```", README.read_text(), re.S).group(1)
    return [line for line in block.splitlines() if line.strip() and not line.startswith("#")]


def test_the_first_screen_is_two_commands_install_then_use():
    demo, tests = first_screen()
    assert demo == ("python3 -m venv .venv && . .venv/bin/activate && ./install.sh && "
                    "ddpwire demo --workers 2")
    assert tests == "./install.sh --test && python -m pytest -q"


def test_ci_runs_the_readmes_test_command_as_written():
    tests = first_screen()[1]
    assert tests in CI.read_text().splitlines()


def test_the_install_section_says_what_install_sh_does_and_the_step_by_hand():
    text = README.read_text()
    section = text[text.index("**Linux without a GPU**"):]
    assert "`./install.sh`" in section
    assert "pip install torch --index-url https://download.pytorch.org/whl/cpu" in section


@pytest.mark.skipif(importlib.util.find_spec("torch") is None, reason="the demo needs torch")
def test_the_readmes_demo_command_runs_as_written():
    demo = first_screen()[0].split(" && ")[-1]
    argv = shlex.split(demo)
    assert argv[0] == "ddpwire"
    proc = subprocess.run([sys.executable, "-m", "ddpwire", *argv[1:]], capture_output=True,
                          text=True, timeout=600, stdin=subprocess.DEVNULL)
    assert proc.returncode == 0, proc.stderr
    assert "weights identical on all 2 workers" in proc.stdout
