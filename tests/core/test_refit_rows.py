"""A rank's part read two ways (torch-free): its receives of tensors of a kind held as ``Received`` boxes (``Rows``)
read as the tuple of transfers they stand for, and cut into the same messages as those transfers."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from shardcore.plan.layout import plan_layout
from shardcore.refit.part import Received, Rows
from shardcore.refit.planner import plan_refit
from shardcore.refit.schedule import rank_batches
from tests.core.test_refit_layouts import model_of


def engine_plan(family: str):  # type: ignore[no-untyped-def]
    """A trainer with one holder per expert and per tp slice into vLLM's layout, and an engine rank's part."""
    model = model_of(family)
    layout = plan_layout(2 + 4, "tp=2,ep=2,expt_tp=1,role=train + tp=4,ep=2,expt_tp=2")
    return plan_refit(layout, 0, [1], model.manifest, layouts={1: model.layout("vllm")}, min_piece_bytes=0)


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("bucket_bytes", [64, 4096, 1 << 20])
def test_received_boxes_are_cut_into_the_messages_of_their_transfers(family: str, bucket_bytes: int) -> None:
    """Both ends cut a pair's messages alike: the sender from its transfers, the receiver from ``Received`` boxes; a
    box bigger than a pair's share of the bucket is cut as its transfer is."""
    plan = engine_plan(family)
    shapes = {tensor.name: tensor.shape for tensor in plan.manifest}
    for rank in range(2, 6):
        mine = plan.for_rank(rank)
        assert any(isinstance(item, Received) for item in mine.recvs.items)
        plain = replace(mine, recvs=tuple(mine.recvs))
        assert not any(isinstance(item, Received) for item in plain.recvs.items)
        assert rank_batches(mine, rank, 6, bucket_bytes, 8, shapes) == rank_batches(
            plain, rank, 6, bucket_bytes, 8, shapes
        )


def test_rows_read_as_the_tuple_of_their_transfers() -> None:
    """``Rows`` counts, sums and names its transfers without making them, and reads, compares, adds, shows and pickles
    as the tuple of them."""
    mine = engine_plan("deepseek_v3").for_rank(2)
    rows = Rows(mine.recvs.items, 2)
    count, nbytes, names = len(rows), rows.nbytes, rows.tensors()
    made = tuple(rows)
    assert count == len(made) > len(rows.items) and nbytes == sum(t.bytes for t in made)
    assert names == {t.tensor for t in made}
    assert rows == made and rows == list(made) and rows != made[1:] and rows == mine.recvs
    assert rows[0] == made[0] and rows[-3:] == made[-3:] and rows + made[:1] == (*made, made[0])
    assert made[:1] + rows == (made[0], *made) and repr(rows) == repr(made)
    assert pickle.loads(pickle.dumps(rows)) == made
    assert all(t.dst == 2 and t.hop == 0 for t in made)
