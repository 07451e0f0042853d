"""A model manifest: every tensor's global shape, element size, and how it lies on a shard.

No model is instantiated: a manifest is the few facts per tensor that, together with a
``ShardPlan``, say which global box of it every rank holds (``shardcore.refit.placement``).
The conventions are Megatron-Core's GPT ones (column-parallel weights split dim 0,
row-parallel dim 1, SwiGLU's gate+up as two packed blocks, experts spread over ep).
"""

from __future__ import annotations

import hashlib
from array import array
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field, replace
from functools import cached_property, lru_cache
from math import prod
from operator import attrgetter
from typing import Any, TypeGuard

from ..errors import ManifestError
from ..plan.arguments import check_count, count_problem, shown

ITEMSIZES: dict[str, int] = {
    "float64": 8,
    "float32": 4,
    "float16": 2,
    "bfloat16": 2,
    "float8_e4m3fn": 1,
    "float8_e5m2": 1,
    "float8_e4m3fnuz": 1,
    "float8_e5m2fnuz": 1,
    "float8_e8m0fnu": 1,
    "complex128": 16,
    "complex64": 8,
    "int64": 8,
    "int32": 4,
    "int16": 2,
    "int8": 1,
    "uint64": 8,
    "uint32": 4,
    "uint16": 2,
    "uint8": 1,
    "bool": 1,
}
"""Element size in bytes of each supported dtype, named as torch names it (``torch.bfloat16`` -> "bfloat16")."""

CONVERTIBLE = (
    "float64",
    "float32",
    "float16",
    "bfloat16",
    "float8_e4m3fn",
    "float8_e5m2",
    "float8_e4m3fnuz",
    "float8_e5m2fnuz",
)
"""The dtypes a refit converts between (real floating values; ``float8_e8m0fnu`` is a scale format, not one)."""

SCALED = "float8_e4m3fn"
"""The destination dtype that carries scales (DeepSeek-V3's fp8 weights): ``<name>_scale_inv`` beside the weight."""

QUANTIZED = tuple(dtype for dtype in CONVERTIBLE if ITEMSIZES[dtype] == 1)
"""The 8-bit floating dtypes: a model-wide conversion to one of them (``Manifest.converted``) quantizes the linear
layers' weights only (``TensorSpec.linear``); a wider dtype converts every floating tensor."""

NOT_LINEAR = (
    "word_embeddings.weight",
    "position_embeddings.weight",
    "output_layer.weight",
    "router.weight",
    "embed_tokens.weight",
    "lm_head.weight",
    "mlp.gate.weight",
)
"""Ends of the names (after a dot, or the whole name) of the matrices that are not a linear layer's weight, so a
model-wide fp8 conversion leaves them in their dtype: the embeddings, the output head and the MoE router, by
Megatron-Core's names (``models.manifest_from_config``), Hugging Face's (``families``) and vLLM's
(``vllm_packing``). Transformer Engine's fp8 parameters and vLLM's fp8 (online, and the block-quantized
checkpoints of DeepSeek-V3 and Qwen3) quantize only the weights of linear layers: the router is a linear layer
vLLM builds unquantized, and the vocabulary-parallel embedding and head are not linear layers there."""

SCALES = ("block", "tensor")
"""How a ``float8_e4m3fn`` destination is scaled: one float32 per 128x128 block (the default, DeepSeek-V3's
``weight_block_size = [128, 128]``), or one for the whole tensor."""

SCALE_BLOCK = 128
"""Elements per dim of one scaling block, along a tensor's blocked dims (``blocked_from``)."""

STAGES = ("first", "last", "all")
"""Pipeline placements that are not a decoder layer: the first stage, the last, or every stage."""


MAX_ELEMENTS = 1 << 48
"""Largest size of a tensor, and so of any of its dims or blocks, in elements: past any device's
memory, and small enough that every offset and byte count fits torch's int64."""
_LONG_NAME = 100
"""Tensor names longer than this (Megatron's are under 80 characters) are shown shortened in messages."""

_NORMALIZED = ("shape", "itemsize", "blocks", "stage", "to_dtype", "scale")
"""The fields of a TensorSpec that its checks set (normalized, or derived: itemsize)."""
_SHARED_FIELDS = attrgetter("shape", "dtype", "tp_dim", "blocks", "unit", "stage", "to_dtype", "scale")
"""The fields of a tensor that its file form writes (``TensorSpec.to_dict``) but its name, layer and expert: the
same weight of every layer shares them, so a manifest's digest numbers their few distinct values."""
_CHECKED: dict[tuple[object, ...], dict[str, Any]] = {}
"""The checked and normalized fields (``_NORMALIZED``) of a TensorSpec, by what its checks read but its name, layer
and expert (``TensorSpec._alike_key``): DeepSeek-V3's manifests make some 76,000 specs per plan that differ only in
those three, and formatting each one's message labels to check the rest again took about a second. Only specs that
passed are kept."""
_CHECKED_MAX = 4096
"""Past this many kinds of spec ``_CHECKED`` starts again, so a process that builds many models holds a few MB for it
at most; one model has a few dozen kinds (DeepSeek-V3's Megatron and HF layouts: 25)."""
_LISTS = (tuple, list)
_INT = {int}
_STR = {str}
_INT_OR_NONE = (int, type(None))
_STR_OR_NONE = (str, type(None))


