"""Bad inputs: each a ShardSpecError or LayoutError naming the bad token; never a crash, hang or MemoryError.

Every public function and CLI flag, the same way: the message names the argument (or the shard
and key), shows the value shortened (never thousands of digits) and says what is accepted.
"""

from __future__ import annotations

import contextlib
import io
import json
import math
import sys
import time
import xml.etree.ElementTree as ET
from datetime import timedelta
from fractions import Fraction
from pathlib import Path
from typing import Any

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcore import (
    Grid,
    LayoutError,
    ShardcoreError,
    ShardSpec,
    ShardSpecError,
    build_shards,
    destroy_shards,
    format_shards,
    get_backend,
    my_shard,
    parse_shards,
    plan_layout,
    register_backend,
)
from shardcore.cli import main
from shardcore.plan.arguments import MAX_SHOWN, MAX_WORLD_SIZE, as_timedelta, shown
from shardcore.plan.topology import check_topology
from shardcore.views.picture import render_svg
from shardcore.views.tables import layout_table

BIG = 10**18
HUGE = "9" * 5000
"""Past Python's int-conversion limit (4,300 digits): int() and str() refuse it."""
MAX_MESSAGE = 400

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
    (f"tp={BIG}", 8, ShardSpecError, f"tp={BIG}: expected a whole number from 1 to {MAX_WORLD_SIZE}"),
    (f"tp={BIG},dp={BIG},pp={BIG}", 8, ShardSpecError, str(BIG)),
    (f"tp=2,ep={BIG}", 2, ShardSpecError, f"ep={BIG}"),
    (f"tp={2**24},dp=2", 2, ShardSpecError, f"= {2**25} ranks is over shardcore's limit"),
    (f"tp={2**24}+tp=1", 2**24, LayoutError, f"at most {MAX_WORLD_SIZE} ranks"),
    ("tp=4+tp=0", 8, ShardSpecError, "shard 1 ('tp=0'): tp=0"),
    ("tp=2+tp=2,role=chef", 8, ShardSpecError, "shard 1 ('tp=2,role=chef'): role='chef'"),
    ([{"tp": 2}, {"tp": 0}], 8, ShardSpecError, "shard 1 ({'tp': 0}): tp=0"),
    (["tp=2+tp=2", "tp=-3"], 8, ShardSpecError, "shard 2 ('tp=-3')"),
    ("tp=3,ep=2", 3, ShardSpecError, "expt_tp defaults to tp = 3"),
    ("tp=" + HUGE, 8, ShardSpecError, "tp=999999999999... (5000 digits)"),
    ("tp=" + "0" * 5000 + "2", 8, ShardSpecError, "(5001 digits)"),
    ("tp=2,dp=-" + HUGE, 8, ShardSpecError, "dp=-999999999999... (5000 digits)"),
    ("tp=2,name=" + HUGE + "=", 8, ShardSpecError, "name='99999999999"),
    (f'[{{"tp": {HUGE}}}]', 8, ShardSpecError, "tp=999999999999... (5000 digits)"),
    (f"- {{tp: 2, dp: {HUGE}}}", 8, ShardSpecError, "dp=999999999999... (5000 digits)"),
    (f"- tp: 1_{HUGE}", 8, ShardSpecError, "tp=1_9999999999... (5001 digits)"),
    ([{"tp": 10**5000}], 8, ShardSpecError, "tp=100000000000... (5001 digits)"),
    ([{"tp": 2, "name": 10**5000}], 8, ShardSpecError, "name=100000000000... (5001 digits)"),
    ([{"tp": 10**2000, "pp": 10**2000, "dp": 10**2000}], 8, ShardSpecError, "(2001 digits)"),
    ([{10**5000: 1}], 8, ShardSpecError, "unknown shard key 100000000000... (5001 digits)"),
    ([ShardSpec(tp=2), [10**5000]], 8, ShardSpecError, "shard 1: a shard must be"),
    ("tp=2", BIG, LayoutError, f"total_world_size={BIG}"),
    ("tp=2", 10**5000, LayoutError, "total_world_size=100000000000... (5001 digits)"),
    ("tp=2", 0, LayoutError, "total_world_size=0"),
    ("tp=2", -4, LayoutError, "-4"),
    ("tp=2", "8", LayoutError, "total_world_size='8'"),
    ("tp=2", 8.0, LayoutError, "total_world_size=8.0"),
    (42, 8, ShardSpecError, "int"),
    (None, 8, ShardSpecError, "NoneType"),
    (b"tp=2", 8, ShardSpecError, "bytes"),
    (object(), 8, ShardSpecError, "object"),
    (2.5, 8, ShardSpecError, "float"),
    ({"tp": 2, "bogus": 1}, 2, ShardSpecError, "'bogus'"),
    ([{"tp": "2"}], 2, ShardSpecError, "'2'"),
    ([{"tp": True}], 2, ShardSpecError, "True"),
    ([{"tp": 2, "tpp": 1}], 2, ShardSpecError, "'tpp'"),
    ([3], 2, ShardSpecError, "int"),
    ('[{"tp": 0}]', 2, ShardSpecError, "tp=0"),
    ("[tp: 2", 2, ShardSpecError, "neither JSON nor YAML"),
    ("tp: 2", 1, LayoutError, "world has 1"),
    ("7", 2, ShardSpecError, "expected key=value"),
    ("- 7", 2, ShardSpecError, "int"),
    ("- {role: chef}", 2, ShardSpecError, "'chef'"),
    ("@/nonexistent/shards.yaml", 2, ShardSpecError, "/nonexistent/shards.yaml"),
]


