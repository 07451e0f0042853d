"""shardcore: lay out heterogeneous parallel jobs, build each rank's process groups, move weights between layouts.

Subpackages, imported one way only (``cli`` -> ``engine`` -> ``refit`` -> ``plan``; ``views`` -> ``plan``;
``replan`` -> ``refit``; everything -> ``errors``); ``docs/design.md`` states the rule, and
``tests/core/test_architecture.py`` checks it:

* ``plan``: shard specs, grids, layouts and their node topology, pure index math (no torch, no numpy);
* ``views``: tables and pictures of a plan (no torch);
* ``refit``: manifests, the refit planner and layout search (no torch);
* ``replan``: elastic re-layout after ranks are lost or added (no torch);
* ``engine``: group creation, builds, refit execution, live checks (torch imported on use);
* ``cli``: the ``shardcore`` command.

This module and each subpackage's ``__init__`` are the public API, the one a backend plugin uses.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from .errors import (
    BackendNotFoundError,
    BackendUnavailableError,
    GroupCreationError,
    LayoutError,
    LayoutMismatchError,
    LostWeightsError,
    ManifestError,
    NoLayoutError,
    RefitError,
    RefitGroupError,
    RefitInputError,
    RefitIntegrityError,
    RefitMismatchError,
    RefitPeerError,
    ShardcoreError,
    ShardSpecError,
    ShardSpecWarning,
    TorchInternalsError,
)
from .plan import (
    DEFAULT_ORDER,
    GROUP_NAMES,
    DistinctGroup,
    Grid,
    GridLike,
    GroupName,
    Layout,
    NamedGrids,
    Order,
    ShardPlan,
    ShardPlanLike,
    ShardSpec,
    format_shards,
    parse_shards,
    plan_layout,
)
from .version import __version__, register_moved

if TYPE_CHECKING:
    from .engine import (
        Backend,
        BackendInfo,
        ExecuteOptions,
        RefitGroup,
        RefitTensors,
        Shard,
        Strategy,
        TransferStats,
        allocate_refit,
        build_shards,
        connect_refit,
        destroy_shards,
        execute_refit,
        form_survivor_world,
        get_backend,
        held_version,
        hookimpl,
        list_backends,
        my_shard,
        register_backend,
        unregister_backend,
    )

# The engine's public names load with the engine, on first use: plan, spec and layout work needs no torch
# machinery, no plugin discovery and no refit executor.
_ENGINE_NAMES = frozenset(
    {
        "Backend",
        "BackendInfo",
        "ExecuteOptions",
        "RefitGroup",
        "RefitTensors",
        "Shard",
        "Strategy",
        "TransferStats",
        "allocate_refit",
        "build_shards",
        "connect_refit",
        "destroy_shards",
        "execute_refit",
        "form_survivor_world",
        "get_backend",
        "held_version",
        "hookimpl",
        "list_backends",
        "my_shard",
        "register_backend",
        "unregister_backend",
    }
)


def __getattr__(name: str) -> Any:
    if name not in _ENGINE_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    from . import engine

    value = getattr(engine, name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


def _from_here(name: str) -> Any:
    """A resolver of one of this package's public names (an engine name loads the engine when called)."""
    return lambda: globals().get(name) or __getattr__(name)


# Renamed in 0.1.0 (the engine left shardcore.refit): the old names work for one more release.
for _old, _new in (
    ("execute", "execute_refit"),
    ("TransferStats", "TransferStats"),
    ("RefitInputError", "RefitInputError"),
    ("RefitPeerError", "RefitPeerError"),
):
    register_moved("shardcore.refit", _old, f"shardcore.{_new}", _from_here(_new))
del _old, _new


__all__ = [
    "DEFAULT_ORDER",
    "GROUP_NAMES",
    "Backend",
    "BackendInfo",
    "BackendNotFoundError",
    "BackendUnavailableError",
    "DistinctGroup",
    "ExecuteOptions",
    "Grid",
    "GridLike",
    "GroupCreationError",
    "GroupName",
    "Layout",
    "LayoutError",
    "LayoutMismatchError",
    "LostWeightsError",
    "ManifestError",
    "NamedGrids",
    "NoLayoutError",
    "Order",
    "RefitError",
    "RefitGroup",
    "RefitGroupError",
    "RefitInputError",
    "RefitIntegrityError",
    "RefitMismatchError",
    "RefitPeerError",
    "RefitTensors",
    "Shard",
    "ShardPlan",
    "ShardPlanLike",
    "ShardSpec",
    "ShardSpecError",
    "ShardSpecWarning",
    "ShardcoreError",
    "Strategy",
    "TorchInternalsError",
    "TransferStats",
    "__version__",
    "allocate_refit",
    "build_shards",
    "connect_refit",
    "destroy_shards",
    "execute_refit",
    "form_survivor_world",
    "format_shards",
    "get_backend",
    "held_version",
    "hookimpl",
    "list_backends",
    "my_shard",
    "parse_shards",
    "plan_layout",
    "register_backend",
    "unregister_backend",
]
