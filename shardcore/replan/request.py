"""A replan described by value (``ReplanRequest``): the one place the CLI and ``replan --check``'s workers replan.

``shardcore replan`` builds one from its flags; ``replan --check`` plans its option in the parent from it (bad
input and missing copies fail there, before a process starts) and hands the same request to every worker, which
plans the same option again. Picklable and torch-free.
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import LayoutError
from ..plan.layout import DEFAULT_ORDER, Layout, plan_layout
from ..refit.documents import model_manifest
from ..refit.manifest import Manifest
from .options import DEFAULT_TRAIN_BYTES_PER_PARAM
from .replan import ReplanOption, ReplanResult, replan
from .restore import restore_plan


@dataclass(frozen=True)
class ReplanRequest:
    """What to replan: the old layout, the model, the loss, and the constraints (``replan``'s arguments).

    Attributes:
        model: A preset name, a manifest file (JSON/YAML), or a ``Manifest``.
        shards: The old layout's spec.
        world: Ranks in the old world.
        lost: Old ranks that are gone.
        new_world: The new world's size instead (or as well); None: the survivors.
        order, allow_idle: How the old layout was laid out.
        memory_bytes: Memory per rank for weights (None: no limit).
        ranks_per_node: Node size: groups spanning physical nodes are counted.
        keep: Indices of shards that must keep their spec.
        train_bytes_per_param: What a train shard's rank holds per parameter (``replan``'s).
    """

    model: str | Manifest
    shards: str
    world: int
    lost: tuple[int, ...] = ()
    new_world: int | None = None
    order: str = DEFAULT_ORDER
    allow_idle: bool = False
    memory_bytes: float | None = None
    ranks_per_node: int | None = None
    keep: tuple[int, ...] = ()
    train_bytes_per_param: float = DEFAULT_TRAIN_BYTES_PER_PARAM

    def layout(self) -> Layout:
        """The old layout.

        Raises:
            ShardcoreError: a bad spec or world size.
        """
        return plan_layout(self.world, self.shards, order=self.order, allow_idle=self.allow_idle)

    def result(self) -> ReplanResult:
        """Every option, ranked (``replan``).

        Raises:
            ShardcoreError: a bad spec, loss, model or constraint; ``NoLayoutError`` when nothing fits.
        """
        manifest = self.model if isinstance(self.model, Manifest) else model_manifest(self.model)
        return replan(
            self.layout(),
            manifest,
            lost=self.lost,
            world_size=self.new_world,
            memory_bytes=self.memory_bytes,
            ranks_per_node=self.ranks_per_node,
            keep=list(self.keep),  # named in an error as given on the command line: [5]
            train_bytes_per_param=self.train_bytes_per_param,
        )

    def option(self, number: int = 1) -> ReplanOption:
        """Option ``number`` (1: the best), its restore planned once, so that a part with no surviving copy
        fails here, before anything starts.

        Raises:
            LayoutError: an option number out of range.
            LostWeightsError: a part of a tensor has no surviving copy.
            ShardcoreError: as ``result``.
        """
        options = self.result().options
        if not 1 <= number <= len(options):
            raise LayoutError(f"--option {number}: the replan has options 1 to {len(options)}")
        option = options[number - 1]
        restore_plan(option)
        return option


__all__ = ["ReplanRequest"]
