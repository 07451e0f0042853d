"""Drop-in replacements for Megatron-Core's ``core.inference.shards`` builders.

Change ``from megatron.core.inference.shards import ...`` to
``from shardcore_megatron.shards import ...`` and get the same groups, with:

* typed errors (``ShardSpecError``/``LayoutError``, both ``ValueError``) where Megatron asserts;
* ``cp > 1``, ``role=train`` and a training window before the shards (``rank_offset``);
* each rank creating only its own groups where torch creates groups lazily (``strategy="auto"``,
  the default, picks this), or every rank creating every group as Megatron does
  (``strategy="world"``, which ``auto`` picks under a device-bound default group);
* identical rank sets (tp and tp_cp when cp = 1, ...) sharing one communicator.

Non-members: ``build_inference_pg_collection`` returns, on a rank outside its window, a
``ProcessGroupCollection`` whose every field is None (what Megatron's really hold, whatever
its docstring says); ``build_inference_pg_collections_for_shards`` sets ``pg_collection``
only on members, as Megatron does.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from shardcore import (
    GroupCreationError,
    Layout,
    LayoutError,
    Order,
    Shard,
    ShardSpec,
    ShardSpecError,
    Strategy,
    build_shards,
    destroy_shards,
    parse_shards,
    plan_layout,
)
from shardcore.plan import INT_KEYS, as_timedelta, check_choice, check_count, check_flag, shown

from .backend import make_collection, require_available

_SPEC_ATTRS = (*INT_KEYS, "role")
_built: list[list[Shard]] = []


@dataclass
class InferenceShard:
    """One shard as this rank sees it; ``pg_collection`` is set only on its member ranks."""

    spec: ShardSpec
    rank_offset: int
    world_size: int
    pg_collection: Any = None
    shard: Shard | None = field(default=None, repr=False, compare=False)


def _torch_world() -> tuple[int, int]:
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise GroupCreationError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group() first"
        )
    return dist.get_rank(), dist.get_world_size()


def _training_sizes() -> dict[str, int]:
    """Training's sizes from Megatron's parallel_state when it is initialised, else all 1."""
    require_available()
    from megatron.core import parallel_state as mpu

    if not mpu.model_parallel_is_initialized():
        return dict.fromkeys(("tp", "pp", "cp", "ep", "expt_tp"), 1)
    return {
        "tp": mpu.get_tensor_model_parallel_world_size(),
        "pp": mpu.get_pipeline_model_parallel_world_size(),
        "cp": mpu.get_context_parallel_world_size(),
        "ep": mpu.get_expert_model_parallel_world_size(),
        "expt_tp": mpu.get_expert_tensor_parallel_world_size(),
    }


def _order(use_tp_pp_dp_mapping: bool) -> Order:
    return Order.TP_CP_PP_DP if check_flag("use_tp_pp_dp_mapping", use_tp_pp_dp_mapping) else Order.TP_CP_DP_PP


def _check_build_options(strategy: object, timeout: object) -> None:
    """The options passed on to build_shards, checked before torch or Megatron is touched."""
    check_choice("strategy", strategy, Strategy)
    as_timedelta(timeout)


def _build(layout: Layout, strategy: str, timeout: float | timedelta | None) -> list[Shard]:
    shards = build_shards(layout.world_size, layout, backend="megatron", strategy=strategy, timeout=timeout)
    _built.append(shards)
    return shards


def build_inference_pg_collection(
    world_size: int,
    tp_size: int | None = None,
    pp_size: int | None = None,
    cp_size: int | None = None,
    ep_size: int | None = None,
    expt_tp_size: int | None = None,
    use_tp_pp_dp_mapping: bool = False,
    rank_offset: int = 0,
    *,
    strategy: str = "auto",
    timeout: float | timedelta | None = None,
) -> Any:
    """One model's ProcessGroupCollection over ranks ``[rank_offset, rank_offset + world_size)``.

    Every rank of the torch world calls it. Sizes left None come from training's
    parallel_state when initialised, else 1; dp is ``world_size / (tp*cp*pp)``.
    Off the window every field of the returned collection is None.

    Raises:
        ShardSpecError: a size that is not a whole number from 1 to shardcore's world limit, or
            sizes that do not divide ``world_size``.
        LayoutError: a bad ``rank_offset``, ``use_tp_pp_dp_mapping``, ``strategy`` or ``timeout``.
    """
    check_count("world_size", world_size, error=ShardSpecError)
    check_count("rank_offset", rank_offset, minimum=0)
    order = _order(use_tp_pp_dp_mapping)
    _check_build_options(strategy, timeout)
    given = {"tp": tp_size, "pp": pp_size, "cp": cp_size, "ep": ep_size, "expt_tp": expt_tp_size}
    for key, value in given.items():
        if value is not None:
            check_count(f"{key}_size", value, error=ShardSpecError)
    defaults = _training_sizes() if any(v is None for v in given.values()) else {}
    sizes = {key: defaults[key] if value is None else value for key, value in given.items()}
    for key, value in sizes.items():
        check_count(f"{key}_size", value, error=ShardSpecError)
    dense = sizes["tp"] * sizes["cp"] * sizes["pp"]
    if world_size % dense:
        raise ShardSpecError(
            f"world_size={world_size} is not divisible by "
            f"tp*cp*pp = {sizes['tp']}*{sizes['cp']}*{sizes['pp']} = {dense}: "
            f"choose sizes whose product divides the window"
        )
    spec = ShardSpec(dp=world_size // dense, **sizes)  # type: ignore[arg-type]  # sizes holds only int keys
    require_available()
    _, total = _torch_world()
    layout = plan_layout(total, [spec], order=order, rank_offset=rank_offset, allow_idle=True)
    shards = _build(layout, strategy, timeout)
    mine = shards[0]
    return mine.handle if mine.is_member else make_collection({})


def _as_input(index: int, item: Any) -> ShardSpec | Mapping[str, Any] | str:
    """What parse_shards reads: the item itself, or the spec attributes of a Megatron-like object."""
    if isinstance(item, (ShardSpec, Mapping, str)):
        return item
    if all(hasattr(item, key) for key in ("tp", "pp", "dp")):
        return {key: getattr(item, key) for key in _SPEC_ATTRS if getattr(item, key, None) is not None}
    raise ShardSpecError(
        f"shard {index}: a shard must be a spec string, a ShardSpec, a mapping or an object with tp/pp/dp "
        f"attributes (like Megatron's InferenceShardSpec); got {type(item).__name__}: {shown(item)}"
    )


def normalize_shard_specs(shards: Any) -> tuple[ShardSpec, ...]:
    """Specs from a string (Megatron's grammar), InferenceShardSpec-like objects or dicts.

    Raises:
        ShardSpecError: as parse_shards, naming the shard (its index) and the bad key and value.
    """
    if isinstance(shards, (str, ShardSpec, Mapping)):
        return parse_shards(shards)
    if not isinstance(shards, Sequence):
        raise ShardSpecError(f"shards must be a spec string or a sequence of specs; got {type(shards).__name__}")
    return parse_shards([_as_input(index, item) for index, item in enumerate(shards)])


def build_inference_pg_collections_for_shards(
    total_world_size: int,
    shards: Any,
    use_tp_pp_dp_mapping: bool = False,
    *,
    rank_offset: int = 0,
    strategy: str = "auto",
    allow_idle: bool = False,
    timeout: float | timedelta | None = None,
) -> list[InferenceShard]:
    """One ProcessGroupCollection per shard, shards in contiguous windows from ``rank_offset``.

    Every rank of the torch world calls it. The shards must fill ``[rank_offset,
    total_world_size)`` unless ``allow_idle``; ranks before ``rank_offset`` (a training
    window) and torch ranks past ``total_world_size`` are idle here. Every shard is
    returned in spec order, ``role=train`` ones included.

    Raises:
        ShardSpecError: a bad spec (see ``normalize_shard_specs``).
        LayoutError: a bad argument, or shards that do not fit the world.
    """
    order = _order(use_tp_pp_dp_mapping)
    _check_build_options(strategy, timeout)
    check_flag("allow_idle", allow_idle)
    specs = normalize_shard_specs(shards)
    layout = plan_layout(total_world_size, specs, order=order, rank_offset=rank_offset, allow_idle=allow_idle)
    require_available()
    _, torch_world = _torch_world()
    if torch_world < total_world_size:
        raise LayoutError(
            f"total_world_size={total_world_size} but the torch world has only {torch_world} ranks: "
            f"pass at most {torch_world}"
        )
    if torch_world > total_world_size:  # ranks past the planned world take part as idle ranks
        layout = plan_layout(torch_world, specs, order=order, rank_offset=rank_offset, allow_idle=True)
    built = _build(layout, strategy, timeout)
    return [InferenceShard(s.spec, s.rank_offset, s.size, s.handle if s.is_member else None, s) for s in built]


def destroy_inference_process_groups() -> None:
    """Destroy every group this module's builders created on this rank (Megatron has no such call)."""
    while _built:
        destroy_shards(_built.pop())


__all__ = [
    "InferenceShard",
    "build_inference_pg_collection",
    "build_inference_pg_collections_for_shards",
    "destroy_inference_process_groups",
    "normalize_shard_specs",
]
