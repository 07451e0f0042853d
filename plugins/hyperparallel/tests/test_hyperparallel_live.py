"""Live gloo worlds: every mesh dim of every rank's MeshContext all-reduces and all-gathers as planned, with
the fallback classes over torch's DeviceMesh and with Hyper-Parallel's classes (the stand-in)."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from plugins.hyperparallel.tests import hyperparallel_workers as workers
from plugins.hyperparallel.tests.hp_checks import (
    COMPARE,
    STAGED,
    check_dims,
    check_matches_build_meshs,
    check_pipelined,
)
from plugins.hyperparallel.tests.hp_expected import group_along, hp_meshes, stage_window
from shardcore.testing import run_world

SHARDS = "tp=2,pp=2,ep=2,expt_tp=1+cp=2,dp=2,ep=2,expt_tp=1"
STANDALONE = {"dp_size": 2, "tp_size": 2, "pp_size": 2, "ep_size": 2, "dp_shard_size": 1, "dp_replicate_size": 2}
SIZES = [  # (offset, tp, cp, dp, pp, ep, dp_shard, edp_shard) of each shard
    (0, 2, 1, 1, 2, 2, 1, 1),
    (4, 1, 2, 2, 1, 2, 2, 1),
]
TORCH_MESH = "torch.distributed.device_mesh.DeviceMesh"
HP_MESH = "hyper_parallel.core.dtensor.device_mesh.DeviceMesh"


@pytest.fixture(scope="module")
def reports() -> list[dict]:
    options = {"dp_shard": {1: 2}, "sequence_parallel": True}
    return run_world(8, workers.build_and_probe, SHARDS, options, STANDALONE, COMPARE, STAGED, timeout=400)


@pytest.mark.parametrize("rank", range(8))
def test_each_mesh_all_reduces_over_hyper_parallels_groups(reports: list[dict], rank: int) -> None:
    report = reports[rank]
    shard = 0 if rank < 4 else 1
    offset, tp, cp, dp, pp, ep, dp_shard, edp_shard = SIZES[shard]
    assert report["shard"] == shard and report["type"] == "shardcore_hyperparallel.context.MeshContext"
    window = stage_window(offset, tp, cp, dp, rank)
    for kind, (shape, names) in hp_meshes(tp, cp, dp, pp, ep, dp_shard, edp_shard).items():
        assert report[kind]["names"] == list(names), kind
        assert report[f"{kind}_seen"]["class"] == TORCH_MESH
        check_dims(report[kind]["dims"], window, shape, names, rank)
    local = rank - window[0]
    assert report["dp_cp"]["ranks"] == [r for r in window if (r - window[0]) % tp == local % tp]
    assert report["dp_cp"]["sum"] == dp * cp
    assert report["cp"]["ranks"] == group_along(window, (dp, cp, tp), rank, 1)
    fields = report["fields"]
    assert (fields["tp_size"], fields["cp_size"], fields["dp_size"], fields["pp_size"], fields["ep_size"]) == (
        tp,
        cp,
        dp,
        pp,
        ep,
    )
    assert fields["dp_shard_size"] == dp_shard and fields["dp_replicate_size"] == dp * cp // dp_shard
    assert fields["pp_rank"] == (rank - offset) // len(window)
    assert (fields["dp_rank"], fields["cp_rank"], fields["tp_rank"]) == (
        local // (cp * tp),
        local // tp % cp,
        local % tp,
    )
    assert fields["ep_rank"] == local % ep
    assert fields["sequence_parallel"] is True and fields["loss_parallel"] is False
    assert report["pp_enabled"] == (pp > 1)


@pytest.mark.parametrize("rank", range(8))
def test_standalone_build_meshs_on_the_whole_world(reports: list[dict], rank: int) -> None:
    """The fallback MeshContext without shardcore: stages of 4 (dp=2, tp=2), pp=2, ep=2 -> 3-D expert mesh."""
    result = reports[rank]["standalone"]
    window = stage_window(0, 2, 1, 2, rank)
    for kind, (shape, names) in hp_meshes(tp=2, cp=1, dp=2, pp=2, ep=2, dp_shard=1, edp_shard=1).items():
        check_dims(result[kind], window, shape, names, rank)
    assert result["dp_cp"]["ranks"] == [r for r in window if r % 2 == rank % 2]
    local = rank % 4
    assert result["ranks"] == [local // 2, 0, local % 2, local % 2]


@pytest.mark.parametrize("rank", range(8))
def test_the_handle_matches_hyper_parallels_own_build_meshs(reports: list[dict], rank: int) -> None:
    check_matches_build_meshs(reports[rank]["compare"], rank, HP_MESH)


@pytest.mark.parametrize("rank", range(8))
def test_hyper_parallels_meshes_over_pipeline_stages_wrap_shardcores_groups(reports: list[dict], rank: int) -> None:
    check_pipelined(reports[rank]["stand_in"], rank, HP_MESH)


@pytest.mark.parametrize("rank", [0, 5])
def test_the_stand_in_refuses_a_dp_cp_mesh_made_apart_as_hyper_parallel_does(reports: list[dict], rank: int) -> None:
    """What the plugin made before (dp_cp a mesh of its own, only registered on device_mesh): the stand-in
    raises where Hyper-Parallel raises, so the flattened dim's tests above catch a return to it."""
    apart = reports[rank]["apart"]
    assert apart["root_mesh"] is None
    assert (
        apart["slice"].startswith("NotImplementedError: ") and "only allows slicing out a contiguous" in apart["slice"]
    )
    assert apart["concatenate"].startswith("ValueError: ") and "share the same root mesh" in apart["concatenate"]
    assert apart["upstream_property"] == (
        "ValueError: Flatten mesh with mesh_dim_name 'dp_cp' has been created before with different layout"
    )