@pytest.mark.parametrize(("shards", "world", "error", "token"), BAD, ids=[shown(row[0])[:40] for row in BAD])
def test_bad_input(shards: Any, world: int, error: type[ShardcoreError], token: str) -> None:
    start = time.perf_counter()
    with pytest.raises(error) as info:
        plan_layout(world, shards)
    assert token in str(info.value)
    assert "\n" not in str(info.value)  # one line, for the CLI
    assert len(str(info.value)) < MAX_MESSAGE + 200, str(info.value)[:MAX_MESSAGE]
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
    with pytest.raises(LayoutError, match=r"rank_offset=100000000000\.\.\. \(5001 digits\)"):
        plan_layout(8, "tp=2", rank_offset=10**5000)
    with pytest.raises(LayoutError, match=r"order=\[1\]: expected one of"):
        plan_layout(2, "tp=2", order=[1])  # type: ignore[arg-type]
    with pytest.raises(LayoutError, match="allow_idle='no': expected True or False"):
        plan_layout(8, "tp=2", allow_idle="no")  # type: ignore[arg-type]


def test_rank_queries_out_of_range() -> None:
    layout = plan_layout(4, "tp=4")
    for bad in (-1, 4, True, "0", 1.0, 10**5000, [0]):
        with pytest.raises(LayoutError, match="outside the world") as info:
            layout.groups_of(bad)  # type: ignore[arg-type]
        assert len(str(info.value)) < MAX_MESSAGE
    plan = layout.shards[0]
    for call, token in [
        (lambda: plan.groups_of(0, ["tp", "bogus"]), "unknown group name 'bogus'"),
        (lambda: plan.groups_of(0, 5), "names=5"),
        (lambda: list(plan.iter_groups("bogus")), "unknown group name 'bogus'"),
        (lambda: plan.grid_of(["tp"]), "group ['tp'] is not defined by a grid"),
        (lambda: plan.coords(10**5000), "(5001 digits) is outside"),
    ]:
        with pytest.raises(LayoutError, match=re_escape(token)):
            call()


def re_escape(text: str) -> str:
    import re

    return re.escape(text)


