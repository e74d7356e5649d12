"""ddpwire's process groups as torch knows them, in real processes: named
and found by name like gloo's, subgroups of any ranks in any order with
their collectives interleaved, destroyed one by one.

Three ranks of tests/groups_script.py run once per path (shared memory,
the default on one host; and DDPWIRE_SHM=0, the rank links): gloo first,
then ddpwire, on the same inputs; each test compares one part of what
they saved.
"""
import pytest

torch = pytest.importorskip("torch")

from side_by_side import ROOT, run_ranks  # noqa: E402

pytestmark = pytest.mark.slow

SCRIPT = ROOT / "tests" / "groups_script.py"
WORLD = 3
#: the subgroups the script makes: ranks as given to new_group, the group's ranks in order
SUBGROUPS = {"a": [0, 2], "b": [0, 1], "c": [1, 2], "d": [2, 0]}


@pytest.fixture(scope="module", params=["shm", "links"])
def runs(request, tmp_path_factory):
    """(path, {backend: [each rank's results]}) of one run of the script's ranks."""
    extra = {"DDPWIRE_SHM": "0"} if request.param == "links" else {}
    tmp = tmp_path_factory.mktemp(f"groups-{request.param}")
    return request.param, run_ranks(SCRIPT, tmp, WORLD, extra)


def _equal(ours, theirs, where):
    if isinstance(theirs, dict):
        assert isinstance(ours, dict) and sorted(ours) == sorted(theirs), (where, ours, theirs)
        for key in theirs:
            _equal(ours[key], theirs[key], (*where, key))
    elif isinstance(theirs, (list, tuple)):
        assert isinstance(ours, (list, tuple)) and len(ours) == len(theirs), (where, ours, theirs)
        for k, (a, b) in enumerate(zip(ours, theirs)):
            _equal(a, b, (*where, k))
    elif isinstance(theirs, torch.Tensor):
        # integers bit for bit; float32 sums of two ranks are too (a + b == b + a),
        # of three within rounding (gloo adds in its own order)
        assert ours.dtype == theirs.dtype and ours.shape == theirs.shape, where
        if theirs.is_floating_point() and "world" in where:
            torch.testing.assert_close(ours, theirs, rtol=1e-6, atol=1e-6, msg=str(where))
        else:
            assert torch.equal(ours, theirs), where
    else:
        assert ours == theirs, (where, ours, theirs)


def test_every_group_is_named_and_found_by_name_as_gloos_are(runs):
    path, got = runs
    for rank in range(WORLD):
        gloo, wire = got["gloo"][rank], got["ddpwire"][rank]
        assert wire["members of"] == gloo["members of"] == sorted(
            key for key, ranks in SUBGROUPS.items() if rank in ranks)
        for key, ours in {"world": wire["world"], **wire["identity"]}.items():
            theirs = gloo["world"] if key == "world" else gloo["identity"][key]
            # the same names as gloo's, the same ranks; torch's lookups by name find the group
            assert ours["name"] == theirs["name"] and ours["name"], (rank, key)
            assert ours["resolved"] and ours["pg_names"] and ours["_get_process_group_name"]
            for field in ("rank", "size", "get_rank", "global ranks"):
                assert ours[field] == theirs[field], (rank, key, field)
            assert ours["backend"] == "ddpwire"
            if key != "world":
                assert ours["global ranks"] == SUBGROUPS[key]
                # each subgroup's large allreduces on a path of its own
                assert ours["paths"] == ((True, False) if path == "shm" else (False, True)), (
                    rank, key, ours["paths"])
        assert set(wire["carrier"].values()) == {"FakeProcessGroup"}
    # new_group([2, 0], sort_ranks=False): rank 2 is the group's rank 0
    assert got["ddpwire"][2]["identity"]["d"]["rank"] == 0
    assert got["ddpwire"][0]["identity"]["d"]["rank"] == 1


