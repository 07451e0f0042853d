"""Shard specs: one model replica set's parallelism, parsed from Megatron's grammar, dicts, JSON or YAML."""

from __future__ import annotations

import os
import re
import sys
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from ..errors import ShardSpecError, ShardSpecWarning
from .arguments import MAX_WORLD_SIZE, LongNumber, check_count, number_or_long, shown
from .loading import load_document, read_text, shown_path

INT_KEYS = ("tp", "pp", "cp", "dp", "ep", "expt_tp")
KEYS = (*INT_KEYS, "role", "name")
ROLES = ("train", "prefill", "decode")
_NAME_FORBIDDEN = set("+;,=")
_FLAT = "a shard list is a flat list of mappings"
_GRAMMAR_SEPARATORS = re.compile(r"[+;,]")
_MISTYPED_COLON = re.compile(r"(^|[+;,])\s*([a-z_]+)\s*:\s*")
_DOCUMENT_SUFFIXES = (".json", ".yaml", ".yml", ".txt")
MAX_SPEC_FILE_BYTES = 1 << 20
"""A shard file is a few lines; a bigger one (or /dev/zero) is a mistake, not a layout."""

ShardsInput = Union[str, "ShardSpec", Mapping[str, Any], Sequence[Union["ShardSpec", Mapping[str, Any], str]]]


def _spelled(text: str) -> str:
    """``text`` for a message, its non-ASCII characters escaped and named: a Cyrillic ``а`` in ``trаin`` looks
    like ``a`` when printed, so the message shows ``'tr\\u0430in'`` and why it is not ``train``."""
    if text.isascii():
        return shown(text)
    odd = sorted({f"U+{ord(char):04X}" for char in text if not char.isascii()})
    escaped = shown(text).encode("ascii", "backslashreplace").decode("ascii")
    return f"{escaped} (non-ASCII {', '.join(odd[:3])}{', ...' if len(odd) > 3 else ''})"


def _role(role: object) -> str:
    """The role in lower case, as Megatron's grammar reads it, in every input format."""
    lowered = role.lower() if isinstance(role, str) else None
    if lowered not in ROLES:
        given = _spelled(role) if isinstance(role, str) else shown(role)
        raise ShardSpecError(f"role={given}: expected one of {', '.join(ROLES)} (any case) or no role")
    return lowered


def _check_name(name: object) -> None:
    """A name is shown in tables, JSON and SVG: printable, so no output is broken or garbled by it."""
    if not isinstance(name, str) or not name.strip() or name != name.strip():
        raise ShardSpecError(f"name={shown(name)}: expected a non-empty string without surrounding spaces")
    if _NAME_FORBIDDEN & set(name):
        raise ShardSpecError(f"name={shown(name)}: a name may not contain any of + ; , =")
    if not name.isprintable():
        bad = next(char for char in name if not char.isprintable())
        raise ShardSpecError(
            f"name={shown(name)}: a name must be printable, without control, format or line-break "
            f"characters (it holds U+{ord(bad):04X})"
        )


