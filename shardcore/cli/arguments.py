"""argparse pieces: the number flags' types, a parser whose errors stay short whatever was typed, and the
flags several commands share (declared here once, so their type, default and help agree everywhere)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Callable, Mapping, Sequence
from typing import Any, NoReturn

from ..engine.live.launch import LIVE_CHECK_TIMEOUT
from ..plan.arguments import MAX_SHOWN, MAX_TIMEOUT, as_timedelta, clipped, did_you_mean, shown
from ..plan.layout import DEFAULT_ORDER, ORDER_ALIASES, Order

ORDER_HELP = (
    "how ranks map to coordinates, innermost first: tp-cp-dp-pp keeps each pipeline stage's ranks "
    "contiguous (Megatron's default); tp-cp-pp-dp (alias tp-pp-dp) keeps each data-parallel replica "
    "contiguous, Megatron's use_tp_pp_dp_mapping (default: %(default)s)"
)
ALLOW_IDLE_HELP = "allow ranks after the last shard to stay idle"
DEFAULT_NPROC = 8
"""Local gloo processes a live check starts when --nproc is not given."""


ERROR = "shardcore: error:"
"""How every error line of the command starts, argparse's usage errors too (argparse's own
prefix names the subcommand: ``shardcore plan: error:``)."""


class Parser(argparse.ArgumentParser):
    """argparse's parser, strict about option names and short in its errors, the one owner of both for every
    command and subcommand (argparse makes each subparser of this class).

    - No abbreviations (``allow_abbrev=False``): ``--shard`` is not taken for ``--shards``, so a flag added
      later never changes what an old command line means.
    - An unknown option is named first, with the closest known one (``--nprocs``: did you mean ``--nproc``?),
      before argparse would report a required flag as missing (``plan --wrold 8`` names ``--wrold``).
    - Errors are cut short (argparse repeats what was typed in full: ``invalid choice: '...'``) and
      prefixed as every other error.
    """

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_known_args(  # type: ignore[override]
        self, args: Sequence[str] | None = None, namespace: argparse.Namespace | None = None
    ) -> tuple[argparse.Namespace, list[str]]:
        unknown = self._unknown_option(sys.argv[1:] if args is None else list(args))
        if unknown is not None:
            known = [option for option in self._option_string_actions if option.startswith("--")]
            self.error(f"unrecognized option {shown(unknown)}{did_you_mean(unknown, known)}")
        return super().parse_known_args(args, namespace)

    def _unknown_option(self, args: list[str]) -> str | None:
        """The first ``--name`` (or ``--name=value``) in ``args`` that this parser does not know, read as
        argparse reads options: up to a lone ``--`` (or, with subcommands, up to the subcommand, which reads
        the rest); a token with a space is a value, never an option."""
        for arg in args:
            if arg == "--" or (self._subparsers is not None and not arg.startswith("-")):
                return None
            name = arg.partition("=")[0]
            if arg.startswith("--") and " " not in arg and name not in self._option_string_actions:
                return name
        return None

    def error(self, message: str) -> NoReturn:
        self.print_usage(sys.stderr)
        self.exit(2, f"{ERROR} {clipped(message, 2 * MAX_SHOWN)}\n")  # its end lists the choices


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


def FRACTION(text: str) -> float:
    """argparse type of a fraction: a number from 0 to 1."""
    try:
        value = float(text)
    except ValueError:
        value = -1.0
    if not 0.0 <= value <= 1.0:
        raise argparse.ArgumentTypeError(f"{_short(text)} is not a fraction from 0 to 1")
    return value


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


def lone_flags(args: argparse.Namespace, flags: Mapping[str, str], needed: str) -> str | None:
    """The error for ``flags`` (flag -> argparse name; None or False when not given) given without ``needed``,
    the flag they act with (e.g. ``--check``), or None: such a flag is refused, never silently ignored."""
    given = [flag for flag, dest in flags.items() if getattr(args, dest) not in (None, False)]
    if not given:
        return None
    return f"{', '.join(given)} need{'s' if len(given) == 1 else ''} {needed}"


def add_order_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup) -> None:
    """``--order``: how ranks map to coordinates (plan, check, refit, replan)."""
    parser.add_argument("--order", default=DEFAULT_ORDER, choices=[*map(str, Order), *ORDER_ALIASES], help=ORDER_HELP)


def add_allow_idle_flag(parser: argparse.ArgumentParser, meaning: str = ALLOW_IDLE_HELP) -> None:
    """``--allow-idle``: let ranks after the last shard stay idle (``meaning``: what that means to this command)."""
    parser.add_argument("--allow-idle", action="store_true", help=meaning)


def add_nproc_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, when: str = "") -> None:
    """``--nproc``: the local world of a live check (``when``: the flag it needs, e.g. "with --check: ")."""
    parser.add_argument(
        "--nproc",
        type=POSITIVE_INT,
        default=DEFAULT_NPROC,
        help=f"{when}local gloo processes to start; ignored under torchrun (default: %(default)s)",
    )


def add_timeout_flag(parser: argparse.ArgumentParser | argparse._ArgumentGroup, when: str = "") -> None:
    """``--timeout``: how long a live rank waits for its peers (``when``: the flag it needs, e.g. "with --check: ")."""
    parser.add_argument(
        "--timeout",
        type=POSITIVE_SECONDS,
        default=LIVE_CHECK_TIMEOUT,
        help=f"{when}seconds a rank waits for the others before naming them in an error (default: %(default)s)",
    )


__all__ = [
    "ALLOW_IDLE_HELP",
    "DEFAULT_NPROC",
    "ERROR",
    "NON_NEGATIVE_INT",
    "ORDER_HELP",
    "POSITIVE_INT",
    "POSITIVE_SECONDS",
    "Parser",
    "add_allow_idle_flag",
    "add_nproc_flag",
    "add_order_flag",
    "add_timeout_flag",
    "lone_flags",
    "missing_flags",
]
