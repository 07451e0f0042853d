"""An SVG picture of a layout: nodes as rows, local ranks as columns, each rank coloured by shard.

Plain SVG text from the standard library (ElementTree escapes it), so the core gains no
dependency. Up to ``MAX_RANK_CELLS`` ranks every rank is a cell labelled with its
(pp, dp, cp, tp) coordinates; a larger world is drawn one cell per node.
"""

from __future__ import annotations

import xml.etree.ElementTree as ET
from typing import TYPE_CHECKING

from .errors import LayoutError
from .layout import DECODER_GROUPS, EXPERT_GROUPS
from .topology import check_ranks_per_node

if TYPE_CHECKING:
    from .layout import Layout, ShardPlan

DEFAULT_RANKS_PER_NODE = 8
MAX_RANK_CELLS = 1024
"""Largest world drawn rank by rank; above it one cell per node keeps the file small."""
NODES_PER_ROW = 32

FILLS = ("#8ec5e8", "#f9b97a", "#93d39a", "#f3a1b0", "#c3aee0", "#f2d57e", "#8fd3cb", "#d9b39c")
"""Light shard colours, so that the dark labels and group outlines stay readable on them."""
STROKES = ("#1f4e79", "#b3261e", "#1b7340", "#6b3fa0", "#a35200", "#0b6e69", "#7a1f5c", "#3d3d3d")
"""Dark outline colours, cycled per highlighted group so neighbouring groups differ."""
IDLE_FILL = "#dcdcdc"
INK, MUTED = "#1e1e1e", "#5c5c5c"
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"

MARGIN, LABEL_W, GAP = 20, 78, 8
CELL_W, CELL_H = 70, 44
NODE_CELL, NODE_GAP = 22, 4


def _el(parent: ET.Element, tag: str, text: str | None = None, **attrs: object) -> ET.Element:
    """A child element; ``font_size`` becomes ``font-size``, ``class_`` becomes ``class``."""
    element = ET.SubElement(parent, tag, {k.rstrip("_").replace("_", "-"): str(v) for k, v in attrs.items()})
    if text is not None:
        element.text = text
    return element


def _fill(index: int) -> str:
    return FILLS[index % len(FILLS)]


def _legend_lines(layout: Layout) -> list[tuple[str, str]]:
    """(colour, text) per shard, then idle ranks."""
    lines = []
    for plan in layout.shards:
        spec = plan.spec
        role = spec.role or "no role"
        name = f" · {spec.name}" if spec.name else ""
        parallel = str(spec).split(",role=")[0].split(",name=")[0]
        lines.append((_fill(plan.index), f"shard {plan.index} · {role}{name} · {parallel} · "
                                         f"ranks {plan.rank_offset}-{plan.ranks.stop - 1}"))
    if layout.idle:
        windows = ", ".join(f"{w.start}-{w.stop - 1}" for w in layout.idle)
        lines.append((IDLE_FILL, f"idle · ranks {windows}"))
    return lines


