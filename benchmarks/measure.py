"""Judging and measuring one fuzz input: the fuzz tests and the long fuzz run share it.

Bad input must be answered with a ``ShardcoreError`` whose message is one line under
MAX_MESSAGE_BYTES; from the CLI, with exit status 2 and one such line on stderr (argparse's usage
before it), never a traceback or the catch-all line of an unexpected error.
"""

from __future__ import annotations

import contextlib
import gc
import io
import time
import traceback
import tracemalloc
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from shardcore.errors import ShardcoreError

MAX_MESSAGE_BYTES = 1024
"""Longest error message (or CLI stderr line) accepted, whatever the input."""
UNEXPECTED = "(run with -v for the traceback)"
"""The end of the CLI's line for an exception that is not a ShardcoreError."""


@dataclass(frozen=True)
class Answer:
    """How one input was answered: what was wrong (None when nothing was), and its longest error line."""

    problem: str | None
    message_bytes: int = 0


@dataclass(frozen=True)
class InputCost:
    """What one fuzz input cost, and how it was answered."""

    seconds: float
    peak_bytes: int
    problem: str | None
    message_bytes: int


def _where(error: BaseException) -> str:
    frames = traceback.extract_tb(error.__traceback__)
    return f" at {frames[-1].filename}:{frames[-1].lineno}" if frames else ""


def _judge_lines(text: str) -> Answer:
    longest = max(text.splitlines() or [""], key=lambda line: len(line.encode("utf-8", "replace")))
    size = len(longest.encode("utf-8", "replace"))
    return Answer(f"a {size}-byte line: {longest[:200]!r}..." if size >= MAX_MESSAGE_BYTES else None, size)


def answer(call: Callable[[], Any], cli: bool = False) -> Answer:
    """Run ``call`` once, quietly, and judge how it answered.

    Args:
        call: the input, applied.
        cli: ``call`` runs ``shardcore.cli.main``: its stderr is judged too, and argparse's
            exit status 2 is an answer.
    """
    err = io.StringIO()
    try:
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
            call()
    except ShardcoreError as error:
        message = str(error)
        if "\n" in message:
            return Answer(f"{type(error).__name__} over several lines: {message[:200]!r}", len(message))
        return _judge_lines(message)
    except SystemExit as exit_:
        if not (cli and exit_.code == 2):
            return Answer(f"SystemExit({exit_.code!r})")
    except Exception as error:
        return Answer(f"{type(error).__name__}{_where(error)}: {str(error)[:300]}")
    text = err.getvalue()
    if "Traceback (most recent call last)" in text or UNEXPECTED in text:
        return Answer(f"unexpected error on stderr: {text[-400:]!r}")
    return _judge_lines(text) if cli else Answer(None)


def measure_input(call: Callable[[], Any], cli: bool = False) -> InputCost:
    """Run ``call`` twice, judged by ``answer``: timed (CPU time, immune to a loaded machine; the
    garbage collector paused), then under tracemalloc."""
    gc.disable()  # a collection pass pays for earlier inputs' garbage: not this input's cost
    try:
        started = time.process_time()
        first = answer(call, cli)
        seconds = time.process_time() - started
    finally:
        gc.enable()
    tracemalloc.start()
    try:
        second = answer(call, cli)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    return InputCost(seconds, peak, second.problem or first.problem, max(first.message_bytes, second.message_bytes))


__all__ = ["MAX_MESSAGE_BYTES", "Answer", "InputCost", "answer", "measure_input"]