def tensor_label(name: str) -> str:
    """A tensor's name as messages show it: as given when short and printable, else quoted and bounded."""
    return name if len(name) <= _LONG_NAME and name.isprintable() else shown(name)


def check_dtype(what: str, dtype: object) -> str:
    """``dtype`` if it is one of ITEMSIZES (torch's names).

    Raises:
        ManifestError: naming ``what``, the value and the accepted names.
    """
    if not isinstance(dtype, str) or dtype not in ITEMSIZES:
        raise ManifestError(f"{what}={shown(dtype)}: expected one of {', '.join(ITEMSIZES)}")
    return dtype


def _is_list(value: object) -> TypeGuard[Sequence[Any]]:
    """A list, a tuple or another sequence that is not text."""
    return type(value) in (list, tuple) or (isinstance(value, Sequence) and not isinstance(value, (str, bytes)))


def _sizes(what: str, value: object, example: str) -> tuple[int, ...]:
    """A list (or tuple) of sizes, each a whole number from 1 to MAX_ELEMENTS."""
    if not _is_list(value):
        raise ManifestError(f"{what}={shown(value)}: expected a list of positive integers, e.g. {example}")
    return tuple(check_count(f"{what} entry", size, maximum=MAX_ELEMENTS, error=ManifestError) for size in value)


