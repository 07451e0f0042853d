"""Fuzzing parse_shards, plan_layout, build_shards' arguments, the refit manifests and API, and `shardcore plan`
/ `shardcore refit`: only ShardcoreError (or argparse's exit 2), with one-line messages under 1 KB and no
traceback from the CLI; for the spec, also under 100 ms of CPU and 100 MB allocated per input.
benchmarks/fuzz_long.py runs the same checks at length; its STRESS tokens (digit strings past Python's int
limit, control characters, nesting) stress the parsers themselves."""

from __future__ import annotations

import contextlib
import io
import random
import tempfile
from collections import Counter
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path
from typing import Any

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from benchmarks.fuzz_long import FLAGS, STRESS, TOKENS
from benchmarks.manifest_inputs import BAD, CONFIG_GOOD, TENSOR_GOOD, TOP_GOOD, random_input, to_api, to_json, to_yaml
from benchmarks.measure import answer, measure_input
from shardcore.cli import main
from shardcore.engine.backends.shards import build_shards
from shardcore.errors import LayoutError, ShardcoreError
from shardcore.plan.arguments import MAX_TIMEOUT, as_timedelta
from shardcore.plan.layout import plan_layout
from shardcore.plan.spec import parse_shards
from shardcore.refit import load_manifest, manifest_from_dict

MAX_SECONDS = 0.1
MAX_BYTES = 100 * 2**20
grammar = st.lists(st.sampled_from(TOKENS), max_size=40).map("".join)
junk = st.text(max_size=60)
stress = st.sampled_from(STRESS)
stressed = st.one_of(
    stress,
    st.lists(
        st.sampled_from(TOKENS) | stress | st.characters(categories=["Cc", "Cf", "Cs", "Zl", "Zp", "Co"]), max_size=8
    ).map("".join),
    st.tuples(st.sampled_from(["tp", "dp", "name", "role"]), stress).map(lambda kv: f"{kv[0]}={kv[1]}"),
    st.tuples(st.sampled_from(["tp", "dp", "name", "role"]), stress).map(lambda kv: f'[{{"{kv[0]}": {kv[1]}}}]'),
    st.tuples(st.sampled_from(["tp", "dp", "name", "role"]), stress).map(lambda kv: f"- {{{kv[0]}: {kv[1]}}}"),
)
"""Inputs that stress the parsers (int limits, unicode, control characters, nesting) rather than the grammar."""
spec_strings = st.one_of(
    grammar, junk, stressed, st.from_regex(r"((tp|pp|cp|dp|ep|expt_tp)=[0-9]{1,3},?){1,4}([+;].*)?")
)
values = st.one_of(
    st.integers(-3, 2**40),
    st.sampled_from([10**5000, -(10**4400), 2**24 + 1]),
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


def bounded(call: Callable[[], Any], cli: bool = False) -> None:
    """Only the errors bad input may raise, with short messages, within the time and memory budget."""
    cost = measure_input(call, cli)
    assert cost.problem is None, cost.problem
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
        st.sampled_from(FLAGS),
        max_size=4,
    ),
)
def test_plan_cli(world: str, spec: str, flags: list[str]) -> None:
    bounded(lambda: main(["plan", f"--world={world}", f"--shards={spec}", *flags]), cli=True)


@FUZZ
@pytest.mark.filterwarnings("ignore::shardcore.errors.ShardSpecWarning")  # Megatron-valid input that warns
@given(stressed)
def test_parser_stress(spec: str) -> None:
    bounded(lambda: parse_shards(spec))


anything = st.one_of(
    st.none(),
    st.booleans(),
    st.integers(),
    st.sampled_from([10**5000, 2**24 + 1]),
    st.floats(),
    st.text(max_size=20),
    st.lists(st.integers(), max_size=3),
    st.timedeltas(),
    st.sampled_from(["local", "world", "tp-pp-dp", "tp", ("tp", "dp")]),
)


@FUZZ
@given(anything)
def test_timeouts_are_in_range_or_refused(timeout: Any) -> None:
    try:
        value = as_timedelta(timeout)
    except ShardcoreError as error:
        assert "timeout=" in str(error) and len(str(error)) < 300
    else:
        assert timedelta(0) < value <= MAX_TIMEOUT


BAD_ARGUMENTS: dict[str, list[Any]] = {
    "timeout": [float("nan"), float("inf"), 1e20, "abc", [5], 0, -(10**5000), True],
    "strategy": [5, "all", None, ["local"]],
    "order": [[1], "tp", 5, None],
    "rank_offset": ["1", -1, 10**5000, 1.0, None],
    "allow_idle": ["no", 1, None],
    "groups": [5, [5], "bogus", b"tp"],
    "backend": [5, b"x", ["dtensor"]],
}


