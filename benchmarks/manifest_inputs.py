"""Random malformed refit inputs: manifest documents (as mappings and as JSON and YAML files), the
manifest API's arguments, and ``shardcore refit`` / ``shardcore plan`` lines.

Every field of a document is given a good value or a bad one (a wrong type, a huge number, a long
string or list, nested aliases, control characters), so that most inputs are malformed in one or
a few places; some files are also corrupted (cut short, over-nested, not UTF-8). ``random_input``
returns one input, applied by a call, for ``benchmarks.measure.answer`` to judge.
``tests/core/test_fuzz.py`` and ``benchmarks/fuzz_long.py`` share it.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from shardcore.cli import main
from shardcore.plan.arguments import shown
from shardcore.refit import (
    Manifest,
    TensorSpec,
    TransformerConfig,
    load_manifest,
    manifest_from_config,
    manifest_from_dict,
    model_manifest,
    preset,
)
from shardcore.refit.documents import TENSOR_KEYS

HUGE_DIGITS = 5000
"""Past Python's int-conversion limit (4,300 digits): neither int() nor str() takes it."""
HUGE = 10**HUGE_DIGITS


@dataclass(frozen=True)
class Huge:
    """A number of HUGE_DIGITS digits: the int in a mapping, its digits in a file."""


@dataclass(frozen=True)
class Raw:
    """A YAML scalar written as is (``0b1...``, ``59:59:...``, ``.nan``); a string in JSON and mappings."""

    text: str


@dataclass(frozen=True)
class Bomb:
    """Nested aliases: ``depth`` lists of ``width`` items, each item the list below, so that the
    value is small to write and to hold (YAML's aliases share) but has width**depth leaves."""

    depth: int
    width: int


Input = tuple[str, Callable[[], Any], str]
"""(kind, the call that applies the input, a short description)."""

TENSOR_GOOD: dict[str, list[Any]] = {
    "name": ["w", "decoder.layers.0.mlp.linear_fc1.weight", "embedding.word_embeddings.weight"],
    "shape": [[8, 4], [8], [16, 8, 2], [4, 4]],
    "dtype": ["float32", "bfloat16", "int8"],
    "tp_dim": [0, 1, None],
    "blocks": [[4, 4], [8], [2, 2]],
    "unit": [1, 2, 4],
    "layer": [0, 1, 3],
    "stage": ["first", "last", "all", ["first", "last"]],
    "expert": [0, 1, 3],
}
TOP_GOOD: dict[str, list[Any]] = {
    "name": ["m", "tiny"],
    "layers": [0, 1, 2, 4],
    "first_stage_layers": [1, None],
    "last_stage_layers": [1, None],
    "experts": [0, 2, 4],
    "dtype": ["float32", "bfloat16"],
}
CONFIG_GOOD: dict[str, list[Any]] = {
    "layers": [1, 2, 4],
    "hidden": [64, 128],
    "ffn": [128, 256],
    "heads": [4, 8],
    "vocab": [128, 256],
    "kv_heads": [None, 2, 4],
    "head_dim": [None, 16],
    "experts": [0, 4],
    "moe_ffn": [32, None],
    "shared_experts": [0, 1],
    "dense_layers": [0, 1],
    "tied_embeddings": [True, False],
    "gated": [True, False],
    "qkv_bias": [True, False],
    "qk_norm": [True, False],
    "q_lora_rank": [None, 32],
    "kv_lora_rank": [None, 16],
    "qk_head_dim": [16],
    "qk_pos_emb_head_dim": [8],
    "v_head_dim": [16],
    "first_stage_layers": [None, 1],
    "last_stage_layers": [None, 1],
    "dtype": ["float32", "bfloat16"],
}
REQUIRED_CONFIG = ("layers", "hidden", "ffn", "heads", "vocab")
SHARD_GOOD: dict[str, list[Any]] = {
    "tp": [1, 2, 4],
    "pp": [1, 2],
    "dp": [1, 2],
    "ep": [1, 2],
    "role": ["train", "prefill", "decode"],
    "name": ["a", "b"],
}
BAD: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2.5,
    math.nan,
    math.inf,
    "",
    "x",
    "all",
    "first",
    "bfloat16",
    "0",
    [],
    [0],
    [-1],
    [1.5],
    ["first"],
    [[1]],
    [None],
    ["first", "first"],
    ["all", "last"],
    {},
    {"a": 1},
    Huge(),
    [Huge(), 2],
    2**63,
    2**48 + 1,
    2**24 + 1,
    "9" * HUGE_DIGITS,
    "x" * 100_000,
    [1] * 1000,
    [2**40] * 300,
    Bomb(6, 7),
    Bomb(12, 3),
    Raw("0b" + "1" * 20_000),
    Raw("0x" + "f" * 5000),
    Raw(":".join(["59"] * 3000)),
    Raw(".nan"),
    Raw("!!binary aGVsbG8="),
    Raw("2024-01-01"),
    "\x1b[31mred",
    "a\nb",
    "\u202eevil",
    "\ud800",
]
"""Wrong types, out-of-range and huge numbers, long or nested values, control characters."""
API_ONLY: list[Any] = [b"x", ("first", "last"), {1, 2}, object(), range(3), Path("w")]
"""Values no document holds, for the API."""
CORRUPTIONS = ("cut", "nest", "dashes", "bytes", "empty", "junk")
NAMES = ["tiny-dense", "tiny-moe", "gpt5", "", "/nonexistent/m.yaml", "/", "/dev/null", "a\x00b", "9" * HUGE_DIGITS]
"""--model values and preset names that are not a file written here."""
JUNK_CHARS = "abc{}[]:,-&*!|>'\"#\n \t0123456789\x00\x1b\u2028\u00e9"


