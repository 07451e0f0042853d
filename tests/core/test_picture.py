"""The SVG picture parses as XML, carries one element per rank (or per node) and outlines groups."""

from __future__ import annotations

import xml.etree.ElementTree as ET
from pathlib import Path

import pytest

from shardcore.cli import main
from shardcore.errors import LayoutError
from shardcore.plan.layout import plan_layout
from shardcore.views.picture import MAX_GRID_HEIGHT, STROKES, Places, draws_ranks, render_svg

NS = "{http://www.w3.org/2000/svg}"
SPEC = "tp=4,pp=2,role=train+tp=2,dp=4,role=prefill,name=a&b<c>+tp=8,role=decode"


def _parse(text: str) -> ET.Element:
    root = ET.fromstring(text)
    assert root.tag == f"{NS}svg"
    return root


def _by_class(root: ET.Element, tag: str, cls: str) -> list[ET.Element]:
    return [e for e in root.iter(f"{NS}{tag}") if e.get("class") == cls]


def test_one_cell_per_rank_carrying_its_shard_and_idle_marked() -> None:
    layout = plan_layout(32, SPEC, allow_idle=True)
    root = _parse(render_svg(layout, 8))
    cells = _by_class(root, "rect", "rank")
    assert [int(c.get("data-rank", -1)) for c in cells] == list(range(32))
    expected = ["0"] * 8 + ["1"] * 8 + ["2"] * 8 + ["idle"] * 8
    assert [c.get("data-shard") for c in cells] == expected
    assert {c.get("fill") for c in cells[24:]} == {"#dcdcdc"}
    assert len({c.get("fill") for c in cells[:24]}) == 3
    texts = [t.text for t in root.iter(f"{NS}text")]
    assert "1,0,0,3" in texts  # rank 7: pp=1, dp=0, cp=0, tp=3
    assert any("a&b<c>" in (t or "") for t in texts)  # escaped on write, intact on parse


def test_legend_names_index_role_name_and_parallelism() -> None:
    root = _parse(render_svg(plan_layout(32, SPEC, allow_idle=True), 8))
    legend = [t.text for t in _by_class(root, "g", "legend")[0].iter(f"{NS}text")]
    assert legend == [
        "shard 0 · train · tp=4,pp=2 · ranks 0-7",
        "shard 1 · prefill · a&b<c> · tp=2,dp=4 · ranks 8-15",
        "shard 2 · decode · tp=8 · ranks 16-23",
        "idle · ranks 24-31",
    ]


def test_highlight_outlines_each_group_and_dashes_the_ones_spanning_nodes() -> None:
    layout = plan_layout(32, "tp=4,dp=3+tp=8", allow_idle=True)  # second shard: [12, 20), crossing node 1|2
    root = _parse(render_svg(layout, 8, highlight="tp"))
    groups = _by_class(root, "g", "group")
    assert [g.get("data-members") for g in groups] == [
        "0 1 2 3",
        "4 5 6 7",
        "8 9 10 11",
        " ".join(map(str, range(12, 20))),
    ]
    assert [g.get("stroke-dasharray") for g in groups] == [None, None, None, "6 4"]
    assert [len(g.findall(f"{NS}rect")) for g in groups] == [1, 1, 1, 2]  # split at the node boundary


def test_strided_groups_are_outlined_member_by_member() -> None:
    root = _parse(render_svg(plan_layout(8, "tp=2,dp=4"), 8, highlight="dp"))
    groups = _by_class(root, "g", "group")
    assert [g.get("data-members") for g in groups] == ["0 2 4 6", "1 3 5 7"]
    assert all(len(g.findall(f"{NS}rect")) == 4 for g in groups)


def test_large_world_falls_back_to_one_cell_per_node() -> None:
    layout = plan_layout(2048 + 4, "tp=8,dp=128+tp=4,dp=128", allow_idle=True)  # shard 1 [1024, 1536)
    assert not draws_ranks(layout, 8)
    root = _parse(render_svg(layout, 8, highlight="tp"))
    assert _by_class(root, "rect", "rank") == []
    nodes = _by_class(root, "rect", "node")
    assert [int(n.get("data-node", -1)) for n in nodes] == list(range(257))
    assert nodes[0].get("data-shards") == "0" and nodes[128].get("data-shards") == "1"
    assert nodes[192].get("data-shards") == "idle" and nodes[256].get("data-shards") == "idle"


