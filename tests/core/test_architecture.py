"""The one-way import rule: cli -> engine -> refit -> plan, views -> plan; the torch-free parts never import torch.

Read from the source (every import statement, including those inside functions), so a lazy
``import torch`` in the plan would fail here even where torch is installed.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[2] / "shardcore"
TORCH_FREE = ("plan", "views", "refit")
"""Subpackages that must run without torch or numpy."""
MAY_IMPORT = {
    "plan": {"plan", "errors"},
    "views": {"plan", "views", "errors"},
    "refit": {"plan", "refit", "errors", "engine"},
    "engine": {"plan", "refit", "engine", "errors"},
    "cli": {"plan", "views", "refit", "engine", "cli", "errors"},
}
"""For each subpackage, the shardcore parts it may import. ``refit`` reaches the engine only for
``shardcore.refit.execute``, imported on first use (the torch-free rule below still holds)."""


def _imports(path: Path) -> list[tuple[int, str]]:
    """(line, absolute module name) of every import in one module of the package."""
    module = ".".join(path.relative_to(PACKAGE.parent).with_suffix("").parts)
    package = module.rsplit(".", 1)[0] if path.name != "__init__.py" else module.removesuffix(".__init__")
    found = []
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found += [(node.lineno, alias.name) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - node.level + 1]
                name = ".".join(base + ([node.module] if node.module else []))
            else:
                name = node.module or ""
            found.append((node.lineno, name))
    return found


def _modules(part: str) -> list[Path]:
    return sorted((PACKAGE / part).rglob("*.py"))


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
            if parts[0] == "shardcore" and len(parts) > 1 and parts[1] not in MAY_IMPORT[part]:
                bad.append(f"{path.relative_to(PACKAGE)}:{line} imports {name}")
    assert not bad, bad


def test_relative_imports_resolve_to_absolute_names() -> None:
    """Without this the rules above could pass vacuously: ``from ..errors`` must read as shardcore.errors."""
    names = [name for _, name in _imports(PACKAGE / "plan" / "layout.py")]
    assert "shardcore.plan.grid" in names and "shardcore.errors" in names
    assert "shardcore.engine.backend" in [name for _, name in _imports(PACKAGE / "engine" / "shards.py")]
