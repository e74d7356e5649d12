"""Every flat allreduce path against the one reference, bit for bit.

The reference is tests/session_helpers.py reference_allreduce (a float32
sum in member order, a true division for AVG; for 16-bit codecs each input
and the result rounded once to 16 bits; for int8 once each through the
codec's blocks). The paths:

* sessions (a real Coordinator, Workers in threads, loopback TCP): the
  star and the mesh; on the mesh float32, bf16, fp16 and int8; the links or the
  shared segment; 1 to 4 workers; a coordinator share of 0 or 0.25 (which
  float32 over the links allows); and unequal or zero fractions handed to
  each worker's Mesh (MeshPeers carries none: only a Mesh made with
  fractions cuts unequally, so the test hands them to Mesh.connect), on the
  links and on the shared segment alike;
* Mesh runners on links made here: unequal and zero fractions, SUM and
  AVG in float32, bf16, fp16 and int8, the exchange's kernels in their
  default ranges and in ranges of a few elements;
* the torch backend's RankLinks, set up through a fake service: the same
  fractions, SUM and AVG, float32, 16-bit and int8 buckets.

Vectors are small (a few thousand elements, some slices empty) so the whole
matrix stays quick on two cores.
"""
from __future__ import annotations

import threading
from typing import List, NamedTuple, Optional

import numpy as np
import pytest

from ddpwire import _core
from ddpwire.plane import codecs
from ddpwire.plane import mesh as meshmod
from ddpwire.plane import plan as planmod
from ddpwire.wire.errors import GradientMismatch
from ddpwire.wire.extensions import ReduceOp
from ddpwire.wire.messages import NO_WORKER

from mesh_session import bits, gradients, mesh_allreduce, mesh_group, run_flat_steps
from session_helpers import reference_allreduce, to_half_bits

COUNT = 3001  # odd: slices of unequal length, and a coordinator part that is not a slice's


class Case(NamedTuple):
    topology: str
    codec: Optional[str]
    transport: str          # "links" (DDPWIRE_SHM=0) or "shm" (the default on loopback)
    n: int
    share: float
    fractions: Optional[tuple] = None

    @property
    def id(self) -> str:
        parts = [self.topology, self.codec or "float32", self.transport, f"n{self.n}",
                 f"share{self.share:g}"]
        if self.fractions is not None:
            parts.append("fractions" + ":".join(f"{f:g}" for f in self.fractions))
        return "-".join(parts)

    @property
    def shared_plane(self) -> bool:
        """Whether the steps go through the shared segment: float32 on the
        mesh of 2+ workers with it on (any fractions: the segment is cut by
        the same plan as the links)."""
        return (self.topology == "mesh" and self.transport == "shm" and self.codec is None
                and self.n >= 2)


def _session_cases() -> List[Case]:
    cases = []
    for n in (1, 2, 3, 4):
        # the star: float32 through the coordinator, no plane, no share
        cases.append(Case("star", None, "links", n, 0.0))
        cases.append(Case("mesh", None, "links", n, 0.0))
        cases.append(Case("mesh", None, "shm", n, 0.0))
        for codec in ("bf16", "fp16", "int8"):  # compressed words travel on the links only
            cases.append(Case("mesh", codec, "links", n, 0.0))
        if n >= 2:  # a share needs float32 over the links
            cases.append(Case("mesh", None, "links", n, 0.25))
    cases += [
        Case("mesh", None, "links", 3, 0.25, (0.0, 1.0, 2.0)),
        Case("mesh", None, "links", 4, 0.25, (0.1, 0.2, 0.3, 0.4)),
        Case("mesh", None, "links", 4, 0.0, (0.0, 0.0, 0.0, 1.0)),
        Case("mesh", None, "links", 2, 0.0, (3.0, 1.0)),
        Case("mesh", "bf16", "links", 3, 0.0, (1.0, 0.0, 1.0)),
        Case("mesh", "fp16", "links", 2, 0.0, (0.0, 1.0)),
        Case("mesh", "int8", "links", 3, 0.0, (1.0, 0.0, 1.0)),
        Case("mesh", "int8", "links", 4, 0.0, (0.1, 0.2, 0.3, 0.4)),
        # the segment with unequal and zero fractions
        Case("mesh", None, "shm", 3, 0.0, (1.0, 2.0, 3.0)),
        Case("mesh", None, "shm", 2, 0.0, (0.0, 1.0)),
        Case("mesh", None, "shm", 4, 0.0, (0.0, 1.0, 0.0, 3.0)),
        # equal fractions given explicitly: the segment, as with none
        Case("mesh", None, "shm", 3, 0.0, (2.0, 2.0, 2.0)),
    ]
    return cases