def test_a_node_shared_by_shards_is_split_by_a_gradient() -> None:
    layout = plan_layout(2000, "tp=4,dp=300+tp=2,dp=400", allow_idle=True)  # boundary at 1200 = node 150
    nodes = _by_class(_parse(render_svg(layout, 7)), "rect", "node")
    assert len(nodes) == 286  # ceil(2000 / 7)
    shared = nodes[1200 // 7]
    assert shared.get("data-shards") == "0 1"
    assert shared.get("fill") == f"url(#node{1200 // 7})"


def test_bad_arguments_raise_layout_errors() -> None:
    layout = plan_layout(8, "tp=8")
    with pytest.raises(LayoutError, match="ranks_per_node=0"):
        render_svg(layout, 0)
    with pytest.raises(LayoutError, match="highlight='embd'"):
        render_svg(layout, 8, highlight="embd")


def test_cli_writes_the_svg(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "layout.svg"
    code = main(["plan", "--world", "32", "--shards", SPEC, "--allow-idle", "--svg", str(path), "--highlight", "tp"])
    assert code == 0
    root = _parse(path.read_text(encoding="utf-8"))
    assert len(_by_class(root, "rect", "rank")) == 32
    assert "nodes of 8" in capsys.readouterr().err  # the default node size, said aloud
    assert main(["plan", "--world", "8", "--shards", "tp=8", "--highlight", "tp"]) == 2


def test_singleton_groups_get_no_outline() -> None:
    root = _parse(render_svg(plan_layout(8, "tp=2,dp=2+tp=1,dp=4"), 8, highlight="tp"))
    groups = _by_class(root, "g", "group")
    assert [g.get("data-members") for g in groups] == ["0 1", "2 3"]


def test_outline_colours_stay_distinct_beyond_the_palette() -> None:
    root = _parse(render_svg(plan_layout(64, "tp=2,dp=32"), 8, highlight="tp"))
    strokes = [g.get("stroke") for g in _by_class(root, "g", "group")]
    assert len(strokes) == 32 > len(STROKES)
    assert strokes[: len(STROKES)] == list(STROKES)
    assert len(set(strokes)) == len(strokes)


def test_the_view_is_chosen_by_image_size_not_rank_count() -> None:
    """1,024 ranks on 8-rank nodes would be 128 rows of cells; on 512-rank nodes a row too wide."""
    assert not draws_ranks(plan_layout(1024, "tp=8,dp=128"), 8)
    assert not draws_ranks(plan_layout(1024, "tp=8,dp=128"), 512)
    assert draws_ranks(plan_layout(256, "tp=8,dp=32"), 8)
    svg = render_svg(plan_layout(1024, "tp=8,dp=128"), 8)
    assert float(_parse(svg).get("height", "0")) < MAX_GRID_HEIGHT


def test_cli_says_when_the_node_view_drops_the_highlight(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "big.svg"
    assert main(["plan", "--world", "1024", "--shards", "tp=8,dp=128", "--svg", str(path), "--highlight", "tp"]) == 0
    assert "note: --highlight tp was not drawn" in capsys.readouterr().err
    assert main(["plan", "--world", "16", "--shards", "tp=8,dp=2", "--svg", str(path), "--highlight", "tp"]) == 0
    assert "not drawn" not in capsys.readouterr().err


def test_a_layout_after_a_loss_is_drawn_where_its_processes_are() -> None:
    """``places``: each rank at its place (here: after rank 1 is lost, new rank r sits at old rank r + 1 from rank 1
    on), so the decode shard's tp=8 group, on node 1 in fact, is drawn in node 1's row alone and not dashed;
    ``absent`` draws the lost place, empty and named. Places that collide or miss a rank are refused."""
    layout = plan_layout(15, "tp=1,dp=3,role=train + tp=4,role=prefill + tp=8,role=decode")
    places = [0, *range(2, 16)]
    root = _parse(render_svg(layout, 8, highlight="tp", places=places, absent={1: "lost"}))
    corner = {
        int(c.get("data-rank", -1)): (float(c.get("x", 0)), float(c.get("y", 0)))
        for c in _by_class(root, "rect", "rank")
    }
    decode = [corner[rank] for rank in range(7, 15)]
    assert len({y for _, y in decode}) == 1 and decode[0][1] > corner[0][1]  # one row: node 1
    assert [x for x, _ in decode] == sorted(x for x, _ in decode)
    group = next(g for g in _by_class(root, "g", "group") if g.get("data-members") == "7 8 9 10 11 12 13 14")
    assert group.get("stroke-dasharray") is None  # inside one node
    (lost,) = _by_class(root, "rect", "absent")
    assert lost.get("data-slot") == "1" and lost.get("data-absent") == "lost"
    assert (float(lost.get("x", 0)), float(lost.get("y", 0))) == (
        (corner[0][0] + corner[1][0]) / 2,
        corner[0][1],
    )
    assert any("lost · an empty place" in (t.text or "") for t in root.iter(f"{NS}text"))
    plain = _parse(render_svg(layout, 8, highlight="tp"))  # by new rank numbers, the same group spans two nodes
    spanning = next(g for g in _by_class(plain, "g", "group") if g.get("data-members") == "7 8 9 10 11 12 13 14")
    assert spanning.get("stroke-dasharray") == "6 4"
    with pytest.raises(LayoutError, match="places: expected distinct non-negative places"):
        render_svg(layout, 8, places=[0, 0, *range(2, 15)])
    with pytest.raises(LayoutError, match="absent place 2: a rank is drawn there"):
        render_svg(layout, 8, places=places, absent={2: "lost"})


def test_the_node_view_places_ranks_and_empty_places_too() -> None:
    """Too many nodes to draw rank by rank (one-rank nodes, ranks 4 places apart): each node cell is its place's."""
    layout = plan_layout(15, "tp=1,dp=3,role=train + tp=4,role=prefill + tp=8,role=decode")
    places = [4 * rank for rank in range(15)]
    assert not draws_ranks(layout, 1, Places(places))
    nodes = _by_class(_parse(render_svg(layout, 1, places=places, absent={1: "lost"})), "rect", "node")
    assert len(nodes) == 57 and nodes[1].get("data-shards") == "lost" and nodes[1].get("fill") == "#ffffff"
    assert [nodes[4 * rank].get("data-shards") for rank in range(15)] == ["0"] * 3 + ["1"] * 4 + ["2"] * 8
    assert nodes[2].get("data-shards") == "empty"
