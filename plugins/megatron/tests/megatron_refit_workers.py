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
from shardcore_megatron.refit import parameters, refit


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
    for parameter in parameters(gpt):
        split = getattr(parameter.tensor, "tensor_model_parallel", False)
        group = (groups.expt_tp if parameter.expert is not None else groups.tp) if split else None
        out.append((parameter.name, parameter.local, parameter.tensor, group))
    return out


def _full(name: str, shape: list[int]) -> torch.Tensor:
    """The source's value of a whole tensor, seeded by its name: norms near 1, the rest small."""
    values = torch.randn(shape, generator=torch.Generator().manual_seed(zlib.crc32(name.encode())))
    return 1 + 0.1 * values if "norm" in name else 0.05 * values


def _cut(full: torch.Tensor, parameter: Any, group: Any) -> torch.Tensor:
    """This tp rank's part: ``tp * stride`` chunks along ``partition_dim``, chunks ``r, r + tp, ...``."""
    if group is None:
        return full
    chunks = full.chunk(group.size() * parameter.partition_stride, dim=parameter.partition_dim)
    return torch.cat(chunks[group.rank() :: group.size()], dim=parameter.partition_dim)


def _gather(local: torch.Tensor, parameter: Any, group: Any) -> torch.Tensor:
    """The whole tensor from every tp rank's part (the inverse of ``_cut``)."""
    if group is None:
        return local
    dim, stride = parameter.partition_dim, parameter.partition_stride
    parts = [torch.empty_like(local) for _ in range(group.size())]
    dist.all_gather(parts, local.contiguous(), group=group)
    pieces = [part.chunk(stride, dim=dim) for part in parts]
    return torch.cat([pieces[rank][block] for block in range(stride) for rank in range(group.size())], dim=dim)


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
