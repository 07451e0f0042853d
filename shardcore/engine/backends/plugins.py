"""Backend discovery through pluggy entry points, and backend selection."""

from __future__ import annotations

import os
from collections.abc import Callable
from dataclasses import dataclass
from importlib.metadata import entry_points

import pluggy

from ...errors import BackendNotFoundError, BackendUnavailableError, LayoutError
from ...plan.arguments import did_you_mean, shown
from . import hookspecs
from .backend import Backend

ENTRY_POINT_GROUP = "shardcore.backends"
DEFAULT_BACKEND = "dtensor"
BACKEND_ENV = "SHARDCORE_BACKEND"
SHIPPED_BACKENDS = ("dtensor", "megatron", "hyperparallel")
"""Backends whose plugin ships in shardcore's source tree, under ``plugins/NAME``: the one table of them
(tox.ini's envs, pyproject's plugin paths and the CLI's hints are checked against it by
``tests/core/test_shipped_backends.py``)."""


def install_hint(name: str | None = None) -> str:
    """How to install a shipped backend (the default one first when ``name`` is None), from a source checkout."""
    if name is not None:
        return f"pip install ./plugins/{name}"
    others = [backend for backend in SHIPPED_BACKENDS if backend != DEFAULT_BACKEND]
    return f"pip install ./plugins/{DEFAULT_BACKEND} (or {', '.join(others)})"


@dataclass(frozen=True)
class BackendInfo:
    """One installed backend as ``shardcore backends`` lists it."""

    name: str
    distribution: str
    version: str
    available: bool
    reason: str | None
    description: str = ""
    device: str | None = None


def _entry_points(name: str | None = None) -> list:
    found = entry_points(group=ENTRY_POINT_GROUP)
    return [ep for ep in found if name is None or ep.name == name]


class _InProcess:
    """A plugin object registering one backend: what ``register_backend`` adds to the manager."""

    def __init__(self, backend: Backend) -> None:
        self.backend = backend

    @hookspecs.hookimpl
    def shardcore_register_backends(self, register: Callable[[Backend], None]) -> None:
        register(self.backend)


def _new_manager() -> pluggy.PluginManager:
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    return manager


plugin_manager = _new_manager()
"""The process's one manager: entry-point plugins are loaded into it on first use, one name at a time."""


def _collect(manager: pluggy.PluginManager) -> dict[str, Backend]:
    """Every backend the manager's plugins register, by name (the first registration of a name wins)."""
    backends: dict[str, Backend] = {}
    manager.hook.shardcore_register_backends(register=lambda backend: backends.setdefault(backend.name, backend))
    return backends


def register_backend(backend: Backend) -> None:
    """Add a backend in-process, without an entry point (tests, notebooks, embedding apps).

    Raises:
        LayoutError: ``backend`` has no name (a non-empty string).
    """
    name = getattr(backend, "name", None)
    if not isinstance(name, str) or not name:
        raise LayoutError(f"register_backend({shown(backend)}): expected a Backend, whose name is a non-empty string")
    unregister_backend(backend.name)
    plugin_manager.register(_InProcess(backend), name=f"in-process:{backend.name}")


def unregister_backend(name: str) -> None:
    """Remove a backend added with ``register_backend``."""
    plugin = plugin_manager.get_plugin(f"in-process:{name}")
    if plugin is not None:
        plugin_manager.unregister(plugin)


def _installed_names() -> list[str]:
    return sorted({ep.name for ep in _entry_points()} | set(_collect(plugin_manager)))


def _load(name: str) -> Backend | None:
    """The backend called ``name``: registered in-process, else loaded once from its entry point.

    Only that entry point's module is imported (scanning them all costs tens of milliseconds
    and would import every backend's framework).
    """
    backend = _collect(plugin_manager).get(name)
    if backend is not None:
        return backend
    try:
        plugin_manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
    except ImportError as error:
        raise BackendUnavailableError(f"backend {shown(name)} failed to import: {error}") from error
    return _collect(plugin_manager).get(name)


