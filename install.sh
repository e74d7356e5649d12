#!/bin/sh
# Install ddpwire from this checkout with the torch build that fits this
# machine, into the Python that runs it ($PYTHON, else python, else python3:
# activate a virtual environment first).
#
#   ./install.sh            ddpwire and torch (the workers, the demo)
#   ./install.sh --test     the same and what the tests need
#   ./install.sh --dry-run  print the commands and run none
#
# Why a script: pip's default torch for Linux is the CUDA build (about 3 GB of
# wheels), useless on a machine without an NVIDIA GPU, and no package extra
# can say "from torch's CPU index". The choice, and why:
#   - a torch that imports already is kept (a pinned or custom build);
#   - Linux with an NVIDIA GPU (nvidia-smi lists one), macOS (MPS) and
#     anything else: PyPI's torch;
#   - Linux without one: torch's CPU build from download.pytorch.org.
set -eu

extra="torch"
dry=""
for arg in "$@"; do
    case "$arg" in
        --test) extra="test,torch" ;;
        --dry-run) dry=1 ;;
        -h|--help) sed -n '2,16p' "$0" | sed 's/^# \{0,1\}//'; exit 0 ;;
        *) echo "install.sh: unknown option '$arg' (--test, --dry-run, --help)" >&2; exit 2 ;;
    esac
done

if [ -z "${PYTHON:-}" ]; then
    if command -v python >/dev/null 2>&1; then PYTHON=python; else PYTHON=python3; fi
fi
cd "$(dirname "$0")"

run() {
    echo "+ $*"
    [ -n "$dry" ] || "$@"
}

if have=$("$PYTHON" -c 'import torch; print(torch.__version__)' 2>/dev/null); then
    echo "torch $have is installed: kept"
else
    case "$(uname -s)" in
        Linux)
            if command -v nvidia-smi >/dev/null 2>&1 && nvidia-smi -L >/dev/null 2>&1; then
                echo "an NVIDIA GPU: PyPI's torch (the CUDA build)"
                run "$PYTHON" -m pip install torch
            else
                echo "no NVIDIA GPU: torch's CPU build (pip's default would be the 3 GB CUDA one)"
                run "$PYTHON" -m pip install torch --index-url https://download.pytorch.org/whl/cpu
            fi ;;
        *)
            run "$PYTHON" -m pip install torch ;;
    esac
fi
run "$PYTHON" -m pip install -e ".[$extra]"
