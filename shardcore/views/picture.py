"""An SVG picture of a layout: nodes as rows, local ranks as columns, each rank coloured by shard.

A layout after a loss (``shardcore replan --svg``) is drawn where its processes sit: ``places`` gives each
rank's physical slot (its old rank's, so a survivor stays on its node), and ``absent`` draws the slots left
empty (the lost ranks, the released ones), so a group the tables say stays inside a node is drawn inside one.

Plain SVG text from the standard library (ElementTree escapes it), so the core gains no
dependency. While the rank grid fits ``MAX_GRID_WIDTH`` x ``MAX_GRID_HEIGHT`` pixels every
rank is a cell labelled with its (pp, dp, cp, tp) coordinates; a larger world is drawn one
cell per node (about 200 bytes a node: 2.4 MB for 100,000 ranks on 8-rank nodes).
"""

from __future__ import annotations

import colorsys
import xml.etree.ElementTree as ET
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING

from ..errors import LayoutError
from ..plan.arguments import counted, shown
from ..plan.topology import TOPOLOGY_GROUPS, check_ranks_per_node

if TYPE_CHECKING:
    from ..plan.layout import Layout, ShardPlan

DEFAULT_RANKS_PER_NODE = 8
MAX_GRID_WIDTH, MAX_GRID_HEIGHT = 4000, 2400
"""Largest rank grid drawn rank by rank, in pixels (about 46 nodes of 8 ranks); beyond it one cell per node."""
NODES_PER_ROW = 32

FILLS = ("#8ec5e8", "#f9b97a", "#93d39a", "#f3a1b0", "#c3aee0", "#f2d57e", "#8fd3cb", "#d9b39c")
"""Light shard colours, so that the dark labels and group outlines stay readable on them."""
STROKES = ("#1f4e79", "#b3261e", "#1b7340", "#6b3fa0", "#a35200", "#0b6e69", "#7a1f5c", "#3d3d3d")
"""Dark outline colours for the first highlighted groups; later ones get golden-angle hues (``_stroke``)."""
IDLE_FILL = "#dcdcdc"
ABSENT_FILL = "#ffffff"
"""An empty slot (a lost or released rank's): white, outlined in ``MARK``, labelled with why."""
MARK = "#d1000f"
"""Outline of the ranks a caller marks (``render_svg(marked=...)``)."""
INK, MUTED = "#1e1e1e", "#5c5c5c"
FONT = "DejaVu Sans, Helvetica, Arial, sans-serif"
MONO = "DejaVu Sans Mono, Menlo, Consolas, monospace"

MARGIN, GAP = 20, 8
CELL_W, CELL_H = 70, 44
NODE_CELL, NODE_GAP = 22, 4


def _el(parent: ET.Element, tag: str, text: str | None = None, **attrs: object) -> ET.Element:
    """A child element; ``font_size`` becomes ``font-size``, ``class_`` becomes ``class``."""
    element = ET.SubElement(parent, tag, {k.rstrip("_").replace("_", "-"): str(v) for k, v in attrs.items()})
    if text is not None:
        element.text = text
    return element


def _cell(group: ET.Element, kind: str, corner: tuple[float, float], cell_w: float, **attrs: object) -> ET.Element:
    """A cell's rounded rectangle of class ``kind`` at ``corner`` (a rank's, or an empty slot's)."""
    x, y = corner
    return _el(group, "rect", None, class_=kind, x=x, y=y, width=cell_w, height=CELL_H, rx=5, **attrs)


def _fill(index: int) -> str:
    return FILLS[index % len(FILLS)]


def _stroke(number: int) -> str:
    """The outline colour of the ``number``-th group: the palette, then hues a golden angle apart
    (consecutive groups always far apart on the colour wheel), alternating two lightnesses."""
    if number < len(STROKES):
        return STROKES[number]
    hue = (number * 0.381966) % 1.0
    red, green, blue = colorsys.hls_to_rgb(hue, 0.28 + 0.1 * (number % 2), 0.75)
    return f"#{round(red * 255):02x}{round(green * 255):02x}{round(blue * 255):02x}"