@pytest.mark.parametrize(
    ("call", "token"),
    [
        (lambda: Grid([2, "2"], ["a", "b"]), "grid dim b='2'"),
        (lambda: Grid([2, 10**5000], ["a", "b"]), "grid dim b=100000000000... (5001 digits)"),
        (lambda: Grid([2], [5]), "expected non-empty strings"),
        (lambda: Grid(5, ["a"]), "grid shape=5: expected a sequence"),  # type: ignore[arg-type]
        (lambda: Grid([2], "a"), "grid dim_names='a': expected a sequence"),
        (lambda: Grid([2], ["a"], rank_offset=-1), "rank_offset=-1"),
        (lambda: Grid([2], ["a"], rank_offset=1.0), "rank_offset=1.0"),  # type: ignore[arg-type]
        (lambda: Grid([2], ["a"]).group_ranks(0, 5), "dims=5"),  # type: ignore[arg-type]
        (lambda: Grid([2], ["a"]).group_ranks(0, [["a"]]), "unknown grid dim ['a']"),  # type: ignore[list-item]
        (lambda: Grid([2], ["a"]).rank_at({"a": "1"}), "coordinate a='1'"),  # type: ignore[dict-item]
        (lambda: Grid([2], ["a"]).rank_at([("a", 1)]), "coords=[('a', 1)]"),  # type: ignore[arg-type]
        (lambda: Grid([2], ["a"]).coords(10**5000), "(5001 digits) is outside"),
        (lambda: format_shards("tp=2"), "format_shards takes a sequence of ShardSpec"),  # type: ignore[arg-type]
        (lambda: format_shards([ShardSpec(), {"tp": 2}]), "format_shards takes"),  # type: ignore[list-item]
        (lambda: my_shard(5), "shards=5: expected the list"),  # type: ignore[arg-type]
        (lambda: destroy_shards(["x"]), "shards=['x']"),  # type: ignore[list-item]
        (lambda: ShardSpec(tp=2, role="Chef"), "role='Chef'"),
        (lambda: get_backend(["dtensor"]), "backend name ['dtensor']: expected a string"),  # type: ignore[arg-type]
        (lambda: register_backend(5), "register_backend(5): expected a Backend"),  # type: ignore[arg-type]
        (lambda: check_topology(plan_layout(8, "tp=8"), 10**5000), "ranks_per_node=100000000000... (5001 digits)"),
        (lambda: render_svg(plan_layout(8, "tp=8"), 10**5000, None), "ranks_per_node=100000000000..."),
        (lambda: ShardSpec(tp=2, expt_tp=10**5000), "expt_tp=100000000000... (5001 digits)"),
        (lambda: Grid([2, 2], ["a" * 10_000] * 2), "(10000 characters)"),
        (lambda: Grid([2, 2], ["a", "b"]).group_ranks(0, ["a" * 10_000] * 2), "unknown grid dim 'aaaa"),
        (lambda: render_svg(plan_layout(8, "tp=8"), 8, "x" * 10_000), "highlight='xxxx"),
        (lambda: get_backend("x" * 10_000), "no backend named 'xxxx"),
        (lambda: parse_shards("@" + "/x" * 5000), "cannot read shard file '/x/x/x"),
        (lambda: parse_shards("- {tp: 2, name: *" + "a" * 10_000 + "}"), "neither JSON nor YAML"),
    ],
)
def test_public_functions_check_their_arguments(call: Any, token: str) -> None:
    with pytest.raises(ShardcoreError) as info:
        call()
    assert token in str(info.value)
    assert len(str(info.value)) < MAX_MESSAGE


NOT_SECONDS: list[Any] = [
    float("nan"),
    float("inf"),
    -float("inf"),
    1e20,
    10**5000,
    "abc",
    "5",
    [5],
    object(),
    0,
    -1,
    0.0,
    True,
    timedelta(0),
    timedelta(days=8),
    timedelta(seconds=-1),
]


@pytest.mark.parametrize("timeout", NOT_SECONDS, ids=shown)
def test_timeouts(timeout: Any) -> None:
    with pytest.raises(LayoutError, match="timeout=") as info:
        as_timedelta(timeout)
    assert "expected seconds" in str(info.value) and len(str(info.value)) < MAX_MESSAGE


@pytest.mark.parametrize("timeout", [1, 2.5, Fraction(1, 2), timedelta(minutes=1), 604800, None])
def test_good_timeouts(timeout: Any) -> None:
    assert as_timedelta(timeout) > timedelta(0)


BUILD_CALLS: list[tuple[dict[str, Any], str]] = [
    *[({"timeout": timeout}, "timeout=") for timeout in NOT_SECONDS],
    ({"groups": 5}, "groups=5: expected group names"),
    ({"groups": [5]}, "groups=[5]"),
    ({"groups": ["tp", "bogus"]}, "unknown group name 'bogus'"),
    ({"strategy": "nowhere"}, "strategy='nowhere': expected one of auto, local, world"),
    ({"strategy": ["local"]}, "strategy=['local']"),
    ({"order": [1]}, "order=[1]"),
    ({"order": "tp-dp-cp"}, "order='tp-dp-cp'"),
    ({"rank_offset": "1"}, "rank_offset='1'"),
    ({"rank_offset": 10**5000}, "rank_offset=100000000000... (5001 digits)"),
    ({"allow_idle": "no"}, "allow_idle='no'"),
    ({"backend": 5}, "backend=5: expected a backend name"),
    ({"total_world_size": "8"}, "total_world_size='8'"),
    ({"total_world_size": 10**5000}, "total_world_size=100000000000... (5001 digits)"),
]


