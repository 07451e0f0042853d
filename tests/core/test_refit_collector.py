"""The collector paused while a refit's many tuples are made (``refit.collector.gc_paused``): off inside, as it was
after, and what was made inside goes to the oldest generation unscanned, where a full collection still finds its
cycles; never thawing what the process froze itself."""

from __future__ import annotations

import gc
import weakref

from shardcore.refit.collector import gc_paused


class _Node:
    """An object that can be in a cycle and be watched dying."""

    def __init__(self) -> None:
        self.other: _Node | None = None


def test_the_collector_is_off_inside_and_as_it_was_after() -> None:
    assert gc.isenabled()
    with gc_paused():
        assert not gc.isenabled()
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # nested: the outer pause still holds
    assert gc.isenabled()
    gc.disable()
    try:
        with gc_paused():
            assert not gc.isenabled()
        assert not gc.isenabled()  # off before, off after
    finally:
        gc.enable()


def test_what_was_made_inside_is_not_scanned_young_and_its_cycles_are_still_collected() -> None:
    gc.collect()
    with gc_paused():
        kept = [(n, (n, n + 1)) for n in range(50_000)]
        first, second = _Node(), _Node()
        first.other, second.other = second, first  # a cycle, dropped below
        dead = weakref.ref(first)
        del first, second
    assert gc.get_count()[0] < 1_000  # the young generation holds none of the 50,000 tuples
    assert dead() is not None  # no young collection found the cycle
    gc.collect()
    assert dead() is None  # a full one does
    assert len(kept) == 50_000


def test_what_the_process_froze_stays_frozen() -> None:
    gc.collect()
    gc.freeze()
    try:
        frozen = gc.get_freeze_count()
        assert frozen > 0
        with gc_paused():
            made = [(n,) for n in range(10_000)]
        assert gc.get_freeze_count() == frozen and len(made) == 10_000
    finally:
        gc.unfreeze()
