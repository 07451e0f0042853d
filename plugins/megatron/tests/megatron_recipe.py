"""The one Megatron test recipe: megatron-core imported quietly, worlds, and a tiny GPT over shardcore's groups.

Importing this module skips the importing test module unless torch, einops and megatron-core are
installed, so every test module that needs megatron-core imports it first. Workers import and build
megatron-core's objects inside ``quiet()`` and build models with ``tiny_gpt``.

The tiny GPT is megatron-core's own ``GPTModel`` (local layer spec: SwiGLU, GQA, learned positions,
optional MoE; 0.16.1 and 0.19.2 alike, nothing patched) with one module swapped: its core attention.
Megatron's ``DotProductAttention`` cannot run a forward pass here: it takes its scratch buffer from
``get_global_memory_buffer()`` on ``torch.cuda.current_device()`` and refuses cp > 1 (Transformer
Engine's job), and Megatron's rope picks the cp rank's positions with ``.cuda()``. ``CpuAttention``
is the same causal softmax attention in plain torch, with context parallelism done by all-gathering
K and V over the cp group; learned positions are fed per token, so no rope is needed.
"""

from __future__ import annotations

import copy
import math
import os
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any

import pytest

pytest.importorskip("torch")
from shardcore_megatron.backend import INSTALL_HINT, missing_requirement

if missing_requirement():
    pytest.skip(f"{missing_requirement()} is not installed: {INSTALL_HINT}", allow_module_level=True)

import torch
import torch.distributed as dist

VOCAB = 256
SEQUENCE = 16
"""Tokens per sequence in the forward pass: a multiple of 2*cp for cp's load-balanced chunks."""


@contextmanager
def quiet() -> Iterator[None]:
    """Without megatron-core's warnings: Transformer Engine, Apex and absl-py absent, CUDA-only advice."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        yield


def fake_world(rank: int, world: int) -> None:
    """Join torch's fake backend as ``rank`` of ``world`` (a world of any size in one process)."""
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        dist.destroy_process_group()
    os.environ["WORLD_SIZE"] = str(world)  # HyperCommGrid reads it
    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


def megatron_shards(world: int, spec: Any, **options: Any) -> list[Any]:
    """shardcore's shards with a ProcessGroupCollection per member rank (``build_shards``, backend megatron)."""
    from shardcore import build_shards

    return build_shards(world, spec, backend="megatron", **options)


@dataclass(frozen=True)
class Tiny:
    """The architecture both sides of a refit share (Megatron's TransformerConfig fields that differ)."""

    layers: int = 4
    experts: int | None = None
    tied: bool = False
    """``share_embeddings_and_output_weights``: with pp > 1 the last stage keeps a copy of the embedding."""
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    expert_bias: bool = False
    """``moe_router_enable_expert_bias``: each router holds a persistent float32 ``expert_bias`` buffer."""
    bf16: bool = False
    """Wrapped in megatron-core's ``Float16Module`` (bf16 weights, and bf16 buffers until the trainer's router
    turns ``expert_bias`` back to float32: ``keep_float32_expert_bias``)."""
    packed: bool = False
    """Each layer also holds megatron-core's ``ColumnParallelLinear`` packed as Mamba's ``in_proj`` (``PACKED``)."""


PACKED = (128, 128, 32, 32, 8)
"""Mamba's in_proj blocks [z, x, B, C, dt] for d_inner 128, ngroups 2, d_state 16, 8 heads (global rows)."""


def _config(spec: Any, model: Tiny) -> Any:
    """Megatron's TransformerConfig (call inside ``quiet()``)."""
    from megatron.core.transformer.transformer_config import TransformerConfig

    uneven = spec.pp > 1  # Megatron rejects an uneven split with no stages to put it on (pp = 1)
    return TransformerConfig(
        num_layers=model.layers,
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
        num_layers_in_first_pipeline_stage=model.first_stage_layers if uneven else None,
        num_layers_in_last_pipeline_stage=model.last_stage_layers if uneven else None,
        num_moe_experts=model.experts,
        moe_ffn_hidden_size=32 if model.experts else None,
        moe_router_topk=2,
        moe_router_enable_expert_bias=model.expert_bias,
        moe_router_score_function="sigmoid" if model.expert_bias else "softmax",
        bf16=model.bf16,
        gated_linear_unit=True,
        add_bias_linear=False,
        hidden_dropout=0.0,
        attention_dropout=0.0,
        params_dtype=torch.bfloat16 if model.bf16 else torch.float32,
        pipeline_dtype=torch.bfloat16 if model.bf16 else torch.float32,
    )


