"""Checking what callers pass (counts, flags, choices, timeouts), and showing a bad value short.

Every public function and CLI flag checks its arguments through here, so that a bad one is a
typed error naming the argument, the value and what is accepted, instead of a Python error from
deep inside (a ``TypeError``, an ``OverflowError``, or ``ValueError: Exceeds the limit (4300
digits)`` from printing a huge integer). Torch-free: the plan, the engine and the CLI share it.
"""

from __future__ import annotations

import difflib
import math
import re
import reprlib
from collections.abc import Collection, Iterable
from datetime import timedelta
from enum import StrEnum
from numbers import Real
from typing import TypeVar

from ..errors import LayoutError, ShardcoreError

MAX_WORLD_SIZE = 1 << 24
"""Largest world planned, and so the largest size any count may have: far above any cluster,
small enough that a group always fits in memory."""

DEFAULT_TIMEOUT = timedelta(minutes=5)
MAX_TIMEOUT = timedelta(days=7)
"""Longest wait accepted: a rank silent for a week is gone, and far longer waits overflow the
clocks of torch's stores and communicators."""

_LONG_INT_DIGITS = 30
"""Integers with more digits are shown as their first digits and their length."""
MAX_SHOWN = 200
"""Most characters ``shown`` and ``clipped`` give one value, so that a message holding a few of them
stays well under 1 KB, whatever the input (a list of lists of lists, a YAML document of aliases)."""

Choice = TypeVar("Choice", bound=StrEnum)


def _digits(number: int) -> int:
    """Decimal digits of ``number`` without converting it to a string (which fails past 4,300 digits)."""
    number = abs(number)
    estimate = max(1, int(number.bit_length() * math.log10(2)))  # the count is estimate or estimate + 1
    return estimate + 1 if number >= 10**estimate else estimate


class LongNumber:
    """A number written with more digits than Python converts (4,300 by default), kept as its text.

    Parsers (the grammar, JSON, YAML) return it in place of the int, so that the spec's checks can
    name the key it was given for; no shard or world can be that big.
    """

    __slots__ = ("text",)

    def __init__(self, text: str) -> None:
        self.text = text

    @property
    def digits(self) -> int:
        return sum(char.isdigit() for char in self.text)

    def __repr__(self) -> str:
        text = self.text.strip()
        sign = text[0] if text[0] in "+-" else ""
        return f"{sign}{text[len(sign) : len(sign) + 12]}... ({self.digits} digits)"


def number_or_long(text: str) -> int | LongNumber:
    """``int(text)``, or a LongNumber when ``text`` is digits that int() refuses only for their length.

    Raises:
        ValueError: ``text`` is not a number, as from int().
    """
    try:
        return int(text)
    except ValueError:
        if text.strip().lstrip("+-").replace("_", "").isdigit():
            return LongNumber(text)
        raise


class _Short(reprlib.Repr):
    """reprlib, bounded everywhere: long strings say their length, huge integers are never converted."""

    def __init__(self) -> None:
        super().__init__()
        self.maxstring = 60
        self.maxother = 60
        self.maxlong = 60
        self.maxlevel = 3  # reprlib's 6 levels of 6 items each are 6^6 items: 72 KB for a 300-byte document

    def repr_int(self, x: int, level: int) -> str:
        digits = _digits(x)
        if digits <= _LONG_INT_DIGITS:
            return repr(x)
        head = abs(x) // 10 ** (digits - 12)
        return f"{'-' if x < 0 else ''}{head}... ({digits} digits)"

    def repr_str(self, x: str, level: int) -> str:
        text = super().repr_str(x, level)
        return text if len(x) <= self.maxstring else f"{text} ({len(x)} characters)"

    def repr_instance(self, x: object, level: int) -> str:
        try:
            return super().repr_instance(x, level)
        except Exception:  # a repr that itself fails (a huge int inside an unknown type)
            return f"<{type(x).__name__}>"


_short = _Short()


def counted(count: int, singular: str, plural: str | None = None) -> str:
    """``1 rank``, ``2 ranks``, ``1 process``, ``4 processes``."""
    return f"{count} {singular if count == 1 else plural or singular + 's'}"


def did_you_mean(word: str, choices: Iterable[str]) -> str:
    """``; did you mean 'tiny-moe'?`` for the choice closest to ``word`` (any case), or '' when none is close."""
    if len(word) > MAX_SHOWN:  # no name is that long, and difflib's cost grows with it
        return ""
    by_lower = {choice.lower(): choice for choice in choices}
    close = difflib.get_close_matches(word.lower(), list(by_lower), n=1, cutoff=0.6)
    return f"; did you mean {by_lower[close[0]]!r}?" if close else ""