@pytest.mark.parametrize(("kwargs", "token"), BUILD_CALLS, ids=[shown(row[0]) for row in BUILD_CALLS])
def test_build_shards_checks_arguments_before_torch(kwargs: dict[str, Any], token: str) -> None:
    """Checked before torch.distributed is touched: here no world exists (nor torch, in the core env)."""
    arguments = {"total_world_size": 8, "shards": "tp=8", **kwargs}
    with pytest.raises(LayoutError) as info:
        build_shards(**arguments)
    assert token in str(info.value) and len(str(info.value)) < MAX_MESSAGE


UNPRINTABLE = ["a\x0bb", "\x1b[31mred", "a\x00", "a\x7f", "a\x85b", "a\u2028b", "\u202eevil", "a\ud800", "a\nb", "a\tb"]


@pytest.mark.parametrize("name", UNPRINTABLE, ids=ascii)
def test_names_must_be_printable(name: str) -> None:
    with pytest.raises(ShardSpecError, match="name="):
        parse_shards([{"tp": 2, "name": name}])
    with pytest.raises(ShardSpecError, match="name="):
        parse_shards(json.dumps([{"tp": 2, "name": name}]))


@settings(deadline=None, max_examples=200)
@given(st.lists(st.text(min_size=1, max_size=12), min_size=1, max_size=3, unique=True))
def test_every_accepted_name_keeps_every_output_well_formed(names: list[str]) -> None:
    """Table, JSON and SVG, whatever name the spec accepts (XML's specials included)."""
    names = [*names, "<&'\">", "ünï código 名前 🚀"]
    try:
        layout = plan_layout(2 * len(names), [{"tp": 2, "name": name} for name in names])
    except ShardSpecError:
        return  # a rejected name reaches no output
    svg = render_svg(layout, 4, None)
    texts = "".join(ET.fromstring(svg).itertext())  # parses: well-formed XML
    assert all(name in texts for name in names)
    assert [plan["spec"]["name"] for plan in json.loads(layout.to_json())["shards"]] == names
    table = layout_table(layout)
    assert all(char.isprintable() for line in table.splitlines() for char in line)


CLI_FLAGS: list[tuple[list[str], str]] = [
    (["--world", HUGE, "--shards", "tp=2"], "' (5000 characters) is not a positive integer"),
    (["--world", "8", "--shards", "tp=2", "--rank-offset", HUGE], "argument --rank-offset"),
    (["--world", "8", "--shards", "tp=8", "--rank", HUGE], "argument --rank"),
    (["--world", "8", "--shards", "tp=8", "--ranks-per-node", HUGE], "argument --ranks-per-node"),
    (["--world", "8", "--shards", "tp=8", "--rank", "1.5"], "argument --rank: 1.5 is not a non-negative integer"),
    (["--world", "8", "--shards", "tp=" + HUGE], "shardcore: error: shard 0"),
    (["--world", "9" * 4000, "--shards", "tp=2"], "total_world_size=999999999999... (4000 digits)"),
    (["--world", "8", "--shards", "tp=8", "--rank", "9" * 4000], "rank 999999999999... (4000 digits)"),
    (["--world", "8", "--shards", "tp=2", "--rank-offset", "9" * 4000], "rank_offset=999999999999..."),
    (["--world", "8", "--shards", "tp=8", "--ranks-per-node", "9" * 4000], "ranks_per_node=999999999999..."),
    (["--world", "8", "--shards", "tp=2,name=a\x1b[31m"], "must be printable"),
    (["--world", "8", "--shards", "tp=8", "--order", "x" * 10_000], "(choose from 'tp-cp-dp-pp', 'tp-cp-pp-dp'"),
    (["--world", "8", "--shards", "tp=8", "y" * 10_000], "unrecognized arguments: yyyy"),
    (["--world", "8", "--shards", "tp=8", "--svg", "/nonexistent/" + "z" * 10_000], "cannot write '/nonexistent/zz"),
]


