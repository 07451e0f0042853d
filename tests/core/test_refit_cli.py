"""`shardcore refit`: the summary table, --rank, --json (--transfers), --list-models, one-line errors."""

from __future__ import annotations

import json

import pytest

from shardcore.cli import main
from shardcore.plan.layout import plan_layout
from shardcore.refit import PRESETS, RefitStats, plan_refit, preset

SPEC = "tp=2,pp=2,dp=2,ep=2,role=train + tp=4,ep=4,expt_tp=1,role=prefill + tp=1,dp=4,ep=2,role=decode"
BASE = ("refit", "--world", "16", "--shards", SPEC, "--from", "0", "--to", "1,2", "--model", "tiny-moe")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_summary_table(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, *BASE, "--ranks-per-node", "4")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("refit tiny-moe (78 tensors")
    assert lines[1].split()[:3] == ["to", "role", "spec"] and "busiest rank" in lines[1]
    assert lines[2].split()[:2] == ["1", "prefill"] and lines[3].split()[:2] == ["2", "decode"]
    assert "busiest sender: rank" in out and "lower bound" in out and "estimate" in out


def test_rank_transfers_match_the_plan(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, *BASE, "--rank", "9")
    assert code == 0
    layout = plan_layout(16, SPEC)
    mine = plan_refit(layout, 0, [1, 2], preset("tiny-moe")).for_rank(9)
    assert f"rank 9: sends 0 (0 B), receives {len(mine.recvs)}" in out
    rows = [line.split() for line in out.splitlines() if line.startswith("recv ")]
    assert [(int(row[1]), row[2]) for row in rows] == [(t.src, t.tensor) for t in mine.recvs]


def test_json_with_transfers(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, *BASE, "--json", "--transfers", "--rank", "3")
    assert code == 0
    data = json.loads(out)
    plan = plan_refit(plan_layout(16, SPEC), 0, [1, 2], preset("tiny-moe"))
    assert data["transfers"] == [t.to_dict() for t in plan.transfers()]
    assert (
        data["total_bytes"]
        == RefitStats.of(plan).total_bytes
        == sum(t["bytes"] for t in data["transfers"] if t["src"] != t["dst"])
    )
    assert data["tensors"]["output_layer.weight"] == {"shape": [1024, 128], "dtype": "float32", "itemsize": 4}
    assert [s["shard"] for s in data["shards"]] == [1, 2]
    assert len(data["rank"]["sends"]) == len(plan.for_rank(3).sends)


def test_list_models(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, "refit", "--list-models")
    assert code == 0 and out.split() == list(PRESETS)


@pytest.mark.parametrize(
    ("argv", "message"),
    [
        (("--to", "1,x"), "--to '1,x': expected shard indices"),
        (("--to", "7"), "destination shard 7"),
        (("--model", "gpt5"), "cannot read manifest 'gpt5'"),
        (("--rank", "99"), "rank 99 is outside the world"),
        (("--shards", "tp=3+tp=4,dp=3"), "over tp=3 of shard 0"),
        (("--intra-gbps", "0"), "--intra-gbps 0.0"),
        (
            ("--min-piece", "1 parsec"),
            "--min-piece='1 parsec': expected a size: whole bytes >= 0 or a number with a unit",
        ),
        (("--min-piece", "-5"), "--min-piece='-5': expected a size"),
        (("--tensors", "*lora*"), "tensor pattern '*lora*' matches no tensor of 'tiny-moe'"),
        (("--tensors", ","), "--tensors is empty"),
    ],
)
def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], argv: tuple[str, ...], message: str) -> None:
    args = list(BASE)
    for flag, value in zip(argv[::2], argv[1::2]):
        if flag in args:
            args[args.index(flag) + 1] = value
        else:
            args += [flag, value]
    if "--shards" in argv:
        args[args.index("--to") + 1] = "1"
        args[args.index("--world") + 1] = "15"
    code, out, err = _run(capsys, *args)
    assert code == 2 and out == ""
    assert err.startswith("shardcore: error: ") and message in err and err.count("\n") == 1


def test_fan_out_floor_and_subset_flags(capsys: pytest.CaptureFixture[str]) -> None:
    two_nodes = ("refit", "--world", "8", "--shards", "tp=4,role=train + tp=2 + tp=2", "--from", "0", "--to", "1,2")
    argv = (*two_nodes, "--model", "tiny-dense", "--ranks-per-node", "4", "--fan-out", "--min-piece", "64KiB")
    code, out, _ = _run(capsys, *argv, "--json", "--transfers")
    assert code == 0
    data = json.loads(out)
    plan = plan_refit(
        plan_layout(8, "tp=4,role=train + tp=2 + tp=2"),
        0,
        [1, 2],
        preset("tiny-dense"),
        4,
        fan_out=True,
        min_piece_bytes=64 << 10,
    )
    stats = RefitStats.of(plan)
    assert data["transfers"] == [t.to_dict() for t in plan.transfers()] and any(
        t["hop"] == 1 for t in data["transfers"]
    )
    assert (data["fan_out"], data["min_piece_bytes"], data["refitted_tensors"]) == (True, 64 << 10, len(plan.manifest))
    assert data["inter_node_bytes"] == stats.inter_node_bytes < data["inter_node_bytes_without_fan_out"]
    assert data["relayed_bytes"] == stats.relayed_bytes > 0
    code, out, _ = _run(capsys, *argv)
    assert code == 0 and "fan-out relayed" in out and "inter-node without it" in out
    code, out, _ = _run(capsys, *BASE, "--tensors", "*.experts.*,embedding.*", "--json")
    part = plan_refit(plan_layout(16, SPEC), 0, [1, 2], preset("tiny-moe")).subset(
        lambda t: ".experts." in t.name or t.name.startswith("embedding.")
    )
    assert code == 0 and json.loads(out)["total_bytes"] == RefitStats.of(part).total_bytes
    assert json.loads(out)["refitted_tensors"] == len(part.tensors)  # type: ignore[arg-type]
    code, _, err = _run(capsys, *two_nodes, "--model", "tiny-dense", "--fan-out")
    assert code == 2 and "--fan-out relays tiles inside nodes: give --ranks-per-node K too" in err


def test_missing_arguments(capsys: pytest.CaptureFixture[str]) -> None:
    code, _, err = _run(capsys, "refit", "--world", "4", "--shards", "tp=2+tp=2", "--model", "tiny-dense")
    assert code == 2 and err == "shardcore: error: refit needs --from, --to (or --list-models)\n"
