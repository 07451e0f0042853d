"""Fuzzing parse_shards, plan_layout and `shardcore plan`: only ShardcoreError (or argparse's exit 2),
under 100 ms of CPU and 100 MB allocated per input. benchmarks/fuzz_long.py runs the same checks at length."""

from __future__ import annotations

import contextlib
import io
from collections.abc import Callable
from typing import Any

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.measure import measure_input
from shardcore.cli import main
from shardcore.plan.layout import plan_layout
from shardcore.plan.spec import parse_shards

MAX_SECONDS = 0.1
MAX_BYTES = 100 * 2**20
TOKENS = [
    "tp",
    "pp",
    "cp",
    "dp",
    "ep",
    "expt_tp",
    "role",
    "name",
    "TP",
    "=",
    ",",
    "+",
    ";",
    " ",
    "\n",
    "-",
    ":",
    "[",
    "]",
    "{",
    "}",
    "@",
    "0",
    "1",
    "2",
    "4",
    "8",
    "16",
    "-1",
    "99999999999999999999",
    "train",
    "prefill",
    "decode",
    "x",
    "é",
    "\x00",
    "1e3",
    "0x10",
    "_",
]
grammar = st.lists(st.sampled_from(TOKENS), max_size=40).map("".join)
junk = st.text(max_size=60)
spec_strings = st.one_of(grammar, junk, st.from_regex(r"((tp|pp|cp|dp|ep|expt_tp)=[0-9]{1,3},?){1,4}([+;].*)?"))
values = st.one_of(
    st.integers(-3, 2**40),
    st.booleans(),
    st.none(),
    st.floats(allow_nan=True),
    junk,
    st.sampled_from(["train", "prefill", "decode", "2"]),
    st.lists(st.integers(), max_size=3),
)
dicts = st.dictionaries(
    st.sampled_from(["tp", "pp", "cp", "dp", "ep", "expt_tp", "role", "name", "bogus", ""]) | junk, values, max_size=6
)
items = st.one_of(dicts, spec_strings, st.integers(), st.none(), st.lists(dicts, max_size=2))
spec_inputs: st.SearchStrategy[Any] = st.one_of(
    spec_strings, st.lists(items, max_size=5), dicts, st.integers(), st.none(), st.binary(max_size=10)
)
worlds = st.one_of(st.integers(-2, 4096), st.sampled_from([2**24, 2**24 + 1, 2**40]), st.floats(), st.none(), junk)
orders = st.one_of(st.sampled_from(["tp-cp-dp-pp", "tp-cp-pp-dp", "tp-dp-pp", "tp-pp-dp"]), junk, st.none())
# Specs that fit big worlds, to reach the large-group paths.
big = st.builds(
    lambda tp, pp, dp: f"tp={tp},pp={pp},dp={dp}",
    st.sampled_from([1, 2, 2**12, 2**24]),
    st.sampled_from([1, 2, 2**12]),
    st.sampled_from([1, 2, 2**12]),
)


def bounded(call: Callable[[], Any], allow_exit: bool = False) -> None:
    """Only the errors bad input may raise, within the time and memory budget."""
    cost = measure_input(call, allow_exit)
    if cost.error is not None:
        raise cost.error
    assert cost.seconds < MAX_SECONDS, f"{cost.seconds * 1000:.0f} ms"
    assert cost.peak_bytes < MAX_BYTES, f"{cost.peak_bytes / 2**20:.0f} MiB"


FUZZ = settings(max_examples=100, deadline=None, suppress_health_check=list(HealthCheck))


@FUZZ
@given(spec_inputs)
def test_parse_shards(spec: Any) -> None:
    bounded(lambda: parse_shards(spec))


@FUZZ
@given(worlds, spec_inputs | big, orders, st.integers(-2, 2**24), st.booleans())
def test_plan_layout(world: Any, spec: Any, order: Any, offset: int, idle: bool) -> None:
    bounded(lambda: plan_layout(world, spec, order=order, rank_offset=offset, allow_idle=idle))


@FUZZ
@given(
    st.one_of(st.integers(-2, 4096), st.sampled_from([2**24, 2**24 + 7])).map(str) | junk,
    spec_strings | big,
    st.lists(
        st.sampled_from(
            [
                "--json",
                "--allow-idle",
                "--order=tp-pp-dp",
                "--order=bad",
                "--strict",
                "--rank=0",
                "--rank=5",
                "--rank=16777215",
                "--rank=-1",
                "--rank=x",
                "--rank-offset=3",
                "--ranks-per-node=8",
                "--ranks-per-node=0",
                "--bogus",
            ]
        ),
        max_size=4,
    ),
)
def test_plan_cli(world: str, spec: str, flags: list[str]) -> None:
    bounded(lambda: main(["plan", f"--world={world}", f"--shards={spec}", *flags]), allow_exit=True)


HOSTILE = [
    "[" * 100_000,
    "{" * 5000,
    "- " * 50_000 + "x",
    "- [" * 3000,
    "[]" * 50_000,
    "tp=" + "9" * 5000,
    "- &a [*a]",
    "- !!python/object/apply:os.system [ls]",
    "@/nonexistent",
    "@/",
    "@/dev/zero",
    "\x00",
    "",
]


def test_hostile_documents() -> None:
    for text in HOSTILE:
        bounded(lambda: parse_shards(text))


def test_plan_rank_of_a_huge_group_is_summarised() -> None:
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        bounded(lambda: main(["plan", "--world", str(2**24), "--shards", f"tp={2**24}", "--rank", "5"]))
        main(["plan", "--world", str(2**24), "--shards", f"tp={2**24}", "--rank", "5"])
    assert f"[0, ..., {2**24 - 1}] ({2**24} ranks, over 1024: not listed)" in out.getvalue()
