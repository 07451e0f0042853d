"""Weight maps: which box of which source tensor is which box of which destination tensor.

Two frameworks hold the same weights under other names and packings: Megatron-Core fuses a layer's
q, k and v rows into ``linear_qkv`` (per query group: its q heads, then its k, then its v), Hugging Face
keeps ``q_proj`` / ``k_proj`` / ``v_proj``, and vLLM packs each tp rank's q and kv heads into its own
``qkv_proj``. Between any two of them every destination element is one source element, moved whole:
a ``WeightMap`` lists those correspondences as ``Link``s, boxes in the tensors' global coordinates.
The box math is the planner's (``boxes.py``); no tensor exists here.

A map is checked when made: every box inside its tensor, the two boxes of a link of one extent, and the
links of each destination tensor tiling it exactly, except the boxes it names as *padding* (rows a layout
pads its vocabulary with, which no source feeds: a refit writes them as zeros where the engine's own loader
zeroes them, vLLM's, and leaves them alone otherwise, Megatron's). Maps compose
(``then``: Megatron -> Hugging Face -> vLLM is one map) and a one-to-one map reverses (``reversed``:
Hugging Face -> Megatron, a training job starting from a checkpoint).

``MappedPlacement`` is how the planner plans through a map: a destination's holdings of its own tensors
(an engine's placement), seen in the source tensors' coordinates. Each of its slices is a box of a source
tensor, held by the ranks that hold its image, at an offset in their local *destination* tensor
(``Slice.target``), so the planner's tiles, pieces and balance apply unchanged.
"""

from __future__ import annotations

import hashlib
from collections.abc import Collection, Iterator, Mapping
from dataclasses import InitVar, dataclass, field
from typing import NamedTuple

from ..errors import ManifestError
from .boxes import Box, fitted, from_fields, meets, moved, overlap, subtract, volume
from .manifest import Manifest, tensor_label
from .placement import HeldTensor, HolderSet, Placement, Slice


class Link(NamedTuple):
    """One box of a destination tensor that is one box of a source tensor: the same elements in the same order.

    Attributes:
        target: The destination tensor's name.
        box: The box in the destination tensor's global coordinates.
        source: The source tensor's name.
        origin: The same elements' box in the source tensor's coordinates: of the same extents, up to unit
            dims on the left (one expert's box in a stacked tensor has one dim more than in its own).
    """

    target: str
    box: Box
    source: str
    origin: Box


def whole(shape: tuple[int, ...]) -> Box:
    """The box of a whole tensor."""
    return tuple((0, size) for size in shape)


def rows(shape: tuple[int, ...], start: int, stop: int, dim: int = 0) -> Box:
    """The box of rows [start, stop) of a tensor along ``dim``, every other dim whole."""
    return tuple((start, stop) if d == dim else (0, size) for d, size in enumerate(shape))


def translate(inner: Box, frm: Box, to: Box) -> Box:
    """The box of ``to`` that is ``inner``, a box inside ``frm``, when ``frm`` and ``to`` are the same elements
    (dims aligned from the right; the unit dims one has more than the other on the left stay where they are)."""
    if inner == frm:
        return to
    n = min(len(frm), len(to))
    tail = tuple(
        (t + a - f, t + b - f)
        for (a, b), (f, _), (t, _) in zip(inner[len(inner) - n :], frm[len(frm) - n :], to[len(to) - n :])
    )
    return (*to[: len(to) - n], *tail)


def _extents(box: Box) -> tuple[int, ...]:
    """A box's extents with the unit dims on its left dropped (what two boxes of one link share)."""
    sizes = [stop - start for start, stop in box]
    while len(sizes) > 1 and sizes[0] == 1:
        sizes.pop(0)
    return tuple(sizes)


def _inside(box: Box, shape: tuple[int, ...]) -> bool:
    return len(box) == len(shape) and all(0 <= a < b <= size for (a, b), size in zip(box, shape))