@dataclass(frozen=True)
class ShardSpec:
    """The parallelism of one shard; ``expt_tp`` defaults to ``tp``.

    A shard owns ``tp*cp*pp*dp`` contiguous ranks; ``ep`` and ``expt_tp`` refactor the
    same ranks on the expert grid, so ``expt_tp*ep*pp`` must divide the shard size. Every size
    is a whole number from 1 to MAX_WORLD_SIZE, and so is the shard size. ``role`` is one of
    ROLES in any case (stored lower case, as Megatron's grammar does); ``name`` is printable.

    Raises:
        ShardSpecError: a bad size, role or name, or an expert grid that does not tile the shard.
    """

    tp: int = 1
    pp: int = 1
    cp: int = 1
    dp: int = 1
    ep: int = 1
    expt_tp: int = None  # type: ignore[assignment]  # None means tp: resolved in __post_init__
    role: str | None = None
    name: str | None = None

    def __post_init__(self) -> None:
        tp, pp, cp, dp, ep = self.tp, self.pp, self.cp, self.dp, self.ep
        defaulted = self.expt_tp is None
        if defaulted:
            object.__setattr__(self, "expt_tp", tp)
        sizes = (tp, pp, cp, dp, ep, self.expt_tp)
        # the common case in one test (a long spec builds hundreds of thousands); else each size's own error
        if not (type(tp) is type(pp) is type(cp) is type(dp) is type(ep) is type(self.expt_tp) is int) or not (
            min(sizes) >= 1 and max(sizes) <= MAX_WORLD_SIZE
        ):
            for key, value in zip(INT_KEYS, sizes):
                check_count(key, value, error=ShardSpecError)
        if self.role is not None:
            object.__setattr__(self, "role", _role(self.role))
        if self.name is not None:
            _check_name(self.name)
        world_size = tp * cp * pp * dp
        if world_size > MAX_WORLD_SIZE:
            raise ShardSpecError(
                f"tp*cp*pp*dp = {tp}*{cp}*{pp}*{dp} = {shown(world_size)} ranks is over "
                f"shardcore's limit of {MAX_WORLD_SIZE}: shrink the sizes"
            )
        expert = self.expt_tp * ep * pp
        if world_size % expert:
            default = f" (expt_tp defaults to tp = {self.tp}; set expt_tp to change it)" if defaulted else ""
            raise ShardSpecError(
                f"expt_tp*ep*pp = {self.expt_tp}*{self.ep}*{self.pp} = {expert} does not divide "
                f"tp*cp*pp*dp = {self.world_size}{default}; choose ep and expt_tp so that expt_tp*ep "
                f"divides tp*cp*dp = {self.world_size // self.pp}"
            )

    @property
    def world_size(self) -> int:
        """Ranks this shard owns: tp*cp*pp*dp."""
        return self.tp * self.cp * self.pp * self.dp

    @property
    def expt_dp(self) -> int:
        """Expert data-parallel size: the shard's ranks left after expt_tp*ep*pp."""
        return self.world_size // (self.expt_tp * self.ep * self.pp)

    def to_dict(self) -> dict[str, Any]:
        """All sizes, plus role and name where set; ``from_dict`` inverts it."""
        out: dict[str, Any] = {key: getattr(self, key) for key in INT_KEYS}
        for key in ("role", "name"):
            if getattr(self, key) is not None:
                out[key] = getattr(self, key)
        return out

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> ShardSpec:
        """Build from a mapping of the spec keys; an unknown key is a ShardSpecError."""
        if not isinstance(data, Mapping):
            raise ShardSpecError(
                f"a shard must be a mapping of {', '.join(KEYS)}; got {type(data).__name__}: {shown(data)}"
            )
        unknown = [key for key in data if key not in KEYS]
        if unknown:
            raise ShardSpecError(f"unknown shard key {shown(unknown[0])}: allowed keys are {', '.join(KEYS)}")
        return cls(**dict(data))

    def __str__(self) -> str:
        """The spec in Megatron's grammar: keys left at their default are omitted (tp always shown)."""
        parts = [f"tp={self.tp}"]
        parts += [f"{key}={getattr(self, key)}" for key in ("pp", "cp", "dp", "ep") if getattr(self, key) != 1]
        if self.expt_tp != self.tp:
            parts.append(f"expt_tp={self.expt_tp}")
        parts += [f"{key}={getattr(self, key)}" for key in ("role", "name") if getattr(self, key) is not None]
        return ",".join(parts)


def format_shards(shards: Sequence[ShardSpec]) -> str:
    """The spec string that parses back to ``shards``.

    Raises:
        ShardSpecError: an item is not a ShardSpec.
    """
    if (
        not isinstance(shards, Sequence)
        or isinstance(shards, str)
        or not all(isinstance(item, ShardSpec) for item in shards)
    ):
        raise ShardSpecError(f"format_shards takes a sequence of ShardSpec; got {shown(shards)}")
    return "+".join(str(spec) for spec in shards)


def _in_shard(index: int, source: object, error: ShardSpecError) -> ShardSpecError:
    """``error`` prefixed with the shard it is about: its index and how it was given."""
    return ShardSpecError(f"shard {index} ({shown(source)}): {error}")


_PACKAGE_DIR = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep


def _warn(message: str) -> None:
    """A ShardSpecWarning attributed to the first caller outside shardcore (the user's line, not ours)."""
    frame, level = sys._getframe(1), 1
    while frame.f_back is not None and os.path.abspath(frame.f_code.co_filename).startswith(_PACKAGE_DIR):
        frame, level = frame.f_back, level + 1
    warnings.warn(message, ShardSpecWarning, stacklevel=level + 1)