@dataclass(frozen=True)
class Places:
    """Where each rank of a layout is drawn: its slot (node = slot // k), and the slots drawn empty."""

    slots: Sequence[int] | None = None
    """Per rank, its slot; None: its own rank (every rank in place)."""
    absent: Mapping[int, str] | None = None
    """Empty slots, each with why (e.g. "lost")."""

    def of(self, rank: int) -> int:
        return rank if self.slots is None else self.slots[rank]

    def count(self, layout: Layout) -> int:
        """Slots drawn: every rank's and every empty one."""
        last = max(self.slots, default=-1) if self.slots is not None else layout.world_size - 1
        return max(last, max(self.absent or (), default=-1)) + 1


def nodes_of(layout: Layout, k: int, places: Places | None = None) -> int:
    """Nodes of ``k`` ranks the world fills (the last may be partial); with ``places``, the slots drawn."""
    return -(-(layout.world_size if places is None else places.count(layout)) // k)


def draws_ranks(layout: Layout, ranks_per_node: int, places: Places | None = None) -> bool:
    """Whether the picture draws every rank (True) or one cell per node: by the rank grid's size in pixels."""
    k = check_ranks_per_node(ranks_per_node)
    nodes = nodes_of(layout, k, places)
    return nodes * (CELL_H + GAP) <= MAX_GRID_HEIGHT and min(k, layout.world_size) * (CELL_W + GAP) <= MAX_GRID_WIDTH


def _legend_lines(layout: Layout) -> list[tuple[str, str]]:
    """(colour, text) per shard, then idle ranks."""
    lines = []
    for plan in layout.shards:
        spec = plan.spec
        role = spec.role or "no role"
        name = f" · {spec.name}" if spec.name else ""
        parallel = ",".join(part for part in str(spec).split(",") if not part.startswith(("role=", "name=")))
        lines.append(
            (
                _fill(plan.index),
                f"shard {plan.index} · {role}{name} · {parallel} · ranks {plan.rank_offset}-{plan.ranks.stop - 1}",
            )
        )
    if layout.idle:
        windows = ", ".join(f"{w.start}-{w.stop - 1}" for w in layout.idle)
        lines.append((IDLE_FILL, f"idle · ranks {windows}"))
    return lines


def _header(svg: ET.Element, layout: Layout, k: int, notes: list[str], places: Places) -> float:
    """Title, notes and legend; returns the y where the grid starts."""
    nodes = nodes_of(layout, k, places)
    title = f"{counted(layout.world_size, 'rank')} on {counted(nodes, 'node')} of {k} · order {layout.order}"
    _el(svg, "text", title, x=MARGIN, y=MARGIN + 16, font_size=18, font_weight="bold", fill=INK)
    y = MARGIN + 40
    for note in notes:
        _el(svg, "text", note, x=MARGIN, y=y, font_size=12, fill=MUTED)
        y += 18
    y += 6
    legend = _el(svg, "g", class_="legend")
    absent = sorted(set((places.absent or {}).values()))
    for colour, text in [*_legend_lines(layout), *((ABSENT_FILL, f"{why} · an empty place") for why in absent)]:
        _el(
            legend,
            "rect",
            x=MARGIN,
            y=y - 12,
            width=16,
            height=16,
            rx=3,
            fill=colour,
            stroke="#8a8a8a",
            stroke_width=0.5,
        )
        _el(legend, "text", text, x=MARGIN + 24, y=y + 1, font_size=13, fill=INK)
        y += 22
    return y + 10


def _text_width(svg: ET.Element) -> float:
    """A generous estimate of the widest text line, to size the canvas."""
    return max((len(t.text or "") * 0.6 * float(t.get("font-size", 12)) for t in svg.iter("text")), default=0)


def _outline_segments(slots: tuple[int, ...], k: int) -> list[tuple[int, int]]:
    """Runs of consecutive slots (sorted) within one node: each is outlined by one rectangle."""
    runs: list[tuple[int, int]] = []
    for slot in slots:
        if runs and slot == runs[-1][1] + 1 and slot // k == runs[-1][0] // k:
            runs[-1] = (runs[-1][0], slot)
        else:
            runs.append((slot, slot))
    return runs


def _rank_label(layout: Layout, rank: int) -> tuple[ShardPlan | None, str, str]:
    """(shard, the cell's label, its tooltip) of one rank."""
    plan = layout.shard_of(rank)
    if plan is None:
        return None, "idle", f"rank {rank}: idle"
    c = plan.coords(rank)
    coords = " ".join(f"{key}={value}" for key, value in c.items())
    tooltip = f"rank {rank} · shard {plan.index} ({plan.spec}) · {coords}"
    return plan, f"{c['pp']},{c['dp']},{c['cp']},{c['tp']}", tooltip


def _label_width(texts: list[str], font_size: float) -> float:
    return max(len(t) for t in texts) * 0.6 * font_size + 16


def _rank_cells(
    svg: ET.Element,
    layout: Layout,
    k: int,
    top: float,
    highlight: str | None,
    marked: frozenset[int],
    places: Places,
) -> tuple[float, float]:
    """One cell per rank at its place, the empty places, and the highlight outlines; returns the grid's right and
    bottom edges."""
    nodes = nodes_of(layout, k, places)
    cells = [_rank_label(layout, rank) for rank in range(layout.world_size)]
    absent = dict(places.absent or {})
    cell_w = max(CELL_W, _label_width([label for _, label, _ in cells] + list(absent.values()), 13))
    node_labels = [f"node {node}" for node in range(nodes)]
    left = MARGIN + _label_width(node_labels, 12)
    pitch_x, pitch_y = cell_w + GAP, CELL_H + GAP
    columns = min(k, places.count(layout))
    top = _grid_headers(svg, columns, node_labels, left, top, cell_w)

    def corner(slot: int) -> tuple[float, float]:
        return left + (slot % k) * pitch_x, top + (slot // k) * pitch_y

    group = _el(svg, "g", class_="ranks")
    for rank, (plan, label, tooltip) in enumerate(cells):
        _rank_cell(group, rank, plan, label, tooltip, corner(places.of(rank)), cell_w)
    for slot, why in sorted(absent.items()):
        _absent_cell(group, slot, why, corner(slot), cell_w)
    if highlight is not None:
        _outlines(svg, layout, k, highlight, corner, cell_w, places)
    if marked:
        _marks(svg, marked, lambda rank: corner(places.of(rank)), cell_w)
    return left + columns * pitch_x, top + nodes * pitch_y


def _absent_cell(group: ET.Element, slot: int, why: str, corner: tuple[float, float], cell_w: float) -> None:
    """An empty place (old rank ``slot``, lost or released): white, a dashed red outline, labelled ``why``."""
    x, y = corner
    cell = _cell(
        group, "absent", corner, cell_w, fill=ABSENT_FILL, stroke=MARK, stroke_dasharray="4 3", data_slot=slot,
        data_absent=why,
    )  # fmt: skip
    _el(cell, "title", f"old rank {slot}: {why}")
    _el(group, "text", why, x=x + cell_w / 2, y=y + 28, font_size=12, fill=MARK, text_anchor="middle")


def _grid_headers(
    svg: ET.Element, columns: int, node_labels: list[str], left: float, top: float, cell_w: float
) -> float:
    """The local rank over each of ``columns`` columns and a node label before each row, so that a
    cell's place reads as (node, local rank); returns the top of the first row."""
    pitch_x, pitch_y = cell_w + GAP, CELL_H + GAP
    _el(svg, "text", "local rank", x=left - 12, y=top, font_size=11, fill=MUTED, text_anchor="end")
    header = _el(svg, "g", font_size=11, fill=MUTED, text_anchor="middle", font_family=MONO)
    for col in range(columns):
        _el(header, "text", str(col), x=left + col * pitch_x + cell_w / 2, y=top)
    top += 10
    labels = _el(svg, "g", font_size=12, fill=MUTED, text_anchor="end")
    for node, text in enumerate(node_labels):
        _el(labels, "text", text, x=left - 12, y=top + node * pitch_y + CELL_H / 2 + 4)
    return top


def _rank_cell(
    group: ET.Element,
    rank: int,
    plan: ShardPlan | None,
    label: str,
    tooltip: str,
    corner: tuple[float, float],
    cell_w: float,
) -> None:
    """One rank's cell at ``corner``: filled with its shard's colour (grey when idle), its rank number,
    its coordinates as ``label`` and ``tooltip`` on hover."""
    x, y = corner
    cell = _cell(
        group,
        "rank",
        corner,
        cell_w,
        fill=IDLE_FILL if plan is None else _fill(plan.index),
        data_rank=rank,
        data_shard="idle" if plan is None else plan.index,
    )
    _el(cell, "title", tooltip)
    _el(group, "text", str(rank), x=x + 5, y=y + 13, font_size=10, fill=MUTED)
    _el(
        group,
        "text",
        label,
        x=x + cell_w / 2,
        y=y + 32,
        font_size=13,
        fill=MUTED if plan is None else INK,
        text_anchor="middle",
        font_family=MONO,
    )


def _marks(
    svg: ET.Element, marked: frozenset[int], corner: Callable[[int], tuple[float, float]], cell_w: float
) -> None:
    """A dashed inner outline on each rank of ``marked``, drawn over the cells and outlines."""
    marks = _el(svg, "g", class_="marked", fill="none", stroke=MARK, stroke_width=2, stroke_dasharray="3 3")
    for rank in sorted(marked):
        x, y = corner(rank)
        _el(marks, "rect", x=x + 2, y=y + 2, width=cell_w - 4, height=CELL_H - 4, rx=4, data_rank=rank)


def _outlines(
    svg: ET.Element,
    layout: Layout,
    k: int,
    name: str,
    corner: Callable[[int], tuple[float, float]],
    cell_w: float,
    places: Places,
) -> None:
    """Outline each group of ``name`` with more than one rank: one rectangle per run of neighbouring
    places, dashed when it spans nodes (``corner``: a slot's cell, where a run's rectangle starts)."""
    outlines = _el(svg, "g", class_="highlight", fill="none", stroke_width=2.5)
    number = 0
    for plan in layout.shards:
        for members in plan.iter_groups(name):
            if len(members) == 1:
                continue
            slots = [places.of(rank) for rank in members]
            attrs = {"stroke_dasharray": "6 4"} if len({slot // k for slot in slots}) > 1 else {}
            box = _el(
                outlines,
                "g",
                class_="group",
                stroke=_stroke(number),
                data_group=name,
                data_shard=plan.index,
                data_members=" ".join(map(str, members)),
                **attrs,
            )
            number += 1
            for first, last in _outline_segments(tuple(sorted(slots)), k):
                x, y = corner(first)
                _el(
                    box,
                    "rect",
                    x=x - 3,
                    y=y - 3,
                    width=(last - first) * (cell_w + GAP) + cell_w + 6,
                    height=CELL_H + 6,
                    rx=7,
                )


def _node_owners(layout: Layout, k: int, places: Places) -> list[list[tuple[str, int]]]:
    """Per node, (shard index, "idle" or why a place is empty, places it holds there) in place order; O(nodes +
    shards) for ranks in place, O(places) otherwise."""
    owners: list[list[tuple[str, int]]] = [[] for _ in range(nodes_of(layout, k, places))]
    if places.slots is None and not places.absent:
        windows = sorted(
            [(p.rank_offset, p.ranks.stop, str(p.index)) for p in layout.shards]
            + [(w.start, w.stop, "idle") for w in layout.idle]
        )
        for start, stop, key in windows:
            for node in range(start // k, (stop - 1) // k + 1):
                held = min(stop, (node + 1) * k) - max(start, node * k)
                owners[node].append((key, held))
        return owners
    keys: dict[int, str] = dict(places.absent or {})
    for plan in layout.shards:
        keys.update((places.of(rank), str(plan.index)) for rank in plan.ranks)
    for window in layout.idle:
        keys.update((places.of(rank), "idle") for rank in window)
    for slot in sorted(keys):
        parts = owners[slot // k]
        if parts and parts[-1][0] == keys[slot]:
            parts[-1] = (keys[slot], parts[-1][1] + 1)
        else:
            parts.append((keys[slot], 1))
    return [parts or [("empty", k)] for parts in owners]


def _key_fill(key: str) -> str:
    """A node cell part's colour: its shard's, idle grey, or white for empty places."""
    if key.isdigit():
        return _fill(int(key))
    return IDLE_FILL if key == "idle" else ABSENT_FILL


def _node_cells(svg: ET.Element, layout: Layout, k: int, top: float, places: Places) -> tuple[float, float]:
    """One cell per node, split by colour where shards share it; returns the right and bottom edges."""
    owners = _node_owners(layout, k, places)
    defs = _el(svg, "defs")
    pitch = NODE_CELL + NODE_GAP
    rows = -(-len(owners) // NODES_PER_ROW)
    row_labels = [
        f"nodes {row * NODES_PER_ROW}-{min((row + 1) * NODES_PER_ROW, len(owners)) - 1}" for row in range(rows)
    ]
    left = MARGIN + _label_width(row_labels, 12)
    labels = _el(svg, "g", font_size=12, fill=MUTED, text_anchor="end")
    for row, text in enumerate(row_labels):
        _el(labels, "text", text, x=left - 12, y=top + row * pitch + NODE_CELL / 2 + 4)
    cells = _el(svg, "g", class_="nodes")
    for node, held in enumerate(owners):
        row, col = divmod(node, NODES_PER_ROW)
        colours = [_key_fill(key) for key, _ in held]
        fill = colours[0]
        if len(held) > 1:
            gradient = _el(defs, "linearGradient", id=f"node{node}")
            total, seen = sum(n for _, n in held), 0
            for colour, (_, n) in zip(colours, held):
                _el(gradient, "stop", offset=f"{seen / total:.4f}", stop_color=colour)
                seen += n
                _el(gradient, "stop", offset=f"{seen / total:.4f}", stop_color=colour)
            fill = f"url(#node{node})"
        cell = _el(
            cells,
            "rect",
            class_="node",
            x=left + col * pitch,
            y=top + row * pitch,
            width=NODE_CELL,
            height=NODE_CELL,
            rx=3,
            fill=fill,
            data_node=node,
            data_shards=" ".join(key for key, _ in held),
        )
        parts = ", ".join(f"{'shard ' + key if key.isdigit() else key} ({n})" for key, n in held)
        _el(cell, "title", f"node {node}: places {node * k}-{(node + 1) * k - 1}: {parts}")
    return left + min(len(owners), NODES_PER_ROW) * pitch, top + rows * pitch


def render_svg(
    layout: Layout,
    ranks_per_node: int = DEFAULT_RANKS_PER_NODE,
    highlight: str | None = None,
    marked: Collection[int] = (),
    marked_label: str = "marked ranks",
    places: Sequence[int] | None = None,
    absent: Mapping[int, str] | None = None,
) -> str:
    """The layout as SVG text: rank cells while they fit (``draws_ranks``), node cells beyond.

    Args:
        layout: The layout.
        ranks_per_node: Places per row (node = place // K).
        highlight: A group name whose groups are outlined.
        marked: Ranks outlined in red (drawn only rank by rank), described in a note as ``marked_label``.
        places: Per rank, the place it is drawn at (after a loss: its old rank's, ``Renumbering.physical``);
            None: its own rank. No two ranks may share one.
        absent: Places drawn empty, each with why (``{old rank: "lost"}``); none may hold a rank.

    Raises:
        LayoutError: a bad node size, group name, marked rank, or places that are not one distinct place per rank.
    """
    k = check_ranks_per_node(ranks_per_node)
    where = _check_places(layout, places, absent)
    if highlight is not None and highlight not in TOPOLOGY_GROUPS:
        raise LayoutError(f"highlight={shown(highlight)}: expected a group name, one of {', '.join(TOPOLOGY_GROUPS)}")
    by_rank = draws_ranks(layout, k, where)
    marks = frozenset(marked)
    outside = [
        rank
        for rank in marks
        if isinstance(rank, bool) or not isinstance(rank, int) or not 0 <= rank < layout.world_size
    ]
    if outside:
        raise LayoutError(f"marked rank {outside[0]!r} is outside the world [0, {layout.world_size})")
    svg = ET.Element("svg", {"xmlns": "http://www.w3.org/2000/svg", "font-family": FONT})
    if by_rank:
        notes = ["each cell: rank, then its coordinates pp,dp,cp,tp"]
        if places is not None:
            notes.append("each rank drawn at its process's place (its old rank's): nodes as they are")
        if highlight is not None:
            notes.append(
                f"outlined: the {highlight} groups of more than one rank, one colour each; dashed: spans nodes"
            )
        if marks:
            notes.append(f"red dotted outline: {marked_label} ({counted(len(marks), 'rank')})")
    else:
        notes = [
            f"{counted(nodes_of(layout, k), 'node')} are too many to draw rank by rank: one cell per node, "
            "split where shards share it"
        ]
        if highlight is not None:
            notes.append(f"{highlight} groups are outlined only when every rank is drawn")
        if marks:
            notes.append(f"{marked_label} ({counted(len(marks), 'rank')}) are outlined only when every rank is drawn")
    top = _header(svg, layout, k, notes, where)
    if by_rank:
        right, bottom = _rank_cells(svg, layout, k, top, highlight, marks, where)
    else:
        right, bottom = _node_cells(svg, layout, k, top, where)
    width = max(right, MARGIN + _text_width(svg)) + MARGIN
    height = bottom + MARGIN
    svg.set("width", f"{width:.0f}")
    svg.set("height", f"{height:.0f}")
    svg.set("viewBox", f"0 0 {width:.0f} {height:.0f}")
    background = ET.Element("rect", {"width": "100%", "height": "100%", "fill": "#ffffff"})
    svg.insert(0, background)
    ET.indent(svg, space=" ")
    return ET.tostring(svg, encoding="unicode") + "\n"


def _check_places(layout: Layout, places: Sequence[int] | None, absent: Mapping[int, str] | None) -> Places:
    """``places`` and ``absent`` checked: one distinct non-negative place per rank, empty places none of them."""
    if places is not None:
        if isinstance(places, (str, bytes)) or not isinstance(places, Sequence) or len(places) != layout.world_size:
            raise LayoutError(f"places: expected one place per rank of the layout ({layout.world_size})")
        bad = [p for p in places if isinstance(p, bool) or not isinstance(p, int) or p < 0]
        if bad or len(set(places)) != len(places):
            raise LayoutError(f"places: expected distinct non-negative places, got {shown(bad[0] if bad else places)}")
    if absent is not None:
        taken = set(range(layout.world_size) if places is None else places)
        clash = [slot for slot in absent if isinstance(slot, bool) or not isinstance(slot, int) or slot in taken]
        if clash or any(slot < 0 for slot in absent):
            raise LayoutError(f"absent place {shown(clash[0] if clash else min(absent))}: a rank is drawn there")
    return Places(places, absent)


__all__ = ["DEFAULT_RANKS_PER_NODE", "MAX_GRID_HEIGHT", "MAX_GRID_WIDTH", "draws_ranks", "render_svg"]
