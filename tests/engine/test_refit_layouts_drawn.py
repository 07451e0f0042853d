"""Refits through the engines' layouts on drawn models, shards and options, executed in one process: every
destination local tensor equals the source's tensors put through the weight map (in a partial refit, what lands
does), every rank's part is its share of the whole plan, and the parts' schedules agree on every message.

The live tests (``test_refit_layouts.py``) check chosen cases on real worlds against transformers models; these
draw the cases (family, head counts, both sides' parallelism, the layouts, the floor, fan-out) and apply the plan's
transfers to torch tensors directly, hop by hop, so a few hundred cases cost seconds. A drawn case that the
planner refuses with a ShardcoreError (an engine tp that does not divide the heads) is skipped.
"""

from __future__ import annotations

from functools import cache
from typing import Any

import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from shardcore.engine.live.layout_check import FILL, through_map
from shardcore.engine.live.refit_check import KnownWeights, cut
from shardcore.engine.transfer.pieces import view_of
from shardcore.errors import ShardcoreError
from shardcore.plan.layout import Layout, plan_layout
from shardcore.plan.spec import parse_shards
from shardcore.refit import pairing
from shardcore.refit.families import HFModel, manifest_from_hf_config
from shardcore.refit.plan import RefitPlan
from shardcore.refit.planner import plan_refit
from shardcore.refit.schedule import rank_batches
from tests.core.test_refit_plan import check_pieces, check_stats

DRAWN = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))


def _executed(plan: RefitPlan, sources: dict[int, dict[str, torch.Tensor]]) -> dict[int, dict[str, torch.Tensor]]:
    """Every rank's destination tensors after the plan's transfers (hop 0 from the sources, then the relays'
    forwards from their destinations), each first filled with FILL and the padding the executor zeroes zeroed;
    each rank's part, the stats and the pieces checked on the way as the Megatron-to-Megatron simulation checks
    them (``test_refit_plan``)."""
    every = list(plan.transfers())
    assert len(set(every)) == len(every)  # no box sent twice
    check_stats(plan, every)  # the stats are those of the transfers, tile by tile
    check_pieces(plan)  # the floor holds, and with fan-out a tile's rows enter a node once
    destinations: dict[int, dict[str, torch.Tensor]] = {}
    shapes, tallies = {tensor.name: tensor.shape for tensor in plan.manifest}, 0
    for rank in range(plan.world_size):
        mine = plan.for_rank(rank)
        assert sorted((*mine.sends, *mine.recvs, *mine.copies)) == sorted(t for t in every if rank in (t.src, t.dst))
        destinations[rank] = {name: torch.full(shape, FILL) for name, shape in mine.destination_shapes.items()}
        placement = plan.destination_placement_of(rank)
        for name, boxes in placement.zeroed(rank).items() if placement is not None else ():
            for box in boxes if name in destinations[rank] else ():  # what the executor zeroes: the engine's padding
                destinations[rank][name][tuple(slice(start, stop) for start, stop in box)] = 0.0
        tallies += pairing.tally(rank_batches(mine, rank, plan.world_size, 1 << 16, 16, shapes))
    assert tallies % pairing.MODULUS == 0  # both ends of every message agree: the executor's first meeting passes
    for hop in (0, 1):
        for t in (t for t in every if t.hop == hop):
            held = sources[t.src][t.tensor] if hop == 0 else destinations[t.src][t.destination]
            landing = view_of(destinations[t.dst][t.destination], t.dst_offset, t.shape)
            landing.copy_(view_of(held, t.src_offset, t.shape).reshape(landing.shape))
    return destinations


@st.composite
def models(draw: st.DrawFn) -> tuple[str, HFModel]:
    """A small fp32 model of one of the families, with drawn head counts (kv heads 1, 2 or 4: an engine's tp over
    fewer kv heads replicates them), widths, tied embeddings and experts."""
    family = draw(st.sampled_from(["llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3"]))
    kv = draw(st.sampled_from([1, 2, 4]))
    heads = kv * draw(st.sampled_from([1, 2, 4]))
    config: dict[str, Any] = {
        "model_type": family, "hidden_size": draw(st.sampled_from([32, 64])), "num_hidden_layers": 4,
        "intermediate_size": draw(st.sampled_from([32, 48, 96])), "num_attention_heads": heads,
        "num_key_value_heads": kv, "vocab_size": draw(st.sampled_from([77, 100, 256])), "torch_dtype": "float32",
        "tie_word_embeddings": draw(st.booleans()),
    }  # fmt: skip
    if family in ("qwen3", "qwen3_moe"):
        config["head_dim"] = draw(st.sampled_from([8, 16]))
    experts = draw(st.sampled_from([2, 4, 8]))
    if family == "qwen3_moe":
        config.update(num_experts=experts, moe_intermediate_size=draw(st.sampled_from([16, 32])))
    if family == "deepseek_v3":
        config.update(
            first_k_dense_replace=1, n_routed_experts=experts, n_shared_experts=1, moe_intermediate_size=16,
            kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, num_key_value_heads=heads,
        )  # fmt: skip
        if draw(st.booleans()):
            config["q_lora_rank"] = 24
    return family, manifest_from_hf_config(config, vocab_multiple=128)


def _engine(draw: st.DrawFn, moe: bool) -> str:
    """A vLLM engine's shard: tp and dp, and for a MoE its experts over ep (1 or 2) times expt_tp (the rest)."""
    tp, dp = draw(st.sampled_from([1, 2, 4])), draw(st.sampled_from([1, 2]))
    ep = draw(st.sampled_from([1, 2])) if moe and tp * dp > 1 else 1
    return f"tp={tp},dp={dp}" + (f",ep={ep},expt_tp={tp * dp // ep}" if moe else "")


