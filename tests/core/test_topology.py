"""Node topology: hand-checked layouts, the histogram count against brute force, and the CLI."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from shardcore.cli import main
from shardcore.errors import LayoutError
from shardcore.plan.layout import DECODER_GROUPS, EXPERT_GROUPS, plan_layout
from shardcore.plan.topology import TOPOLOGY_GROUPS, check_topology, node_crossings


def test_tp16_on_8_rank_nodes_is_a_warning() -> None:
    report = check_topology(plan_layout(32, "tp=16,dp=2"), 8)
    tp = report.finding(0, "tp")
    assert (tp.severity, tp.crossing, tp.total, tp.group_size) == ("warning", 2, 2, 16)
    assert tp.example == tuple(range(16))
    assert "tp" in {f.name for f in report.warnings}
    assert report.finding(0, "dp").severity == "info"  # [0, 16] crosses but is no bandwidth group


def test_tp8_aligned_is_not_flagged() -> None:
    report = check_topology(plan_layout(32, "tp=8,dp=2,pp=2"), 8)
    for name in ("tp", "cp", "ep", "expt_tp", "tp_ep", "tp_cp"):
        finding = report.finding(0, name)
        assert (finding.severity, finding.crossing, finding.example) == ("ok", 0, None)
    assert report.warnings == ()
    assert report.sharing == ()
    assert "no warnings" in report.format()


def test_pp_crossing_nodes_is_info_not_warning() -> None:
    report = check_topology(plan_layout(16, "tp=8,pp=2"), 8)
    pp = report.finding(0, "pp")
    assert (pp.severity, pp.crossing, pp.total, pp.example) == ("info", 8, 8, (0, 8))
    assert report.warnings == ()


def test_shard_starting_mid_node_shares_nodes_and_its_tp_group_crosses() -> None:
    layout = plan_layout(32, "tp=4,dp=3,role=train+tp=8,role=decode", allow_idle=True)  # decode: ranks [12, 20)
    report = check_topology(layout, 8)
    first, decode = report.placements
    assert (first.starts_mid_node, first.ends_mid_node, first.shares_node) == (False, True, True)
    assert first.shared_nodes == (1,) and decode.shared_nodes == (1, 2)
    assert (decode.ranks, decode.nodes) == (range(12, 20), range(1, 3))
    assert decode.starts_mid_node and decode.ends_mid_node
    assert report.finding(1, "tp").example == tuple(range(12, 20))
    assert report.finding(0, "tp").crossing == 0  # [8, 12) stays inside node 1
    text = report.format()
    assert "straddl" not in text
    assert "shard 0: ranks [0, 12) on nodes 0-1, shares node 1 with other ranks (ends at local rank 3)" in text
    assert (
        "shard 1: ranks [12, 20) on nodes 1-2, shares nodes 1 and 2 with other ranks (starts at local rank 4, " in text
    )
    assert "warning  shard 1 tp = expt_tp = tp_ep (one communicator): 1 of 1 group crosses nodes" in text


def test_a_shard_ending_mid_node_on_one_node_shares_it() -> None:
    layout = plan_layout(8, "tp=4+tp=4")
    text = check_topology(layout, 8).format()
    assert "shard 0: ranks [0, 4) on node 0, shares node 0 with other ranks (ends at local rank 3)" in text
    assert "node topology: 8 ranks on 1 node of 8" in text


def test_one_warning_per_communicator_when_names_share_it() -> None:
    """tp=8, ep=1, expt_tp defaulting to tp: tp, tp_cp, expt_tp and tp_ep are one rank set."""
    report = check_topology(plan_layout(24, "tp=8,dp=2", rank_offset=4, allow_idle=True), 8)
    names = {f.name for f in report.warnings}
    assert {"tp", "expt_tp", "tp_ep"} <= names
    text = report.format()
    warning_lines = [line for line in text.splitlines() if line.startswith("  warning")]
    assert len(warning_lines) == len(report.communicators(report.warnings))
    tp_line = next(line for line in warning_lines if " tp " in line or " tp =" in line)
    assert "tp = " in tp_line and "expt_tp" in tp_line and "tp_ep" in tp_line and "(one communicator)" in tp_line
    assert sum("expt_tp" in line for line in warning_lines) == 1
    assert text.splitlines()[-1].startswith(f"{len(warning_lines)} warning")


def test_names_merge_only_when_their_rank_sets_match() -> None:
    """tp=4 and tp_ep = expt_tp(2) x ep(2) are the same four ranks; ep alone is another set."""
    report = check_topology(plan_layout(16, "tp=4,ep=2,expt_tp=2,dp=2", rank_offset=2, allow_idle=True), 8)
    merged = [[f.name for f in same] for same in report.communicators(report.warnings)]
    assert sorted(merged) == [["ep"], ["tp", "tp_ep"]]


def test_last_shard_ending_the_world_does_not_share_a_node() -> None:
    report = check_topology(plan_layout(12, "tp=4,dp=3"), 8)
    assert not report.placements[0].shares_node
    assert report.num_nodes == 2


def test_every_grid_group_name_is_reported_per_shard() -> None:
    report = check_topology(plan_layout(16, "tp=2,ep=2,pp=2,dp=2+tp=8"), 4)
    assert [f.name for f in report.groups if f.shard == 1] == list(TOPOLOGY_GROUPS)
    assert len(TOPOLOGY_GROUPS) == 13
    json.dumps(report.to_dict())


@pytest.mark.parametrize("bad", [0, -8, 2.5, True, "8", None])
def test_ranks_per_node_must_be_a_positive_int(bad: object) -> None:
    with pytest.raises(LayoutError, match=repr(bad).replace(".", r"\.")):
        check_topology(plan_layout(8, "tp=8"), bad)  # type: ignore[arg-type]


def test_a_million_ranks_is_cheap_and_lists_no_huge_group() -> None:
    report = check_topology(plan_layout(1 << 20, "tp=8,cp=2,pp=8,dp=8192,ep=8"), 8)
    assert {f.name for f in report.warnings} == {"cp", "ep", "tp_ep"}
    dp = report.finding(0, "dp")
    assert dp.crossing == dp.total == 128
    assert dp.describe_example() == "the 8192-rank group spanning ranks 0-131056"
    assert report.to_dict()["groups"][3]["example"] is None  # dp: too big to list


@st.composite
def layouts(draw: st.DrawFn) -> tuple[object, int]:
    """A one-shard layout at a random offset, with a valid expert split, and a node size."""
    tp, cp, pp, dp = (draw(st.sampled_from([1, 2, 3, 4])) for _ in range(4))
    rest = tp * cp * dp
    expt_tp = draw(st.sampled_from([d for d in range(1, rest + 1) if rest % d == 0]))
    ep = draw(st.sampled_from([e for e in range(1, rest // expt_tp + 1) if (rest // expt_tp) % e == 0]))
    order = draw(st.sampled_from(["tp-cp-dp-pp", "tp-cp-pp-dp"]))
    if order == "tp-cp-pp-dp" and pp > 1 and tp * cp != expt_tp * ep:
        order = "tp-cp-dp-pp"
    offset = draw(st.integers(0, 13))
    spec = f"tp={tp},cp={cp},pp={pp},dp={dp},ep={ep},expt_tp={expt_tp}"
    layout = plan_layout(offset + tp * cp * pp * dp, spec, order=order, rank_offset=offset)
    return layout, draw(st.integers(1, 20))


@settings(deadline=None, max_examples=300)
@given(layouts())
def test_counts_and_first_example_match_brute_force(case: tuple[object, int]) -> None:
    layout, k = case
    plan = layout.shards[0]  # type: ignore[attr-defined]
    for grid, names in ((plan.decoder_grid, DECODER_GROUPS), (plan.expert_grid, EXPERT_GROUPS)):
        for dims in names.values():
            crossing = [g for g in grid.iter_groups(dims) if g[0] // k != g[-1] // k]
            assert node_crossings(grid, dims, k) == (len(crossing), crossing[0][0] if crossing else None)


SPEC = "tp=4,pp=2,dp=2,role=train+tp=2,dp=2,role=prefill+tp=8,role=decode"  # decode: ranks [20, 28)


def test_cli_prints_findings_after_the_table(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--world", "32", "--shards", SPEC, "--allow-idle", "--ranks-per-node", "8"]) == 0
    out = capsys.readouterr().out
    assert out.index("idle ranks") < out.index("node topology: 32 ranks on 4 nodes of 8")
    assert "warning  shard 2 tp" in out


def test_cli_strict_exits_1_on_warnings_and_0_without(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["plan", "--world", "32", "--shards", SPEC, "--allow-idle", "--ranks-per-node"]
    assert main([*args, "8", "--strict"]) == 1
    assert main([*args, "4", "--strict"]) == 1  # tp=8 crosses 4-rank nodes anyway
    assert main([*args, "32", "--strict"]) == 0
    aligned = ["plan", "--world", "16", "--shards", "tp=8,pp=2", "--ranks-per-node", "8", "--strict"]
    assert main(aligned) == 0  # pp crosses nodes: info only
    capsys.readouterr()
    assert main([*aligned, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["topology"]["warnings"] == 0


def test_cli_json_carries_the_report_and_strict(capsys: pytest.CaptureFixture[str]) -> None:
    args = ["--allow-idle", "--ranks-per-node", "8", "--strict", "--json"]
    code = main(["plan", "--world", "32", "--shards", SPEC, *args])
    data = json.loads(capsys.readouterr().out)
    assert code == 1
    assert data["topology"]["warnings"] == 3
    assert data["topology"]["placements"][2]["shares_node"] is True


def test_cli_strict_without_ranks_per_node_is_a_usage_error(capsys: pytest.CaptureFixture[str]) -> None:
    assert main(["plan", "--world", "8", "--shards", "tp=8", "--strict"]) == 2
    assert "--ranks-per-node" in capsys.readouterr().err
    with pytest.raises(SystemExit) as exit_info:
        main(["plan", "--world", "8", "--shards", "tp=8", "--ranks-per-node", "0"])
    assert exit_info.value.code == 2
    assert "argument --ranks-per-node: 0 is not a positive integer" in capsys.readouterr().err
