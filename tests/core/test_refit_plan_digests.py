"""Many refits' plans, whole, against digests recorded from the code before the planner's house was rebuilt (issue 42).

A plan here is everything its consumers read: every rank's part (each transfer with its hop and target, in the
part's order; the local shapes), every rank's schedule (its batches and messages, as ``schedule.rank_batches`` cuts
them, and its pairing tally), the partial-amax exchange of a per-tensor fp8 refit, the global transfer order and the
stats. Dense and MoE models, Megatron and engine layouts, collocated and disjoint, converting, fanned out and
partial. A refactor of the planner that changes any of it fails here, naming the case and the part that changed.

The digests live in ``refit_plan_digests.json`` beside this module; a deliberate change of the plans records them
anew with ``python -m tests.core.test_refit_plan_digests`` (and says why in its commit).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Callable
from pathlib import Path

import pytest

from shardcore.plan.layout import plan_layout
from shardcore.refit import RefitPlan, RefitStats, ShardPlacement, plan_refit, plan_refit_from, preset
from shardcore.refit.pairing import tally
from shardcore.refit.scales import amax_exchange
from shardcore.refit.schedule import rank_batches
from tests.core.test_refit_convert import _blocky
from tests.core.test_refit_layouts import model_of

RECORDED = Path(__file__).with_name("refit_plan_digests.json")
MOE = "tp=2,pp=2,dp=2,ep=2,role=train+tp=4,ep=4,expt_tp=1,role=prefill+tp=1,dp=4,ep=2,role=decode"


def _moe_disjoint() -> RefitPlan:
    return plan_refit(plan_layout(16, MOE), 0, [1, 2], preset("tiny-moe"), 4)


def _moe_collocated() -> RefitPlan:
    train, other = (
        plan_layout(8, "tp=2,pp=2,dp=2,ep=2,role=train"),
        plan_layout(8, "tp=4,ep=4,expt_tp=1 + tp=1,dp=4,ep=2"),
    )
    return plan_refit(train, 0, list(other.shards), preset("tiny-moe"), 2, min_piece_bytes=0)


def _dense_disjoint() -> RefitPlan:
    return plan_refit(plan_layout(6, "tp=2,dp=2,role=train+tp=1+tp=1"), 0, [1, 2], preset("tiny-dense"))


def _dense_fan_out() -> RefitPlan:
    layout = plan_layout(12, "tp=2,dp=2,role=train+tp=2,dp=2+tp=1,dp=4")
    return plan_refit(layout, 0, [1, 2], preset("tiny-dense"), 2, min_piece_bytes=0, fan_out=True)


def _dense_floor() -> RefitPlan:
    return plan_refit(plan_layout(8, "tp=4,role=train+tp=2,dp=2"), 0, 1, preset("tiny-dense"), min_piece_bytes="4KiB")


def _moe_subset() -> RefitPlan:
    return _moe_disjoint().subset(lambda tensor: tensor.expert in (0, 3) or tensor.name.endswith("bias"))


def _renumbered_source() -> RefitPlan:
    layout = plan_layout(10, "tp=2,pp=2,dp=2,ep=2,role=train+tp=2,ep=2,expt_tp=1")
    manifest = preset("tiny-moe")
    source = ShardPlacement(layout.shards[0], manifest).restrict({r: r for r in range(8) if r != 5} | {5: 9})
    return plan_refit_from(source, [ShardPlacement(layout.shards[1], manifest)], 4, min_piece_bytes=0, world_size=10)


def _into_layouts(family: str, experts: str = ",ep=2,expt_tp=1") -> Callable[[], RefitPlan]:
    def plan() -> RefitPlan:
        model = model_of(family)
        layout = plan_layout(2 + 4 + 4 + 2, f"tp=2{experts},role=train + dp=4 + tp=2,dp=2{experts} + dp=2")
        layouts = {1: model.layout("hf"), 2: model.layout("vllm"), 3: model.layout("hf-stacked")}
        return plan_refit(layout, 0, [1, 2, 3], model.manifest, min_piece_bytes=0, layouts=layouts)

    return plan


def _into_vllm_fan_out() -> RefitPlan:
    model = model_of("qwen3_moe")
    layout = plan_layout(2 + 4 + 4, "tp=2,ep=2,expt_tp=1,role=train + dp=4 + tp=2,dp=2,ep=2,expt_tp=1")
    layouts = {1: model.layout("hf-stacked"), 2: model.layout("vllm")}
    return plan_refit(layout, 0, [1, 2], model.manifest, ranks_per_node=2, fan_out=True, layouts=layouts)


def _into_vllm_fan_out_shared_kv() -> RefitPlan:
    """vLLM at tp=4 holds each of the model's 2 kv heads on two tp ranks: one destination holds a box in two slices,
    so a fan-out group has two members from it (``RefitPlan._groups``)."""
    model = model_of("llama")
    layout = plan_layout(2 + 8, "tp=2,role=train + tp=4,dp=2")
    return plan_refit(layout, 0, 1, model.manifest, ranks_per_node=4, fan_out=True, layouts={1: model.layout("vllm")})


def _from_hf() -> RefitPlan:
    model = model_of("deepseek_v3")
    layout = plan_layout(4 + 4, "dp=4 + tp=2,dp=2,ep=2,expt_tp=1,role=train")
    return plan_refit(layout, 0, 1, model.manifest, min_piece_bytes=0, layouts={0: model.layout("hf")})


def _fp8_blocks() -> RefitPlan:
    return plan_refit(plan_layout(6, "tp=2,dp=2,role=train + tp=2"), 0, 1, _blocky())


def _fp8_per_tensor() -> RefitPlan:
    return plan_refit(plan_layout(8, "tp=2,dp=2,role=train + tp=1,dp=4"), 0, 1, _blocky(scale="tensor"))


def _cast() -> RefitPlan:
    layout = plan_layout(12, "tp=2,pp=2,dp=2,ep=2,role=train + tp=4,ep=4,expt_tp=1")
    return plan_refit(layout, 0, 1, preset("tiny-moe").converted("bfloat16"))


def _fp8_into_vllm() -> RefitPlan:
    model = model_of("qwen3", hidden_size=256, intermediate_size=512, head_dim=128, num_attention_heads=2,
                     num_key_value_heads=2)  # fmt: skip
    layout = plan_layout(4, "tp=2,role=train + tp=2")
    manifest = model.manifest.converted("float8_e4m3fn")
    return plan_refit(layout, 0, 1, manifest, min_piece_bytes=0, layouts={1: model.layout("vllm")})


CASES: dict[str, Callable[[], RefitPlan]] = {
    "moe-disjoint": _moe_disjoint,
    "moe-collocated": _moe_collocated,
    "dense-disjoint": _dense_disjoint,
    "dense-fan-out": _dense_fan_out,
    "dense-floor": _dense_floor,
    "moe-subset": _moe_subset,
    "renumbered-source": _renumbered_source,
    "llama-into-layouts": _into_layouts("llama", ""),
    "qwen3-moe-into-layouts": _into_layouts("qwen3_moe"),
    "deepseek-v3-into-layouts": _into_layouts("deepseek_v3"),
    "qwen3-moe-into-vllm-fan-out": _into_vllm_fan_out,
    "llama-into-vllm-fan-out-shared-kv": _into_vllm_fan_out_shared_kv,
    "deepseek-v3-from-hf": _from_hf,
    "fp8-blocks": _fp8_blocks,
    "fp8-per-tensor": _fp8_per_tensor,
    "cast-bfloat16": _cast,
    "fp8-into-vllm": _fp8_into_vllm,
}


def _hash(items: object) -> str:
    return hashlib.sha256(repr(items).encode()).hexdigest()[:16]


def digests(plan: RefitPlan) -> dict[str, str]:
    """The plan's digests, part by part: ``parts`` (every rank's, whole and in order), ``schedule`` (every rank's
    batches and pairing tally, the amax exchange's too), ``transfers`` (the global order) and ``stats``."""
    world, manifest = plan.world_size, plan.manifest
    shapes = {tensor.name: tensor.shape for tensor in manifest}
    converting = frozenset(tensor.name for tensor in manifest if tensor.to_dtype is not None)
    parts, schedules = [], []
    for rank in range(world):
        mine = plan.for_rank(rank)
        parts.append((rank, mine.sends, mine.recvs, mine.copies, [*mine.source_shapes.items()],
                      [*mine.destination_shapes.items()]))  # fmt: skip
        amax = amax_exchange(plan, rank)
        for part, cut in ((mine, shapes), (amax, {name: (n,) for name, (_, n) in amax.parts.items()})):
            batches = rank_batches(part, rank, world, 1 << 16, 16, cut, converting if part is mine else frozenset())
            messages = [(b.key, [(m.key, m.peer, m.send, m.nbytes, m.ledger, m.pieces) for m in b.messages])
                        for b in batches]  # fmt: skip
            schedules.append((rank, messages, tally(batches), amax.parts))
    return {
        "parts": _hash(parts),
        "schedule": _hash(schedules),
        "transfers": _hash(list(plan.transfers())),
        "stats": _hash(RefitStats.of(plan)),
    }


@pytest.mark.parametrize("case", sorted(CASES))
def test_the_plan_is_the_recorded_one(case: str) -> None:
    recorded = json.loads(RECORDED.read_text())[case]
    assert digests(CASES[case]()) == recorded, f"{case}: the plan changed (see this module's doc)"


def test_every_case_is_recorded_and_none_is_empty() -> None:
    """The record names the cases this module plans, and every case moves something over the wire, with a hop or a
    target or a conversion where its name says so."""
    assert set(json.loads(RECORDED.read_text())) == set(CASES)
    fanned = [_dense_fan_out(), _into_vllm_fan_out(), _into_vllm_fan_out_shared_kv()]
    assert all(any(t.hop for t in plan.transfers()) for plan in fanned)
    engine = fanned[2].destination_placements[0]
    boxes = [(piece.target, piece.box) for p in range(len(engine.manifest)) for piece in engine.slices(p)]
    assert len(set(boxes)) < len(boxes)  # a box in two slices of one destination
    assert all(t.target for t in _into_vllm_fan_out().transfers())
    assert amax_exchange(_fp8_per_tensor(), 0).sends and not amax_exchange(_fp8_blocks(), 0).sends
    assert _moe_subset().tensors and _renumbered_source().world_size == 10


if __name__ == "__main__":  # records the digests anew: only for a deliberate change of the plans
    RECORDED.write_text(json.dumps({case: digests(make()) for case, make in sorted(CASES.items())}, indent=1) + "\n")