def _megatron(draw: st.DrawFn, moe: bool) -> str:
    spec = (
        f"tp={draw(st.sampled_from([1, 2, 4]))},pp={draw(st.sampled_from([1, 2]))},dp={draw(st.sampled_from([1, 2]))}"
    )
    return spec + (f",ep={draw(st.sampled_from([1, 2]))},expt_tp={draw(st.sampled_from([1, 2]))}" if moe else "")


@st.composite
def options(draw: st.DrawFn) -> dict[str, Any]:
    """The planner's options: the floor (default, off, or small enough to cut these tiles) and nodes, with or
    without fan-out."""
    chosen: dict[str, Any] = {}
    floor = draw(st.sampled_from([None, 0, 256]))
    if floor is not None:
        chosen["min_piece_bytes"] = floor
    per_node = draw(st.sampled_from([None, 2, 4]))
    if per_node is not None:
        chosen.update(ranks_per_node=per_node, fan_out=draw(st.booleans()))
    return chosen


def _planned(model: HFModel, spec: str, layouts: dict[int, str], options: dict[str, Any]) -> tuple[Layout, RefitPlan]:
    """The layout and plan of a drawn case from shard 0 into the others; a case the planner refuses is skipped."""
    try:
        layout = plan_layout(sum(shard.world_size for shard in parse_shards(spec)), spec)
        chosen = {index: model.layout(kind) for index, kind in layouts.items() if kind != "megatron"}
        return layout, plan_refit(
            layout, 0, list(range(1, len(layout.shards))), model.manifest, layouts=chosen, **options
        )
    except ShardcoreError:
        assume(False)
        raise


@DRAWN
@given(models(), st.data(), options())
def test_from_megatron_shards_into_drawn_layouts(
    drawn: tuple[str, HFModel], data: st.DataObject, chosen: dict[str, Any]
) -> None:
    family, model = drawn
    moe = family in ("qwen3_moe", "deepseek_v3")
    kinds = data.draw(st.lists(st.sampled_from(["hf", "hf-stacked", "vllm", "megatron"]), min_size=1, max_size=2))
    shards = [f"{_megatron(data.draw, moe)},role=train"]
    shards += [
        "dp=" + str(data.draw(st.sampled_from([1, 2])))
        if kind.startswith("hf")
        else (_engine(data.draw, moe) if kind == "vllm" else _megatron(data.draw, moe))
        for kind in kinds
    ]
    layout, plan = _planned(model, " + ".join(shards), dict(enumerate(kinds, 1)), chosen)
    names = [tensor.name for tensor in model.manifest.tensors]
    partial = data.draw(st.booleans())
    if partial:  # a partial refit: the drawn tensors (and those refitted with them)
        plan = plan.subset(data.draw(st.sets(st.sampled_from(names), min_size=1, max_size=len(names) // 2)))
    weights = KnownWeights(model.manifest)
    source = layout.shards[0]
    sources = {
        rank: {
            name: cut(weights.full(name), model.manifest.tensor(name), source, rank, model.manifest)
            for name in plan.for_rank(rank).source_shapes
        }
        for rank in source.ranks
    }
    destinations = _executed(plan, sources)
    for shard in layout.shards[1:]:
        for rank in shard.ranks:
            mapped = through_map(plan, rank)
            for name, got in destinations[rank].items():
                if mapped is None:
                    wanted = cut(weights.full(name), model.manifest.tensor(name), shard, rank, model.manifest)
                else:
                    wanted = mapped(name, weights.full)
                if partial:  # what lands is right; the rest of a tensor fed by other tensors too stays as allocated
                    written = got != FILL
                    assert written.any() and torch.equal(got[written], wanted[written]), (rank, name)
                else:
                    assert torch.equal(got, wanted), (rank, name)


@DRAWN
@given(models(), st.data(), options())
def test_from_a_checkpoint_back_into_drawn_shards(
    drawn: tuple[str, HFModel], data: st.DataObject, chosen: dict[str, Any]
) -> None:
    """From the hf or hf-stacked layout (a checkpoint, on every rank of its shard) into Megatron shards or a vLLM
    engine; the checkpoint is the Megatron tensors put through the forward map, so Megatron shards get back exactly
    their own slices of those tensors."""
    family, model = drawn
    moe = family in ("qwen3_moe", "deepseek_v3")
    kind, into = data.draw(st.sampled_from(["hf", "hf-stacked"])), data.draw(st.sampled_from(["megatron", "vllm"]))
    target = _megatron(data.draw, moe) if into == "megatron" else _engine(data.draw, moe)
    layout, plan = _planned(
        model, f"dp={data.draw(st.sampled_from([1, 2]))},role=train + {target}", {0: kind, 1: into}, chosen
    )
    weights = KnownWeights(model.manifest)
    forward = plan_refit(
        plan_layout(2, "dp=1,role=train + dp=1"), 0, [1], model.manifest, layouts={1: model.layout(kind)}
    )
    converted = through_map(forward, 1)
    assert converted is not None

    @cache
    def checkpoint(name: str) -> torch.Tensor:
        return converted(name, weights.full)

    sources = {
        rank: {name: checkpoint(name) for name in plan.for_rank(rank).source_shapes} for rank in layout.shards[0].ranks
    }
    destinations = _executed(plan, sources)
    shard = layout.shards[1]
    for rank in shard.ranks:
        mapped = through_map(plan, rank)
        for name, got in destinations[rank].items():
            assert torch.equal(got, mapped(name, checkpoint)), (rank, name)
            if into == "megatron":
                own = cut(weights.full(name), model.manifest.tensor(name), shard, rank, model.manifest)
                written = got != FILL  # the vocabulary's padding rows stay as allocated
                assert torch.equal(got[written], own[written]), (rank, name)
