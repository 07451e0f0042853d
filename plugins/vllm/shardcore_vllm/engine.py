"""The engine side: a vLLM ``WeightTransferEngine`` that receives each worker's own slices through shardcore.

vLLM creates one per worker (``LLM(..., weight_transfer_config={"backend": "shardcore"})``) and drives it with
its own calls: ``init_weight_transfer_engine`` joins the refit group, ``start_weight_update`` /
``update_weights`` / ``finish_weight_update`` run one update.

Where the bytes land: never in the tensors vLLM already processed (on CPU every linear weight is packed into a
oneDNN handle and left an empty Parameter; quantized methods transform theirs too). vLLM's layerwise reload
(``start_weight_update`` puts every layer back on the meta device in the checkpoint format) is the way in: for
each partial refit of the update (consecutive layers up to two layers' bytes, or tensors outside them), this worker
materialises the layers it writes, zeroed (the vocabulary padding rows stay zero, as vLLM's loader leaves
them), shardcore's executor writes this worker's own slices into them, and vLLM's own per-layer processing runs
on them at once. So the extra memory at any moment is at most about two layers' checkpoint-format tensors (plus
what vLLM's processing of them allocates), not the model's.

vLLM 0.32 exposes the layerwise reload's steps publicly except the one that processes a layer whose tensors
were filled without its weight loaders (``reload.layerwise._layerwise_process``, which vLLM's own weight
loaders reach): it is looked up once and its absence is a typed error naming the vLLM version.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from typing import Any

import torch
from vllm.distributed.weight_transfer.base import (
    WeightTransferEngine,
    WeightTransferInitInfo,
    WeightTransferUpdateInfo,
)

from shardcore import RefitGroup, RefitInputError, ShardcoreError, execute_refit, parse_shards

from .setup import RefitSetup


@dataclass(frozen=True)
class ShardcoreInitInfo(RefitSetup, WeightTransferInitInfo):
    """``init_weight_transfer_engine``'s ``init_info`` for the ``shardcore`` backend: a ``RefitSetup`` under the
    base vLLM parses init info into (``RefitSetup.to_dict()`` makes its fields, on either side)."""


@dataclass
class ShardcoreUpdateInfo(WeightTransferUpdateInfo):
    """``update_weights``' ``update_info``: the update's version (the training step), recorded by shardcore."""

    version: int | None = None


def _layerwise() -> tuple[Any, Any, Any, Any]:
    """vLLM's layerwise-reload steps: (start, info of a layer, materialise a layer, process a layer)."""
    import vllm
    from vllm.model_executor.model_loader.reload import layerwise, meta

    process = getattr(layerwise, "_layerwise_process", None)
    if process is None:
        raise ShardcoreError(
            f"vLLM {vllm.__version__}: its layerwise reload has no _layerwise_process; shardcore-vllm is tested "
            "with vLLM 0.32: install that, or a shardcore-vllm made for this vLLM"
        )
    return layerwise.initialize_layerwise_reload, layerwise.get_layerwise_info, meta.materialize_layer, process


