"""Backend discovery through pluggy entry points, and backend selection."""

from __future__ import annotations

import os
from dataclasses import dataclass
from functools import lru_cache
from importlib.metadata import entry_points

import pluggy

from . import hookspecs
from .errors import BackendNotFoundError, BackendUnavailableError
from .protocols import Backend

ENTRY_POINT_GROUP = "shardcore.backends"
DEFAULT_BACKEND = "dtensor"
BACKEND_ENV = "SHARDCORE_BACKEND"


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


def plugin_manager(name: str | None = None) -> pluggy.PluginManager:
    """A fresh manager with the entry-point plugins loaded: only ``name``'s when given."""
    manager = pluggy.PluginManager(hookspecs.PROJECT)
    manager.add_hookspecs(hookspecs)
    manager.load_setuptools_entrypoints(ENTRY_POINT_GROUP, name=name)
    manager.check_pending()
    return manager


def _collect(manager: pluggy.PluginManager) -> dict[str, Backend]:
    backends: dict[str, Backend] = {}
    manager.hook.shardcore_register_backends(register=lambda backend: backends.setdefault(backend.name, backend))
    return backends


_registered: dict[str, Backend] = {}


def register_backend(backend: Backend) -> None:
    """Add a backend in-process, without an entry point (tests, notebooks, embedding apps)."""
    _registered[backend.name] = backend


def unregister_backend(name: str) -> None:
    """Remove a backend added with ``register_backend``."""
    _registered.pop(name, None)


def _installed_names() -> list[str]:
    return sorted({ep.name for ep in _entry_points()} | set(_registered))


@lru_cache(maxsize=None)
def _load(name: str) -> Backend | None:
    """The backend registered under ``name`` by its entry point, loaded once per process."""
    try:
        return _collect(plugin_manager(name)).get(name)
    except ImportError as error:
        raise BackendUnavailableError(f"backend {name!r} failed to import: {error}") from error


def get_backend(name: str | None = None, *, require_available: bool = True) -> Backend:
    """Select a backend: explicit ``name`` > ``$SHARDCORE_BACKEND`` > ``dtensor``.

    Only the chosen backend's plugin module is imported, once per process (scanning
    entry points costs tens of milliseconds).
    """
    chosen = name or os.environ.get(BACKEND_ENV) or DEFAULT_BACKEND
    backend = _registered.get(chosen) or _load(chosen)
    if backend is None:
        installed = ", ".join(_installed_names()) or "none"
        raise BackendNotFoundError(
            f"no backend named {chosen!r}; installed: {installed}. "
            f"Install one, e.g. pip install ./plugins/{chosen} (or set {BACKEND_ENV} to an installed name)"
        )
    if require_available:
        reason = backend.unavailable_reason()
        if reason:
            raise BackendUnavailableError(f"backend {chosen!r} is installed but unavailable here: {reason}")
    return backend


def list_backends() -> list[BackendInfo]:
    """Every installed backend, available or with the reason it is not and how to fix it."""
    infos: dict[str, BackendInfo] = {}
    for ep in _entry_points():
        distribution = ep.dist.name if ep.dist else "?"
        version = ep.dist.version if ep.dist else "?"
        try:
            backends = _collect(plugin_manager(ep.name))
        except Exception as error:  # a broken plugin is listed, not fatal
            infos[ep.name] = BackendInfo(ep.name, distribution, version, False, f"plugin failed to load: {error}")
            continue
        for backend in backends.values():
            infos[backend.name] = _info(backend, distribution, version)
    for backend in _registered.values():
        infos[backend.name] = _info(backend, "(in-process)", "-")
    return [infos[name] for name in sorted(infos)]


def _info(backend: Backend, distribution: str, version: str) -> BackendInfo:
    reason = backend.unavailable_reason()
    note = getattr(backend, "device_note", None)
    device = note() if reason is None and callable(note) else None
    return BackendInfo(backend.name, distribution, version, reason is None, reason, getattr(backend, "description", ""), device)


__all__ = [
    "BACKEND_ENV",
    "DEFAULT_BACKEND",
    "ENTRY_POINT_GROUP",
    "BackendInfo",
    "get_backend",
    "list_backends",
    "plugin_manager",
    "register_backend",
    "unregister_backend",
]