def junk(rng: random.Random) -> str:
    return "".join(rng.choice(JUNK_CHARS) for _ in range(rng.randint(0, 30)))


def value(rng: random.Random, good: list[Any], bad_share: float = 0.25) -> Any:
    """A good value of a field, or (``bad_share`` of the time) a bad one."""
    if rng.random() >= bad_share:
        return rng.choice(good)
    return junk(rng) if rng.random() < 0.1 else rng.choice(BAD)


def _fields(rng: random.Random, good: dict[str, list[Any]], required: tuple[str, ...], share: float) -> dict[str, Any]:
    return {
        key: value(rng, options)
        for key, options in good.items()
        if (key in required and rng.random() < 0.97) or rng.random() < share
    }


def tensor_entry(rng: random.Random, position: int) -> Any:
    if rng.random() < 0.04:
        return rng.choice(BAD)
    entry = _fields(rng, TENSOR_GOOD, ("name", "shape"), 0.35)
    if isinstance(entry.get("name"), str) and rng.random() < 0.9:
        entry["name"] += str(position)  # mostly unique names
    if rng.random() < 0.04:
        entry[rng.choice(["size", "bogus", "", "Shape"])] = 1
    return entry


def config(rng: random.Random) -> Any:
    if rng.random() < 0.04:
        return rng.choice(BAD)
    data = _fields(rng, CONFIG_GOOD, REQUIRED_CONFIG, 0.3)
    if rng.random() < 0.04:
        data["hidden_size"] = 64
    return data


def document(rng: random.Random) -> Any:
    """A manifest in its file form, mostly malformed somewhere."""
    if rng.random() < 0.03:
        return rng.choice(BAD)
    doc = _fields(rng, TOP_GOOD, (), 0.4)
    if rng.random() < 0.3:
        doc["config"] = config(rng)
        if rng.random() < 0.05:
            doc["tensors"] = []
    elif rng.random() < 0.96:
        doc["tensors"] = [tensor_entry(rng, i) for i in range(rng.randint(0, 5))]
    else:
        doc["tensors"] = rng.choice(BAD)
    if rng.random() < 0.03:
        doc[rng.choice(["tensorz", "model", "", "Layers"])] = 1
    return doc


