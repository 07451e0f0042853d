"""A gloo backend that can shrink: a stand-in for NCCL's communicator shrink, so that torch's ``shrink_group``
runs on CPU.

torch 2.13's gloo says ``supports_shrinking`` False. ``register_shrinkable_gloo()`` registers a backend,
``gloo_shrinkable``, whose groups are ``ProcessGroupGloo``s that say True and whose
``shrink(ranks_to_exclude, shrink_flags, opts)`` connects a gloo group of the remaining ranks through the
group's own store, as NCCL's shrink makes a smaller communicator from its parent. Everything else is
torch's own ``shrink_group``: it checks the ranks, destroys the other groups, replaces the default group
with the shrunk one and renumbers the ranks. For tests and ``shardcore replan --check --shrink`` only: the
shrunk group connects through the store, so the store's host must survive; ``SHRINK_ABORT`` has nothing to
abort (a gloo group left behind is destroyed by torch).
"""

from __future__ import annotations

import hashlib
from datetime import timedelta
from functools import cache
from typing import Any

SHRINKABLE_GLOO = "gloo_shrinkable"
"""The stand-in's backend name, for ``init_process_group``."""
_groups: list[Any] = []
"""Every group the stand-in made: holding the Python object keeps its class (and so ``supports_shrinking``)
visible when torch hands the backend back to Python."""


@cache
def _backend_class() -> type:
    """The stand-in's class, made once torch is imported."""
    import torch.distributed as dist

    class ShrinkableGloo(dist.ProcessGroupGloo):
        def __init__(self, store: Any, rank: int, size: int, timeout: timedelta) -> None:
            super().__init__(store, rank, size, timeout)
            self._store, self._timeout = store, timeout
            _groups.append(self)

        @property
        def supports_shrinking(self) -> bool:
            return True

        def shrink(self, ranks_to_exclude: list[int], shrink_flags: int = 0, opts_override: Any = None) -> Any:
            excluded = set(ranks_to_exclude)
            keep = [rank for rank in range(self.size()) if rank not in excluded]
            name = hashlib.sha256(repr(keep).encode()).hexdigest()[:12]
            store = dist.PrefixStore(f"shrunk/{len(keep)}-{name}/", self._store)
            return ShrinkableGloo(store, keep.index(self.rank()), len(keep), self._timeout)

    return ShrinkableGloo


def _create(store: Any, rank: int, size: int, timeout: timedelta) -> Any:
    return _backend_class()(store, rank, size, timeout)


@cache
def register_shrinkable_gloo() -> str:
    """Register the stand-in with torch.distributed (once per process); returns its name."""
    import torch.distributed as dist

    dist.Backend.register_backend(SHRINKABLE_GLOO, _create, devices=["cpu"])
    return SHRINKABLE_GLOO


__all__ = ["SHRINKABLE_GLOO", "register_shrinkable_gloo"]
