"""What both sides of an update agree on (``RefitSetup``), and the per-layer plans both run in the same order.

One refit of the whole model would have every engine rank materialise every layer in the checkpoint format at
once: the whole model's bytes again. So an update is a sequence of partial refits (``plan.subset``), in the same
order on both sides, each of consecutive decoder layers (or tensors outside the layers) whose bytes together
stay within two of the largest layer's: an engine rank holds at most that much checkpoint-format memory at a
time (or one tensor outside the layers, when it is larger, such as the embedding), and vLLM processes each layer
as soon as its refit is done. Each refit costs its meetings, so fewer, larger groups are faster.

Torch-free and vLLM-free: the trainer side imports it without vLLM installed.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Literal

from shardcore import ExecuteOptions, RefitInputError, parse_shards
from shardcore.refit import HFModel, RefitRequest, ShardRefitPlan, manifest_from_hf_config

if TYPE_CHECKING:
    from shardcore import RefitGroup

BACKEND = "shardcore"
"""The name vLLM selects this backend by: ``weight_transfer_config={"backend": "shardcore"}``."""


def _hf_model(model: str | Mapping[str, Any]) -> HFModel:
    """The model of a Hugging Face config given as a path (of ``config.json`` or its folder, ``hf:`` or not) or as
    its contents, parsed once for every plan of an update (``RefitRequest`` takes it as it is).

    Raises:
        RefitInputError: ``model`` is neither a path nor a mapping.
        ManifestError: a config that does not parse.
    """
    if isinstance(model, str):
        return manifest_from_hf_config(model.removeprefix("hf:"))
    if not isinstance(model, Mapping):
        raise RefitInputError(
            f"model {model!r}: expected a Hugging Face config.json path (or its folder), or the config as a dict"
        )
    return manifest_from_hf_config(model)


@dataclass(frozen=True)
class RefitSetup:
    """The terms of the refit group and of its plan, the same on every rank of both jobs.

    Attributes:
        address: ``host:port`` of the TCPStore the trainer's rank 0 serves (``shardcore.connect_refit``).
        trainer_ranks: How many processes the trainer job brings.
        trainer_spec: The trainer's shard spec, e.g. ``"tp=2"`` or ``"tp=2,pp=2,role=train"``.
        engine_spec: The engine's, as vLLM runs it, e.g. ``"tp=2"``: its tp must be vLLM's tensor-parallel size.
        model: The model's Hugging Face config: a ``config.json`` path (or its folder, or ``hf:PATH``), or its
            contents as a dict (JSON-able, so it travels over vLLM's HTTP routes too).
        trainer_layout: How the trainer's ``sources`` are named and split: ``megatron`` (Megatron-Core's global
            names, its tp packing: ``shardcore_megatron.refit.model_tensors(model)``), or ``hf`` / ``hf-stacked``
            (a transformers model's ``state_dict()``, whole on every trainer rank: ``trainer_spec`` tp=1).
        name: The refit group's name on the store (another engine on the same address takes another).
        transport: The collective library the refit group runs on (``connect_refit``'s ``backend``): ``gloo``
            (CPU), ``nccl`` (CUDA) or ``hccl`` (Ascend). Not ``backend``: in vLLM's init info that word is the
            weight-transfer backend's name (``shardcore``).
        timeout: Seconds for joining and for each refit; a peer that dies is named within it.
        options: ``shardcore.ExecuteOptions`` fields (``bucket_bytes``, ``max_ops``, ``verify``), JSON-able.
    """

    address: str
    trainer_ranks: int
    trainer_spec: str
    engine_spec: str
    model: str | dict[str, Any]
    trainer_layout: str = "megatron"
    name: str = "refit"
    transport: str = "gloo"
    timeout: float = 300.0
    options: dict[str, Any] = field(default_factory=dict)

    def engine_ranks(self) -> int:
        """How many workers the engine spec has (tp x pp x ...).

        Raises:
            ShardSpecError: a spec that does not parse.
        """
        return sum(spec.world_size for spec in parse_shards(self.engine_spec))

    def execute_options(self, version: int | None = None) -> ExecuteOptions:
        """The executor's options of one refit.

        Raises:
            RefitInputError: an unknown or bad option (naming it).
        """
        known = set(ExecuteOptions.__dataclass_fields__) - {"timeout", "version"}
        unknown = sorted(set(self.options) - known)
        if unknown:
            raise RefitInputError(f"options: unknown {unknown[0]!r}; expected some of {', '.join(sorted(known))}")
        return ExecuteOptions(**self.options, timeout=self.timeout, version=version)

    def plans(self) -> list[ShardRefitPlan]:
        """The update's partial refits, in the order both sides run them: the tensors before the first layer, the
        decoder layers, then the tensors after, cut into consecutive groups of at most two layers' bytes.

        Raises:
            ShardcoreError: a spec, model or layout that does not plan (a ``ManifestError`` for a config the
                engine's tp does not split, say), the same on both sides.
        """
        request = RefitRequest(
            _hf_model(self.model),
            f"{self.trainer_spec} + {self.engine_spec}",
            0,
            (1,),
            from_layout=self.trainer_layout,
            to_layout="vllm",
        )
        plan = request.plan(self.trainer_ranks + self.engine_ranks())
        before: list[list[str]] = []
        layers: dict[int, list[str]] = {}
        after: list[list[str]] = []
        for tensor in plan.manifest:
            if tensor.layer is not None:
                layers.setdefault(tensor.layer, []).append(tensor.name)
            else:
                (after if layers else before).append([tensor.name])
        units = before + [layers[index] for index in sorted(layers)] + after
        nbytes = {tensor.name: tensor.nbytes for tensor in plan.manifest}
        budget = 2 * max((sum(nbytes[name] for name in layer) for layer in layers.values()), default=0)
        groups: list[list[str]] = []
        held = 0
        for unit in units:
            size = sum(nbytes[name] for name in unit)
            if groups and held + size <= budget:
                groups[-1] += unit
                held += size
            else:
                groups.append(list(unit))
                held = size
        return [plan.subset(names) for names in groups]

    def join(
        self, side: Literal["trainer", "engine"], rank: int, engine_ranks: int | None = None
    ) -> tuple[RefitGroup, list[ShardRefitPlan]]:
        """Join the refit group as ``side``'s ``rank`` and plan the update's partial refits; the group is closed
        again when the plan fails, so that nothing is left joined.

        Args:
            side: ``"trainer"`` or ``"engine"``.
            rank: This process's rank in its own job.
            engine_ranks: The engine's worker count where the engine knows it (vLLM's world size); None: the
                engine spec's.

        Raises:
            RefitGroupError: within the timeout: nobody serves the address, a side never came, or the jobs
                disagree on counts.
            ShardcoreError: a spec or model that does not plan (the same on both sides).
        """
        from shardcore import connect_refit

        group = connect_refit(
            self.address,
            side=side,
            rank=rank,
            trainer_ranks=self.trainer_ranks,
            engine_ranks=self.engine_ranks() if engine_ranks is None else engine_ranks,
            backend=self.transport,
            name=self.name,
            timeout=self.timeout,
        )
        try:
            return group, self.plans()
        except Exception:
            group.close()
            raise

    def to_dict(self) -> dict[str, Any]:
        """The setup as vLLM's init info carries it (JSON-able): the setup's own fields, never a subclass's (the
        trainer's init info adds vLLM's ``rank``, which the engine side does not take)."""
        return {name: value for name, value in asdict(self).items() if name in RefitSetup.__dataclass_fields__}


__all__ = ["BACKEND", "RefitSetup"]