def _header(svg: ET.Element, layout: Layout, k: int, notes: list[str]) -> float:
    """Title, notes and legend; returns the y where the grid starts."""
    nodes = -(-layout.world_size // k)
    title = f"{layout.world_size} ranks on {nodes} node{'s' if nodes > 1 else ''} of {k} · order {layout.order}"
    _el(svg, "text", title, x=MARGIN, y=MARGIN + 16, font_size=18, font_weight="bold", fill=INK)
    y = MARGIN + 40
    for note in notes:
        _el(svg, "text", note, x=MARGIN, y=y, font_size=12, fill=MUTED)
        y += 18
    y += 6
    legend = _el(svg, "g", class_="legend")
    for colour, text in _legend_lines(layout):
        _el(legend, "rect", x=MARGIN, y=y - 12, width=16, height=16, rx=3, fill=colour, stroke="#8a8a8a",
            stroke_width=0.5)
        _el(legend, "text", text, x=MARGIN + 24, y=y + 1, font_size=13, fill=INK)
        y += 22
    return y + 10


def _text_width(svg: ET.Element) -> float:
    """A generous estimate of the widest text line, to size the canvas."""
    return max((len(t.text or "") * 0.6 * float(t.get("font-size", 12)) for t in svg.iter("text")), default=0)


def _outline_segments(group: tuple[int, ...], k: int) -> list[tuple[int, int]]:
    """Runs of consecutive ranks within one node: each is outlined by one rectangle."""
    runs: list[tuple[int, int]] = []
    for rank in group:
        if runs and rank == runs[-1][1] + 1 and rank // k == runs[-1][0] // k:
            runs[-1] = (runs[-1][0], rank)
        else:
            runs.append((rank, rank))
    return runs


def _groups(plan: ShardPlan, name: str) -> list[tuple[int, ...]]:
    if name in DECODER_GROUPS:
        return list(plan.decoder_grid.iter_groups(DECODER_GROUPS[name]))
    return list(plan.expert_grid.iter_groups(EXPERT_GROUPS[name]))


def _rank_cells(svg: ET.Element, layout: Layout, k: int, top: float, highlight: str | None) -> tuple[float, float]:
    """One cell per rank and the highlight outlines; returns the grid's right and bottom edges."""
    left = MARGIN + LABEL_W
    header = _el(svg, "g", font_size=11, fill=MUTED, text_anchor="middle", font_family=MONO)
    for col in range(min(k, layout.world_size)):
        _el(header, "text", str(col), x=left + col * (CELL_W + GAP) + CELL_W / 2, y=top)
    top += 10

    def corner(rank: int) -> tuple[float, float]:
        return left + (rank % k) * (CELL_W + GAP), top + (rank // k) * (CELL_H + GAP)

    nodes = -(-layout.world_size // k)
    labels = _el(svg, "g", font_size=12, fill=MUTED, text_anchor="end")
    for node in range(nodes):
        _el(labels, "text", f"node {node}", x=left - 12, y=top + node * (CELL_H + GAP) + CELL_H / 2 + 4)
    cells = _el(svg, "g", class_="ranks")
    for rank in range(layout.world_size):
        plan = layout.shard_of(rank)
        x, y = corner(rank)
        shard = "idle" if plan is None else str(plan.index)
        cell = _el(cells, "rect", class_="rank", x=x, y=y, width=CELL_W, height=CELL_H, rx=5,
                   fill=IDLE_FILL if plan is None else _fill(plan.index), data_rank=rank, data_shard=shard)
        if plan is None:
            _el(cell, "title", f"rank {rank}: idle")
            label = "idle"
        else:
            c = plan.coords(rank)
            coords = " ".join(f"{key}={value}" for key, value in c.items())
            _el(cell, "title", f"rank {rank} · shard {plan.index} ({plan.spec}) · {coords}")
            label = f"{c['pp']},{c['dp']},{c['cp']},{c['tp']}"
        _el(cells, "text", str(rank), x=x + 5, y=y + 13, font_size=10, fill=MUTED)
        _el(cells, "text", label, x=x + CELL_W / 2, y=y + 32, font_size=13, fill=INK, text_anchor="middle",
            font_family=MONO)
    if highlight is not None:
        outlines = _el(svg, "g", class_="highlight", fill="none", stroke_width=2.5)
        number = 0
        for plan in layout.shards:
            for group in _groups(plan, highlight):
                crosses = group[0] // k != group[-1] // k
                colour = STROKES[number % len(STROKES)]
                number += 1
                for first, last in _outline_segments(group, k):
                    x, y = corner(first)
                    attrs = {"stroke_dasharray": "6 4"} if crosses else {}
                    _el(outlines, "rect", class_="group", x=x - 3, y=y - 3, width=(last - first) * (CELL_W + GAP) + CELL_W + 6,
                        height=CELL_H + 6, rx=7, stroke=colour, data_group=highlight,
                        data_members=" ".join(map(str, group)), **attrs)
    columns = min(k, layout.world_size)
    return left + columns * (CELL_W + GAP), top + nodes * (CELL_H + GAP)


def _node_owners(layout: Layout, k: int) -> list[list[tuple[str, int]]]:
    """Per node, (shard index or "idle", ranks it holds there) in rank order; O(nodes + shards)."""
    windows = sorted([(p.rank_offset, p.ranks.stop, str(p.index)) for p in layout.shards] +
                     [(w.start, w.stop, "idle") for w in layout.idle])
    owners: list[list[tuple[str, int]]] = [[] for _ in range(-(-layout.world_size // k))]
    for start, stop, key in windows:
        for node in range(start // k, (stop - 1) // k + 1):
            held = min(stop, (node + 1) * k) - max(start, node * k)
            owners[node].append((key, held))
    return owners


def _node_cells(svg: ET.Element, layout: Layout, k: int, top: float) -> tuple[float, float]:
    """One cell per node, split by colour where shards share it; returns the right and bottom edges."""
    owners = _node_owners(layout, k)
    defs = _el(svg, "defs")
    left = MARGIN + LABEL_W
    pitch = NODE_CELL + NODE_GAP
    labels = _el(svg, "g", font_size=12, fill=MUTED, text_anchor="end")
    cells = _el(svg, "g", class_="nodes")
    for node, held in enumerate(owners):
        row, col = divmod(node, NODES_PER_ROW)
        if col == 0:
            last = min(node + NODES_PER_ROW, len(owners)) - 1
            _el(labels, "text", f"nodes {node}-{last}", x=left - 10, y=top + row * pitch + NODE_CELL / 2 + 4)
        colours = [IDLE_FILL if key == "idle" else _fill(int(key)) for key, _ in held]
        fill = colours[0]
        if len(held) > 1:
            gradient = _el(defs, "linearGradient", id=f"node{node}")
            total, seen = sum(n for _, n in held), 0
            for colour, (_, n) in zip(colours, held):
                _el(gradient, "stop", offset=f"{seen / total:.4f}", stop_color=colour)
                seen += n
                _el(gradient, "stop", offset=f"{seen / total:.4f}", stop_color=colour)
            fill = f"url(#node{node})"
        cell = _el(cells, "rect", class_="node", x=left + col * pitch, y=top + row * pitch, width=NODE_CELL,
                   height=NODE_CELL, rx=3, fill=fill, data_node=node, data_shards=" ".join(key for key, _ in held))
        parts = ", ".join(f"{'idle' if key == 'idle' else 'shard ' + key} ({n})" for key, n in held)
        _el(cell, "title", f"node {node}: ranks {node * k}-{min((node + 1) * k, layout.world_size) - 1}: {parts}")
    rows = -(-len(owners) // NODES_PER_ROW)
    return left + min(len(owners), NODES_PER_ROW) * pitch, top + rows * pitch


def render_svg(layout: Layout, ranks_per_node: int = DEFAULT_RANKS_PER_NODE, highlight: str | None = None) -> str:
    """The layout as SVG text: rank cells up to MAX_RANK_CELLS ranks, node cells beyond."""
    k = check_ranks_per_node(ranks_per_node)
    if highlight is not None and highlight not in DECODER_GROUPS and highlight not in EXPERT_GROUPS:
        raise LayoutError(f"highlight={highlight!r}: expected a group name, one of "
                          f"{', '.join([*DECODER_GROUPS, *EXPERT_GROUPS])}")
    by_rank = layout.world_size <= MAX_RANK_CELLS
    svg = ET.Element("svg", {"xmlns": "http://www.w3.org/2000/svg", "font-family": FONT})
    if by_rank:
        notes = ["each cell: rank, then its coordinates pp,dp,cp,tp"]
        if highlight is not None:
            notes.append(f"outlined: the {highlight} groups, one colour each; dashed: the group spans nodes")
    else:
        notes = [f"{layout.world_size} ranks is over {MAX_RANK_CELLS}: one cell per node, split where shards share it"]
        if highlight is not None:
            notes.append(f"--highlight {highlight} is drawn only up to {MAX_RANK_CELLS} ranks")
    top = _header(svg, layout, k, notes)
    if by_rank:
        right, bottom = _rank_cells(svg, layout, k, top, highlight)
    else:
        right, bottom = _node_cells(svg, layout, k, top)
    width = max(right, MARGIN + _text_width(svg)) + MARGIN
    height = bottom + MARGIN
    svg.set("width", f"{width:.0f}")
    svg.set("height", f"{height:.0f}")
    svg.set("viewBox", f"0 0 {width:.0f} {height:.0f}")
    background = ET.Element("rect", {"width": "100%", "height": "100%", "fill": "#ffffff"})
    svg.insert(0, background)
    ET.indent(svg, space=" ")
    return ET.tostring(svg, encoding="unicode") + "\n"


__all__ = ["DEFAULT_RANKS_PER_NODE", "MAX_RANK_CELLS", "render_svg"]
