"""Refit a Megatron-Core model's weights into another model laid out by shardcore's shards.

In the spirit of Megatron-Core 0.19's ``swap_model_weights(src_model, dst_model, ...)``, but the
plan is shardcore's: computed per rank from the two shards' layouts, with replicas balanced and cp
allowed. It moves what Megatron's own refit moves: every parameter and every persistent buffer (the MoE
router's ``expert_bias``, which aux-loss-free balancing updates each step: a router bias left at zero
routes tokens differently, with no error anywhere). The manifest is read off those tensors:

* ``tensor_model_parallel`` / ``partition_dim`` give the tp-split dim; the global size is the local
  one times the tp size (expt_tp for an expert);
* ``partition_sizes`` (Mamba's ``in_proj`` [z, x, B, C, dt] and ``conv1d`` [x, B, C], megatron-core
  0.19) lists a tp rank's packed blocks, of unequal sizes: each block is split over tp on its own;
  else ``partition_stride`` > 1 (SwiGLU's gate+up in ``linear_fc1``) means that many equal blocks;
* a persistent buffer takes the source's dtype on the destination, as Megatron's refit does: the
  trainer keeps ``expert_bias`` in float32 while a freshly wrapped bf16 model holds it in bf16;
* pipeline-local layer numbers become global ones (``TransformerLayer.layer_number`` is global);
* local expert indices become global ones (``MoELayer.local_expert_indices``), under one name
  ``decoder.layers.L.mlp.experts.local_experts.E.`` for both Megatron namings (sequential and grouped);
* a tied output layer on a last stage that is not also first (``output_layer.weight``) is the
  embedding, which then sits on the first and last stages;
* the pipeline split (``num_layers_in_first/last_pipeline_stage``) comes from the models with pp > 1
  (Megatron allows none at pp = 1), and every layer must sit on the stage it gives.

Every rank contributes what its own stage and experts hold; one all-gather joins
them, and any disagreement (between ranks, or between the two models' conventions) is a typed
error naming the tensor.

The plan is kept across calls (``kept_plans``, a ``shardcore.engine.KeptPlans``), under every rank's
key: its records (names, shapes, dtypes, placement), the models' facts, the two shards and the
layout's fingerprint, the world's size. An RL loop that refits the same models every step plans once;
a call whose key changed on any rank plans again, on every rank.
"""

from __future__ import annotations

import re
import warnings
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

from shardcore import ExecuteOptions, Layout, RefitInputError, ShardPlan, TransferStats, execute_refit
from shardcore.engine import KeptPlans, all_gather_objects

_LAYER = re.compile(r"^decoder\.layers\.(\d+)\.(.*)$")
_SEQUENTIAL_EXPERT = re.compile(r"^mlp\.experts\.local_experts\.(\d+)\.(.*)$")
_GROUPED_EXPERT = re.compile(r"^mlp\.experts\.(linear_fc[12])\.(weight|bias)(\d+)$")
_EMBEDDING = "embedding.word_embeddings.weight"


def _chunks(model: Any) -> list[Any]:
    """A model, or its virtual-pipeline chunks, unwrapped from DDP/Float16Module-style ``.module``."""
    chunks = list(model) if isinstance(model, Sequence) else [model]
    out = []
    for chunk in chunks:
        while hasattr(chunk, "module") and not hasattr(chunk, "decoder") and not hasattr(chunk, "embedding"):
            chunk = chunk.module
        out.append(chunk)
    return out


def _expert_indices(chunk: Any, local_layer: int) -> Sequence[int]:
    mlp = chunk.decoder.layers[local_layer].mlp
    indices = getattr(mlp, "local_expert_indices", None)
    if indices is None:
        raise RefitInputError(
            f"decoder.layers.{local_layer}.mlp has experts but no local_expert_indices: not a Megatron-Core MoELayer?"
        )
    return indices


def _global(chunk: Any, name: str, tied_output: bool) -> tuple[str, int | None, int | None]:
    """(global name, global layer, global expert) of a local parameter name."""
    if name == "output_layer.weight" and tied_output:
        return _EMBEDDING, None, None
    match = _LAYER.match(name)
    if match is None:
        return name, None, None
    local, rest = int(match.group(1)), match.group(2)
    layer = chunk.decoder.layers[local].layer_number - 1
    expert = None
    sequential, grouped = _SEQUENTIAL_EXPERT.match(rest), _GROUPED_EXPERT.match(rest)
    if sequential:
        expert = _expert_indices(chunk, local)[int(sequential.group(1))]
        rest = f"mlp.experts.local_experts.{expert}.{sequential.group(2)}"
    elif grouped:
        expert = _expert_indices(chunk, local)[int(grouped.group(3))]
        rest = f"mlp.experts.local_experts.{expert}.{grouped.group(1)}.{grouped.group(2)}"
    return f"decoder.layers.{layer}.{rest}", layer, expert


