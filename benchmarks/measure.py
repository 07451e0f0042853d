"""Measuring what one input costs: the fuzz test and the long fuzz run share it."""

from __future__ import annotations

import contextlib
import gc
import io
import time
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardcore.errors import ShardcoreError


@dataclass(frozen=True)
class InputCost:
    """What one fuzz input cost, and any error other than the ones bad input may raise."""

    seconds: float
    peak_bytes: int
    error: BaseException | None


def measure_input(call: Callable[[], Any], allow_exit: bool = False) -> InputCost:
    """Run ``call`` twice, quietly: timed (CPU time, immune to a loaded machine; the garbage collector
    paused), then under tracemalloc.

    A ShardcoreError is the expected answer to bad input, and with ``allow_exit`` so is
    argparse's exit status 2; anything else is returned as ``error``.
    """

    def once() -> BaseException | None:
        try:
            with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
                call()
        except ShardcoreError:
            pass
        except SystemExit as exit_:
            if not (allow_exit and exit_.code == 2):
                return exit_
        except Exception as error:
            return error
        return None

    gc.disable()  # a collection pass pays for earlier inputs' garbage: not this input's cost
    try:
        started = time.process_time()
        error = once()
        seconds = time.process_time() - started
    finally:
        gc.enable()
    tracemalloc.start()
    try:
        error = once() or error
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return InputCost(seconds, peak, error)


__all__ = ["InputCost", "measure_input"]
