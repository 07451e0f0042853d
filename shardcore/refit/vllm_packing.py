"""vLLM's tensor-parallel packing of a Hugging Face model: the ``vllm`` layout's tensors and how they tile.

Each rank of a vLLM (or SGLang) engine with a shard's tp, pp and ep holds its weights packed as the engine's
weight loaders pack a checkpoint: ``QKVParallelLinear.weight_loader`` (``qkv_proj`` = [its q heads; its
kv heads], kv heads replicated when tp exceeds their count), ``MergedColumnParallelLinear.weight_loader``
(``gate_up_proj`` = [its gate rows; its up rows]), ``RowParallelLinear`` (``o_proj`` / ``down_proj`` split on
dim 1), ``VocabParallelEmbedding`` / ``ParallelLMHead`` (the vocabulary padded to a multiple of 64, then
split over tp; a refit writes the padding rows as zeros, as vLLM's loader does) and ``FusedMoE.weight_loader``
(``mlp.experts.routed_experts.w13_weight [local experts, 2*moe_ffn/tp, hidden]`` = per expert [gate; up],
``w2_weight [local experts, hidden, moe_ffn/tp]``, the experts spread over ep, split over expt_tp; vLLM 0.32
holds them on ``FusedMoE``'s ``routed_experts`` module, ``FUSED_MOE``).

An engine's "global" tensor is its ranks' local tensors laid side by side along the split dims, so its
placement is plain tiling (``engine_placement``) and the packing lies in the weight map from the HF tensors
(``vllm_tensors``): a refit from Megatron goes ``Megatron -> HF`` (``families``) then ``HF -> vLLM``. The
engine's loaders are restated here alone, so that a change of theirs is a change of this module. Only shapes
and index math live here; no weight, no torch.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from typing import Any

from ..errors import ManifestError
from ..plan.layout import ShardPlan
from .boxes import Box
from .manifest import Manifest, TensorSpec, split_layers
from .models import TransformerConfig
from .placement import ExplicitPlacement, HeldBox, Placement
from .weightmap import MapBuilder, WeightMap, rows, whole

VLLM_VOCAB_PADDING = 64
"""vLLM's ``DEFAULT_VOCAB_PADDING_SIZE``: ``VocabParallelEmbedding`` pads the vocabulary to a multiple of it."""

FUSED_MOE = "mlp.experts.routed_experts."
"""Where vLLM's ``FusedMoE`` keeps its stacked experts (``w13_weight``, ``w2_weight``), under a layer's prefix:
vLLM 0.32's ``routed_experts`` submodule (checked against the installed engine in plugins/vllm's tests)."""


def vllm_tensors(
    hf: Manifest, config: TransformerConfig, vocab: int, model_name: str, tp: int, expt_tp: int
) -> tuple[Manifest, WeightMap]:
    """``HFModel.vllm``: a vLLM engine's tensors and the map filling them from ``hf``, the HF tensors of the
    model ``config`` (whose own vocabulary is ``vocab``, unpadded; ``model_name`` labels it in messages).

    Raises:
        ManifestError: as ``HFModel.vllm``.
    """
    return _VllmPacking(hf, config, vocab, model_name, tp, expt_tp).build()


