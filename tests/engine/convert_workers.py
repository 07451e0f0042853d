"""Rank functions for the converting-refit tests: several plans per spawned world (a world costs seconds)."""

from __future__ import annotations

import os
from dataclasses import asdict
from typing import Any

from shardcore import execute_refit
from shardcore.engine.live.refit_check import check_refit
from shardcore.errors import ShardcoreError
from shardcore.refit import Manifest, RefitRequest, TensorSpec, TransformerConfig, manifest_from_config, preset
from tests.engine.refit_workers import timed_outcome

BLOCKY = TransformerConfig(layers=2, hidden=256, ffn=512, heads=2, kv_heads=2, vocab=1024, dtype="bfloat16")
"""Every tp part a run of whole 128x128 blocks at tp <= 2 (head_dim 128, hidden 256)."""

# (label, model, conversion (to_dtype, scale) or None, source layout, destination layout or None (the same), shards)
CASES = [
    ("bf16 -> bf16", "blocky", None, "tp=2,dp=2,role=train + tp=1,dp=2 + tp=2", None, [1, 2]),
    ("fp32 -> bf16, collocated", "tiny-dense", ("bfloat16", None), "tp=2,dp=4", "tp=1,dp=8", [0]),
    (
        "bf16 -> fp32, disaggregated",
        "blocky",
        ("float32", None),
        "tp=2,dp=2,role=train + tp=1,dp=2 + tp=2",
        None,
        [1, 2],
    ),
    (
        "bf16 -> fp8 per tensor, tp 2 -> 1 and 2",
        "blocky",
        ("float8_e4m3fn", "tensor"),
        "tp=2,dp=2,role=train + tp=1,dp=2 + tp=2",
        None,
        [1, 2],
    ),
    (
        "bf16 -> fp8 per tensor, pp 2 -> 1, collocated",
        "blocky",
        ("float8_e4m3fn", "tensor"),
        "tp=2,pp=2,dp=2",
        "tp=2,dp=4",
        [0],
    ),
    (
        "bf16 -> fp8 per block, tp 2 -> 1 and 2",
        "blocky",
        ("float8_e4m3fn", "block"),
        "tp=2,dp=2,role=train + tp=1,dp=2 + tp=2",
        None,
        [1, 2],
    ),
    ("bf16 -> fp8 per block, collocated", "blocky", ("float8_e4m3fn", "block"), "tp=2,dp=4", "tp=1,dp=8", [0]),
    (
        "bf16 -> fp8 per block of each stacked matrix, tp 2 -> 1 and 2",
        "stacked",
        ("float8_e4m3fn", "block"),
        "tp=2,dp=2,role=train + tp=1,dp=2 + tp=2",
        None,
        [1, 2],
    ),
]

STACKED = Manifest(
    (
        TensorSpec("experts.w13", (4, 512, 256), tp_dim=1, blocks=(256, 256), stage="all"),  # tp parts: whole blocks
        TensorSpec("experts.w2", (6, 256, 200), tp_dim=0, stage="all"),  # 3 experts a tp part; blocks cut at 200
    ),
    name="stacked",
)
"""Stacked experts split over tp along a blocked dim and along the expert dim (which any split keeps whole)."""


def manifest_of(model: str, conversion: tuple[str, str | None] | None) -> Manifest:
    models = {"blocky": manifest_from_config(BLOCKY, name="blocky"), "stacked": STACKED}
    manifest = models[model] if model in models else preset(model)
    return manifest if conversion is None else manifest.converted(*conversion)


def plan_of(world: int, case: tuple) -> Any:
    _, model, conversion, src_spec, dst_spec, dst = case
    to_dtype, scale = conversion or (None, None)
    model = manifest_of(model, None)
    request = RefitRequest(model, src_spec, 0, tuple(dst), dst_spec, allow_idle=True, to_dtype=to_dtype, scale=scale)
    return request.plan(world)


def run_cases(rank: int, world: int, cases: list[tuple], options: dict[str, Any]) -> list[dict[str, Any]]:
    """Check every case on this world: per case, this rank's report as a dict."""
    return [asdict(check_refit(plan_of(world, case), rank, timeout=120, **options)) for case in cases]


def wrong_destination_dtype(rank: int, world: int) -> str:
    """Rank 5 allocates a bf16 destination where the plan converts to fp8: every rank gets the typed error."""
    import torch

    plan = plan_of(world, CASES[3])
    mine = plan.for_rank(rank)
    manifest = plan.manifest
    sources = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in mine.source_shapes.items()}
    destinations = {
        name: torch.zeros(shape, dtype=getattr(torch, manifest.tensor(name).destination_dtype))
        for name, shape in mine.destination_shapes.items()
    }
    if rank == 5:
        name = "decoder.layers.0.mlp.linear_fc1.weight"
        destinations[name] = torch.zeros(mine.destination_shapes[name], dtype=torch.bfloat16)
    try:
        execute_refit(plan, sources, destinations, timeout=30)
    except ShardcoreError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"


def killed_in_the_amax_exchange(rank: int, world: int, victim: int, timeout: float) -> tuple[str, str, tuple, float]:
    """``victim`` (a source rank) dies at its first post, the partial-amax exchange's; the others name it in time."""
    from shardcore.engine.transfer.exchange import Exchange

    plan = plan_of(world, CASES[3])
    if rank == victim:

        def dying(self: Exchange, messages: Any, wires: Any) -> list:
            os._exit(17)

        Exchange._issue = dying  # type: ignore[method-assign]
    return timed_outcome(plan, rank, timeout=timeout)


def partial_per_tensor_scales(rank: int, world: int) -> dict[str, Any]:
    """A partial refit of per-tensor-scaled fp8 weights (the MLP's first linears), each rank passing exactly
    ``for_rank(rank).source_shapes``: it arrives bitwise. Then rank 0 leaves out a selected weight: every rank
    gets one typed error naming it, before a byte moves."""
    import torch

    request = RefitRequest(
        manifest_of("blocky", None),
        "tp=2,dp=2,role=train + tp=1,dp=2 + tp=2",
        0,
        (1, 2),
        tensors=("*linear_fc1*",),
        to_dtype="float8_e4m3fn",
        scale="tensor",
    )
    plan = request.plan(world)
    out: dict[str, Any] = {"report": asdict(check_refit(plan, rank, timeout=120))}
    mine, manifest = plan.for_rank(rank), plan.manifest
    sources = {name: torch.zeros(shape, dtype=torch.bfloat16) for name, shape in mine.source_shapes.items()}
    if rank == 0:
        del sources["decoder.layers.0.mlp.linear_fc1.weight"]
    destinations = {
        name: torch.zeros(shape, dtype=getattr(torch, manifest.tensor(name).destination_dtype))
        for name, shape in mine.destination_shapes.items()
    }
    try:
        execute_refit(plan, sources, destinations, timeout=30)
        out["missing"] = "no error"
    except ShardcoreError as error:
        out["missing"] = f"{type(error).__name__}: {error}"
    return out