def shard_document(rng: random.Random) -> Any:
    """A shard list (or one shard) for ``--shards``, as a document."""
    shards = [_fields(rng, SHARD_GOOD, ("tp",), 0.3) for _ in range(rng.randint(1, 3))]
    return shards[0] if len(shards) == 1 and rng.random() < 0.5 else shards


def _bomb(bomb: Bomb) -> list[Any]:
    level: list[Any] = [1] * bomb.width
    for _ in range(bomb.depth):
        level = [level] * bomb.width
    return level


def to_api(data: Any) -> Any:
    """The document as Python values: Huge is the int, Bomb shared lists, Raw its text."""
    if isinstance(data, Huge):
        return HUGE
    if isinstance(data, Bomb):
        return _bomb(data)
    if isinstance(data, Raw):
        return data.text
    if isinstance(data, dict):
        return {key: to_api(item) for key, item in data.items()}
    if isinstance(data, list):
        return [item if type(item) is int else to_api(item) for item in data]
    return data


def _scalar(data: Any) -> str:
    if type(data) is int:  # the common case, first: lists of a thousand numbers
        return str(data)
    if isinstance(data, Huge):
        return "9" * HUGE_DIGITS
    if isinstance(data, Raw):
        return json.dumps(data.text)
    if isinstance(data, float) and not math.isfinite(data):
        return "NaN" if math.isnan(data) else "Infinity"
    return json.dumps(data)


def to_json(data: Any) -> str:
    """JSON text; Huge as its digits, a Bomb as nesting of its depth (JSON has no aliases)."""
    if isinstance(data, Bomb):
        return "[" * data.depth + "1" + "]" * data.depth
    if isinstance(data, dict):
        return "{" + ", ".join(f"{json.dumps(str(key))}: {to_json(item)}" for key, item in data.items()) + "}"
    if isinstance(data, list):
        return "[" + ", ".join(to_json(item) for item in data) + "]"
    return _scalar(data)


class _Yaml:
    """YAML text: the top mapping and the tensor list in block style, values in flow style; a Bomb
    as anchors, each level aliasing the one before it."""

    def __init__(self) -> None:
        self.anchors = 0

    def flow(self, data: Any) -> str:
        if isinstance(data, Bomb):
            first = self.anchors
            self.anchors += data.depth + 1
            levels = [f"&a{first} [{', '.join(['1'] * data.width)}]"]
            levels += [
                f"&a{first + i} [{', '.join([f'*a{first + i - 1}'] * data.width)}]" for i in range(1, data.depth + 1)
            ]
            return "[" + ", ".join(levels) + "]"
        if isinstance(data, Raw):
            return data.text
        if isinstance(data, float) and not math.isfinite(data):
            return ".nan" if math.isnan(data) else ".inf"
        if isinstance(data, dict):
            return "{" + ", ".join(f"{json.dumps(str(key))}: {self.flow(item)}" for key, item in data.items()) + "}"
        if isinstance(data, list):
            return "[" + ", ".join(self.flow(item) for item in data) + "]"
        return _scalar(data)

    def block(self, data: Any) -> str:
        if not isinstance(data, dict):
            return self.flow(data)
        lines = []
        for key, item in data.items():
            if isinstance(item, list) and item and all(isinstance(entry, dict) for entry in item):
                lines.append(f"{json.dumps(str(key))}:")
                lines += [f"  - {self.flow(entry)}" for entry in item]
            else:
                lines.append(f"{json.dumps(str(key))}: {self.flow(item)}")
        return "\n".join(lines) + "\n"


def to_yaml(data: Any) -> str:
    return _Yaml().block(data)


