"""Moving tensors between their device and the host bytes the wire carries.

A CPU tensor that is already contiguous goes out from where it lies. A CUDA
tensor is copied into a pinned host buffer with ``non_blocking`` on the
current stream, and the sending thread waits on an event recorded after that
copy (so backward keeps running while it lands); its result goes back from a
pinned buffer on a side stream, synchronised before the collective completes,
so whatever runs after completion sees the new values. MPS has no pinned
memory: plain copies, then a device synchronise. Host buffers are reused from
a pool keyed by size, since DDP sends the same buckets every step.
"""
from __future__ import annotations

import threading
from typing import Callable, Dict, List, Optional, Sequence, Tuple

import numpy as np
import torch

__all__ = ["HostPool", "DeviceCopies", "Staging", "byte_view"]


def byte_view(t: torch.Tensor) -> np.ndarray:
    """The elements of a contiguous CPU tensor as a uint8 numpy array (no copy)."""
    return t.reshape(-1).view(torch.uint8).numpy()


class HostPool:
    """Reusable host byte buffers; pinned when ``pin`` (CUDA)."""

    def __init__(self, pin: bool) -> None:
        self.pin = pin
        self._free: Dict[int, List[torch.Tensor]] = {}
        self._lock = threading.Lock()
        self.allocated = 0

    def take(self, nbytes: int) -> torch.Tensor:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        self.allocated += 1
        return torch.empty(nbytes, dtype=torch.uint8, pin_memory=self.pin)

    def give(self, buf: torch.Tensor) -> None:
        with self._lock:
            self._free.setdefault(buf.numel(), []).append(buf)


class DeviceCopies:
    """The device-specific half of staging, for one device type."""

    def __init__(self, device_type: str) -> None:
        self.device_type = device_type
        self._side: Dict[int, "torch.cuda.Stream"] = {}

    def to_host(self, dst: torch.Tensor, src: torch.Tensor) -> Optional[Callable[[], None]]:
        """Start copying ``src`` (flat, on the device) into host ``dst``;
        returns what the sending thread must call before reading ``dst``."""
        if self.device_type == "cuda":
            dst.copy_(src, non_blocking=True)
            event = torch.cuda.Event()
            event.record(torch.cuda.current_stream(src.device))
            return event.synchronize
        dst.copy_(src)
        if self.device_type == "mps":
            torch.mps.synchronize()
        return None

    def from_host(self, dst: torch.Tensor, src: torch.Tensor) -> None:
        """Copy host ``src`` into device ``dst`` and wait until it is there."""
        if self.device_type == "cuda":
            index = dst.device.index if dst.device.index is not None else torch.cuda.current_device()
            side = self._side.get(index)
            if side is None:
                side = self._side[index] = torch.cuda.Stream(device=index)
            with torch.cuda.stream(side):
                dst.copy_(src, non_blocking=True)
            side.synchronize()
            return
        dst.copy_(src)
        if self.device_type == "mps":
            torch.mps.synchronize()


