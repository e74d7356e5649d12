"""A gradient or result buffer a step cannot send or fill is refused before
anything goes on the wire, with one message on every path (issue 18, item 1:
float64 gradients were averaged into garbage on the mesh, silently)."""
from __future__ import annotations

import numpy as np
import pytest

from ddpwire import _core
from mesh_session import Session
from session_helpers import reference_allreduce

FLOAT64 = (r"GradientPayload\.gradients: expected a C-contiguous float32 buffer .*"
           r"got numpy\.ndarray of dtype float64")

# every flat path a Worker's allreduce can take
PATHS = {
    "star": dict(topology="star"),
    "mesh-shared-memory": dict(topology="mesh"),
    "mesh-tcp": dict(topology="mesh", shared_memory=False),
    "mesh-share": dict(topology="mesh", shared_memory=False, coordinator_share=0.25),
}


def _bad_then_good(grads, errors):
    """A body: every refused call first (float64 gradients through allreduce
    and through send_gradients, a float64 and a read-only ``out``), then one
    good step, which must come out exact: the refusals sent nothing."""
    def body(w):
        g = grads[w.worker_id]
        seen = []
        with pytest.raises(TypeError, match=FLOAT64):
            w.allreduce(0, g.astype(np.float64), 1.0, 1, 1)
        with pytest.raises(TypeError, match=FLOAT64):
            w.send_gradients(0, g.astype(np.float64), 1.0, 1, 1)
        with pytest.raises(TypeError, match="out: expected a writable 1-D C-contiguous float32"):
            w.allreduce(0, g, 1.0, 1, 1, out=np.empty(len(g), dtype=np.float64))
        frozen = np.empty(len(g), dtype=np.float32)
        frozen.flags.writeable = False
        with pytest.raises(TypeError, match="read-only"):
            w.allreduce(0, g, 1.0, 1, 1, out=frozen)
        with pytest.raises(ValueError, match="out: has 3 elements, the gradients have"):
            w.allreduce(0, g, 1.0, 1, 1, out=np.empty(3, dtype=np.float32))
        seen.append("refused")
        errors[w.worker_id] = seen
        return w.allreduce(0, g, 1.0, 1, 1).gradients.copy()
    return body


@pytest.mark.parametrize("path", sorted(PATHS))
def test_a_buffer_that_cannot_be_sent_is_refused_and_the_session_goes_on(path):
    count = 4099 if path == "mesh-share" else 1000
    rng = np.random.default_rng(7)
    grads = [rng.standard_normal(count).astype(np.float32) for _ in range(3)]
    refused = {}
    s = Session(3, _bad_then_good(grads, refused), coordinator=PATHS[path])
    try:
        s.coord.allreduce(0)
    finally:
        s.join()
    assert not s.errors, s.errors
    assert sorted(refused) == [0, 1, 2]
    want = reference_allreduce(grads)
    for wid in range(3):
        assert np.array_equal(s.results[wid].view(np.uint32), want.view(np.uint32))


def test_the_readme_snippet_with_numpy_default_dtype_is_refused():
    # the README's `np.full(4, 1.0 + shard.shard_start)` is float64
    with pytest.raises(TypeError, match=FLOAT64):
        _core.float32_gradients(np.full(4, 1.0))
    view = _core.float32_gradients(np.arange(6, dtype=np.float32).reshape(2, 3))
    assert view.dtype == np.float32 and view.shape == (6,)


def test_a_refused_buffer_names_what_it_is():
    with pytest.raises(TypeError, match=r"got numpy\.ndarray of dtype float32, not C-contiguous"):
        _core.float32_gradients(np.zeros((4, 4), dtype=np.float32)[:, 0])
    with pytest.raises(TypeError, match=r"BlockGradientPayload\.gradients: .* got list"):
        _core.float32_gradients([1.0, 2.0], "BlockGradientPayload.gradients")
