"""The one-way import rule, read from the source: every import statement, those inside functions too.

The rule (stated once more in ``docs/design.md`` and in ``shardcore/__init__.py``):

* ``cli`` -> ``engine`` -> ``refit`` -> ``plan``, and ``views`` -> ``plan``; ``replan`` (elastic re-layout)
  sits on ``refit`` and ``views``, and only ``engine`` and ``cli`` import it; every part may use ``errors``;
* ``plan``, ``views``, ``refit`` and ``replan`` never import torch or numpy, not even lazily;
* the shipped plugins import only the public API: ``shardcore`` and its subpackages' ``__init__``,
  never a module inside them (``shardcore.engine.backends.shards``);
* no module imports one that imports it back (no cycles).
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PACKAGE = ROOT / "shardcore"
PLUGINS = sorted(path for path in ROOT.glob("plugins/*/shardcore_*") if (path / "__init__.py").is_file())
"""The plugins' packages (not the ``*.egg-info`` folders an editable install leaves beside them)."""
TORCH_FREE = ("plan", "views", "refit", "replan")
"""Subpackages that must run without torch or numpy."""
LEAVES = {"errors", "version"}
"""Modules every part may import: they import nothing of shardcore."""
MAY_IMPORT = {
    "plan": {"plan", *LEAVES},
    "views": {"plan", "views", *LEAVES},
    "refit": {"plan", "refit", *LEAVES},
    "replan": {"plan", "views", "refit", "replan", *LEAVES},
    "engine": {"plan", "refit", "replan", "engine", *LEAVES},
    "cli": {"plan", "views", "refit", "replan", "engine", "cli", *LEAVES},
}
"""For each subpackage, the shardcore parts it may import."""


def _module_name(path: Path, base: Path) -> str:
    return ".".join(path.relative_to(base.parent).with_suffix("").parts).removesuffix(".__init__")


def _imports(path: Path, base: Path = PACKAGE) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in one module: ``from a import b`` yields a and a.b."""
    module = _module_name(path, base)
    package = module if path.name == "__init__.py" else module.rsplit(".", 1)[0]
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(parts + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
            found += [(node.lineno, f"{name}.{alias.name}") for alias in node.names]
    return found


def _modules(part: str) -> list[Path]:
    return sorted((PACKAGE / part).rglob("*.py"))


def _all_modules() -> dict[str, Path]:
    return {_module_name(path, PACKAGE): path for path in sorted(PACKAGE.rglob("*.py"))}


@pytest.mark.parametrize("part", TORCH_FREE)
def test_torch_free_parts_never_import_torch_or_numpy(part: str) -> None:
    bad = [
        f"{path.relative_to(PACKAGE)}:{line} imports {name}"
        for path in _modules(part)
        for line, name in _imports(path)
        if name.split(".")[0] in {"torch", "numpy"}
    ]
    assert not bad, bad


@pytest.mark.parametrize("part", sorted(MAY_IMPORT))
def test_imports_go_one_way(part: str) -> None:
    bad = []
    for path in _modules(part):
        for line, name in _imports(path):
            parts = name.split(".")
            if (
                parts[0] == "shardcore"
                and len(parts) > 1
                and not parts[1].startswith("__")
                and parts[1] not in MAY_IMPORT[part]
            ):
                bad.append(f"{path.relative_to(PACKAGE)}:{line} imports {name}")
    assert not bad, bad


@pytest.mark.parametrize("plugin", PLUGINS, ids=lambda path: path.name)
def test_plugins_use_only_the_public_api(plugin: Path) -> None:
    public = {"shardcore", *(f"shardcore.{path.parent.name}" for path in PACKAGE.glob("*/__init__.py"))}
    modules = _all_modules()
    bad = []
    for path in sorted(plugin.rglob("*.py")):
        for line, name in _imports(path, plugin):
            if name.startswith("shardcore.") and name not in public and name in modules:
                bad.append(f"{path.relative_to(ROOT)}:{line} imports {name}")
    assert not bad, bad


def test_no_module_imports_itself_back() -> None:
    """No cycle among the package's modules (a package's ``__init__`` re-exporting its children is not one)."""
    modules = _all_modules()
    edges = {
        name: {target for _, target in _imports(path) if target in modules and target != name}
        for name, path in modules.items()
    }
    edges = {name: {t for t in targets if not t.startswith(f"{name}.")} for name, targets in edges.items()}
    cycles = []
    for start in modules:
        stack, seen = [(start, (start,))], set()
        while stack:
            node, trail = stack.pop()
            for target in edges[node]:
                if target == start:
                    cycles.append(" -> ".join((*trail, start)))
                elif target not in seen:
                    seen.add(target)
                    stack.append((target, (*trail, target)))
    assert not cycles, sorted(cycles)[:5]


def test_relative_imports_resolve_to_absolute_names() -> None:
    """Without this the rules above could pass vacuously: ``from ..errors`` must read as shardcore.errors."""
    names = [name for _, name in _imports(PACKAGE / "plan" / "layout.py")]
    assert "shardcore.plan.grid" in names and "shardcore.errors" in names
    assert "shardcore.engine.backends.backend" in [
        name for _, name in _imports(PACKAGE / "engine" / "backends" / "shards.py")
    ]


def test_no_check_is_an_assert_that_python_dash_o_removes() -> None:
    """Neither the package nor a plugin uses ``assert`` or ``__debug__``, so ``python -O`` runs every check
    (the core env also runs the bad-input tests under ``-O``, as a user's optimised process would)."""
    found = []
    for path in [*PACKAGE.rglob("*.py"), *(path for plugin in PLUGINS for path in plugin.rglob("*.py"))]:
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Assert) or (isinstance(node, ast.Name) and node.id == "__debug__"):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}")
    assert not found, found
