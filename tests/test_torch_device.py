"""Device choice: automatic fallback order, overrides, and errors for absent devices."""
import pytest

torch = pytest.importorskip("torch")

from ddpwire.wire.errors import DeviceUnavailable  # noqa: E402
from ddpwire.torch.device import DEVICE_ENV, choose_device  # noqa: E402


@pytest.fixture
def machine(monkeypatch):
    """Pretend the machine has the given accelerators."""
    monkeypatch.delenv(DEVICE_ENV, raising=False)

    def set_(cuda: int = 0, mps: bool = False) -> None:
        monkeypatch.setattr(torch.cuda, "is_available", lambda: cuda > 0)
        monkeypatch.setattr(torch.cuda, "device_count", lambda: cuda)
        monkeypatch.setattr(torch.backends.mps, "is_available", lambda: mps)

    return set_


def test_cpu_when_nothing_else(machine):
    machine(cuda=0, mps=False)
    choice = choose_device()
    assert choice.device == torch.device("cpu")
    assert (choice.backend, choice.gpu_count) == ("cpu", 0)


def test_cuda_first_and_counts_gpus(machine):
    machine(cuda=2, mps=True)
    choice = choose_device()
    assert choice.device.type == "cuda"
    assert (choice.backend, choice.gpu_count) == ("cuda", 2)


def test_mps_when_no_cuda(machine):
    machine(cuda=0, mps=True)
    choice = choose_device()
    assert choice.device == torch.device("mps")
    assert (choice.backend, choice.gpu_count) == ("mps", 1)


def test_argument_overrides_automatic_choice(machine):
    machine(cuda=2, mps=True)
    assert choose_device("cpu").backend == "cpu"
    assert choose_device("mps").device == torch.device("mps")
    choice = choose_device("cuda:1")
    assert choice.device == torch.device("cuda", 1)
    assert (choice.backend, choice.gpu_count) == ("cuda", 2)


def test_env_override_and_argument_precedence(machine, monkeypatch):
    machine(cuda=1, mps=False)
    monkeypatch.setenv(DEVICE_ENV, "cpu")
    assert choose_device().device == torch.device("cpu")
    assert choose_device("cuda").backend == "cuda"  # the argument beats the environment
    monkeypatch.setenv(DEVICE_ENV, "CUDA:0")
    assert choose_device().device == torch.device("cuda", 0)


@pytest.mark.parametrize(
    "spec, cuda, mps, needle",
    [
        ("cuda", 0, True, "CUDA is not available"),
        ("cuda:1", 1, False, "only 1 CUDA device"),
        ("mps", 2, False, "MPS is not available"),
    ],
)
def test_absent_device_is_an_error(machine, spec, cuda, mps, needle):
    machine(cuda=cuda, mps=mps)
    with pytest.raises(DeviceUnavailable, match=needle):
        choose_device(spec)


def test_absent_device_from_env_names_the_variable(machine, monkeypatch):
    machine(cuda=0, mps=False)
    monkeypatch.setenv(DEVICE_ENV, "cuda:0")
    with pytest.raises(DeviceUnavailable, match=DEVICE_ENV):
        choose_device()


@pytest.mark.parametrize("spec", ["tpu", "cuda:", "cuda:x", "gpu", ""])
def test_unknown_spelling_is_a_value_error(machine, spec):
    machine(cuda=1, mps=True)
    with pytest.raises(ValueError, match="unknown device"):
        choose_device(spec)
