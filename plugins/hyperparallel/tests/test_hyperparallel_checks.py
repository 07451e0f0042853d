"""Every Hyper-Parallel check raises a LayoutError (a ValueError) that says what to change."""

from __future__ import annotations

from types import SimpleNamespace

import pytest

from shardcore import LayoutError, plan_layout
from shardcore.engine.backends.shards import check_options
from shardcore_hyperparallel import HyperParallelBackend, check_dense_tp_layout, resolve_sizes


def _validate(spec: str, world: int, order: str = "tp-cp-dp-pp", **options: object) -> None:
    backend = HyperParallelBackend()
    check_options(backend, options)
    backend.validate(plan_layout(world, spec, order=order), options)


def test_world_size_must_be_dp_cp_tp_pp() -> None:
    with pytest.raises(LayoutError, match=r"dp\*cp\*tp\*pp = 2\*1\*2\*2 = 8 must equal the world of 6 ranks") as info:
        resolve_sizes(world_size=6, dp=2, cp=1, tp=2, pp=2)
    assert isinstance(info.value, ValueError)
    assert "change dp, cp, tp or pp" in str(info.value)


def test_fsdp_domain_must_be_dp_times_cp() -> None:
    with pytest.raises(LayoutError, match=r"shard 0 .*dp_replicate\*dp_shard = 2\*4 = 8 must equal dp\*cp = 4"):
        _validate("tp=2,dp=2,cp=2", 8, dp_replicate=2, dp_shard=4)
    with pytest.raises(LayoutError, match="pick dp_shard dividing 4"):
        _validate("tp=2,dp=2,cp=2", 8, dp_shard=3)


def test_expert_domain_must_be_divisible_by_ep() -> None:
    # shardcore's spec already makes ep divide tp*cp*dp, so this guard is reached only directly
    with pytest.raises(LayoutError, match=r"expert domain .* dp\*cp\*tp = 6, must be divisible by ep=4: choose ep"):
        resolve_sizes(world_size=6, dp=3, cp=1, tp=2, pp=1, ep=4)


def test_expert_dp_must_be_divisible_by_edp_shard() -> None:
    with pytest.raises(LayoutError, match=r"dp\*cp\*tp/ep = 4 must be divisible by edp_shard=3: choose edp_shard"):
        _validate("tp=2,dp=4,ep=2,expt_tp=1", 8, edp_shard=3)


def test_expert_checks_only_when_ep_is_on() -> None:
    resolve_sizes(world_size=6, dp=3, cp=1, tp=2, pp=1, ep=1, edp_shard=5)


class _FakeMesh:
    """A mesh with a rank list per named dim and a local rank: enough for the TP layout check."""

    def __init__(self, tp_ranks: list[int], local: int) -> None:
        self.rank_list = tp_ranks
        self._local = local

    def __getitem__(self, name: str) -> _FakeMesh:
        return self

    def get_local_rank(self) -> int:
        return self._local


def test_dense_tp_layout_groups_must_match() -> None:
    with pytest.raises(LayoutError, match=r"device_mesh\['tp'\] ranks \(0, 1\) differ from fsdp_non_moe_mesh\['tp'\]"):
        check_dense_tp_layout(_FakeMesh([0, 1], 0), _FakeMesh([0, 2], 0))


def test_dense_tp_layout_local_ranks_must_match() -> None:
    with pytest.raises(LayoutError, match="tp index is 0 in device_mesh but 1 in fsdp_non_moe_mesh"):
        check_dense_tp_layout(_FakeMesh([0, 1], 0), _FakeMesh([0, 1], 1))


def test_dense_tp_layout_check_skips_meshes_without_rank_lists() -> None:
    check_dense_tp_layout(SimpleNamespace(), _FakeMesh([0, 1], 0))


def test_interleaved_pp_order_is_rejected() -> None:
    with pytest.raises(LayoutError, match=r"stages are contiguous windows.*use order='tp-cp-dp-pp'"):
        _validate("tp=2,pp=2,dp=2", 8, order="tp-cp-pp-dp")
    _validate("tp=2,dp=2", 4, order="tp-cp-pp-dp")  # without pp both orders are the same


def test_unknown_option_and_short_per_shard_option() -> None:
    with pytest.raises(
        LayoutError, match=r"unknown option\(s\) 'dp_shards' for backend 'hyperparallel': it accepts dp_replicate"
    ):
        _validate("tp=2", 2, dp_shards=1)
    with pytest.raises(LayoutError, match="gives no value for shard 1"):
        _validate("tp=2+tp=2", 4, dp_shard=[1])


@pytest.mark.parametrize("value", [0, -1, 1.5, True, "2"])
def test_option_values_must_be_positive_integers(value: object) -> None:
    with pytest.raises(LayoutError, match="expected a positive integer"):
        _validate("dp=2", 2, dp_shard=value)
