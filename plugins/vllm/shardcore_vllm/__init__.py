"""shardcore as vLLM's weight-transfer backend ``shardcore``.

Engine side: ``LLM(model, weight_transfer_config={"backend": "shardcore"})`` (or ``vllm serve ...
--weight-transfer-config '{"backend": "shardcore"}'``), driven by vLLM's own weight-update calls or routes;
``register`` (the ``vllm.general_plugins`` entry point, which vLLM runs in every process before a model loads)
makes the backend known. Trainer side: ``Trainer`` (shardcore's) or ``ShardcoreTrainerEngine`` (vLLM's
``TrainerWeightTransferEngine`` API), sources from ``shardcore_megatron.refit.model_tensors(model)`` or a dict.

Importing this package imports neither vLLM nor torch; ``register`` imports vLLM's factory only.
"""

from __future__ import annotations

from typing import Any

from .setup import BACKEND, RefitSetup


def register() -> None:
    """Register the ``shardcore`` engine (worker side) and trainer engine with vLLM's factories; idempotent.

    vLLM calls it in every process through the ``vllm.general_plugins`` entry point; calling it again (or
    after vLLM learnt the name some other way) does nothing."""
    from vllm.distributed.weight_transfer.factory import WeightTransferEngineFactory, WeightTransferTrainerFactory

    if BACKEND not in WeightTransferEngineFactory._registry:
        WeightTransferEngineFactory.register_engine(BACKEND, "shardcore_vllm.engine", "ShardcoreWeightTransferEngine")
    if BACKEND not in WeightTransferTrainerFactory._registry:
        WeightTransferTrainerFactory.register_engine(BACKEND, "shardcore_vllm.trainer", "ShardcoreTrainerEngine")


def __getattr__(name: str) -> Any:
    """The trainer side's names, loaded on first use (``trainer`` needs torch; its vLLM classes need vLLM)."""
    if name not in _TRAINER_NAMES:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    import importlib

    return getattr(importlib.import_module(f"{__name__}.trainer"), name)


_TRAINER_NAMES = frozenset(
    {"HTTPClient", "LLMClient", "ShardSource", "ShardcoreTrainerEngine", "ShardcoreTrainerInitInfo", "Trainer"}
)


__all__ = [
    "BACKEND",
    "HTTPClient",
    "LLMClient",
    "RefitSetup",
    "ShardSource",
    "ShardcoreTrainerEngine",
    "ShardcoreTrainerInitInfo",
    "Trainer",
    "register",
]