SESSION_CASES = _session_cases()


@pytest.fixture
def made_meshes(monkeypatch):
    """Every Mesh a worker opens, in order of opening."""
    made = []
    real = meshmod.Mesh.connect.__func__

    def connect(cls, *args, **kwargs):
        mesh = real(cls, *args, **kwargs)
        made.append(mesh)
        return mesh
    monkeypatch.setattr(meshmod.Mesh, "connect", classmethod(connect))
    return made


@pytest.mark.parametrize("case", SESSION_CASES, ids=[c.id for c in SESSION_CASES])
def test_a_session_s_flat_steps_give_the_reference_bits(case, monkeypatch, made_meshes):
    monkeypatch.setenv("DDPWIRE_SHM", "1" if case.transport == "shm" else "0")
    if case.fractions is not None:
        real = meshmod.Mesh.connect  # the recording one

        def with_fractions(*args, **kwargs):
            return real(*args, fractions=case.fractions, **kwargs)
        monkeypatch.setattr(meshmod.Mesh, "connect", with_fractions)
    grads = gradients(case.n, COUNT, seed=case.n * 7 + len(case.id))
    coordinator = dict(topology=case.topology, coordinator_share=case.share)
    if case.codec is not None:
        coordinator["compression"] = case.codec
    s = run_flat_steps(grads, 2, mesh=case.topology == "mesh", **coordinator)
    assert s.coord.mesh == (case.topology == "mesh")
    assert s.coord.share == meshmod.share_value(case.share)
    assert s.planes == {i: case.shared_plane for i in range(case.n)}
    if case.topology == "mesh":
        assert len(made_meshes) == case.n
        assert all(m.fractions == case.fractions for m in made_meshes)
        # the steps were cut by the plan of these fractions and share, on
        # the links and on the segment alike
        want_plan = planmod.Plan(COUNT, case.n, case.fractions, made_meshes[0].codec,
                                 s.coord.share)
        assert all(m._plans[COUNT].bounds == want_plan.bounds for m in made_meshes)
    want = reference_allreduce(grads, codec=case.codec)
    losses = set()
    for i in range(case.n):
        got, loss = s.results[i]
        assert np.array_equal(bits(got), bits(want)), (case.id, i)
        losses.add(loss)
    assert len(losses) == 1


# ---- Mesh runners on links made here ----

FRACTIONS = [
    (0.0, 1.0), (1.0, 3.0),
    (1.0, 0.0, 1.0), (0.5, 0.25, 0.25), (0.0, 0.0, 1.0),
    (0.0, 0.0, 0.0, 1.0), (0.1, 0.2, 0.3, 0.4), (0.2, 0.0, 0.8, 0.0),
]
#: (codec, op): every codec sums and averages
REDUCTIONS = [(codec, op) for codec in (None, "bf16", "fp16", "int8")
              for op in (ReduceOp.SUM, ReduceOp.AVG)]


@pytest.fixture(params=["whole", "tiny"])
def ranges(request):
    """The exchange's kernels at their default step (each small slice here
    in one range), or narrowing 3 elements ahead of the bytes and reducing
    or widening 3 at least per call: many small writes, many ranges."""
    if request.param == "tiny":
        _core.set_kernel_chunk(3)
    yield request.param
    _core.set_kernel_chunk(0)


