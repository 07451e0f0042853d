"""argparse pieces: the number flags' types, and a parser whose errors stay short whatever was typed."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from typing import NoReturn

from ..plan.arguments import MAX_SHOWN, MAX_TIMEOUT, as_timedelta, clipped, shown


class Parser(argparse.ArgumentParser):
    """argparse's parser, with its own errors cut short: argparse repeats what was typed in full
    (``invalid choice: '...'``, ``unrecognized arguments: ...``), however long it is."""

    def error(self, message: str) -> NoReturn:
        super().error(clipped(message, 2 * MAX_SHOWN))  # its end lists the choices


def _short(text: str) -> str:
    """The flag's text as typed, or shortened when long (a 5,000-digit number is one line)."""
    return text if len(text) <= 24 else shown(text)


def _number(kind: Callable[[str], float], minimum: float, what: str) -> Callable[[str], float]:
    """An argparse type: ``kind`` parsed and at least ``minimum``; argparse names the flag in its error,
    and a huge value is shown short (never thousands of digits)."""

    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{_short(text)} is not {what}") from None
        if value < minimum:
            raise argparse.ArgumentTypeError(f"{_short(text)} is not {what}")
        return value

    return parse


POSITIVE_INT = _number(int, 1, "a positive integer")
NON_NEGATIVE_INT = _number(int, 0, "a non-negative integer")


def POSITIVE_SECONDS(text: str) -> float:
    """argparse type of --timeout: seconds as build_shards takes them (above 0, finite, at most MAX_TIMEOUT)."""
    try:
        seconds = float(text)
        as_timedelta(seconds)
    except ValueError:  # float() refused it, or as_timedelta (a LayoutError is a ValueError)
        limit = MAX_TIMEOUT.total_seconds()
        raise argparse.ArgumentTypeError(
            f"{_short(text)} is not a positive number of seconds (at most {limit:.0f})"
        ) from None
    return seconds


def missing_flags(args: argparse.Namespace, *flags: str) -> list[str]:
    """The ``flags`` (``--memory-gb``, ``--from``, ...) that were not given; ``--from`` and ``--to`` are
    stored as ``src`` and ``dst``, the others under their argparse name."""
    dests = {"--from": "src", "--to": "dst"}
    return [flag for flag in flags if getattr(args, dests.get(flag, flag[2:].replace("-", "_"))) is None]


__all__ = ["NON_NEGATIVE_INT", "POSITIVE_INT", "POSITIVE_SECONDS", "Parser", "missing_flags"]
