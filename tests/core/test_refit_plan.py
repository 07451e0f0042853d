"""The refit planner, simulated in plain Python (no torch, no numpy) on random layouts and manifests.

Every source rank's local tensors are cut from known global tensors (element value = its global
flat index, tagged with the tensor), the plan's transfers are applied, and every destination
rank's local tensors must equal what it must hold, each element written exactly once.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import replace
from itertools import product
from math import prod

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from shardcore.errors import ManifestError
from shardcore.plan.layout import Layout, ShardPlan, plan_layout
from shardcore.plan.spec import ShardSpec
from shardcore.refit import Manifest, RefitPlan, RefitStats, TensorSpec, Transfer, holdings, local_shape, plan_refit
from shardcore.refit.cost import _Tally
from shardcore.refit.part import transfer_order

SIM = settings(max_examples=150, deadline=None, suppress_health_check=list(HealthCheck))


# -- the simulation ---------------------------------------------------------------------------


def _cells(box: Sequence[tuple[int, int]]) -> Iterator[tuple[int, ...]]:
    return product(*(range(start, stop) for start, stop in box))


def _flat(index: Sequence[int], shape: Sequence[int]) -> int:
    out = 0
    for i, size in zip(index, shape):
        out = out * size + i
    return out


def _sources(plan: ShardPlan, manifest: Manifest) -> dict[tuple[int, str], list[object]]:
    """Every rank's local source tensors, cut from the global tensors (value = (name, global flat index))."""
    local: dict[tuple[int, str], list[object]] = {}
    for rank in plan.ranks:
        for tensor in manifest:
            shape = local_shape(tensor, plan, rank, manifest)
            if shape is None:
                assert holdings(tensor, plan, rank, manifest) == ()
                continue
            data: list[object] = [None] * prod(shape)
            for box, offset in holdings(tensor, plan, rank, manifest):
                for cell in _cells(box):
                    at = [c - b[0] + o for c, b, o in zip(cell, box, offset)]
                    assert data[_flat(at, shape)] is None, "holdings overlap in the local tensor"
                    data[_flat(at, shape)] = (tensor.name, _flat(cell, tensor.shape))
            assert None not in data, "holdings do not tile the local tensor"
            local[rank, tensor.name] = data
    return local


def simulate(refit: RefitPlan) -> list[Transfer]:
    """Apply every transfer, hop 0 before hop 1 (as the executor runs them: a relay forwards what it received);
    check exactly-once delivery, values, holders and locality. Returns the transfers."""
    manifest, source = refit.manifest, refit.source
    chosen = {t.name for p, t in enumerate(manifest) if refit.tensors is None or p in refit.tensors}
    have = _sources(source, manifest)
    transfers = list(refit.transfers())
    received: dict[tuple[int, str], list[object]] = {}
    writes: dict[tuple[int, str], list[int]] = {}
    for destination in refit.destinations:
        for rank in destination.ranks:
            for tensor in manifest:
                shape = local_shape(tensor, destination, rank, manifest)
                if shape is not None and tensor.name in chosen:
                    received[rank, tensor.name] = [None] * prod(shape)
                    writes[rank, tensor.name] = [0] * prod(shape)
    for transfer in sorted(transfers, key=lambda t: t.hop):
        tensor = manifest.tensor(transfer.tensor)
        assert transfer.bytes == prod(transfer.shape) * tensor.wire_itemsize > 0
        assert transfer.hop in (0, 1) and not (transfer.hop and transfer.is_local), transfer
        if transfer.hop:  # a relay forwards from its destination tensor, inside its node
            assert refit.fan_out and transfer.src // refit.ranks_per_node == transfer.dst // refit.ranks_per_node  # type: ignore[operator]
            src_data = received[transfer.src, transfer.tensor]
            src_shape = local_shape(tensor, _shard_of(refit, transfer.src), transfer.src, manifest)
        else:
            src_data = have[transfer.src, transfer.tensor]  # KeyError: the source holds none of it
            src_shape = local_shape(tensor, source, transfer.src, manifest)
        dst_shape = local_shape(tensor, _shard_of(refit, transfer.dst), transfer.dst, manifest)
        assert src_shape is not None and dst_shape is not None
        if not transfer.is_local:  # the destination must not already hold any of it
            for box, _ in holdings(tensor, source, transfer.dst, manifest):
                assert any(a >= d or c >= b for (a, b), (c, d) in zip(box, transfer.box)), transfer
        for cell in _cells(transfer.box):
            rel = [c - b[0] for c, b in zip(cell, transfer.box)]
            value = src_data[_flat([r + o for r, o in zip(rel, transfer.src_offset)], src_shape)]
            assert value == (tensor.name, _flat(cell, tensor.shape)), (transfer, cell)
            at = _flat([r + o for r, o in zip(rel, transfer.dst_offset)], dst_shape)
            received[transfer.dst, transfer.tensor][at] = value
            writes[transfer.dst, transfer.tensor][at] += 1
    for key, counts in writes.items():
        assert set(counts) == {1}, f"{key}: elements written {sorted(set(counts))} times"
    assert received == {key: value for key, value in _expected(refit).items() if key[1] in chosen}
    return transfers