@FUZZ
@given(
    st.sampled_from(sorted(BAD_ARGUMENTS)).flatmap(
        lambda bad: st.tuples(st.just(bad), st.sampled_from(BAD_ARGUMENTS[bad]))
    ),
    st.dictionaries(st.sampled_from(sorted(BAD_ARGUMENTS)), anything),
)
def test_build_shards_arguments(bad: tuple[str, Any], others: dict[str, Any]) -> None:
    """One bad argument among any others: refused with a typed error before torch is touched (none is imported)."""
    kwargs = {**others, bad[0]: bad[1]}
    cost = measure_input(lambda: build_shards(8, "tp=8", **kwargs))
    assert cost.problem is None and cost.seconds < MAX_SECONDS
    try:
        build_shards(8, "tp=8", **kwargs)
    except LayoutError as error:
        assert len(str(error)) < 400
    else:
        raise AssertionError(f"{kwargs} was accepted")


HOSTILE = [
    "[" * 100_000,
    "{" * 5000,
    "- " * 50_000 + "x",
    "- [" * 3000,
    "[]" * 50_000,
    "tp=" + "9" * 5000,
    f'[{{"tp": {"9" * 5000}}}]',
    f"- {{tp: {'9' * 5000}}}",
    "- {tp: 0b" + "1" * 20_000 + "}",
    "- {tp: 2, name: \ud800}",
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


REFIT_INPUTS = 10_000
CLI_SHARE = 0.08
"""Of the inputs, CLI lines: each builds argparse's parser anew (about 5-10 ms here), the rest take about 1 ms."""


@pytest.mark.filterwarnings("ignore::shardcore.errors.ShardSpecWarning")
def test_malformed_refit_inputs(tmp_path: Path) -> None:
    """10,000 seeded random inputs (benchmarks/manifest_inputs.py): manifest mappings, JSON and YAML files,
    the manifest API's arguments, `shardcore refit` and `shardcore plan` lines; 0 problems."""
    rng = random.Random(20_261_201)
    counts: Counter[str] = Counter()
    problems = []
    for index in range(REFIT_INPUTS):
        kind, call, described = random_input(rng, tmp_path, CLI_SHARE)
        counts[kind] += 1
        problem = answer(call, cli=kind.endswith("_cli")).problem
        if problem is not None:
            problems.append(f"input {index} ({kind}): {problem} | {described}")
    assert not problems, f"{len(problems)} problems, the first: " + "\n".join(problems[:5])
    assert set(counts) == {"manifest_dict", "manifest_file", "manifest_api", "refit_cli", "plan_document_cli"}
    assert min(counts.values()) >= 150, counts


json_values = st.recursive(
    st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=20) | st.sampled_from(BAD),
    lambda children: st.lists(children, max_size=4) | st.dictionaries(st.text(max_size=8), children, max_size=4),
    max_leaves=12,
)
"""Any JSON-like value, BAD's hand-picked ones among the leaves."""


def _mixed(good: dict[str, list[Any]]) -> st.SearchStrategy[dict[str, Any]]:
    """Mappings of the given keys (and some others), each value good or anything."""
    keys = st.sampled_from([*good, "bogus"])
    return st.dictionaries(keys, json_values, max_size=4).flatmap(
        lambda bad: st.fixed_dictionaries(
            {}, optional={key: st.sampled_from(options) for key, options in good.items()}
        ).map(lambda fine: {**fine, **bad})
    )


tensor_entries = _mixed(TENSOR_GOOD)
documents = st.one_of(
    json_values,
    st.tuples(_mixed(TOP_GOOD), st.lists(tensor_entries, max_size=3)).map(lambda pair: {**pair[0], "tensors": pair[1]}),
    st.tuples(_mixed(TOP_GOOD), _mixed(CONFIG_GOOD)).map(lambda pair: {**pair[0], "config": pair[1]}),
)


@FUZZ
@given(documents, st.sampled_from(["mapping", "json", "yaml"]))
def test_manifest_documents(document: Any, form: str) -> None:
    """A manifest document drawn by hypothesis, as a mapping or a JSON or YAML file: a manifest, or a short error."""
    if form == "mapping":
        assert answer(lambda: manifest_from_dict(to_api(document))).problem is None
        return
    with tempfile.TemporaryDirectory() as folder:
        path = Path(folder) / f"m.{form}"
        text = to_yaml(document) if form == "yaml" else to_json(document)
        path.write_bytes(text.encode("utf-8", "surrogatepass"))
        assert answer(lambda: load_manifest(path)).problem is None
