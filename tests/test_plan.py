"""ddpwire.plane.plan: the one cut of a vector among the mesh's members and the
coordinator. Pure arithmetic: no links, no threads."""
from __future__ import annotations

import ast
import math
from fractions import Fraction
from pathlib import Path

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from ddpwire.plane import mesh as meshmod
from ddpwire.plane import plan as planmod
from ddpwire.wire.extensions import Codec
from ddpwire.plane.plan import Plan, check_fractions, slice_bounds

fraction_values = st.one_of(st.just(0.0), st.floats(1e-6, 1e6), st.integers(0, 50))


def test_equal_fractions_are_todays_slice_bounds():
    for count in list(range(0, 70)) + [4097, 100_003, 1 << 40]:
        for n in range(1, 9):
            want = slice_bounds(count, n)
            # any equal numbers: the rule reduces to w·count//N exactly
            for fractions in (None, [1] * n, [0.1] * n, [1 / 3] * n, [5e-324] * n, [1e300] * n):
                plan = Plan(count, n, fractions)
                assert list(plan.bounds) == want, (count, n, fractions)
                assert plan.equal


def test_slice_bounds_is_worker_w_s_share_rounded_down():
    assert slice_bounds(10, 3) == [(0, 3), (3, 6), (6, 10)]
    assert slice_bounds(1, 3) == [(0, 0), (0, 0), (0, 1)]


@settings(max_examples=300, deadline=None)
@given(st.integers(0, 10_000), st.lists(fraction_values, min_size=1, max_size=9),
       st.integers(0, planmod.MAX_SHARE))
def test_slices_tile_the_members_part_in_order_each_within_an_element(count, fractions,
                                                                      share):
    if not any(f > 0 for f in fractions):
        fractions = fractions[:-1] + [1.0]
    n = len(fractions)
    plan = Plan(count, n, fractions, coordinator_share=share)
    assert plan.part == planmod.coordinator_part(count, share)
    assert plan.ours == count - plan.part
    starts = [a for a, _ in plan.bounds]
    ends = [b for _, b in plan.bounds]
    assert starts[0] == 0 and ends[-1] == plan.ours and starts[1:] == ends[:-1]
    exact = [Fraction(f) for f in fractions]
    total = sum(exact)
    for k, (a, b) in enumerate(plan.bounds):
        assert a <= b
        # the rounding rule, restated over exact rationals
        assert a == math.floor(plan.ours * sum(exact[:k]) / total)
        assert abs((b - a) - plan.ours * exact[k] / total) < 1
        if fractions[k] == 0:
            assert a == b  # a member with fraction 0 owns nothing


def test_unequal_and_zero_fractions_cut_by_prefix_sums():
    assert Plan(10, 3, [0.1, 0, 0.9]).bounds == ((0, 1), (1, 1), (1, 10))
    assert Plan(1000, 3, [1, 2, 3], coordinator_share=1 << 14).bounds == \
        ((0, 125), (125, 375), (375, 750))
    assert Plan(7, 4, [0, 0, 0, 2]).bounds == ((0, 0), (0, 0), (0, 0), (0, 7))
    assert Plan(7, 4, [2, 0, 0, 0]).bounds == ((0, 7), (7, 7), (7, 7), (7, 7))
    # a fraction just above 0 may still own an element (within one of its
    # share, rounded down at its start): only 0 itself owns none
    assert Plan(3, 2, [1, 1e-300]).bounds == ((0, 2), (2, 3))
    assert not Plan(10, 3, [0.1, 0, 0.9]).equal


def test_scaling_by_a_power_of_two_keeps_every_cut():
    for fractions in ([0.1, 0.2, 0.7], [3, 1, 0, 5], [1e-3, 2e-3]):
        base = Plan(100_003, len(fractions), fractions).bounds
        for scale in (2.0, 0.5, 2.0 ** 40, 2.0 ** -60):
            assert Plan(100_003, len(fractions), [f * scale for f in fractions]).bounds == base


