"""Parity with Megatron-Core's ``--inference-shards`` grammar
(https://github.com/NVIDIA/Megatron-LM/blob/core_v0.19.0/megatron/core/inference/shards_spec.py).

``reference_parse`` restates Megatron's parser from that description; with ``extended=True`` it
also allows shardcore's documented extensions (cp > 1, role=train, name=). Any exception in
the reference means "rejected". shardcore also refuses what no world can hold or show: sizes
over its world limit, unprintable names and two shards of one name (``_plannable``).
"""

from __future__ import annotations

import warnings
from pathlib import Path
from typing import Any

import pytest
from hypothesis import assume, example, given, settings
from hypothesis import strategies as st

from shardcore import LayoutError, ShardSpec, ShardSpecError, ShardSpecWarning, parse_shards, plan_layout
from shardcore.plan.arguments import MAX_WORLD_SIZE

SIZE_KEYS = ("tp", "pp", "ep", "expt_tp", "dp", "cp")
COMPARED = ("tp", "pp", "ep", "dp", "cp", "expt_tp", "role", "name")


class Rejected(Exception):
    """The reference parser refuses the string."""


def _reference_spec(fields: dict[str, Any], extended: bool) -> dict[str, Any]:
    spec: dict[str, Any] = {"tp": 1, "pp": 1, "ep": 1, "dp": 1, "cp": 1, "expt_tp": None, "role": None, "name": None}
    spec.update(fields)
    if not extended and spec["cp"] != 1:
        raise Rejected("cp must be 1")
    if spec["name"] is not None and (not spec["name"] or any(c in spec["name"] for c in "=\n\r\t")):
        raise Rejected("bad name")  # checked on the final value: the last one wins
    if spec["expt_tp"] is None:
        spec["expt_tp"] = spec["tp"]
    world = spec["tp"] * spec["pp"] * spec["dp"] * spec["cp"]
    expert = spec["expt_tp"] * spec["ep"] * spec["pp"]
    if expert == 0 or world % expert:  # Megatron divides by zero there: still a rejection
        raise Rejected("expert grid does not tile")
    return spec


def reference_parse(text: str, *, extended: bool = False) -> list[dict[str, Any]]:
    """Shards as dicts, or Rejected / ValueError (from int()) when the grammar refuses ``text``."""
    keys = SIZE_KEYS + ("role",) + (("name",) if extended else ())
    roles = ("prefill", "decode") + (("train",) if extended else ())
    shards = []
    for chunk in text.replace("+", ";").split(";"):
        if not chunk.strip():
            continue  # empty shards are skipped, but a shard of empty items is a default shard
        fields: dict[str, Any] = {}
        for item in chunk.split(","):
            item = item.strip()
            if not item:
                continue
            key, sep, value = item.partition("=")
            key, value = key.strip(), value.strip()
            if not sep or key not in keys:
                raise Rejected(item)
            if key == "role":
                if value.lower() not in roles:
                    raise Rejected(value)
                fields[key] = value.lower()
            elif key == "name":
                fields[key] = value
            else:
                fields[key] = int(value)  # last value wins
        shards.append(_reference_spec(fields, extended))
    if not shards:
        raise Rejected("empty")
    return shards


def _outcome(text: str, *, extended: bool) -> list[dict[str, Any]] | None:
    try:
        return reference_parse(text, extended=extended)
    except (Rejected, ValueError):
        return None


def _plannable(shards: list[dict[str, Any]]) -> bool:
    """Sizes from 1 to the world limit, a shard within it, printable names, each name once."""
    sizes = all(0 < shard[key] <= MAX_WORLD_SIZE for shard in shards for key in SIZE_KEYS)
    worlds = all(shard["tp"] * shard["pp"] * shard["dp"] * shard["cp"] <= MAX_WORLD_SIZE for shard in shards)
    names = [shard["name"] for shard in shards if shard["name"] is not None]
    return sizes and worlds and all(name.isprintable() for name in names) and len(set(names)) == len(names)


def _fields(shards: tuple[ShardSpec, ...]) -> list[dict[str, Any]]:
    return [{key: getattr(spec, key) for key in COMPARED} for spec in shards]


