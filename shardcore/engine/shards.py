"""build_shards: from a spec to every rank's live groups and its backend's handle."""

from __future__ import annotations

import logging
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ..errors import GroupCreationError, LayoutError
from ..plan.layout import DEFAULT_ORDER, GROUP_NAMES, Layout, RankGroups, ShardPlan, plan_layout
from ..plan.spec import ShardsInput, ShardSpec, format_shards
from .backend import Backend
from .groups import (
    DEFAULT_TIMEOUT,
    Strategy,
    as_timedelta,
    check_local_strategy,
    create_groups,
    destroy_groups,
    is_fake_world,
)
from .plugins import get_backend
from .rendezvous import Agreement, agree, meet, report_failure
from .torch_state import group_counter, set_group_counter

log = logging.getLogger("shardcore")


@dataclass
class Shard:
    """One shard as this rank sees it: groups and handle are set only on member ranks."""

    index: int
    spec: ShardSpec
    rank_offset: int
    size: int
    """Ranks in the shard's window."""
    plan: ShardPlan = field(repr=False)
    groups: dict[str, Any] = field(default_factory=dict, repr=False)
    """Group name -> this rank's ProcessGroup (None where not created or not a member)."""
    group_ranks: RankGroups = field(default_factory=dict, repr=False)
    """Group name -> the global ranks of this rank's group, as planned."""
    handle: Any = None
    is_member: bool = False
    _created: list[Any] = field(default_factory=list, repr=False)

    @property
    def ranks(self) -> range:
        """The shard's global ranks."""
        return self.plan.ranks


def _require_initialized() -> None:
    try:
        import torch.distributed as dist
    except ImportError:
        raise GroupCreationError("build_shards needs torch: pip install torch") from None
    if not dist.is_available() or not dist.is_initialized():
        raise GroupCreationError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group() first "
            "(or shardcore_dtensor.ensure_distributed_initialized())"
        )


def _require_world(total_world_size: int) -> int:
    """This rank, once ``total_world_size`` is checked against the torch world."""
    import torch.distributed as dist

    rank, world = dist.get_rank(), dist.get_world_size()
    if total_world_size != world:
        raise GroupCreationError(
            f"total_world_size={total_world_size} but the torch world has {world} ranks: plan the whole world "
            f"(pass {world}, with allow_idle=True for ranks outside every shard)"
        )
    return rank


def _plan(
    total_world_size: int,
    shards: ShardsInput | Layout,
    backend: str | None,
    order: str,
    rank_offset: int,
    allow_idle: bool,
    strategy: str,
    groups: Sequence[str] | None,
    backend_options: Mapping[str, Any],
) -> tuple[Backend, Layout, tuple[str, ...], Strategy]:
    """Everything a rank checks on its own before meeting the others: backend, layout, groups, options, strategy."""
    chosen = get_backend(backend)
    names = _group_names(groups if groups is not None else chosen.group_names)
    layout = (
        shards
        if isinstance(shards, Layout)
        else plan_layout(total_world_size, shards, order=order, rank_offset=rank_offset, allow_idle=allow_idle)
    )
    if layout.world_size != total_world_size:
        raise LayoutError(f"the layout plans {layout.world_size} ranks but total_world_size={total_world_size}")
    check_options(chosen, backend_options)
    chosen.validate(layout, backend_options)
    try:
        chosen_strategy = Strategy(strategy)
    except ValueError:
        raise GroupCreationError(f"strategy={strategy!r}: expected one of {', '.join(Strategy)}") from None
    if chosen_strategy == Strategy.LOCAL:
        check_local_strategy()
    return chosen, layout, names, chosen_strategy


