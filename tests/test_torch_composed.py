"""The collectives the "ddpwire" backend composes from its own (reduce,
gather, scatter, all-to-all, the coalesced forms) against gloo's, in real
processes.

The ranks of tests/composed_script.py run once per path (3 in shared
memory, 2 on the rank links):
every case on gloo, then on ddpwire, on the same inputs, sync and async;
each test compares one family of what they saved.
"""
import pytest

torch = pytest.importorskip("torch")

from side_by_side import ROOT, run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "composed_script.py"
#: dtypes every byte-copy op and every reduction is compared on, at least
REQUIRED = ("torch.float32", "torch.float64", "torch.int64", "torch.int8")


@pytest.fixture(scope="module", params=["3 ranks, shared memory", "2 ranks, links"])
def runs(request, tmp_path_factory):
    """{backend: [each rank's results]} of one run of the script's ranks:
    3 in shared memory (the default on one host), and 2 on the rank links
    (DDPWIRE_SHM=0, the path across hosts)."""
    world, env = {"3 ranks, shared memory": (3, {}),
                  "2 ranks, links": (2, {"DDPWIRE_SHM": "0"})}[request.param]
    return run_ranks(SCRIPT, tmp_path_factory.mktemp("composed"), world, env)


def _world(runs):
    return len(runs["gloo"])


def _is_error(value):
    return isinstance(value, tuple) and value[:1] == ("error",)


def _same(ours, theirs, exact, where):
    """Equal bit for bit (``exact``), else within float rounding (gloo
    reduces in its own order); lists and None alike."""
    if isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), (where, ours, theirs)
        for k, (a, b) in enumerate(zip(ours, theirs)):
            _same(a, b, exact, (where, k))
        return
    if not isinstance(theirs, torch.Tensor):
        assert ours == theirs, (where, ours, theirs)
        return
    assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, (where, ours, theirs)
    if exact or not theirs.dtype.is_floating_point:
        assert torch.equal(ours, theirs), (where, ours, theirs)
    else:
        loose = theirs.dtype in (torch.float16, torch.bfloat16)
        torch.testing.assert_close(ours.float(), theirs.float(), rtol=1e-2 if loose else 1e-5,
                                   atol=1e-2 if loose else 1e-5, msg=str(where))


def _compare(runs, kinds, exact):
    """Compare ddpwire's outputs with gloo's for every case of ``kinds`` on
    every rank; returns the (kind, dtype) pairs gloo answered."""
    compared = set()
    for rank in range(_world(runs)):
        gloo, wire = runs["gloo"][rank]["cases"], runs["ddpwire"][rank]["cases"]
        for key, theirs in gloo.items():
            if key[0] not in kinds:
                continue
            ours = wire[key]
            assert not _is_error(ours), (key, rank, ours)
            if _is_error(theirs):
                continue  # gloo refuses it: nothing to compare with
            _same(ours["out"], theirs["out"], exact(key), (key, rank))
            compared.add(key[:2])
    return compared


def _covers(compared, kinds, dtypes=REQUIRED):
    for kind in kinds:
        for dtype in dtypes:
            assert (kind, dtype) in compared, (kind, dtype)


def _float_sum_or_product(key):
    return key[-1] in ("sum", "product")


def test_reduce_matches_gloo_on_the_root_and_leaves_the_other_ranks_alone(runs):
    compared = set()
    for rank in range(_world(runs)):
        gloo, wire = runs["gloo"][rank]["cases"], runs["ddpwire"][rank]["cases"]
        for key, theirs in gloo.items():
            if key[0] != "reduce":
                continue
            ours = wire[key]
            assert not _is_error(ours), (key, ours)
            if ours["dst"] != rank:
                # gloo leaves partial results here; ddpwire the tensor as it was
                assert torch.equal(ours["out"], ours["in"]), (key, rank)
            elif not _is_error(theirs):
                _same(ours["out"], theirs["out"], not _float_sum_or_product(key), (key, rank))
                compared.add(key[1:])
    for dtype in REQUIRED:
        for op in ("sum", "max", "min", "product"):
            assert (dtype, op) in compared, (dtype, op)


def test_allreduce_coalesced_matches_gloo(runs):
    compared = _compare(runs, {"allreduce_coalesced"}, lambda key: not _float_sum_or_product(key))
    _covers(compared, ["allreduce_coalesced"])


def test_a_sparse_sum_matches_gloo_bit_for_bit(runs):
    # every rank's coalesced entries added in rank order, as gloo does
    # (torch's sparse add has no float16 kernel on the CPU: both refuse it)
    kinds = {"sparse allreduce 1-d", "sparse allreduce hybrid"}
    compared = set()
    for rank in range(_world(runs)):
        gloo, wire = runs["gloo"][rank]["cases"], runs["ddpwire"][rank]["cases"]
        for key, theirs in gloo.items():
            if key[0] in kinds:
                ours = wire[key]
                if _is_error(theirs):
                    assert _is_error(ours), (key, rank, ours, theirs)
                else:
                    _same(ours["out"], theirs["out"], True, (key, rank))
                    compared.add(key[:2])
    _covers(compared, kinds)


