"""build_shards: from a spec to every rank's live groups and its backend's handle."""

from __future__ import annotations

import logging
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Any

from ...errors import GroupCreationError, LayoutError, LayoutMismatchError
from ...plan.arguments import as_timedelta, check_choice, check_count, check_flag, check_names, shown
from ...plan.layout import DEFAULT_ORDER, GROUP_NAMES, Layout, RankGroups, ShardPlan, plan_layout, resolve_order
from ...plan.spec import ShardsInput, ShardSpec, format_shards
from ..agreement import Party, Purpose, Terms, arrive_failed, convene, decided_without_me, meet
from ..groups.create import create_groups, destroy_groups
from ..groups.strategy import Strategy, choose_strategy
from ..groups.window import Window, open_window
from ..torch_state import dist, group_counter, import_torch, is_fake_world, set_group_counter
from .backend import Backend
from .plugins import get_backend

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
    layout: Layout = field(repr=False)
    """The whole layout the shard belongs to (what refit plans over)."""
    groups: dict[str, Any] = field(default_factory=dict, repr=False)
    """Group name -> this rank's ProcessGroup (None where not created or not a member)."""
    group_ranks: RankGroups = field(default_factory=dict, repr=False)
    """Group name -> the global ranks of this rank's group, as planned."""
    handle: Any = None
    is_member: bool = False
    window: Window | None = field(default=None, repr=False)
    """On member ranks: creates the window's own groups after the build (see ``engine.window``)."""
    _created: list[Any] = field(default_factory=list, repr=False)

    @property
    def ranks(self) -> range:
        """The shard's global ranks."""
        return self.plan.ranks

    def new_group(self, ranks: Sequence[int], **options: Any) -> Any:
        """A group of this window's ranks, created by the window alone, safe beside other windows.

        Use it instead of ``dist.new_group`` after the build: every rank of this shard's window
        (not of the world) calls it, with the same ranks, in the same order.

        Args:
            ranks: global ranks inside the shard.
            **options: ``timeout``, ``backend``, ``pg_options``, ``group_desc``.

        Returns:
            The ProcessGroup on its members, None on the window's other ranks.

        Raises:
            GroupCreationError: not a member rank, ranks outside the shard, or a window rank
                absent or asking for something else within the timeout.
        """
        return self._window().new_group(ranks, **options)

    def new_groups(self, rows: Sequence[Sequence[int]], **options: Any) -> Any:
        """Disjoint groups of this window in one agreement (Megatron's enumerate-all pattern); this rank's one.

        Raises:
            GroupCreationError: as ``new_group``, or overlapping rows.
        """
        return self._window().new_groups(rows, **options)

    def _window(self) -> Window:
        if self.window is None:
            raise GroupCreationError(
                f"this rank is not a member of shard {self.index} (ranks {self.ranks.start}..{self.ranks.stop - 1}): "
                f"only the shard's ranks create its groups (use my_shard(shards))"
            )
        return self.window


BUILD = Purpose("build", "build_shards", GroupCreationError)


@dataclass(frozen=True)
class BuildTerms(Terms):
    """What every rank must bring to a build: the same layout, backend, groups and strategy."""

    KIND = "build"
    HIDDEN = ("layout", "group_counter")

    layout: str
    """The layout's fingerprint: equal layouts, equal fingerprints."""
    spec: str
    """The layout's shards as a spec string, to show a person what differs."""
    order: str
    rank_offset: int
    backend: str
    group_names: tuple[str, ...]
    strategy: str
    group_counter: int
    """torch's default-mode group counter: ranks start the build from the highest one brought."""

    def same_plan(self, other: BuildTerms) -> bool:
        """True when only the strategy or counter differ (not a layout mismatch)."""
        return (self.layout, self.backend, self.group_names) == (other.layout, other.backend, other.group_names)

    def same_build(self, other: BuildTerms) -> bool:
        """True when only the group counter differs: the ranks can build, from the highest counter."""
        return self.same_plan(other) and self.strategy == other.strategy


def _require_initialized() -> None:
    try:
        import_torch()
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
    strategy: Strategy,
    names: tuple[str, ...] | None,
    backend_options: Mapping[str, Any],
) -> tuple[Backend, Layout, tuple[str, ...], Strategy]:
    """Everything a rank checks on its own before meeting the others: backend, layout, options, strategy.

    ``names`` are the requested group names (None: those the backend's handle uses).
    """
    chosen = get_backend(backend)
    names = names if names is not None else _group_names(chosen.group_names)
    layout = (
        shards
        if isinstance(shards, Layout)
        else plan_layout(total_world_size, shards, order=order, rank_offset=rank_offset, allow_idle=allow_idle)
    )
    if layout.world_size != total_world_size:
        raise LayoutError(f"the layout plans {layout.world_size} ranks but total_world_size={total_world_size}")
    check_options(chosen, backend_options)
    chosen.validate(layout, backend_options)
    chosen_strategy, why = choose_strategy(strategy)
    log.info("shardcore: strategy %s: %s", chosen_strategy, why)
    return chosen, layout, names, chosen_strategy


