"""The engine: needs torch, imported on use. Group creation, builds, refit execution and the live checks.

Folders by concept (see ``docs/design.md``):

* ``agreement``: the one protocol by which ranks agree before they act (store epochs, failures);
* ``groups/``: creating process groups (``strategy``, ``create``) and window-local groups (``window``);
* ``backends/``: the backend contract and its discovery, and ``build_shards``;
* ``transfer/``: executing a refit plan with point-to-point messages, in one world or over a refit group
  between two jobs (``connect_refit``);
* ``kept_plans``: the plans a one-call refit (the plugins' ``refit()``) keeps across its calls;
* ``survivors``: the survivors' world after ranks are lost (``shrink_group``, or a new world);
* ``live/``: worlds for live checks (``shardcore check``, ``shardcore refit --check``).

What a backend plugin may use is exported here and by ``shardcore``; the modules are private.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from ..refit.options import DEFAULT_BUCKET_BYTES, DEFAULT_MAX_OPS, ExecuteOptions, Verify
    from .backends.backend import Backend
    from .backends.hookspecs import hookimpl
    from .backends.plugins import (
        BACKEND_ENV,
        DEFAULT_BACKEND,
        ENTRY_POINT_GROUP,
        SHIPPED_BACKENDS,
        BackendInfo,
        get_backend,
        install_hint,
        list_backends,
        register_backend,
        unregister_backend,
    )
    from .backends.shards import Shard, build_shards, destroy_shards, my_shard
    from .collectives import all_gather_objects
    from .device import comm_backend, device_type, npu_status
    from .groups.strategy import Strategy
    from .groups.window import Window, window_of
    from .kept_plans import KeptPlans
    from .survivors import SurvivorWorld, form_survivor_world
    from .torch_state import TESTED_TORCH, check_torch_internals, import_torch, live_group_count, torch_internal_missing
    from .transfer.allocate import RefitTensors, allocate_refit, seeded_box
    from .transfer.execute import TransferStats, execute_refit, held_version
    from .transfer.group import RefitGroup, connect_refit
    from .transfer.session import HeldVersion, RefitSession

# Each public name and the module that owns it, imported on first use (PEP 562): ``import shardcore``
# for plan, spec and layout work loads neither the executor nor the plugin discovery, and the executor's
# options (torch-free, owned by ``refit.options``) load without the executor.
_LAZY: dict[str, str] = {
    "BACKEND_ENV": ".backends.plugins",
    "Backend": ".backends.backend",
    "BackendInfo": ".backends.plugins",
    "DEFAULT_BACKEND": ".backends.plugins",
    "DEFAULT_BUCKET_BYTES": "..refit.options",
    "DEFAULT_MAX_OPS": "..refit.options",
    "ENTRY_POINT_GROUP": ".backends.plugins",
    "ExecuteOptions": "..refit.options",
    "HeldVersion": ".transfer.session",
    "KeptPlans": ".kept_plans",
    "RefitGroup": ".transfer.group",
    "RefitSession": ".transfer.session",
    "RefitTensors": ".transfer.allocate",
    "SHIPPED_BACKENDS": ".backends.plugins",
    "Shard": ".backends.shards",
    "Strategy": ".groups.strategy",
    "TESTED_TORCH": ".torch_state",
    "SurvivorWorld": ".survivors",
    "TransferStats": ".transfer.execute",
    "Verify": "..refit.options",
    "Window": ".groups.window",
    "all_gather_objects": ".collectives",
    "allocate_refit": ".transfer.allocate",
    "build_shards": ".backends.shards",
    "check_torch_internals": ".torch_state",
    "comm_backend": ".device",
    "connect_refit": ".transfer.group",
    "destroy_shards": ".backends.shards",
    "device_type": ".device",
    "execute_refit": ".transfer.execute",
    "form_survivor_world": ".survivors",
    "get_backend": ".backends.plugins",
    "held_version": ".transfer.execute",
    "hookimpl": ".backends.hookspecs",
    "import_torch": ".torch_state",
    "install_hint": ".backends.plugins",
    "list_backends": ".backends.plugins",
    "live_group_count": ".torch_state",
    "my_shard": ".backends.shards",
    "npu_status": ".device",
    "register_backend": ".backends.plugins",
    "seeded_box": ".transfer.allocate",
    "torch_internal_missing": ".torch_state",
    "unregister_backend": ".backends.plugins",
    "window_of": ".groups.window",
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(importlib.import_module(_LAZY[name], __name__), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(__all__)


__all__ = [
    "BACKEND_ENV",
    "DEFAULT_BACKEND",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_MAX_OPS",
    "ENTRY_POINT_GROUP",
    "SHIPPED_BACKENDS",
    "TESTED_TORCH",
    "Backend",
    "BackendInfo",
    "ExecuteOptions",
    "HeldVersion",
    "KeptPlans",
    "RefitGroup",
    "RefitSession",
    "RefitTensors",
    "Shard",
    "Strategy",
    "SurvivorWorld",
    "TransferStats",
    "Verify",
    "Window",
    "all_gather_objects",
    "allocate_refit",
    "build_shards",
    "check_torch_internals",
    "comm_backend",
    "connect_refit",
    "destroy_shards",
    "device_type",
    "execute_refit",
    "form_survivor_world",
    "get_backend",
    "held_version",
    "hookimpl",
    "import_torch",
    "install_hint",
    "list_backends",
    "live_group_count",
    "my_shard",
    "npu_status",
    "register_backend",
    "seeded_box",
    "torch_internal_missing",
    "unregister_backend",
    "window_of",
]
