"""Point to point on the "ddpwire" backend (send, recv, isend, irecv,
recv from any source, batch_isend_irecv, tags) against gloo's, in real
processes.

tests/p2p_script.py runs every case on gloo, then on ddpwire, in 2 and 3
ranks, with shared memory on (point to point through the service on rank
0) and off (direct links between the ranks); every result must be gloo's,
bit for bit, a two-stage pipeline's trained weights included.
"""
import pytest

torch = pytest.importorskip("torch")

from side_by_side import (DTYPES_NAMES, ROOT, data, identical as _same, run_ranks,  # noqa: E402
                          start_ranks)
from test_torch_backend import finish  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "p2p_script.py"
CONFIGS = {"2 ranks, service": (2, {}), "3 ranks, service": (3, {}),
           "2 ranks, links": (2, {"DDPWIRE_SHM": "0"}), "3 ranks, links": (3, {"DDPWIRE_SHM": "0"})}
REQUIRED = ("torch.float32", "torch.float64", "torch.int64", "torch.int8", "torch.bool")


@pytest.fixture(scope="module", params=list(CONFIGS))
def runs(request, tmp_path_factory):
    """(world, shared memory off, {backend: [each rank's results]})."""
    world, env = CONFIGS[request.param]
    return world, bool(env), run_ranks(SCRIPT, tmp_path_factory.mktemp("p2p"), world, env)


def _case(runs, name):
    world, _, got = runs
    return [(got["ddpwire"][r]["cases"][name], got["gloo"][r]["cases"][name]) for r in range(world)]


def test_every_dtype_travels_round_the_ring_as_on_gloo(runs):
    world = runs[0]
    for rank, (ours, theirs) in enumerate(_case(runs, "dtypes")):
        assert set(REQUIRED) <= set(theirs)
        _same(ours, theirs, rank)
        # and it is the previous rank's tensor, not zeros that happen to agree
        prv = (rank - 1) % world
        k = DTYPES_NAMES.index("int64")
        assert torch.equal(ours["torch.int64"], data(torch.int64, (3, 5), 100 * prv + k, spread=100))


def test_tags_match_exactly_and_one_tag_keeps_the_send_order(runs):
    for rank, (ours, theirs) in enumerate(_case(runs, "tags")):
        _same(ours, theirs, rank)
    ours = _case(runs, "tags")[1][0]
    assert [ours[k][0].item() for k in ("first", "second", "third", "fourth")] == [2, 1, 3, 4]


def test_any_source_names_each_sender(runs):
    world = runs[0]
    for rank, (ours, theirs) in enumerate(_case(runs, "any source")):
        _same(ours, theirs, rank)
    ours = _case(runs, "any source")[0][0]
    assert ours[:-1] == [(r, [r, 10 * r]) for r in range(1, world)]
    assert ours[-1] == ("irecv", world - 1, [world - 1, 1 - world])


def test_irecv_posted_before_or_after_the_message_arrives(runs):
    for rank, (ours, theirs) in enumerate(_case(runs, "both orders")):
        _same({k: v for k, v in ours.items() if k != "future"},
              {k: v for k, v in theirs.items() if k != "future"}, rank)
    ours = _case(runs, "both orders")[1][0]
    assert torch.equal(ours["irecv first"], torch.arange(6, dtype=torch.float64) * 1.5)
    assert torch.equal(ours["send first"], torch.arange(5, dtype=torch.int32) - 7)
    assert ours["future"] is True  # the irecv's future holds the receiving tensor


def test_batch_isend_irecv_ring(runs):
    world = runs[0]
    for rank, (ours, theirs) in enumerate(_case(runs, "batch")):
        _same(ours, theirs, rank)
        assert torch.equal(ours[0], torch.arange(7) * ((rank - 1) % world + 1))


def test_non_contiguous_tensors_travel_where_gloo_needs_copies(runs):
    for rank, (ours, theirs) in enumerate(_case(runs, "non-contiguous")):
        # gloo refuses strided tensors: ddpwire's strided result is gloo's
        # result through contiguous copies
        assert theirs["strided"][:2] == ("error", "RuntimeError"), theirs["strided"]
        _same(ours["through copies"], theirs["through copies"], rank)
        _same(ours["strided"], theirs["through copies"], rank)
        assert (ours["strided"][:, 1::2] == -1).all()


def test_send_to_self_is_a_value_error_as_on_gloo(runs):
    world, _, got = runs
    for rank, (ours, theirs) in enumerate(_case(runs, "send to self")):
        assert ours == theirs and ours[:2] == ("error", "ValueError"), (ours, theirs)
        mine = got["ddpwire"][rank]["ddpwire"]
        for name in ("pg.send to self", "pg.recv from self", "negative tag"):
            assert mine[name][:2] == ("error", "ValueError"), (name, mine[name])


def test_pipeline_trains_to_gloos_weights(runs):
    for rank, (ours, theirs) in enumerate(_case(runs, "pipeline")):
        if rank > 1:
            assert ours is None and theirs is None
            continue
        _same(ours, theirs, rank)
        assert ours["state"]
    losses = _case(runs, "pipeline")[1][0]["losses"]
    assert len(losses) == 4 and len({x.item() for x in losses}) == 4  # it did train


def test_the_route_is_direct_exactly_when_the_rank_links_are(runs):
    world, links, got = runs
    for rank in range(world):
        mine = got["ddpwire"][rank]["ddpwire"]
        assert mine["direct"] is links and mine["rank links"] is links
        assert mine["the group still answers"].item() == sum(range(world))


def test_a_message_of_another_size_or_dtype_is_a_typed_error(runs):
    mine = runs[2]["ddpwire"][1]["ddpwire"]
    kind, name, text = mine["size mismatch"]
    assert name == "PointToPointMismatch", mine["size mismatch"]
    assert ("rank 0 sent rank 1 (tag 31) 3 elements of float32 (12 bytes) where the receiving "
            "tensor holds 4 of float32 (16 bytes)") in text
    kind, name, text = mine["dtype mismatch"]
    assert name == "PointToPointMismatch" and "of int32" in text and "tag 32" in text, text
    # nothing written, and the next message with its tag still comes
    assert (mine["size mismatch left"] == -1).all() and (mine["dtype mismatch left"] == -1).all()
    assert mine["after the mismatches"].tolist() == [5.0, 6.0]


def test_a_receive_not_done_in_time_says_timed_out(runs):
    mine = runs[2]["ddpwire"][1]["ddpwire"]
    assert mine["timeout"][:2] == ("error", "PointToPointTimeout"), mine["timeout"]
    assert "timed out" in mine["timeout"][2] and "tag 999" in mine["timeout"][2]
    assert mine["timeout completed"] is False


@pytest.mark.parametrize("world, dying", [(3, 2), (2, 0)], ids=["rank 2 of 3", "rank 0 of 2"])
@pytest.mark.parametrize("env", [{}, {"DDPWIRE_SHM": "0"}], ids=["service", "links"])
def test_a_rank_that_dies_fails_the_receives_waiting_for_it(tmp_path, env, world, dying):
    codes, outputs = finish(start_ranks(SCRIPT, tmp_path, world, dict(env, P2P_DYING=str(dying)),
                                        ["death"]))
    assert codes == [3 if r == dying else 0 for r in range(world)], "\n".join(outputs)
    for rank in range(world):
        if rank == dying:
            continue
        got = torch.load(tmp_path / f"run.death.rank{rank}.pt", weights_only=False)
        assert got["from the dying"][:2] == ("error", "CollectiveAborted"), got
        assert got["from the dying rank"] == dying, got
