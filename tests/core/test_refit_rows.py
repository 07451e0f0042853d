"""A rank's part read two ways (torch-free): its receives of tensors of a kind held as ``Received`` boxes (``Rows``)
read as the tuple of transfers they stand for, and cut into the same messages as those transfers."""

from __future__ import annotations

import pickle
from dataclasses import replace

import pytest

from shardcore.plan.layout import plan_layout
from shardcore.plan.spec import parse_shards
from shardcore.refit.manifest import Manifest, TensorSpec
from shardcore.refit.part import Received, Rows
from shardcore.refit.planner import plan_refit
from shardcore.refit.schedule import MessagePieces, pair_messages, rank_batches
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


def test_a_message_reads_its_packed_boxes_as_their_pieces() -> None:
    """A message cut from ``Received`` boxes holds each tensor's boxes that fit whole as one entry (a ``Received``), and
    counts, sums, reads, compares and shows as the pieces its transfers are cut into; a box that would cross the
    message's end is cut as its transfer is."""
    mine = engine_plan("deepseek_v3").for_rank(2)
    items = [item for item in mine.recvs.items if item.src == 0]
    made = [transfer for item in items for transfer in (item.transfers(2) if isinstance(item, Received) else [item])]
    for cap in (1 << 20, 4096, 64):
        messages, expected = pair_messages(items, cap, 2), pair_messages(made, cap, 2)
        assert [size for _, size in messages] == [size for _, size in expected]
        for (pieces, _), (alike, _) in zip(messages, expected):
            assert isinstance(pieces, MessagePieces) and not any(alike.layouts)
            whole = tuple(alike)
            assert pieces == whole and pieces == list(whole) and len(pieces) == len(whole) and pieces != whole[1:]
            assert pieces.payload == sum(piece.nbytes for piece, _ in whole) and repr(pieces) == repr(whole)
            assert pieces[0] == whole[0] and pieces[-2:] == whole[-2:] and list(pieces) == list(whole)
        packed = [e for pieces, _ in messages for e, found in zip(pieces.entries, pieces.layouts) if found is not None]
        if cap == 64:  # no kind's boxes fit whole
            assert not packed
        else:
            assert all(isinstance(entry, Received) for entry in packed)
            assert packed and (cap < 1 << 20 or any(len(entry.rows) > 1 for entry in packed))


@pytest.mark.parametrize("source", ["tp=2,role=train", "tp=1,pp=2,role=train"])
def test_each_layer_is_received_as_it_is_held_and_typed(source: str) -> None:
    """A rank's receives are found once for the same weight of every layer, yet each layer's are its own: a layer on
    another pipeline stage comes from that stage's ranks, and a layer of another dtype moves its own bytes."""
    tensors = [
        TensorSpec(
            f"decoder.layers.{layer}.mlp.linear_fc1.weight",
            (64, 32),
            dtype="float32" if layer % 2 else "bfloat16",
            tp_dim=0,
            layer=layer,
        )
        for layer in range(4)
    ]
    layout = plan_layout(2 + 4, f"{source} + tp=4")
    plan = plan_refit(layout, 0, [1], Manifest(tuple(tensors), layers=4), min_piece_bytes=0)
    every = list(plan.transfers())
    for rank in range(2, 6):
        mine = plan.for_rank(rank)
        assert any(isinstance(item, Received) for item in mine.recvs.items)
        assert sorted(mine.recvs) == sorted(t for t in every if t.dst == rank and t.src != rank)
    assert {t.bytes for t in every if t.tensor.startswith("decoder.layers.1.")} == {16 * 32 * 4}


def test_an_engine_rank_receives_each_stage_from_its_own_ranks() -> None:
    """Every MoE layer of an engine's stacked tensors is alike, so its receives are found once; a trainer whose
    pipeline stages hold different layers still sends each from the stage that holds it."""
    model = model_of("qwen3_moe")
    layout = plan_layout(4 + 4, "tp=1,pp=2,dp=2,ep=2,expt_tp=1,role=train + tp=4,ep=2,expt_tp=2")
    plan = plan_refit(layout, 0, [1], model.manifest, layouts={1: model.layout("vllm")}, min_piece_bytes=0)
    every = list(plan.transfers())
    stages = {layer: stage for stage, layers in enumerate(model.manifest.stage_layers(2)) for layer in layers}
    for rank in range(4, 8):
        mine = plan.for_rank(rank)
        assert sorted(mine.recvs) == sorted(t for t in every if t.dst == rank and t.src != rank)
        for transfer in mine.recvs:
            layer = model.manifest.tensor(transfer.tensor).layer
            if layer is not None:
                assert layout.shards[0].coords(transfer.src)["pp"] == stages[layer], transfer


@pytest.mark.parametrize(
    ("spec", "to", "per_node", "direct"),
    [
        # replicas on nodes of their own: each expert's box has one needer per node, received whole from its holder
        ("tp=2,ep=2,expt_tp=1,role=train + tp=2,dp=2,expt_tp=2", [1], 2, {2, 3, 4, 5}),
        # both replicas on the trainer's node: each needer shares it with another, so every tensor goes the general way
        ("tp=2,ep=2,expt_tp=1,role=train + tp=2,dp=2,expt_tp=2", [1], 6, set()),
        # two engines; ranks 3, 4 and 5 share a node across them, so they never receive directly; rank 2 may
        ("tp=2,ep=2,expt_tp=1,role=train + tp=2,expt_tp=2 + tp=2,expt_tp=2", [1, 2], 3, {2}),
        # the second engine shares a node with the first's second stage: a layer there has a needer of each engine on
        # the node, a layer of the first stage one, so whether a rank there is alone differs from layer to layer
        ("tp=2,ep=2,expt_tp=1,role=train + tp=2,pp=2,expt_tp=2 + tp=2,expt_tp=2", [1, 2], 4, {2, 3}),
    ],
)
def test_fan_out_receives_directly_only_where_no_relay_serves(
    spec: str, to: list[int], per_node: int, direct: set[int]
) -> None:
    """With fan-out, an engine rank receives a tensor's boxes directly (as ``Received`` boxes, found once per
    layer's pattern) only where it is the tile's one needer on its node; every rank's part still equals the plan's
    transfers made tile by tile (which never take the direct way)."""
    model = model_of("qwen3_moe")
    layout = plan_layout(sum(shard.world_size for shard in parse_shards(spec)), spec)
    vllm = model.layout("vllm")
    plan = plan_refit(
        layout,
        0,
        to,
        model.manifest,
        layouts=dict.fromkeys(to, vllm),
        min_piece_bytes=0,
        fan_out=True,
        ranks_per_node=per_node,
    )
    every = list(plan.transfers())
    for rank in range(layout.world_size):
        mine = plan.for_rank(rank)
        assert sorted(mine.recvs) == sorted(t for t in every if t.dst == rank and t.src != rank), rank
        assert sorted(mine.sends) == sorted(t for t in every if t.src == rank and t.dst != rank), rank
        assert any(isinstance(item, Received) for item in mine.recvs.items) == (rank in direct), rank
