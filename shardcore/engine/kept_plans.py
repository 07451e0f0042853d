"""Plans a one-call refit made, kept across its calls: an RL loop refits the same models every step.

The plugins' ``refit()`` wrappers read a manifest off the models, all-gather it and plan, on every
call; on small models that costs more than the transfer. But the plan is a pure function of what
every rank brings (its tensors' names, shapes, dtypes and placement, the layouts, the planner's
options, the world), so a wrapper hands that to :meth:`KeptPlans.get` as this rank's key and plans
only when some rank's key changed.

Whether to plan is decided by all the ranks together, in one all-gather of two 32-byte digests per
rank (this rank's key, and the set of plans it keeps): a rank whose model changed and a rank whose
model did not would otherwise go different ways, one into the planning all-gather, the other into the
transfer, and wait on each other. A plan is kept under every rank's key at once, so a kept plan is
used only where the whole world brings what it was made from. The executor's start meeting compares
every rank's plan fingerprint besides (``execute_refit``), so a kept plan that disagreed anyway would
be named there before a byte moves.
"""

from __future__ import annotations

import hashlib
import pickle
from collections import OrderedDict
from collections.abc import Callable
from typing import Any, Generic, TypeVar

from ..errors import RefitInputError
from ..plan.arguments import shown
from .collectives import collective_device

T = TypeVar("T")
DIGEST_BYTES = 32
"""sha256: one for the rank's key, one for the set of world keys it keeps a plan under."""
DEFAULT_CAPACITY = 4
"""Plans kept at once: enough for a loop that refits a trainer into a few engines in turn."""


def _digest(value: bytes) -> bytes:
    return hashlib.sha256(value).digest()


class KeptPlans(Generic[T]):
    """Plans kept across calls, each under the keys every rank brought when it was made.

    Every rank of the default group calls :meth:`get` together, as it calls the refit that uses it.

    Attributes:
        builds: Plans made (``build`` called) since this object was created.
        hits: Calls answered by a kept plan.
    """

    def __init__(self, capacity: int = DEFAULT_CAPACITY) -> None:
        """
        Args:
            capacity: How many plans to keep; the least recently used one goes first.

        Raises:
            RefitInputError: ``capacity`` is not a positive int.
        """
        if isinstance(capacity, bool) or not isinstance(capacity, int) or capacity < 1:
            raise RefitInputError(f"KeptPlans capacity must be a positive int, got {shown(capacity)}")
        self.capacity = capacity
        self.builds = 0
        self.hits = 0
        self._plans: OrderedDict[bytes, T] = OrderedDict()

    @property
    def _held(self) -> bytes:
        """The digest of the world keys this rank keeps plans under: ranks that kept different plans differ here."""
        return _digest(b"".join(sorted(self._plans)))

    def get(self, key: Any, build: Callable[[], T]) -> T:
        """The plan made for ``key`` on this rank and every other rank's key: kept, or built now.

        Args:
            key: Everything this rank's part of the plan is made from, picklable (e.g. its records, the
                layouts' fingerprints, the world size). Ranks may bring different keys.
            build: Makes the plan; called on every rank or on none (it may use collectives).

        Returns:
            The kept plan, or the one ``build`` returned (kept from now on).
        """
        import torch
        import torch.distributed as dist

        mine = torch.frombuffer(bytearray(_digest(pickle.dumps(key)) + self._held), dtype=torch.uint8)
        mine = mine.to(collective_device())
        everyone = [torch.empty_like(mine) for _ in range(dist.get_world_size())]
        dist.all_gather(everyone, mine)
        digests = [bytes(t.cpu().tolist()) for t in everyone]
        world_key = _digest(b"".join(d[:DIGEST_BYTES] for d in digests))
        same_plans = len({d[DIGEST_BYTES:] for d in digests}) == 1  # every rank keeps the same plans
        if same_plans and world_key in self._plans:
            self._plans.move_to_end(world_key)
            self.hits += 1
            return self._plans[world_key]
        if not same_plans:  # a rank failed a build the others finished: start afresh together
            self._plans.clear()
        self._plans.pop(world_key, None)  # before building anew: a build that fails here keeps nothing
        plan = build()
        self.builds += 1
        self._plans[world_key] = plan
        while len(self._plans) > self.capacity:
            self._plans.popitem(last=False)
        return plan

    def clear(self) -> None:
        """Forget every plan (on every rank together, or the next call plans afresh everywhere)."""
        self._plans.clear()


__all__ = ["DEFAULT_CAPACITY", "KeptPlans"]
