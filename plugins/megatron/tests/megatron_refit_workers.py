"""Rank functions for the Megatron refit tests: tiny megatron-core GPTs (0.16.1, 0.19.2) on CPU, refit, compared.

The source is filled by Megatron's own conventions (a seeded full tensor per global name, cut along
``partition_dim`` with ``partition_stride`` the way ``_initialize_affine_weight_cpu`` cuts it), the
destination with -1; after the refit both are gathered back to full tensors over their own groups
and hashed, and both models run a forward pass on the same tokens. Nothing here asks shardcore's
placement where a byte should be.
"""

from __future__ import annotations

import hashlib
import zlib
from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from plugins.megatron.tests import megatron_recipe as recipe
from shardcore import RefitInputError, destroy_shards
from shardcore.engine import all_gather_objects
from shardcore_megatron.refit import refit, refit_tensors


@dataclass(frozen=True)
class Case:
    """One refit over a 4-rank world: ``source``'s shard 0 into ``target``'s shard 0 (collocated, two
    layouts over the same ranks), or into ``source``'s shard 1 when ``target`` is None."""

    label: str
    source: str
    target: str | None = None
    model: recipe.Tiny = field(default_factory=recipe.Tiny)
    target_model: recipe.Tiny | None = None
    """The destination's architecture where it differs from ``model``: the refit must refuse it."""

    @property
    def runs_forward(self) -> bool:
        """megatron-core's MoE router (0.16.1, 0.19.2) moves its weight to CUDA in every forward: dense models only."""
        return self.model.experts is None


def _named(gpt: Any, groups: Any) -> list[tuple[str, str, Any, Any]]:
    """(global name, local name, parameter, the group it is split over or None) of this rank's parameters."""
    out = []
    for parameter in refit_tensors(gpt):
        split = getattr(parameter.tensor, "tensor_model_parallel", False)
        group = (groups.expt_tp if parameter.expert is not None else groups.tp) if split else None
        out.append((parameter.name, parameter.local, parameter.tensor, group))
    return out


def _full(name: str, shape: list[int]) -> torch.Tensor:
    """The source's value of a whole tensor, seeded by its name: norms near 1, the rest small."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return 1 + 0.1 * values if "norm" in name else 0.05 * values


def _local_blocks(parameter: Any) -> list[int]:
    """A tp rank's packed blocks along ``partition_dim``, by megatron-core's marks: ``partition_sizes``
    where set (Mamba), else ``partition_stride`` equal blocks."""
    sizes = getattr(parameter, "partition_sizes", None)
    if sizes is not None:
        return list(sizes)
    stride = getattr(parameter, "partition_stride", 1)
    return [parameter.shape[parameter.partition_dim] // stride] * stride


def _cut(full: torch.Tensor, parameter: Any, group: Any) -> torch.Tensor:
    """This tp rank's part: each packed block cut in tp equal chunks, this rank's chunk of each, in order."""
    if group is None:
        return full
    dim, tp = parameter.partition_dim, group.size()
    blocks = full.split([size * tp for size in _local_blocks(parameter)], dim=dim)
    return torch.cat([block.chunk(tp, dim=dim)[group.rank()] for block in blocks], dim=dim)


def _gather(local: torch.Tensor, parameter: Any, group: Any) -> torch.Tensor:
    """The whole tensor from every tp rank's part (the inverse of ``_cut``)."""
    if group is None:
        return local
    dim, sizes = parameter.partition_dim, _local_blocks(parameter)
    parts = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(parts, local.contiguous(), group=group)
    pieces = [part.split(sizes, dim=dim) for part in parts]
    return torch.cat([pieces[rank][block] for block in range(len(sizes)) for rank in range(group.size())], dim=dim)


def _fill_source(gpt: Any, groups: Any) -> None:
    """Every parameter from its seeded full tensor: replicas and the tied copy agree by construction."""
    with torch.no_grad():
        for name, _, parameter, group in _named(gpt, groups):
            shape = list(parameter.shape)
            if group is not None:
                shape[parameter.partition_dim] *= group.size()
            parameter.copy_(_cut(_full(name, shape), parameter, group))


def _digests(gpt: Any, groups: Any) -> list[tuple[str, str, tuple[int, ...], str]]:
    """(global name, local name, full shape, sha256 of the full tensor's bytes) of every parameter."""
    out = []
    for name, local, parameter, group in _named(gpt, groups):
        full = _gather(parameter.data, parameter, group)
        data = bytes(full.contiguous().reshape(-1).view(torch.uint8).tolist())
        out.append((name, local, tuple(full.shape), hashlib.sha256(data).hexdigest()))
    return out