def _fid(fractions):
    return ":".join(f"{f:g}" for f in fractions)


@pytest.mark.parametrize("codec,op", REDUCTIONS,
                         ids=[f"{c or 'float32'}-{o.name.lower()}" for c, o in REDUCTIONS])
@pytest.mark.parametrize("fractions", FRACTIONS, ids=[_fid(f) for f in FRACTIONS])
def test_mesh_runners_with_unequal_and_zero_fractions_give_the_reference_bits(
        fractions, codec, op, ranges):
    n = len(fractions)
    meshes = mesh_group(n, codec, fractions)
    try:
        # two lengths, one after the other: the plans (and scratch) per length
        for step, count in enumerate((1000, 37, 1000, 2560)):
            grads = gradients(n, count, seed=100 * step + n)
            plan = planmod.Plan(count, n, fractions, meshes[0].codec)
            wire = codecs.codec_of(codec)
            # (a blocked codec also leaves a member with too few blocks empty)
            assert any(a == b for a, b in plan.bounds) == (0.0 in fractions) or wire.block
            outs, outcomes, errors, owned = mesh_allreduce(meshes, step, grads, op)
            assert errors == [None] * n, errors
            # each averaged the slice the plan gives it, an empty one included
            # (held as the codec's words: int8's as bytes)
            assert owned == [wire.size(b) - wire.size(a) if wire.block else b - a
                             for a, b in plan.bounds]
            if wire.block:  # every slice that holds an element starts on a block
                assert all(a % wire.block == 0 for a, b in plan.bounds if b > a)
            want = reference_allreduce(grads, op, codec)
            for r in range(n):
                assert np.array_equal(bits(outs[r]), bits(want)), (step, r)
                assert outcomes[r].bad_worker == NO_WORKER
    finally:
        for m in meshes:
            m.close()


@pytest.mark.parametrize("codec", ["bf16", "fp16"])
@pytest.mark.parametrize("op", [ReduceOp.SUM, ReduceOp.AVG], ids=["sum", "avg"])
def test_16_bit_words_given_as_they_are_give_the_reference_s_words(codec, op, ranges):
    # a bfloat16 tensor's words travel without widening or narrowing, with
    # the bits of the same values given in float32
    fractions = (1.0, 0.0, 2.0)
    meshes = mesh_group(3, codec, fractions)
    try:
        grads = gradients(3, 3001, seed=8)
        words = [to_half_bits(g, codec) for g in grads]
        outs, outcomes, errors, _ = mesh_allreduce(meshes, 0, words, op)
        assert errors == [None] * 3, errors
        want = to_half_bits(reference_allreduce(grads, op, codec), codec)
        for r in range(3):
            assert outs[r].dtype == np.uint16 and np.array_equal(outs[r], want), r
            assert outcomes[r].bad_worker == NO_WORKER
    finally:
        for m in meshes:
            m.close()


def test_a_runner_refuses_words_its_codec_does_not_carry():
    for codec, dtype in ((None, np.uint16), ("bf16", np.float64), ("int8", np.uint16)):
        meshes = mesh_group(2, codec)
        try:
            with pytest.raises(TypeError, match="the mesh reduces float32"):
                meshes[0].reduce_scatter(0, np.zeros(8, dtype), 1.0)
        finally:
            for m in meshes:
                m.close()


