"""Hugging Face model families as Megatron-Core and the inference engines hold them.

A model read from its Hugging Face ``config.json`` (``manifest_from_hf_config``; the config's keys are read in
``hf_config``) has both sides' tensors: the Megatron-Core GPT manifest a training job holds
(``models.manifest_from_config``) and the tensors of the Hugging Face model class, with the weight map between
them (Megatron-Bridge's conversion, as boxes), made here from Megatron-Core's sizes. A side of a refit is then a
*layout* (``ModelLayout``, ``HFModel.layout``), and ``sides`` gives each side's placement through its map:

- ``megatron``: Megatron-Core's GPT layout, by ``ShardPlacement``'s index math.
- ``hf``: the transformers model class on every rank of the shard (tp = pp = 1), as ``model.state_dict()``
  names, shapes and dtypes its weights in transformers 4 and as checkpoints (safetensors keys) name them:
  one ``experts.{e}.gate_proj`` per expert. A tied output head is the embedding (no ``lm_head.weight``).
- ``hf-stacked``: the same, with each MoE layer's experts stacked as transformers 5 holds them in memory:
  ``mlp.experts.gate_up_proj [experts, 2*moe_ffn, hidden]`` (gate, then up) and ``mlp.experts.down_proj``.
- ``vllm``: what each rank of a vLLM (or SGLang) engine with the shard's tp, pp and ep holds, packed as its
  weight loaders pack a checkpoint (``vllm_packing``): the map into it reads the HF tensors, so a refit from
  Megatron goes ``Megatron -> HF`` then ``HF -> vLLM``.

Only shapes and index math live here; no weight, no torch.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field, fields
from functools import cached_property, partial
from pathlib import Path
from typing import Any

from ..errors import ManifestError
from ..plan.arguments import shown
from ..plan.layout import ShardPlan
from .boxes import Box
from .collector import gc_paused
from .hf_config import MEGATRON_VOCAB_MULTIPLE, parse_hf_config
from .manifest import Manifest, TensorSpec
from .models import TransformerConfig, manifest_from_config
from .placement import Placement, ShardPlacement, check_fits
from .vllm_packing import engine_placement, vllm_tensors
from .weightmap import MapBuilder, MappedPlacement, WeightMap, rows, whole

UNMAPPED = ("mlp.gate.e_score_correction_bias",)
"""HF tensors (by the end of their names) no refit moves: DeepSeek-V3's router bias is Megatron-Core's
``router.expert_bias``, a buffer updated outside the optimizer (not a parameter, so not in the manifest);
the engine keeps its own."""

LAYOUTS = ("megatron", "hf", "hf-stacked", "vllm")
"""The layouts a side of a refit may hold a model in (see the module doc)."""


@dataclass(frozen=True)
class HFModel:
    """A Hugging Face model of a supported family: its Megatron-Core config and both sides' tensors.

    Build it with ``manifest_from_hf_config``.

    Attributes:
        family: The HF ``model_type`` (one of ``hf_config.FAMILIES``).
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
        with gc_paused():
            return manifest_from_config(self.config, self.name)

    @cached_property
    def _hf(self) -> tuple[Manifest, WeightMap]:
        with gc_paused():
            return self._hf_side(stacked=False)

    @cached_property
    def _hf_stacked(self) -> tuple[Manifest, WeightMap]:
        with gc_paused():
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
            feeds = sorted(self.to_hf.fed_by(tensor.name))
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
        weights = MapBuilder()

        def add(name: str, shape: tuple[int, ...], origin: str, **where: Any) -> None:
            """A tensor that is its Megatron tensor whole."""
            tensors.append(TensorSpec(name, shape, dtype, **where))
            weights.link(name, whole(shape), origin, whole(source.tensor(origin).shape))

        vocab = self.vocab
        tensors.append(TensorSpec("model.embed_tokens.weight", (vocab, hidden), dtype, stage=("first",)))
        weights.link("model.embed_tokens.weight", rows((vocab, hidden), 0, vocab), "embedding.word_embeddings.weight",
                     rows((c.vocab, hidden), 0, vocab))  # fmt: skip
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
                    weights.fill(
                        name,
                        (fused,),
                        ("qkv", shape, full, heads, skip, d),
                        partial(_unfused, shape, full, heads, skip, d),
                    )
            if c.qk_norm:
                for part in "qk":
                    add(f"{h}self_attn.{part}_norm.weight", (d,), f"{m}self_attention.{part}_layernorm.weight", **at)
            heads_out = c.heads * (c.v_head_dim if c.kv_lora_rank is not None else d)
            add(f"{h}self_attn.o_proj.weight", (hidden, heads_out), f"{m}self_attention.linear_proj.weight", **at)
            add(f"{h}post_attention_layernorm.weight", (hidden,), f"{m}pre_mlp_layernorm.weight", **at)
            if c.experts and layer >= c.dense_layers:
                add(f"{h}mlp.gate.weight", (c.experts, hidden), f"{m}mlp.router.weight", **at)
                self._experts(tensors, weights, layer, stacked)
                if c.shared_experts:
                    shared = c.shared_experts * (c.moe_ffn or 0)
                    self._mlp(tensors, weights, f"{m}mlp.shared_experts.", f"{h}mlp.shared_experts.", shared, at)
            else:
                self._mlp(tensors, weights, f"{m}mlp.", f"{h}mlp.", c.ffn, at)
        add("model.norm.weight", (hidden,), "decoder.final_layernorm.weight", stage=("last",))
        if not c.tied_embeddings:
            tensors.append(TensorSpec("lm_head.weight", (vocab, hidden), dtype, stage=("last",)))
            weights.link("lm_head.weight", rows((vocab, hidden), 0, vocab), "output_layer.weight",
                         rows((c.vocab, hidden), 0, vocab))  # fmt: skip
        kind = "hf-stacked" if stacked else "hf"
        targets = Manifest(tuple(tensors), layers=c.layers, name=f"{self.name} ({kind})")
        return targets, WeightMap.filled(source, targets, weights.fills, name=f"megatron -> {kind}")

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
        weights: MapBuilder,
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
            weights.fill(name, (fc1,), ("fc1", block, ffn, hidden), partial(_fc1_block, block, ffn, hidden))
        tensors.append(TensorSpec(f"{h}down_proj.weight", (hidden, ffn), dtype, **at))
        weights.fill(f"{h}down_proj.weight", (fc2,), ("fc2", ffn, hidden), partial(_fc2, ffn, hidden))

    def _experts(self, tensors: list[TensorSpec], weights: MapBuilder, layer: int, stacked: bool) -> None:
        """A MoE layer's routed experts: one MLP per expert, or transformers 5's two stacked tensors, in which
        expert e's ``gate_up_proj[e]`` is its ``linear_fc1`` whole ([gate; up]), ``down_proj[e]`` its ``linear_fc2``."""
        c = self.config
        hidden, ffn, experts = c.hidden, c.moe_ffn or 0, c.experts
        m, h = f"decoder.layers.{layer}.mlp.experts.", f"model.layers.{layer}.mlp.experts."
        at: dict[str, Any] = {"layer": layer}
        if not stacked:
            for e in range(experts):
                self._mlp(tensors, weights, m, f"{h}{e}.", ffn, at, suffix=str(e))
            return
        for name, shape, origin in (
            ("gate_up_proj", (experts, 2 * ffn, hidden), "linear_fc1.weight"),
            ("down_proj", (experts, hidden, ffn), "linear_fc2.weight"),
        ):
            tensors.append(TensorSpec(f"{h}{name}", shape, c.dtype, **at))
            sources = tuple(f"{m}{origin}{e}" for e in range(experts))
            weights.fill(f"{h}{name}", sources, ("stacked", shape), partial(_stacked, shape))

    # -- Hugging Face -> vLLM ------------------------------------------------------------------------

    def vllm(self, tp: int, expt_tp: int) -> tuple[Manifest, WeightMap]:
        """The tensors of a vLLM engine with ``tp`` (and ``expt_tp`` for the experts), laid side by side over
        its ranks, and the map filling them from the HF tensors (the loaders' packing, as boxes).

        Raises:
            ManifestError: heads, kv heads, sizes or the padded vocabulary that do not split over tp.
        """
        key = (tp, expt_tp)
        if key not in self._vllm:
            with gc_paused():
                self._vllm[key] = vllm_tensors(self.hf_manifest, self.config, self.vocab, self.name, tp, expt_tp)
        return self._vllm[key]

    def vllm_from_megatron(self, tp: int, expt_tp: int) -> WeightMap:
        """Megatron's tensors -> a vLLM engine's (``to_hf`` then ``vllm``), made once per (tp, expt_tp).

        Raises:
            ManifestError: as ``vllm``.
        """
        key = (tp, expt_tp)
        if key not in self._from_megatron:
            with gc_paused():
                self._from_megatron[key] = self.to_hf.then(self.vllm(tp, expt_tp)[1])
        return self._from_megatron[key]