def _parse_value(key: str, value: str) -> Any:
    if key == "role":
        return _role(value)  # each one, as Megatron does, though the last wins
    if key == "name":
        return value
    try:
        number = number_or_long(value)  # as Megatron's parser: '+2', '1_0' and non-ASCII digits are numbers too
    except ValueError:
        raise ShardSpecError(f"{key}={_spelled(value)}: expected a positive integer, e.g. {key}=2") from None
    if isinstance(number, LongNumber):  # Megatron's int() refuses it here, even if a later value would win
        check_count(key, number, error=ShardSpecError)
    elif not value.isascii():  # Megatron's int() reads '４' (full width) as 4: so does shardcore, saying so
        _warn(f"{key}={_spelled(value)} is read as {key}={number}: write the digits in ASCII")
    return number


def _parse_one(index: int, shard: str) -> tuple[ShardSpec, bool]:
    """One non-empty shard of the grammar (``key=value`` items, comma separated), and whether it warned
    (a repeated key, an empty item, a non-ASCII digit).

    Empty items are skipped, so a shard of only commas is a default shard, as in Megatron; one before the
    last item (``tp=4,,pp=2``: a value left out?) is warned about.
    """
    values: dict[str, Any] = {}
    warned = False
    items = shard.split(",")
    for position, item in enumerate(items):
        key, equals, value = item.partition("=")
        key = key.strip()
        if not equals:
            if not key:
                if position < len(items) - 1:
                    warned = True
                    _warn(f"shard {index} ({shown(shard)}): an empty item is skipped, as in Megatron; remove the comma")
                continue
            name, _, typed = (part.strip() for part in key.partition(":"))
            colon = f" (write {name}={typed})" if name in KEYS and typed.isalnum() and len(typed) <= 24 else ""
            raise ShardSpecError(f"bad entry {shown(key)}: expected key=value, e.g. tp=2{colon}")
        if key not in KEYS:
            hint = f" (keys are lower case: {key.lower()})" if key.lower() in KEYS else ""
            raise ShardSpecError(f"unknown key {_spelled(key)}{hint}: allowed keys are {', '.join(KEYS)}")
        if key in values:
            warned = True
            _warn(f"shard {index} ({shown(shard)}): key {key!r} repeated; the last value wins")
        value = value.strip()
        warned |= key in INT_KEYS and not value.isascii()
        values[key] = _parse_value(key, value)
    return ShardSpec(**values), warned


def _parse_grammar(text: str, first: int) -> list[ShardSpec]:
    """Megatron's ``--inference-shards`` grammar: shards split by ``+`` or ``;``, empty ones skipped.

    ``first`` is the index of the first shard, for messages. A shard's text seen before is that
    shard again (specs are immutable): a long spec repeats a few kinds of shard, each parsed once.
    """
    specs: list[ShardSpec] = []
    seen: dict[str, ShardSpec] = {}
    for chunk in text.replace("+", ";").split(";"):
        spec = seen.get(chunk)
        if spec is None:
            shard = chunk.strip()
            if not shard:
                continue
            index = first + len(specs)
            try:
                spec, warned = _parse_one(index, shard)
            except ShardSpecError as error:
                raise _in_shard(index, shard, error) from None
            if not warned:  # a shard that warned (a repeated key) warns each time it appears
                seen[chunk] = spec
        specs.append(spec)
    return specs


def _misspelled_grammar(text: str) -> str | None:
    """Why ``text`` is the grammar mistyped, or None: ``tp:2,pp:2`` (``:`` for ``=``, which no JSON or YAML
    document reads as shards) or ``spec.json`` (a file named without its ``@``)."""
    items = [item.strip() for item in _GRAMMAR_SEPARATORS.split(text) if item.strip()]
    colons = [(key.strip(), value.strip()) for key, _, value in (item.partition(":") for item in items)]
    # 'tp: 2' alone is YAML's one-shard mapping; 'tp:2' and 'tp: 2, pp: 2' are no document of shards
    spaced = len(items) == 1 and " " in items[0]
    if colons and "\n" not in text and not spaced and all(key in KEYS and value for key, value in colons):
        fixed = _MISTYPED_COLON.sub(r"\1\2=", text)
        return f"bad entry {shown(items[0])}: write key=value, e.g. {shown(fixed)} (':' is for JSON or YAML)"
    named = len(items) == 1 and not set("=: ") & set(items[0])
    if named and (Path(items[0]).suffix in _DOCUMENT_SUFFIXES or os.path.isfile(items[0])):
        return f"{shown(items[0])} looks like a file: give a spec file as @{items[0]}"
    return None