def _shardcore(text: str) -> tuple[ShardSpec, ...] | None:
    """parse_shards' result, or None when it raises ShardSpecError (anything else fails the test)."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        try:
            return parse_shards(text)
        except ShardSpecError:
            return None


_pad = st.sampled_from(["", "", " ", "\t", "  ", "\n "])
_int_value = st.integers(-2, 9).map(str) | st.sampled_from(
    ["1.5", "abc", "", "02", "1_0", "\u0662", "2 2", "0x2", str(10**18), "2=3", "-0", "9" * 5000, "0" * 5000 + "2"]
)
_values = {
    "role": st.sampled_from(["prefill", "decode", "train", "PREFILL", "Decode", "TRAIN", "x", ""]),
    "name": st.sampled_from(["a", "llm-1", "x:y", "a b", "a=b", "a\tb", "", "a\x0bb", "\x1b[31m", "\u202e"]),
}
_keys = st.sampled_from([*SIZE_KEYS, "tp", "dp", "ep", "role", "name", "TP", "Pp", "x", "", "t p", "expt-tp"])


@st.composite
def _items(draw: st.DrawFn) -> str:
    kind = draw(st.sampled_from(["kv", "kv", "kv", "kv", "bare", "empty"]))
    key = draw(_keys)
    if kind == "bare":
        return draw(_pad) + key
    if kind == "empty":
        return draw(_pad)
    value = draw(_values.get(key, _int_value))
    return f"{draw(_pad)}{key}{draw(_pad)}={draw(_pad)}{value}{draw(_pad)}"


_shard_text = st.lists(_items(), max_size=4).map(",".join)
grammar_strings = st.one_of(
    st.tuples(st.lists(_shard_text, min_size=0, max_size=4), st.sampled_from(["+", ";", " + ", ";;", "+;"])).map(
        lambda parts: parts[1].join(parts[0])
    ),
    st.text(alphabet="tpdcerol_=,+;0123 \t-x", max_size=30),
)


@settings(deadline=None, max_examples=1000)
@given(grammar_strings)
@example("tp=2+,")
@example(" , ")
@example("tp=2,name=x:y")
@example("tp=2,tp=4,tp=1")
@example("tp=-1,dp=-2")
@example("tp=0")
def test_grammar_parity(text: str) -> None:
    # JSON / YAML documents and @file are shardcore input formats of their own; Megatron rejects them all.
    assume(not text.strip().startswith(("[", "{", "-", "#", "@")))
    mine = _shardcore(text)
    megatron = _outcome(text, extended=False)
    if megatron is not None and _plannable(megatron):
        assert mine is not None, f"Megatron accepts {text!r}"
        assert _fields(mine) == megatron
    extended = _outcome(text, extended=True)
    if extended is None or not _plannable(extended):
        assert mine is None, f"{text!r} must be rejected, got {mine}"
    else:
        assert mine is not None and _fields(mine) == extended


@pytest.mark.filterwarnings("ignore::shardcore.errors.ShardSpecWarning")  # Megatron-valid input that warns
@settings(deadline=None, max_examples=300)
@given(st.text(max_size=40))
def test_any_text_is_parsed_or_a_shard_spec_error(text: str) -> None:
    try:
        shards = parse_shards(text)
    except ShardSpecError as error:
        assert str(error)
    else:
        assert shards and all(isinstance(spec, ShardSpec) for spec in shards)


# Megatron-Core 0.19 parse_inference_shards_spec on these inputs: (input, world, shards or the error type)
TABLE = [
    (
        "tp=2,role=prefill+tp=1,dp=2,role=decode",
        4,
        [ShardSpec(tp=2, role="prefill"), ShardSpec(tp=1, dp=2, role="decode")],
    ),
    ("tp=2,role=prefill;tp=1,role=decode", 3, [ShardSpec(tp=2, role="prefill"), ShardSpec(tp=1, role="decode")]),
    ("tp=2,role=PREFILL+tp=2,role=Decode", 4, [ShardSpec(tp=2, role="prefill"), ShardSpec(tp=2, role="decode")]),
    (" tp = 2 , pp=2 ;; ", 4, [ShardSpec(tp=2, pp=2)]),
    ("tp=4,expt_tp=1,ep=4", 4, [ShardSpec(tp=4, expt_tp=1, ep=4)]),
    ("tp=2,ep=2,dp=2", 4, [ShardSpec(tp=2, ep=2, dp=2)]),
    ("tp=2,", 2, [ShardSpec(tp=2)]),
    ("tp=2,ep=2", 2, ShardSpecError),
    ("TP=2", 2, ShardSpecError),
    ("tp", 1, ShardSpecError),
    ("tp=a", 1, ShardSpecError),
    ("role=", 1, ShardSpecError),
    ("", 1, ShardSpecError),
    (";+;", 1, ShardSpecError),
    ("tp=2,pp=2", 2, LayoutError),
]


@pytest.mark.parametrize(("text", "world", "expected"), TABLE, ids=[row[0] for row in TABLE])
def test_megatron_table(text: str, world: int, expected: Any) -> None:
    if isinstance(expected, list):
        layout = plan_layout(world, text)
        assert [plan.spec for plan in layout.shards] == expected
        assert layout.shards[0].ranks == range(0, expected[0].world_size)
    else:
        with pytest.raises(expected):
            plan_layout(world, text)


def test_megatron_table_windows() -> None:
    layout = plan_layout(4, "tp=2,role=prefill+tp=1,dp=2,role=decode")
    assert [plan.ranks for plan in layout.shards] == [range(0, 2), range(2, 4)]


def test_cp_above_one_is_an_extension() -> None:
    (spec,) = parse_shards("tp=2,cp=2")
    assert spec.cp == 2 and spec.world_size == 4
    with pytest.raises(Rejected, match="cp"):
        reference_parse("tp=2,cp=2")


def test_repeated_key_last_wins_with_a_warning() -> None:
    with pytest.warns(ShardSpecWarning, match="'tp'") as record:
        (spec,) = parse_shards("tp=2,tp=4")
    assert spec.tp == 4 == reference_parse("tp=2,tp=4")[0]["tp"]
    # Attributed to the caller's line (this file), not to shardcore's source.
    assert [Path(warning.filename).name for warning in record] == ["test_grammar.py"]
    with pytest.warns(ShardSpecWarning, match=r"shard 1 \('role=prefill,role=decode'\): key 'role' repeated"):
        assert parse_shards("tp=2+role=prefill,role=decode")[1].role == "decode"
    with pytest.warns(ShardSpecWarning) as record:
        plan_layout(2, "tp=2,tp=2")
    assert [Path(warning.filename).name for warning in record] == ["test_grammar.py"]


def test_no_warning_without_repeats() -> None:
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_shards("tp=2,pp=2+tp=2")[0].pp == 2


def test_an_empty_item_inside_a_shard_is_read_as_megatron_does_with_a_warning() -> None:
    """``tp=4,,pp=2``: Megatron skips the empty item (a value left out?), so shardcore must accept it with the
    same meaning; it says so. A trailing comma is Megatron's documented style and stays silent."""
    with pytest.warns(ShardSpecWarning, match=r"shard 0 \('tp=4,,pp=2'\): an empty item is skipped"):
        (spec,) = parse_shards("tp=4,,pp=2")
    assert (spec.tp, spec.pp) == (4, 2) and _fields((spec,)) == reference_parse("tp=4,,pp=2")
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert parse_shards("tp=4,pp=2,")[0].pp == 2


def test_a_non_ascii_digit_is_read_as_megatron_does_with_a_warning() -> None:
    """Python's int() (so Megatron's parser) reads a full-width ``４`` as 4: shardcore reads it so too, and
    shows the character escaped, so the user sees what was typed."""
    with pytest.warns(ShardSpecWarning, match=r"tp='\\uff14' \(non-ASCII U\+FF14\) is read as tp=4"):
        (spec,) = parse_shards("tp=\uff14,pp=2")
    assert spec.tp == 4 and _fields((spec,)) == reference_parse("tp=\uff14,pp=2")


def test_a_look_alike_letter_is_shown_escaped() -> None:
    """A Cyrillic ``а`` in ``trаin`` prints like ``train``: the message shows it escaped and names it."""
    with pytest.raises(ShardSpecError, match=r"role='tr\\u0430in' \(non-ASCII U\+0430\): expected one of train"):
        parse_shards("tp=2,role=tr\u0430in")
    with pytest.raises(ShardSpecError, match=r"unknown key 't\\u0440' \(non-ASCII U\+0440\)"):
        parse_shards("t\u0440=2")
