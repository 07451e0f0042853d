"""Rank functions for the real oracle of the engine layouts: megatron-core's own GPTModel against transformers'.

The world is [Megatron tp=2,pp=2 (ep=2 for MoE): 4 ranks | transformers model, tp=1: 1 rank | vLLM tp=2: 2
ranks]. Each Megatron rank builds its stage of a small megatron-core ``GPTModel`` (fp32, local layer spec,
RMSNorm, SwiGLU, GQA, the family's qkv bias or q/k norms or experts) from the HF config and fills it with
seeded values by Megatron's own conventions (``megatron_refit_workers._fill_source``: a full tensor per
global name, cut along ``partition_dim`` / ``partition_stride``), so nothing of shardcore's layouts decides
what a Megatron rank holds. Its logits on ``TOKENS`` are the oracle. The plan refits the Megatron shard into
transformers' model class (the HF rank loads what it received) and into the vLLM tp=2 layout (the test
unpacks and loads those ranks' tensors, ``layout_workers.vllm_to_hf``); both must give Megatron's logits.

Then the reverse: an independently seeded transformers model, on the HF rank, refit into the Megatron
shard's own parameters, whose forward pass must give that model's logits.

megatron-core 0.16.1 assumes CUDA in a few places of a forward pass: its core attention (swapped for the
recipe's ``CpuAttention``, as in every Megatron test here), rope and the MoE token dispatcher (they put their
frequencies and buffers on ``torch.cuda.current_device()``: the forward pass runs inside
``cpu_current_device``, where it answers the CPU), and the MoE router (its ``router_gating_linear`` needs
Transformer Engine: each router is a ``CpuRouter``, the same gating linear in ``F.linear``). The experts'
tokens move with the ``allgather`` dispatcher (``alltoall`` creates a CUDA stream).
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

import torch
import torch.nn.functional as F

from plugins.megatron.tests import megatron_recipe as recipe
from plugins.megatron.tests.megatron_refit_workers import _fill_source
from shardcore import destroy_shards, execute_refit
from shardcore.plan.layout import plan_layout
from shardcore.refit.families import manifest_from_hf_config
from shardcore.refit.planner import plan_refit
from shardcore_megatron.refit import model_tensors

from . import layout_workers as hf

TOKENS = hf.TOKENS
SEQUENCE = len(TOKENS[0])
WORLD = 7
"""[Megatron (4) | transformers (1) | vLLM tp=2 (2)]."""
HF_RANK = 4
VLLM_RANKS = (5, 6)


def _cpu_router() -> type:
    from megatron.core.transformer.moe.router import TopKRouter

    class CpuRouter(TopKRouter):
        """``TopKRouter`` whose gating linear runs where its weight is (see the module doc)."""

        def gating(self, input: torch.Tensor) -> torch.Tensor:
            return F.linear(input, self.weight, self.bias)

    return CpuRouter


def megatron_gpt(config: dict[str, Any], shard: Any, vocab: int) -> Any:
    """This rank's stage of the megatron-core GPTModel of HF ``config`` over ``shard``'s groups, in eval mode."""
    from transformers import AutoConfig

    hf_config = AutoConfig.for_model(config["model_type"], **{k: v for k, v in config.items() if k != "model_type"})
    spec, groups = shard.spec, shard.handle
    stage = groups.pp.rank()
    experts = getattr(hf_config, "num_experts", None)
    qk_norm = config["model_type"] in ("qwen3", "qwen3_moe")
    tied = bool(hf_config.tie_word_embeddings)
    with recipe.quiet():
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.transformer_config import TransformerConfig

        megatron = TransformerConfig(
            num_layers=hf_config.num_hidden_layers,
            hidden_size=hf_config.hidden_size,
            num_attention_heads=hf_config.num_attention_heads,
            num_query_groups=hf_config.num_key_value_heads,
            kv_channels=getattr(hf_config, "head_dim", None) or hf_config.hidden_size // hf_config.num_attention_heads,
            ffn_hidden_size=hf_config.intermediate_size,
            normalization="RMSNorm",
            layernorm_epsilon=hf_config.rms_norm_eps,
            gated_linear_unit=True,
            activation_func=F.silu,
            add_bias_linear=False,
            add_qkv_bias=config["model_type"] == "qwen2",
            qk_layernorm=qk_norm,
            use_cpu_initialization=True,
            tensor_model_parallel_size=spec.tp,
            pipeline_model_parallel_size=spec.pp,
            expert_model_parallel_size=spec.ep,
            expert_tensor_parallel_size=spec.expt_tp,
            num_moe_experts=experts,
            moe_ffn_hidden_size=hf_config.moe_intermediate_size if experts else None,
            moe_router_topk=hf_config.num_experts_per_tok if experts else 2,
            moe_router_load_balancing_type="none",
            moe_token_dispatcher_type="allgather",
            hidden_dropout=0.0,
            attention_dropout=0.0,
            params_dtype=torch.float32,
            pipeline_dtype=torch.float32,
        )
        layer_spec = get_gpt_layer_local_spec(num_experts=experts, qk_layernorm=qk_norm, normalization="RMSNorm")
        layer_spec.submodules.self_attention.submodules.core_attention = recipe.CpuAttention
        gpt = GPTModel(
            megatron,
            layer_spec,
            vocab_size=vocab,
            max_sequence_length=SEQUENCE,
            pre_process=stage == 0,
            post_process=stage == spec.pp - 1,
            share_embeddings_and_output_weights=tied,
            pg_collection=recipe._without_embd(groups) if tied and spec.pp > 1 else groups,
            position_embedding_type="rope",
            rotary_base=hf_config.rope_theta,
        )
    gpt.embd_group = groups.embd
    if experts:
        router = _cpu_router()
        for layer in gpt.decoder.layers:
            layer.mlp.router.__class__ = router
    return gpt.eval()


@contextmanager
def cpu_current_device() -> Iterator[None]:
    """Inside, ``torch.cuda.current_device()`` answers the CPU, on a machine with no CUDA: megatron-core's rope
    moves its frequencies there and its MoE token dispatcher allocates there (``_gather_along_first_dim``,
    directly or from Megatron's global memory buffer, which is made here once)."""
    from megatron.core import parallel_state

    real = torch.cuda.current_device
    torch.cuda.current_device = lambda: torch.device("cpu")  # type: ignore[assignment]
    try:
        if parallel_state._GLOBAL_MEMORY_BUFFER is None:
            parallel_state._set_global_memory_buffer()
        yield
    finally:
        torch.cuda.current_device = real  # type: ignore[assignment]


def megatron_logits(gpt: Any, shard: Any) -> torch.Tensor | None:
    """The whole model's logits on ``TOKENS`` on the last stage (None on the others)."""
    with cpu_current_device():
        return recipe.forward(gpt, shard, torch.tensor(TOKENS))


def _numpy(logits: torch.Tensor | None) -> Any:
    return None if logits is None else logits.numpy()


def run_cases(rank: int, world_size: int, cases: list[tuple[dict[str, Any], str]]) -> list[dict[str, Any]]:
    """Every (HF config, Megatron spec) case: Megatron -> transformers and vLLM tp=2, then transformers ->
    Megatron. Returns per case the Megatron logits (last stage), the HF rank's and the vLLM ranks' tensors."""
    results = []
    for config, megatron_spec in cases:
        model = manifest_from_hf_config(config, vocab_multiple=128)
        vllm_spec = "tp=2,expt_tp=2" if model.config.experts else "tp=2"
        spec = f"{megatron_spec},role=train + dp=1 + {vllm_spec}"
        shards = recipe.megatron_shards(world_size, spec)
        layout = plan_layout(world_size, spec)
        megatron = shards[0]
        gpt = megatron_gpt(config, megatron, model.config.vocab) if megatron.is_member else None
        result: dict[str, Any] = {"case": config["model_type"], "rank": rank}
        sources: dict[str, torch.Tensor] = {}
        if gpt is not None:
            _fill_source(gpt, megatron.handle)
            sources = model_tensors(gpt)
            result["megatron"] = _numpy(megatron_logits(gpt, megatron))
        plan = plan_refit(layout, 0, [1, 2], model.manifest, layouts={1: model.layout("hf"), 2: model.layout("vllm")})
        mine = plan.for_rank(rank)
        destinations = {name: torch.zeros(shape) for name, shape in mine.destination_shapes.items()}
        execute_refit(plan, {n: sources[n] for n in mine.source_shapes}, destinations, timeout=60)
        if rank == HF_RANK:
            fresh = hf.reference_model(config, seed=2)
            missing, unexpected = fresh.load_state_dict(destinations, strict=False)
            result["missing"], result["unexpected"] = sorted(missing), sorted(unexpected)
            result["hf"] = hf.logits(fresh).numpy()
        if rank in VLLM_RANKS:
            result["vllm"] = {name: tensor.numpy() for name, tensor in destinations.items()}  # pickled, not shared
        # the reverse: an independently seeded transformers model into the Megatron shard's own parameters
        back = plan_refit(layout, 1, [0], model.manifest, layouts={1: model.layout("hf")})
        theirs = back.for_rank(rank)
        given = {}
        if rank == HF_RANK:
            original = hf.reference_model(config, seed=3)
            result["original"] = hf.logits(original).numpy()
            state = original.state_dict()
            given = {name: state[name] for name in theirs.source_shapes}
        received = {}
        if gpt is not None:
            with torch.no_grad():
                for parameter in gpt.parameters():
                    parameter.fill_(-1.0)
            received = {n: t for n, t in model_tensors(gpt).items() if n in theirs.destination_shapes}
        execute_refit(back, given, received, timeout=60)
        if gpt is not None:
            result["megatron_back"] = _numpy(megatron_logits(gpt, megatron))
        destroy_shards(shards)
        results.append(result)
    return results
