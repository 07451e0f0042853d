"""Rank functions for the Megatron refit tests: tiny GPT models built by megatron-core 0.16.1 on CPU."""

from __future__ import annotations

import warnings
from typing import Any

import torch

from shardcore import build_shards, destroy_shards
from shardcore.engine.live.refit_check import cut, known_tensor


def gpt(shard: Any, experts: int | None) -> Any:
    """A tiny GPT (4 layers, SwiGLU, GQA) over the shard's ProcessGroupCollection, stage chosen by its pp rank."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

    spec, groups = shard.spec, shard.handle
    config = TransformerConfig(
        num_layers=4,
        hidden_size=64,
        num_attention_heads=8,
        num_query_groups=4,
        ffn_hidden_size=128,
        use_cpu_initialization=True,
        tensor_model_parallel_size=spec.tp,
        pipeline_model_parallel_size=spec.pp,
        context_parallel_size=spec.cp,
        expert_model_parallel_size=spec.ep,
        expert_tensor_parallel_size=spec.expt_tp,
        num_moe_experts=experts,
        moe_ffn_hidden_size=32 if experts else None,
        gated_linear_unit=True,
        add_bias_linear=False,
        params_dtype=torch.float32,
        pipeline_dtype=torch.float32,
    )
    stage = groups.pp.rank()
    return GPTModel(
        config,
        get_gpt_layer_local_spec(num_experts=experts),
        vocab_size=256,
        max_sequence_length=32,
        pre_process=stage == 0,
        post_process=stage == spec.pp - 1,
        pg_collection=groups,
        position_embedding_type="rope",
    )


def _fill(model: Any, plan: Any, manifest: Any, rank: int, known: bool) -> None:
    from shardcore_megatron.refit import parameters

    with torch.no_grad():
        for name, parameter, _ in parameters(model):
            spec = manifest.tensor(name)
            value = cut(known_tensor(spec, manifest.index(name)), spec, plan, rank, manifest) if known else None
            parameter.copy_(value) if known else parameter.fill_(-1.0)


def _matches(model: Any, plan: Any, manifest: Any, rank: int) -> dict[str, bool]:
    from shardcore_megatron.refit import parameters

    out = {}
    for name, parameter, _ in parameters(model):
        spec = manifest.tensor(name)
        out[name] = bool(
            torch.equal(parameter.data, cut(known_tensor(spec, manifest.index(name)), spec, plan, rank, manifest))
        )
    return out


CASES = [
    # (label, source spec, destination spec or None (second shard of the same layout), experts)
    ("collocated tp=2,pp=2 -> tp=4", "tp=2,pp=2", "tp=4", None),
    ("disaggregated MoE dp=2,ep=2,expt_tp=1 -> tp=2 (expt_tp=2)", "dp=2,ep=2,expt_tp=1 + tp=2", None, 4),
]


def refit_models(rank: int, world: int) -> list[dict[str, Any]]:
    """Each case: fill the source model with known tensors, refit, compare every destination parameter."""
    from shardcore_megatron.refit import read_manifest, refit

    results = []
    for label, src_spec, dst_spec, experts in CASES:
        src_shards = build_shards(world, src_spec, backend="megatron")
        dst_shards = build_shards(world, dst_spec, backend="megatron") if dst_spec else src_shards
        source, target = src_shards[0], dst_shards[0] if dst_spec else dst_shards[1]
        src_model = gpt(source, experts) if source.is_member else None
        dst_model = gpt(target, experts) if target.is_member else None
        manifest = read_manifest(src_model, dst_model, source.plan, target.plan)
        if src_model is not None:
            _fill(src_model, source.plan, manifest, rank, known=True)
        if dst_model is not None:
            _fill(dst_model, target.plan, manifest, rank, known=False)
        stats = refit(src_model, dst_model, src_shards, src=source, dst=target, timeout=120, bucket_bytes=1 << 16)
        matches = _matches(dst_model, target.plan, manifest, rank) if dst_model is not None else {}
        results.append(
            {
                "label": label,
                "matches": matches,
                "tensors": len(manifest),
                "received": stats.bytes_received,
                "copied": stats.bytes_copied,
                "names": sorted(matches),
            }
        )
        destroy_shards(src_shards)
        if dst_spec:
            destroy_shards(dst_shards)
    return results