def _parse_text(text: str, source: str) -> list[ShardSpec]:
    stripped = text.strip()
    mistyped = None if "=" in stripped else _misspelled_grammar(stripped)
    if mistyped:
        raise ShardSpecError(mistyped)
    # A document starts like a list, a mapping or a comment, or has ':' and no '=' (grammar never
    # has ':' without '='; a shard name may hold ':').
    if stripped[:1] in ("[", "{", "-", "#") or (":" in stripped and "=" not in stripped):
        document = load_document(stripped, source, ShardSpecError, _FLAT)
        if isinstance(document, Mapping):
            document = [document]  # one mapping is one shard, as in parse_shards
        if not isinstance(document, list):
            raise ShardSpecError(
                f"{source} must hold a list of shards (e.g. '- {{tp: 2, role: prefill}}') or one shard; "
                f"got {type(document).__name__}"
            )
        return _from_sequence(document)
    return _parse_grammar(text, 0)


def _from_sequence(items: Sequence[Any]) -> list[ShardSpec]:
    out: list[ShardSpec] = []
    seen: dict[tuple[Any, ...], ShardSpec] = {}  # a long list repeats a few kinds of shard: each checked once
    for item in items:
        if isinstance(item, ShardSpec):
            out.append(item)
        elif isinstance(item, Mapping):
            # equal dicts give the same shard; each value's type is in the key too (True is not 1)
            key: tuple[Any, ...] | None = (*item.items(), *map(type, item.values())) if type(item) is dict else None
            try:
                spec = None if key is None else seen.get(key)
            except TypeError:  # a value that cannot be a key (a list): checked on its own
                spec = key = None
            if spec is None:
                try:
                    spec = ShardSpec.from_dict(item)
                except ShardSpecError as error:
                    raise _in_shard(len(out), dict(item), error) from None
                if key is not None:
                    seen[key] = spec
            out.append(spec)
        elif isinstance(item, str):
            out.extend(_parse_grammar(item, len(out)))
        else:
            raise ShardSpecError(
                f"shard {len(out)}: a shard must be a ShardSpec, a mapping or a spec string; "
                f"got {type(item).__name__}: {shown(item)}"
            )
    return out


def _check_unique_names(shards: Sequence[ShardSpec]) -> None:
    """Names identify shards (in tables, pictures and code): two shards may not share one."""
    first: dict[str, int] = {}
    for index, spec in enumerate(shards):
        if spec.name is None:
            continue
        if spec.name in first:
            raise ShardSpecError(
                f"name={shown(spec.name)} is given to shards {first[spec.name]} and {index}: "
                f"each shard needs its own name"
            )
        first[spec.name] = index


def parse_shards(spec: ShardsInput) -> tuple[ShardSpec, ...]:
    """Parse shards from a spec string, ``@file`` (JSON/YAML/grammar), ShardSpecs or dicts.

    Accepts every string Megatron-Core's ``--inference-shards`` parser accepts, with the same
    meaning, plus ``cp > 1``, ``role=train`` and ``name=``, except sizes over MAX_WORLD_SIZE
    (no world holds them). One mapping (or a document holding one) is one shard. A key repeated
    within a shard of the grammar warns (ShardSpecWarning), and the last value wins, as in Megatron.

    Args:
        spec: a spec string, ``@path`` of a JSON / YAML / grammar file, a ShardSpec, a mapping
            of the spec keys, or a sequence of ShardSpecs, mappings and spec strings.

    Returns:
        The shards, in the order given (at least one).

    Raises:
        ShardSpecError: a malformed spec, naming the shard (its index and text) and the bad key
            and value; an empty spec; two shards with one name.
    """
    if isinstance(spec, ShardSpec):
        shards = [spec]
    elif isinstance(spec, Mapping):
        shards = _from_sequence([spec])
    elif isinstance(spec, str):
        if spec.strip().startswith("@"):
            path = Path(spec.strip()[1:])
            text = read_text(path, "shard file", MAX_SPEC_FILE_BYTES, ShardSpecError, "give a spec file, not data")
            shards = _parse_text(text, f"shard file {shown_path(path)}")
        else:
            shards = _parse_text(spec, "the shard spec")
    elif isinstance(spec, Sequence) and not isinstance(spec, (bytes, bytearray)):
        shards = _from_sequence(spec)
    else:
        raise ShardSpecError(
            f"shards must be a spec string like 'tp=2,role=prefill+tp=4', a list of ShardSpec or dicts; "
            f"got {type(spec).__name__}"
        )
    if not shards:
        raise ShardSpecError("the shard spec is empty: give at least one shard, e.g. 'tp=2'")
    _check_unique_names(shards)
    return tuple(shards)


__all__ = ["INT_KEYS", "KEYS", "ROLES", "ShardSpec", "format_shards", "parse_shards"]
