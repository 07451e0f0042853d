"""Reading what users write as files and documents: shard specs and refit manifests share it.

Files are read up to a size cap (``/dev/zero`` is not read forever), documents are JSON else YAML
(PyYAML is optional), nesting is bounded before parsing (deep nesting overflows json's and YAML's
recursion, and libyaml can segfault), and integers too long for ``int()`` come back as
``LongNumber`` so that the checks can name the key they were given for. Every failure is the
caller's error class, with a message of bounded length.
"""

from __future__ import annotations

import json
import re
from functools import cache
from pathlib import Path
from typing import Any, BinaryIO

from ..errors import ShardcoreError
from .arguments import MAX_SHOWN, LongNumber, clipped, number_or_long, shown

MAX_DOCUMENT_DEPTH = 64
_BRACKETS = re.compile(r"[\[\]{}]")
_LEADING = re.compile(r"[ \t]*(?:-(?:[ \t]+|$))*")


def shown_path(path: str | Path) -> str:
    """A file's path for a message: whole up to MAX_SHOWN characters (paths run longer than values), else cut."""
    text = str(path)
    return repr(text) if len(text) <= MAX_SHOWN else shown(text)


_CHUNK = 1 << 16


def _read_at_most(file: BinaryIO, size: int) -> bytes:
    """Up to ``size`` bytes, read 64 KiB at a time: ``file.read(size)`` allocates all ``size`` bytes at once."""
    chunks, total = [], 0
    while total < size:
        chunk = file.read(min(_CHUNK, size - total))
        if not chunk:
            break
        chunks.append(chunk)
        total += len(chunk)
    return b"".join(chunks)


def read_text(path: Path, what: str, limit: int, error: type[ShardcoreError], fix: str) -> str:
    """The UTF-8 text of the file at ``path``, refused past ``limit`` bytes.

    Args:
        path: the file.
        what: what the file is, for messages ("shard file", "manifest").
        limit: the most bytes a real file of this kind holds.
        error: the error class to raise.
        fix: what to give instead, for messages.

    Raises:
        error: unreadable, not UTF-8, or over ``limit``; naming the file.
    """
    where = shown_path(path)
    try:
        with path.open("rb") as file:
            data = _read_at_most(file, limit + 1)
        text = data.decode("utf-8")
    except OSError as problem:  # its str() repeats the path, unbounded
        raise error(f"cannot read {what} {where}: {problem.strerror or type(problem).__name__}; {fix}") from None
    except ValueError as problem:  # undecodable, or a NUL in the path
        raise error(f"cannot read {what} {where}: {clipped(str(problem))}; {fix}") from None
    if len(data) > limit:
        raise error(f"{what} {where} is over {limit} bytes: {fix}")
    return text


def _nesting_depth(text: str) -> int:
    """A bound on a JSON/YAML document's nesting (brackets; indentation and leading '- ' per line),
    stopping early once over MAX_DOCUMENT_DEPTH."""
    depth = 0
    for match in _BRACKETS.finditer(text):
        depth += 1 if match.group() in "[{" else -1
        if depth > MAX_DOCUMENT_DEPTH:
            return depth
    return max((len(_LEADING.match(line).group()) for line in text.splitlines()), default=0)  # type: ignore[union-attr]


@cache
def _yaml_loader(yaml: Any) -> Any:
    """PyYAML's safe loader (the C parser when built), whose integers may be LongNumbers (see number_or_long)."""
    base = getattr(yaml, "CSafeLoader", yaml.SafeLoader)

    def construct_int(loader: Any, node: Any) -> Any:
        try:
            return yaml.SafeLoader.construct_yaml_int(loader, node)
        except ValueError:  # a part too long for int(): YAML 1.1's base-60 '1:30' has parts, a decimal has one
            text = loader.construct_scalar(node)
            return LongNumber(text) if ":" in text else number_or_long(text)

    loader: Any = type("ShardcoreLoader", (base,), {})
    loader.add_constructor("tag:yaml.org,2002:int", construct_int)
    return loader


def load_document(text: str, source: str, error: type[ShardcoreError], shape: str) -> Any:
    """The JSON document in ``text``, else the YAML one.

    Args:
        text: the document.
        source: what it is, for messages ("the shard spec", "manifest 'm.yaml'").
        error: the error class to raise.
        shape: what such a document looks like, for messages ("a shard list is a flat list of mappings").

    Raises:
        error: not text, nested over MAX_DOCUMENT_DEPTH, or neither JSON nor YAML (the parser's
            message, on one line and cut short).
    """
    try:
        text.encode("utf-8")  # libyaml and every output need text; a lone surrogate is not
    except UnicodeEncodeError as problem:
        raise error(
            f"{source} holds U+{ord(text[problem.start]):04X} at position {problem.start}: a lone surrogate is not text"
        ) from None
    if _nesting_depth(text) > MAX_DOCUMENT_DEPTH:
        raise error(f"{source} is nested more than {MAX_DOCUMENT_DEPTH} levels deep: {shape}")
    try:
        return json.loads(text, parse_int=number_or_long)
    except RecursionError:
        raise error(f"{source} is nested too deeply: {shape}") from None
    except ValueError as json_error:
        try:
            import yaml
        except ImportError:
            raise error(
                f"{source} is not valid JSON ({json_error}); for YAML install PyYAML: pip install 'shardcore[yaml]'"
            ) from None
        try:
            return yaml.load(text, Loader=_yaml_loader(yaml))
        except RecursionError:
            raise error(f"{source} is nested too deeply: {shape}") from None
        except yaml.YAMLError as yaml_error:
            detail = " ".join(str(yaml_error).split())  # one line: YAML's message spans several
            raise error(f"{source} is neither JSON nor YAML: {clipped(detail)}") from None


__all__ = ["MAX_DOCUMENT_DEPTH", "load_document", "read_text", "shown_path"]