def _stage(name: str, tied: bool) -> tuple[str, ...]:
    """Pipeline placement of a tensor outside the decoder layers."""
    if name.startswith("embedding."):
        return ("first", "last") if tied and name == _EMBEDDING else ("first",)
    if name.startswith(("output_layer.", "decoder.final_layernorm.")):
        return ("last",)
    return ("all",)


class RefitTensor(NamedTuple):
    """One tensor a refit moves (a parameter or a persistent buffer) under its global name (layer and
    expert global too)."""

    name: str
    local: str
    tensor: Any
    layer: int | None
    expert: int | None
    buffer: bool = False
    """A persistent buffer (in the state dict, not a parameter): e.g. the MoE router's ``expert_bias``."""


def _tied(chunk: Any) -> bool:
    return bool(getattr(chunk, "share_embeddings_and_output_weights", False))


def _persistent_buffers(chunk: Any) -> Iterator[tuple[str, Any]]:
    """(local name, tensor) of every persistent buffer of ``chunk``: what its state dict saves besides the
    parameters. Non-persistent ones (the router's token counts) are scratch, reset every step."""
    for prefix, module in chunk.named_modules():
        scratch = module._non_persistent_buffers_set
        for name, tensor in module.named_buffers(recurse=False):
            if name not in scratch:
                yield (f"{prefix}.{name}" if prefix else name), tensor


def refit_tensors(model: Any) -> Iterator[RefitTensor]:
    """Every parameter, then every persistent buffer, of every chunk of ``model``; a tied output layer's
    weight is named as the embedding."""
    for chunk in _chunks(model):
        tied_output = _tied(chunk) and not getattr(chunk, "pre_process", True)
        for buffer, named in ((False, chunk.named_parameters()), (True, _persistent_buffers(chunk))):
            for local, tensor in named:
                name, layer, expert = _global(chunk, local, tied_output)
                yield RefitTensor(name, local, tensor, layer, expert, buffer)


_LOCAL_EXPERT = re.compile(r"^(decoder\.layers\.\d+\.mlp\.experts\.)local_experts\.(\d+)\.(linear_fc[12]\.\w+)$")


def model_tensors(model: Any) -> dict[str, Any]:
    """This rank's parameters and persistent buffers of ``model`` (their ``.data``), by the names of shardcore's
    manifests (``shardcore.refit.preset``, ``manifest_from_hf_config(path).manifest``): the ``sources`` (or, for a
    model to write in place, the ``destinations``) that ``execute_refit`` takes with a plan of such a manifest.

    Layers and experts are named by their global numbers, an expert as the manifests name it
    (``decoder.layers.5.mlp.experts.linear_fc1.weight130``); a tied output layer on a last stage is the embedding.
    Pass ``{n: t for n, t in model_tensors(model).items() if n in mine.source_shapes}`` for a partial refit.

    Args:
        model: This rank's Megatron-Core model, or its virtual-pipeline chunks (DDP/Float16Module unwrapped).
    """
    out = {}
    for tensor in refit_tensors(model):
        match = _LOCAL_EXPERT.match(tensor.name)
        name = f"{match.group(1)}{match.group(3)}{match.group(2)}" if match else tensor.name
        out[name] = tensor.tensor.data
    return out


