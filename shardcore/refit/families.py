"""Hugging Face model families as Megatron-Core and the inference engines hold them.

From a Hugging Face ``config.json`` (``manifest_from_hf_config``) this module makes both sides' tensors: the
Megatron-Core GPT manifest a training job holds (``models.manifest_from_config``) and the tensors of the
Hugging Face model class, and the weight maps between them and into vLLM/SGLang's tensor-parallel packing.
A side of a refit is then a *layout* (``ModelLayout``, ``HFModel.layout``):

- ``megatron``: Megatron-Core's GPT layout, by ``ShardPlacement``'s index math.
- ``hf``: the transformers model class on every rank of the shard (tp = pp = 1), as ``model.state_dict()``
  names, shapes and dtypes its weights in transformers 4 and as checkpoints (safetensors keys) name them:
  one ``experts.{e}.gate_proj`` per expert. A tied output head is the embedding (no ``lm_head.weight``).
- ``hf-stacked``: the same, with each MoE layer's experts stacked as transformers 5 holds them in memory:
  ``mlp.experts.gate_up_proj [experts, 2*moe_ffn, hidden]`` (gate, then up) and ``mlp.experts.down_proj``.
- ``vllm``: what each rank of a vLLM (or SGLang) engine with the shard's tp, pp and ep holds, packed as its
  weight loaders pack a checkpoint: ``QKVParallelLinear.weight_loader`` (``qkv_proj`` = [its q heads; its
  kv heads], kv heads replicated when tp exceeds their count), ``MergedColumnParallelLinear.weight_loader``
  (``gate_up_proj`` = [its gate rows; its up rows]), ``RowParallelLinear`` (``o_proj`` / ``down_proj`` split on
  dim 1), ``VocabParallelEmbedding`` / ``ParallelLMHead`` (the vocabulary padded to a multiple of 64, then
  split over tp; a refit writes the padding rows as zeros, as vLLM's loader does) and ``FusedMoE.weight_loader``
  (``mlp.experts.routed_experts.w13_weight [local experts, 2*moe_ffn/tp, hidden]`` = per expert [gate; up],
  ``w2_weight [local experts, hidden, moe_ffn/tp]``, the experts spread over ep, split over expt_tp; vLLM 0.32
  holds them on ``FusedMoE``'s ``routed_experts`` module, ``FUSED_MOE``).

An engine's "global" tensor is its ranks' local tensors laid side by side along the split dims, so its
placement is plain tiling and the packing lies in the weight map: ``Megatron -> HF`` then ``HF -> vLLM``.
Only shapes and index math live here; no weight, no torch.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property
from pathlib import Path
from typing import Any

from ..errors import ManifestError
from ..plan.arguments import check_count, shown
from ..plan.layout import ShardPlan
from .manifest import ITEMSIZES, MAX_ELEMENTS, Manifest, TensorSpec, split_layers
from .models import TransformerConfig, manifest_from_config
from .placement import ExplicitPlacement, HeldBox, Placement, ShardPlacement, check_fits
from .weightmap import Link, MappedPlacement, WeightMap, rows, whole

FAMILIES = ("llama", "qwen2", "qwen3", "qwen3_moe", "deepseek_v3")
"""The Hugging Face ``model_type``s with weight maps: Llama 3 (GQA), Qwen2 (qkv bias), Qwen3 (q/k norm),
Qwen3-MoE (experts and router), DeepSeek-V3 (multi-latent attention, shared experts, dense first layers)."""

UNMAPPED = ("mlp.gate.e_score_correction_bias",)
"""HF tensors (by the end of their names) no refit moves: DeepSeek-V3's router bias is Megatron-Core's
``router.expert_bias``, a buffer updated outside the optimizer (not a parameter, so not in the manifest);
the engine keeps its own."""

LAYOUTS = ("megatron", "hf", "hf-stacked", "vllm")
"""The layouts a side of a refit may hold a model in (see the module doc)."""

VLLM_VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: ``VocabParallelEmbedding`` pads the vocabulary to a multiple of it."""

MEGATRON_VOCAB_MULTIPLE = 128 * 8
"""Megatron pads its vocabulary to ``make_vocab_size_divisible_by`` (128) x tp; padding to tp=8's multiple
lets every tp up to 8 split it."""

FUSED_MOE = "mlp.experts.routed_experts."
"""Where vLLM's ``FusedMoE`` keeps its stacked experts (``w13_weight``, ``w2_weight``), under a layer's prefix:
vLLM 0.32's ``routed_experts`` submodule (checked against the installed engine in plugins/vllm's tests)."""

EXPERT_KEYS = {
    "qwen3_moe": ("num_experts", "num_local_experts"),
    "deepseek_v3": ("n_routed_experts", "num_local_experts"),
}
"""Where each MoE family's config gives its routed experts per layer: transformers 4 saves Qwen3-MoE's as
``num_experts``, transformers 5 as ``num_local_experts``; DeepSeek-V3's is ``n_routed_experts``, which
transformers 5 also reads as ``num_local_experts``. Every key is read; one that cannot be is refused, never
taken for a dense model."""

_DTYPES = {"float32": "float32", "bfloat16": "bfloat16", "float16": "float16", "fp32": "float32", "bf16": "bfloat16"}


def _key(config: Mapping[str, Any], name: str, default: Any = ManifestError) -> Any:
    """The size ``name`` of an HF config (every key read here is a whole number), checked under the user's own
    key (``hidden_size``, not the ``hidden`` it becomes); ``default`` when absent, else a ManifestError."""
    if name in config and config[name] is not None:
        return check_count(f"HF config {name}", config[name], minimum=0, maximum=MAX_ELEMENTS, error=ManifestError)
    if default is ManifestError:
        raise ManifestError(
            f"HF config ({config.get('model_type')}) has no {name}: is it a config.json of a causal LM?"
        )
    return default