def corrupt(rng: random.Random, text: str) -> str | bytes:
    """The text broken one way: cut short, over-nested, not UTF-8, empty, or junk appended."""
    how = rng.choice(CORRUPTIONS)
    if how == "cut":
        return text[: rng.randint(0, len(text))]
    if how == "nest":
        return "[" * rng.choice([70, 1000, 100_000]) + text
    if how == "dashes":
        return "- " * rng.choice([70, 5000]) + text
    if how == "bytes":
        return b"\xff\xfe\x00" + text.encode("utf-8", "surrogatepass")
    if how == "empty":
        return ""
    return text + junk(rng)


def write_manifest(rng: random.Random, folder: Path, name: str) -> tuple[Path, str]:
    """A random document written as JSON or YAML (sometimes corrupted) under ``folder``."""
    doc = document(rng)
    yaml = rng.random() < 0.5
    text: str | bytes = to_yaml(doc) if yaml else to_json(doc)
    if rng.random() < 0.1:
        text = corrupt(rng, text)
    path = folder / f"{name}.{'yaml' if yaml else 'json'}"
    path.unlink(missing_ok=True)  # a new file: truncating one in place can wait for the disk (ext4)
    if isinstance(text, bytes):
        path.write_bytes(text)
    else:
        path.write_bytes(text.encode("utf-8", "surrogatepass"))  # a lone surrogate is written as-is
    return path, f"{path.name}: {text[:200]!r}"


def document_input(rng: random.Random) -> Input:
    doc = document(rng)
    data = to_api(doc)
    return "manifest_dict", lambda: manifest_from_dict(data), shown(data)


def file_input(rng: random.Random, folder: Path) -> Input:
    path, described = write_manifest(rng, folder, "fuzz")
    reader = rng.choice([load_manifest, model_manifest, lambda path: load_manifest(str(path))])
    return "manifest_file", lambda: reader(path), described


def _api_config(rng: random.Random) -> dict[str, Any]:
    kwargs = {key: to_api(value(rng, CONFIG_GOOD[key])) for key in REQUIRED_CONFIG}
    for item in fields(TransformerConfig):
        if item.name not in kwargs and rng.random() < 0.3:
            kwargs[item.name] = to_api(value(rng, CONFIG_GOOD[item.name]))
    return kwargs


def api_input(rng: random.Random) -> Input:
    """One call of the manifest API with a random argument (a good one, a bad one, or one no document holds)."""
    anything = to_api(rng.choice([*BAD, *API_ONLY, *NAMES]))
    target = rng.randrange(7)
    if target == 0:
        name = rng.choice([*NAMES, anything])
        return "manifest_api", lambda: preset(name), f"preset({shown(name)})"
    if target == 1:
        model = rng.choice([*NAMES, anything])
        reader = rng.choice([model_manifest, load_manifest])
        return "manifest_api", lambda: reader(model), f"{reader.__name__}({shown(model)})"
    if target == 2:
        kwargs = _api_config(rng)
        return "manifest_api", lambda: TransformerConfig(**kwargs), f"TransformerConfig(**{shown(kwargs)})"
    if target == 3:
        data = to_api(config(rng))
        return "manifest_api", lambda: TransformerConfig.from_dict(data), f"from_dict({shown(data)})"
    if target == 4:
        kwargs = _api_config(rng)
        name, made = rng.choice(["m", anything]), rng.random() < 0.8

        def from_config() -> Manifest:
            return manifest_from_config(TransformerConfig(**kwargs) if made else anything, name=name)

        return (
            "manifest_api",
            from_config,
            f"manifest_from_config({shown(kwargs) if made else shown(anything)}, {shown(name)})",
        )
    if target == 5:
        entry = tensor_entry(rng, 0)
        spec = (
            {key: item for key, item in to_api(entry).items() if key in TENSOR_KEYS} if isinstance(entry, dict) else {}
        )
        spec.setdefault("name", anything)
        spec.setdefault("shape", anything)
        return "manifest_api", lambda: TensorSpec(**spec), f"TensorSpec(**{shown(spec)})"
    tensors = rng.choice([anything, [TensorSpec("w", (4,), stage="all"), anything], ()])
    layers = rng.choice([1, anything])
    return "manifest_api", lambda: Manifest(tensors, layers=layers), f"Manifest({shown(tensors)}, {shown(layers)})"


