"""DTensor refit across meshes on live gloo worlds: full_tensor() on the destination equals the source."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from plugins.dtensor.tests import dtensor_refit_workers as workers
from shardcore.testing import run_world


def test_collocated_meshes_over_the_same_ranks() -> None:
    for rank, result in enumerate(run_world(4, workers.collocated)):
        assert all(result["source"].values()), (rank, result["source"])
        for label in ("flat", "transposed", "again"):
            assert result[label]["equal"] == dict.fromkeys(workers.SHAPES, True), (rank, label, result[label])
            assert result[label]["copied"] > 0  # each rank holds part of its destination already
        # built for each new destination mesh; kept for the one seen before (the loop's next step)
        assert [result[label]["plans"] for label in ("flat", "transposed", "again")] == [(1, 0), (1, 0), (0, 1)]


def test_training_mesh_to_two_inference_meshes_on_other_ranks() -> None:
    results = run_world(8, workers.disaggregated)
    assert [r["shard"] for r in results] == [0, 0, 0, 0, 1, 1, 2, 2]
    assert all(r["executed as"] == ("checksum", 3) for r in results)  # the executor's options reach it
    for rank, result in enumerate(results):
        assert all(result["source"].values()) and all(result["equal"].values()), (rank, result)
    assert all(r["received"] > 0 and r["sent"] == 0 for r in results[4:])
    assert sum(r["sent"] for r in results[:4]) == sum(r["received"] for r in results[4:])


def test_disagreeing_conventions_are_one_typed_error_on_every_rank() -> None:
    results = run_world(4, workers.errors)
    assert all(r == results[0] for r in results)
    out = results[0]
    assert out["shape"].startswith("RefitInputError") and "'qkv'" in out["shape"] and "[16, 12]" in out["shape"]
    assert "[16, 10]" in out["shape"]
    assert "float32" in out["dtype"] and "bfloat16" in out["dtype"]
    assert "'proj' has no source" in out["missing"]
    assert "Partial" in out["partial"] and "Replicate" in out["partial"]


def test_local_shards_are_a_layout_plans_sources_and_destinations() -> None:
    """``local_shards(module)``: the DTensors' local shards, in the shapes a shardcore layout's plan names where the
    DTensors split its tp dim contiguously; refit with ``execute_refit`` they give the destination's full tensors.
    A plain tensor and a Partial placement are refused, naming the tensor and the fix."""
    for rank, result in enumerate(run_world(4, workers.module_into_a_layout)):
        assert result["shapes"] and result["equal"] == dict.fromkeys(("qkv", "proj", "norm"), True), (rank, result)
        assert result["refused"]["plain"].startswith("RefitInputError: tensor 'norm' is a Tensor, not a DTensor")
        assert "distribute_tensor(t, mesh, [Replicate()])" in result["refused"]["plain"]
        assert "tensor 'norm': placement P(sum) is not supported" in result["refused"]["partial"]