def test_gather_and_scatter_match_gloo_bit_for_bit(runs):
    _covers(_compare(runs, {"gather", "scatter"}, lambda key: True), ["gather", "scatter"])


def test_all_to_all_matches_gloo_bit_for_bit_with_and_without_split_sizes(runs):
    kinds = ["all_to_all", "all_to_all_single", "all_to_all_single splits",
             "all_to_all_single input splits", "all_to_all_single output splits"]
    _covers(_compare(runs, set(kinds), lambda key: True), kinds)


def test_coalesced_gathers_and_reduce_scatters_match_gloo(runs):
    # the reduce-scatters take MAX and MIN: exact too
    kinds = ["allgather_coalesced", "all_gather_single_coalesced", "allgather_into_tensor_coalesced",
             "reduce_scatter_single_coalesced", "reduce_scatter_tensor_coalesced"]
    _covers(_compare(runs, set(kinds), lambda key: True), kinds)


def test_async_works_complete_with_their_outputs_in_the_future(runs):
    # the outputs themselves, as gloo's reduce, gather, scatter and
    # all-to-all give (its coalesced ops give copies, or no future at all)
    checked = set()
    for rank in range(_world(runs)):
        for key, ours in runs["ddpwire"][rank]["cases"].items():
            if isinstance(ours, dict) and ours.get("future") is not None:
                assert ours["future"] is True, (key, rank)
                checked.add(key[0])
    assert checked == {"reduce", "allreduce_coalesced", "gather", "scatter", "all_to_all",
                       "all_to_all_single", "all_to_all_single splits",
                       "all_to_all_single input splits", "all_to_all_single output splits",
                       "allgather_coalesced", "allgather_into_tensor_coalesced",
                       "reduce_scatter_tensor_coalesced"}, checked


def test_bad_arguments_are_value_errors_naming_the_op_and_leave_the_group_usable(runs):
    for rank in range(_world(runs)):
        gloo, wire = runs["gloo"][rank]["errors"], runs["ddpwire"][rank]["errors"]
        for case, theirs in gloo.items():
            ours = wire[case]
            if case == "the group still answers":
                assert ours.tolist() == theirs.tolist() == [float(sum(range(_world(runs))))]
                continue
            if not _is_error(theirs):
                # gloo (torch 2.13) on 2 ranks takes rows that do not divide and
                # returns whatever its buffers held: refused here all the same
                assert case == "all_to_all_single rows do not divide", (case, theirs)
            assert ours[:2] == ("error", "ValueError"), (case, ours)
            op = case.split()[0]
            op = {"all_to_all": "alltoall"}.get(op, op)  # the process group's name for it
            assert ours[2].startswith(f"ddpwire {op}: "), (case, ours)
    world = _world(runs)
    assert runs["ddpwire"][0]["errors"]["gather output list too short"][2] == (
        f"ddpwire gather: {world} outputs needed, got {world - 1}")
    assert runs["ddpwire"][0]["errors"]["all_to_all_single splits do not add up"][2] == (
        f"ddpwire all_to_all_single: input_split_sizes {[1] * world} add up to {world}, "
        f"the input has 6 rows")


def test_split_sizes_or_sparse_shapes_that_disagree_are_refused_on_every_rank_alike(runs):
    # gloo would hang there; every ddpwire rank sees the same table of counts
    for rank in range(_world(runs)):
        got = runs["ddpwire"][rank]["ddpwire"]
        assert got["split sizes disagree"] == (
            "error", "ValueError",
            "ddpwire all_to_all_single: rank 0 sends 1 elements to rank 1, which expects 2 from it")
        assert got["sparse shapes disagree"] == (
            "error", "ValueError",
            "ddpwire allreduce: rank 1's sparse tensor is float32 of shape (5,) (1 sparse and 0 "
            "dense dimensions), rank 0's float32 of shape (4,) (1 sparse and 0 dense dimensions)")
        assert got["the group still answers"].tolist() == [float(sum(range(_world(runs))))]


def test_a_failed_op_fails_wait_and_leaves_its_outputs_unchanged(runs):
    for rank in range(_world(runs)):
        got = runs["ddpwire"][rank]["ddpwire"]
        kind, name, text = got["failed reduce"]
        assert (kind, name) == ("error", "CollectiveAborted") and "disagrees" in text, text
        assert got["failed reduce completed"] == (True, False, True)
        before, after = got["failed reduce left"]
        assert torch.equal(before, after)
        # issued before or after the group failed: an error either way
        assert got["failed gather"][:2] == ("error", "CollectiveAborted")
    untouched = runs["ddpwire"][0]["ddpwire"]["failed gather left"]
    assert all(t.tolist() == [-1.0] * 4 for t in untouched)


def test_monitored_barrier_stays_unsupported_and_point_to_point_refuses_self(runs):
    # point to point itself: tests/test_torch_p2p.py
    for rank in range(_world(runs)):
        got = runs["ddpwire"][rank]["ddpwire"]
        assert got["monitored_barrier"] == ("error", "NotImplementedError",
                                            "the ddpwire backend does not implement "
                                            "monitored_barrier")
        for name, role in (("send", "destination"), ("recv", "source")):
            assert got[name][:2] == ("error", "ValueError"), got[name]
            assert got[name][2].startswith(f"Invalid {role} rank"), got[name]
