"""Rank functions for the delta-refit tests: many refits of one plan per world, the sources stepped by a simulated
optimizer between them, every destination compared bitwise with a dense refit's result after every refit."""

from __future__ import annotations

from typing import Any

import torch

from shardcore import ExecuteOptions, ShardcoreError, execute_refit
from shardcore.engine.live.refit_check import KnownWeights, cut, mismatches
from shardcore.engine.transfer import delta as delta_module
from shardcore.engine.transfer.session import DEFAULT_SESSION
from shardcore.refit import RefitRequest, TransformerConfig, manifest_from_config, tensors_matching

SMALL = TransformerConfig(layers=1, hidden=128, ffn=256, heads=2, kv_heads=2, vocab=512, dtype="bfloat16")
"""A small bf16 model (about 0.4 MB): a hundred refits of it take seconds."""
BLOCKY = TransformerConfig(layers=1, hidden=256, ffn=512, heads=2, kv_heads=2, vocab=512, dtype="bfloat16")
"""Every tp part a run of whole 128x128 blocks at tp <= 2, for fp8 per-block scales."""
SPEC = "tp=2,role=train + tp=1 + tp=1"
"""Four ranks: a tp=2 source, two destinations of one rank each."""


def _request(run: dict[str, Any], destinations: tuple[int, ...]) -> RefitRequest:
    config = BLOCKY if run.get("conversion") else SMALL
    if run.get("wider"):
        config = TransformerConfig(**{**config.__dict__, "ffn": 2 * config.ffn})
    model = manifest_from_config(config, name="delta-test")
    to_dtype, scale = run.get("conversion") or (None, None)
    return RefitRequest(model, SPEC, 0, destinations, to_dtype=to_dtype, scale=scale, **run.get("planner", {}))


def _changed(before: dict[str, torch.Tensor], after: dict[str, torch.Tensor]) -> tuple[int, int]:
    """Elements that differ bitwise between two sets of tensors, and elements in all."""
    same = [n for n in before if n in after and before[n].shape == after[n].shape]
    changed = sum(int(torch.ne(before[n].view(torch.int16), after[n].view(torch.int16)).sum()) for n in same)
    return changed, sum(before[n].numel() for n in same)


def steps(rank: int, world: int, run: dict[str, Any]) -> list[dict[str, Any]]:
    """One delta refit per entry of ``run["fractions"]`` (the first from the initial weights, each later one
    after an optimizer step changing about that fraction of the elements), at versions 1, 2, ...; per refit,
    what this rank saw. ``run["events"]`` maps a refit's index to what happens to it:

    - ``miss``: the second destination (rank 3) is left out of this refit (a plan to the first one only);
    - ``fail``: rank 2 fails as its first message lands (the refit fails everywhere);
    - ``fresh destination``: rank 3's destinations are new tensors (a restarted engine);
    - ``fresh sender``: rank 0 forgets its snapshots (a restarted trainer);
    - ``subset``: a partial refit of the attention weights only (the other tensors skip this version);
    - ``behind its back``: before this refit, rank 2 changes a destination's bytes where no counter sees it
      (through ``.data``), so the delta lands on a base it does not hold;
    - ``reshaped``: a plan of another model, whose MLP tensors have another shape (new destinations for them);
    - ``dense``: one dense refit (no delta) at this version, to compare the delta results with.
    """
    full = _request(run, (1, 2)).plan(world)
    only_first = _request(run, (1,)).plan(world)
    manifest = full.manifest
    weights = KnownWeights(manifest)
    mine = full.for_rank(rank)
    sources = {n: cut(weights.full(n), manifest.tensor(n), full.source, rank, manifest) for n in mine.source_shapes}
    destinations = _fresh(full, rank)
    out: list[dict[str, Any]] = []
    for index, fraction in enumerate(run["fractions"]):
        event = run.get("events", {}).get(index, "")
        before = {name: local.clone() for name, local in sources.items()}
        if index:
            weights.step(fraction)
            for name, local in sources.items():
                local.copy_(cut(weights.full(name), manifest.tensor(name), full.source, rank, manifest))
        if event == "fresh destination" and rank == 3:
            destinations = _fresh(full, rank)
        if event == "fresh sender" and rank == 0:
            DEFAULT_SESSION.forget_snapshots()
        if event == "behind its back" and rank == 2:
            name = "decoder.layers.0.mlp.linear_fc1.weight"
            destinations[name].data[0, 0] = 7.0
        if event == "reshaped":
            full = _request({**run, "wider": True}, (1, 2)).plan(world)
            manifest, weights = full.manifest, _restepped(full.manifest, weights)
            sources = {
                n: cut(weights.full(n), manifest.tensor(n), full.source, rank, manifest)
                for n in full.for_rank(rank).source_shapes
            }
            destinations = {**_fresh(full, rank), **{n: t for n, t in destinations.items() if ".mlp." not in n}}
        plan = {"miss": only_first, "subset": full.subset(tensors_matching(manifest, "*.self_attention.*"))}.get(
            event, full
        )
        options = ExecuteOptions(timeout=60, version=index + 1, delta=event != "dense", **run.get("options", {}))
        seen: dict[str, Any] = {"event": event, "changed": _changed(before, sources) if index else (0, 0)}
        real = delta_module.DeltaSession.unpack
        if event == "fail" and rank == 2:
            delta_module.DeltaSession.unpack = _failing  # type: ignore[method-assign]
        try:
            stats = execute_refit(plan, sources, destinations, options=options)
            seen.update(
                outcome="ok",
                wire=stats.wire_bytes_received,
                dense=stats.bytes_received,
                sent_wire=stats.wire_bytes_sent,
                sent=stats.bytes_sent,
                snapshots=stats.snapshot_bytes,
            )
        except ShardcoreError as error:
            seen["outcome"] = f"{type(error).__name__}: {error}"
        finally:
            delta_module.DeltaSession.unpack = real  # type: ignore[method-assign]
        written = plan.for_rank(rank).destination_shapes
        seen["mismatches"] = mismatches(plan, rank, {n: destinations[n] for n in written}, weights, None)
        out.append(seen)
    return out


def _restepped(manifest: Any, weights: KnownWeights) -> KnownWeights:
    """The same optimizer steps on another model's tensors."""
    again = KnownWeights(manifest)
    again.steps = list(weights.steps)
    return again


def _fresh(plan: Any, rank: int) -> dict[str, torch.Tensor]:
    return {
        name: torch.full(shape, -1.0, dtype=getattr(torch, plan.destination_tensor(name).destination_dtype))
        for name, shape in plan.for_rank(rank).destination_shapes.items()
    }


def _failing(*args: Any) -> None:
    raise RuntimeError("injected: applying a delta failed")


def without_version(rank: int, world: int) -> str:
    """A delta refit without a version: every rank's outcome."""
    plan = _request({}, (1, 2)).plan(world)
    sources = {n: torch.zeros(shape, dtype=torch.bfloat16) for n, shape in plan.for_rank(rank).source_shapes.items()}
    try:
        execute_refit(plan, sources, _fresh(plan, rank), options=ExecuteOptions(timeout=30, delta=True))
    except ShardcoreError as error:
        return f"{type(error).__name__}: {error}"
    return "no error"
