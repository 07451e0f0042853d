"""Checks of what the workers report, shared by the stand-in's live test and the real-package test."""

from __future__ import annotations

from plugins.hyperparallel.tests.hp_expected import group_along, hp_meshes, stage_window, unravel

COMPARE = ("tp=2,dp=4,ep=2,expt_tp=1", {"dp_size": 4, "tp_size": 2, "ep_size": 2, "dp_shard_size": 4})
"""8 ranks in one stage (pp=1), where Hyper-Parallel's own build_meshs is safe: shardcore's handle must equal it."""
STAGED = "tp=2,dp=2,pp=2,ep=2,expt_tp=1"
"""8 ranks in two stages of 4 (dp=2, tp=2), where Hyper-Parallel's own build_meshs collides
(test_hyperparallel_stages)."""
RANK_FIELDS = ("dp_rank", "tp_rank", "cp_rank", "pp_rank", "ep_rank")


def check_dims(probe: dict, window: list[int], shape: tuple[int, ...], names: tuple[str, ...], rank: int) -> None:
    """Each dim's group all-reduced and all-gathered over the ranks along that dim of ``window``."""
    for dim, name in enumerate(names):
        seen, expected = probe[name], group_along(window, shape, rank, dim)
        assert seen["sum"] == shape[dim] == seen["mesh_size"], (name, rank)
        assert seen["ranks"] == expected, (name, rank)
        assert seen["local"] == expected.index(rank), (name, rank)


def check_matches_build_meshs(seen: dict, rank: int, mesh_class: str) -> None:
    """COMPARE: the same classes, mesh names, shapes, ranks and coordinates as Hyper-Parallel's own
    build_meshs; the size fields equal; the rank fields are this rank's coordinates where Hyper-Parallel
    leaves 0 (the plugin README's table)."""
    own, ours = seen["hyper_parallel"], seen["shardcore"]
    assert seen["shardcore_is_a_hyper_parallel_context"]
    assert ours["meshes"] == own["meshes"] and ours["cp_mesh"] == own["cp_mesh"]
    for flattened in ("dp_cp_mesh", "dp_cp_tp", "joined", "dp_cp_root_is_device_mesh"):  # dp_cp: a flattened dim
        assert ours[flattened] == own[flattened], flattened
    assert ours["dp_cp_root_is_device_mesh"]
    assert {m["class"] for m in ours["meshes"].values()} == {mesh_class}
    sizes = {k: v for k, v in ours["fields"].items() if k not in RANK_FIELDS}
    assert sizes == {k: v for k, v in own["fields"].items() if k not in RANK_FIELDS}
    assert [own["fields"][k] for k in RANK_FIELDS] == [0, 0, 0, 0, 0]
    assert [ours["fields"][k] for k in RANK_FIELDS] == [rank // 2, rank % 2, 0, 0, rank % 2]


def check_pipelined(result: dict, rank: int, mesh_class: str) -> None:
    """STAGED, built twice with destroy_shards between: Hyper-Parallel's classes, each dim over the right
    ranks of the rank's own stage (all-reduced and all-gathered), Hyper-Parallel's own API answering, every
    dim resolving to shardcore's group, and none created through Hyper-Parallel (where it can be counted)."""
    assert result["created"] in (0, None)
    window = stage_window(0, 2, 1, 2, rank)
    local = rank - window[0]
    assert len(result["builds"]) == 2
    for report in result["builds"]:
        assert "hyper_parallel.distributed.mesh.MeshContext" in report["bases"]
        assert report["groups_are_shardcores"] and report["dp_cp_registered"]
        for kind, (shape, names) in hp_meshes(tp=2, cp=1, dp=2, pp=2, ep=2, dp_shard=2, edp_shard=1).items():
            assert report[f"{kind}_seen"] == {
                "class": mesh_class,
                "names": list(names),
                "shape": list(shape),
                "ranks": window,
                "coordinate": unravel(local, shape),
            }
            check_dims(report[kind]["dims"], window, shape, names, rank)
            api = report["api"][kind]
            assert (api["rank_list"], api["mesh_shape"]) == (window, list(shape))
            assert api["along"] == {name: group_along(window, shape, rank, d) for d, name in enumerate(names)}
            assert api["axis_id"] == {name: len(names) - 1 - d for d, name in enumerate(names)}
        assert report["dp_cp"]["ranks"] == [r for r in window if r % 2 == rank % 2]
        assert report["fields"]["pp_rank"] == rank // 4
        flattened = report["flattened_dp_cp"]
        assert flattened["sliced"] == {"ranks": window, "shape": [2, 2]}
        assert flattened["sliced_groups_are_shardcores"] == [True, True]
        assert flattened["joined_is_the_slice"] and flattened["root_is_device_mesh"] and flattened["upstream_property"]
