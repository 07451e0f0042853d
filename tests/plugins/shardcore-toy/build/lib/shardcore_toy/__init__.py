"""A minimal third-party backend: discovered through its entry point, no shardcore code change.

Its handle is a plain dict ``{group name: group size}`` of the rank's live groups,
read back from the process groups the engine created.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import Any

from shardcore import Backend, hookimpl


class ToyBackend(Backend):
    name = "toy"
    description = "test backend: a dict of group sizes"

    def make_handle(
        self, plan: Any, rank: int, groups: Mapping[str, Any], options: Mapping[str, Any]
    ) -> dict[str, int]:
        return {name: group.size() for name, group in groups.items() if group is not None}


@hookimpl
def shardcore_register_backends(register: Callable[[Backend], None]) -> None:
    register(ToyBackend())