def _compare_logits(src: torch.Tensor | None, dst: torch.Tensor | None) -> dict[str, Any]:
    """Every last-stage rank's logits of both models, exchanged: the largest difference between them."""
    gathered = all_gather_objects({"src": src, "dst": dst})
    sources = [g["src"] for g in gathered if g["src"] is not None]
    targets = [g["dst"] for g in gathered if g["dst"] is not None]
    return {
        "copies": (len(sources), len(targets)),
        "replicas_agree": all(torch.equal(t, side[0]) for side in (sources, targets) for t in side),
        "max_diff": max(float((s - t).abs().max()) for s in sources for t in targets),
        "max_logit": float(sources[0].abs().max()),
    }


def _refit_and_compare(case: Case, source: Any, target: Any, src_shards: list[Any]) -> dict[str, Any]:
    """Fill, refit, then the gathered weights' digests and the two forward passes."""
    src = recipe.tiny_gpt(source, case.model) if source.is_member else None
    dst = recipe.tiny_gpt(target, case.target_model or case.model) if target.is_member else None
    if src is not None:
        if case.model.expert_bias:
            recipe.keep_float32_expert_bias(src)
        _fill_source(src, source.handle)
    if dst is not None:
        with torch.no_grad():
            for parameter in dst.parameters():
                parameter.fill_(-1.0)
    try:
        stats = refit(src, dst, src_shards, src=source, dst=target, timeout=120, bucket_bytes=1 << 16)
    except RefitInputError as error:
        return {"error": str(error)}
    ids = recipe.tokens()
    logits = None
    if case.runs_forward:
        logits = _compare_logits(
            recipe.forward(src, source, ids) if src is not None else None,
            recipe.forward(dst, target, ids) if dst is not None else None,
        )
    return {
        "error": None,
        "src": _digests(src, source.handle) if src is not None else [],
        "dst": _digests(dst, target.handle) if dst is not None else [],
        "copied": stats.bytes_copied,
        "received": stats.bytes_received,
        "logits": logits,
        "buffers": _buffer_dtypes(src, dst),
    }


def _buffer_dtypes(src: Any, dst: Any) -> dict[str, list[tuple[str, str]]]:
    """(global name, dtype) of each side's persistent buffers on this rank."""
    return {
        side: [(t.name, str(t.tensor.dtype)) for t in refit_tensors(model) if t.buffer] if model is not None else []
        for side, model in (("src", src), ("dst", dst))
    }


def refit_cases(rank: int, world: int, cases: list[Case]) -> list[dict[str, Any]]:
    """Each case in turn on one world (megatron-core is imported once per rank)."""
    results = []
    for case in cases:
        src_shards = recipe.megatron_shards(world, case.source)
        dst_shards = recipe.megatron_shards(world, case.target) if case.target else src_shards
        target = dst_shards[0] if case.target else dst_shards[1]
        results.append(_refit_and_compare(case, src_shards[0], target, src_shards))
        destroy_shards(src_shards)
        if case.target:
            destroy_shards(dst_shards)
    return results


def kept_plan_steps(rank: int, world: int) -> list[dict[str, Any]]:
    """An RL loop's refits: tp=2,pp=2 into tp=4 (plans), again after a training step changed every source
    weight (kept), into tp=2,dp=2 over the same ranks (another target: plans), into tp=4 again (kept).

    Each step: how many plans ``kept_plans`` built and reused in it, and both sides' digests after it.
    """
    from shardcore_megatron.refit import kept_plans

    source, four, two = (recipe.megatron_shards(world, spec) for spec in ("tp=2,pp=2", "tp=4", "tp=2,dp=2"))
    src = recipe.tiny_gpt(source[0], recipe.Tiny())
    targets = {
        "tp=4": (four[0], recipe.tiny_gpt(four[0], recipe.Tiny())),
        "tp=2,dp=2": (two[0], recipe.tiny_gpt(two[0], recipe.Tiny())),
    }
    _fill_source(src, source[0].handle)
    kept_plans.clear()
    steps = []
    for label in ("tp=4", "tp=4", "tp=2,dp=2", "tp=4"):
        shard, dst = targets[label]
        builds, hits = kept_plans.builds, kept_plans.hits
        refit(src, dst, source, src=source[0], dst=shard, timeout=120)
        steps.append(
            {
                "target": label,
                "built": kept_plans.builds - builds,
                "kept": kept_plans.hits - hits,
                "src": _digests(src, source[0].handle),
                "dst": _digests(dst, shard.handle),
            }
        )
        with torch.no_grad():  # the next training step: every source weight changes
            for parameter in src.parameters():
                parameter.mul_(2.0)
    for shards in (source, four, two):
        destroy_shards(shards)
    return steps


def refit_world(rank: int, world: int, cases: list[Case]) -> tuple[list[dict[str, Any]], list[dict[str, Any]]]:
    """The refit cases, then the kept-plan steps, on one world (megatron-core is imported once per rank)."""
    return refit_cases(rank, world, cases), kept_plan_steps(rank, world)
