"""The engine: needs torch, imported on use. Group creation, builds, refit execution and the live checks.

Folders by concept (see the README's design section):

* ``agreement``: the one protocol by which ranks agree before they act (store epochs, failures);
* ``groups/``: creating process groups (``strategy``, ``create``) and window-local groups (``window``);
* ``build/``: the backend contract and its discovery, and ``build_shards``;
* ``transfer/``: executing a refit plan with point-to-point messages;
* ``survivors``: the survivors' world after ranks are lost (``shrink_group``, or a new world);
* ``live/``: worlds for live checks (``shardcore check``, ``shardcore refit --check``).

What a backend plugin may use is exported here and by ``shardcore``; the modules are private.
"""

from __future__ import annotations

from .build.backend import Backend
from .build.hookspecs import hookimpl
from .build.plugins import (
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
from .build.shards import Shard, build_shards, destroy_shards, my_shard
from .device import comm_backend, device_type, npu_status
from .groups.strategy import Strategy
from .groups.window import Window, window_of
from .live.launch import all_gather_objects
from .survivors import SurvivorWorld, form_survivor_world
from .torch_state import live_group_count
from .transfer.execute import (
    DEFAULT_BUCKET_BYTES,
    DEFAULT_MAX_OPS,
    HeldVersion,
    TransferStats,
    Verify,
    execute_refit,
    held_version,
)

__all__ = [
    "BACKEND_ENV",
    "DEFAULT_BACKEND",
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_MAX_OPS",
    "ENTRY_POINT_GROUP",
    "SHIPPED_BACKENDS",
    "Backend",
    "BackendInfo",
    "HeldVersion",
    "Shard",
    "Strategy",
    "SurvivorWorld",
    "TransferStats",
    "Verify",
    "Window",
    "all_gather_objects",
    "build_shards",
    "comm_backend",
    "destroy_shards",
    "device_type",
    "execute_refit",
    "form_survivor_world",
    "get_backend",
    "held_version",
    "hookimpl",
    "install_hint",
    "list_backends",
    "live_group_count",
    "my_shard",
    "npu_status",
    "register_backend",
    "unregister_backend",
    "window_of",
]