def _blocks(tensor: RefitTensor, dim: int, tp: int, global_size: int) -> tuple[int, ...]:
    """The global sizes of a tp-split tensor's packed blocks along ``dim`` (() for one block).

    ``partition_sizes`` lists a tp rank's blocks (Mamba's ``in_proj``: z, x, B, C, dt); each block is
    split over tp on its own, so its global size is tp times the local one.

    Raises:
        RefitInputError: ``partition_sizes`` does not add up to the tensor's local size along ``dim``.
    """
    sizes = getattr(tensor.tensor, "partition_sizes", None)
    if sizes is not None:
        local = [int(size) for size in sizes]
        if sum(local) != tensor.tensor.shape[dim]:
            raise RefitInputError(
                f"tensor {tensor.name!r} ({tensor.local}): partition_sizes {local} add up to {sum(local)}, but its "
                f"local size along partition_dim {dim} is {tensor.tensor.shape[dim]}: set partition_sizes to the "
                f"sizes of this tp rank's packed blocks"
            )
        return tuple(size * tp for size in local) if len(local) > 1 else ()
    stride = int(getattr(tensor.tensor, "partition_stride", 1))
    return (global_size // stride,) * stride if stride > 1 else ()


def _dtype(tensor: Any) -> str:
    return str(tensor.dtype).removeprefix("torch.")


def _records(model: Any, plan: ShardPlan, side: str, rank: int) -> list[dict[str, Any]]:
    """The manifest fields of every tensor this rank holds of ``model`` (laid out by ``plan``), and
    where the rank sits (its pipeline stage, to check the layers against the manifest's split).

    A destination buffer's dtype is not a field: the source's is the manifest's (``_match_buffer_dtypes``).
    """
    tied = any(_tied(chunk) for chunk in _chunks(model))
    where = {"side": side, "rank": rank, "stage": plan.coords(rank)["pp"], "pp": plan.spec.pp}
    records = []
    for tensor in refit_tensors(model):
        shape = list(tensor.tensor.shape)
        fields: dict[str, Any] = {"name": tensor.name}
        if not (tensor.buffer and side == "dst"):
            fields["dtype"] = _dtype(tensor.tensor)
        if getattr(tensor.tensor, "tensor_model_parallel", False):
            dim = int(tensor.tensor.partition_dim)
            tp = plan.spec.expt_tp if tensor.expert is not None else plan.spec.tp
            shape[dim] *= tp
            fields.update(tp_dim=dim, blocks=_blocks(tensor, dim, tp, shape[dim]))
        fields["shape"] = tuple(shape)
        if tensor.layer is None:
            fields["stage"] = _stage(tensor.name, tied)
        else:
            fields["layer"] = tensor.layer
            if tensor.expert is not None:
                fields["expert"] = tensor.expert
        records.append({**where, "local": tensor.local, "fields": fields, "buffer": tensor.buffer})
    return records


def _config_facts(model: Any, plan: ShardPlan, side: str) -> dict[str, Any]:
    """What the manifest needs of the whole model; the pipeline split counts only where pp > 1."""
    config = _chunks(model)[0].config
    split = (
        getattr(config, "num_layers_in_first_pipeline_stage", None),
        getattr(config, "num_layers_in_last_pipeline_stage", None),
    )
    return {
        "side": side,
        "pp": plan.spec.pp,
        "model": {"layers": int(config.num_layers), "experts": int(getattr(config, "num_moe_experts", None) or 0)},
        "split": split if plan.spec.pp > 1 else None,
    }


def _shown_split(split: tuple[int | None, int | None] | None) -> str:
    if split is None or split == (None, None):
        return "evenly"
    return f"num_layers_in_first_pipeline_stage={split[0]}, num_layers_in_last_pipeline_stage={split[1]}"


def _model_facts(facts: Sequence[dict[str, Any]]) -> dict[str, Any]:
    """The manifest's model-wide fields both models agree on.

    One pipeline split serves every shard with pp > 1 (``Manifest.first_stage_layers``): a pp=1 model
    has none to disagree with, two pipelined models must share it.
    """
    first = facts[0]
    for other in facts[1:]:
        if other["model"] != first["model"]:
            raise RefitInputError(
                f"the two models disagree on the model: {first['model']} ({first['side']}) against "
                f"{other['model']} ({other['side']}): refit needs the same layers and experts on both sides"
            )
    pipelined = [f for f in facts if f["split"] is not None]
    for other in pipelined[1:]:
        if other["split"] != pipelined[0]["split"]:
            raise RefitInputError(
                f"the {pipelined[0]['side']} model (pp={pipelined[0]['pp']}) splits its layers "
                f"{_shown_split(pipelined[0]['split'])}, the {other['side']} model (pp={other['pp']}) "
                f"{_shown_split(other['split'])}: shardcore's manifest holds one pipeline split for every shard "
                f"with pp > 1, so give both models the same num_layers_in_first/last_pipeline_stage"
            )
    split = pipelined[0]["split"] if pipelined else (None, None)
    return {**first["model"], "first_stage_layers": split[0], "last_stage_layers": split[1]}


def _check_stages(records: Sequence[dict[str, Any]], manifest: Any) -> None:
    """Every layer sits on the stage the manifest's split puts it (not so under a split refit cannot read)."""
    for record in records:
        layer = record["fields"].get("layer")
        if layer is None:
            continue
        expected = manifest.stage_layers(record["pp"])
        if layer not in expected[record["stage"]]:
            where = next(stage for stage, layers in enumerate(expected) if layer in layers)
            raise RefitInputError(
                f"tensor {record['fields']['name']!r} ({record['local']}) is on pipeline stage {record['stage']} of "
                f"the {record['side']} model (rank {record['rank']}), but splitting {manifest.layers} layers over "
                f"pp={record['pp']} {_shown_split((manifest.first_stage_layers, manifest.last_stage_layers))} puts "
                f"layer {layer} on stage {where}: refit reads an even split or num_layers_in_first/last_pipeline_stage"
                f", not pipeline_model_parallel_layout or account_for_embedding/loss_in_pipeline_split"
            )


def manifest_from_records(records: Sequence[dict[str, Any]], facts: Sequence[dict[str, Any]]) -> Any:
    """One manifest from every rank's records; a tensor described two ways is a typed error naming it.

    Raises:
        RefitInputError: two ranks (of one model or of the two models) disagree on a tensor or on the
            model-wide facts, a layer sits off the stage the pipeline split gives it, or a destination
            tensor has no source.
    """
    from shardcore.refit import Manifest, TensorSpec

    model = _model_facts(facts)
    seen: dict[str, dict[str, Any]] = {}
    for record in sorted(records, key=lambda r: (r["side"] != "src", r["rank"])):
        first = seen.setdefault(record["fields"]["name"], record)
        expected = first["fields"]
        if "dtype" not in record["fields"]:  # a destination buffer takes the source's dtype
            expected = {key: value for key, value in expected.items() if key != "dtype"}
        if record["fields"] != expected:
            raise RefitInputError(
                f"tensor {record['fields']['name']!r}: the {first['side']} model on rank {first['rank']} "
                f"({first['local']}) describes it as {first['fields']}, the {record['side']} model on rank "
                f"{record['rank']} ({record['local']}) as {record['fields']}: the two models' conventions disagree"
            )
    sources = {r["fields"]["name"] for r in records if r["side"] == "src"}
    missing = sorted({r["fields"]["name"] for r in records if r["side"] == "dst"} - sources)
    if missing:
        raise RefitInputError(
            f"destination parameter {missing[0]!r} has no source parameter ({len(missing)} such): both models "
            f"must be built from the same architecture"
        )
    tensors = tuple(TensorSpec(**seen[name]["fields"]) for name in sorted(seen))
    manifest = Manifest(tensors, **model, name="megatron")
    _check_stages(records, manifest)
    return manifest


def _local_records(src_model: Any, dst_model: Any, source: ShardPlan, target: ShardPlan, rank: int) -> dict[str, Any]:
    """What this rank contributes to the manifest: its tensors' records and its models' facts."""
    mine: dict[str, Any] = {"records": [], "facts": []}
    for side, model, plan in (("src", src_model, source), ("dst", dst_model, target)):
        if model is not None and rank in plan:
            mine["records"] += _records(model, plan, side, rank)
            mine["facts"].append(_config_facts(model, plan, side))
    return mine


def _gathered_manifest(mine: dict[str, Any]) -> Any:
    gathered = all_gather_objects(mine)
    return manifest_from_records([r for g in gathered for r in g["records"]], [f for g in gathered for f in g["facts"]])


def read_manifest(src_model: Any, dst_model: Any, source: ShardPlan, target: ShardPlan) -> Any:
    """The manifest both models agree on, from every rank's parameters and persistent buffers (one all-gather).

    Every rank of the world calls it, with None for a model it does not hold.
    """
    import torch.distributed as dist

    return _gathered_manifest(_local_records(src_model, dst_model, source, target, dist.get_rank()))


def _match_buffer_dtypes(model: Any, manifest: Any) -> None:
    """Give each destination buffer the manifest's (the source's) dtype, in place, where it differs.

    The tensor object stays (``.data`` is replaced, as megatron-core's router does to keep ``expert_bias``
    in float32), so the module's attribute and every reference to it see the refit's values.
    """
    import torch

    for tensor in refit_tensors(model):
        if tensor.buffer:
            dtype = manifest.tensors[manifest.index(tensor.name)].dtype
            if _dtype(tensor.tensor) != dtype:
                tensor.tensor.data = tensor.tensor.data.to(getattr(torch, dtype))


kept_plans: KeptPlans[Any] = KeptPlans()
"""The plans ``refit`` keeps across calls (see the module's docstring); ``kept_plans.clear()`` on every
rank forgets them."""


def _layout(shards: Any) -> Layout:
    """The Layout behind shardcore's shards (a Layout, ``build_shards``' list, or InferenceShards)."""
    if isinstance(shards, Layout):
        return shards
    first = shards[0]
    return (first.shard if hasattr(first, "shard") else first).layout


def _shard_plan(layout: Layout, which: Any) -> ShardPlan:
    if isinstance(which, ShardPlan):
        return which
    plan = getattr(which, "plan", None) or getattr(getattr(which, "shard", None), "plan", None)
    return plan if plan is not None else layout.shards[which]


def refit(
    src_model: Any,
    dst_model: Any,
    shards: Any,
    *,
    src: Any = 0,
    dst: Any = 1,
    options: ExecuteOptions | None = None,
    timeout: float | timedelta | None = None,
    bucket_bytes: int | None = None,
) -> TransferStats:
    """Copy ``src_model``'s weights into ``dst_model`` across their shards; every rank of the world calls it.

    Parameters and persistent buffers move; a destination buffer takes the source's dtype. The plan is
    kept for the next call that brings the same models, shards and world on every rank
    (``kept_plans``): then a call costs one all-gather of two digests per rank before the transfer.

    Args:
        src_model: This rank's source model (or its virtual-pipeline chunks), None where the rank is not
            in the source shard.
        dst_model: This rank's destination model, written in place; None where the rank is not in it.
        shards: shardcore's shards: ``build_shards``' list, ``build_inference_pg_collections_for_shards``'
            list, or a Layout.
        src: The source shard: an index into ``shards``, or a Shard / ShardPlan (e.g. of another layout
            over the same ranks, for a collocated refit).
        dst: The destination shard, given the same way.
        options: The executor's knobs (timeout, bucket bytes, ops per batch, verification, version), as
            ``shardcore.execute_refit`` takes them.
        timeout: Seconds for the whole transfer, in the place of ``options.timeout``.
        bucket_bytes: Extra memory for packing, in the place of ``options.bucket_bytes``.

    Returns:
        This rank's TransferStats.

    Raises:
        RefitInputError: the models disagree on a tensor, or do not fit their shards (on every rank).
        RefitPeerError: a rank died or never arrived.
    """
    import torch
    import torch.distributed as dist

    layout = _layout(shards)
    source, target = _shard_plan(layout, src), _shard_plan(layout, dst)
    rank = dist.get_rank()
    mine = _local_records(src_model, dst_model, source, target, rank)
    key = (mine, layout.fingerprint(), source.to_dict(), target.to_dict(), dist.get_world_size(), rank)
    refit_plan = kept_plans.get(key, lambda: _plan(layout, source, target, mine))
    if dst_model is not None and rank in target:
        _match_buffer_dtypes(dst_model, refit_plan.manifest)

    def tensors(model: Any, plan: ShardPlan) -> dict[str, Any]:
        if model is None or rank not in plan:
            return {}
        return {tensor.name: tensor.tensor.data for tensor in refit_tensors(model)}

    with torch.no_grad():
        return execute_refit(
            refit_plan,
            tensors(src_model, source),
            tensors(dst_model, target),
            options=options,
            timeout=timeout,
            bucket_bytes=bucket_bytes,
        )


def _plan(layout: Layout, source: ShardPlan, target: ShardPlan, mine: dict[str, Any]) -> Any:
    """The refit plan from every rank's records (one all-gather); every rank calls it together."""
    from shardcore import ShardcoreError
    from shardcore.refit import plan_refit

    manifest = _gathered_manifest(mine)
    try:
        return plan_refit(layout, source, [target], manifest)
    except ShardcoreError as error:
        raise RefitInputError(f"the models do not fit their shards: {error}") from error


_RENAMED = {"parameters": "refit_tensors", "Parameter": "RefitTensor"}
"""Names renamed in 0.1.x (they yield persistent buffers too now): served with a DeprecationWarning for one release."""


def __getattr__(name: str) -> Any:
    if name in _RENAMED:
        warnings.warn(
            f"shardcore_megatron.refit.{name} is now {_RENAMED[name]} (persistent buffers too); {name} goes in the "
            f"next release",
            DeprecationWarning,
            stacklevel=2,
        )
        return globals()[_RENAMED[name]]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = [
    "RefitTensor",
    "kept_plans",
    "manifest_from_records",
    "model_tensors",
    "read_manifest",
    "refit",
    "refit_tensors",
]
