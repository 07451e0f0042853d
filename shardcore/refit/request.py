"""A refit between shards, described by value (``RefitRequest``): the one place its plan is built.

``shardcore refit`` (and ``--check``), the live check's workers and the tests describe the refit they run with
one request: the parent builds it from the flags and plans it once (every bad input fails there, before a
process starts), then hands it to every worker, which plans the same refit from it again. Picklable and
torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass, replace

from ..errors import ManifestError, RefitError
from ..plan.arguments import shown
from ..plan.layout import DEFAULT_ORDER, Layout, ShardPlan, plan_layout
from .documents import model_manifest
from .families import HF_PREFIX, HFModel, ModelLayout, hf_model_of, shard_layouts
from .manifest import Manifest
from .plan import DEFAULT_MIN_PIECE_BYTES, ShardRefitPlan, tensors_matching
from .planner import plan_refit


@dataclass(frozen=True)
class RefitRequest:
    """What to refit: the layout and its shards, the model, the planner's options, the tensors, the conversion.

    Attributes:
        model: A preset name, a manifest file (JSON/YAML), ``hf:PATH`` (a Hugging Face ``config.json``), a
            ``Manifest``, or an ``HFModel`` (``manifest_from_hf_config``: a config parsed already, from a path
            or from its contents).
        shards: The layout's spec, e.g. ``'tp=4,role=train + tp=2'``.
        src: The source shard's index.
        dst: The destination shards' indices.
        dst_shards: The spec of another layout over the same world whose shards ``dst`` indexes (the
            collocated two-layout case); None: ``dst`` indexes the shards of ``shards``.
        order: How ranks map to coordinates in both layouts.
        allow_idle: Whether ranks after the last shard may stay idle (in both layouts).
        ranks_per_node, min_piece_bytes, fan_out: The planner's options (``plan_refit``).
        tensors: Name patterns of a partial refit (``tensors_matching``); empty: every tensor.
        to_dtype: The model-wide destination dtype (``Manifest.converted``: every floating tensor for a cast, the
            linear layers' weights for fp8), or None for the manifest's own.
        scale: With a ``float8_e4m3fn`` ``to_dtype``: ``block`` (the default) or ``tensor``.
        from_layout / to_layout: How the source / the destinations hold their weights (``families.LAYOUTS``:
            ``megatron``, ``hf``, ``hf-stacked``, ``vllm``); another than megatron needs ``model`` = ``hf:PATH``
            or an ``HFModel``.
    """

    model: str | Manifest | HFModel
    shards: str
    src: int
    dst: tuple[int, ...]
    dst_shards: str | None = None
    order: str = DEFAULT_ORDER
    allow_idle: bool = False
    ranks_per_node: int | None = None
    min_piece_bytes: int = DEFAULT_MIN_PIECE_BYTES
    fan_out: bool = False
    tensors: tuple[str, ...] = ()
    to_dtype: str | None = None
    scale: str | None = None
    from_layout: str = "megatron"
    to_layout: str = "megatron"

    def manifest(self) -> Manifest:
        """The model's manifest, converted as ``to_dtype`` and ``scale`` say.

        Raises:
            ManifestError: an unknown model, a bad manifest file, or a conversion the tensors cannot take.
        """
        if isinstance(self.model, Manifest):
            manifest = self.model
        else:
            manifest = self.model.manifest if isinstance(self.model, HFModel) else model_manifest(self.model)
        return manifest if self.to_dtype is None else manifest.converted(self.to_dtype, self.scale)

    def layout(self, world_size: int) -> Layout:
        """The layout the source shard (and, without ``dst_shards``, the destinations) belongs to.

        Raises:
            ShardcoreError: a bad spec or world size.
        """
        return plan_layout(world_size, self.shards, order=self.order, allow_idle=self.allow_idle)

    def plan(self, world_size: int) -> ShardRefitPlan:
        """The plan on a world of ``world_size`` ranks; every rank that plans the same request gets the same plan.

        Raises:
            RefitError: bad shard indices, planner options or tensor patterns.
            ShardcoreError: a bad spec, model or conversion (a ``ManifestError`` where the model does not
                split over a shard).
        """
        layout = self.layout(world_size)
        if self.dst_shards is None and self.src in self.dst:
            raise RefitError(
                f"destination shard {self.src} is the source shard: a refit onto itself moves nothing; name other "
                "destination shards"
            )
        targets: list[int | ShardPlan] = list(self.dst)
        if self.dst_shards is not None:
            other = plan_layout(world_size, self.dst_shards, order=self.order, allow_idle=self.allow_idle)
            wrong = [index for index in self.dst if not 0 <= index < len(other.shards)]
            if wrong:
                raise RefitError(
                    f"destination shard {shown(wrong[0])}: the destination layout {shown(self.dst_shards)} has "
                    f"shards 0 to {len(other.shards) - 1}"
                )
            targets = [other.shards[index] for index in self.dst]
        request = self
        if isinstance(self.model, str) and self.model.startswith(HF_PREFIX):  # read once, for both
            request = replace(self, model=hf_model_of(self.model))
        plan = plan_refit(
            layout,
            self.src,
            targets,
            request.manifest(),
            self.ranks_per_node,
            min_piece_bytes=self.min_piece_bytes,
            fan_out=self.fan_out,
            layouts=request.layouts(),
        )
        # the plan's own tensors: through a layout a converting manifest is planned in the source's dtypes
        return plan.subset(tensors_matching(plan.manifest, self.tensors)) if self.tensors else plan

    def layouts(self) -> dict[int, ModelLayout] | None:
        """``plan_refit``'s ``layouts`` for ``from_layout`` / ``to_layout`` (None: Megatron's on both sides).

        Raises:
            ManifestError: an unknown layout, or one other than megatron without a ``hf:PATH`` or ``HFModel`` model.
        """
        if self.from_layout == self.to_layout == "megatron":
            return None
        if not isinstance(self.model, str | HFModel):
            raise ManifestError(
                f"--from-layout {self.from_layout} --to-layout {self.to_layout}: a layout other than megatron "
                "needs the model as a Hugging Face config, model='hf:PATH/config.json' (or manifest_from_hf_config's "
                "HFModel)"
            )
        return shard_layouts(self.model, self.src, self.dst, self.from_layout, self.to_layout)


__all__ = ["RefitRequest"]
