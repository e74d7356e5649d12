"""The one-line answer when the [torch] extra is missing, checked before
anything starts (and without importing torch, so the coordinator side stays
torch-free)."""
from __future__ import annotations

import importlib.util

from ..wire.errors import DdpwireError

__all__ = ["TorchMissing", "require_torch", "INSTALL_HINT"]

INSTALL_HINT = ("pip install 'ddpwire[torch]'  (Linux without a GPU: first "
                "pip install torch --index-url https://download.pytorch.org/whl/cpu)")

# what the demo models and data need: torch, and scikit-learn for the digits
_NEEDED = {"torch": "PyTorch", "sklearn": "scikit-learn"}


class TorchMissing(DdpwireError):
    """A command that trains was started where the [torch] extra is not installed."""


def require_torch(command: str) -> None:
    """Raise :class:`TorchMissing` naming ``command``, what is absent and how
    to install it, unless torch and scikit-learn can be imported."""
    missing = [label for module, label in _NEEDED.items() if not _importable(module)]
    if missing:
        raise TorchMissing(f"{command} needs {' and '.join(missing)}, not installed here: {INSTALL_HINT}")


def _importable(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False