@dataclass(frozen=True)
class TensorSpec:
    """One tensor of the model, in global coordinates.

    Args:
        name: The parameter name (Megatron's, with global layer and expert numbers).
        shape: The global (unsharded) shape.
        dtype: torch's dtype name, e.g. "bfloat16"; sets ``itemsize``.
        tp_dim: The dim split over tp (expt_tp for an expert), or None when every tp rank holds it whole.
        blocks: Sizes of the packed blocks along ``tp_dim`` (sum = ``shape[tp_dim]``); each block is
            split over tp on its own and a tp rank holds its slices of all blocks, concatenated.
            Defaults to one block.
        unit: Each block is cut only at multiples of this many elements of ``tp_dim``, e.g. one
            query group's rows of ``linear_qkv`` or one head's columns of ``linear_proj``.
        layer: Global decoder layer index: the tensor sits on the pipeline stage of that layer.
        stage: Otherwise, the stages holding it: ("first",), ("last",), ("first", "last") for a tied
            embedding, or ("all",).
        expert: Global expert index for an expert tensor (needs ``layer``): it lives on the expert
            grid, owned by one ep rank, split over expt_tp and replicated over expt_dp.
        to_dtype: The destination's dtype when it differs from ``dtype`` (a converting refit, between
            floating dtypes: ``CONVERTIBLE``); None keeps ``dtype``.
        scale: With ``to_dtype="float8_e4m3fn"``: "block" (default) or "tensor" (``SCALES``); the weight
            then brings its scale tensor ``<name>_scale_inv`` into the manifest (``scale_spec``).
        scale_of: Set on a scale tensor only, naming its weight: the manifest derives these itself.

    Raises:
        ManifestError: naming the tensor, for any inconsistent field.
    """

    name: str
    shape: tuple[int, ...]
    dtype: str = "bfloat16"
    tp_dim: int | None = None
    blocks: tuple[int, ...] = ()
    unit: int = 1
    layer: int | None = None
    stage: tuple[str, ...] = ()
    expert: int | None = None
    to_dtype: str | None = None
    scale: str | None = None
    scale_of: str | None = None
    itemsize: int = field(init=False)

    def __post_init__(self) -> None:
        if not isinstance(self.name, str) or not self.name:
            raise ManifestError(f"tensor name {shown(self.name)}: expected a non-empty string")
        key = self._alike_key()
        checked = _CHECKED.get(key) if key is not None else None
        if checked is None:
            self._check_fields()
            if key is not None:
                if len(_CHECKED) >= _CHECKED_MAX:
                    _CHECKED.clear()
                _CHECKED[key] = {attribute: getattr(self, attribute) for attribute in (*_NORMALIZED, "_shared")}
            return
        self.__dict__.update(checked)  # as object.__setattr__ field by field would, in one call
        self._check_indices()

    @cached_property
    def _shared(self) -> str:
        """The fields the same weight of every layer shares (``_SHARED_FIELDS``: all that the file form writes but
        the name, layer and expert), as text: what a manifest's digest numbers (``Manifest._alike``). Made once per
        kind of spec (``_CHECKED`` hands it on with the checked fields), so a digest of tens of thousands of specs
        hashes as many cached texts, not a tuple of eight fields each."""
        return repr(_SHARED_FIELDS(self))

    def _alike_key(self) -> tuple[object, ...] | None:
        """What every check but the name's, the layer's and the expert's reads, as the key of ``_CHECKED``; None
        when a field is not of its plain type (an exact tuple or list of exact ints, str, int or None), whose
        checks then run in full: True == 1 and 2048.0 == 2048 hash and compare alike, so only values of one exact
        type can share a key without letting a bad spec take a good one's result. Of the layer and scale_of, the
        checks read only whether they are None (a layer or a stage; a scale tensor's dtypes)."""
        shape, blocks, stage = self.shape, self.blocks, self.stage
        if type(stage) is str:
            stage = (stage,)
        if not (
            type(shape) in _LISTS
            and type(blocks) in _LISTS
            and type(stage) in _LISTS
            and set(map(type, shape)) <= _INT
            and (not blocks or set(map(type, blocks)) <= _INT)
            and (not stage or set(map(type, stage)) <= _STR)
            and type(self.dtype) is str
            and type(self.unit) is int
            and type(self.tp_dim) in _INT_OR_NONE
            and type(self.to_dtype) in _STR_OR_NONE
            and type(self.scale) in _STR_OR_NONE
            and type(self.scale_of) in _STR_OR_NONE
        ):
            return None
        return (
            tuple(shape),
            self.dtype,
            self.tp_dim,
            tuple(blocks),
            self.unit,
            tuple(stage),
            self.to_dtype,
            self.scale,
            self.scale_of is None,
            self.layer is None,
        )

    @property
    def _label(self) -> str:
        """The tensor as its messages name it."""
        return f"tensor {tensor_label(self.name)}"

    def _check_fields(self) -> None:
        """Every check but the name's, normalizing shape, blocks, stage, to_dtype and scale and setting itemsize."""
        label = self._label
        shape = _sizes(f"{label}: shape", self.shape, "[4096, 1024]")
        if not shape:
            raise ManifestError(f"{label}: shape=[]: expected a non-empty list of positive integers")
        numel = 1
        for size in shape:  # stops at the limit: the product of a million dims is not computed
            numel *= size
            if numel > MAX_ELEMENTS:
                raise ManifestError(
                    f"{label} {shown(list(shape))}: over {MAX_ELEMENTS} elements, shardcore's limit for a "
                    "tensor: check the shape"
                )
        object.__setattr__(self, "shape", shape)
        object.__setattr__(self, "itemsize", ITEMSIZES[check_dtype(f"{label}: dtype", self.dtype)])
        self._check_split(label, shape)
        self._check_placement(label)
        self._check_conversion(label)

    def _check_split(self, label: str, shape: tuple[int, ...]) -> None:
        check_count(f"{label}: unit", self.unit, maximum=MAX_ELEMENTS, error=ManifestError)
        blocks = _sizes(f"{label}: blocks", self.blocks, "[4096, 4096] (gate and up)")
        if self.tp_dim is None:
            if blocks or self.unit != 1:
                raise ManifestError(f"{label}: blocks and unit need a tp_dim (the dim split over tp)")
            object.__setattr__(self, "blocks", ())
            return
        tp_dim = check_count(f"{label}: tp_dim", self.tp_dim, minimum=0, error=ManifestError)
        if tp_dim >= len(shape):
            raise ManifestError(
                f"{label} {shown(list(shape))}: tp_dim={tp_dim} is not a dim of a {len(shape)}-d tensor"
            )
        blocks = blocks or (shape[tp_dim],)
        if sum(blocks) != shape[tp_dim]:
            raise ManifestError(
                f"{label} {shown(list(shape))}: blocks {shown(list(blocks))} sum to {shown(sum(blocks))}, "
                f"not to dim {tp_dim}'s size {shape[tp_dim]}"
            )
        object.__setattr__(self, "blocks", blocks)

    def _check_placement(self, label: str) -> None:
        stage = (self.stage,) if isinstance(self.stage, str) else self.stage
        if (
            not _is_list(stage)
            or not all(isinstance(s, str) for s in stage)
            or not set(stage) <= set(STAGES)
            or len(set(stage)) != len(stage)
            or ("all" in stage and len(stage) > 1)
        ):
            raise ManifestError(f"{label}: stage={shown(self.stage)}: expected first, last, [first, last] or all")
        object.__setattr__(self, "stage", tuple(stage))
        if (self.layer is None) == (not stage):
            raise ManifestError(
                f"{label}: give exactly one of layer (a global decoder layer index) or stage "
                f"(first, last, [first, last] for a tied embedding, or all)"
            )
        self._check_indices()

    def _check_indices(self) -> None:
        """The layer and the expert: whole numbers from 0, an expert's with its layer. Run for every spec, as they
        differ between specs alike otherwise (``_CHECKED``), so the label is formatted only for a message."""
        for what, index in (("layer", self.layer), ("expert", self.expert)):
            if index is not None and count_problem(index, minimum=0) is not None:
                check_count(f"{self._label}: {what}", index, minimum=0, error=ManifestError)
        if self.expert is not None and self.layer is None:
            raise ManifestError(f"{self._label}: an expert tensor needs the layer it belongs to")

    def _check_conversion(self, label: str) -> None:
        to_dtype = None if self.to_dtype == self.dtype else self.to_dtype
        object.__setattr__(self, "to_dtype", to_dtype)
        if to_dtype is not None:
            if not isinstance(to_dtype, str) or to_dtype not in ITEMSIZES:
                raise ManifestError(
                    f"{label}: to_dtype {shown(to_dtype)} is not a dtype: choose one of {', '.join(CONVERTIBLE)}"
                )
            if self.dtype not in CONVERTIBLE or to_dtype not in CONVERTIBLE:
                raise ManifestError(
                    f"{label}: cannot convert {self.dtype} to {to_dtype}: a refit converts only between "
                    f"{', '.join(CONVERTIBLE)}; drop its to_dtype"
                )
        if to_dtype != SCALED:
            if self.scale is not None:
                raise ManifestError(
                    f"{label}: scale={shown(self.scale)} needs to_dtype {SCALED} (the dtype that carries scales)"
                )
        else:
            object.__setattr__(self, "scale", "block" if self.scale is None else self.scale)
            if self.scale not in SCALES:
                raise ManifestError(f"{label}: scale {shown(self.scale)} is not one of {', '.join(SCALES)}")
            blocked = self.tp_dim is not None and self.tp_dim >= blocked_from(len(self.shape))
            cut = self.blocks[:-1] if blocked and self.scale == "block" else ()
            if any(size % SCALE_BLOCK for size in cut):
                raise ManifestError(
                    f"{label} {shown(list(self.shape))}: packed blocks {shown(list(self.blocks))} must be multiples of "
                    f"{SCALE_BLOCK} (all but the last) for block scales, or a scale block would mix two of them; "
                    f"give it scale: tensor (--scale tensor)"
                )
        if self.scale_of is not None and not isinstance(self.scale_of, str):
            raise ManifestError(f"{label}: scale_of={shown(self.scale_of)}: expected the name of its weight")
        if self.scale_of is not None and (self.dtype != "float32" or to_dtype is not None):
            raise ManifestError(f"{label}: a scale tensor (scale_of={shown(self.scale_of)}) is float32 both sides")

    @property
    def linear(self) -> bool:
        """Whether it is a linear layer's weight, which a model-wide fp8 conversion quantizes: a matrix (or a stack
        of them: experts) whose name does not end in one of ``NOT_LINEAR``. Norms and biases (1-d), embeddings, the
        output head and the router are not. Read off the name and shape, so a manifest file needs no field for it;
        its per-tensor ``to_dtype`` decides a tensor the rule gets wrong."""
        return len(self.shape) >= 2 and not any(self.name == end or self.name.endswith(f".{end}") for end in NOT_LINEAR)

    def converts_by_default(self, to_dtype: str) -> bool:
        """Whether a model-wide conversion to ``to_dtype`` converts it (``Manifest.converted``, ``--to-dtype``, a
        manifest file's top-level ``to_dtype``): a floating tensor, and for an 8-bit float (``QUANTIZED``) a linear
        layer's weight (``linear``)."""
        return self.dtype in CONVERTIBLE and (to_dtype not in QUANTIZED or self.linear)

    @property
    def destination_dtype(self) -> str:
        """The dtype a destination holds it in."""
        return self.to_dtype or self.dtype

    @property
    def wire_dtype(self) -> str:
        """The dtype its bytes travel in: the narrower of the two (the destination's when they are as wide), so
        the sender casts when that narrows and the receiver when the destination is wider."""
        destination = self.destination_dtype
        return destination if ITEMSIZES[destination] <= self.itemsize else self.dtype

    @property
    def wire_itemsize(self) -> int:
        """Bytes per element on the wire (what the plan's transfers and the cost model count)."""
        return ITEMSIZES[self.wire_dtype]

    def scale_spec(self) -> TensorSpec | None:
        """Its scale tensor, placed like it (same stage, expert and split dim), or None when it has none.

        ``<name>_scale_inv``, float32: shape [1] for a per-tensor scale; per block, ``scale_shape`` (one value per
        128 elements of each blocked dim, rounded up; a stacked tensor's leading dims as they are), and along a
        blocked split dim one block of scales per packed block.
        """
        if self.scale is None:
            return None
        if self.scale == "tensor":
            shape: tuple[int, ...] = (1,)
            split: dict[str, Any] = {"tp_dim": None, "blocks": (), "unit": 1}
        else:
            shape = scale_shape(self.shape)
            split = {"tp_dim": self.tp_dim, "blocks": (), "unit": 1}
            if self.tp_dim is not None and len(self.blocks) > 1:
                blocked = self.tp_dim >= blocked_from(len(self.shape))
                split["blocks"] = tuple(-(-size // SCALE_BLOCK) if blocked else size for size in self.blocks)
        return replace(
            self,
            name=f"{self.name}_scale_inv",
            shape=shape,
            dtype="float32",
            to_dtype=None,
            scale=None,
            scale_of=self.name,
            **split,
        )

    @property
    def numel(self) -> int:
        """Elements of the global tensor."""
        return prod(self.shape)

    @property
    def nbytes(self) -> int:
        """Bytes of the global tensor."""
        return self.numel * self.itemsize

    def to_dict(self) -> dict[str, Any]:
        """The manifest-file form; fields left at their default are omitted."""
        out: dict[str, Any] = {"name": self.name, "shape": list(self.shape), "dtype": self.dtype}
        if self.tp_dim is not None:
            out["tp_dim"] = self.tp_dim
            if len(self.blocks) > 1:
                out["blocks"] = list(self.blocks)
            if self.unit != 1:
                out["unit"] = self.unit
        if self.layer is not None:
            out["layer"] = self.layer
        else:
            out["stage"] = self.stage[0] if len(self.stage) == 1 else list(self.stage)
        if self.expert is not None:
            out["expert"] = self.expert
        if self.to_dtype is not None:
            out["to_dtype"] = self.to_dtype
        if self.scale is not None:
            out["scale"] = self.scale
        return out


@dataclass(frozen=True)
class Manifest:
    """Every tensor of a model plus the model-wide facts its placement needs.

    Args:
        tensors: The tensors, in a fixed order (the plan's order).
        layers: Number of decoder layers (every ``layer`` is below it).
        first_stage_layers: Layers on the first pipeline stage (Megatron's
            ``decoder_first_pipeline_num_layers``); None for the even split.
        last_stage_layers: Layers on the last stage (``decoder_last_pipeline_num_layers``).
        experts: Experts per MoE layer (every ``expert`` is below it); 0 for a dense model.
        name: A label for tables.

    A tensor converted to ``float8_e4m3fn`` brings its scale tensor (``TensorSpec.scale_spec``): the
    manifest appends each one after the given tensors (a given one must equal it), so ``tensors`` holds
    every tensor a refit moves.

    Raises:
        ManifestError: duplicate names, or a layer / expert index out of range.
    """

    tensors: tuple[TensorSpec, ...]
    layers: int = 0
    first_stage_layers: int | None = None
    last_stage_layers: int | None = None
    experts: int = 0
    name: str = "model"
    _index: dict[str, int] = field(init=False, repr=False, compare=False)
    _by_layer: dict[int, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _by_expert: dict[tuple[int, int], tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _by_stage: dict[str, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    scale_positions: frozenset[int] = field(init=False, repr=False, compare=False)
    """The positions of the fp8 scale tensors (``TensorSpec.scale_of``), found with the rest: a plan's runs and
    stats ask of every tile."""
    _digest: str = field(init=False, repr=False, compare=False, default="")
    alike_numbers: tuple[int, ...] = field(init=False, repr=False, compare=False)
    """Per position, the number of its tensor's fields but name, layer and expert (``TensorSpec._shared``) among the
    manifest's distinct ones, numbered as first met: the same weight of every layer shares it. Found with the rest,
    while each tensor is at hand, so a rank's part compares a layer's weights with another's as a column of ints,
    without reading tens of thousands of specs again."""
    _alike_texts: list[str] = field(init=False, repr=False, compare=False)
    """Those distinct fields, by number."""
    ordered_names: tuple[str, ...] = field(init=False, repr=False, compare=False)
    """Every tensor's name, by position."""

    def __post_init__(self) -> None:
        if isinstance(self.tensors, (str, bytes, Mapping)) or not isinstance(self.tensors, Iterable):
            raise ManifestError(f"tensors={shown(self.tensors)}: expected a list of TensorSpec")
        object.__setattr__(self, "tensors", _with_scales(tuple(self.tensors)))
        if not isinstance(self.name, str) or not self.name:
            raise ManifestError(f"manifest name={shown(self.name)}: expected a non-empty string")
        check_count("layers", self.layers, minimum=0, error=ManifestError)
        check_count("experts", self.experts, minimum=0, error=ManifestError)
        for key in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, key) is not None:
                check_count(key, getattr(self, key), minimum=0, error=ManifestError)
        if not self.tensors:
            raise ManifestError("the manifest has no tensors: list at least one")
        index: dict[str, int] = {}
        by_layer: dict[int, list[int]] = {}
        by_expert: dict[tuple[int, int], list[int]] = {}
        by_stage: dict[str, list[int]] = {s: [] for s in STAGES}
        scales: list[int] = []
        shared: dict[str, int] = {}
        alike: list[int] = []
        for position, tensor in enumerate(self.tensors):
            if not isinstance(tensor, TensorSpec):
                raise ManifestError(f"manifest entry {position} is a {type(tensor).__name__}, not a TensorSpec")
            if tensor.name in index:
                raise ManifestError(
                    f"tensor {tensor_label(tensor.name)} appears twice in the manifest: names must be unique"
                )
            index[tensor.name] = position
            self._check_range(tensor)
            if tensor.expert is not None:
                by_expert.setdefault((tensor.layer, tensor.expert), []).append(position)  # type: ignore[arg-type]
            elif tensor.layer is not None:
                by_layer.setdefault(tensor.layer, []).append(position)
            for stage in tensor.stage:
                by_stage[stage].append(position)
            if tensor.scale_of is not None:
                scales.append(position)
            alike.append(shared.setdefault(tensor._shared, len(shared)))
        object.__setattr__(self, "_index", index)
        object.__setattr__(self, "alike_numbers", tuple(alike))
        object.__setattr__(self, "_alike_texts", list(shared))
        object.__setattr__(self, "ordered_names", tuple(index))
        object.__setattr__(self, "scale_positions", frozenset(scales))
        object.__setattr__(self, "_by_layer", {k: tuple(v) for k, v in by_layer.items()})
        object.__setattr__(self, "_by_expert", {k: tuple(v) for k, v in by_expert.items()})
        object.__setattr__(self, "_by_stage", {k: tuple(v) for k, v in by_stage.items()})

    def _check_range(self, tensor: TensorSpec) -> None:
        """The tensor's layer and expert are inside the model's."""
        for what, index, count, fix in (
            ("layer", tensor.layer, self.layers, "set layers to the model's decoder layer count"),
            ("expert", tensor.expert, self.experts, "set experts to the experts per MoE layer"),
        ):
            if index is not None and index >= count:
                raise ManifestError(
                    f"tensor {tensor_label(tensor.name)}: {what} {index} is outside the model's {count} {what}s: {fix}"
                )

    def __iter__(self) -> Iterator[TensorSpec]:
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)

    def tensor(self, name: str) -> TensorSpec:
        """The tensor called ``name``.

        Raises:
            ManifestError: no such tensor.
        """
        return self.tensors[self.index(name)]

    @property
    def shapes(self) -> Mapping[str, tuple[int, ...]]:
        """Every tensor's global shape by name, looked up when asked: a schedule asks for a few of the tens of
        thousands (``schedule.may_stage``), so none is copied out."""
        return _Shapes(self)

    def index(self, name: str) -> int:
        """Position of tensor ``name`` in the manifest (the plan's tensor order)."""
        position = self._index.get(name) if isinstance(name, str) else None
        if position is None:
            raise ManifestError(f"no tensor named {shown(name)} in manifest {shown(self.name)}")
        return position

    def positions(self, names: Iterable[str]) -> tuple[int, ...]:
        """The position of each of ``names`` (``index``), at a dict lookup each: a weight map finds a quarter
        million.

        Raises:
            ManifestError: a name that is not a tensor's (naming the first).
        """
        index = self._index
        try:
            return tuple([index[name] for name in names])
        except (KeyError, TypeError):
            return tuple(map(self.index, names))

    @cached_property
    def nbytes(self) -> int:
        """Bytes of the whole model (each tensor once, in its source dtype; scale tensors are derived, not counted),
        from the distinct fields of its tensors (``_alike``): a tensor's bytes are its shape's and dtype's."""
        given, numbers, _ = self._alike
        alike = dict(zip(numbers, given))  # a tensor of each distinct fields
        return sum(alike[number].nbytes * count for number, count in Counter(numbers).items())

    @cached_property
    def _alike(self) -> tuple[list[TensorSpec], Sequence[int], list[str]]:
        """The given tensors (the derived scale tensors left out), each one's number in the table of the distinct
        fields they have but name, layer and expert (``alike_numbers``, numbered among the given tensors alone), and
        that table. What ``digest`` and ``nbytes`` read, made once."""
        if not self.scale_positions:
            return list(self.tensors), self.alike_numbers, self._alike_texts
        kept = [position for position in range(len(self.tensors)) if position not in self.scale_positions]
        renumbered: dict[int, int] = {}
        numbers = [renumbered.setdefault(self.alike_numbers[position], len(renumbered)) for position in kept]
        return [self.tensors[position] for position in kept], numbers, [self._alike_texts[n] for n in renumbered]

    @cached_property
    def converting(self) -> frozenset[str]:
        """The tensors whose dtype a refit converts on the way (``to_dtype`` set), found once: every refit asks
        (what it stages, never lands in place), and a model can hold tens of thousands of tensors."""
        return frozenset(tensor.name for tensor in self.tensors if tensor.to_dtype is not None)

    @cached_property
    def names(self) -> frozenset[str]:
        """Every tensor's name, found once (a delta refit may stage a message of any of them)."""
        return frozenset(self._index)

    @property
    def converts(self) -> bool:
        """Whether a refit of this model converts any tensor's dtype."""
        return bool(self.converting)

    def as_held(self) -> Manifest:
        """This model as its ranks hold it: every tensor in its own dtype, no conversion and no scale tensor
        (what a restore moves: the survivors' weights, unchanged)."""
        if not self.converts:
            return self
        held = tuple(replace(t, to_dtype=None, scale=None) for t in self.tensors if t.scale_of is None)
        return replace(self, tensors=held)

    def converted(self, to_dtype: str, scale: str | None = None) -> Manifest:
        """This model with its destination dtype set to ``to_dtype`` (``--to-dtype``): for a cast (16 bits or
        wider) on every floating tensor; for an 8-bit float (``QUANTIZED``: ``float8_e4m3fn`` with its scales) on
        the linear layers' weights only (``TensorSpec.linear``), as Transformer Engine and vLLM quantize a model:
        norms, biases, embeddings, the output head and the router keep their dtype (and their own ``to_dtype``).

        Args:
            to_dtype: A dtype of ``CONVERTIBLE``, torch's name.
            scale: For ``float8_e4m3fn``: "block" (the default) or "tensor".

        Raises:
            ManifestError: an unknown dtype, one that does not convert, or a scale the tensors cannot take,
                naming the tensor and the fix.
        """
        check_conversion(to_dtype, scale)
        given = tuple(
            replace(tensor, to_dtype=to_dtype, scale=None if tensor.dtype == to_dtype else scale)
            if tensor.converts_by_default(to_dtype)
            else tensor
            for tensor in self.tensors
            if tensor.scale_of is None
        )
        return replace(self, tensors=given)

    def stage_layers(self, pp: int) -> tuple[range, ...]:
        """Each pipeline stage's global layer range under ``pp`` stages (see ``split_layers``)."""
        return split_layers(self.layers, pp, self.first_stage_layers, self.last_stage_layers)

    def on_stage(self, stage: int, pp: int, experts: range = range(0)) -> Iterator[int]:
        """Positions of the tensors a stage holds: its layers' dense tensors, the experts in
        ``experts`` of those layers, and the first/last/all-stage tensors; each once, ascending.

        Costs what the stage holds, not the whole manifest.
        """
        placed = list(self._by_stage["all"])
        if stage == 0:
            placed += self._by_stage["first"]
        if stage == pp - 1:
            placed += self._by_stage["last"]
        for layer in self.stage_layers(pp)[stage]:
            placed += self._by_layer.get(layer, ())
            for expert in experts:
                placed += self._by_expert.get((layer, expert), ())
        return iter(sorted(set(placed)))

    def digest(self) -> str:
        """A short digest that equal manifests share: ranks compare it before a refit moves a byte, in every rank's
        first refit of a plan. Made once, of the fields ``to_dict`` writes (the derived scale tensors left out): the
        names, layers and experts as columns, the other fields as a number per tensor and their few distinct values
        (``_SHARED_FIELDS``), so DeepSeek-V3's 30,428 tensors cost about as many list items, not a dict and its JSON
        text each (25 ms, against 0.1 s before); the names and numbers as bytes (``hash_names``), not as text."""
        if not self._digest:
            given, numbers, table = self._alike
            model = (self.name, self.layers, self.first_stage_layers, self.last_stage_layers, self.experts)
            found = hashlib.sha256(repr((model, table, [t.layer for t in given], [t.expert for t in given])).encode())
            hash_names(found.update, [t.name for t in given])
            found.update(array("q", numbers).tobytes())
            object.__setattr__(self, "_digest", found.hexdigest()[:16])
        return self._digest

    def to_dict(self) -> dict[str, Any]:
        """The manifest-file form (see ``docs/refit.md``, "The manifest"); ``manifest_from_dict`` inverts it."""
        out: dict[str, Any] = {"name": self.name, "layers": self.layers}
        for key in ("first_stage_layers", "last_stage_layers"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        if self.experts:
            out["experts"] = self.experts
        out["tensors"] = [tensor.to_dict() for tensor in self.tensors if tensor.scale_of is None]
        return out


def hash_names(update: Callable[[bytes], object], names: Sequence[str]) -> None:
    """Put ``names`` into a hash (``update``: a ``hashlib`` object's) as one byte string and their lengths: tens of
    thousands of names cost a join, not a quoted text each as ``repr`` makes. Any string may be a name, so the
    lengths tell where each ends, and a lone surrogate is encoded as it is."""
    update(array("q", map(len, names)).tobytes())
    update("".join(names).encode("utf-8", "surrogatepass"))


def blocked_from(ndim: int) -> int:
    """The first of the dims a block scale covers in a tensor of ``ndim`` dims: its last two (its one dim when
    1-d). The dims before them are batch: a stacked tensor (vLLM's ``w13_weight [experts, 2*ffn, hidden]``) is
    one matrix per expert, each with blocks of its own, as vLLM's block-quantized ``FusedMoE`` scales it
    (``w13_weight_scale_inv [experts, 2*ffn/128, hidden/128]``); no block spans two experts."""
    return max(0, ndim - 2)


def scale_shape(shape: tuple[int, ...]) -> tuple[int, ...]:
    """The shape of the block scales of a tensor (or of a rank's local tensor) of ``shape``: one float32 per
    128 elements of each blocked dim (``blocked_from``), rounded up (a block cut by the tensor's end covers what
    there is of it); the batch dims before them as they are."""
    first = blocked_from(len(shape))
    return tuple(shape[:first]) + tuple(-(-size // SCALE_BLOCK) for size in shape[first:])


def check_conversion(to_dtype: object, scale: object) -> None:
    """That ``to_dtype`` and ``scale`` make a model-wide conversion (``Manifest.converted``, a file's defaults).

    Raises:
        ManifestError: an unknown dtype or one that does not convert, or a scale without float8_e4m3fn.
    """
    if scale is not None and to_dtype != SCALED:
        raise ManifestError(f"scale={shown(scale)} needs to_dtype {SCALED} (the dtype that carries scales)")
    if to_dtype not in CONVERTIBLE:
        known = isinstance(to_dtype, str) and to_dtype in ITEMSIZES
        what = "is not a floating dtype a refit converts to" if known else "is not a dtype"
        raise ManifestError(f"to_dtype {shown(to_dtype)} {what}: choose one of {', '.join(CONVERTIBLE)}")
    if scale is not None and scale not in SCALES:
        raise ManifestError(f"scale {shown(scale)} is not one of {', '.join(SCALES)}")


def _with_scales(tensors: tuple[TensorSpec, ...]) -> tuple[TensorSpec, ...]:
    """The given tensors, then the scale tensor of every fp8 weight that is not among them already.

    Raises:
        ManifestError: a given scale tensor that is not its weight's, or one whose weight has none, or a
            tensor that takes a scale tensor's name.
    """
    given = {tensor.name: tensor for tensor in tensors if isinstance(tensor, TensorSpec)}
    derived = {}
    for tensor in given.values():
        spec = tensor.scale_spec()
        if spec is None:
            continue
        found = given.get(spec.name)
        if found is None:
            derived[spec.name] = spec
        elif found != spec:
            raise ManifestError(
                f"tensor {tensor_label(spec.name)}: that name holds the {tensor.scale} scales of "
                f"{tensor_label(tensor.name)} (to_dtype {tensor.to_dtype}); rename it, or give the scale tensor "
                f"the manifest derives"
            )
    for tensor in given.values():
        if tensor.scale_of is not None and getattr(given.get(tensor.scale_of), "scale", None) is None:
            raise ManifestError(
                f"tensor {tensor_label(tensor.name)}: scale_of={shown(tensor.scale_of)} names no fp8 weight of "
                f"the manifest; scale tensors are derived from a weight with to_dtype {SCALED}"
            )
    return tensors + tuple(derived.values())


@lru_cache(maxsize=256)
def split_layers(layers: int, pp: int, first: int | None = None, last: int | None = None) -> tuple[range, ...]:
    """Megatron's pipeline split: the first and last stages take ``first`` / ``last`` layers when
    given, the other stages an even share of the rest. With pp=1 every layer is on stage 0.

    Raises:
        ManifestError: the layers do not divide as asked, naming the counts and the fix.
    """
    if pp == 1:
        return (range(layers),)
    given = (first is not None) + (last is not None)
    rest = layers - (first or 0) - (last or 0)
    middle = pp - given
    asked = f"{layers} layers over pp={pp}" + "".join(
        f", {key}={value}"
        for key, value in (("first_stage_layers", first), ("last_stage_layers", last))
        if value is not None
    )
    if rest < 0 or (middle == 0 and rest) or (middle and rest % middle):
        fix = (
            "make the layer count divisible by pp or set first_stage_layers/last_stage_layers"
            if not given
            else f"choose first/last stage counts that leave a multiple of {middle} layers for the other stages"
            if middle
            else "with pp=2 the first and last stage counts must add up to the layers"
        )
        raise ManifestError(f"{asked} do not split evenly: {fix}")
    share = rest // middle if middle else 0
    counts = [share] * pp
    if first is not None:
        counts[0] = first
    if last is not None:
        counts[-1] = last
    stages, start = [], 0
    for count in counts:
        stages.append(range(start, start + count))
        start += count
    return tuple(stages)


class _Shapes(Mapping[str, "tuple[int, ...]"]):
    """``Manifest.shapes``: a manifest's global shapes by tensor name, read from its tensors."""

    __slots__ = ("_manifest",)

    def __init__(self, manifest: Manifest) -> None:
        self._manifest = manifest

    def __getitem__(self, name: str) -> tuple[int, ...]:
        position = self._manifest._index.get(name)
        if position is None:
            raise KeyError(name)
        return self._manifest.tensors[position].shape

    def __iter__(self) -> Iterator[str]:
        return (tensor.name for tensor in self._manifest.tensors)

    def __len__(self) -> int:
        return len(self._manifest.tensors)


__all__ = [
    "CONVERTIBLE",
    "ITEMSIZES",
    "MAX_ELEMENTS",
    "NOT_LINEAR",
    "QUANTIZED",
    "SCALED",
    "SCALES",
    "SCALE_BLOCK",
    "STAGES",
    "Manifest",
    "TensorSpec",
    "blocked_from",
    "check_conversion",
    "check_dtype",
    "hash_names",
    "scale_shape",
    "split_layers",
    "tensor_label",
]