def build_shards(
    total_world_size: int,
    shards: ShardsInput | Layout,
    *,
    backend: str | None = None,
    order: str = DEFAULT_ORDER,
    rank_offset: int = 0,
    allow_idle: bool = False,
    strategy: str = Strategy.LOCAL,
    timeout: float | timedelta | None = None,
    groups: Sequence[str] | None = None,
    **backend_options: Any,
) -> list[Shard]:
    """Plan the layout, create this rank's groups and build its backend handle.

    SPMD: every rank of the world calls it with the same arguments, idle ranks too. Before
    any group is created the ranks check, through the store, that they planned the same
    layout; a rank that differs or never arrives makes every rank raise (never hang). The
    call ends with a world sync, so that no rank (least of all the store's host) tears
    down while others still create.

    Args:
        total_world_size: ranks in the torch world; it must equal ``dist.get_world_size()``.
        shards: a spec (string, ``@file``, dicts, ShardSpecs) or a planned ``Layout``.
        backend: backend name; default ``$SHARDCORE_BACKEND``, else ``dtensor``.
        order: ``tp-cp-dp-pp`` (pipeline stages contiguous) or ``tp-cp-pp-dp``.
        rank_offset: first rank of the first shard; earlier ranks are idle.
        allow_idle: let ranks after the last shard stay idle.
        strategy: ``local`` (members create their own groups) or ``world`` (every rank
            creates every group, Megatron's pattern).
        timeout: seconds (or a timedelta) to wait for other ranks; default 5 minutes.
        groups: the standard group names to create (default: ``Backend.group_names``, those
            the handle uses); the others stay None.
        **backend_options: options of the chosen backend (``Backend.options`` lists them).

    Returns:
        One ``Shard`` per shard in spec order; ``groups`` and ``handle`` are set on member ranks.

    Raises:
        ShardSpecError, LayoutError: a bad spec, layout, group name or backend option.
        BackendNotFoundError, BackendUnavailableError: the backend is missing or cannot work here.
        LayoutMismatchError: ranks planned different layouts.
        GroupCreationError: torch.distributed is not initialised, a rank is missing, dead or
            slow past ``timeout``, or group creation failed.
    """
    _require_initialized()
    fake = is_fake_world()
    wait = DEFAULT_TIMEOUT
    try:  # a rank that fails here still arrives, with its error, so the others stop and name it
        rank = _require_world(total_world_size)
        wait = as_timedelta(timeout)
        chosen, layout, names, strategy = _plan(
            total_world_size, shards, backend, order, rank_offset, allow_idle, strategy, groups, backend_options
        )
    except BaseException as error:
        if not fake:
            report_failure(None, "agree", error, wait)
        raise
    epoch = 0
    if fake:
        log.info("shardcore: fake backend, ranks cannot see each other: agreement checks skipped")
    else:
        agreement = Agreement(
            layout.fingerprint(),
            format_shards([plan.spec for plan in layout.shards]),
            str(layout.order),
            layout.rank_offset,
            chosen.name,
            names,
            strategy,
            group_counter(),
        )
        epoch, counter = agree(agreement, wait)
        if counter != agreement.group_counter:  # a failed build left this rank behind: catch up
            set_group_counter(counter)
    extras = {plan.index: chosen.extra_groups(plan, backend_options) for plan in layout.shards}
    created: list[Any] = []
    try:
        ranks_by_name, process_groups, created = create_groups(layout, rank, extras, strategy, wait, names)
        result = []
        for plan in layout.shards:
            shard = Shard(plan.index, plan.spec, plan.rank_offset, plan.size, plan, dict.fromkeys(GROUP_NAMES))
            if rank in plan:
                shard.is_member, shard.group_ranks, shard._created = True, ranks_by_name, created
                shard.groups.update(process_groups)
                shard.handle = chosen.make_handle(plan, rank, shard.groups, backend_options)
            result.append(shard)
    except BaseException as error:
        destroy_groups(created)
        if not fake:
            report_failure(epoch, "built", error, wait)
        raise
    if not fake:
        try:
            meet(epoch, "built", wait)
        except BaseException:
            destroy_groups(created)
            raise
    return result


def _group_names(names: Sequence[str] | None) -> tuple[str, ...]:
    """The standard group names to create, in creation order; None means all 15."""
    if names is None:
        return GROUP_NAMES
    if isinstance(names, str):
        names = [names]
    unknown = [name for name in names if name not in GROUP_NAMES]
    if unknown:
        raise LayoutError(f"unknown group name {unknown[0]!r}: choose from {', '.join(GROUP_NAMES)}")
    return tuple(name for name in GROUP_NAMES if name in names)


def check_options(backend: Backend, options: Mapping[str, Any]) -> None:
    """Reject options the backend does not declare, before any rank communicates.

    Raises:
        LayoutError: an unknown option, naming the ones the backend accepts.
    """
    unknown = sorted(set(options) - set(backend.options))
    if unknown:
        accepted = ", ".join(backend.options) or "none"
        raise LayoutError(f"unknown option(s) {', '.join(unknown)} for backend {backend.name!r}: it accepts {accepted}")


def my_shard(shards: Sequence[Shard]) -> Shard | None:
    """This rank's shard, or None on an idle rank."""
    return next((shard for shard in shards if shard.is_member), None)


def destroy_shards(shards: Sequence[Shard]) -> None:
    """Destroy exactly the groups ``build_shards`` created on this rank.

    Local to the rank (no communication); call it on every rank that built, idle ranks
    included, before building again or destroying the default group.
    """
    for shard in shards:
        destroy_groups(shard._created)
        shard._created = []
        shard.groups = {name: None for name in shard.groups}
        shard.handle = None


__all__ = ["Shard", "build_shards", "check_options", "destroy_shards", "my_shard"]