@pytest.mark.parametrize(("flags", "token"), CLI_FLAGS, ids=[" ".join(row[0])[:60] for row in CLI_FLAGS])
def test_plan_flags(flags: list[str], token: str) -> None:
    """One error line (after argparse's usage for a malformed flag), short, no traceback, exit 2."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err), contextlib.redirect_stdout(io.StringIO()):
        try:
            code = main(["plan", *flags])
        except SystemExit as exit_:
            code = exit_.code
    last = err.getvalue().rstrip("\n").splitlines()[-1]
    assert code == 2 and token in last and "Traceback" not in err.getvalue(), err.getvalue()[:MAX_MESSAGE]
    assert len(err.getvalue()) < 2 * MAX_MESSAGE + 400


@pytest.mark.parametrize("timeout", ["nan", "inf", "1e20", "0", "-1", "abc", HUGE])
def test_check_timeout_flag_is_refused_before_anything_starts(timeout: str) -> None:
    err = io.StringIO()
    with contextlib.redirect_stderr(err), pytest.raises(SystemExit) as info:
        main(["check", "--shards", "tp=2", "--nproc", "2", "--timeout", timeout])
    message = err.getvalue()
    assert info.value.code == 2 and "argument --timeout: " in message
    assert "is not a positive number of seconds (at most 604800)" in message
    assert len(err.getvalue()) < 2 * MAX_MESSAGE + 400


def test_cli_warning_is_one_line(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--world", "4", "--shards", "tp=2,tp=4"]) == 0
    err = capsys.readouterr().err
    assert err == "shardcore: warning: shard 0 ('tp=2,tp=4'): key 'tp' repeated; the last value wins\n"


NESTED_ALIASES = [
    # 6 levels of 7 aliases of the level below: a 260-byte YAML document with 7**7 leaves
    "{pp: &l0 [1,1,1,1,1,1,1], "
    + ", ".join(f"k{i}: &l{i} [{', '.join([f'*l{i - 1}'] * 7)}]" for i in range(1, 6))
    + ", cp: ["
    + ", ".join(["*l5"] * 7)
    + "]}",
    "{pp: &l0 [" + ", ".join(["1"] * 40) + "], cp: [" + ", ".join(["*l0"] * 200) + "]}",
    "- {tp: 2, name: &n " + "x" * 5000 + "}\n- {tp: 2, name: *n}\n",
]


@pytest.mark.parametrize("spec", NESTED_ALIASES, ids=["levels", "wide", "names"])
def test_aliased_documents_give_short_errors(spec: str) -> None:
    """Each value of a YAML spec is shown bounded: the first gave 72 KB of error text, a longer one 433 KB."""
    err = io.StringIO()
    with contextlib.redirect_stderr(err):
        assert main(["plan", "--world", "8", "--shards", spec]) == 2
    assert err.getvalue().startswith("shardcore: error: ") and err.getvalue().count("\n") == 1
    assert len(err.getvalue()) < 1024, len(err.getvalue())


def test_shown_is_short_for_anything() -> None:
    assert shown(10**5000) == "100000000000... (5001 digits)"
    assert shown(-(10**40)) == "-100000000000... (41 digits)"
    assert shown(99999999999999999999) == "99999999999999999999"
    assert shown("x" * 10_000).endswith("(10000 characters)")
    assert len(shown([10**5000] * 1000)) < MAX_MESSAGE
    assert len(shown({"k" * 1000: [[[[["deep"]]]]]})) < MAX_MESSAGE
    level: list[Any] = [1] * 7
    for _ in range(7):
        level = [level] * 7  # 7**8 leaves, shared
    assert len(shown(level)) <= MAX_SHOWN + 3 and len(shown({i: level for i in range(100)})) <= MAX_SHOWN + 3
    assert sys.get_int_max_str_digits() in (0, 4300) and math.isfinite(len(shown(10**100_000)))


@pytest.mark.parametrize(
    ("text", "token"),
    [
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
@pytest.mark.filterwarnings("ignore::shardcore.errors.ShardSpecWarning")  # Megatron-valid input that warns
def test_whitespace_variants_are_valid(text: str) -> None:
    assert {spec.tp for spec in parse_shards(text)} == {2}


@pytest.mark.filterwarnings("ignore::shardcore.errors.ShardSpecWarning")  # Megatron-valid input that warns
@settings(deadline=None, max_examples=200)
@given(st.integers(-5, 1 << 30), st.text(alphabet="tpdcer_=,+;0123456789 -x:[]{}", max_size=25))
def test_any_world_and_text_is_planned_or_a_typed_error(world: int, text: str) -> None:
    try:
        layout = plan_layout(world, text)
    except (ShardSpecError, LayoutError) as error:
        assert str(error) and "\n" not in str(error)
    else:
        assert sum(plan.size for plan in layout.shards) == world
