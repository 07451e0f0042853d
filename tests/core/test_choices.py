"""valid_specs: every spec of R ranks that plan_layout accepts, no other, checked against brute force."""

from __future__ import annotations

from itertools import product

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcore import LayoutError, ShardSpec, ShardSpecError, plan_layout
from shardcore.plan import AXES, check_axes, divisors, valid_specs


def _brute_force(ranks: int, order: str, limits: dict[str, int]) -> set[ShardSpec]:
    """Every 6-tuple of sizes up to ``ranks`` that ShardSpec and plan_layout accept, within ``limits`` (an
    axis absent stays at 1; expt_tp absent stays at tp)."""
    found = set()
    sizes = range(1, ranks + 1)
    grids = [(tp, cp, pp) for tp, cp, pp in product(sizes, sizes, sizes) if ranks % (tp * cp * pp) == 0]
    for (tp, cp, pp), ep, expt_tp in product(grids, sizes, sizes):
        values = {"tp": tp, "cp": cp, "pp": pp, "dp": ranks // (tp * cp * pp), "ep": ep}
        if any(value > limits.get(axis, 1) for axis, value in values.items()):
            continue
        if expt_tp > limits["expt_tp"] if "expt_tp" in limits else expt_tp != tp:
            continue
        try:
            spec = ShardSpec(**values, expt_tp=expt_tp)
            plan_layout(ranks, spec, order=order)
        except (ShardSpecError, LayoutError):
            continue
        found.add(spec)
    return found


@settings(deadline=None, max_examples=40)
@given(
    st.integers(1, 16),
    st.sampled_from(["tp-cp-dp-pp", "tp-cp-pp-dp"]),
    st.dictionaries(st.sampled_from(AXES), st.integers(1, 16), min_size=1),
)
def test_every_valid_spec_and_no_other(ranks: int, order: str, limits: dict[str, int]) -> None:
    specs = list(valid_specs(ranks, order=order, axes=limits))
    assert len(specs) == len(set(specs)), "a spec is enumerated twice"
    assert set(specs) == _brute_force(ranks, order, limits)
    assert all(spec.world_size == ranks for spec in specs)


def test_all_axes_by_name_and_the_fixed_order() -> None:
    specs = list(valid_specs(12))
    assert set(specs) == _brute_force(12, "tp-cp-dp-pp", dict.fromkeys(AXES, 12))
    keys = [(s.tp, s.cp, s.pp, s.expt_tp, s.ep) for s in specs]
    assert keys == sorted(keys)
    assert list(valid_specs(6, axes=["dp"])) == [ShardSpec(dp=6)]
    assert list(valid_specs(6, axes=[])) == []  # dp must be 1 then: no spec of 6 ranks
    assert [str(s) for s in valid_specs(4, axes={"tp": 2, "dp": 4})] == ["tp=1,dp=4", "tp=2,dp=2"]


def test_role_and_name_are_given_to_every_spec() -> None:
    assert {(s.role, s.name) for s in valid_specs(8, role="decode", name="d")} == {("decode", "d")}


def test_divisors() -> None:
    for number in range(1, 200):
        assert divisors(number) == [d for d in range(1, number + 1) if number % d == 0]


@pytest.mark.parametrize(
    ("axes", "message"),
    [
        (["tp", "dq"], "unknown axis 'dq'"),
        ({"tp": 0}, "largest tp=0"),
        ({"tp": True}, "largest tp=True"),
        (7, "expected axis names"),
    ],
)
def test_bad_axes_name_the_axis(axes: object, message: str) -> None:
    with pytest.raises(LayoutError, match=message):
        check_axes(axes)
    with pytest.raises(LayoutError, match=message):
        list(valid_specs(4, axes=axes))  # type: ignore[arg-type]


def test_bad_ranks_and_order() -> None:
    with pytest.raises(LayoutError, match="ranks=0"):
        list(valid_specs(0))
    with pytest.raises(LayoutError, match="order='x'"):
        list(valid_specs(4, order="x"))