@dataclass(frozen=True)
class HFModel:
    """A Hugging Face model of a supported family: its Megatron-Core config and both sides' tensors.

    Build it with ``manifest_from_hf_config``.

    Attributes:
        family: The HF ``model_type`` (one of ``FAMILIES``).
        config: Megatron-Core's view of it (the vocabulary padded to ``vocab_multiple``).
        vocab: The HF vocabulary size (unpadded).
        name: A label for tables.
    """

    family: str
    config: TransformerConfig
    vocab: int
    name: str = "model"
    _vllm: dict[tuple[int, int], tuple[Manifest, WeightMap]] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )
    _from_megatron: dict[tuple[int, int], WeightMap] = field(
        default_factory=dict, init=False, repr=False, compare=False
    )

    @cached_property
    def manifest(self) -> Manifest:
        """Megatron-Core's GPT tensors (what ``plan_refit`` between Megatron shards takes)."""
        return manifest_from_config(self.config, self.name)

    @cached_property
    def _hf(self) -> tuple[Manifest, WeightMap]:
        return self._hf_side(stacked=False)

    @cached_property
    def _hf_stacked(self) -> tuple[Manifest, WeightMap]:
        return self._hf_side(stacked=True)

    @property
    def hf_manifest(self) -> Manifest:
        """The transformers model class's tensors (``model.state_dict()`` names, per-expert MoE)."""
        return self._hf[0]

    @property
    def to_hf(self) -> WeightMap:
        """Megatron's tensors -> the Hugging Face tensors."""
        return self._hf[1]

    def hf_layout(self, kind: str) -> tuple[Manifest, WeightMap]:
        """An HF layout's tensors and the map into them from Megatron's: ``hf``, the model class's (per-expert
        MoE); ``hf-stacked``, with each layer's experts stacked as transformers 5 holds them."""
        return self._hf_stacked if kind == "hf-stacked" else self._hf

    def check_manifest(self, manifest: Manifest) -> None:
        """That ``manifest`` is this model's Megatron manifest (the one its weight maps read).

        Raises:
            ManifestError: it is not, naming the first tensor that differs, its shape in both, and the HF
                tensor(s) it feeds, so that a config whose sizes disagree with the manifest is told which.
        """
        ours = self.manifest
        if manifest is ours or manifest == ours:
            return
        theirs = {tensor.name: tensor for tensor in manifest}
        start = f"manifest {manifest.name!r} is not the Megatron manifest of {self.name!r}"
        fix = "pass model.manifest, or build both from one config"
        for tensor in ours:
            other = theirs.get(tensor.name)
            if other == tensor:
                continue
            feeds = sorted({link.target for link in self.to_hf.out_of(tensor.name)})
            fed = f" (it feeds {', '.join(feeds[:3])}{', ...' if len(feeds) > 3 else ''})" if feeds else ""
            given = "has no such tensor" if other is None else f"has {list(other.shape)} {other.dtype}"
            if other is not None and (other.shape, other.dtype) == (tensor.shape, tensor.dtype):
                given += "".join(
                    f", {key}={getattr(other, key)!r} (config: {getattr(tensor, key)!r})"
                    for key in (f.name for f in fields(TensorSpec))
                    if getattr(other, key) != getattr(tensor, key)
                )
            raise ManifestError(
                f"{start}: the HF config gives {tensor.name} {list(tensor.shape)} {tensor.dtype}{fed}, the manifest "
                f"{given}: {fix}"
            )
        extra = next((name for name in theirs if name not in {t.name for t in ours}), None)
        if extra is not None:
            raise ManifestError(f"{start}: its tensor {extra} is no tensor of the HF config's model: {fix}")
        facts = ("layers", "first_stage_layers", "last_stage_layers", "experts")
        differ = [f"{key} {getattr(manifest, key)} (config: {getattr(ours, key)})" for key in facts
                  if getattr(manifest, key) != getattr(ours, key)]  # fmt: skip
        if differ:
            raise ManifestError(f"{start}: {', '.join(differ)}: {fix}")

    def layout(self, kind: str) -> ModelLayout:
        """This model in layout ``kind`` (one of ``LAYOUTS``), for ``plan_refit(..., layouts={shard: ...})``.

        Raises:
            ManifestError: an unknown layout, naming the known ones.
        """
        if kind not in LAYOUTS:
            raise ManifestError(f"unknown layout {shown(kind)}: layouts are {', '.join(LAYOUTS)}")
        return ModelLayout(self, kind)

    # -- Megatron -> Hugging Face ---------------------------------------------------------------------

    def _hf_side(self, stacked: bool) -> tuple[Manifest, WeightMap]:
        """The HF tensors and the map filling them from Megatron's (Megatron-Bridge's conversion, as boxes)."""
        c, source = self.config, self.manifest
        hidden, dtype = c.hidden, c.dtype
        d = c.head_dim or hidden // c.heads
        groups = c.kv_heads or c.heads
        per_group = c.heads // groups
        span = (per_group + 2) * d
        tensors: list[TensorSpec] = []
        links: list[Link] = []

        def add(name: str, shape: tuple[int, ...], origin: str, **where: Any) -> None:
            """A tensor that is its Megatron tensor whole."""
            tensors.append(TensorSpec(name, shape, dtype, **where))
            links.append(Link(name, whole(shape), origin, whole(source.tensor(origin).shape)))

        vocab = self.vocab
        tensors.append(TensorSpec("model.embed_tokens.weight", (vocab, hidden), dtype, stage=("first",)))
        links.append(
            Link("model.embed_tokens.weight", rows((vocab, hidden), 0, vocab), "embedding.word_embeddings.weight",
                 rows((c.vocab, hidden), 0, vocab))
        )  # fmt: skip
        for layer in range(c.layers):
            m, h = f"decoder.layers.{layer}.", f"model.layers.{layer}."
            at: dict[str, Any] = {"layer": layer}
            add(f"{h}input_layernorm.weight", (hidden,), f"{m}input_layernorm.weight", **at)
            if c.kv_lora_rank is not None:
                self._mla(add, m, h, at)
            for kind in () if c.kv_lora_rank is not None else ("weight", "bias") if c.qkv_bias else ("weight",):
                tail = (hidden,) if kind == "weight" else ()
                fused = f"{m}self_attention.linear_qkv.{kind}"
                full = (groups * span, *tail)
                for part, heads, skip in (("q", per_group, 0), ("k", 1, per_group), ("v", 1, per_group + 1)):
                    name = f"{h}self_attn.{part}_proj.{kind}"
                    shape = (groups * heads * d, *tail)
                    tensors.append(TensorSpec(name, shape, dtype, **at))
                    for g in range(groups):  # query group g: its q heads, then its k head, then its v head
                        start = g * span + skip * d
                        links.append(
                            Link(name, rows(shape, g * heads * d, (g + 1) * heads * d), fused,
                                 rows(full, start, start + heads * d))
                        )  # fmt: skip
            if c.qk_norm:
                for part in "qk":
                    add(f"{h}self_attn.{part}_norm.weight", (d,), f"{m}self_attention.{part}_layernorm.weight", **at)
            heads_out = c.heads * (c.v_head_dim if c.kv_lora_rank is not None else d)
            add(f"{h}self_attn.o_proj.weight", (hidden, heads_out), f"{m}self_attention.linear_proj.weight", **at)
            add(f"{h}post_attention_layernorm.weight", (hidden,), f"{m}pre_mlp_layernorm.weight", **at)
            if c.experts and layer >= c.dense_layers:
                add(f"{h}mlp.gate.weight", (c.experts, hidden), f"{m}mlp.router.weight", **at)
                self._experts(tensors, links, layer, stacked)
                if c.shared_experts:
                    shared = c.shared_experts * (c.moe_ffn or 0)
                    self._mlp(tensors, links, f"{m}mlp.shared_experts.", f"{h}mlp.shared_experts.", shared, at)
            else:
                self._mlp(tensors, links, f"{m}mlp.", f"{h}mlp.", c.ffn, at)
        add("model.norm.weight", (hidden,), "decoder.final_layernorm.weight", stage=("last",))
        if not c.tied_embeddings:
            tensors.append(TensorSpec("lm_head.weight", (vocab, hidden), dtype, stage=("last",)))
            links.append(
                Link("lm_head.weight", rows((vocab, hidden), 0, vocab), "output_layer.weight",
                     rows((c.vocab, hidden), 0, vocab))
            )  # fmt: skip
        kind = "hf-stacked" if stacked else "hf"
        targets = Manifest(tuple(tensors), layers=c.layers, name=f"{self.name} ({kind})")
        return targets, WeightMap(source, targets, tuple(links), name=f"megatron -> {kind}")

    def _mla(self, add: Any, m: str, h: str, at: dict[str, Any]) -> None:
        """DeepSeek's multi-latent attention: each Megatron projection is one HF tensor whole (both put a head's
        no-rope part before its rope part, and the kv down projection's latent before its rope key)."""
        c = self.config
        hidden, rope, latent = c.hidden, c.qk_pos_emb_head_dim, c.kv_lora_rank or 0
        qk = c.qk_head_dim + rope
        a = f"{m}self_attention."
        if c.q_lora_rank is None:
            add(f"{h}self_attn.q_proj.weight", (c.heads * qk, hidden), f"{a}linear_q_proj.weight", **at)
        else:
            add(f"{h}self_attn.q_a_proj.weight", (c.q_lora_rank, hidden), f"{a}linear_q_down_proj.weight", **at)
            add(f"{h}self_attn.q_a_layernorm.weight", (c.q_lora_rank,), f"{a}q_layernorm.weight", **at)
            add(f"{h}self_attn.q_b_proj.weight", (c.heads * qk, c.q_lora_rank), f"{a}linear_q_up_proj.weight", **at)
        add(f"{h}self_attn.kv_a_proj_with_mqa.weight", (latent + rope, hidden), f"{a}linear_kv_down_proj.weight", **at)
        add(f"{h}self_attn.kv_a_layernorm.weight", (latent,), f"{a}kv_layernorm.weight", **at)
        kv_up = c.heads * (c.qk_head_dim + c.v_head_dim)
        add(f"{h}self_attn.kv_b_proj.weight", (kv_up, latent), f"{a}linear_kv_up_proj.weight", **at)

    def _mlp(
        self,
        tensors: list[TensorSpec],
        links: list[Link],
        m: str,
        h: str,
        ffn: int,
        at: dict[str, Any],
        suffix: str = "",
    ) -> None:
        """A SwiGLU MLP: Megatron's ``linear_fc1`` = [gate; up] -> ``gate_proj`` and ``up_proj``; ``linear_fc2`` ->
        ``down_proj``."""
        hidden, dtype = self.config.hidden, self.config.dtype
        fc1, fc2 = f"{m}linear_fc1.weight{suffix}", f"{m}linear_fc2.weight{suffix}"
        for block, part in enumerate(("gate", "up")):
            name = f"{h}{part}_proj.weight"
            tensors.append(TensorSpec(name, (ffn, hidden), dtype, **at))
            links.append(Link(name, whole((ffn, hidden)), fc1, rows((2 * ffn, hidden), block * ffn, (block + 1) * ffn)))
        tensors.append(TensorSpec(f"{h}down_proj.weight", (hidden, ffn), dtype, **at))
        links.append(Link(f"{h}down_proj.weight", whole((hidden, ffn)), fc2, whole((hidden, ffn))))

    def _experts(self, tensors: list[TensorSpec], links: list[Link], layer: int, stacked: bool) -> None:
        """A MoE layer's routed experts: one MLP per expert, or transformers 5's two stacked tensors, in which
        expert e's ``gate_up_proj[e]`` is its ``linear_fc1`` whole ([gate; up]), ``down_proj[e]`` its ``linear_fc2``."""
        c = self.config
        hidden, ffn, experts = c.hidden, c.moe_ffn or 0, c.experts
        m, h = f"decoder.layers.{layer}.mlp.experts.", f"model.layers.{layer}.mlp.experts."
        at: dict[str, Any] = {"layer": layer}
        if not stacked:
            for e in range(experts):
                self._mlp(tensors, links, m, f"{h}{e}.", ffn, at, suffix=str(e))
            return
        for name, shape, origin in (
            ("gate_up_proj", (experts, 2 * ffn, hidden), "linear_fc1.weight"),
            ("down_proj", (experts, hidden, ffn), "linear_fc2.weight"),
        ):
            tensors.append(TensorSpec(f"{h}{name}", shape, c.dtype, **at))
            links += [
                Link(f"{h}{name}", rows(shape, e, e + 1), f"{m}{origin}{e}", whole(shape[1:])) for e in range(experts)
            ]

    # -- Hugging Face -> vLLM ------------------------------------------------------------------------

    def vllm(self, tp: int, expt_tp: int) -> tuple[Manifest, WeightMap]:
        """The tensors of a vLLM engine with ``tp`` (and ``expt_tp`` for the experts), laid side by side over
        its ranks, and the map filling them from the HF tensors (the loaders' packing, as boxes).

        Raises:
            ManifestError: heads, kv heads, sizes or the padded vocabulary that do not split over tp.
        """
        key = (tp, expt_tp)
        if key not in self._vllm:
            self._vllm[key] = _VllmPacking(self, tp, expt_tp).build()
        return self._vllm[key]

    def vllm_from_megatron(self, tp: int, expt_tp: int) -> WeightMap:
        """Megatron's tensors -> a vLLM engine's (``to_hf`` then ``vllm``), made once per (tp, expt_tp).

        Raises:
            ManifestError: as ``vllm``.
        """
        key = (tp, expt_tp)
        if key not in self._from_megatron:
            self._from_megatron[key] = self.to_hf.then(self.vllm(tp, expt_tp)[1])
        return self._from_megatron[key]


