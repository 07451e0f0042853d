"""`shardcore replan`: the table, --json, --svg, and one-line errors, in-process through main(argv)."""

from __future__ import annotations

import json
import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from shardcore.cli import main
from shardcore.plan import plan_layout
from shardcore.refit import preset
from shardcore.replan import replan

SPEC = "tp=8,pp=2,dp=2,role=train+tp=8,dp=4,role=decode"
BASE = ("replan", "--world", "72", "--allow-idle", "--shards", SPEC, "--model", "llama3-70b", "--ranks-per-node", "8")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_table_ranks_the_options_and_details_the_best(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, *BASE, "--lost", "8-15", "--memory-gb", "80")
    assert code == 0 and err == ""
    lines = out.splitlines()
    assert lines[0].startswith("replan llama3-70b on a world of 72 after losing ranks 8-15 (whole node 1)")
    assert "8 of shard 0 'tp=8,pp=2,dp=2,role=train'" in lines[0]
    assert lines[1].split()[:4] == ["#", "kind", "new", "spec"]
    assert lines[2].split()[:2] == ["1", "shrink"]
    assert "best: option 1 (shrink), a world of 56" in out
    assert "released (old ranks; they leave with the lost ones): 24-31" in out
    assert "dp 16/16" in out and "restore: no rank needs other weights" in out


def test_json_is_the_api(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, _ = _run(capsys, *BASE, "--lost", "8-15", "--json")
    assert code == 0
    data = json.loads(out)
    result = replan(plan_layout(72, SPEC, allow_idle=True), preset("llama3-70b"), lost=range(8, 16), ranks_per_node=8)
    assert [option["kind"] for option in data["options"]] == [option.kind for option in result.options]
    assert data["lost"] == list(range(8, 16)) and data["options"][0]["moves"] == []
    shift = next(option for option in data["options"] if option["kind"] == "shift")
    assert shift["moved"] == 24 and all(move["needs_weights"] for move in shift["moves"])


def test_missing_copies_are_listed(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("replan", "--world", "4", "--shards", "tp=2+tp=2", "--model", "tiny-dense", "--lost", "0,2")
    code, out, _ = _run(capsys, *argv)
    assert code == 0
    assert (
        "missing: embedding.word_embeddings.weight [0:512, 0:128]: no surviving copy; held only by lost ranks 0, 2"
        in out
    )


def test_svg_outlines_the_ranks_that_need_weights(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    picture = tmp_path / "new.svg"
    code, _, err = _run(capsys, *BASE, "--lost", "8-15", "--keep", "0", "--new-world", "72", "--svg", str(picture))
    assert code == 0 and f"wrote {picture}" in err
    marked = [e for e in ET.parse(picture).iter() if e.tag.endswith("rect") and e.get("data-rank") is not None]
    outlined = {int(e.get("data-rank")) for e in marked if e.get("stroke") is None and e.get("fill") is None}
    best = replan(
        plan_layout(72, SPEC, allow_idle=True), preset("llama3-70b"), lost=range(8, 16), world_size=72, keep=[0]
    ).best
    assert outlined == {move.new for move in best.moves if move.needs_weights} != set()


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--lost", "80"), "lost rank 80 is outside the world [0, 72)"),
        (("--lost", "8-x"), "--lost '8-x': expected a rank or a range like 8-15"),
        (("--lost", "9-8"), "--lost '9-8'"),
        (("--lost", ","), "--lost: expected 1 to 4096 ranks or ranges"),
        (("--lost", "8", "--keep", "5"), "keep=[5]: expected shard indices from 0 to 1"),
        (("--lost", "8", "--memory-gb", "0"), "--memory-gb 0.0"),
        (("--lost", "0-71"), "every one of the 72 ranks is lost"),
        ((), "replan needs --lost RANKS"),
        (("--lost", "8", "--option", "2"), "--option needs --check"),  # were silently ignored
        (("--lost", "8", "--shrink"), "--shrink needs --check"),
        (("--lost", "8", "--backend", "dtensor", "--shrink"), "--backend, --shrink need --check"),
    ],
)
def test_bad_input_is_one_line(capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], message: str) -> None:
    code, out, err = _run(capsys, *BASE, *extra)
    assert code == 2 and out == ""
    assert err.startswith("shardcore: error: ") and message in err and err.count("\n") == 1


