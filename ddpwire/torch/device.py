"""Pick the device a worker trains on, and what it tells the coordinator about it.

The order is CUDA, then Apple's MPS, then CPU. An explicit choice (argument, or
the ``DDPWIRE_DEVICE`` environment variable) wins, and naming a device this
machine lacks is an error rather than a silent fall back to CPU: a user who
asked for a GPU would otherwise train at CPU speed without noticing.
"""
from __future__ import annotations

import logging
import os
import re
from dataclasses import dataclass
from typing import Optional

import torch

from .._text import counted
from ..wire.errors import DeviceUnavailable

__all__ = ["DeviceChoice", "choose_device", "DEVICE_ENV"]

logger = logging.getLogger(__name__)

DEVICE_ENV = "DDPWIRE_DEVICE"
_SPEC = re.compile(r"^(cuda)(?::(\d+))?$|^(mps|cpu)$")


@dataclass(frozen=True)
class DeviceChoice:
    """The chosen device and the two JoinRequest fields that describe it.

    ``backend`` is ``"cuda"``, ``"mps"`` or ``"cpu"``; ``gpu_count`` is
    ``torch.cuda.device_count()`` for CUDA, 1 for MPS and 0 for CPU.
    """

    device: torch.device
    backend: str
    gpu_count: int


def _mps_available() -> bool:
    mps = getattr(torch.backends, "mps", None)
    return bool(mps is not None and mps.is_available())


def _parse(spec: str) -> tuple:
    match = _SPEC.match(spec.strip().lower())
    if match is None:
        raise ValueError(
            f"unknown device {spec!r}: expected 'cuda', 'cuda:<index>', 'mps' or 'cpu'"
        )
    if match.group(1):
        index = match.group(2)
        return "cuda", None if index is None else int(index)
    return match.group(3), None


def _cuda(index: Optional[int]) -> DeviceChoice:
    count = torch.cuda.device_count()
    device = torch.device("cuda") if index is None else torch.device("cuda", index)
    return DeviceChoice(device, "cuda", count)


def choose_device(override: Optional[str] = None) -> DeviceChoice:
    """Return the device to train on.

    ``override`` (or, when it is ``None``, the ``DDPWIRE_DEVICE`` environment
    variable) may be ``"cuda"``, ``"cuda:<index>"``, ``"mps"`` or ``"cpu"``.
    Raises :class:`ValueError` for any other spelling and
    :class:`~ddpwire.wire.errors.DeviceUnavailable` for a device that is not present.
    """
    source = "argument"
    if override is None:
        override = os.environ.get(DEVICE_ENV) or None
        source = DEVICE_ENV
    if override is None:
        if torch.cuda.is_available():
            choice = _cuda(None)
        elif _mps_available():
            choice = DeviceChoice(torch.device("mps"), "mps", 1)
        else:
            choice = DeviceChoice(torch.device("cpu"), "cpu", 0)
        logger.info("device %s chosen automatically", choice.device)
        return choice

    kind, index = _parse(override)
    if kind == "cuda":
        if not torch.cuda.is_available():
            raise DeviceUnavailable(f"device {override!r} (from {source}) asked for, but CUDA is not available")
        count = torch.cuda.device_count()
        if index is not None and index >= count:
            raise DeviceUnavailable(
                f"device {override!r} (from {source}) asked for, but only "
                f"{counted(count, 'CUDA device')} present"
            )
        choice = _cuda(index)
    elif kind == "mps":
        if not _mps_available():
            raise DeviceUnavailable(f"device {override!r} (from {source}) asked for, but MPS is not available")
        choice = DeviceChoice(torch.device("mps"), "mps", 1)
    else:
        choice = DeviceChoice(torch.device("cpu"), "cpu", 0)
    logger.info("device %s chosen by %s", choice.device, source)
    return choice
