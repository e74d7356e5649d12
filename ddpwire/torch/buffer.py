"""One preallocated float32 host buffer holding every trainable parameter's gradient.

The wire carries a model's gradients as one f32 vector (or, per block, one
vector per block), so the buffer lays the parameters out back to back in a
fixed order that every worker shares. It is allocated once; each step only
copies into it (``gather``) and out of it (``scatter``). On CUDA it is pinned
so the device-to-host copies can run asynchronously, and a device-side staging
copy lets ``scatter`` do one large host-to-device transfer instead of one per
parameter.

The layout is a sequence of :class:`Segment` (a transformer block, or a
non-block part such as ``lm_head``), each made of named :class:`Component`;
every segment occupies one contiguous slice, so a block's gradient is a slice
that can be sent as it is.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Dict, Iterable, List, Optional, Sequence, Tuple, Union

import numpy as np
import torch
from torch import nn

from ..wire.errors import GradientMismatch
from ..wire.messages import NON_BLOCK_COMPONENTS

__all__ = [
    "Component",
    "Segment",
    "GradientBuffer",
    "ParamsLike",
    "BLOCK_COMPONENTS",
    "NON_BLOCK_COMPONENTS",
    "block_segment",
]

logger = logging.getLogger(__name__)

ParamsLike = Union[nn.Module, nn.Parameter, Iterable[nn.Parameter]]


# The protocol's names: the 9 components of a transformer block, in wire order (the
# non-block parts, with the code each carries, are ddpwire.wire.messages.NON_BLOCK_COMPONENTS).
BLOCK_COMPONENTS: Tuple[str, ...] = (
    "w_q", "w_k", "w_v", "w_o", "gate", "up", "down", "input_norm", "post_attn_norm",
)


def block_segment(block_idx: int) -> str:
    """The segment name of transformer block ``block_idx`` in a layout."""
    return f"block.{block_idx}"


def _params(source: ParamsLike) -> Tuple[nn.Parameter, ...]:
    if isinstance(source, nn.Module):
        return tuple(source.parameters())
    if isinstance(source, torch.Tensor):
        return (source,)
    return tuple(source)


@dataclass(frozen=True)
class Component:
    """A named group of parameters; its size on the wire is their element count."""

    name: str
    params: Tuple[nn.Parameter, ...]

    @classmethod
    def of(cls, name: str, source: ParamsLike) -> "Component":
        """A component from a module (all its parameters), a parameter, or an iterable of them."""
        return cls(name, _params(source))


@dataclass(frozen=True)
class Segment:
    """A named, contiguous run of components: one block, or one non-block part."""

    name: str
    components: Tuple[Component, ...]

    @classmethod
    def of(cls, name: str, components: Sequence[Tuple[str, ParamsLike]]) -> "Segment":
        """A segment from ``(component_name, module_or_params)`` pairs, in wire order."""
        return cls(name, tuple(Component.of(c, src) for c, src in components))


@dataclass
class _Slot:
    param: nn.Parameter
    start: int
    end: int
    host: torch.Tensor  # view of the host buffer, shaped like param
    staging: Optional[torch.Tensor]  # view of the device staging buffer (CUDA only)


def _default_layout(source: ParamsLike) -> Tuple[Segment, ...]:
    if isinstance(source, nn.Module):
        named = [(n, p) for n, p in source.named_parameters() if p.requires_grad]
    else:
        named = [(f"param.{i}", p) for i, p in enumerate(_params(source)) if p.requires_grad]
    return (Segment("all", tuple(Component(n, (p,)) for n, p in named)),)


class GradientBuffer:
    """Flatten a model's gradients into one contiguous float32 CPU buffer and back.

    ``model_or_params`` is a module or an iterable of parameters; parameters
    with ``requires_grad=False`` are left out of the layout. ``device`` is the
    device the model trains on (default: that of the first parameter); on CUDA
    the host buffer is pinned. ``layout`` orders the parameters into segments
    and components; by default there is one segment, ``"all"``, with one
    component per parameter in ``parameters()`` order. A layout must name every
    trainable parameter exactly once, since a gradient left out would never be
    averaged and the workers' weights would drift apart.
    """

    def __init__(
        self,
        model_or_params: ParamsLike,
        device: Optional[Union[torch.device, str]] = None,
        *,
        layout: Optional[Sequence[Segment]] = None,
    ) -> None:
        trainable = [p for p in _params(model_or_params) if p.requires_grad]
        if device is None:
            device = trainable[0].device if trainable else torch.device("cpu")
        self.device = torch.device(device)
        self._cuda = self.device.type == "cuda"
        segments = tuple(layout) if layout is not None else _default_layout(model_or_params)
        self._check_layout(segments, trainable)

        ordered: List[Tuple[str, List[int], List[nn.Parameter]]] = []
        for seg in segments:
            sizes, params = [], []
            for comp in seg.components:
                live = [p for p in comp.params if p.requires_grad]
                sizes.append(sum(p.numel() for p in live))
                params.extend(live)
            ordered.append((seg.name, sizes, params))
        self.numel = sum(sum(sizes) for _, sizes, _ in ordered)

        # pinned memory lets non_blocking device-to-host copies overlap; pageable memory would make them synchronous
        self.tensor = torch.empty(self.numel, dtype=torch.float32, pin_memory=self._cuda)
        self.array: np.ndarray = self.tensor.numpy()
        self._staging = (
            torch.empty(self.numel, dtype=torch.float32, device=self.device) if self._cuda else None
        )

        self._slots: List[_Slot] = []
        self._ranges: Dict[str, Tuple[int, int, int, int]] = {}  # name -> start, end, first slot, last slot
        self._sizes: Dict[str, List[int]] = {}
        offset = 0
        for name, sizes, params in ordered:
            seg_start, first = offset, len(self._slots)
            for p in params:
                end = offset + p.numel()
                staging = self._staging[offset:end].view(p.shape) if self._staging is not None else None
                self._slots.append(_Slot(p, offset, end, self.tensor[offset:end].view(p.shape), staging))
                offset = end
            self._ranges[name] = (seg_start, offset, first, len(self._slots))
            self._sizes[name] = sizes
        self.segment_names: Tuple[str, ...] = tuple(self._ranges)
        logger.debug("gradient buffer: %d floats in %d segments on %s", self.numel, len(segments), self.device)

    @staticmethod
    def _check_layout(segments: Sequence[Segment], trainable: Sequence[nn.Parameter]) -> None:
        seen: Dict[int, str] = {}
        names = set()
        for seg in segments:
            if seg.name in names:
                raise ValueError(f"layout names segment {seg.name!r} twice")
            names.add(seg.name)
            for comp in seg.components:
                for p in comp.params:
                    if id(p) in seen:
                        raise ValueError(
                            f"a parameter appears in both {seen[id(p)]!r} and {seg.name}/{comp.name!r}"
                        )
                    seen[id(p)] = f"{seg.name}/{comp.name}"
        missing = [p for p in trainable if id(p) not in seen]
        if missing:
            shapes = ", ".join(str(tuple(p.shape)) for p in missing[:5])
            raise ValueError(f"layout leaves out {len(missing)} trainable parameter(s), shapes {shapes}")

    # ----- whole buffer -----

    def gather(self) -> np.ndarray:
        """Copy every trainable parameter's ``.grad`` into the buffer and return it.

        A parameter without a gradient (unused this step) contributes zeros.
        The returned array is the buffer itself, valid until the next call.
        """
        return self._gather(0, len(self._slots), self.array)

    def zero(self) -> np.ndarray:
        """Fill the buffer with zeros (a worker with an empty shard sends these)."""
        self.array.fill(0.0)
        return self.array

    def scatter(self, avg: Optional[object] = None) -> None:
        """Write the buffer (or ``avg``, any float32 buffer of ``numel`` elements) into each ``.grad``.

        ``.grad`` is created where it is ``None``; otherwise it is overwritten
        in place, so a step allocates nothing. On CUDA the copies are queued
        on the current stream without waiting: the host buffer is next written
        by the CPU only after the following ``gather`` has synchronized.
        """
        if avg is not None:
            src = self._as_float32(avg)
            if src.size != self.numel:
                raise GradientMismatch("gradients length", self.numel, src.size)
            if src.ctypes.data != self.array.ctypes.data:
                np.copyto(self.array, src)
        if self._staging is not None:
            self._staging.copy_(self.tensor, non_blocking=True)
        for slot in self._slots:
            source = slot.staging if slot.staging is not None else slot.host
            grad = slot.param.grad
            if grad is None:
                slot.param.grad = grad = torch.empty_like(slot.param)
            grad.copy_(source)

    # ----- segments (per-block sending) -----

    def segment_range(self, name: str) -> Tuple[int, int]:
        """The ``[start, end)`` element range of a segment in the buffer."""
        start, end, _, _ = self._range(name)
        return start, end

    def component_sizes(self, name: str) -> List[int]:
        """Element count of each component of a segment, in layout order."""
        self._range(name)
        return list(self._sizes[name])

    def segment_view(self, name: str) -> np.ndarray:
        """The segment's slice of the buffer (a view: writing it writes the buffer)."""
        start, end, _, _ = self._range(name)
        return self.array[start:end]

    def segment_params(self, name: str) -> Tuple[nn.Parameter, ...]:
        """The trainable parameters of a segment, in layout order."""
        _, _, first, last = self._range(name)
        return tuple(s.param for s in self._slots[first:last])

    def gather_segment(self, name: str) -> np.ndarray:
        """Copy one segment's gradients into its slice and return the slice."""
        start, end, first, last = self._range(name)
        return self._gather(first, last, self.array[start:end])

    # ----- internals -----

    def _range(self, name: str) -> Tuple[int, int, int, int]:
        try:
            return self._ranges[name]
        except KeyError:
            raise KeyError(f"no segment {name!r} in layout (have {', '.join(self._ranges)})") from None

    def _gather(self, first: int, last: int, out: np.ndarray) -> np.ndarray:
        for slot in self._slots[first:last]:
            grad = slot.param.grad
            if grad is None:
                slot.host.zero_()
            else:
                slot.host.copy_(grad, non_blocking=self._cuda)
        if self._cuda:
            # the copies above were only queued; numpy must not read the bytes before they land
            torch.cuda.synchronize(self.device)
        return out

    @staticmethod
    def _as_float32(avg: object) -> np.ndarray:
        if isinstance(avg, np.ndarray):
            if avg.dtype != np.float32:
                raise TypeError(f"averaged gradients must be float32, got {avg.dtype}")
            if not avg.flags.c_contiguous:
                raise TypeError("averaged gradients must be C-contiguous")
            return avg.reshape(-1)
        return np.frombuffer(avg, dtype=np.float32)  # type: ignore[call-overload]