@contextmanager
def cpu_current_device(needed: bool) -> Iterator[None]:
    """``torch.cuda.current_device()`` answering "cpu" while a model is built, where ``needed``.

    megatron-core's router (0.16.1, 0.19.2) allocates ``expert_bias`` on ``torch.cuda.current_device()``;
    this stub, in the building rank only and only for the constructor, is the one thing these models
    need beyond the swapped core attention. Nothing in megatron-core is patched.
    """
    if not needed:
        yield
        return
    original = torch.cuda.current_device
    torch.cuda.current_device = lambda: "cpu"
    try:
        yield
    finally:
        torch.cuda.current_device = original


def _add_packed(gpt: Any, config: Any, groups: Any) -> None:
    """A megatron-core ``ColumnParallelLinear`` per layer, packed like Mamba's ``in_proj`` and marked with
    ``partition_sizes`` the way megatron-core 0.19's ``MambaMixer`` marks it (its blocks split over tp
    one by one). MambaMixer itself needs mamba-ssm's CUDA kernels to be built at all."""
    from megatron.core.tensor_parallel import ColumnParallelLinear

    tp = groups.tp.size()
    for layer in gpt.decoder.layers:
        layer.in_proj = ColumnParallelLinear(
            config.hidden_size,
            sum(PACKED),
            config=config,
            init_method=config.init_method,
            bias=False,
            tp_group=groups.tp,
        )
        layer.in_proj.weight.partition_sizes = [size // tp for size in PACKED]


def keep_float32_expert_bias(gpt: Any) -> None:
    """What a trainer's router does on its first step (megatron-core's ``_maintain_float32_expert_bias``):
    a bf16-wrapped model's ``expert_bias`` back in float32."""
    for module in gpt.modules():
        if hasattr(module, "_maintain_float32_expert_bias"):
            module._maintain_float32_expert_bias()


def tiny_gpt(shard: Any, model: Tiny) -> Any:
    """This rank's stage of a tiny GPT over its shard's ProcessGroupCollection, in eval mode.

    A tied model with pp > 1 is built with ``embd=None``: megatron-core (0.16.1, 0.19.2) moves the last stage's
    copy of the embedding to CUDA (``weight.data.cuda()``) for its first all-reduce over ``embd``.
    The copy then starts at zero, which refit must overwrite; the real group is set afterwards.
    """
    spec, groups = shard.spec, shard.handle
    stage, tied_across_stages = groups.pp.rank(), model.tied and spec.pp > 1
    with quiet(), cpu_current_device(model.expert_bias):
        from megatron.core.models.gpt import GPTModel
        from megatron.core.models.gpt.gpt_layer_specs import get_gpt_layer_local_spec
        from megatron.core.transformer.module import Float16Module

        layer_spec = get_gpt_layer_local_spec(num_experts=model.experts)
        layer_spec.submodules.self_attention.submodules.core_attention = CpuAttention
        config = _config(spec, model)
        gpt = GPTModel(
            config,
            layer_spec,
            vocab_size=VOCAB,
            max_sequence_length=SEQUENCE,
            pre_process=stage == 0,
            post_process=stage == spec.pp - 1,
            share_embeddings_and_output_weights=model.tied,
            pg_collection=_without_embd(groups) if tied_across_stages else groups,
            position_embedding_type="learned_absolute",
        )
        if model.packed:
            _add_packed(gpt, config, groups)
    gpt.embd_group = groups.embd
    return (Float16Module(config, gpt) if model.bf16 else gpt).eval()


def _without_embd(groups: Any) -> Any:
    """A shallow copy of a ProcessGroupCollection whose ``embd`` is None (its fields take no ``replace``)."""
    copied = copy.copy(groups)
    copied.embd = None
    return copied


def cp_positions(length: int, cp_size: int, cp_rank: int) -> torch.Tensor:
    """The global positions a cp rank holds: chunks ``r`` and ``2cp-1-r`` of ``2cp`` (Megatron's load balance)."""
    chunk = length // (2 * cp_size)
    first, second = cp_rank * chunk, (2 * cp_size - 1 - cp_rank) * chunk
    return torch.cat([torch.arange(first, first + chunk), torch.arange(second, second + chunk)])


def _all_gather(tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    parts = [torch.empty_like(tensor) for _ in range(group.size())]
    dist.all_gather(parts, tensor.contiguous(), group=group)
    return torch.cat(parts, dim=dim)


def cp_gather(tensor: torch.Tensor, group: Any, dim: int) -> torch.Tensor:
    """The whole sequence from every cp rank's chunks along ``dim``, in global order."""
    if group.size() == 1:
        return tensor
    gathered = _all_gather(tensor, group, dim)
    order = torch.cat([cp_positions(gathered.size(dim), group.size(), r) for r in range(group.size())])
    return gathered.index_select(dim, torch.argsort(order))


class CpuAttention(torch.nn.Module):
    """Megatron's causal core attention on CPU; with cp > 1 each rank attends to all-gathered K and V.

    Takes what Megatron's attention builder passes (``config``, ``pg_collection``, ...), and
    ``[sequence, batch, heads, head_dim]`` queries, keys and values; returns ``[sequence, batch, hidden]``.
    """

    def __init__(self, config: Any, pg_collection: Any, softmax_scale: float | None = None, **_: Any) -> None:
        super().__init__()
        self.cp = pg_collection.cp
        self.scale = softmax_scale or 1.0 / math.sqrt(config.kv_channels)

    def forward(self, query: torch.Tensor, key: torch.Tensor, value: torch.Tensor, *_: Any, **__: Any) -> torch.Tensor:
        cp_size = self.cp.size()
        mine = cp_positions(query.size(0) * cp_size, cp_size, self.cp.rank())
        key, value = cp_gather(key, self.cp, 0), cp_gather(value, self.cp, 0)
        repeat = query.size(2) // key.size(2)  # GQA: each key/value head serves `repeat` query heads
        key, value = key.repeat_interleave(repeat, dim=2), value.repeat_interleave(repeat, dim=2)
        scores = torch.einsum("sbhd,tbhd->bhst", query, key) * self.scale
        future = mine[:, None] < torch.arange(key.size(0))[None, :]
        probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
        context = torch.einsum("bhst,tbhd->sbhd", probs, value)
        return context.reshape(context.size(0), context.size(1), -1)


def tokens(batch: int = 2, seed: int = 11) -> torch.Tensor:
    """The token ids every rank feeds both models: ``[batch, SEQUENCE]``."""
    return torch.randint(0, VOCAB, (batch, SEQUENCE), generator=torch.Generator().manual_seed(seed))


@torch.no_grad()
def forward(gpt: Any, shard: Any, ids: torch.Tensor) -> torch.Tensor | None:
    """The whole model's logits ``[batch, SEQUENCE, VOCAB]`` on its last stage (None on the others).

    Each stage receives the previous stage's hidden states and sends its own on (``dist.send`` /
    ``dist.recv`` along the pp group); each cp rank feeds its load-balanced chunks of the sequence.
    The last stage gathers the vocabulary over tp (Megatron's own gather allocates on CUDA) and the
    chunks over cp, back in order.
    """
    groups = shard.handle
    cp, pp = groups.cp, groups.pp
    positions = cp_positions(ids.size(1), cp.size(), cp.rank())
    stage, chain = pp.rank(), dist.get_process_group_ranks(pp)
    if stage > 0:
        hidden = torch.empty(len(positions), ids.size(0), gpt.config.hidden_size)
        dist.recv(hidden, chain[stage - 1])
        gpt.set_input_tensor(hidden)
    out = gpt(ids[:, positions], positions.expand(ids.size(0), -1), None)
    if stage < len(chain) - 1:
        dist.send(out.contiguous(), chain[stage + 1])
        return None
    return cp_gather(_all_gather(out, groups.tp, dim=-1), cp, dim=1)