def build_shards(
    total_world_size: int,
    shards: ShardsInput | Layout,
    *,
    backend: str | None = None,
    order: str = DEFAULT_ORDER,
    rank_offset: int = 0,
    allow_idle: bool = False,
    strategy: str = Strategy.AUTO,
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
        strategy: ``auto`` (default: ``world`` where torch creates groups with every rank, as
            with a device-bound default group, else ``local``; logged), ``local`` (members create
            their own groups; refused where it would hang) or ``world`` (every rank creates every
            group, Megatron's pattern).
        timeout: seconds (or a timedelta) to wait for other ranks: above 0 and at most a week;
            default 5 minutes.
        groups: the standard group names to create (default: ``Backend.group_names``, those
            the handle uses); the others stay None.
        **backend_options: options of the chosen backend (``Backend.options`` lists them).

    Returns:
        One ``Shard`` per shard in spec order; ``groups`` and ``handle`` are set on member ranks.

    Raises:
        ShardSpecError, LayoutError: a bad spec, layout, argument, group name or backend option;
            the arguments are checked before torch.distributed is touched.
        BackendNotFoundError, BackendUnavailableError: the backend is missing or cannot work here.
        LayoutMismatchError: ranks planned different layouts.
        GroupCreationError: torch.distributed is not initialised, a rank is missing, dead or
            slow past ``timeout``, or group creation failed.
    """
    wait, asked = _check_arguments(total_world_size, backend, order, rank_offset, allow_idle, strategy, timeout)
    names = None if groups is None else _group_names(groups)
    _require_initialized()
    fake = is_fake_world()
    party = None if fake else Party.world()
    try:  # a rank that fails here still arrives, with its error, so the others stop and name it
        rank = _require_world(total_world_size)
        chosen, layout, names, chosen_strategy = _plan(
            total_world_size, shards, backend, order, rank_offset, allow_idle, asked, names, backend_options
        )
    except BaseException as error:
        if party is not None:
            arrive_failed(party, BUILD, None, "planned", error, wait)
        raise
    epoch = 0
    if party is None:
        log.info("shardcore: fake backend, ranks cannot see each other: agreement checks skipped")
    else:
        epoch = _agree(party, layout, chosen.name, names, chosen_strategy, wait)
    built, created = _create(layout, rank, chosen, names, chosen_strategy, epoch, wait, backend_options, party)
    if party is not None:
        try:
            meet(party, BUILD, epoch, "built", wait)
        except BaseException:
            destroy_groups(created)
            raise
    return built


def _agree(
    party: Party, layout: Layout, backend: str, names: tuple[str, ...], strategy: Strategy, wait: timedelta
) -> int:
    """The build's first meeting: every rank brings the same terms; returns the build's epoch.

    Ranks that differ only in torch's group counter (a failed build left one behind) all go on from
    the highest counter brought.

    Raises:
        LayoutMismatchError: ranks planned different layouts, backends or groups.
        GroupCreationError: ranks agree on the layout but not the strategy; or a rank is missing or failed.
    """
    spec = format_shards([plan.spec for plan in layout.shards])
    mine = BuildTerms(
        layout.fingerprint(), spec, str(layout.order), layout.rank_offset, backend, names, strategy, group_counter()
    )
    outcome = convene(party, BUILD, mine.encode(), wait)
    if outcome.groups is None:
        return outcome.epoch
    values = [BuildTerms.decode(value) for _, value in outcome.groups]
    if all(v is not None and values[0] is not None and values[0].same_build(v) for v in values):
        counter = max(v.group_counter for v in values if v is not None)
        if counter != mine.group_counter:  # a failed build left this rank behind: catch up
            set_group_counter(counter)
        return outcome.epoch
    same_plan = all(v is not None and values[0] is not None and values[0].same_plan(v) for v in values)
    error = GroupCreationError if same_plan else LayoutMismatchError
    message = BuildTerms.disagreement(
        dist().get_rank(),
        outcome.groups,
        f"at the start of build {outcome.epoch}",
        "Every rank must call build_shards with the same spec, order, backend, groups and strategy",
    )
    raise error(message, sorted(r for ranks, _ in outcome.groups[1:] for r in ranks))


def _create(
    layout: Layout,
    rank: int,
    chosen: Backend,
    names: tuple[str, ...],
    strategy: Strategy,
    epoch: int,
    wait: timedelta,
    backend_options: Mapping[str, Any],
    party: Party | None,
) -> tuple[list[Shard], list[Any]]:
    """Create this rank's groups and handles; on any failure arrive with the error, then destroy what was created.

    In that order: destroying deletes this rank's connect keys, and a member still inside ``new_group``
    may not have read them yet (it would wait out the timeout). Arriving with ``stay`` waits until every
    rank has reached the meeting, so past creating, or until the meeting times out.
    """
    extras = {plan.index: chosen.extra_groups(plan, backend_options) for plan in layout.shards}
    created: list[Any] = []
    deadline = time.monotonic() + wait.total_seconds()

    def abandoned() -> bool:  # only past the deadline can the others have given up: no store call before it
        return party is not None and time.monotonic() > deadline and decided_without_me(party, epoch, "built")

    try:
        ranks_by_name, process_groups = create_groups(
            layout, rank, extras, strategy, wait, names, created=created, abandoned=abandoned
        )
        result = []
        for plan in layout.shards:
            shard = Shard(plan.index, plan.spec, plan.rank_offset, plan.size, plan, layout, dict.fromkeys(GROUP_NAMES))
            if rank in plan:
                shard.is_member, shard.group_ranks, shard._created = True, ranks_by_name, created
                shard.window = open_window(plan.ranks, epoch, wait, created)
                shard.groups.update(process_groups)
                shard.handle = chosen.make_handle(plan, rank, shard.groups, backend_options)
            result.append(shard)
    except BaseException as error:
        if party is not None:
            arrive_failed(party, BUILD, epoch, "built", error, wait, stay=True)
        destroy_groups(created)
        raise
    return result, created


def _check_arguments(
    total_world_size: object,
    backend: object,
    order: object,
    rank_offset: object,
    allow_idle: object,
    strategy: object,
    timeout: object,
) -> tuple[timedelta, Strategy]:
    """Every plain argument of build_shards, before torch is touched: (the timeout, the strategy).

    ``order``, ``rank_offset`` and ``allow_idle`` are checked even where a Layout makes them unused,
    so that a bad call fails alike whatever ``shards`` is.
    """
    check_count("total_world_size", total_world_size)
    if backend is not None and not isinstance(backend, str):
        raise LayoutError(f"backend={shown(backend)}: expected a backend name (a string) or None")
    resolve_order(order)  # type: ignore[arg-type]  # checked there
    check_count("rank_offset", rank_offset, minimum=0)
    check_flag("allow_idle", allow_idle)
    return as_timedelta(timeout), check_choice("strategy", strategy, Strategy)


def _group_names(names: Sequence[str] | None) -> tuple[str, ...]:
    """The standard group names to create, in creation order; None means all 15."""
    return GROUP_NAMES if names is None else check_names("groups", names, GROUP_NAMES)


def check_options(backend: Backend, options: Mapping[str, Any]) -> None:
    """Reject options the backend does not declare, before any rank communicates.

    Raises:
        LayoutError: an unknown option, naming the ones the backend accepts.
    """
    unknown = sorted(set(options) - set(backend.options))
    if unknown:
        accepted = ", ".join(backend.options) or "none"
        raise LayoutError(
            f"unknown option(s) {shown(', '.join(map(str, unknown)))} for backend {shown(backend.name)}: "
            f"it accepts {accepted}"
        )


def _check_shards(shards: object) -> Sequence[Shard]:
    if not isinstance(shards, Sequence) or not all(isinstance(shard, Shard) for shard in shards):
        raise LayoutError(f"shards={shown(shards)}: expected the list of Shard that build_shards returned")
    return shards


def my_shard(shards: Sequence[Shard]) -> Shard | None:
    """This rank's shard, or None on an idle rank.

    Raises:
        LayoutError: ``shards`` is not what build_shards returned.
    """
    return next((shard for shard in _check_shards(shards) if shard.is_member), None)


def destroy_shards(shards: Sequence[Shard]) -> None:
    """Destroy exactly the groups ``build_shards`` created on this rank.

    Local to the rank (no communication); call it on every rank that built, idle ranks
    included, before building again or destroying the default group.

    Raises:
        LayoutError: ``shards`` is not what build_shards returned.
    """
    for shard in _check_shards(shards):
        destroy_groups(shard._created)
        if shard.window is not None:
            shard.window.close()
        shard._created = []
        shard.groups = {name: None for name in shard.groups}
        shard.handle = None


__all__ = ["Shard", "build_shards", "check_options", "destroy_shards", "my_shard"]
