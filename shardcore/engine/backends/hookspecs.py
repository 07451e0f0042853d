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

    Called when backends are listed or one is selected, in every process, so do no heavy
    imports here: a backend imports its framework only when it builds or checks availability.
    When two plugins register the same name, the first registration wins (pluggy calls the
    most recently registered plugin first, so an in-process ``register_backend`` overrides an
    installed entry point).

    Args:
        register: takes one ``Backend`` (an object with ``name``, ``description`` and
            ``make_handle``; subclass ``shardcore.Backend`` for the defaults).
    """
