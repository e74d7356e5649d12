"""GradientBuffer: layout, gather/scatter round trips, segments, and the CUDA copy discipline (mocked)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")
from torch import nn  # noqa: E402

from ddpwire.wire.errors import GradientMismatch  # noqa: E402
from ddpwire.torch.buffer import GradientBuffer, Segment  # noqa: E402
from ddpwire.torch.models import TinyTransformer  # noqa: E402


class Odd(nn.Module):
    """A frozen layer in the middle and a parameter forward never touches."""

    def __init__(self) -> None:
        super().__init__()
        torch.manual_seed(3)
        self.a = nn.Linear(3, 4)
        self.frozen = nn.Linear(4, 4)
        self.frozen.requires_grad_(False)
        self.unused = nn.Parameter(torch.randn(5))
        self.b = nn.Linear(4, 2)

    def forward(self, x):
        return self.b(torch.tanh(self.frozen(self.a(x))))


def backward(model, rows=6, features=3):
    x = torch.randn(rows, features, generator=torch.Generator().manual_seed(1))
    model(x).square().sum().backward()


def trainable(model):
    return [p for p in model.parameters() if p.requires_grad]


def span(model, param):
    """Where ``param`` sits in the default layout (parameters() order, frozen ones skipped)."""
    offset = 0
    for p in trainable(model):
        if p is param:
            return slice(offset, offset + p.numel())
        offset += p.numel()
    raise AssertionError("not trainable")


def test_layout_skips_frozen_and_counts_unused():
    model = Odd()
    buf = GradientBuffer(model)
    assert buf.numel == (3 * 4 + 4) + 5 + (4 * 2 + 2)
    assert buf.array.dtype == np.float32 and buf.array.shape == (buf.numel,)
    assert buf.segment_names == ("all",)
    # a module's own parameters come before its children's in parameters() order
    assert buf.component_sizes("all") == [5, 12, 4, 8, 2]


def test_gather_copies_grads_and_zeros_for_unused():
    model = Odd()
    buf = GradientBuffer(model)
    buf.array.fill(np.nan)  # stale bytes must all be overwritten
    backward(model)
    assert model.unused.grad is None and model.frozen.weight.grad is None
    out = buf.gather()
    assert out is buf.array
    expected = np.concatenate(
        [p.grad.reshape(-1).numpy() if p.grad is not None else np.zeros(p.numel(), np.float32) for p in trainable(model)]
    )
    np.testing.assert_array_equal(out, expected)
    assert not out[span(model, model.unused)].any()
    assert np.abs(out).sum() > 0


def test_scatter_round_trip_creates_missing_grads_and_reuses_existing():
    model = Odd()
    buf = GradientBuffer(model)
    backward(model)
    avg = np.arange(buf.numel, dtype=np.float32) * np.float32(0.5)
    buf.scatter(avg)
    offset = 0
    for p in trainable(model):
        np.testing.assert_array_equal(p.grad.reshape(-1).numpy(), avg[offset : offset + p.numel()])
        offset += p.numel()
    assert model.frozen.weight.grad is None and model.frozen.bias.grad is None
    pointers = [p.grad.data_ptr() for p in trainable(model)]
    # the buffer itself as the source, and then a bytes-like average
    buf.array[:] = -avg
    buf.scatter()
    assert [p.grad.data_ptr() for p in trainable(model)] == pointers
    np.testing.assert_array_equal(model.a.weight.grad.reshape(-1).numpy(), -avg[span(model, model.a.weight)])
    buf.scatter(avg.tobytes())
    np.testing.assert_array_equal(model.unused.grad.numpy(), avg[span(model, model.unused)])
    np.testing.assert_array_equal(buf.gather(), avg)


def test_scatter_rejects_wrong_length_and_dtype():
    buf = GradientBuffer(Odd())
    with pytest.raises(GradientMismatch, match="gradients length mismatch: expected 31, got 30"):
        buf.scatter(np.zeros(30, np.float32))
    with pytest.raises(TypeError, match="float32"):
        buf.scatter(np.zeros(31, np.float64))


def test_explicit_parameter_list_and_default_device():
    model = Odd()
    buf = GradientBuffer([model.b.weight, model.a.bias])
    assert buf.numel == 8 + 4 and buf.device == torch.device("cpu")
    backward(model)
    np.testing.assert_array_equal(buf.gather()[:8], model.b.weight.grad.reshape(-1).numpy())


def test_transformer_layout_segments_are_contiguous_slices():
    model = TinyTransformer(vocab=8, dim=8, n_blocks=3, n_heads=2, ffn=12, max_len=6)
    layout = model.gradient_layout()
    buf = GradientBuffer(model, layout=layout)
    assert buf.numel == sum(p.numel() for p in model.parameters())
    assert buf.segment_names == ("embedding", "block.0", "block.1", "block.2", "final_norm", "lm_head")
    dim, ffn = 8, 12
    assert buf.component_sizes("block.1") == [dim * dim] * 4 + [ffn * dim] * 3 + [dim, dim]
    assert buf.component_sizes("embedding") == [8 * dim + 6 * dim]
    ends = [buf.segment_range(n) for n in buf.segment_names]
    assert ends[0][0] == 0 and ends[-1][1] == buf.numel
    assert all(a[1] == b[0] for a, b in zip(ends, ends[1:]))

    tokens = torch.randint(0, 8, (4, 6), generator=torch.Generator().manual_seed(0))
    model(tokens).sum().backward()
    buf.array.fill(7.0)
    view = buf.gather_segment("block.1")
    start, end = buf.segment_range("block.1")
    assert view.ctypes.data == buf.array[start:].ctypes.data and view.size == end - start
    expected = np.concatenate([p.grad.reshape(-1).numpy() for p in buf.segment_params("block.1")])
    np.testing.assert_array_equal(view, expected)
    assert (buf.array[:start] == 7.0).all() and (buf.array[end:] == 7.0).all()
    with pytest.raises(KeyError, match="block.9"):
        buf.segment_view("block.9")


def test_layout_must_cover_every_trainable_parameter_once():
    model = Odd()
    partial = [Segment.of("a", [("a", model.a)])]
    with pytest.raises(ValueError, match="leaves out 3 trainable"):
        GradientBuffer(model, layout=partial)
    twice = [Segment.of("x", [("a", model.a), ("b", model.b)]), Segment.of("y", [("u", model.unused), ("b", model.b)])]
    with pytest.raises(ValueError, match="appears in both"):
        GradientBuffer(model, layout=twice)
    # frozen parameters may be named in a layout; they take no room
    full = [Segment.of("x", [("a", model.a), ("frozen", model.frozen)]), Segment.of("y", [("u", model.unused), ("b", model.b)])]
    buf = GradientBuffer(model, layout=full)
    assert buf.component_sizes("x") == [16, 0]


@pytest.fixture
def fake_cuda(monkeypatch):
    """Run the CUDA path on the CPU: record pinning, non_blocking copies and synchronize calls."""
    calls = []
    real_empty, real_copy = torch.empty, torch.Tensor.copy_

    def empty(*args, **kwargs):
        calls.append(("empty", bool(kwargs.pop("pin_memory", False)), str(kwargs.pop("device", "cpu"))))
        return real_empty(*args, **kwargs)

    def copy_(self, src, non_blocking=False):
        calls.append(("copy", non_blocking))
        return real_copy(self, src, non_blocking)

    def synchronize(device=None):
        calls.append(("sync", str(device)))

    model = Odd()  # built before the patches: nn.Linear allocates with torch.empty too
    monkeypatch.setattr(torch, "empty", empty)
    monkeypatch.setattr(torch.Tensor, "copy_", copy_)
    monkeypatch.setattr(torch.cuda, "synchronize", synchronize)
    return model, calls


def test_cuda_path_pins_copies_non_blocking_then_synchronizes(fake_cuda):
    model, calls = fake_cuda
    buf = GradientBuffer(model, torch.device("cuda", 0))
    assert calls == [("empty", True, "cpu"), ("empty", False, "cuda:0")]  # pinned host buffer, device staging
    backward(model)
    calls.clear()
    out = buf.gather()
    used = [p for p in trainable(model) if p.grad is not None]
    assert calls == [("copy", True)] * len(used) + [("sync", "cuda:0")]
    np.testing.assert_array_equal(out[span(model, model.a.weight)], model.a.weight.grad.reshape(-1).numpy())

    calls.clear()
    avg = np.linspace(-1, 1, buf.numel, dtype=np.float32)
    buf.scatter(avg)
    # one host-to-device transfer of the whole buffer, then device-side copies into each .grad
    assert calls[0] == ("copy", True)
    assert calls[1:] == [("copy", False)] * len(trainable(model))
    assert not any(c[0] == "empty" for c in calls)
    np.testing.assert_array_equal(model.unused.grad.numpy(), avg[span(model, model.unused)])

    calls.clear()
    buf.gather_segment("all")
    assert calls[-1] == ("sync", "cuda:0") and all(c == ("copy", True) for c in calls[:-1])


def test_cpu_path_neither_pins_nor_synchronizes(fake_cuda):
    model, calls = fake_cuda
    buf = GradientBuffer(model, "cpu")
    assert calls == [("empty", False, "cpu")]
    backward(model)
    calls.clear()
    buf.gather()
    buf.scatter()
    assert calls and all(c == ("copy", False) for c in calls)