REFIT_SHARDS = ["tp=2+tp=2", "tp=2,pp=2+tp=4", "tp=1,dp=4+tp=2,dp=2", "tp=2,ep=2+tp=1,dp=2", "tp=4+tp=4"]
COUNTS = ["0", "1", "2", "4", "8", "-1", "x", "", "1.5", "9" * 4000, "9" * HUGE_DIGITS, "\u0662"]
"""Flag values; 4,000 digits is a number int() still reads (its limit is 4,300), and too long to show."""
REFIT_FLAGS = [
    "--json",
    "--transfers",
    "--rank=0",
    "--rank=99",
    "--ranks-per-node=2",
    "--ranks-per-node=0",
    "--intra-gbps=0",
    "--intra-gbps=nan",
    "--inter-gbps=-1",
    "--order=tp-pp-dp",
    "--order=" + "x" * 5000,
    "--allow-idle",
    "--bogus",
    "x" * 5000,
    "--nproc=3",
    "--bucket-bytes=4",
    "-q",
]
PLAN_FLAGS = [
    "--json",
    "--allow-idle",
    "--rank=1",
    "--ranks-per-node=2",
    "--order=" + "y" * 5000,
    "--highlight=" + "z" * 5000,
]


def _maybe(rng: random.Random, flag: str, choices: list[str]) -> list[str]:
    return [flag, rng.choice(choices)] if rng.random() < 0.93 else []


def refit_line(rng: random.Random, folder: Path) -> list[str]:
    """``shardcore refit`` with random (often bad) flags; never --check."""
    model = rng.choice(NAMES)
    if rng.random() < 0.5:
        model = str(write_manifest(rng, folder, "model")[0])
    argv = ["refit"]
    argv += _maybe(rng, "--world", ["4", "8", *COUNTS])
    argv += _maybe(rng, "--shards", [*REFIT_SHARDS, junk(rng), to_yaml(shard_document(rng))])
    argv += _maybe(rng, "--from", ["0", "1", *COUNTS])
    argv += _maybe(rng, "--to", ["1", "0,1", "1,x", ",", "1," * 1000, "-1", *COUNTS])
    argv += _maybe(rng, "--model", [model, model, "tiny-dense", "tiny-moe"])
    return argv + rng.sample(REFIT_FLAGS, rng.randint(0, 3))


def plan_line(rng: random.Random) -> list[str]:
    """``shardcore plan`` with a shard document that holds bad values (nested aliases among them)."""
    doc = shard_document(rng)
    spec = to_yaml(doc) if rng.random() < 0.6 else to_json(doc)
    return [
        "plan",
        "--world",
        rng.choice(["4", "8", *COUNTS]),
        "--shards",
        spec,
        *rng.sample(PLAN_FLAGS, rng.randint(0, 2)),
    ]


def cli_input(rng: random.Random, folder: Path) -> Input:
    argv = refit_line(rng, folder) if rng.random() < 0.75 else plan_line(rng)
    return "refit_cli" if argv[0] == "refit" else "plan_document_cli", lambda: main(argv), repr(argv)[:300]


def random_input(rng: random.Random, folder: Path, cli_share: float = 0.15) -> Input:
    """One random input: a document (40%), a file (30%) or an API call (30%) of the rest; CLI lines ``cli_share``."""
    if rng.random() < cli_share:
        return cli_input(rng, folder)
    pick = rng.random()
    if pick < 0.4:
        return document_input(rng)
    if pick < 0.7:
        return file_input(rng, folder)
    return api_input(rng)


__all__ = ["Input", "cli_input", "document", "random_input", "to_json", "to_yaml"]
