"""Test stand-in for Hyper-Parallel's ``hyper_parallel/distributed/mesh.py`` (see the stand-in's README).

``build_meshs`` follows the documented steps: pipeline stages are contiguous windows of
``dp*cp*tp`` ranks, and each rank builds its stage's three meshes with ``init_device_mesh``
over that window only, so each stage creates only its own groups.
"""

from __future__ import annotations

import inspect
from dataclasses import dataclass, field
from math import prod
from typing import Any

import torch.distributed as dist

from hyper_parallel import init_device_mesh


def _init_topology_mesh(mesh_kwargs: dict[str, Any]) -> Any:
    """``init_device_mesh`` with only the keyword arguments it accepts (test fakes accept fewer)."""
    accepted = inspect.signature(init_device_mesh).parameters
    return init_device_mesh(**{k: v for k, v in mesh_kwargs.items() if k in accepted})


def _validate_dense_tp_rank_layout(device_mesh: Any, fsdp_non_moe_mesh: Any) -> None:
    if not hasattr(device_mesh, "rank_list") or not hasattr(fsdp_non_moe_mesh, "rank_list"):
        return
    if tuple(device_mesh["tp"].rank_list) != tuple(fsdp_non_moe_mesh["tp"].rank_list):
        raise ValueError("device_mesh['tp'] and fsdp_non_moe_mesh['tp'] rank groups differ")
    if device_mesh["tp"].get_local_rank() != fsdp_non_moe_mesh["tp"].get_local_rank():
        raise ValueError("device_mesh['tp'] and fsdp_non_moe_mesh['tp'] local ranks differ")


@dataclass
class MeshContext:
    """A pipeline stage's topology and mesh domains."""

    device_mesh: Any = None
    fsdp_non_moe_mesh: Any = None
    fsdp_moe_mesh: Any = None
    dp_size: int = 1
    dp_replicate_size: int = 1
    dp_shard_size: int = 1
    edp_shard_size: int = 1
    tp_size: int = 1
    cp_size: int = 1
    pp_size: int = 1
    ep_size: int = 1
    dp_rank: int = 0
    tp_rank: int = 0
    cp_rank: int = 0
    pp_rank: int = 0
    ep_rank: int = 0
    sequence_parallel: bool = False
    loss_parallel: bool = False

    @property
    def pp_enabled(self) -> bool:
        return self.pp_size > 1

    @property
    def dp_cp_mesh(self) -> Any:
        if self.device_mesh is None:
            return None
        names = tuple(d for d in ("dp", "cp") if d in self.device_mesh.mesh_dim_names)
        sub = self.device_mesh[names[0]] if len(names) == 1 else self.device_mesh[names]
        return sub.flatten("dp_cp") if sub.ndim > 1 else sub

    @property
    def cp_mesh(self) -> Any:
        if self.device_mesh is None or "cp" not in self.device_mesh.mesh_dim_names:
            return None
        return self.device_mesh["cp"]

    def build_meshs(self, device_type: str, world_size: int) -> None:
        """The device, dense-FSDP and expert-FSDP meshes of this rank's pipeline stage."""
        dense = self.dp_size * self.cp_size * self.tp_size
        if dense * self.pp_size != world_size:
            raise ValueError(
                f"dp_size * cp_size * tp_size * pp_size must equal world_size ({dense * self.pp_size} != {world_size})"
            )
        if self.dp_replicate_size * self.dp_shard_size != self.dp_size * self.cp_size:
            raise ValueError("dp_replicate_size * dp_shard_size must equal dp_size * cp_size")
        init_backend = dist.is_initialized()
        stage_rank_list = None
        if init_backend and self.pp_size > 1:
            start = dist.get_rank() // dense * dense
            stage_rank_list = tuple(range(start, start + dense))
        kwargs: dict[str, Any] = {"device_type": device_type, "init_backend": init_backend}
        if init_backend:
            kwargs["rank_list"] = stage_rank_list
        self.device_mesh = _init_topology_mesh(
            {**kwargs, "mesh_shape": (self.dp_size, self.cp_size, self.tp_size), "mesh_dim_names": ("dp", "cp", "tp")}
        )
        dense_rank_list = tuple(self.device_mesh.rank_list) if hasattr(self.device_mesh, "rank_list") else None
        kwargs["rank_list"] = dense_rank_list
        self.fsdp_non_moe_mesh = _init_topology_mesh(
            {
                **kwargs,
                "mesh_shape": (self.dp_replicate_size, self.dp_shard_size, self.tp_size),
                "mesh_dim_names": ("fsdp_replicate", "fsdp_shard", "tp"),
            }
        )
        _validate_dense_tp_rank_layout(self.device_mesh, self.fsdp_non_moe_mesh)
        self.fsdp_moe_mesh = None
        if self.ep_size > 1:
            domain = prod(self.device_mesh.mesh_shape)
            if domain % self.ep_size:
                raise ValueError(f"expert domain {domain} is not divisible by ep_size {self.ep_size}")
            edp = domain // self.ep_size
            if edp % self.edp_shard_size:
                raise ValueError(f"edp size {edp} is not divisible by edp_shard_size {self.edp_shard_size}")
            replicate = edp // self.edp_shard_size
            shape: tuple[int, ...] = (self.edp_shard_size, self.ep_size)
            names: tuple[str, ...] = ("edp_shard", "ep")
            if replicate > 1:
                shape, names = (replicate, *shape), ("edp_replicate", *names)
            self.fsdp_moe_mesh = _init_topology_mesh({**kwargs, "mesh_shape": shape, "mesh_dim_names": names})


@dataclass
class DistributedSetup:
    """The distributed configuration container that holds a MeshContext."""

    mesh_context: MeshContext = field(default_factory=MeshContext)
    strategy_config: Any = None
    pipeline_config: Any = None
    moe_parallel_config: Any = None
    activation_checkpointing: Any = None
    plan_overrides: Any = None
    module_replacements: Any = None
    low_precision_config: Any = None
    fp32_main_params: bool = False


__all__ = ["DistributedSetup", "MeshContext"]