@dataclass(frozen=True)
class WeightMap:
    """Every element of ``targets``' tensors as an element of ``sources``' (see the module doc).

    Args:
        sources: The tensors the map reads.
        targets: The tensors it fills.
        links: The correspondences.
        padding: Per destination tensor, boxes no source feeds (an engine's vocabulary padding).
        name: What it maps, for messages and fingerprints ("megatron -> hf").
        zeroed: The destination holds zeros in its padding (an engine whose own loader zeroes it, as vLLM's
            does): a refit writes them (``MappedPlacement.zeroed``). False: a refit leaves the padding as it is
            (Megatron's vocabulary padding, which its checkpoint converters fill their own way).

    Raises:
        ManifestError: a link naming a tensor that is not there, a box outside its tensor, a link whose two
            boxes differ in extent, or a destination tensor its links and padding do not tile exactly, naming
            both tensors.
    """

    sources: Manifest
    targets: Manifest
    links: tuple[Link, ...]
    padding: Mapping[str, tuple[Box, ...]] = field(default_factory=dict)
    name: str = "map"
    zeroed: bool = False
    _into: dict[str, tuple[Link, ...]] = field(init=False, repr=False, compare=False)
    _from: dict[str, tuple[Link, ...]] = field(init=False, repr=False, compare=False)
    _feeds: dict[str, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _numbers: dict[str, tuple[int, ...]] = field(init=False, repr=False, compare=False)
    _patterns: dict[str, int] = field(init=False, repr=False, compare=False)
    _pattern_boxes: tuple[tuple[tuple[Box, Box], ...], ...] = field(init=False, repr=False, compare=False)
    _digest: str = field(default="", init=False, repr=False, compare=False)
    _composed: InitVar[bool] = False
    """Made by ``then`` from two checked maps, whose composition is a map by construction: not checked again."""

    def __post_init__(self, _composed: bool) -> None:
        into: dict[str, list[Link]] = {}
        out: dict[str, list[Link]] = {}
        feeds: dict[str, list[int]] = {}
        numbers: dict[str, list[int]] = {}
        at = {tensor.name: n for n, tensor in enumerate(self.sources)}
        shapes = {tensor.name: tensor.shape for tensor in self.targets}
        checked: set[tuple[Box, Box, tuple[int, ...], tuple[int, ...]]] = set()  # alike links, checked once
        for link in self.links:
            position = (
                at[link.source]
                if _composed
                else self._check_link(link, at.get(link.source), shapes.get(link.target), checked)
            )
            filling = into.setdefault(link.target, [])
            numbers.setdefault(link.source, []).append(len(filling))
            filling.append(link)
            out.setdefault(link.source, []).append(link)
            feeds.setdefault(link.target, []).append(position)
        for name, boxes in () if _composed else self.padding.items():
            tensor = self.targets.tensor(name)
            if not all(_inside(box, tensor.shape) for box in boxes):
                raise ManifestError(f"{self.name}: padding of {tensor_label(name)} reaches outside it")
        patterns: dict[tuple[tuple[Box, Box], ...], int] = {}
        pattern_of = {
            k: patterns.setdefault(tuple((link.box, link.origin) for link in v), len(patterns)) for k, v in into.items()
        }
        tiled: set[tuple[int, int, tuple[Box, ...]]] = set()  # tensors of one pattern, size and padding: one check
        for tensor in () if _composed else self.targets:
            pattern = pattern_of.get(tensor.name)
            alike_tiling = (-1 if pattern is None else pattern, tensor.numel, self.padding.get(tensor.name, ()))
            if alike_tiling not in tiled:
                self._check_tiled(tensor.name, tensor.numel, into.get(tensor.name, []))
                tiled.add(alike_tiling)
        object.__setattr__(self, "_into", {k: tuple(v) for k, v in into.items()})
        object.__setattr__(self, "_from", {k: tuple(v) for k, v in out.items()})
        object.__setattr__(self, "_feeds", {k: tuple(v) for k, v in feeds.items()})
        object.__setattr__(self, "_numbers", {k: tuple(v) for k, v in numbers.items()})
        object.__setattr__(self, "_patterns", pattern_of)
        object.__setattr__(self, "_pattern_boxes", tuple(patterns))

    def _check_link(
        self,
        link: Link,
        position: int | None,
        shape: tuple[int, ...] | None,
        checked: set[tuple[Box, Box, tuple[int, ...], tuple[int, ...]]],
    ) -> int:
        """``link``'s source position, once its tensors are known, its boxes inside them and of one extent; links
        alike in boxes and shapes (the same weight of every layer) are checked once, in ``checked``.

        Raises:
            ManifestError: naming the link, as the class says.
        """
        if position is None or shape is None:  # the manifests' own errors, naming the tensor
            position, shape = self.sources.index(link.source), self.targets.tensor(link.target).shape
        source_shape = self.sources.tensors[position].shape
        alike = (link.box, link.origin, shape, source_shape)
        if alike not in checked:
            if not _inside(link.box, shape) or not _inside(link.origin, source_shape):
                raise ManifestError(
                    f"{self._where(link)}: a box reaches outside {tensor_label(link.target)} "
                    f"{list(shape)} or {tensor_label(link.source)} {list(source_shape)}: check the sizes"
                )
            if _extents(link.box) != _extents(link.origin):
                raise ManifestError(f"{self._where(link)}: the two boxes differ in extent")
            checked.add(alike)
        return position

    def _where(self, link: Link) -> str:
        """A link in a message (made only for one: a model's maps have a quarter million links)."""
        return (
            f"{self.name}: {tensor_label(link.target)} {_shown(link.box)} <- {tensor_label(link.source)} "
            f"{_shown(link.origin)}"
        )

    def _check_tiled(self, name: str, numel: int, links: list[Link]) -> None:
        """The links and padding of one destination tensor cover it, each element once."""
        boxes = [(link.box, link.source) for link in links] + [(box, "") for box in self.padding.get(name, ())]
        if not links:
            raise ManifestError(
                f"{self.name}: destination tensor {tensor_label(name)} is fed by no source tensor of "
                f"{self.sources.name!r}: the model's families disagree (check the config's family and sizes)"
            )
        pair = _overlapping(boxes, 0)
        if pair is not None:
            (first, feeds), (second, other) = sorted(pair)
            raise ManifestError(
                f"{self.name}: destination tensor {tensor_label(name)}: box {_shown(first)} (from "
                f"{tensor_label(feeds or 'padding')}) and box {_shown(second)} (from "
                f"{tensor_label(other or 'padding')}) overlap: each element has one source"
            )
        covered = sum(volume(box) for box, _ in boxes)
        if covered != numel:
            sources = sorted({link.source for link in links})
            raise ManifestError(
                f"{self.name}: destination tensor {tensor_label(name)} has {numel} elements but its sources "
                f"({', '.join(map(tensor_label, sources[:3]))}) feed {covered}: the config's sizes disagree with "
                f"the manifest's"
            )

    def into(self, target: str) -> tuple[Link, ...]:
        """The links that fill destination tensor ``target``."""
        return self._into.get(target, ())

    def feeds(self, target: str) -> tuple[int, ...]:
        """The position among the sources of each link that fills ``target`` (``into``'s order)."""
        return self._feeds.get(target, ())

    def pattern(self, target: str) -> int:
        """A number that destination tensors share when their links have the same boxes (the same weight of every
        layer; in another layer, the links read other tensors), so that what depends on boxes alone is found once."""
        return self._patterns[target]

    def out_of(self, source: str) -> tuple[Link, ...]:
        """The links that read source tensor ``source``."""
        return self._from.get(source, ())

    def numbers(self, source: str) -> tuple[int, ...]:
        """The number of each link that reads ``source`` among the links filling its destination tensor (``out_of``'s
        order; ``into``'s numbering): a source tensor's part of a destination's image is found without the rest."""
        return self._numbers.get(source, ())

    def then(self, after: WeightMap) -> WeightMap:
        """This map followed by ``after`` (whose sources are this map's targets): one map from this map's
        sources to ``after``'s targets. Padding stays ``after``'s (and whether it is zeroed); an element
        ``after`` reads from this map's padding would be fed by nothing, and is an error.

        Raises:
            ManifestError: the two maps do not meet (naming the tensor), or a composed box reads padding.
        """
        if after.sources is not self.targets:
            raise ManifestError(f"{self.name} then {after.name}: the second map must read the first map's targets")
        links: list[Link] = []
        composed: dict[tuple[int, Box, Box], list[tuple[int, Box, Box]]] = {}
        for second in after.links:
            firsts = self.into(second.source)
            # (first link's number, box, origin) of each piece: the same for every source of one pattern
            alike = (self.pattern(second.source), second.box, second.origin)
            pieces = composed.get(alike)
            if pieces is None:
                pieces = composed[alike] = self._through(firsts, second, after)
            links.extend(Link(second.target, box, firsts[number].source, origin) for number, box, origin in pieces)
        return WeightMap(
            self.sources, after.targets, tuple(links), after.padding, f"{self.name} -> {after.name}", after.zeroed, True
        )

    def _through(self, firsts: tuple[Link, ...], second: Link, after: WeightMap) -> list[tuple[int, Box, Box]]:
        """``second``'s link of ``after`` through this map's links into its source (``firsts``): per first link it
        meets, (its number, the box of ``second.target``, the box of the first link's source).

        Raises:
            ManifestError: part of ``second`` reads padding of its source that no link feeds.
        """
        pieces, fed = [], 0
        for number, first in enumerate(firsts):
            if meets(first.box, second.origin):
                shared = overlap(first.box, second.origin)
                fed += volume(shared)
                pieces.append(
                    (number, translate(shared, second.origin, second.box), translate(shared, first.box, first.origin))
                )
        if fed != volume(second.origin):
            raise ManifestError(
                f"{self.name} then {after.name}: {tensor_label(second.target)} reads padding of "
                f"{tensor_label(second.source)} that no source of {self.sources.name!r} feeds"
            )
        return pieces

    def reversed(self, name: str | None = None) -> WeightMap:
        """The same correspondences read the other way: this map's sources filled from its targets. The parts
        of a source no link reads (Megatron's vocabulary padding) become the reversed map's padding, left as it is.

        Raises:
            ManifestError: a source element that this map copies into two places (an engine's replicated kv
                heads), which the reverse could not fill once: reverse the map to the unreplicated layout.
        """
        padding: dict[str, tuple[Box, ...]] = {}
        for tensor in self.sources:
            links = self.out_of(tensor.name)
            if sum(volume(link.origin) for link in links) > tensor.numel:
                raise ManifestError(
                    f"{self.name}: source tensor {tensor_label(tensor.name)} feeds more elements than it has "
                    f"(replicated into {len({link.target for link in links})} tensors or places): a map that copies "
                    f"an element twice has no reverse"
                )
            rest = [whole(tensor.shape)]
            for link in links:
                rest = [left for box in rest for left in subtract(box, link.origin)]
            if rest:
                padding[tensor.name] = tuple(rest)
        links = tuple(Link(link.source, link.origin, link.target, link.box) for link in self.links)
        return WeightMap(self.targets, self.sources, links, padding, name or f"reverse of {self.name}")

    def digest(self) -> str:
        """A short digest that equal maps share (in a plan's fingerprint), made once: of each destination tensor's
        links as their pattern (``pattern``: each pattern's boxes written once) and the source tensors they read,
        so a model's quarter million links cost as many names, not as many tuples' text (1.4 s for DeepSeek-V3's
        map into vLLM, in every rank's first refit)."""
        if not self._digest:
            fills = [
                (target, self._patterns[target], tuple(link.source for link in links))
                for target, links in self._into.items()
            ]
            text = repr((self.name, self._pattern_boxes, fills, sorted(self.padding.items()), self.zeroed))
            object.__setattr__(self, "_digest", hashlib.sha256(text.encode()).hexdigest()[:16])
        return self._digest


def _overlapping(boxes: list[tuple[Box, str]], dim: int) -> tuple[tuple[Box, str], tuple[Box, str]] | None:
    """Two of ``boxes`` (which agree on the dims before ``dim``) that share an element, or None.

    Boxes with the very same extent along ``dim`` overlap where their later dims do (a stacked tensor's
    experts each hold many boxes of one slot): those are compared on the next dim, so the check stays near
    linear; boxes with different but meeting extents are compared pairwise, a sweep along ``dim``."""
    if len(boxes) < 2:
        return None
    if dim == len(boxes[0][0]):
        return boxes[0], boxes[1]  # equal along every dim: the same box twice
    by_extent: dict[tuple[int, int], list[tuple[Box, str]]] = {}
    for item in boxes:
        by_extent.setdefault(item[0][dim], []).append(item)
    for group in by_extent.values():
        found = _overlapping(group, dim + 1)
        if found is not None:
            return found
    extents = sorted(by_extent)
    for i, (start, stop) in enumerate(extents):
        for later in extents[i + 1 :]:
            if later[0] >= stop:
                break
            for first in by_extent[(start, stop)]:
                for second in by_extent[later]:
                    if meets(first[0], second[0]):
                        return first, second
    return None


def _shown(box: Box) -> str:
    return str([list(pair) for pair in box])


Entry = tuple[int, Box, tuple[int, ...], HolderSet, int]
"""One slice of an image: (link number, source box, offset in the destination's local tensor, holders, block)."""


class _Image:
    """A destination tensor's slices in its source tensors' coordinates, without the tensors' names.

    Its slices are numbered link by link, each link's in the engine's order (a slice's number, its ``part``, seeds
    the planner's choice of sender), but made one link at a time, when asked for: a training rank reads the links of
    the few experts it holds, not an engine tensor's thousands. Which engine slices meet a link is found once per
    distinct extent of the link along the dims the slices are cut on (every expert's link of a stacked tensor has
    the same): a slice meets a link when it meets it there and along the dims every slice spans alike.

    Attributes:
        starts: Where each link's slices start among the image's (by link number; one more at the end).
    """

    __slots__ = ("_by_holders", "_entries", "_links", "_made", "_matches", "ranks", "starts")

    def __init__(self, links: tuple[Link, ...], engine: Placement, position: int) -> None:
        pieces = engine.slices(position)
        spans = list(zip(*(piece.box for piece in pieces)))  # per dim, every slice's [start, stop)
        cut = [d for d, span in enumerate(spans) if len(set(span)) > 1]
        shape = engine.manifest.tensors[position].shape  # a link lies inside it: a slice spanning a dim meets it there
        alike = [(d, span[0]) for d, span in enumerate(spans) if len(set(span)) == 1 and span[0] != (0, shape[d])]
        found: dict[tuple[tuple[int, int], ...], list[Slice]] = {}
        self._matches: list[list[Slice]] = []
        self.starts = [0]
        for link in links:
            box, matches = link.box, []
            if not alike or all(box[d][0] < stop and start < box[d][1] for d, (start, stop) in alike):
                key = tuple([box[d] for d in cut])
                if key not in found:
                    found[key] = list(engine.overlapping(position, box))
                matches = found[key]
            self._matches.append(matches)
            self.starts.append(self.starts[-1] + len(matches))
        self._links = links
        self._made: dict[int, list[Entry]] = {}
        self._entries: list[Entry] | None = None
        self._by_holders: list[tuple[frozenset[int], list[int]]] | None = None
        self.ranks: dict[int, list[tuple[int, Entry]]] = {}

    def link(self, number: int) -> list[Entry]:
        """The slices of link ``number``, in order (the first is the image's ``starts[number]``-th)."""
        made = self._made.get(number)
        if made is None:
            link = self._links[number]
            made = self._made[number] = []
            for piece in self._matches[number]:
                shared = overlap(piece.box, link.box)
                box = translate(shared, link.box, link.origin)
                offset = tuple(o + lo - a for o, (lo, _), (a, _) in zip(piece.offset, shared, piece.box))
                made.append((number, box, offset, piece.holders, piece.block))
        return made

    @property
    def entries(self) -> list[Entry]:
        """Every slice of the image, in order."""
        if self._entries is None:
            self._entries = [entry for number in range(len(self._links)) for entry in self.link(number)]
        return self._entries

    def of_rank(self, rank: int) -> list[tuple[int, Entry]]:
        """The (order, entry) of each slice ``rank`` holds, in order: found once per image and rank (a layer's
        tensor has the same as every other layer's)."""
        found = self.ranks.get(rank)
        if found is None:
            if self._by_holders is None:
                by_holders: dict[int, tuple[frozenset[int], list[int]]] = {}
                for order, entry in enumerate(self.entries):
                    by_holders.setdefault(entry[3].key, (entry[3].members, []))[1].append(order)
                self._by_holders = list(by_holders.values())
            mine = [orders for members, orders in self._by_holders if rank in members]
            orders = mine[0] if len(mine) == 1 else sorted(order for group in mine for order in group)
            entries = self.entries
            found = self.ranks[rank] = [(order, entries[order]) for order in orders]
        return found


class MappedPlacement(Placement):
    """A destination's holdings of its own tensors (``engine``), in the coordinates of ``weights``' sources.

    The planner plans between placements of one manifest: this one presents what ``engine`` holds as boxes
    of ``weights.sources``' tensors, each held by the ranks holding its image and lying at an offset in
    their local destination tensor (``Slice.target`` names it). Its slices of one source tensor may overlap
    (an element copied to two places, such as a replicated kv head); each is planned on its own.

    Args:
        engine: What the destination holds, over ``weights.targets``.
        weights: How the destination's tensors are the source's.
        landing: ``weights.targets`` as the destination holds them when it quantizes what lands (fp8 through a
            layout, ``landing.landed``): the converting tensors with their dtype, and their scale tensors.

    Raises:
        ManifestError: ``engine`` describes other tensors than ``weights.targets``.
    """

    def __init__(self, engine: Placement, weights: WeightMap, landing: Manifest | None = None) -> None:
        if engine.manifest is not weights.targets:
            raise ManifestError(
                f"{engine.label}: its tensors are not those {weights.name} fills: build both from one model"
            )
        self.engine, self.weights, self.manifest = engine, weights, weights.sources
        self.landing = landing
        self.index, self.label = engine.index, engine.label
        self._mapped: dict[int, tuple[tuple[int, Slice], ...]] = {}
        self._by_source: dict[int, dict[int, list[Slice]]] = {}
        self._slices: dict[int, tuple[Slice, ...]] = {}
        self._images: dict[tuple[object, ...], _Image] = {}
        self._image_of: dict[int, tuple[_Image, tuple[int, ...]]] = {}
        self._reads: dict[int, tuple[list[int], list[_Image], tuple[tuple[int, int], ...]]] = {}
        self._met: dict[tuple[object, ...], list[tuple[int, int, Entry]]] = {}

    @property
    def ranks(self) -> Collection[int]:
        return self.engine.ranks

    def describe(self) -> str:
        """The engine's holdings, the map, and what it quantizes on landing (so a refit's ranks agree on it)."""
        landing = ""
        if self.landing is not None:
            scaled = sum(tensor.scale is not None for tensor in self.landing)
            landing = f", quantizing {scaled} tensors on landing (digest {self.landing.digest()})"
        return f"{self.engine.describe()} through {self.weights.name} (digest {self.weights.digest()}){landing}"

    def _image(self, position: int) -> tuple[_Image, tuple[int, ...]]:
        """Destination tensor ``position``'s image (``_Image``), and the source tensor's position of each of its
        links. An image is found once per distinct (engine slices, ``WeightMap.pattern``): the same weight of every
        layer (a MoE layer's 4,096 expert links) has the same, only the tensors' names differ; and kept per position
        (a training rank's slices ask for their destination tensors' images many times)."""
        known = self._image_of.get(position)
        if known is not None:
            return known
        name = self.weights.targets.tensors[position].name
        engine = self.engine.slices(position)
        key = (
            tuple((piece.box, piece.offset, piece.holders.key, piece.block) for piece in engine),
            self.weights.pattern(name),
        )
        found = self._images.get(key)
        if found is None:
            found = self._images[key] = _Image(self.weights.into(name), self.engine, position)
        known = self._image_of[position] = (found, self.weights.feeds(name))
        return known

    def _of_target(self, position: int) -> tuple[tuple[int, Slice], ...]:
        """Every slice of destination tensor ``position``'s image, with its source tensor's position."""
        found = self._mapped.get(position)
        if found is not None:
            return found
        name = self.weights.targets.tensors[position].name
        image, feeds = self._image(position)
        found = self._mapped[position] = tuple(
            (feeds[number], from_fields(Slice, (box, offset, holders, block, order, name)))
            for order, (number, box, offset, holders, block) in enumerate(image.entries)
        )
        by_source = self._by_source[position] = {}
        for source, piece in found:
            by_source.setdefault(source, []).append(piece)
        return found

    def slices(self, position: int) -> tuple[Slice, ...]:
        found = self._slices.get(position)
        if found is None:
            name = self.manifest.tensors[position].name
            targets = sorted({self.weights.targets.index(link.target) for link in self.weights.out_of(name)})
            for target in targets:
                self._of_target(target)
            found = tuple(piece for t in targets for piece in self._by_source[t].get(position, ()))
            self._slices[position] = found
        return found

    def overlapping(self, position: int, box: Box) -> Iterator[Slice]:
        """The slices of source tensor ``position`` meeting ``box``, in ``slices``' order: made for those only, unless
        every slice is made already. A training rank asks for those meeting its own source slices, a few of the
        thousands of its tensors' images (every engine rank's)."""
        made = self._slices.get(position)
        if made is not None:
            return (piece for piece in made if meets(piece.box, box))
        return self._meeting(position, box)

    def _meeting(self, position: int, box: Box) -> Iterator[Slice]:
        """``overlapping``'s slices, read off the images of the destination tensors ``position`` feeds: per
        (destination tensor, link number) in ``slices``' order, the link's slices (``_Image.link``) that meet. Which
        meet is found once per (images, link numbers, box): the same weight of every layer reads the same."""
        reads = self._reads.get(position)
        if reads is None:
            name = self.manifest.tensors[position].name
            index = self.weights.targets.index
            pairs = sorted(zip((index(link.target) for link in self.weights.out_of(name)), self.weights.numbers(name)))
            images = [self._image(target)[0] for target, _ in pairs]
            reads = self._reads[position] = (
                [target for target, _ in pairs],
                images,
                tuple((id(image), number) for image, (_, number) in zip(images, pairs)),  # kept alive in _images
            )
        targets, images, signature = reads
        key = (signature, box)
        met = self._met.get(key)
        if met is None:
            met = self._met[key] = [
                (k, order, entry)
                for k, (image, (_, number)) in enumerate(zip(images, signature))
                for order, entry in enumerate(image.link(number), image.starts[number])
                if meets(entry[1], box)
            ]
        names = self.weights.targets.tensors
        for k, order, (_, piece_box, offset, holders, block) in met:
            target = targets[k]
            made = self._mapped.get(target)
            if made is not None:
                yield made[order][1]
            else:
                yield from_fields(Slice, (piece_box, offset, holders, block, order, names[target].name))

    def held(self, rank: int) -> Iterator[HeldTensor]:
        """The rank's tensors, each as the slices of its image the rank holds: made for this rank only (an
        engine rank holds an eighth of a tp=8 engine's), unless every slice is made already."""
        for held in self.engine.held(rank):
            position = held.position
            name = self.weights.targets.tensors[position].name
            image, feeds = self._image(position)
            made = self._mapped.get(position)
            by_source: dict[int, list[Slice]] = {}
            for order, (number, box, offset, holders, block) in image.of_rank(rank):
                piece = (
                    made[order][1]
                    if made is not None
                    else from_fields(Slice, (box, offset, holders, block, order, name))
                )
                by_source.setdefault(feeds[number], []).append(piece)
            shape = held.shape
            for source, pieces in sorted(by_source.items()):
                yield from_fields(HeldTensor, (source, shape, tuple(pieces), name))

    def zeroed(self, rank: int) -> dict[str, tuple[Box, ...]]:
        """The boxes of ``rank``'s local tensors that a refit writes as zeros, in local coordinates, by tensor name:
        the padding of a map that zeroes it (``WeightMap.zeroed``: vLLM's loader zeroes its vocabulary padding, and
        its reload path leaves it as it was, uninitialised); {} for any other map or rank."""
        weights, found = self.weights, {}
        for name, padding in weights.padding.items() if weights.zeroed else ():
            boxes = []
            for piece in self.engine.slices(weights.targets.index(name)):
                for box in padding if rank in piece.holders.members else ():
                    if meets(piece.box, box):
                        shared = overlap(piece.box, box)
                        start = moved(piece.offset, piece.box, shared)
                        extents = fitted(tuple(stop - lo for lo, stop in shared), len(start))
                        boxes.append(tuple((at, at + size) for at, size in zip(start, extents)))
            if boxes:
                found[name] = tuple(boxes)
        return found

    def local_tensors(self) -> Manifest:
        """The tensors this side's ranks hold locally (the destination's, by their own names and dtypes, with the
        scale tensors of those it quantizes on landing)."""
        return self.weights.targets if self.landing is None else self.landing

    def restrict(self, renumber: Mapping[int, int]) -> MappedPlacement:
        """The engine's holdings on the ranks ``renumber`` names, renumbered, through the same map and landing: a
        restricted destination still holds (and quantizes) the engine's own tensors.

        Raises:
            RefitError: as ``Placement.restrict``.
        """
        return MappedPlacement(self.engine.restrict(renumber), self.weights, self.landing)


__all__ = ["Link", "MappedPlacement", "WeightMap", "rows", "translate", "whole"]
