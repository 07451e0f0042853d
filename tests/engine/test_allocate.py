"""``allocate_refit``: a rank's sources and destinations in the plan's shapes and dtypes (a bf16 model's are bf16),
seeded sources alike on every rank and in every layout, so a refit of them can be checked on each rank alone."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

import torch

from shardcore import allocate_refit
from shardcore.engine import seeded_box
from shardcore.errors import LayoutError
from shardcore.plan.layout import plan_layout
from shardcore.refit import manifest_from_hf_config
from shardcore.refit.planner import plan_refit
from shardcore.testing import run_world
from tests.engine import refit_workers as workers

CONFIG = {
    "model_type": "qwen2", "hidden_size": 64, "intermediate_size": 96, "num_hidden_layers": 2,
    "num_attention_heads": 4, "num_key_value_heads": 2, "vocab_size": 128, "torch_dtype": "bfloat16",
}  # fmt: skip


def test_a_seeded_box_is_its_slice_of_the_seeded_whole() -> None:
    """A box is computed alone and equals the same box of the whole tensor: any layout's ranks agree."""
    whole = seeded_box((6, 10, 4), ((0, 6), (0, 10), (0, 4)), 3, torch.float32)
    part = seeded_box((6, 10, 4), ((2, 5), (7, 10), (1, 3)), 3, torch.float32)
    assert torch.equal(part, whole[2:5, 7:10, 1:3])
    assert whole.abs().max() <= 1 and whole.unique().numel() > 100  # spread values, not a constant
    assert not torch.equal(whole, seeded_box((6, 10, 4), ((0, 6), (0, 10), (0, 4)), 4, torch.float32))


def test_allocation_follows_the_part_and_refuses_a_bad_seed() -> None:
    """Empty tensors of the part's shapes and dtypes on each side (bf16 here, where ``torch.randn(shape)`` gives
    float32 and the executor refuses it); a seed that is not an int is one typed error."""
    manifest = manifest_from_hf_config(CONFIG).manifest
    plan = plan_refit(plan_layout(4, "tp=2,role=train + tp=2"), 0, [1], manifest)
    for rank in (0, 2):
        mine = plan.for_rank(rank)
        sources, destinations = allocate_refit(plan, rank)
        for tensors, shapes, dtypes in (
            (sources, mine.source_shapes, mine.source_dtypes),
            (destinations, mine.destination_shapes, mine.destination_dtypes),
        ):
            assert {n: tuple(t.shape) for n, t in tensors.items()} == shapes
            assert {n: str(t.dtype).removeprefix("torch.") for n, t in tensors.items()} == dtypes
    assert allocate_refit(plan, 0).sources and not allocate_refit(plan, 0).destinations
    with pytest.raises(LayoutError, match=r"seed='7': expected an int"):
        allocate_refit(plan, 0, seed="7")  # type: ignore[arg-type]


def test_seeded_sources_refit_into_what_each_destination_seeds_itself() -> None:
    results = run_world(8, workers.allocated_refit, CONFIG, timeout=300)
    assert all(r["dtypes"] == ["torch.bfloat16"] for r in results)
    assert all(r["destinations"] for r in results[4:])  # both engines received
    assert [r["differ"] for r in results] == [[]] * 8
