"""Shard specs: one model replica set's parallelism, parsed from Megatron's grammar, dicts, JSON or YAML."""

from __future__ import annotations

import json
import re
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Union

from ..errors import ShardSpecError

INT_KEYS = ("tp", "pp", "cp", "dp", "ep", "expt_tp")
KEYS = (*INT_KEYS, "role", "name")
ROLES = ("train", "prefill", "decode")
_NAME_FORBIDDEN = set("+;,=\n\r\t")

ShardsInput = Union[str, "ShardSpec", Sequence[Union["ShardSpec", Mapping[str, Any], str]]]


def _check_size(key: str, value: object) -> None:
    if isinstance(value, bool) or not isinstance(value, int):
        raise ShardSpecError(f"{key}={value!r}: expected a positive integer, e.g. {key}=2")
    if value < 1:
        raise ShardSpecError(f"{key}={value}: sizes must be positive integers (>= 1)")


@dataclass(frozen=True)
class ShardSpec:
    """The parallelism of one shard; ``expt_tp`` defaults to ``tp``.

    A shard owns ``tp*cp*pp*dp`` contiguous ranks; ``ep`` and ``expt_tp`` refactor the
    same ranks on the expert grid, so ``expt_tp*ep*pp`` must divide the shard size.
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
        for key in ("tp", "pp", "cp", "dp", "ep"):
            _check_size(key, getattr(self, key))
        if self.expt_tp is None:
            object.__setattr__(self, "expt_tp", self.tp)
        _check_size("expt_tp", self.expt_tp)
        if self.role is not None and self.role not in ROLES:
            raise ShardSpecError(f"role={self.role!r}: expected one of {', '.join(ROLES)} (lower case) or no role")
        if self.name is not None:
            if not isinstance(self.name, str) or not self.name.strip() or self.name != self.name.strip():
                raise ShardSpecError(f"name={self.name!r}: expected a non-empty string without surrounding spaces")
            if _NAME_FORBIDDEN & set(self.name):
                raise ShardSpecError(f"name={self.name!r}: a name may not contain any of + ; , = or line breaks")
        expert = self.expt_tp * self.ep * self.pp
        if self.world_size % expert:
            raise ShardSpecError(
                f"shard '{self}': expt_tp*ep*pp = {expert} does not divide tp*cp*pp*dp = {self.world_size}; "
                f"choose ep and expt_tp so that expt_tp*ep divides tp*cp*dp = {self.world_size // self.pp}"
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
            raise ShardSpecError(f"a shard must be a mapping of {', '.join(KEYS)}; got {type(data).__name__}: {data!r}")
        unknown = [key for key in data if key not in KEYS]
        if unknown:
            raise ShardSpecError(f"unknown shard key {unknown[0]!r}: allowed keys are {', '.join(KEYS)}")
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
    """The spec string that parses back to ``shards``."""
    return "+".join(str(spec) for spec in shards)


def _parse_value(key: str, value: str, shard: str) -> Any:
    if key == "role":
        role = value.lower()
        if role not in ROLES:
            raise ShardSpecError(f"role={value!r} in shard {shard!r}: expected one of {', '.join(ROLES)}")
        return role
    if key == "name":
        return value
    try:
        return int(value)
    except ValueError:
        raise ShardSpecError(f"{key}={value!r} in shard {shard!r}: expected a positive integer, e.g. {key}=2") from None


def _parse_one(shard: str) -> ShardSpec:
    """One non-empty shard of the grammar (``key=value`` items, comma separated).

    Empty items are skipped, so a shard of only commas is a default shard, as in Megatron.
    """
    values: dict[str, Any] = {}
    for item in shard.split(","):
        item = item.strip()
        if not item:
            continue
        if "=" not in item:
            raise ShardSpecError(f"bad entry {item!r} in shard {shard!r}: expected key=value, e.g. tp=2")
        key, value = (part.strip() for part in item.split("=", 1))
        if key not in KEYS:
            hint = f" (keys are lower case: {key.lower()})" if key.lower() in KEYS else ""
            raise ShardSpecError(f"unknown key {key!r} in shard {shard!r}{hint}: allowed keys are {', '.join(KEYS)}")
        if key in values:
            warnings.warn(f"key {key!r} repeated in shard {shard!r}; the last value wins", stacklevel=4)
        values[key] = _parse_value(key, value, shard)
    return ShardSpec(**values)


def _parse_grammar(text: str) -> list[ShardSpec]:
    """Megatron's ``--inference-shards`` grammar: shards split by ``+`` or ``;``, empty ones skipped."""
    chunks = (chunk.strip() for chunk in text.replace("+", ";").split(";"))
    return [_parse_one(chunk) for chunk in chunks if chunk]


MAX_DOCUMENT_DEPTH = 64
_BRACKETS = re.compile(r"[\[\]{}]")
_LEADING = re.compile(r"[ \t]*(?:-(?:[ \t]+|$))*")


