"""shardcore's version (the one place it is written: pyproject.toml reads it from here), and the public
names that moved, each kept one more release as a deprecated alias (CHANGELOG.md lists them).

A moved name is registered by the package that can reach its new home (the top-level ``shardcore``,
which every import of a subpackage runs first), and served by the old module's ``__getattr__`` through
``moved``: so ``shardcore.refit.execute`` still works without ``shardcore.refit`` importing the engine,
even lazily.
"""

from __future__ import annotations

import warnings
from collections.abc import Callable

__version__ = "0.1.0"

_MOVED: dict[tuple[str, str], tuple[str, Callable[[], object]]] = {}


def register_moved(module: str, name: str, new_name: str, resolve: Callable[[], object]) -> None:
    """Keep ``module.name`` working after it moved to ``new_name``; ``resolve()`` returns the object."""
    _MOVED[(module, name)] = (new_name, resolve)


def moved(module: str, name: str) -> object:
    """For ``module``'s ``__getattr__``: the object ``name`` moved to, with a DeprecationWarning naming it.

    Raises:
        AttributeError: ``name`` is no moved name of ``module`` (as for any missing attribute).
    """
    try:
        new_name, resolve = _MOVED[(module, name)]
    except KeyError:
        raise AttributeError(f"module {module!r} has no attribute {name!r}") from None
    warnings.warn(
        f"{module}.{name} is deprecated and goes in the next release: use {new_name}", DeprecationWarning, stacklevel=3
    )
    return resolve()


__all__ = ["__version__", "moved", "register_moved"]