@pytest.mark.parametrize("codec", [None, "bf16"])
def test_the_owner_of_a_non_finite_element_reports_it_and_a_zero_member_reports_nothing(
        codec):
    fractions = (1.0, 0.0, 1.0)
    meshes = mesh_group(3, codec, fractions)
    try:
        grads = gradients(3, 1000, seed=4)
        plan = planmod.Plan(1000, 3, fractions)
        lo, hi = plan.slice(2)  # worker 2 owns [500, 1000), worker 1 nothing
        grads[1][lo + 7] = np.inf
        grads[0][hi - 1] = np.nan
        outs, outcomes, errors, owned = mesh_allreduce(meshes, 0, grads)
        assert errors == [None] * 3, errors
        assert owned == [500, 0, 500]
        assert [o.bad_worker for o in outcomes[:2]] == [NO_WORKER, NO_WORKER]
        assert (outcomes[2].bad_worker, outcomes[2].bad_index) == (0, hi - 1)
        # a non-finite element is the coordinator's to halt on; the
        # reduction itself is the reference's wherever the inputs are finite
        want = reference_allreduce(grads, codec=codec)
        finite = np.isfinite(want)
        assert finite.sum() == len(want) - 2
        for r in range(3):
            assert np.array_equal(bits(outs[r][finite]), bits(want[finite])), r
    finally:
        for m in meshes:
            m.close()


def test_members_given_other_fractions_are_named_at_the_heads():
    meshes = mesh_group(2, None, (1.0, 1.0))
    # worker 1 cuts [0, 250) for worker 0, which expects [0, 500)
    meshes[1].fractions = (1.0, 3.0)
    try:
        outs, _, errors, _ = mesh_allreduce(meshes, 0, gradients(2, 1000, seed=2))
        for r, other in ((0, 1), (1, 0)):
            assert isinstance(errors[r], GradientMismatch), repr(errors[r])
            assert errors[r].worker_id == other and "slice length" in str(errors[r])
        assert outs == [None, None]
    finally:
        for m in meshes:
            m.close()


def test_a_mesh_refuses_bad_fractions_before_any_step():
    meshes = mesh_group(2)
    try:
        for bad, message in (((1.0,), "name 1 members"), ((1.0, -1.0), "negative"),
                             ((0.0, 0.0), "positive"), ((float("nan"), 1.0), "finite")):
            with pytest.raises(ValueError, match=message):
                meshmod.Mesh(meshes[0].links, 0, meshes[0].codec, 1.0, fractions=bad)
    finally:
        for m in meshes:
            m.close()


# ---- the torch backend's rank links ----

RANK_FRACTIONS = [(0.0, 1.0, 2.0), (1.0, 0.0, 0.0), (0.25, 0.5, 0.25)]


@pytest.mark.parametrize("fractions", RANK_FRACTIONS, ids=[_fid(f) for f in RANK_FRACTIONS])
def test_rank_links_with_fractions_give_the_reference_bits(fractions, ranges):
    pytest.importorskip("torch")
    from ddpwire.plane.collectives import Op
    from ddpwire.plane import rank_links as _links
    from rank_group import form_all, loopback

    world = len(fractions)
    ranks = form_all(world, lambda r: dict(loopback(r), fractions=fractions))
    try:
        assert all(isinstance(r, _links.RankLinks) for r in ranks), ranks
        for i, (codec, op) in enumerate(REDUCTIONS):
            inputs = gradients(world, 2000 + i, seed=30 + i)
            bufs = [x.copy() for x in inputs]
            threads = [threading.Thread(target=ranks[r].allreduce,
                                        args=(bufs[r], Op(int(op)), codec))
                       for r in range(world)]
            for t in threads:
                t.start()
            for t in threads:
                t.join(60)
                assert not t.is_alive(), "a rank's allreduce hung"
            assert all(r.failure is None for r in ranks), [r.failure for r in ranks]
            want = reference_allreduce(inputs, op, codec)
            for r in range(world):
                assert np.array_equal(bits(bufs[r]), bits(want)), (codec, op.name, r)
    finally:
        for r in ranks:
            if isinstance(r, _links.RankLinks):
                r.close()


def test_rank_links_refuse_bad_fractions_before_the_set_up():
    pytest.importorskip("torch")
    from ddpwire.plane import rank_links as _links

    with pytest.raises(ValueError, match="fractions name 2 members"):
        _links.form_links(object(), 0, 3, listen_host="127.0.0.1", advertise="127.0.0.1",
                          timeout=1.0, fractions=(1.0, 1.0))