@dataclass
class _VllmPacking:
    """The vLLM tensors of one (tp, expt_tp), built with their links from the HF tensors."""

    model: HFModel
    tp: int
    expt_tp: int
    tensors: list[TensorSpec] = field(default_factory=list)
    links: list[Link] = field(default_factory=list)
    padding: dict[str, tuple[tuple[tuple[int, int], ...], ...]] = field(default_factory=dict)

    def _check(self, what: str, size: int, parts: int, axis: str = "tp") -> int:
        if size % parts:
            raise ManifestError(
                f"vllm layout of {self.model.name!r}: {what} ({size}) does not split over {axis}={parts}: choose a "
                f"{axis} that divides it"
            )
        return size // parts

    def same(self, name: str, **at: Any) -> None:
        """A tensor vLLM holds as the HF model does (whole or split by plain tiling)."""
        shape = self.model.hf_manifest.tensor(name).shape
        self.tensors.append(TensorSpec(name, shape, self.model.config.dtype, **at))
        self.links.append(Link(name, whole(shape), name, whole(shape)))

    def build(self) -> tuple[Manifest, WeightMap]:
        model, c, tp = self.model, self.model.config, self.tp
        hf = model.hf_manifest
        self._vocab("model.embed_tokens.weight", "first")
        for layer in range(c.layers):
            h = f"model.layers.{layer}."
            at: dict[str, Any] = {"layer": layer}
            self.same(f"{h}input_layernorm.weight", **at)
            if c.kv_lora_rank is not None:
                self._mla(h, **at)
            else:
                self._qkv(h, "weight", **at)
            if c.qkv_bias:
                self._qkv(h, "bias", **at)
            if c.qk_norm:
                self.same(f"{h}self_attn.q_norm.weight", **at)
                self.same(f"{h}self_attn.k_norm.weight", **at)
            self._check("attention heads x head_dim", hf.tensor(f"{h}self_attn.o_proj.weight").shape[1], tp)
            self.same(f"{h}self_attn.o_proj.weight", **at)
            self.same(f"{h}post_attention_layernorm.weight", **at)
            if c.experts and layer >= c.dense_layers:
                self.same(f"{h}mlp.gate.weight", **at)
                self._experts(h, **at)
                if c.shared_experts:
                    shared, m = c.shared_experts * (c.moe_ffn or 0), f"{h}mlp.shared_experts."
                    self._gate_up(m, m, "gate_up_proj.weight", shared, tp, **at)
                    self.same(f"{m}down_proj.weight", **at)
            else:
                self._gate_up(f"{h}mlp.", f"{h}mlp.", "gate_up_proj.weight", c.ffn, tp, **at)
                self.same(f"{h}mlp.down_proj.weight", **at)
        self.same("model.norm.weight", stage=("last",))
        if not c.tied_embeddings:
            self._vocab("lm_head.weight", "last")
        targets = Manifest(tuple(self.tensors), layers=c.layers, name=f"{model.name} (vllm tp={tp})")
        name = f"hf -> vllm tp={tp}"
        return targets, WeightMap(hf, targets, tuple(self.links), self.padding, name=name, zeroed=True)

    def _vocab(self, name: str, stage: str) -> None:
        """``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary padded to a multiple of 64, split over tp."""
        vocab, hidden = self.model.vocab, self.model.config.hidden
        padded = -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
        if padded % self.tp:
            raise ManifestError(
                f"vllm layout of {self.model.name!r}: {name}: vLLM pads the vocabulary {vocab} to {padded} (a multiple "
                f"of {VLLM_VOCAB_PADDING}), which tp={self.tp} does not split: choose a tp that divides {padded}"
            )
        shape = (padded, hidden)
        self.tensors.append(TensorSpec(name, shape, self.model.config.dtype, stage=(stage,)))
        self.links.append(Link(name, rows(shape, 0, vocab), name, whole((vocab, hidden))))
        if padded > vocab:
            self.padding[name] = (rows(shape, vocab, padded),)

    def _mla(self, h: str, **at: Any) -> None:
        """``DeepseekV2MLAAttention``: with q compression, ``fused_qkv_a_proj`` = [q_a_proj; kv_a_proj_with_mqa]
        whole on every rank (a ``MergedColumnParallelLinear`` with tp disabled); ``q_b_proj`` / ``kv_b_proj``
        (``ColumnParallelLinear``: whole heads per rank) and ``o_proj`` split over tp; norms whole."""
        c, a = self.model.config, f"{h}self_attn."
        self._check("attention heads", c.heads, self.tp)
        if c.q_lora_rank is None:
            self.same(f"{a}q_proj.weight", **at)
            self.same(f"{a}kv_a_proj_with_mqa.weight", **at)
        else:
            hf = self.model.hf_manifest
            parts = [hf.tensor(f"{a}{part}.weight").shape for part in ("q_a_proj", "kv_a_proj_with_mqa")]
            shape = (parts[0][0] + parts[1][0], c.hidden)
            self.tensors.append(TensorSpec(f"{a}fused_qkv_a_proj.weight", shape, c.dtype, **at))
            start = 0
            for part, size in zip(("q_a_proj", "kv_a_proj_with_mqa"), parts):
                self.links.append(
                    Link(f"{a}fused_qkv_a_proj.weight", rows(shape, start, start + size[0]), f"{a}{part}.weight",
                         whole(size))
                )  # fmt: skip
                start += size[0]
            self.same(f"{a}q_a_layernorm.weight", **at)
            self.same(f"{a}q_b_proj.weight", **at)
        self.same(f"{a}kv_a_layernorm.weight", **at)
        self.same(f"{a}kv_b_proj.weight", **at)

    def _qkv(self, h: str, kind: str, **at: Any) -> None:
        """``QKVParallelLinear``: tp rank r holds [its q heads; its k heads; its v heads]; with more ranks than kv
        heads, rank r holds kv head r // (tp / kv heads) (vLLM's ``num_kv_head_replicas``)."""
        c, tp = self.model.config, self.tp
        d = c.head_dim or c.hidden // c.heads
        kv = c.kv_heads or c.heads
        q_heads = self._check("attention heads", c.heads, tp)
        if tp >= kv:
            self._check("tp over kv heads", tp, kv, "kv heads")
            kv_heads, replicas = 1, tp // kv
        else:
            kv_heads, replicas = self._check("kv heads", kv, tp), 1
        tail = (c.hidden,) if kind == "weight" else ()
        local = (q_heads + 2 * kv_heads) * d
        name = f"{h}self_attn.qkv_proj.{kind}"
        shape = (tp * local, *tail)
        self.tensors.append(TensorSpec(name, shape, c.dtype, **at))
        for r in range(tp):
            first_kv = (r // replicas) * kv_heads
            start = r * local
            for part, heads, first in (
                ("q", q_heads, r * q_heads),
                ("k", kv_heads, first_kv),
                ("v", kv_heads, first_kv),
            ):
                source = f"{h}self_attn.{part}_proj.{kind}"
                full = self.model.hf_manifest.tensor(source).shape
                self.links.append(
                    Link(
                        name, rows(shape, start, start + heads * d), source, rows(full, first * d, (first + heads) * d)
                    )
                )
                start += heads * d

    def _gate_up(
        self, m: str, h: str, name: str, ffn: int, parts: int, *, lead: tuple[int, ...] = (), **at: Any
    ) -> None:
        """``MergedColumnParallelLinear`` (and ``FusedMoE``'s w1/w3): rank r holds [its gate rows; its up rows]."""
        share = self._check("ffn", ffn, parts, "tp" if not lead else "expt_tp")
        hidden = self.model.config.hidden
        target = f"{h}{name}"
        for r in range(parts):
            for block, part in enumerate(("gate", "up")):
                start = r * 2 * share + block * share
                box = ((lead[0], lead[0] + 1),) if lead else ()
                self.links.append(
                    Link(target, (*box, (start, start + share), (0, hidden)), f"{m}{part}_proj.weight",
                         rows((ffn, hidden), r * share, (r + 1) * share))
                )  # fmt: skip
        if not lead:
            self.tensors.append(TensorSpec(target, (2 * ffn, hidden), self.model.config.dtype, **at))

    def _experts(self, h: str, **at: Any) -> None:
        """``FusedMoE``: ``w13_weight [experts, 2*moe_ffn, hidden]`` with each expt_tp rank's [gate; up] rows side
        by side, and ``w2_weight [experts, hidden, moe_ffn]`` (= each expert's down_proj, split on dim 2)."""
        c = self.model.config
        ffn, hidden, experts = c.moe_ffn or 0, c.hidden, c.experts
        self.tensors.append(TensorSpec(f"{h}{FUSED_MOE}w13_weight", (experts, 2 * ffn, hidden), c.dtype, **at))
        self.tensors.append(TensorSpec(f"{h}{FUSED_MOE}w2_weight", (experts, hidden, ffn), c.dtype, **at))
        for e in range(experts):
            m = f"{h}mlp.experts.{e}."
            self._gate_up(m, f"{h}{FUSED_MOE}", "w13_weight", ffn, self.expt_tp, lead=(e,))
            self.links.append(
                Link(f"{h}{FUSED_MOE}w2_weight", ((e, e + 1), (0, hidden), (0, ffn)), f"{m}down_proj.weight",
                     whole((hidden, ffn)))
            )  # fmt: skip


# -- placements --------------------------------------------------------------------------------------

_SPLITS: dict[str, tuple[tuple[str, int], ...]] = {
    "qkv_proj.weight": (("tp", 0),),
    "qkv_proj.bias": (("tp", 0),),
    "q_proj.weight": (("tp", 0),),
    "q_b_proj.weight": (("tp", 0),),
    "kv_b_proj.weight": (("tp", 0),),
    "gate_up_proj.weight": (("tp", 0),),
    "o_proj.weight": (("tp", 1),),
    "down_proj.weight": (("tp", 1),),
    "embed_tokens.weight": (("tp", 0),),
    "lm_head.weight": (("tp", 0),),
    "w13_weight": (("ep", 0), ("expt_tp", 1)),
    "w2_weight": (("ep", 0), ("expt_tp", 2)),
}
"""How a vLLM rank's tensor tiles the side-by-side tensor, by the end of its name: (grid axis, dim) pairs."""


def _split_of(name: str) -> tuple[tuple[str, int], ...]:
    return next((split for end, split in _SPLITS.items() if name.endswith(end)), ())


def engine_placement(tensors: Manifest, plan: ShardPlan, split: bool, label: str) -> Placement:
    """What each rank of ``plan`` holds of an engine's ``tensors``: its pipeline stage's tensors (an even split
    of the layers), each tiled over tp (and ep, expt_tp for experts) when ``split``, else whole.

    Raises:
        ManifestError: a tensor that does not tile over the shard, or layers that do not split over pp.
    """
    spec = plan.spec
    try:
        stages = split_layers(tensors.layers, spec.pp)
    except ManifestError as error:
        raise ManifestError(f"{label}: {error}") from None
    records: list[HeldBox] = []
    for rank in plan.ranks:
        dense, expert = plan.decoder_grid.coords(rank), plan.expert_grid.coords(rank)
        coords = {"tp": dense["tp"], "ep": expert["ep"], "expt_tp": expert["expt_tp"]}
        sizes = {"tp": spec.tp, "ep": spec.ep, "expt_tp": spec.expt_tp}
        stage = dense["pp"]
        for tensor in tensors:
            if tensor.layer is not None and tensor.layer not in stages[stage]:
                continue
            if tensor.layer is None and not (
                "all" in tensor.stage
                or ("first" in tensor.stage and stage == 0)
                or ("last" in tensor.stage and stage == spec.pp - 1)
            ):
                continue
            box = [(0, size) for size in tensor.shape]
            for axis, dim in _split_of(tensor.name) if split else ():
                size, parts = tensor.shape[dim], sizes[axis]
                if size % parts:
                    raise ManifestError(
                        f"{label}: tensor {tensor.name} {list(tensor.shape)}: dim {dim} ({size}) does not split over "
                        f"{axis}={parts}: choose an {axis} that divides it"
                    )
                share = size // parts
                box[dim] = (coords[axis] * share, (coords[axis] + 1) * share)
            records.append(HeldBox(tensor.name, rank, tuple(box)))
    return ExplicitPlacement(tensors, records, index=plan.index, label=label)


@dataclass(frozen=True)
class ModelLayout:
    """One model in one layout (``HFModel.layout``): what a side of a refit holds, for ``plan_refit``'s ``layouts``."""

    model: HFModel
    kind: str

    def __str__(self) -> str:
        return f"{self.model.name} ({self.kind})"


def _hf_placement(model: HFModel, kind: str, plan: ShardPlan) -> tuple[Placement, WeightMap]:
    """A shard holding the HF model class whole on every rank, and the map into its tensors from Megatron's."""
    spec = plan.spec
    label = f"shard {plan.index} '{spec}' ({kind})"
    if max(spec.tp, spec.pp, spec.ep, spec.expt_tp) > 1:
        raise ManifestError(
            f"{label}: the {kind} layout holds the transformers model class whole on every rank: give its shard "
            f"tp=1, pp=1 (dp for more copies), or use the vllm layout for a split engine"
        )
    targets, weights = model.hf_layout(kind)
    return engine_placement(targets, plan, split=False, label=label), weights


def sides(
    source: ShardPlan, destinations: tuple[ShardPlan, ...], layouts: Mapping[int, ModelLayout]
) -> tuple[Placement, tuple[Placement, ...]]:
    """The placements of a refit between shards in the given layouts, all in the source's coordinates: the
    source's own tensors, and each destination's through the weight map from them (``MappedPlacement``).

    Args:
        source: The source shard.
        destinations: The destination shards.
        layouts: Layout by shard index; a shard not named holds Megatron's layout.

    Raises:
        ManifestError: layouts of different models, a source layout that is not megatron or hf (a vLLM
            engine replicates kv heads, so it is a destination only), or a shard the model does not split over.
    """
    models = {id(item.model): item.model for item in layouts.values()}
    if len(models) != 1:
        raise ManifestError("layouts: give every shard's layout of one model (one manifest_from_hf_config)")
    (model,) = models.values()

    def kind_of(plan: ShardPlan) -> str:
        return layouts[plan.index].kind if plan.index in layouts else "megatron"

    start = kind_of(source)
    if start not in ("megatron", "hf", "hf-stacked"):
        raise ManifestError(
            f"source shard {source.index} in the {start} layout: a refit starts from megatron or hf (a vLLM engine "
            f"holds replicated kv heads and padding, which do not name one source element each)"
        )
    if start == "megatron":
        check_fits(model.manifest, source)
        origin: Placement = ShardPlacement(source, model.manifest)
        from_megatron: WeightMap | None = None
    else:
        origin, from_megatron = _hf_placement(model, start, source)
    out: list[Placement] = []
    for plan in destinations:
        kind = kind_of(plan)
        if kind == "megatron":
            check_fits(model.manifest, plan)
            held: Placement = ShardPlacement(plan, model.manifest)
            weights = None if from_megatron is None else from_megatron.reversed(f"{start} -> megatron")
        elif kind == "vllm":
            targets, packing = model.vllm(plan.spec.tp, plan.spec.expt_tp)
            held = engine_placement(targets, plan, split=True, label=f"shard {plan.index} '{plan.spec}' (vllm)")
            if from_megatron is None:
                weights = model.vllm_from_megatron(plan.spec.tp, plan.spec.expt_tp)
            else:
                weights = _hf_to(model, start, packing)
        else:
            held, into = _hf_placement(model, kind, plan)
            weights = into if from_megatron is None else None if kind == start else from_megatron.reversed().then(into)
        out.append(held if weights is None else MappedPlacement(held, weights))
    return origin, tuple(out)


def _hf_to(model: HFModel, start: str, packing: WeightMap) -> WeightMap:
    """The map from an HF source layout into vLLM's packing (which reads the per-expert HF tensors)."""
    if start == "hf":
        return packing
    return model._hf_stacked[1].reversed().then(model.to_hf).then(packing)


HF_PREFIX = "hf:"
"""``--model hf:PATH``: a Hugging Face config.json (or the folder holding it) instead of a manifest or preset."""


def hf_model_of(model: str) -> HFModel:
    """The model ``--model hf:PATH`` names (``manifest_from_hf_config(PATH)``).

    Raises:
        ManifestError: ``model`` does not start with ``hf:``, or its config is bad.
    """
    if not isinstance(model, str) or not model.startswith(HF_PREFIX):
        raise ManifestError(
            f"model {shown(model)}: a layout other than megatron needs the model's Hugging Face config: "
            f"--model {HF_PREFIX}PATH/config.json"
        )
    return manifest_from_hf_config(model.removeprefix(HF_PREFIX))


def shard_layouts(
    model: str, src: int, dst: Sequence[int], source: str = "megatron", destination: str = "megatron"
) -> dict[int, ModelLayout] | None:
    """``plan_refit``'s ``layouts`` for ``--from-layout`` / ``--to-layout``: ``source``'s for shard ``src``,
    ``destination``'s for every shard of ``dst``; None when both are megatron (no layout to plan through).

    Raises:
        ManifestError: an unknown layout, or one other than megatron without ``--model hf:PATH``.
    """
    if source == destination == "megatron":
        return None
    hf = hf_model_of(model)
    chosen = {index: hf.layout(destination) for index in dst}
    chosen[src] = hf.layout(source)
    return {index: layout for index, layout in chosen.items() if layout.kind != "megatron"} or None


# -- from a Hugging Face config ------------------------------------------------------------------------


def manifest_from_hf_config(
    config: str | Path | Mapping[str, Any], *, vocab_multiple: int = MEGATRON_VOCAB_MULTIPLE, name: str | None = None
) -> HFModel:
    """Both sides of a model from its Hugging Face ``config.json``: Megatron's manifest (``.manifest``), the HF
    tensors (``.hf_manifest``), and its layouts (``.layout("hf" | "hf-stacked" | "vllm" | "megatron")``).

    Args:
        config: The path of a ``config.json`` (or of the folder holding it), or its contents as a mapping.
        vocab_multiple: Megatron pads the vocabulary to a multiple of this (``make_vocab_size_divisible_by``
            x tp); both sides of a refit must agree on it.
        name: A label for tables (default: the family and sizes).

    Raises:
        ManifestError: an unreadable file, an unsupported family (naming the supported ones), or a config
            whose sizes are missing or inconsistent (an MoE family's expert count among them: ``EXPERT_KEYS``).
    """
    data = _read_config(config)
    family = data.get("model_type")
    if family not in FAMILIES:
        raise ManifestError(
            f"HF model_type {shown(family)} has no weight map: supported families are {', '.join(FAMILIES)}"
        )
    vocab = _key(data, "vocab_size")
    layers = _key(data, "num_hidden_layers")
    dtype = _DTYPES.get(str(data.get("torch_dtype") or data.get("dtype") or "float32").removeprefix("torch."))
    if dtype is None or dtype not in ITEMSIZES:
        raise ManifestError(
            f"HF config torch_dtype {shown(data.get('torch_dtype'))}: expected float32, bfloat16 or float16"
        )
    for key, unsupported in (("attention_bias", family != "qwen2"), ("mlp_bias", True)):
        if data.get(key) and unsupported:
            raise ManifestError(f"HF config {key}=true ({family}): biases outside q/k/v have no weight map yet")
    check = check_multiple(vocab_multiple)
    sizes: dict[str, Any] = {  # what every family's config says alike
        "layers": layers,
        "hidden": _key(data, "hidden_size"),
        "ffn": _key(data, "intermediate_size"),
        "heads": _key(data, "num_attention_heads"),
        "vocab": -(-vocab // check) * check,
        "tied_embeddings": bool(data.get("tie_word_embeddings", False)),
        "dtype": dtype,
    }
    make = _deepseek if family == "deepseek_v3" else _llama_like
    transformer = make(data, family, sizes)
    label = name or f"{family}-{layers}x{transformer.hidden}"
    return HFModel(family, transformer, vocab, label)


def _llama_like(data: Mapping[str, Any], family: str, sizes: dict[str, Any]) -> TransformerConfig:
    """Llama 3, Qwen2, Qwen3 and Qwen3-MoE: GQA, qkv bias (Qwen2), q/k norms (Qwen3), experts (Qwen3-MoE)."""
    experts = _experts(data, family) if family == "qwen3_moe" else 0
    dense_layers = 0
    if experts:
        only = list(data.get("mlp_only_layers") or [])
        if _key(data, "decoder_sparse_step", 1) != 1 or only != list(range(len(only))):
            raise ManifestError(
                f"HF config ({family}): decoder_sparse_step={data.get('decoder_sparse_step')}, mlp_only_layers="
                f"{shown(only)}: only the first layers may be dense (mlp_only_layers = [0 .. k-1], sparse step 1)"
            )
        dense_layers = len(only)
    return TransformerConfig(
        **sizes,
        kv_heads=_key(data, "num_key_value_heads", None),
        head_dim=_key(data, "head_dim", None),
        experts=experts,
        moe_ffn=_key(data, "moe_intermediate_size") if experts else None,
        dense_layers=dense_layers,
        qkv_bias=family == "qwen2",
        qk_norm=family in ("qwen3", "qwen3_moe"),
    )


def _deepseek(data: Mapping[str, Any], family: str, sizes: dict[str, Any]) -> TransformerConfig:
    """DeepSeek-V3's config (``deepseek_v3``): MLA sizes, routed and shared experts, the first layers dense."""
    if _key(data, "moe_layer_freq", 1) != 1:
        raise ManifestError(
            f"HF config ({family}): moe_layer_freq={data.get('moe_layer_freq')}: only the first "
            f"first_k_dense_replace layers may be dense (moe_layer_freq 1)"
        )
    experts = _experts(data, family)
    return TransformerConfig(
        **sizes,
        experts=experts,
        moe_ffn=_key(data, "moe_intermediate_size") if experts else None,
        shared_experts=int(_key(data, "n_shared_experts", 0) or 0) if experts else 0,
        dense_layers=min(int(_key(data, "first_k_dense_replace", 0)), sizes["layers"]) if experts else 0,
        q_lora_rank=_key(data, "q_lora_rank", None),
        kv_lora_rank=_key(data, "kv_lora_rank"),
        qk_head_dim=_key(data, "qk_nope_head_dim"),
        qk_pos_emb_head_dim=_key(data, "qk_rope_head_dim"),
        v_head_dim=_key(data, "v_head_dim"),
    )


def _experts(data: Mapping[str, Any], family: str) -> int:
    """The routed experts per MoE layer of a ``family`` config, from every key transformers saves it under
    (``EXPERT_KEYS``); 0 is a model whose layers are all dense.

    Raises:
        ManifestError: no key gives the count, one gives no non-negative integer, or two give different ones.
    """
    keys = EXPERT_KEYS[family]
    given = {key: data[key] for key in keys if data.get(key) is not None}
    if not given:
        raise ManifestError(
            f"HF config ({family}) has no expert count: expected {' or '.join(keys)} (the routed experts per MoE "
            f"layer); pass the model's own config.json, as transformers saves it"
        )
    for key, value in given.items():
        if isinstance(value, bool) or not isinstance(value, int) or value < 0:
            raise ManifestError(
                f"HF config ({family}) {key}={shown(value)}: expected the routed experts per MoE layer, an integer >= 0"
            )
    if len(set(given.values())) > 1:
        both = ", ".join(f"{key}={value}" for key, value in given.items())
        raise ManifestError(f"HF config ({family}) gives two expert counts, {both}: keep one of them")
    return int(next(iter(given.values())))


def check_multiple(value: object) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or value < 1:
        raise ManifestError(f"vocab_multiple={shown(value)}: expected a positive integer, e.g. 1024")
    return value


def _read_config(config: str | Path | Mapping[str, Any]) -> Mapping[str, Any]:
    if isinstance(config, Mapping):
        return config
    if not isinstance(config, (str, Path)):
        raise ManifestError(f"config={shown(config)}: expected the path of a config.json or its contents")
    path = Path(config)
    if path.is_dir():
        path = path / "config.json"
    try:
        data = json.loads(path.read_text())
    except (OSError, ValueError) as error:
        raise ManifestError(f"cannot read HF config {path}: {error}") from None
    if not isinstance(data, Mapping):
        raise ManifestError(f"HF config {path}: expected a JSON object")
    return data


__all__ = [
    "EXPERT_KEYS",
    "FAMILIES",
    "HF_PREFIX",
    "LAYOUTS",
    "MEGATRON_VOCAB_MULTIPLE",
    "VLLM_VOCAB_PADDING",
    "HFModel",
    "ModelLayout",
    "engine_placement",
    "hf_model_of",
    "manifest_from_hf_config",
    "shard_layouts",
    "sides",
]
