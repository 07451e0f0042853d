"""A vLLM worker extension for the tests (``worker_extension_cls``): what landed in the checkpoint-format tensors,
what vLLM's own loaders put there, the engine's figures, the worker's pid."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch


def _wire(tensor: torch.Tensor) -> tuple[list[int], str, bytes]:
    """A tensor as vLLM's RPC carries it back intact: shape, dtype, bytes."""
    return list(tensor.shape), str(tensor.dtype), tensor.detach().contiguous().numpy().tobytes()


class Probe:
    def pid(self) -> int:
        return os.getpid()

    def transfer_stats(self) -> dict[str, Any]:
        return dict(self.weight_transfer_engine.stats)  # type: ignore[attr-defined]

    def capture_landing(self) -> None:
        """From now on, snapshot every layer's checkpoint-format tensors just before vLLM processes them."""
        import shardcore_vllm.engine as engine

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        names = {id(module): name for name, module in model.named_modules()}
        self.landed: dict[str, torch.Tensor] = {}
        if getattr(engine, "_captured", False):
            return
        engine._captured = True  # type: ignore[attr-defined]
        original = engine._layerwise

        def patched() -> Any:
            initialize, info_of, materialize, process = original()

            def snapshot_then_process(layer: Any, info: Any) -> None:
                for name, tensor in layer.named_parameters(recurse=False):
                    self.landed[f"{names[id(layer)]}.{name}"] = tensor.detach().clone()
                process(layer, info)

            return initialize, info_of, materialize, snapshot_then_process

        engine._layerwise = patched  # type: ignore[assignment]

    def landing(self) -> dict[str, tuple[list[int], str, bytes]]:
        return {name: _wire(tensor) for name, tensor in self.landed.items()}

    def loaders_landing(self, folder: str) -> dict[str, tuple[list[int], str, bytes]]:
        """What vLLM's own weight loaders put in the checkpoint-format tensors from the checkpoint in ``folder``
        (every layer materialised and zeroed, its loaders unwrapped, ``model.load_weights``), before processing;
        then vLLM processes them (the engine holds that checkpoint afterwards)."""
        from safetensors.torch import load_file
        from vllm.model_executor.model_loader.reload import finalize_layerwise_reload, initialize_layerwise_reload
        from vllm.model_executor.model_loader.reload.layerwise import (
            _get_original_loader,
            _layerwise_process,
            get_layerwise_info,
        )
        from vllm.model_executor.model_loader.reload.meta import materialize_layer

        model = self.model_runner.get_model()  # type: ignore[attr-defined]
        initialize_layerwise_reload(model)
        layers = []
        for name, layer in model.named_modules():
            info = get_layerwise_info(layer)
            if not info.can_load() or not any(True for _ in layer.parameters(recurse=False)):
                continue
            materialize_layer(layer, info)
            with torch.no_grad():
                for tensor in layer.parameters(recurse=False):
                    tensor.zero_()
                    tensor.weight_loader = _get_original_loader(tensor)  # type: ignore[attr-defined]
            layers.append((name, layer, info))
        weights: dict[str, torch.Tensor] = {}
        for path in sorted(Path(folder).glob("*.safetensors")):
            weights.update(load_file(path))
        model.load_weights(iter(weights.items()))
        out = {
            f"{name}.{tensor_name}": _wire(tensor)
            for name, layer, _ in layers
            for tensor_name, tensor in layer.named_parameters(recurse=False)
        }
        for _, layer, info in layers:
            _layerwise_process(layer, info)
        finalize_layerwise_reload(model, self.model_runner.model_config)  # type: ignore[attr-defined]
        return out