def _shard_of(refit: RefitPlan, rank: int) -> ShardPlan:
    return next(plan for plan in refit.destinations if rank in plan)


def _expected(refit: RefitPlan) -> dict[tuple[int, str], list[object]]:
    out: dict[tuple[int, str], list[object]] = {}
    for destination in refit.destinations:
        out.update(_sources(destination, refit.manifest))
    return out


def check_for_rank(refit: RefitPlan, transfers: list[Transfer]) -> None:
    """for_rank(r), computed alone, is exactly rank r's share of the global plan, in the agreed order."""
    key = transfer_order(refit.manifest)
    moved = {t.name for p, t in enumerate(refit.manifest) if refit.tensors is None or p in refit.tensors}
    for rank in range(refit.layout.world_size):
        mine = refit.for_rank(rank)
        assert list(mine.sends) == sorted((t for t in transfers if t.src == rank != t.dst), key=key)
        assert list(mine.recvs) == sorted((t for t in transfers if t.dst == rank != t.src), key=key)
        assert list(mine.copies) == sorted((t for t in transfers if t.src == rank == t.dst), key=key)
        for tensor in refit.manifest:
            held = local_shape(tensor, refit.source, rank, refit.manifest)
            expected = held if tensor.name in moved and tensor.scale_of is None else None  # scales: derived
            assert mine.source_shapes.get(tensor.name) == expected
            need = [local_shape(tensor, plan, rank, refit.manifest) for plan in refit.destinations if rank in plan]
            assert mine.destination_shapes.get(tensor.name) == (need[0] if need and tensor.name in moved else None)


def stats_tile_by_tile(refit: RefitPlan) -> RefitStats:
    """The stats added piece by piece over every tile, as ``RefitStats.of`` added them before it added a
    route's run by arithmetic: the oracle of every figure it reports."""
    tally = _Tally.start(refit)
    for tile, pieces in refit.tiles():
        tally.add(tile, pieces)
    return RefitStats.of_tally(refit, tally)


