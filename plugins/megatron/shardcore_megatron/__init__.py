"""shardcore backend ``megatron``: a Megatron-Core ``ProcessGroupCollection`` per shard.

Importing this package never imports megatron-core; the backend and the drop-in
builders in :mod:`shardcore_megatron.shards` import it only when they build.
"""

from __future__ import annotations

from .backend import INSTALL_HINT, MegatronBackend, add_group, collection_fields, shardcore_register_backends

__all__ = ["INSTALL_HINT", "MegatronBackend", "add_group", "collection_fields", "shardcore_register_backends"]
