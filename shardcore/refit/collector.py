"""The cyclic garbage collector paused while a refit's many small tuples are made.

A model's weight maps hold half a million links and a plan a million tiles and runs: tuples that live on and
make no cycles. Each full collection pass on the way walks every object of the process, which cost as much as
making them (weight maps: 1.6 of 4.5 s for DeepSeek-V3's). Reference counting still frees what dies.
"""

from __future__ import annotations

import gc
from collections.abc import Iterator
from contextlib import contextmanager


@contextmanager
def gc_paused() -> Iterator[None]:
    """The cyclic garbage collector off inside, as it was after (see the module doc); nests."""
    if not gc.isenabled():
        yield
        return
    gc.disable()
    try:
        yield
    finally:
        gc.enable()


__all__ = ["gc_paused"]