def shown(value: object) -> str:
    """``repr(value)`` for an error message, bounded: never thousands of digits or characters."""
    if isinstance(value, bool) or value is None:
        return repr(value)
    if isinstance(value, int):
        return _short.repr_int(value, 1)
    text = _short.repr(value)
    return text if len(text) <= MAX_SHOWN else f"{text[:MAX_SHOWN]}..."


def clipped(text: str, limit: int = MAX_SHOWN) -> str:
    """``text`` for an error message (a parser's own message), at most about ``limit`` characters: its
    start and its end, where parsers say what they expected and where."""
    if len(text) <= limit:
        return text
    return f"{text[: limit // 2]} ...({len(text) - limit} characters)... {text[-(limit // 2) :]}"


def shortened(text: str, limit: int, separator: str = "; ") -> str:
    """``text`` (another rank's error, say) for a message, about ``limit`` characters at most, cut where a reader
    can tell: its first whole items (the parts ``separator`` joins, such as a rank's problems) and how many were
    left out; a first item too long on its own is cut at a space, not inside a word, and says how much is left
    out.

    >>> shortened("tensor a is missing; tensor b is missing; tensor c is missing", 50)
    'tensor a is missing; ... (2 more left out)'
    """
    if len(text) <= limit:
        return text
    reserve = len(f"{separator}... ({len(text)} characters left out)")
    room = max(limit - reserve, 16)
    items = text.split(separator)
    kept: list[str] = []
    size = 0
    for item in items:
        size += len(item) + (len(separator) if kept else 0)
        if size > room:
            break
        kept.append(item)
    if kept:
        return f"{separator.join(kept)}{separator}... ({len(items) - len(kept)} more left out)"
    cut = text[:room]
    space = cut.rfind(" ")
    cut = (cut[:space] if space > room // 2 else cut).rstrip(" ,;:")
    return f"{cut} ... ({len(text) - len(cut)} characters left out)"


_SHOWN_RUNS = 16
"""Runs of consecutive ranks shown in a message; the rest are counted."""


def shown_ranks(ranks: Iterable[int]) -> str:
    """Ranks for a message, bounded whatever their number: ``[0-3, 6, 8, 9] (7 ranks)``.

    Runs of three or more consecutive ranks are written ``a-b``; after 16 runs, ``...`` and the count.
    """
    ordered = sorted(set(ranks))
    runs: list[list[int]] = []
    for rank in ordered:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    parts = []
    for first, last in runs[:_SHOWN_RUNS]:
        parts += [f"{first}-{last}"] if last - first >= 2 else [str(r) for r in range(first, last + 1)]
    more = ", ..." if len(runs) > _SHOWN_RUNS else ""
    return f"[{', '.join(parts)}{more}] ({len(ordered)} rank{'' if len(ordered) == 1 else 's'})"


def format_bytes(size: float) -> str:
    """Bytes in decimal units, 3 significant digits: '512 B', '4.72 MB', '1.34 TB'."""
    units, step = ("B", "kB", "MB", "GB", "TB"), 0
    while abs(size) >= 1000 and step < len(units) - 1:
        size, step = size / 1000, step + 1
    return f"{size:.0f} B" if step == 0 else f"{size:.3g} {units[step]}"


_SIZE_UNITS = {"": 1, "b": 1, "kb": 10**3, "mb": 10**6, "gb": 10**9, "kib": 1 << 10, "mib": 1 << 20, "gib": 1 << 30}
MAX_SIZE = 1 << 50
"""Largest size accepted in bytes (a petabyte): any larger one is a typo."""


def check_size(name: str, value: object, *, error: type[ShardcoreError] = LayoutError) -> int:
    """``value`` as a whole number of bytes in [0, MAX_SIZE]: an int, or a text such as ``'1MiB'``, ``'512 kB'``
    or ``'4096'`` (units B, kB, MB, GB, KiB, MiB, GiB, any case; a fraction only with a unit).

    Raises:
        LayoutError (or ``error``): naming ``name``, the value and the accepted forms.
    """
    accepted = "expected a size: whole bytes >= 0 or a number with a unit (B, kB, MB, GB, KiB, MiB, GiB), e.g. 1MiB"
    size: int | None = None
    if isinstance(value, int) and not isinstance(value, bool):
        size = value
    elif isinstance(value, str) and len(value) <= 40:
        found = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*", value)
        unit = _SIZE_UNITS.get(found.group(2).lower()) if found else None
        if found and unit is not None and ("." not in found.group(1) or found.group(2)):
            size = int(float(found.group(1)) * unit) if "." in found.group(1) else int(found.group(1)) * unit
    if size is None or not 0 <= size <= MAX_SIZE:
        raise error(f"{name}={shown(value)}: {accepted}; at most 2**50 bytes")
    return size


def check_count(
    name: str,
    value: object,
    *,
    minimum: int = 1,
    maximum: int = MAX_WORLD_SIZE,
    error: type[ShardcoreError] = LayoutError,
) -> int:
    """``value`` as an int in ``[minimum, maximum]``; a bool or any other type is refused.

    Raises:
        LayoutError (or ``error``): naming ``name``, the value and the accepted range.
    """
    if type(value) is int and minimum <= value <= maximum:  # the common case, first: manifests check thousands
        return value
    problem = count_problem(value, minimum=minimum, maximum=maximum)
    if problem is None and isinstance(value, int):
        return value
    raise error(f"{name}={shown(value)}: {problem}")


def count_problem(value: object, *, minimum: int = 1, maximum: int = MAX_WORLD_SIZE) -> str | None:
    """What is wrong with ``value`` as a count in ``[minimum, maximum]`` (None: nothing), for a caller that names
    the value its own way (``refit.options``: by the field, or by the CLI's flag)."""
    if isinstance(value, (LongNumber, bool)) or not isinstance(value, int):
        many = "too many digits; " if isinstance(value, LongNumber) else ""
        return f"{many}expected a whole number from {minimum} to {maximum}"
    if not minimum <= value <= maximum:
        over = value > maximum
        limit = " (shardcore's limit)" if over and maximum == MAX_WORLD_SIZE else ""
        return f"expected a whole number from {minimum} to {maximum}{limit}"
    return None


def check_flag(name: str, value: object) -> bool:
    """``value`` if it is True or False: a string like ``'no'`` is truthy, so it is refused.

    Raises:
        LayoutError: naming ``name`` and the value.
    """
    if not isinstance(value, bool):
        raise LayoutError(f"{name}={shown(value)}: expected True or False")
    return value


def check_choice(name: str, value: object, choices: type[Choice]) -> Choice:
    """``value`` as a member of the string enum ``choices``.

    Raises:
        LayoutError: naming ``name``, the value and every accepted one.
    """
    if isinstance(value, str):
        try:
            return choices(value)
        except ValueError:
            pass
    raise LayoutError(f"{name}={shown(value)}: expected one of {', '.join(choices)}")


def check_names(name: str, value: object, known: tuple[str, ...]) -> tuple[str, ...]:
    """A group name or a collection of them, each one of ``known``; returned in the order of ``known``.

    Raises:
        LayoutError: not names, or an unknown name, naming the accepted ones.
    """
    names = [value] if isinstance(value, str) else value
    if not isinstance(names, Collection) or not all(isinstance(item, str) for item in names):
        raise LayoutError(f"{name}={shown(value)}: expected group names from {', '.join(known)}")
    unknown = [item for item in names if item not in known]
    if unknown:
        raise LayoutError(f"unknown group name {shown(unknown[0])} in {name}: choose from {', '.join(known)}")
    return tuple(item for item in known if item in names)


def as_timedelta(timeout: object, name: str = "timeout") -> timedelta:
    """Seconds (an int or float) or a timedelta, positive, finite and at most MAX_TIMEOUT; None means DEFAULT_TIMEOUT.

    Raises:
        LayoutError: naming ``name``, the value and what is accepted.
    """
    if timeout is None:
        return DEFAULT_TIMEOUT
    accepted = f"expected seconds (a number above 0 and at most {MAX_TIMEOUT.total_seconds():.0f}) or a timedelta"
    if isinstance(timeout, timedelta):
        value = timeout
    elif isinstance(timeout, Real) and not isinstance(timeout, bool):
        seconds = float(timeout) if not isinstance(timeout, int) or _digits(timeout) < 300 else math.inf
        if not (math.isfinite(seconds) and 0 < seconds <= MAX_TIMEOUT.total_seconds()):
            raise LayoutError(f"{name}={shown(timeout)}: {accepted}")
        value = timedelta(seconds=seconds)
    else:
        raise LayoutError(f"{name}={shown(timeout)}: {accepted}")
    if not timedelta(0) < value <= MAX_TIMEOUT:
        raise LayoutError(f"{name}={shown(timeout)}: {accepted}")
    return value


__all__ = [
    "DEFAULT_TIMEOUT",
    "MAX_SHOWN",
    "MAX_SIZE",
    "MAX_TIMEOUT",
    "MAX_WORLD_SIZE",
    "LongNumber",
    "as_timedelta",
    "check_choice",
    "check_count",
    "check_flag",
    "check_names",
    "check_size",
    "clipped",
    "count_problem",
    "counted",
    "did_you_mean",
    "format_bytes",
    "number_or_long",
    "shortened",
    "shown",
    "shown_ranks",
]