def test_collectives_of_several_groups_interleaved_give_gloos_results(runs):
    _, got = runs
    for rank in range(WORLD):
        gloo, wire = got["gloo"][rank], got["ddpwire"][rank]
        _equal(wire["round 1"], gloo["round 1"], ("round 1",))
        # and again with group a destroyed
        _equal(wire["ddpwire"]["after a"], gloo["round 2"], ("after a",))
        assert sorted(wire["ddpwire"]["after a"]) == sorted(
            ["world", *(k for k, r in SUBGROUPS.items() if rank in r and k != "a")])


def test_torchs_functional_collectives_find_ddpwire_groups_by_name(runs):
    _, got = runs
    for rank in range(WORLD):
        _equal(got["ddpwire"][rank]["by name"], got["gloo"][rank]["by name"], ("by name",))


def test_a_destroyed_subgroup_is_released_and_refuses_naming_itself(runs):
    _, got = runs
    for rank in SUBGROUPS["a"]:
        wire = got["ddpwire"][rank]["ddpwire"]
        name = wire["a name"]
        assert wire["repr"]["a"] == (f"DdpwireProcessGroup(rank={SUBGROUPS['a'].index(rank)}, "
                                     f"world_size=2, group_name='{name}', closed=False)")
        assert wire["a repr"] == wire["repr"]["a"].replace("closed=False", "closed=True")
        assert wire["a closed"] == (True, False, False)
        assert wire["fds released"] > 0  # its sockets (and shared memory) closed
        assert not wire["a still in pg_names"]
        assert wire["a resolved"][:2] == ("error", "RuntimeError")
        # torch refuses it first; the group itself, by name
        assert wire["a all_reduce"][:2] == ("error", "ValueError")
        for what in ("allreduce", "barrier"):
            assert wire[f"a {what}"] == (
                "error", "RuntimeError",
                f"ddpwire {what}: the process group '{name}' (rank {SUBGROUPS['a'].index(rank)} "
                f"of 2) is closed (destroyed)"), wire[f"a {what}"]


def test_the_others_keep_working_as_each_is_destroyed_and_the_default_goes_last(runs):
    _, got = runs
    for rank in range(WORLD):
        wire = got["ddpwire"][rank]["ddpwire"]
        for key in ("b", "c", "d"):
            if rank in SUBGROUPS[key]:
                assert wire[f"{key} closed"] is True
                assert wire[f"world after {key}"].tolist() == [sum(range(1, WORLD + 1))]
        assert wire["world closed"] is True
        assert wire["world repr"].endswith(f"group_name='{wire['world name before']}', closed=True)")
        assert wire["world allreduce"] == (
            "error", "RuntimeError",
            f"ddpwire allreduce: the process group '0' (rank {rank} of {WORLD}) is closed "
            "(destroyed)")


def test_a_collective_that_reaches_the_name_carrier_fails(runs):
    _, got = runs
    for rank in range(WORLD):
        kind, name, text = got["ddpwire"][rank]["ddpwire"]["carrier refuses"]
        assert (kind, name) == ("error", "RuntimeError") and "error_on_collective" in text, text


def test_without_a_carrier_a_group_still_works_and_says_so_once(monkeypatch, caplog):
    # a torch without FakeProcessGroup: the group has no name, and its collectives still run
    import logging

    import torch.distributed as dist
    from ddpwire.torch import backend

    monkeypatch.setattr(torch._C._distributed_c10d, "FakeProcessGroup", None)
    monkeypatch.setattr(backend, "_carrier_missing", False)
    groups = []
    try:
        with caplog.at_level(logging.WARNING, logger=backend.__name__):
            for _ in range(2):
                groups.append(backend.DdpwireProcessGroup(dist.HashStore(), 0, 1))
        warned = [r for r in caplog.records if "carry a group's name" in r.getMessage()]
        assert len(warned) == 1, caplog.text
        t = torch.arange(3.0)
        groups[0].allreduce([t]).wait()
        assert t.tolist() == [0.0, 1.0, 2.0]
        assert repr(groups[0]) == ("DdpwireProcessGroup(rank=0, world_size=1, group_name=None, "
                                   "closed=False)")
    finally:
        for group in groups:
            group.close()
    with pytest.raises(RuntimeError, match=r"^ddpwire barrier: the process group \(rank 0 of 1\) "
                                           r"is closed \(destroyed\)$"):
        groups[0].barrier()
