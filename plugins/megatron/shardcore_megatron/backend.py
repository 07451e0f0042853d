"""The Megatron backend: a member rank's groups as a real ``ProcessGroupCollection``."""

from __future__ import annotations

import importlib.util
import os
import warnings
from collections.abc import Callable, Mapping
from dataclasses import fields
from typing import TYPE_CHECKING, Any

from shardcore import GROUP_NAMES, Backend, BackendUnavailableError, ShardPlanLike, hookimpl
from shardcore.plan import Dims

if TYPE_CHECKING:
    from shardcore import Shard

INSTALL_HINT = "pip install 'megatron-core>=0.16.1' einops"


def _has_megatron_core() -> bool:
    """megatron.core is present; looked up on disk, since find_spec("megatron.core") imports megatron."""
    try:
        spec = importlib.util.find_spec("megatron")
    except (ImportError, ValueError):
        return False
    locations = (spec.submodule_search_locations or []) if spec is not None else []
    return any(os.path.isfile(os.path.join(location, "core", "__init__.py")) for location in locations)


def missing_requirement() -> str | None:
    """The first of megatron-core / einops that is not installed, found without importing either."""
    if not _has_megatron_core():
        return "megatron-core"
    try:
        return None if importlib.util.find_spec("einops") is not None else "einops"
    except (ImportError, ValueError):
        return "einops"


def require_available() -> None:
    """Raise BackendUnavailableError, with the install command, when megatron-core or einops is missing."""
    missing = missing_requirement()
    if missing:
        raise BackendUnavailableError(f"{missing} is not installed: {INSTALL_HINT}")


def collection_class() -> type:
    """Megatron's ProcessGroupCollection, imported on first use (megatron.core takes seconds to import)."""
    require_available()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # Transformer Engine / Apex / absl-py absent: harmless here
        from megatron.core.process_groups_config import ProcessGroupCollection
    return ProcessGroupCollection


def collection_fields() -> tuple[str, ...]:
    """The standard group names the installed ProcessGroupCollection has (older releases lack some)."""
    names = {f.name for f in fields(collection_class())}
    return tuple(name for name in GROUP_NAMES if name in names)


def make_collection(groups: Mapping[str, Any]) -> Any:
    """A ProcessGroupCollection with every field Megatron's inference builder sets; absent groups are None."""
    return collection_class()(**{name: groups.get(name) for name in collection_fields()})


class MegatronBackend(Backend):
    """Real Megatron-Core ProcessGroupCollections over each shard's window."""

    name = "megatron"
    description = "Megatron-Core ProcessGroupCollection (tp, cp, pp, dp, mp, ..., embd, pos_embd) per shard"

    def unavailable_reason(self) -> str | None:
        missing = missing_requirement()
        return f"{missing} is not installed: {INSTALL_HINT}" if missing else None

    def load_framework(self) -> None:
        collection_class()

    def make_handle(self, plan: ShardPlanLike, rank: int, groups: Mapping[str, Any], options: Mapping[str, Any]) -> Any:
        return make_collection(groups)


def add_group(shard: Shard, name: str, dims: Dims, *, expert: bool = False, **options: Any) -> Any:
    """Create, after the build, this rank's group along grid ``dims`` and set it on the collection as ``name``.

    Megatron creates extra groups by enumerating a grid's groups on every rank of the world
    (``HyperCommGrid.create_pg``); on a shard's window that is unsafe beside other windows
    (see ``shardcore.engine.groups.window``). Here only the shard's window takes part: every rank of
    the window calls it, with the same arguments, in the same order.

    Args:
        shard: this rank's shard (``my_shard(shards)``) from ``build_shards(..., backend="megatron")``.
        name: the attribute of ``shard.handle`` (a ProcessGroupCollection) that holds the group.
        dims: decoder grid dims (tp, cp, dp, pp), or expert grid dims (expt_tp, ep, expt_dp, pp).
        expert: take the dims from the expert grid.
        **options: ``timeout``, ``backend``, ``pg_options`` (as for ``dist.new_group``).

    Returns:
        This rank's new ProcessGroup.

    Raises:
        LayoutError: an unknown dim.
        GroupCreationError: not a member, or a window rank absent or asking for something else.
    """
    grid = shard.plan.expert_grid if expert else shard.plan.decoder_grid
    group = shard.new_groups(list(grid.iter_groups(dims)), group_desc=name, **options)
    setattr(shard.handle, name, group)
    return group


@hookimpl
def shardcore_register_backends(register: Callable[[Backend], None]) -> None:
    """Register the ``megatron`` backend."""
    register(MegatronBackend())