class Staging:
    """Host bytes for a collective's inputs, and its result written back into
    its outputs in place. ``copies`` may be injected per device type (tests
    drive the pooling and ordering with CPU tensors)."""

    def __init__(self, copies: Optional[Dict[str, DeviceCopies]] = None,
                 pools: Optional[Dict[str, HostPool]] = None) -> None:
        self._copies = copies if copies is not None else {}
        self._pools = pools if pools is not None else {}

    def _for(self, device_type: str) -> Tuple[DeviceCopies, HostPool]:
        if device_type not in self._copies:
            self._copies[device_type] = DeviceCopies(device_type)
        if device_type not in self._pools:
            pin = device_type == "cuda" and torch.cuda.is_available()
            self._pools[device_type] = HostPool(pin)
        return self._copies[device_type], self._pools[device_type]

    def outgoing(self, tensors: Sequence[torch.Tensor]
                 ) -> Tuple[np.ndarray, Optional[Callable[[], None]], Callable[[], None]]:
        """(bytes to send, wait-before-send or None, release) for the
        concatenation of ``tensors``."""
        if len(tensors) == 1 and tensors[0].device.type == "cpu" and tensors[0].is_contiguous():
            return byte_view(tensors[0]), None, _nothing
        device_type = tensors[0].device.type
        nbytes = sum(t.numel() * t.element_size() for t in tensors)
        if device_type == "cpu":
            host = torch.empty(nbytes, dtype=torch.uint8)
            _fill(host, tensors, lambda dst, src: dst.copy_(src))
            return host.numpy(), None, _nothing
        copies, pool = self._for(device_type)
        host = pool.take(nbytes)
        waits: List[Callable[[], None]] = []

        def copy(dst: torch.Tensor, src: torch.Tensor) -> None:
            ready = copies.to_host(dst, src)
            if ready is not None:
                waits.append(ready)

        _fill(host, tensors, copy)

        def ready() -> None:
            for wait in waits:
                wait()

        return host.numpy(), (ready if waits else None), lambda: pool.give(host)

    def incoming(self, outputs: Sequence[torch.Tensor], data: np.ndarray) -> None:
        """Write ``data`` (the result's bytes, any dtype view) into
        ``outputs`` in order, in place."""
        raw = data.view(np.uint8).reshape(-1)
        offset = 0
        for t in outputs:
            n = t.numel() * t.element_size()
            chunk = raw[offset:offset + n]
            offset += n
            if t.device.type == "cpu":
                if t.is_contiguous():
                    dst = byte_view(t)
                    if dst.ctypes.data != chunk.ctypes.data:  # else it was received in place
                        np.copyto(dst, chunk)
                else:
                    t.copy_(_host_like(t, chunk))
                continue
            copies, pool = self._for(t.device.type)
            host = pool.take(n)
            np.copyto(host.numpy(), chunk)
            try:
                copies.from_host(t, host.view(t.dtype).view(t.shape))
            finally:
                pool.give(host)
        if offset != raw.size:
            raise ValueError(f"the result has {raw.size} bytes, the outputs hold {offset}")


    def landing(self, outputs: Sequence[torch.Tensor], byte_offset: int, nbytes: int) -> Optional[np.ndarray]:
        """Where a result of ``nbytes`` at ``byte_offset`` of ``outputs`` can
        be received in place: the bytes of a single contiguous CPU output;
        None otherwise (it is received elsewhere and copied)."""
        if len(outputs) != 1 or outputs[0].device.type != "cpu" or not outputs[0].is_contiguous():
            return None
        view = byte_view(outputs[0])
        if byte_offset + nbytes > view.size:
            return None
        return view[byte_offset:byte_offset + nbytes]

    def incoming_at(self, output: torch.Tensor, byte_offset: int, data: np.ndarray) -> None:
        """Write ``data`` into the bytes of contiguous ``output`` starting at
        ``byte_offset`` (one piece of a collective sent in pieces)."""
        raw = data.view(np.uint8).reshape(-1)
        size = output.element_size()
        if byte_offset % size or raw.size % size or byte_offset + raw.size > output.numel() * size:
            raise ValueError(f"{raw.size} result bytes at offset {byte_offset} do not fit "
                             f"{output.numel()} elements of {output.dtype}")
        if output.device.type == "cpu":
            dst = byte_view(output)[byte_offset:byte_offset + raw.size]
            if dst.ctypes.data != raw.ctypes.data:  # else it was received in place
                np.copyto(dst, raw)
            return
        copies, pool = self._for(output.device.type)
        host = pool.take(raw.size)
        np.copyto(host.numpy(), raw)
        try:
            start = byte_offset // size
            copies.from_host(output.view(-1)[start:start + raw.size // size], host.view(output.dtype))
        finally:
            pool.give(host)


def _nothing() -> None:
    return None


def _fill(host: torch.Tensor, tensors: Sequence[torch.Tensor],
          copy: Callable[[torch.Tensor, torch.Tensor], None]) -> None:
    offset = 0
    for t in tensors:
        n = t.numel() * t.element_size()
        dst = host[offset:offset + n].view(t.dtype)
        copy(dst, t.reshape(-1) if t.is_contiguous() else t.contiguous().reshape(-1))
        offset += n


def _host_like(t: torch.Tensor, chunk: np.ndarray) -> torch.Tensor:
    flat = torch.empty(chunk.size, dtype=torch.uint8)
    np.copyto(flat.numpy(), chunk)
    return flat.view(t.dtype).view(t.shape)
