"""Manifests generated from a transformer config, with Megatron-Core's GPT names and conventions, and presets.

Names are Megatron's local-spec parameter names with global layer numbers and, for grouped-GEMM
experts, the global expert index (``decoder.layers.5.mlp.experts.linear_fc1.weight130``), which is
how Megatron's resharding resolves them. Only shapes are produced; no weights exist here.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass, fields
from typing import Any

from ..errors import ManifestError
from ..plan.arguments import check_count, did_you_mean, shown
from .manifest import MAX_ELEMENTS, Manifest, TensorSpec, check_dtype

MAX_CONFIG_TENSORS = 1_000_000
"""Most tensors a config may generate: DeepSeek-V3 has about 32,000; a million is a typo's size
(layers or experts off by orders of magnitude), and would take seconds to build."""
_TENSORS_PER_LAYER = 12
"""At most this many dense tensors per decoder layer (MLA attention, norms, router, shared experts)."""
_TENSORS_PER_EXPERT = 2


@dataclass(frozen=True)
class TransformerConfig:
    """The sizes of a GPT-style decoder (Megatron's TransformerConfig, the fields refit needs).

    Args:
        layers: Decoder layers.
        hidden: Hidden size.
        ffn: Dense MLP size (``ffn_hidden_size``).
        heads: Attention (query) heads.
        vocab: Vocabulary size, already padded to a size every tp involved divides (Megatron pads
            to a multiple of ``make_vocab_size_divisible_by`` x tp; both sides of a refit must agree).
        kv_heads: Query groups (GQA); None for multi-head attention.
        head_dim: Per-head size; None for hidden // heads.
        experts: Routed experts per MoE layer; 0 for a dense model.
        moe_ffn: Each routed expert's MLP size.
        shared_experts: Shared experts (their MLP is shared_experts x moe_ffn wide, split over tp).
        dense_layers: With experts, the first this many layers keep a dense MLP (DeepSeek's
            ``first_k_dense_replace``).
        tied_embeddings: Share the embedding with the output head (no ``output_layer.weight``).
        gated: SwiGLU MLP: ``linear_fc1`` holds the gate and up blocks.
        qkv_bias: ``linear_qkv`` has a bias (Megatron's ``add_qkv_bias``: Qwen2).
        qk_norm: Per-head RMSNorms of the queries and keys (Megatron's ``qk_layernorm``: Qwen3).
        q_lora_rank / kv_lora_rank / qk_head_dim / qk_pos_emb_head_dim / v_head_dim: Multi-latent
            attention (DeepSeek) when ``kv_lora_rank`` is set; ``q_lora_rank`` None means no q compression.
        first_stage_layers / last_stage_layers: Uneven pipeline split (Megatron's
            ``decoder_first/last_pipeline_num_layers``).
        dtype: Parameter dtype, torch's name.

    Raises:
        ManifestError: a size that is missing, not a whole number in range or inconsistent, or
            sizes that make over MAX_CONFIG_TENSORS tensors.
    """

    layers: int
    hidden: int
    ffn: int
    heads: int
    vocab: int
    kv_heads: int | None = None
    head_dim: int | None = None
    experts: int = 0
    moe_ffn: int | None = None
    shared_experts: int = 0
    dense_layers: int = 0
    tied_embeddings: bool = False
    gated: bool = True
    qkv_bias: bool = False
    qk_norm: bool = False
    q_lora_rank: int | None = None
    kv_lora_rank: int | None = None
    qk_head_dim: int = 128
    qk_pos_emb_head_dim: int = 64
    v_head_dim: int = 128
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    dtype: str = "bfloat16"

    def __post_init__(self) -> None:
        for item in fields(self):
            value = getattr(self, item.name)
            if item.name in ("tied_embeddings", "gated", "qkv_bias", "qk_norm"):
                if not isinstance(value, bool):
                    raise ManifestError(f"config {item.name}={shown(value)}: expected true or false")
            elif item.name == "dtype":
                check_dtype("config dtype", value)
            elif value is not None or item.default is not None:  # None only where it is the default
                minimum = 0 if item.name in ("experts", "shared_experts", "dense_layers") else 1
                check_count(f"config {item.name}", value, minimum=minimum, maximum=MAX_ELEMENTS, error=ManifestError)
        kv_heads = self.kv_heads or self.heads
        if self.kv_lora_rank is None and self.heads % kv_heads:
            raise ManifestError(f"config heads={self.heads} is not a multiple of kv_heads={kv_heads}")
        if self.kv_lora_rank is None and self.head_dim is None and self.hidden < self.heads:
            raise ManifestError(
                f"config hidden={self.hidden} is below heads={self.heads}, so hidden // heads leaves no head "
                "size: set head_dim"
            )
        if self.experts and self.moe_ffn is None:
            raise ManifestError("config experts > 0 needs moe_ffn (each expert's MLP size)")
        if self.dense_layers > self.layers:
            raise ManifestError(f"config dense_layers={self.dense_layers} is more than layers={self.layers}")
        tensors = self.layers * (_TENSORS_PER_LAYER + _TENSORS_PER_EXPERT * self.experts)
        if tensors > MAX_CONFIG_TENSORS:
            raise ManifestError(
                f"config layers={self.layers} with experts={self.experts} makes about {shown(tensors)} tensors, "
                f"over shardcore's limit of {MAX_CONFIG_TENSORS} for one manifest: check layers and experts"
            )

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> TransformerConfig:
        """Build from a mapping of the field names; an unknown key is a ManifestError."""
        names = [item.name for item in fields(cls)]
        if not isinstance(data, Mapping):
            raise ManifestError(f"config={shown(data)}: expected a mapping of {', '.join(names)}")
        unknown = [key for key in data if key not in names]
        if unknown:
            raise ManifestError(f"unknown config key {shown(unknown[0])}: allowed keys are {', '.join(names)}")
        missing = [name for name in ("layers", "hidden", "ffn", "heads", "vocab") if name not in data]
        if missing:
            raise ManifestError(f"config is missing {', '.join(missing)}")
        return cls(**dict(data))


def _mlp(prefix: str, ffn: int, hidden: int, gated: bool, **where: Any) -> list[TensorSpec]:
    """A tp-split MLP: fc1 column-parallel (gate and up as two packed blocks), fc2 row-parallel.

    ``prefix`` ends where Megatron appends ``linear_fc1.weight`` (or, for grouped experts, where
    the expert index is appended after ``weight``).
    """
    expert = where.get("expert")
    suffix = "" if expert is None else str(expert)
    fc1 = TensorSpec(
        f"{prefix}linear_fc1.weight{suffix}",
        (2 * ffn if gated else ffn, hidden),
        tp_dim=0,
        blocks=(ffn, ffn) if gated else (),
        **where,
    )
    fc2 = TensorSpec(f"{prefix}linear_fc2.weight{suffix}", (hidden, ffn), tp_dim=1, **where)
    return [fc1, fc2]


def _attention(config: TransformerConfig, prefix: str, **where: Any) -> list[TensorSpec]:
    """Self-attention: GQA's fused qkv (rows grouped by query group), or DeepSeek's MLA projections."""
    h = config.hidden
    if config.kv_lora_rank is None:
        d = config.head_dim or h // config.heads
        groups = config.kv_heads or config.heads
        per_group = (config.heads // groups + 2) * d  # a group's q heads, then its k, then its v
        qkv = f"{prefix}self_attention.linear_qkv."
        fused = [TensorSpec(f"{qkv}weight", (groups * per_group, h), tp_dim=0, unit=per_group, **where)]
        if config.qkv_bias:
            fused.append(TensorSpec(f"{qkv}bias", (groups * per_group,), tp_dim=0, unit=per_group, **where))
        if config.qk_norm:
            fused += [TensorSpec(f"{prefix}self_attention.{n}_layernorm.weight", (d,), **where) for n in "qk"]
        return [
            TensorSpec(f"{prefix}input_layernorm.weight", (h,), **where),
            *fused,
            TensorSpec(f"{prefix}self_attention.linear_proj.weight", (h, config.heads * d), tp_dim=1, unit=d, **where),
        ]
    qk = config.qk_head_dim + config.qk_pos_emb_head_dim
    attn = f"{prefix}self_attention."
    q: list[TensorSpec]
    if config.q_lora_rank is None:
        q = [TensorSpec(f"{attn}linear_q_proj.weight", (config.heads * qk, h), tp_dim=0, unit=qk, **where)]
    else:
        q = [
            TensorSpec(f"{attn}linear_q_down_proj.weight", (config.q_lora_rank, h), **where),
            TensorSpec(f"{attn}q_layernorm.weight", (config.q_lora_rank,), **where),
            TensorSpec(
                f"{attn}linear_q_up_proj.weight", (config.heads * qk, config.q_lora_rank), tp_dim=0, unit=qk, **where
            ),
        ]
    kv_up = config.qk_head_dim + config.v_head_dim
    return [
        TensorSpec(f"{prefix}input_layernorm.weight", (h,), **where),
        *q,
        TensorSpec(f"{attn}linear_kv_down_proj.weight", (config.kv_lora_rank + config.qk_pos_emb_head_dim, h), **where),
        TensorSpec(f"{attn}kv_layernorm.weight", (config.kv_lora_rank,), **where),
        TensorSpec(
            f"{attn}linear_kv_up_proj.weight",
            (config.heads * kv_up, config.kv_lora_rank),
            tp_dim=0,
            unit=kv_up,
            **where,
        ),
        TensorSpec(
            f"{attn}linear_proj.weight",
            (h, config.heads * config.v_head_dim),
            tp_dim=1,
            unit=config.v_head_dim,
            **where,
        ),
    ]


def manifest_from_config(config: TransformerConfig, name: str = "model") -> Manifest:
    """Every parameter of a GPT model built from ``config``, placed by Megatron-Core's conventions.

    The embedding sits on the first stage and, tied, also on the last (where Megatron keeps its
    copy as ``output_layer.weight``); the final norm and untied output head on the last stage;
    norms and the router are replicated; experts carry their global index.

    Raises:
        ManifestError: ``config`` is not a TransformerConfig, a generated shape is out of range, or
            ``name`` is not a non-empty string.
    """
    if not isinstance(config, TransformerConfig):
        raise ManifestError(
            f"config={shown(config)}: expected a TransformerConfig (TransformerConfig.from_dict reads a mapping)"
        )
    h, tensors, moe_ffn = config.hidden, [], config.moe_ffn or 0
    embedding_stage = ("first", "last") if config.tied_embeddings else ("first",)
    dtype = config.dtype
    tensors.append(TensorSpec("embedding.word_embeddings.weight", (config.vocab, h), dtype, 0, stage=embedding_stage))
    for layer in range(config.layers):
        prefix = f"decoder.layers.{layer}."
        where: dict[str, Any] = {"layer": layer, "dtype": dtype}
        tensors += _attention(config, prefix, **where)
        tensors.append(TensorSpec(f"{prefix}pre_mlp_layernorm.weight", (h,), **where))
        if config.experts and layer >= config.dense_layers:
            tensors.append(TensorSpec(f"{prefix}mlp.router.weight", (config.experts, h), **where))
            for expert in range(config.experts):
                tensors += _mlp(
                    f"{prefix}mlp.experts.",
                    moe_ffn,
                    h,
                    config.gated,
                    expert=expert,
                    **where,
                )
            if config.shared_experts:
                shared = config.shared_experts * moe_ffn
                tensors += _mlp(f"{prefix}mlp.shared_experts.", shared, h, config.gated, **where)
        else:
            tensors += _mlp(f"{prefix}mlp.", config.ffn, h, config.gated, **where)
    tensors.append(TensorSpec("decoder.final_layernorm.weight", (h,), dtype, stage=("last",)))
    if not config.tied_embeddings:
        tensors.append(TensorSpec("output_layer.weight", (config.vocab, h), dtype, 0, stage=("last",)))
    return Manifest(
        tuple(tensors),
        layers=config.layers,
        first_stage_layers=config.first_stage_layers,
        last_stage_layers=config.last_stage_layers,
        experts=config.experts,
        name=name,
    )


PRESET_CONFIGS: dict[str, TransformerConfig] = {
    # Llama-3 vocab 128,256 padded to 129,024 (a multiple of 128 x 8) so every tp up to 8 splits it.
    "llama3-8b": TransformerConfig(layers=32, hidden=4096, ffn=14336, heads=32, kv_heads=8, vocab=129024),
    "llama3-70b": TransformerConfig(layers=80, hidden=8192, ffn=28672, heads=64, kv_heads=8, vocab=129024),
    # DeepSeek-V3: MLA, 256 routed + 1 shared expert, first 3 layers dense; vocab 129,280 padded to
    # 131,072 (a multiple of 128 x 32). The multi-token-prediction layer is not included.
    "deepseek-v3": TransformerConfig(
        layers=61,
        hidden=7168,
        ffn=18432,
        heads=128,
        vocab=131072,
        experts=256,
        moe_ffn=2048,
        shared_experts=1,
        dense_layers=3,
        q_lora_rank=1536,
        kv_lora_rank=512,
        qk_head_dim=128,
        qk_pos_emb_head_dim=64,
        v_head_dim=128,
    ),
    # Tiny models for tests and live checks: every size divides by tp and ep up to 8, 4 layers.
    "tiny-dense": TransformerConfig(
        layers=4, hidden=128, ffn=512, heads=8, kv_heads=8, vocab=1024, tied_embeddings=True, dtype="float32"
    ),
    "tiny-moe": TransformerConfig(
        layers=4,
        hidden=128,
        ffn=512,
        heads=8,
        kv_heads=8,
        vocab=1024,
        experts=8,
        moe_ffn=64,
        shared_experts=1,
        dense_layers=1,
        dtype="float32",
    ),
    # Tiny, for fp8 block scales in tests and live checks: 128-wide heads and every tp-split size a multiple of
    # 512, so each tp slice up to tp = 4 is whole 128x128 blocks (the two above split into 64-wide heads).
    "tiny-fp8": TransformerConfig(layers=2, hidden=512, ffn=512, heads=4, kv_heads=4, vocab=512, dtype="bfloat16"),
}
PRESETS: tuple[str, ...] = tuple(PRESET_CONFIGS)
"""Preset model names, for ``preset`` and ``shardcore refit --model``."""


def preset(name: str) -> Manifest:
    """The manifest of a preset model (shapes only).

    Raises:
        ManifestError: unknown name, listing the presets.
    """
    if not isinstance(name, str) or name not in PRESET_CONFIGS:
        hint = did_you_mean(name, PRESETS) if isinstance(name, str) else ""
        raise ManifestError(f"unknown model preset {shown(name)}: presets are {', '.join(PRESETS)}{hint}")
    return manifest_from_config(PRESET_CONFIGS[name], name=name)


__all__ = ["PRESETS", "PRESET_CONFIGS", "TransformerConfig", "manifest_from_config", "preset"]