def check_stats(refit: RefitPlan, transfers: list[Transfer]) -> None:
    stats = RefitStats.of(refit)
    assert stats == stats_tile_by_tile(refit)
    peers: dict[int, set[int]] = {}
    for t in transfers:
        if not t.is_local:
            peers.setdefault(t.src, set()).add(t.dst)
            peers.setdefault(t.dst, set()).add(t.src)
    assert stats.peers == {rank: len(others) for rank, others in peers.items()}
    moved = [t for t in transfers if not t.is_local]
    assert stats.total_bytes == sum(t.bytes for t in moved)
    assert stats.local_bytes == sum(t.bytes for t in transfers if t.is_local)
    assert stats.transfers == len(transfers)
    assert stats.intra_node_bytes + stats.inter_node_bytes == stats.total_bytes
    for rank, size in stats.sent.items():
        assert size == sum(t.bytes for t in moved if t.src == rank)
    assert sum(stats.received.values()) == stats.total_bytes
    assert stats.busiest_sent >= stats.lower_bound - 1e-9
    assert sum(shard.bytes for shard in stats.shards) == stats.total_bytes
    if refit.ranks_per_node is not None:
        per = refit.ranks_per_node
        assert stats.intra_node_bytes == sum(t.bytes for t in moved if t.src // per == t.dst // per)
    assert stats.relayed_bytes == sum(t.bytes for t in transfers if t.hop)
    if refit.fan_out:  # what fan-out saves is what the same plan without it sends across nodes
        direct = RefitStats.of(replace(refit, fan_out=False))
        assert stats.inter_node_bytes_without_fan_out == direct.inter_node_bytes >= stats.inter_node_bytes
        assert stats.total_bytes == direct.total_bytes


def check_pieces(refit: RefitPlan) -> None:
    """The floor: no piece under ``min_piece_bytes`` unless it is the whole tile. Fan-out: a tile's rows enter a
    node without holders once, whichever destinations sliced alike need them there (destinations sliced
    otherwise, or holding the box in another local tensor, as another layout does, are other groups: their tiles
    may coincide, and enter again)."""
    entering: dict[tuple[object, ...], int] = {}
    per = refit.ranks_per_node
    for tile, pieces in refit.tiles():
        for src, dst, lo, hi, hop in pieces:
            assert 0 <= lo < hi <= tile.rows, (tile, lo, hi)
            if src != dst and (hi - lo) * tile.row_bytes < refit.min_piece_bytes:
                assert (lo, hi) == (0, tile.rows), (tile, lo, hi)
            if refit.fan_out and per is not None and not hop and src // per != dst // per:
                first = tile.group[0][1]
                key = (tile.position, tile.box, dst // per, first.box, first.target)
                entering[key] = entering.get(key, 0) + hi - lo
    for key, rows in entering.items():
        assert rows <= key[1][0][1] - key[1][0][0], key  # type: ignore[index]


# -- random layouts and manifests ----------------------------------------------------------------


@st.composite
def shard_specs(draw: st.DrawFn, max_ranks: int = 16) -> ShardSpec:
    tp = draw(st.sampled_from([1, 2, 4]))
    cp = draw(st.sampled_from([1, 1, 2]))
    pp = draw(st.sampled_from([1, 1, 2, 3]))
    dp = draw(st.sampled_from([1, 1, 2, 3]))
    while tp * cp * pp * dp > max_ranks:
        dp, cp, pp = (1, cp, pp) if dp > 1 else (dp, 1, pp) if cp > 1 else (dp, cp, 1)
    inner = tp * cp * dp
    pairs = [(et, ep) for et in (1, 2, 4) for ep in (1, 2, 4) if inner % (et * ep) == 0]
    expt_tp, ep = draw(st.sampled_from(pairs))
    return ShardSpec(tp=tp, cp=cp, pp=pp, dp=dp, ep=ep, expt_tp=expt_tp)


@st.composite
def manifests(draw: st.DrawFn) -> Manifest:
    layers = draw(st.sampled_from([0, 6]))
    experts = draw(st.sampled_from([0, 4])) if layers else 0
    tensors = []
    for i in range(draw(st.integers(1, 6))):
        ndim = draw(st.integers(1, 3))
        shape = [draw(st.integers(1, 3)) for _ in range(ndim)]
        fields: dict[str, object] = {}
        if draw(st.booleans()):
            tp_dim = draw(st.integers(0, ndim - 1))
            unit = draw(st.sampled_from([1, 1, 2]))
            blocks = [4 * unit * draw(st.integers(1, 2)) for _ in range(draw(st.integers(1, 2)))]
            shape[tp_dim] = sum(blocks)
            fields.update(tp_dim=tp_dim, blocks=tuple(blocks), unit=unit)
        if layers and draw(st.booleans()):
            fields["layer"] = draw(st.integers(0, layers - 1))
            if experts and draw(st.booleans()):
                fields["expert"] = draw(st.integers(0, experts - 1))
        else:
            fields["stage"] = draw(st.sampled_from([("first",), ("last",), ("first", "last"), ("all",)]))
        dtype = draw(st.sampled_from(["bfloat16", "float32", "int8"]))
        if dtype != "int8":  # a converting refit: wire bytes, and per-tensor fp8 scales placed and moved too
            fields["to_dtype"] = draw(st.sampled_from([None, None, "bfloat16", "float32", "float8_e4m3fn"]))
            fields["scale"] = "tensor" if fields["to_dtype"] == "float8_e4m3fn" else None
        tensors.append(TensorSpec(f"t{i}", tuple(shape), dtype, **fields))  # type: ignore[arg-type]
    return Manifest(tuple(tensors), layers=layers, experts=experts)


@st.composite
def refits(draw: st.DrawFn) -> RefitPlan:
    manifest = draw(manifests())
    source = draw(shard_specs())
    targets = draw(st.lists(shard_specs(max_ranks=12), min_size=1, max_size=2))
    per_node = draw(st.sampled_from([None, 1, 2, 4]))
    fan_out = per_node is not None and draw(st.booleans())
    min_piece = draw(st.sampled_from([0, 0, 16, 40, 1 << 20]))
    if draw(st.booleans()):  # disaggregated: one layout, the destinations after the source
        layout = plan_layout(sum(s.world_size for s in (source, *targets)), [source, *targets])
        src: int | ShardPlan = 0
        dst: list[int | ShardPlan] = list(range(1, len(targets) + 1))
    else:  # collocated: a second layout over the same world
        world = max(source.world_size, sum(s.world_size for s in targets))
        layout = plan_layout(world, [source], allow_idle=True)
        other = plan_layout(world, targets, allow_idle=True)
        src, dst = 0, list(other.shards)
    plan = plan_refit(layout, src, dst, manifest, per_node, min_piece_bytes=min_piece, fan_out=fan_out)
    if draw(st.integers(0, 3)) == 0:  # a partial refit
        names = [t.name for t in manifest]
        return plan.subset(draw(st.lists(st.sampled_from(names), min_size=1, unique=True)))
    return plan


@SIM
@given(refits())
def test_simulated_refit_delivers_every_element_once(refit: RefitPlan) -> None:
    transfers = simulate(refit)
    check_for_rank(refit, transfers)
    check_stats(refit, transfers)
    check_pieces(refit)


# -- named cases ----------------------------------------------------------------------------------


def _tiny(layers: int = 4, experts: int = 4, first: int | None = None, last: int | None = None) -> Manifest:
    tensors = [
        TensorSpec("emb", (16, 4), "float32", tp_dim=0, stage=("first", "last")),
        TensorSpec("norm", (4,), "float32", stage=("last",)),
    ]
    for layer in range(layers):
        tensors += [
            TensorSpec(f"l{layer}.fc1", (16, 4), "float32", tp_dim=0, blocks=(8, 8), layer=layer),
            TensorSpec(f"l{layer}.fc2", (4, 8), "float32", tp_dim=1, layer=layer),
            TensorSpec(f"l{layer}.ln", (4,), "float32", layer=layer),
        ]
        tensors += [
            TensorSpec(f"l{layer}.e{e}", (8, 4), "float32", tp_dim=0, layer=layer, expert=e) for e in range(experts)
        ]
    return Manifest(tuple(tensors), layers=layers, experts=experts, first_stage_layers=first, last_stage_layers=last)


def _layout(spec: str) -> Layout:
    from shardcore.plan.spec import parse_shards

    return plan_layout(sum(s.world_size for s in parse_shards(spec)), spec)


def test_identity_refit_is_all_local_copies() -> None:
    layout = _layout("tp=2,pp=2,dp=2,ep=2")
    other = plan_layout(8, "tp=2,pp=2,dp=2,ep=2")
    refit = plan_refit(layout, 0, other.shards[0], _tiny())
    transfers = simulate(refit)
    assert transfers and all(t.is_local for t in transfers)
    assert RefitStats.of(refit).total_bytes == 0 and RefitStats.of(refit).busiest_sender is None


def test_uneven_pipeline_split_and_several_destinations() -> None:
    manifest = _tiny(layers=5, first=1, last=2)  # pp=3: stages hold 1, 2, 2 layers
    with pytest.raises(ManifestError, match="5 layers over pp=5, first_stage_layers=1, last_stage_layers=2"):
        plan_refit(_layout("tp=2,pp=3,dp=2,ep=2 + tp=1,pp=5"), 0, 1, manifest)
    layout = _layout("tp=2,pp=3,dp=2,ep=2 + tp=4,ep=4,expt_tp=1 + tp=1,dp=2,ep=2")
    refit = plan_refit(layout, 0, [1, 2], manifest, min_piece_bytes=0)
    transfers = simulate(refit)
    check_for_rank(refit, transfers)
    assert {t.dst for t in transfers} == set(range(12, 18))


def test_pieces_split_across_replicas_balance_the_load() -> None:
    # 8 source replicas (dp=8), one tp=1 destination: each of the 8 holds every byte; the split
    # lets each send an eighth of every large tensor.
    manifest = Manifest((TensorSpec("w", (1024, 1024), "float32", tp_dim=0, stage=("all",)),))
    refit = plan_refit(_layout("tp=1,dp=8 + tp=1"), 0, 1, manifest, min_piece_bytes=1 << 16)
    stats = RefitStats.of(refit)
    assert stats.total_bytes == 4 << 20
    assert stats.lower_bound == (4 << 20) / 8
    assert stats.busiest_sent == stats.lower_bound and len(stats.sent) == 8


def test_whole_small_tensors_rotate_over_replicas() -> None:
    manifest = Manifest(tuple(TensorSpec(f"n{i}", (64,), "float32", stage=("all",)) for i in range(64)))
    refit = plan_refit(_layout("tp=1,dp=4 + tp=1"), 0, 1, manifest)  # each tensor is one 256-byte piece
    stats = RefitStats.of(refit)
    assert stats.transfers == 64
    assert sorted(stats.sent.values()) == [16 * 256] * 4


def test_same_node_sources_first() -> None:
    # collocated: train tp=1,dp=8 on ranks 0-7, a tp=2 destination on ranks 0-1 and another on 4-5 (nodes of 4)
    manifest = _tiny(layers=2, experts=0)
    layout = plan_layout(8, "tp=1,dp=8")
    other = plan_layout(8, "tp=2 + tp=2 + tp=2 + tp=2")
    refit = plan_refit(layout, 0, [other.shards[0], other.shards[2]], manifest, ranks_per_node=4)
    transfers = simulate(refit)
    assert all(t.src // 4 == t.dst // 4 for t in transfers)
    assert RefitStats.of(refit).inter_node_bytes == 0


def test_for_rank_of_an_idle_or_foreign_rank_is_empty() -> None:
    layout = plan_layout(12, "tp=2,dp=2 + tp=4", allow_idle=True)
    refit = plan_refit(layout, 0, 1, _tiny(experts=0))
    mine = refit.for_rank(10)
    assert mine.sends == mine.recvs == mine.copies == () and mine.source_shapes == mine.destination_shapes == {}
