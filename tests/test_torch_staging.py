"""Device staging through what runs on CPU: the pooled host buffers, the
wait before sending, and results written back in place, with the device
copies injected (the CUDA and MPS branches run on a device machine:
bench/device_check.sh)."""
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from ddpwire.torch.staging import DeviceCopies, HostPool, Staging, byte_view  # noqa: E402


class RecordingCopies(DeviceCopies):
    """The device half of staging for a pretend device whose tensors live on
    the CPU: records each copy and hands out the wait a CUDA event would."""

    def __init__(self):
        super().__init__("fake")
        self.log = []

    def to_host(self, dst, src):
        dst.copy_(src)
        self.log.append(("to_host", dst.numel()))
        return lambda: self.log.append(("ready", None))

    def from_host(self, dst, src):
        dst.copy_(src)
        self.log.append(("from_host", dst.numel()))


class FakeDevice:
    type = "fake"


class OnFake:
    """A CPU tensor that reports device "fake", so staging takes the device path."""

    def __init__(self, t):
        self.t = t
        self.device = FakeDevice()
        self.dtype = t.dtype

    def numel(self):
        return self.t.numel()

    def element_size(self):
        return self.t.element_size()

    def is_contiguous(self):
        return self.t.is_contiguous()

    def reshape(self, *shape):
        return self.t.reshape(*shape)

    def contiguous(self):
        return self.t.contiguous()

    def copy_(self, src, non_blocking=False):
        return self.t.copy_(src)

    def view(self, *shape):
        return self.t.view(*shape)

    @property
    def shape(self):
        return self.t.shape


def test_contiguous_cpu_tensor_goes_out_without_a_copy():
    t = torch.arange(6, dtype=torch.float32)
    data, ready, release = Staging().outgoing([t])
    assert ready is None
    assert data.ctypes.data == t.data_ptr() and data.nbytes == 24


def test_device_tensors_go_through_one_reused_host_buffer_per_size():
    copies = RecordingCopies()
    pool = HostPool(pin=False)
    staging = Staging(copies={"fake": copies}, pools={"fake": pool})
    a = OnFake(torch.arange(4, dtype=torch.float32))
    b = OnFake(torch.tensor([True, False, True]))
    for _ in range(3):
        data, ready, release = staging.outgoing([a])
        assert copies.log[-1] == ("to_host", 4)
        ready()  # the sending thread waits for the copy before reading data
        assert copies.log[-1] == ("ready", None)
        assert data.view(np.float32).tolist() == [0, 1, 2, 3]
        staging.incoming([a], (data.view(np.float32) * 2).view(np.uint8))
        assert a.t.tolist() == [0, 2, 4, 6] and copies.log[-1] == ("from_host", 4)
        release()
        a.t.copy_(torch.arange(4, dtype=torch.float32))
        data, ready, release = staging.outgoing([b])
        ready()
        release()
    # one buffer for each size in flight, reused every round, plus the result's
    assert pool.allocated <= 3


def test_several_inputs_are_concatenated_and_results_split_in_order():
    staging = Staging(copies={"fake": RecordingCopies()}, pools={"fake": HostPool(pin=False)})
    parts = [OnFake(torch.full((2,), float(i))) for i in range(3)]
    data, ready, release = staging.outgoing(parts)
    ready()
    assert data.view(np.float32).tolist() == [0, 0, 1, 1, 2, 2]
    outs = [torch.zeros(3, dtype=torch.float32), torch.zeros(3, dtype=torch.float32)]
    staging.incoming(outs, np.arange(6, dtype=np.float32).view(np.uint8))
    assert outs[0].tolist() == [0, 1, 2] and outs[1].tolist() == [3, 4, 5]
    with pytest.raises(ValueError, match="the outputs hold"):
        staging.incoming(outs, np.arange(7, dtype=np.float32).view(np.uint8))


def test_results_land_in_place_in_non_contiguous_and_bfloat16_tensors():
    base = torch.zeros(4, 4, dtype=torch.bfloat16)
    column = base[:, 1]
    want = torch.tensor([1.5, -2.0, 3.25, 0.5], dtype=torch.bfloat16)
    Staging().incoming([column], byte_view(want.clone()))
    assert torch.equal(base[:, 1], want) and base[:, 0].abs().sum() == 0
    data, ready, _ = Staging().outgoing([column])
    assert bytes(data) == bytes(byte_view(want.clone()))


def test_cuda_copies_are_pinned_and_asynchronous_when_cuda_is_there():
    if not torch.cuda.is_available():
        pool = Staging()._for("cuda")[1]
        assert pool.pin is False  # no CUDA: nothing to pin, and nothing asks for it
        return
    staging = Staging()
    t = torch.arange(1000, dtype=torch.float32, device="cuda")
    data, ready, release = staging.outgoing([t])
    assert ready is not None
    ready()
    assert staging._for("cuda")[1].pin
    assert data.view(np.float32)[999] == 999
    staging.incoming([t], (data.view(np.float32) + 1).view(np.uint8))
    assert t[0].item() == 1
    release()
