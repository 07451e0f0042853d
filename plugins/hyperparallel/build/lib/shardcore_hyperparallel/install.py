"""Which classes a member rank's MeshContext is made of: Hyper-Parallel's own, or compatible fallbacks.

Hyper-Parallel is not on PyPI; a user installs it from source, and its layout has moved
twice (``hyper_models/...``, then ``hyper_parallel/auto_models/...``, now
``hyper_parallel/distributed/mesh.py``, with its DeviceMesh exported at the package root).
Only the current layout is accepted: an older one is a ``BackendUnavailableError`` that
names what was found and what is expected, decided from the installed files alone
(importing Hyper-Parallel imports torch, and maybe torch_npu). Without Hyper-Parallel the
plugin's own dataclasses and torch's DeviceMesh are used.
"""

from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass
from functools import cache
from pathlib import Path
from typing import Any

from shardcore import BackendUnavailableError

from .context import DistributedSetup, MeshContext, build_through_shardcore, flat_dp_cp

CURRENT_LAYOUT = "hyper_parallel/distributed/mesh.py"
"""The one Hyper-Parallel layout this plugin accepts (MeshContext and DistributedSetup live there)."""
OLDER_LAYOUTS = {
    "hyper_parallel/auto_models/components/distributed/infrastructure.py": (
        "Hyper-Parallel's older 'auto_models' layout"
    ),
    "hyper_models/components/distributed/infrastructure.py": "the old 'hyper_models' stub package",
}
"""Where earlier Hyper-Parallel versions kept the two classes, and what to call each in messages."""
INSTALL_FIX = (
    "install Hyper-Parallel from a current checkout (pip install . in a clone of "
    "https://gitcode.com/mindspore/hyper-parallel), or uninstall it to use this plugin's own classes"
)


@dataclass(frozen=True)
class MeshClasses:
    """The classes a member rank's handle is built from, and where they come from."""

    mesh_context: type
    distributed_setup: type
    device_mesh: type
    source: str


def _package_dirs(name: str) -> list[Path]:
    """The directories of an installed top-level package, found without importing it."""
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        return []
    return [] if spec is None else [Path(p) for p in spec.submodule_search_locations or ()]


def installed_layout() -> Path | None:
    """The directory of the installed ``hyper_parallel`` package with the current layout, or None
    when no Hyper-Parallel is installed.

    Raises:
        BackendUnavailableError: an older layout (or the ``hyper_models`` stub) is installed instead.
    """
    current = _package_dirs("hyper_parallel")
    for root in current:
        if (root / "distributed" / "mesh.py").is_file():
            return root
    for top in ("hyper_parallel", "hyper_models"):
        for root in _package_dirs(top):
            for relative, what in OLDER_LAYOUTS.items():
                path = root.parent / relative
                if relative.startswith(f"{top}/") and path.is_file():
                    raise _old_layout(f"{what} ({path})")
            raise _old_layout(f"a package {top!r} at {root} without {CURRENT_LAYOUT.removeprefix('hyper_parallel/')}")
    return None


def _old_layout(found: str) -> BackendUnavailableError:
    return BackendUnavailableError(
        f"found {found}, but the hyperparallel backend needs Hyper-Parallel's current layout, {CURRENT_LAYOUT} "
        f"(MeshContext, DistributedSetup) with hyper_parallel.DeviceMesh: {INSTALL_FIX}"
    )


def _hyper_parallel_classes(root: Path) -> MeshClasses:
    """Hyper-Parallel's classes from a current-layout install, with MeshContext subclassed (see mesh_classes)."""
    try:
        mesh_module = importlib.import_module("hyper_parallel.distributed.mesh")
        package = importlib.import_module("hyper_parallel")
    except Exception as error:  # a broken install: its import error, in one line
        raise BackendUnavailableError(
            f"Hyper-Parallel at {root} failed to import: {type(error).__name__}: {str(error)[:300]}: {INSTALL_FIX}"
        ) from None
    found = {
        "hyper_parallel.distributed.mesh.MeshContext": getattr(mesh_module, "MeshContext", None),
        "hyper_parallel.distributed.mesh.DistributedSetup": getattr(mesh_module, "DistributedSetup", None),
        "hyper_parallel.DeviceMesh": getattr(package, "DeviceMesh", None),
    }
    missing = [name for name, value in found.items() if not isinstance(value, type)]
    if not missing and not callable(getattr(found["hyper_parallel.DeviceMesh"], "from_group", None)):
        missing = ["hyper_parallel.DeviceMesh.from_group"]
    if missing:
        raise BackendUnavailableError(
            f"Hyper-Parallel at {root} lacks {', '.join(missing)}, which its current layout has: {INSTALL_FIX}"
        )
    base: Any = found["hyper_parallel.distributed.mesh.MeshContext"]

    class ShardMeshContext(base):
        """Hyper-Parallel's MeshContext over groups shardcore created: its dp_cp_mesh is the engine's
        dp x cp group and build_meshs builds through shardcore, so neither creates groups itself."""

        @property
        def dp_cp_mesh(self) -> Any:
            return flat_dp_cp(self)

        build_meshs = build_through_shardcore

    setup = found["hyper_parallel.distributed.mesh.DistributedSetup"]
    return MeshClasses(ShardMeshContext, setup, found["hyper_parallel.DeviceMesh"], str(root))  # type: ignore[arg-type]


@cache
def mesh_classes() -> MeshClasses:
    """The classes member ranks' handles are made of here, chosen once per process.

    Hyper-Parallel's own (MeshContext subclassed so that ``dp_cp_mesh`` and ``build_meshs``
    create no groups, DistributedSetup, DeviceMesh) when its current layout is installed;
    else this plugin's dataclasses and torch's DeviceMesh.

    Raises:
        BackendUnavailableError: an older Hyper-Parallel layout is installed, or the current one
            fails to import or lacks one of the classes.
    """
    root = installed_layout()
    if root is not None:
        return _hyper_parallel_classes(root)
    from torch.distributed.device_mesh import DeviceMesh

    return MeshClasses(MeshContext, DistributedSetup, DeviceMesh, "shardcore_hyperparallel (torch's DeviceMesh)")


__all__ = ["CURRENT_LAYOUT", "OLDER_LAYOUTS", "MeshClasses", "installed_layout", "mesh_classes"]
