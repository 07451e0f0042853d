"""Refit a Megatron-Core model's weights into another model laid out by shardcore's shards.

In the spirit of Megatron-Core 0.19's ``swap_model_weights(src_model, dst_model, ...)``, but the
plan is shardcore's: computed per rank from the two shards' layouts, with replicas balanced and cp
allowed. The manifest is read off the models' parameters:

* ``tensor_model_parallel`` / ``partition_dim`` give the tp-split dim; the global size is the local
  one times the tp size (expt_tp for an expert);
* ``partition_stride`` > 1 (SwiGLU's gate+up in ``linear_fc1``) means that many packed blocks;
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
"""

from __future__ import annotations

import re
from collections.abc import Iterator, Sequence
from datetime import timedelta
from typing import Any, NamedTuple

from shardcore import ExecuteOptions, Layout, RefitInputError, ShardPlan, TransferStats, execute_refit
from shardcore.engine import all_gather_objects

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


class Parameter(NamedTuple):
    """One parameter of a chunk under its global name (layer and expert global too)."""

    name: str
    local: str
    tensor: Any
    layer: int | None
    expert: int | None


def _tied(chunk: Any) -> bool:
    return bool(getattr(chunk, "share_embeddings_and_output_weights", False))


def parameters(model: Any) -> Iterator[Parameter]:
    """Every parameter of every chunk of ``model``; a tied output layer's weight is named as the embedding."""
    for chunk in _chunks(model):
        tied_output = _tied(chunk) and not getattr(chunk, "pre_process", True)
        for local, tensor in chunk.named_parameters():
            name, layer, expert = _global(chunk, local, tied_output)
            yield Parameter(name, local, tensor, layer, expert)


def _records(model: Any, plan: ShardPlan, side: str, rank: int) -> list[dict[str, Any]]:
    """The manifest fields of every parameter this rank holds of ``model`` (laid out by ``plan``), and
    where the rank sits (its pipeline stage, to check the layers against the manifest's split)."""
    tied = any(_tied(chunk) for chunk in _chunks(model))
    where = {"side": side, "rank": rank, "stage": plan.coords(rank)["pp"], "pp": plan.spec.pp}
    records = []
    for parameter in parameters(model):
        shape = list(parameter.tensor.shape)
        fields: dict[str, Any] = {"name": parameter.name, "dtype": str(parameter.tensor.dtype).removeprefix("torch.")}
        if getattr(parameter.tensor, "tensor_model_parallel", False):
            dim = int(parameter.tensor.partition_dim)
            shape[dim] *= plan.spec.expt_tp if parameter.expert is not None else plan.spec.tp
            stride = int(getattr(parameter.tensor, "partition_stride", 1))
            fields.update(tp_dim=dim, blocks=(shape[dim] // stride,) * stride if stride > 1 else ())
        fields["shape"] = tuple(shape)
        if parameter.layer is None:
            fields["stage"] = _stage(parameter.name, tied)
        else:
            fields["layer"] = parameter.layer
            if parameter.expert is not None:
                fields["expert"] = parameter.expert
        records.append({**where, "local": parameter.local, "fields": fields})
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
        if record["fields"] != first["fields"]:
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


def read_manifest(src_model: Any, dst_model: Any, source: ShardPlan, target: ShardPlan) -> Any:
    """The manifest both models agree on, from every rank's parameters (one all-gather).

    Every rank of the world calls it, with None for a model it does not hold.
    """
    import torch.distributed as dist

    rank = dist.get_rank()
    mine: dict[str, Any] = {"records": [], "facts": []}
    for side, model, plan in (("src", src_model, source), ("dst", dst_model, target)):
        if model is not None and rank in plan:
            mine["records"] += _records(model, plan, side, rank)
            mine["facts"].append(_config_facts(model, plan, side))
    gathered = all_gather_objects(mine)
    return manifest_from_records([r for g in gathered for r in g["records"]], [f for g in gathered for f in g["facts"]])


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

    from shardcore import ShardcoreError
    from shardcore.refit import plan_refit

    layout = _layout(shards)
    source, target = _shard_plan(layout, src), _shard_plan(layout, dst)
    manifest = read_manifest(src_model, dst_model, source, target)
    try:
        refit_plan = plan_refit(layout, source, [target], manifest)
    except ShardcoreError as error:
        raise RefitInputError(f"the models do not fit their shards: {error}") from error

    rank = dist.get_rank()

    def tensors(model: Any, plan: ShardPlan) -> dict[str, Any]:
        if model is None or rank not in plan:
            return {}
        return {parameter.name: parameter.tensor.data for parameter in parameters(model)}

    with torch.no_grad():
        return execute_refit(
            refit_plan,
            tensors(src_model, source),
            tensors(dst_model, target),
            options=options,
            timeout=timeout,
            bucket_bytes=bucket_bytes,
        )


__all__ = ["Parameter", "manifest_from_records", "parameters", "read_manifest", "refit"]