def get_backend(name: str | None = None, *, require_available: bool = True) -> Backend:
    """Select a backend: explicit ``name`` > ``$SHARDCORE_BACKEND`` > ``dtensor``.

    Only the chosen backend's plugin module is imported, once per process.

    Args:
        name: the backend's name, or None for the environment's or the default.
        require_available: raise when the backend is installed but cannot work here.

    Raises:
        BackendNotFoundError: no installed backend has that name.
        BackendUnavailableError: its plugin failed to import, or it cannot work here.
    """
    if name is not None and not isinstance(name, str):
        raise LayoutError(f"backend name {shown(name)}: expected a string or None")
    chosen = name or os.environ.get(BACKEND_ENV) or DEFAULT_BACKEND
    backend = _load(chosen)
    if backend is None:
        raise BackendNotFoundError(_not_found(chosen, from_env=not name and chosen == os.environ.get(BACKEND_ENV)))
    if require_available:
        reason = backend.unavailable_reason()
        if reason:
            raise BackendUnavailableError(f"backend {shown(chosen)} is installed but unavailable here: {reason}")
    return backend


def _not_found(chosen: str, from_env: bool) -> str:
    """Why no backend has that name, and a fix that exists: the install command for a shipped
    backend, else the installed names and the closest one."""
    installed = _installed_names()
    where = f" (from ${BACKEND_ENV})" if from_env else ""
    listing = f"installed: {', '.join(installed)}" if installed else "no backend is installed"
    if chosen in SHIPPED_BACKENDS:
        return f"backend {shown(chosen)}{where} is not installed ({listing}): {install_hint(chosen)}"
    hint = did_you_mean(chosen, [*installed, *SHIPPED_BACKENDS])
    fix = f"set {BACKEND_ENV} to an installed name" if from_env else "choose an installed name"
    return f"no backend named {shown(chosen)}{where}; {listing}{hint} ({fix})"


def list_backends() -> list[BackendInfo]:
    """Every installed backend, available or with the reason it is not and how to fix it."""
    infos: dict[str, BackendInfo] = {}
    for ep in _entry_points():
        distribution = ep.dist.name if ep.dist else "?"
        version = ep.dist.version if ep.dist else "?"
        try:
            plugin_manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=ep.name)
        except Exception as error:  # a broken plugin is listed, not fatal
            infos[ep.name] = BackendInfo(ep.name, distribution, version, False, f"plugin failed to load: {error}")
            continue
        for plugin in plugin_manager.get_plugins():
            if plugin_manager.get_name(plugin) == ep.name:
                for backend in _collect_one(plugin).values():
                    infos[backend.name] = _info(backend, distribution, version)
    for plugin in plugin_manager.get_plugins():
        if isinstance(plugin, _InProcess):
            infos[plugin.backend.name] = _info(plugin.backend, "(in-process)", "-")
    return [infos[name] for name in sorted(infos)]


def _collect_one(plugin: object) -> dict[str, Backend]:
    """The backends one loaded plugin module registers."""
    manager = _new_manager()
    manager.register(plugin)
    return _collect(manager)


def _info(backend: Backend, distribution: str, version: str) -> BackendInfo:
    reason = backend.unavailable_reason()
    note = getattr(backend, "device_note", None)
    device = None
    if reason is None and callable(note):
        try:
            device = note()
        except BackendUnavailableError as error:  # torch itself does not import here (device.device_notes says why)
            reason = str(error)
    return BackendInfo(
        backend.name, distribution, version, reason is None, reason, getattr(backend, "description", ""), device
    )


__all__ = [
    "BACKEND_ENV",
    "DEFAULT_BACKEND",
    "ENTRY_POINT_GROUP",
    "SHIPPED_BACKENDS",
    "BackendInfo",
    "get_backend",
    "install_hint",
    "list_backends",
    "plugin_manager",
    "register_backend",
    "unregister_backend",
]
