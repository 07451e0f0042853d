"""The trainer side: this rank's own shards into every engine worker's own slices, over ``connect_refit``.

Two ways in, the same refits underneath:

* ``Trainer``: shardcore's own. Every trainer rank makes one (it joins the refit group) and calls
  ``send(sources, version)`` per update while the engine runs ``update_weights`` (offline: the driver calls
  ``llm.start_weight_update()`` / ``llm.update_weights(...)`` / ``llm.finish_weight_update(...)``).
* ``ShardcoreTrainerEngine``: vLLM's trainer-side API (``TrainerWeightTransferEngine``), registered as
  ``shardcore`` in ``WeightTransferTrainerFactory``: a trainer written against vLLM's API changes only its init
  info. Its sender (rank 0) drives the engine through a ``VLLMWeightSyncClient`` (vLLM's HTTP client, or
  ``LLMClient`` for an ``LLM`` in the same process) while every rank refits.

``sources`` is this rank's local shards by Megatron's global names: from a live Megatron-Core model,
``shardcore_megatron.refit.model_tensors(model)`` (parameters and persistent buffers, experts named as the
manifests name them); or a
dict of tensors. shardcore plans who sends what from the specs alone: no gather on the trainer.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Collection, Iterator, Mapping
from dataclasses import dataclass
from typing import Any, Self

from shardcore import RefitGroup, TransferStats, execute_refit

from .setup import BACKEND, RefitSetup

Sources = Mapping[str, Any]


class Trainer:
    """One trainer rank's end of the refit group; every trainer rank makes one, all with the same setup.

    Joining blocks until every worker of the engine has joined too (its ``init_weight_transfer_engine``).
    """

    def __init__(self, setup: RefitSetup, rank: int) -> None:
        """Join the group and plan the update's partial refits.

        Args:
            setup: The terms both sides share.
            rank: This process's rank in the trainer job.

        Raises:
            RefitGroupError: within the timeout: an engine that never came or disagrees on counts.
            ShardcoreError: a spec or model that does not plan.
        """
        self.setup = setup
        self.group: RefitGroup
        self.group, self.plans = setup.join("trainer", rank)

    def send(self, sources: Sources, version: int | None = None) -> list[TransferStats]:
        """Send one update: every partial refit, in order, while the engine receives it.

        Args:
            sources: This rank's local tensors by Megatron's global names
                (``shardcore_megatron.refit.model_tensors(model)``).
            version: The update's version (the training step), as the engine's ``update_weights`` gets it.

        Returns:
            This rank's TransferStats, one per partial refit.

        Raises:
            RefitPeerError: within the timeout, naming an engine worker that died or never called.
            RefitInputError: a missing or misshapen source (naming it), on both sides before a byte moves.
        """
        options = self.setup.execute_options(version)
        out = []
        for plan in self.plans:
            mine = plan.for_rank(self.group.rank).source_shapes
            chosen = {name: sources[name] for name in mine if name in sources}
            out.append(execute_refit(plan, chosen, {}, options=options, group=self.group))
        return out

    def close(self) -> None:
        """Leave the refit group."""
        self.group.close()


class LLMClient:
    """A ``VLLMWeightSyncClient`` over an offline ``vllm.LLM`` in this process (the four calls), and its
    ``reset_prefix_cache``, which ``ShardcoreTrainerEngine`` calls after each update."""

    def __init__(self, llm: Any) -> None:
        self.llm = llm

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.llm.init_weight_transfer_engine({"init_info": init_info})

    def start_weight_update(self) -> None:
        self.llm.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.llm.update_weights({"update_info": update_info})

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.llm.finish_weight_update(weight_version=weight_version)

    def reset_prefix_cache(self) -> None:
        self.llm.reset_prefix_cache()


class HTTPClient:
    """vLLM's HTTP client (``clients.HTTPVLLMWeightSyncClient``, the RL routes of a server started with
    ``VLLM_SERVER_DEV_MODE=1``) plus ``reset_prefix_cache`` (the dev route ``/reset_prefix_cache``)."""

    def __init__(self, base_url: str, timeout: float = 300) -> None:
        from vllm.distributed.weight_transfer.clients import HTTPVLLMWeightSyncClient

        self.client = HTTPVLLMWeightSyncClient(base_url, timeout)
        self.base_url, self.timeout = base_url.rstrip("/"), timeout

    def init_weight_transfer_engine(self, init_info: dict[str, Any]) -> None:
        self.client.init_weight_transfer_engine(init_info)

    def start_weight_update(self) -> None:
        self.client.start_weight_update()

    def update_weights(self, update_info: Any) -> None:
        self.client.update_weights(update_info)

    def finish_weight_update(self, weight_version: str | None = None) -> None:
        self.client.finish_weight_update(weight_version)

    def reset_prefix_cache(self) -> None:
        import requests

        requests.post(f"{self.base_url}/reset_prefix_cache", timeout=self.timeout).raise_for_status()


def _trainer_bases() -> tuple[type, type, type]:
    from vllm.distributed.weight_transfer.base import TrainerInitInfo, TrainerWeightTransferEngine, WeightSource

    return TrainerInitInfo, TrainerWeightTransferEngine, WeightSource


def _vllm_classes() -> dict[str, Any]:
    """vLLM's trainer-side classes for the ``shardcore`` backend, made on first use (vLLM is imported then)."""
    if _made:
        return _made
    init_base, engine_base, source_base = _trainer_bases()

    @dataclass(frozen=True)
    class ShardcoreTrainerInitInfo(RefitSetup, init_base):  # type: ignore[misc, valid-type]
        """vLLM's ``TrainerInitInfo`` for ``shardcore``: a ``RefitSetup``, and ``rank`` (keyword, vLLM's)."""

        backend = BACKEND

    class ShardSource(source_base):  # type: ignore[misc, valid-type]
        """A ``WeightSource`` of this rank's *local shards* (not full tensors) by Megatron's global names, from
        a live Megatron-Core model, a dict, or a callable returning either."""

        def __init__(self, tensors: Any) -> None:
            self._tensors = tensors

        def tensors(self) -> Sources:
            found = self._tensors() if callable(self._tensors) else self._tensors
            if isinstance(found, Mapping):
                return found
            from shardcore_megatron.refit import model_tensors

            return model_tensors(found)

        def metadata(self) -> list[Any]:
            from vllm.distributed.weight_transfer.base import ParamMeta

            return [ParamMeta(n, t.dtype, tuple(t.shape)) for n, t in self.tensors().items()]

        def __iter__(self) -> Iterator[tuple[str, Any]]:
            return iter(self.tensors().items())

        def held_names(self) -> Collection[str] | None:
            return list(self.tensors())

    class ShardcoreTrainerEngine(engine_base):  # type: ignore[misc, valid-type]
        """vLLM's ``TrainerWeightTransferEngine`` for ``shardcore``; every trainer rank makes one with
        ``WeightTransferTrainerFactory.trainer_init(init_info, client=..., source=ShardSource(model))``."""

        init_info_cls = ShardcoreTrainerInitInfo

        def __init__(self, *, client: Any, source: Any, is_sender: bool, trainer: Trainer) -> None:
            super().__init__(client=client, source=source, is_sender=is_sender)
            self.trainer = trainer
            self.version = 0

        @classmethod
        def trainer_init(cls, init_info: Any, *, client: Any, source: Any = None) -> Self:
            sender = init_info.is_sender
            calls = _Background(client.init_weight_transfer_engine, init_info.to_dict()) if sender else None
            try:
                trainer = Trainer(init_info, init_info.rank)
            finally:
                if calls is not None:
                    calls.join()
            return cls(client=client, source=source, is_sender=init_info.is_sender, trainer=trainer)

        def send_weights(self, version: int | None = None) -> None:
            """One update: the sender starts it on the engine, every rank refits while the engine receives, the
            sender finishes it (the weight version is the update's) and resets the engine's prefix cache (no
            request reuses KV computed with older weights)."""
            self.version = self.version + 1 if version is None else version
            if self.source is None:
                raise ValueError("shardcore's trainer engine needs a source: ShardSource(model or tensors)")
            if self.is_sender:
                self.client.start_weight_update()
            calls = _Background(self.client.update_weights, {"version": self.version}) if self.is_sender else None
            try:
                self.trainer.send(self.source.tensors(), self.version)
            finally:
                if calls is not None:
                    calls.join()
            if self.is_sender:
                self.client.finish_weight_update(weight_version=str(self.version))
                reset = getattr(self.client, "reset_prefix_cache", None)
                if reset is not None:
                    reset()

        def shutdown(self) -> None:
            self.trainer.close()

    _made.update(
        ShardcoreTrainerInitInfo=ShardcoreTrainerInitInfo, ShardSource=ShardSource,
        ShardcoreTrainerEngine=ShardcoreTrainerEngine,
    )  # fmt: skip
    return _made


_made: dict[str, Any] = {}


class _Background:
    """A client call run beside the refit (it returns only once the engine has received), its error re-raised
    on ``join``."""

    def __init__(self, call: Callable[[Any], Any], argument: Any) -> None:
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, args=(call, argument), daemon=True)
        self.thread.start()

    def _run(self, call: Callable[[Any], Any], argument: Any) -> None:
        try:
            call(argument)
        except BaseException as error:  # re-raised in the caller's thread
            self.error = error

    def join(self) -> None:
        self.thread.join()
        if self.error is not None:
            raise self.error


def __getattr__(name: str) -> Any:
    """vLLM's trainer-side classes (``ShardcoreTrainerInitInfo``, ``ShardSource``, ``ShardcoreTrainerEngine``):
    made on first use, so that ``Trainer`` needs no vLLM."""
    if name in ("ShardcoreTrainerInitInfo", "ShardSource", "ShardcoreTrainerEngine"):
        return _vllm_classes()[name]
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["HTTPClient", "LLMClient", "Trainer"]