class ShardcoreWeightTransferEngine(WeightTransferEngine[ShardcoreInitInfo, ShardcoreUpdateInfo]):
    """Receives this worker's own slices of every update from a shardcore trainer over a refit group.

    ``stats`` holds the last update's figures: ``seconds``, ``bytes_received``, ``refits`` (partial refits run),
    ``agreement_seconds`` (of the refits' time, their two meetings each on the group's store),
    ``peak_landing_bytes`` (the most checkpoint-format bytes materialised at once) and ``peak_buffer_bytes``
    (the executor's staging).
    """

    init_info_cls = ShardcoreInitInfo
    update_info_cls = ShardcoreUpdateInfo

    def __init__(self, config: Any, vllm_config: Any, device: torch.device, model: torch.nn.Module) -> None:
        super().__init__(config, vllm_config, device, model)
        self.group: RefitGroup | None = None
        self.setup: RefitSetup | None = None
        self._plans: list[Any] = []
        self._written: set[str] = set()
        self._sharing: dict[int, list[tuple[str, torch.nn.Module, str]]] = {}
        self.stats: dict[str, Any] = {}

    def init_transfer_engine(self, init_info: ShardcoreInitInfo) -> None:
        """Join the refit group as this worker's engine rank and plan the update's partial refits.

        Raises:
            RefitInputError: an engine spec whose tp or pp is not vLLM's (before joining: the trainer is told
                within its timeout that this engine never came).
            RefitGroupError: within the timeout: nobody serves the address, or the jobs disagree on counts.
        """
        setup: RefitSetup = init_info
        parallel = self.parallel_config
        specs = parse_shards(setup.engine_spec)
        spec = specs[0]
        if len(specs) != 1 or spec.tp != parallel.tensor_parallel_size or spec.pp != parallel.pipeline_parallel_size:
            raise RefitInputError(
                f"engine_spec {setup.engine_spec!r}: this vLLM engine runs tensor_parallel_size="
                f"{parallel.tensor_parallel_size}, pipeline_parallel_size={parallel.pipeline_parallel_size}; give "
                f"the engine's own spec, e.g. 'tp={parallel.tensor_parallel_size}'"
            )
        self.shutdown()
        rank = torch.distributed.get_rank() if torch.distributed.is_initialized() else 0
        group, self._plans = setup.join("engine", rank, parallel.world_size)
        self.group, self.setup = group, setup
        self._written = {
            name.rpartition(".")[0] for plan in self._plans for name in plan.for_rank(group.rank).destination_shapes
        }

    def start_weight_update(self) -> None:
        """Put the model's layers back in the checkpoint format, on the meta device (vLLM's layerwise reload)."""
        initialize, info_of, *_ = _layerwise()
        initialize(self.model)
        self._sharing = {}
        for owner, layer in self.model.named_modules():
            kernel = info_of(layer).kernel_tensors
            for attribute, tensor in (kernel[0] if kernel else {}).items():
                self._sharing.setdefault(id(tensor), []).append((owner, layer, attribute))

    def update_weights(self, update_info: dict[str, Any]) -> None:
        """One update; unlike the base class, no ``torch.accelerator.synchronize()`` without an accelerator (it
        raises on a CPU-only torch)."""
        self.receive_weights(self.parse_update_info(update_info))
        if torch.accelerator.is_available():
            torch.accelerator.synchronize()

    def receive_weights(self, update_info: ShardcoreUpdateInfo) -> None:
        """Run the update's partial refits in order, each layer processed by vLLM as soon as it has landed.

        On failure (a trainer rank died, bad terms) the layers not yet written get their old weights back
        (vLLM's finalize), the group is closed (connect again with ``init_weight_transfer_engine``), and the
        typed error is raised.

        Raises:
            RefitError: from shardcore: ``RefitPeerError`` naming a trainer rank that died or never came,
                ``RefitInputError`` / ``RefitMismatchError`` when the two sides' terms differ.
        """
        if self.group is None or self.setup is None:
            raise RefitInputError(
                "update_weights before init_weight_transfer_engine: join the trainer's refit group first"
            )
        _, info_of, materialize, process = _layerwise()
        options = self.setup.execute_options(update_info.version)
        started, received, peak_landing, peak_buffer, agreement = time.monotonic(), 0, 0, 0, 0.0
        try:
            for plan in self._plans:
                layers, destinations = self._materialized(plan, self.group.rank, info_of, materialize)
                peak_landing = max(peak_landing, sum(t.nbytes for t in destinations.values()))
                stats = execute_refit(plan, {}, destinations, options=options, group=self.group)
                received += stats.bytes_received
                agreement += stats.agreement_seconds
                peak_buffer = max(peak_buffer, stats.peak_buffer_bytes)
                layers += self._tied(destinations, info_of, materialize)
                del destinations
                for layer in layers:
                    process(layer, info_of(layer))
        except BaseException:
            self.finish_weight_update()
            self.shutdown()
            raise
        self.stats = {
            "version": update_info.version,
            "seconds": time.monotonic() - started,
            "bytes_received": received,
            "refits": len(self._plans),
            "agreement_seconds": agreement,
            "peak_landing_bytes": peak_landing,
            "peak_buffer_bytes": peak_buffer,
        }

    def _materialized(self, plan: Any, rank: int, info_of: Any, materialize: Any) -> tuple[list[Any], dict[str, Any]]:
        """The layers group rank ``rank`` writes in ``plan``, materialised and zeroed, and their tensors by name.

        A name the model does not have is left out: the executor then names it on both sides."""
        layers: dict[str, torch.nn.Module] = {}
        destinations: dict[str, torch.Tensor] = {}
        for name in plan.for_rank(rank).destination_shapes:
            owner, _, attribute = name.rpartition(".")
            try:
                layer = self.model.get_submodule(owner)
            except AttributeError:
                continue
            if owner not in layers:
                info = info_of(layer)
                if info.can_load():
                    materialize(layer, info)
                    with torch.no_grad():
                        for tensor in layer.parameters(recurse=False):
                            tensor.zero_()
                    layers[owner] = layer
            tensor = getattr(layer, attribute, None)
            if isinstance(tensor, torch.Tensor) and not tensor.is_meta:
                destinations[name] = tensor.data
        return list(layers.values()), destinations

    def _tied(self, written: dict[str, torch.Tensor], info_of: Any, materialize: Any) -> list[torch.nn.Module]:
        """The layers that share a written tensor and that no refit writes (a tied ``lm_head``), materialised and
        given the same checkpoint-format bytes, so that vLLM processes each of them too.

        vLLM's layerwise reload gives each layer a tensor of its own, so a tie is broken while it runs: left alone,
        a tied head would keep what vLLM made of the old weights (on CPU its oneDNN copy)."""
        out = []
        for name, tensor in written.items():
            owner, _, attribute = name.rpartition(".")
            kernel = info_of(self.model.get_submodule(owner)).kernel_tensors
            shared = kernel[0].get(attribute) if kernel else None
            for other_owner, other, other_attribute in self._sharing.get(id(shared), []) if shared is not None else []:
                info = info_of(other)
                if other_owner in self._written or not info.can_load():
                    continue
                materialize(other, info)
                getattr(other, other_attribute).data.copy_(tensor)
                out.append(other)
        return out

    def finish_weight_update(self) -> None:
        """Process what is left (attention layers, anything no refit wrote keeps its weights): vLLM's finalize."""
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload

        finalize_layerwise_reload(self.model, self.model_config)

    def shutdown(self) -> None:
        """Leave the refit group (the engine keeps serving with the weights it holds)."""
        if self.group is not None:
            self.group.close()
            self.group = None


__all__ = ["ShardcoreInitInfo", "ShardcoreUpdateInfo", "ShardcoreWeightTransferEngine"]