def test_one_lost_rank_and_one_option_read_in_the_singular(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("replan", "--world", "6", "--allow-idle", "--shards", "tp=2,pp=2,role=train+tp=2,role=prefill")
    code, out, _ = _run(capsys, *argv, "--lost", "1", "--model", "tiny-dense")
    assert code == 0
    assert out.splitlines()[0].startswith("replan tiny-dense on a world of 6 after losing rank 1: 1 of shard 0")
    assert "; 1 option in " in out.splitlines()[0]


MIXED = ("replan", "--world", "24", "--shards", "tp=4,dp=2,role=train + tp=2,dp=4,role=prefill + tp=4,dp=2,role=decode")
MIXED += ("--model", "llama3-8b", "--ranks-per-node", "8", "--lost", "2,3")


def test_replacements_and_borrowing_are_offered(capsys: pytest.CaptureFixture[str]) -> None:
    """--new-world 24 after losing 2: replace (2 ranks need weights, none crossing nodes) above shift; --keep 0:
    the prefill shard lends a replica (dp 4 -> 3). Both say what they did, in the table and as JSON."""
    code, out, _ = _run(capsys, *MIXED, "--new-world", "24")
    assert code == 0
    rows = {line.split()[1]: line.split() for line in out.splitlines()[2:8] if line[:1].isdigit()}
    assert rows["replace"][-6] == "2" and rows["replace"][-2] == "0" and int(rows["shift"][-6]) > 2  # moved, crossing
    assert int(rows["replace"][0]) < int(rows["shift"][0])
    code, out, _ = _run(capsys, *MIXED, "--new-world", "24", "--json")
    replace = next(option for option in json.loads(out)["options"] if option["kind"] == "replace")
    assert replace["replaced"] == [2, 3] and replace["needing_weights"] == 2
    code, out, _ = _run(capsys, *MIXED, "--keep", "0")
    assert code == 0 and "best: option 1 (borrow)" in out
    assert "keeps its spec on 2 ranks shard 1 gives up: 'tp=2,dp=4,role=prefill' -> 'tp=2,dp=3,role=prefill'" in out


def test_train_memory_counts_optimizer_state(capsys: pytest.CaptureFixture[str]) -> None:
    """--memory-gb for a train shard holds --train-bytes-per-param bytes a parameter (16 by default, as --help
    says): 8B parameters' trainer re-laid out on 6 ranks needs ~32 GB a rank at tp=4, 4 at 2 bytes a parameter."""
    code, out, err = _run(capsys, *MIXED, "--memory-gb", "20", "-q")
    assert code == 2 and "no layout survives" in err
    code, out, _ = _run(capsys, *MIXED, "--memory-gb", "20", "--train-bytes-per-param", "2")
    assert code == 0 and "best: option 1" in out
    code, out, err = _run(capsys, *MIXED, "--train-bytes-per-param", "0")
    assert code == 2 and "--train-bytes-per-param 0.0: expected a positive number" in err
    with pytest.raises(SystemExit):
        main(["replan", "--help"])
    helped = " ".join(capsys.readouterr().out.split())
    assert "--train-bytes-per-param B" in helped and "(default 16: mixed-" in helped
    assert "bf16 weights 2 + fp32 master weights 4 + Adam's two fp32 moments 8 + bf16 gradients 2" in helped


def test_svg_draws_the_nodes_as_they_are_and_the_lost_rank(capsys: pytest.CaptureFixture[str], tmp_path: Path) -> None:
    """Rank 1 lost: the decode shard (old ranks 8-15, node 1; new ranks 7-14) is drawn in node 1's row, as the
    table's 0 crossing groups say, and rank 1's place is drawn empty, marked lost."""
    picture = tmp_path / "new.svg"
    argv = ("replan", "--world", "16", "--shards", "tp=4,role=train + tp=4,role=prefill + tp=8,role=decode")
    code, out, _ = _run(capsys, *argv, "--lost", "1", "--model", "tiny-dense", "--ranks-per-node", "8", "--svg",
                        str(picture))  # fmt: skip
    assert code == 0 and out.splitlines()[2].split()[-2] == "0"  # no group crosses nodes
    cells = [e for e in ET.parse(picture).iter() if e.tag.endswith("rect") and e.get("class") == "rank"]
    rows = {int(e.get("data-rank", -1)): float(e.get("y", 0)) for e in cells}
    assert len({rows[rank] for rank in range(7, 15)}) == 1 and rows[7] > rows[0]
    lost = [e for e in ET.parse(picture).iter() if e.tag.endswith("rect") and e.get("class") == "absent"]
    assert [(e.get("data-slot"), e.get("data-absent")) for e in lost] == [("1", "lost")]
