"""The pluggy hook surface: one registrar hook through which plugins add backends.

A backend distribution registers a module under the entry-point group
``shardcore.backends`` (entry-point name = backend name) and implements::

    from shardcore import hookimpl

    @hookimpl
    def shardcore_register_backends(register):
        register(MyBackend())
"""

from __future__ import annotations

from collections.abc import Callable

import pluggy

from .backend import Backend

PROJECT = "shardcore"
hookspec = pluggy.HookspecMarker(PROJECT)
hookimpl = pluggy.HookimplMarker(PROJECT)


@hookspec
def shardcore_register_backends(register: Callable[[Backend], None]) -> None:
    """Call ``register(backend)`` once for each backend this plugin provides.

    Called when backends are listed or one is selected; do no heavy imports here:
    a backend imports its framework only when it builds or checks availability.
    """
