"""Bad inputs: each a ShardSpecError or LayoutError naming the bad token; never a crash, hang or MemoryError."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcore import LayoutError, ShardcoreError, ShardSpecError, parse_shards, plan_layout

BIG = 10**18

# (shards input, world, error type, a token the message must contain)
BAD: list[tuple[Any, int, type[ShardcoreError], str]] = [
    ("", 8, ShardSpecError, "empty"),
    ("   \t\n", 8, ShardSpecError, "empty"),
    ("+;+", 8, ShardSpecError, "empty"),
    ([], 8, ShardSpecError, "empty"),
    ("tp=2,foo=1", 2, ShardSpecError, "'foo'"),
    ("TP=2", 2, ShardSpecError, "'TP'"),
    ("tp", 1, ShardSpecError, "'tp'"),
    ("tp=0", 8, ShardSpecError, "tp=0"),
    ("tp=-1", 8, ShardSpecError, "tp=-1"),
    ("dp=0,tp=2", 8, ShardSpecError, "dp=0"),
    ("tp=abc", 8, ShardSpecError, "'abc'"),
    ("tp=1.5", 8, ShardSpecError, "'1.5'"),
    ("tp=", 8, ShardSpecError, "tp=''"),
    ("tp=2 2", 8, ShardSpecError, "'2 2'"),
    ("role=x", 1, ShardSpecError, "'x'"),
    ("role=", 1, ShardSpecError, "role=''"),
    ("tp=2,ep=2", 2, ShardSpecError, "ep"),
    ("tp=4,expt_tp=3", 4, ShardSpecError, "expt_tp"),
    ("tp=2,name=a=b", 2, ShardSpecError, "'a=b'"),
    ("tp=4", 2, LayoutError, "world has 2"),
    ("tp=2+tp=2", 3, LayoutError, "need 4 ranks"),
    ("tp=2", 4, LayoutError, "[2, 4)"),
    ("tp=2 , pp = 2", 3, LayoutError, "world has 3"),
    ("t p=2", 2, ShardSpecError, "'t p'"),
    (f"tp={BIG}", 8, LayoutError, str(BIG)),
    (f"tp={BIG},dp={BIG},pp={BIG}", 8, LayoutError, str(BIG)),
    (f"tp=2,ep={BIG}", 2, ShardSpecError, str(BIG)),
    ("tp=" + "9" * 5000, 8, ShardSpecError, "tp="),
    ("tp=2", BIG, LayoutError, str(BIG)),
    ("tp=2", 0, LayoutError, "world size 0"),
    ("tp=2", -4, LayoutError, "-4"),
    (42, 8, ShardSpecError, "int"),
    (None, 8, ShardSpecError, "NoneType"),
    (b"tp=2", 8, ShardSpecError, "bytes"),
    (object(), 8, ShardSpecError, "object"),
    (2.5, 8, ShardSpecError, "float"),
    ({"tp": 2}, 2, ShardSpecError, "dict"),
    ([{"tp": "2"}], 2, ShardSpecError, "'2'"),
    ([{"tp": True}], 2, ShardSpecError, "True"),
    ([{"tp": 2, "tpp": 1}], 2, ShardSpecError, "'tpp'"),
    ([3], 2, ShardSpecError, "int"),
    ('[{"tp": 0}]', 2, ShardSpecError, "tp=0"),
    ("[tp: 2", 2, ShardSpecError, "neither JSON nor YAML"),
    ("tp: 2", 2, ShardSpecError, "list of shards"),
    ("- {role: chef}", 2, ShardSpecError, "'chef'"),
    ("@/nonexistent/shards.yaml", 2, ShardSpecError, "/nonexistent/shards.yaml"),
]


@pytest.mark.parametrize(("shards", "world", "error", "token"), BAD, ids=[repr(row[0])[:40] for row in BAD])
def test_bad_input(shards: Any, world: int, error: type[ShardcoreError], token: str) -> None:
    start = time.perf_counter()
    with pytest.raises(error) as info:
        plan_layout(world, shards)
    assert token in str(info.value)
    assert "\n" not in str(info.value)  # one line, for the CLI
    assert time.perf_counter() - start < 2.0


def test_rank_offset_and_order_errors() -> None:
    with pytest.raises(LayoutError, match="rank_offset=8"):
        plan_layout(8, "tp=2", rank_offset=8)
    with pytest.raises(LayoutError, match="rank_offset=-1"):
        plan_layout(8, "tp=2", rank_offset=-1)
    with pytest.raises(LayoutError, match="'tp-dp-cp'"):
        plan_layout(2, "tp=2", order="tp-dp-cp")
    with pytest.raises(LayoutError, match="need 4 ranks from rank 6"):
        plan_layout(8, "tp=4", rank_offset=6)


def test_rank_queries_out_of_range() -> None:
    layout = plan_layout(4, "tp=4")
    for bad in (-1, 4, True, "0", 1.0):
        with pytest.raises(LayoutError, match="outside the world"):
            layout.groups_of(bad)  # type: ignore[arg-type]


@pytest.mark.parametrize(
    ("text", "token"),
    [
        ("tp: 2\npp: 2\n", "dict"),
        ("just words", "expected key=value"),
        ("- 3\n", "int"),
        ("- [tp, 2]\n", "list"),
        ("{tp: 2", "neither JSON nor YAML"),
        ("- {tp: 2, ep: 4}\n", "ep"),
    ],
)
def test_bad_shard_files(tmp_path: Path, text: str, token: str) -> None:
    path = tmp_path / "shards.yaml"
    path.write_text(text, encoding="utf-8")
    with pytest.raises(ShardSpecError) as info:
        parse_shards(f"@{path}")
    assert token in str(info.value)


def test_unreadable_shard_file(tmp_path: Path) -> None:
    (tmp_path / "bin.yaml").write_bytes(b"\xff\xfe\x00garbage")
    with pytest.raises(ShardSpecError, match=r"bin\.yaml"):
        parse_shards(f"@{tmp_path / 'bin.yaml'}")
    with pytest.raises(ShardSpecError, match="dir"):
        parse_shards(f"@{tmp_path}/dir")


@pytest.mark.parametrize(
    "text",
    [" tp=2 ", "\ttp=2\n", "tp = 2", "tp=2 + tp=2", "tp=2;\n;tp=2", "  tp=2 ,, pp=1 , ", "tp=2\u3000", "+tp=2+"],
)
def test_whitespace_variants_are_valid(text: str) -> None:
    assert {spec.tp for spec in parse_shards(text)} == {2}


@settings(deadline=None, max_examples=200)
@given(st.integers(-5, 1 << 30), st.text(alphabet="tpdcer_=,+;0123456789 -x:[]{}", max_size=25))
def test_any_world_and_text_is_planned_or_a_typed_error(world: int, text: str) -> None:
    try:
        layout = plan_layout(world, text)
    except (ShardSpecError, LayoutError) as error:
        assert str(error) and "\n" not in str(error)
    else:
        assert sum(plan.size for plan in layout.shards) == world
