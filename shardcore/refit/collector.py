"""The cyclic garbage collector paused while a refit's many small tuples are made.

A model's weight maps hold half a million links and a plan a million tiles and runs: tuples that live on and
make no cycles. Each full collection pass on the way walks every object of the process, which cost as much as
making them (weight maps: 1.6 of 4.5 s for DeepSeek-V3's). Reference counting still frees what dies.

When the pause ends, the next collection would scan everything made during it (a DeepSeek-V3 engine rank's part:
a fifth of making it), and what lives on would be scanned again on its way to the oldest generation. So the objects
then tracked (the process's other young ones with them) go straight into the oldest generation (``gc.freeze`` then
``gc.unfreeze``, which moves lists and scans nothing): a cycle among them is found by the next full collection
instead of a young one. Not when the process froze objects itself (``gc.get_freeze_count()``: a server's, before it
forks, as vLLM does), which ``gc.unfreeze`` would thaw.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off inside, as it was after (see the module doc); nests. What was made inside
    goes into the oldest generation when it ends, unscanned (see the module doc)."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        if gc.get_freeze_count() == 0:  # none of the process's own (a server's objects frozen before it forks)
            gc.freeze()
            gc.unfreeze()
        gc.enable()


__all__ = ["gc_paused"]