def _nesting_depth(text: str) -> int:
    """A bound on a JSON/YAML document's nesting (brackets; indentation and leading '- ' per line),
    stopping early once over MAX_DOCUMENT_DEPTH.

    Deeply nested documents overflow json's and YAML's recursion (libyaml segfaults), so they are
    refused before parsing; a shard list needs a depth of 3 or so.
    """
    depth = 0
    for match in _BRACKETS.finditer(text):
        depth += 1 if match.group() in "[{" else -1
        if depth > MAX_DOCUMENT_DEPTH:
            return depth
    return max((len(_LEADING.match(line).group()) for line in text.splitlines()), default=0)  # type: ignore[union-attr]


def _load_document(text: str, source: str) -> Any:
    """JSON, else YAML (PyYAML is optional)."""
    if _nesting_depth(text) > MAX_DOCUMENT_DEPTH:
        raise ShardSpecError(
            f"{source} is nested more than {MAX_DOCUMENT_DEPTH} levels deep: a shard list is a flat list of mappings"
        )
    try:
        return json.loads(text)
    except RecursionError:
        raise ShardSpecError(f"{source} is nested too deeply: a shard list is a flat list of mappings") from None
    except ValueError as json_error:
        try:
            import yaml
        except ImportError:
            raise ShardSpecError(
                f"{source} is not valid JSON ({json_error}); for YAML install PyYAML: pip install 'shardcore[yaml]'"
            ) from None
        try:
            return yaml.load(text, Loader=getattr(yaml, "CSafeLoader", yaml.SafeLoader))  # C parser when built
        except RecursionError:
            raise ShardSpecError(f"{source} is nested too deeply: a shard list is a flat list of mappings") from None
        except yaml.YAMLError as yaml_error:
            detail = " ".join(str(yaml_error).split())  # one line: YAML's message spans several
            raise ShardSpecError(f"{source} is neither JSON nor YAML: {detail}") from None


def _parse_text(text: str, source: str) -> list[ShardSpec]:
    stripped = text.strip()
    # A document starts like a list, a mapping or a comment, or has ':' and no '=' (grammar never
    # has ':' without '='; a shard name may hold ':').
    if stripped[:1] in ("[", "{", "-", "#") or (":" in stripped and "=" not in stripped):
        document = _load_document(stripped, source)
        if not isinstance(document, list):
            raise ShardSpecError(
                f"{source} must hold a list of shards (e.g. '- {{tp: 2, role: prefill}}'); "
                f"got {type(document).__name__}"
            )
        return _from_sequence(document)
    return _parse_grammar(text)


def _from_sequence(items: Sequence[Any]) -> list[ShardSpec]:
    out: list[ShardSpec] = []
    for item in items:
        if isinstance(item, ShardSpec):
            out.append(item)
        elif isinstance(item, Mapping):
            out.append(ShardSpec.from_dict(item))
        elif isinstance(item, str):
            out.extend(_parse_grammar(item))
        else:
            raise ShardSpecError(
                f"a shard must be a ShardSpec, a mapping or a spec string; got {type(item).__name__}: {item!r}"
            )
    return out


MAX_SPEC_FILE_BYTES = 1 << 20
"""A shard file is a few lines; a bigger one (or /dev/zero) is a mistake, not a layout."""


def _read_spec_file(path: Path) -> str:
    try:
        with path.open("rb") as file:
            data = file.read(MAX_SPEC_FILE_BYTES + 1)
        text = data.decode("utf-8")
    except (OSError, ValueError) as error:  # ValueError: undecodable, or a NUL in the path
        raise ShardSpecError(f"cannot read shard file {str(path)!r}: {error}") from None
    if len(data) > MAX_SPEC_FILE_BYTES:
        raise ShardSpecError(
            f"shard file {str(path)!r} is over {MAX_SPEC_FILE_BYTES} bytes: give a spec file, not data"
        )
    return text


def parse_shards(spec: ShardsInput) -> tuple[ShardSpec, ...]:
    """Parse shards from a spec string, ``@file`` (JSON/YAML/grammar), ShardSpecs or dicts.

    Accepts every string Megatron-Core's ``--inference-shards`` parser accepts, with the same
    meaning, plus ``cp > 1``, ``role=train`` and ``name=``; every error is a ShardSpecError.
    """
    if isinstance(spec, ShardSpec):
        shards = [spec]
    elif isinstance(spec, str):
        if spec.strip().startswith("@"):
            path = Path(spec.strip()[1:])
            shards = _parse_text(_read_spec_file(path), f"shard file {str(path)!r}")
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
    return tuple(shards)


__all__ = ["INT_KEYS", "KEYS", "ROLES", "ShardSpec", "format_shards", "parse_shards"]