@dataclass
class _VllmPacking:
    """The vLLM tensors of one (tp, expt_tp), built with their links from the HF tensors."""

    hf: Manifest
    config: TransformerConfig
    vocab: int
    model_name: str
    tp: int
    expt_tp: int
    tensors: list[TensorSpec] = field(default_factory=list)
    weights: MapBuilder = field(default_factory=MapBuilder)
    padding: dict[str, tuple[tuple[tuple[int, int], ...], ...]] = field(default_factory=dict)

    def _check(self, what: str, size: int, parts: int, axis: str = "tp") -> int:
        if size % parts:
            raise ManifestError(
                f"vllm layout of {self.model_name!r}: {what} ({size}) does not split over {axis}={parts}: choose a "
                f"{axis} that divides it"
            )
        return size // parts

    def same(self, name: str, **at: Any) -> None:
        """A tensor vLLM holds as the HF model does (whole or split by plain tiling)."""
        shape = self.hf.tensor(name).shape
        self.tensors.append(TensorSpec(name, shape, self.config.dtype, **at))
        self.weights.link(name, whole(shape), name, whole(shape))

    def build(self) -> tuple[Manifest, WeightMap]:
        c, tp, hf = self.config, self.tp, self.hf
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
                    self._gate_up(m, m, "gate_up_proj.weight", shared, **at)
                    self.same(f"{m}down_proj.weight", **at)
            else:
                self._gate_up(f"{h}mlp.", f"{h}mlp.", "gate_up_proj.weight", c.ffn, **at)
                self.same(f"{h}mlp.down_proj.weight", **at)
        self.same("model.norm.weight", stage=("last",))
        if not c.tied_embeddings:
            self._vocab("lm_head.weight", "last")
        targets = Manifest(tuple(self.tensors), layers=c.layers, name=f"{self.model_name} (vllm tp={tp})")
        name = f"hf -> vllm tp={tp}"
        return targets, WeightMap.filled(hf, targets, self.weights.fills, self.padding, name=name, zeroed=True)

    def _vocab(self, name: str, stage: str) -> None:
        """``VocabParallelEmbedding`` / ``ParallelLMHead``: the vocabulary padded to a multiple of 64, split over tp."""
        vocab, hidden = self.vocab, self.config.hidden
        padded = -(-vocab // VLLM_VOCAB_PADDING) * VLLM_VOCAB_PADDING
        if padded % self.tp:
            raise ManifestError(
                f"vllm layout of {self.model_name!r}: {name}: vLLM pads the vocabulary {vocab} to {padded} (a multiple "
                f"of {VLLM_VOCAB_PADDING}), which tp={self.tp} does not split: choose a tp that divides {padded}"
            )
        shape = (padded, hidden)
        self.tensors.append(TensorSpec(name, shape, self.config.dtype, stage=(stage,)))
        self.weights.link(name, rows(shape, 0, vocab), name, whole((vocab, hidden)))
        if padded > vocab:
            self.padding[name] = (rows(shape, vocab, padded),)

    def _mla(self, h: str, **at: Any) -> None:
        """``DeepseekV2MLAAttention``: with q compression, ``fused_qkv_a_proj`` = [q_a_proj; kv_a_proj_with_mqa]
        whole on every rank (a ``MergedColumnParallelLinear`` with tp disabled); ``q_b_proj`` / ``kv_b_proj``
        (``ColumnParallelLinear``: whole heads per rank) and ``o_proj`` split over tp; norms whole."""
        c, a = self.config, f"{h}self_attn."
        self._check("attention heads", c.heads, self.tp)
        if c.q_lora_rank is None:
            self.same(f"{a}q_proj.weight", **at)
            self.same(f"{a}kv_a_proj_with_mqa.weight", **at)
        else:
            parts = [self.hf.tensor(f"{a}{part}.weight").shape for part in ("q_a_proj", "kv_a_proj_with_mqa")]
            shape = (parts[0][0] + parts[1][0], c.hidden)
            self.tensors.append(TensorSpec(f"{a}fused_qkv_a_proj.weight", shape, c.dtype, **at))

            def fused() -> Iterator[tuple[Box, Box, int]]:
                start = 0
                for number, size in enumerate(parts):
                    yield rows(shape, start, start + size[0]), whole(size), number
                    start += size[0]

            sources = (f"{a}q_a_proj.weight", f"{a}kv_a_proj_with_mqa.weight")
            self.weights.fill(f"{a}fused_qkv_a_proj.weight", sources, ("fused_qkv_a", *parts), fused)
            self.same(f"{a}q_a_layernorm.weight", **at)
            self.same(f"{a}q_b_proj.weight", **at)
        self.same(f"{a}kv_a_layernorm.weight", **at)
        self.same(f"{a}kv_b_proj.weight", **at)

    def _qkv(self, h: str, kind: str, **at: Any) -> None:
        """``QKVParallelLinear``: tp rank r holds [its q heads; its k heads; its v heads]; with more ranks than kv
        heads, rank r holds kv head r // (tp / kv heads) (vLLM's ``num_kv_head_replicas``)."""
        c, tp = self.config, self.tp
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
        sources = tuple(f"{h}self_attn.{part}_proj.{kind}" for part in "qkv")
        fulls = tuple(self.hf.tensor(source).shape for source in sources)

        def packed() -> Iterator[tuple[Box, Box, int]]:
            for r in range(tp):
                first_kv = (r // replicas) * kv_heads
                start = r * local
                for part, (heads, first) in enumerate(
                    ((q_heads, r * q_heads), (kv_heads, first_kv), (kv_heads, first_kv))
                ):
                    yield rows(shape, start, start + heads * d), rows(fulls[part], first * d, (first + heads) * d), part
                    start += heads * d

        self.weights.fill(name, sources, ("qkv", shape, fulls, tp, q_heads, kv_heads, replicas, d), packed)

    def _gate_up(self, m: str, h: str, name: str, ffn: int, **at: Any) -> None:
        """``MergedColumnParallelLinear``: tp rank r holds [its gate rows; its up rows]."""
        share, hidden, tp = self._check("ffn", ffn, self.tp), self.config.hidden, self.tp
        sources = (f"{m}gate_proj.weight", f"{m}up_proj.weight")
        self.weights.fill(
            f"{h}{name}", sources, ("gate_up", ffn, hidden, tp), lambda: _packed_gate_up(ffn, hidden, tp, share)
        )
        self.tensors.append(TensorSpec(f"{h}{name}", (2 * ffn, hidden), self.config.dtype, **at))

    def _experts(self, h: str, **at: Any) -> None:
        """``FusedMoE``: ``w13_weight [experts, 2*moe_ffn, hidden]`` with each expt_tp rank's [gate; up] rows side
        by side (its w1 and w3, as ``MergedColumnParallelLinear`` packs them), and ``w2_weight [experts, hidden,
        moe_ffn]`` (= each expert's down_proj, split on dim 2)."""
        c, parts = self.config, self.expt_tp
        ffn, hidden, experts = c.moe_ffn or 0, c.hidden, c.experts
        share = self._check("ffn", ffn, parts, "expt_tp")
        self.tensors.append(TensorSpec(f"{h}{FUSED_MOE}w13_weight", (experts, 2 * ffn, hidden), c.dtype, **at))
        self.tensors.append(TensorSpec(f"{h}{FUSED_MOE}w2_weight", (experts, hidden, ffn), c.dtype, **at))
        m = f"{h}mlp.experts."
        gate_up = tuple(f"{m}{e}.{part}_proj.weight" for e in range(experts) for part in ("gate", "up"))

        def w13() -> Iterator[tuple[Box, Box, int]]:
            links = _packed_gate_up(ffn, hidden, parts, share)
            for e in range(experts):
                for box, origin, part in links:
                    yield ((e, e + 1), *box), origin, 2 * e + part

        self.weights.fill(f"{h}{FUSED_MOE}w13_weight", gate_up, ("w13", experts, ffn, hidden, parts), w13)
        down = tuple(f"{m}{e}.down_proj.weight" for e in range(experts))
        self.weights.fill(
            f"{h}{FUSED_MOE}w2_weight",
            down,
            ("w2", experts, hidden, ffn),
            lambda: [(((e, e + 1), (0, hidden), (0, ffn)), whole((hidden, ffn)), e) for e in range(experts)],
        )


def _packed_gate_up(ffn: int, hidden: int, parts: int, share: int) -> list[tuple[Box, Box, int]]:
    """A gate and up projection ([ffn, hidden] each) packed over ``parts`` ranks, each holding [its ``share`` of gate
    rows; its share of up rows]: (box of the packed tensor, box of the projection, 0 for gate or 1 for up) per link."""
    return [
        (
            (((2 * r + block) * share, (2 * r + block + 1) * share), (0, hidden)),
            rows((ffn, hidden), r * share, (r + 1) * share),
            block,
        )
        for r in range(parts)
        for block in (0, 1)
    ]


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


__all__ = ["FUSED_MOE", "VLLM_VOCAB_PADDING", "engine_placement", "vllm_tensors"]