def test_a_plan_is_a_value_every_member_computes_alike():
    a = Plan(5000, 3, [0.5, 0.25, 0.25], Codec.BF16, 100)
    b = Plan(5000, 3, (0.5, 0.25, 0.25), Codec.BF16, 100)
    assert a == b and hash(a) == hash(b) and a.bounds == b.bounds
    assert a.fractions == (0.5, 0.25, 0.25)
    with pytest.raises(AttributeError):
        a.count = 1  # type: ignore[misc]


def test_the_coordinator_s_part_is_the_vector_s_last_elements():
    plan = Plan(1000, 2, coordinator_share=1 << 15)
    assert (plan.part, plan.ours) == (500, 500)
    assert plan.bounds == ((0, 250), (250, 500))
    assert Plan(1, 1, coordinator_share=planmod.MAX_SHARE).part == 0
    assert Plan(0, 3, [1, 0, 2]).bounds == ((0, 0),) * 3


@pytest.mark.parametrize("fractions,members,message", [
    ([1, 2], 3, "fractions name 2 members, the mesh has 3"),
    ([1, -0.5, 1], 3, r"fractions\[1\] must not be negative, got -0.5"),
    ([0, 0, 0], 3, "fractions must sum to a positive number"),
    ([float("nan"), 1], 2, r"fractions\[0\] must be finite, got nan"),
    ([1, float("inf")], 2, r"fractions\[1\] must be finite, got inf"),
    (["1", 1], 2, r"fractions\[0\] must be a real number, got '1'"),
    ([True, 1], 2, r"fractions\[0\] must be a real number, got True"),
    ([None, 1], 2, r"fractions\[0\] must be a real number, got None"),
    ("11", 2, "fractions must be a sequence of numbers"),
    (2, 2, "fractions must be a sequence of numbers"),
])
def test_bad_fractions_are_a_value_error_naming_them(fractions, members, message):
    with pytest.raises(ValueError, match=message):
        check_fractions(fractions, members)
    with pytest.raises(ValueError, match=message):
        Plan(10, members, fractions)


def test_fractions_are_kept_as_floats_and_minus_zero_is_zero():
    assert check_fractions(None, 3) is None
    assert check_fractions([1, -0.0, 2.5], 3) == (1.0, 0.0, 2.5)
    assert math.copysign(1.0, check_fractions([1, -0.0], 2)[1]) == 1.0


@pytest.mark.parametrize("kwargs,message", [
    (dict(count=-1, members=1), "count must be at least 0, got -1"),
    (dict(count=1.0, members=1), "count must be an integer, got 1.0"),
    (dict(count=1, members=0), "members must be at least 1, got 0"),
    (dict(count=1, members=1, codec=7), "codec must be one of"),
    (dict(count=1, members=1, coordinator_share=1 << 16),
     "coordinator_share must be from 0 to 65535, got 65536"),
])
def test_bad_plan_arguments_are_a_value_error_naming_them(kwargs, message):
    with pytest.raises(ValueError, match=message):
        Plan(**kwargs)
    with pytest.raises(ValueError, match="member must be from 0 to 2, got 3"):
        Plan(10, 3).slice(3)


def test_the_mesh_names_are_the_plan_s():
    for name in ("slice_bounds", "coordinator_part"):
        assert getattr(meshmod, name) is getattr(planmod, name)


def test_the_plan_imports_nothing_above_it():
    tree = ast.parse(Path(planmod.__file__).read_text())
    imported = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            imported.add(("." * node.level) + (node.module or ""))
        elif isinstance(node, ast.Import):
            imported.update(a.name for a in node.names)
    # the codec table beside it: a description (a blocked codec cuts in blocks)
    assert imported <= {"__future__", "math", "numbers", "dataclasses", "typing",
                        "..wire.extensions", ".codecs"}, imported
