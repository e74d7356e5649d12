"""ddpwire.torch.comm_hook: DDP on a gloo process group, each bucket averaged
by a ddpwire coordinator speaking only the reference block messages."""
import threading

import pytest

torch = pytest.importorskip("torch")

from ddpwire import Coordinator  # noqa: E402
from ddpwire.torch.comm_hook import serve_comm_hook  # noqa: E402
from test_torch_backend import finish, load, start_ranks  # noqa: E402

pytestmark = pytest.mark.slow


def test_comm_hook_on_gloo_matches_plain_gloo(tmp_path):
    world = 2
    token = "comm-hook-test"  # no stray process may take a worker's slot
    coord = Coordinator(("127.0.0.1", 0), world, timeout=30, join_timeout=60, token=token)
    served = {}

    def serve():
        try:
            coord.wait_for_workers()
            served["steps"] = serve_comm_hook(coord)
        except BaseException as exc:  # noqa: BLE001 - reported by the assertion below
            served["error"] = exc

    thread = threading.Thread(target=serve, daemon=True)
    thread.start()
    out = tmp_path / "run"
    host, port = coord.local_addr
    codes, outputs = finish(start_ranks(world, out, ["gloo", "gloo+hook"], torchrun_env=False,
                                        extra={"DDP_HOOK_ADDR": f"{host}:{port}",
                                               "DDPWIRE_TOKEN": token, "DDP_TIMEOUT": "30"}))
    thread.join(30)
    coord.close()
    assert codes == [0] * world, "\n".join(outputs) + repr(served)
    assert "error" not in served, served
    assert served["steps"] == 6  # DDP_STEPS iterations, every bucket of each
    plain = [load(out, "gloo", r) for r in range(world)]
    hooked = [load(out, "gloo+hook", r) for r in range(world)]
    for name, value in hooked[0]["state"].items():
        if "running" in name or "num_batches" in name:
            continue
        assert torch.equal(value, hooked[1]["state"][name]), name
        torch.testing.assert_close(value, plain[0]["state"][name], rtol=1e-5, atol=1e-6)