def _unfused(
    shape: tuple[int, ...], full: tuple[int, ...], heads: int, skip: int, d: int
) -> Iterator[tuple[Box, Box, int]]:
    """One of q, k, v (``heads`` heads of ``d`` rows per query group, after ``skip`` heads of the group) out of
    Megatron's ``linear_qkv`` (``full``): per query group, its q heads, then its k head, then its v head."""
    span = full[0] // (shape[0] // (heads * d))
    for g in range(shape[0] // (heads * d)):
        start = g * span + skip * d
        yield rows(shape, g * heads * d, (g + 1) * heads * d), rows(full, start, start + heads * d), 0


def _fc1_block(block: int, ffn: int, hidden: int) -> Iterator[tuple[Box, Box, int]]:
    """Gate (``block`` 0) or up (1) out of Megatron's ``linear_fc1`` = [gate; up]."""
    yield whole((ffn, hidden)), rows((2 * ffn, hidden), block * ffn, (block + 1) * ffn), 0


def _fc2(ffn: int, hidden: int) -> Iterator[tuple[Box, Box, int]]:
    """``down_proj``: Megatron's ``linear_fc2`` whole."""
    yield whole((hidden, ffn)), whole((hidden, ffn)), 0


def _stacked(shape: tuple[int, ...]) -> Iterator[tuple[Box, Box, int]]:
    """A stacked experts tensor: expert e's slot is its own tensor (source e) whole."""
    for e in range(shape[0]):
        yield rows(shape, e, e + 1), whole(shape[1:]), e


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


def hf_model_of(model: str | HFModel) -> HFModel:
    """The model ``--model hf:PATH`` names (``manifest_from_hf_config(PATH)``), or ``model`` itself when it is one
    already parsed: a caller that holds the config's contents (vLLM's init info) passes it without a file.

    Args:
        model: ``hf:PATH`` (a ``config.json`` or the folder holding it), or an ``HFModel``.

    Raises:
        ManifestError: ``model`` is neither an ``HFModel`` nor text starting with ``hf:``, or its config is bad.
    """
    if isinstance(model, HFModel):
        return model
    if not isinstance(model, str) or not model.startswith(HF_PREFIX):
        raise ManifestError(
            f"model {shown(model)}: a layout other than megatron needs the model's Hugging Face config: "
            f"--model {HF_PREFIX}PATH/config.json"
        )
    return manifest_from_hf_config(model.removeprefix(HF_PREFIX))


def shard_layouts(
    model: str | HFModel, src: int, dst: Sequence[int], source: str = "megatron", destination: str = "megatron"
) -> dict[int, ModelLayout] | None:
    """``plan_refit``'s ``layouts`` for ``--from-layout`` / ``--to-layout``: ``source``'s for shard ``src``,
    ``destination``'s for every shard of ``dst``; None when both are megatron (no layout to plan through).

    Args:
        model: ``hf:PATH`` or an ``HFModel`` (``hf_model_of``).
        src: The source shard's index.
        dst: The destination shards' indices.
        source: The source's layout (``LAYOUTS``).
        destination: The destinations' layout.

    Raises:
        ManifestError: an unknown layout, or one other than megatron without ``--model hf:PATH``.
    """
    if source == destination == "megatron":
        return None
    hf = hf_model_of(model)
    chosen = {index: hf.layout(destination) for index in dst}
    chosen[src] = hf.layout(source)
    return {index: layout for index, layout in chosen.items() if layout.kind != "megatron"} or None


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
            whose sizes are missing or inconsistent (an MoE family's expert count among them:
            ``hf_config.EXPERT_KEYS``).
    """
    family, transformer, vocab = parse_hf_config(config, vocab_multiple)
    label = name or f"{family}-{transformer.layers}x{transformer.hidden}"
    return HFModel(family, transformer, vocab, label)


__all__ = [
    "HF_PREFIX",
    "LAYOUTS",
    "HFModel",
    "ModelLayout",
    "hf_model_of",
    "manifest_from_hf_config",
    "shard_layouts",
    "sides",
]
