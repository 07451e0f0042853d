"""Weight maps: which box of which source tensor is which box of which destination tensor.

Two frameworks hold the same weights under other names and packings: Megatron-Core fuses a layer's
q, k and v rows into ``linear_qkv`` (per query group: its q heads, then its k, then its v), Hugging Face
keeps ``q_proj`` / ``k_proj`` / ``v_proj``, and vLLM packs each tp rank's q and kv heads into its own
``qkv_proj``. Between any two of them every destination element is one source element, moved whole:
a ``WeightMap`` lists those correspondences as ``Link``s, boxes in the tensors' global coordinates.
The box math is the planner's (``boxes.py``); no tensor exists here.

A map is held fill by fill (``Fill``): a destination tensor's links without the tensors' names, which the same
weight of every layer shares, beside the names of the source tensors each fills from. DeepSeek-V3's map into a
vLLM engine has a quarter million links but a few dozen fills: it is made (``MapBuilder``), checked and composed
once per fill, and a ``Link`` is made only when asked for.

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
import warnings
from array import array
from collections.abc import Callable, Collection, Hashable, Iterable, Iterator, Mapping
from contextlib import suppress
from operator import itemgetter
from typing import NamedTuple

from ..errors import ManifestError
from .boxes import Box, fitted, from_fields, meets, moved, overlap, subtract, volume
from .manifest import Manifest, hash_names, tensor_label
from .placement import HeldAlike, HeldTensor, HolderSet, Member, Placement, Slice


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


class Fill(NamedTuple):
    """How a destination tensor is filled, without the tensors' names: what the same weight of every layer shares.

    Attributes:
        links: Per link, in order: (its box of the destination tensor, its box of the source tensor it reads).
        slots: Per link, which of the filling's source tensors it reads (its number among them).
    """

    links: tuple[tuple[Box, Box], ...]
    slots: tuple[int, ...]


Filling = tuple[Fill, tuple[str, ...]]
"""A destination tensor's fill and its source tensors' names, by slot."""


class MapBuilder:
    """A weight map's destination tensors, each filled at once (``fill``): a fill is made once per key and shared by
    the tensors whose links differ in the source tensors' names alone (the same weight of every layer), so a map of a
    quarter million links costs as many fills as the model has kinds of weight. ``WeightMap.filled`` takes the result.

    Attributes:
        fills: The filling of each destination tensor, in the order they were filled.
    """

    def __init__(self) -> None:
        self.fills: dict[str, Filling] = {}
        self._made: dict[Hashable, Fill] = {}

    def fill(
        self, target: str, sources: tuple[str, ...], key: Hashable, make: Callable[[], Iterable[tuple[Box, Box, int]]]
    ) -> None:
        """Fill ``target`` from ``sources``, all of it at once (a later fill of the same tensor replaces it).

        Args:
            target: The destination tensor's name.
            sources: The source tensors' names; a link reads one by its number among them.
            key: What the links' boxes depend on, all of it: tensors with one key share one fill.
            make: Yields (box of ``target``, box of the source, the source's number) per link, in order; called
                once per ``key``.
        """
        found = self._made.get(key)
        if found is None:
            made = list(make())
            found = self._made[key] = Fill(tuple((box, origin) for box, origin, _ in made), tuple(s for *_, s in made))
        self.fills[target] = (found, sources)

    def link(self, target: str, box: Box, source: str, origin: Box) -> None:
        """Fill ``target`` with one link: its ``box`` is ``source``'s ``origin``."""
        self.fill(target, (source,), (box, origin), lambda: ((box, origin, 0),))


class WeightMap:
    """Every element of ``targets``' tensors as an element of ``sources``' (see the module doc).

    Held fill by fill (``Fill``): each destination tensor's links as a fill that the same weight of every layer shares,
    and the names of the source tensors it reads; a ``Link`` is made when asked for (``into``, ``out_of``, ``links``).

    Args:
        sources: The tensors the map reads.
        targets: The tensors it fills.
        links: The correspondences (``filled`` takes them fill by fill, from a ``MapBuilder``).
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
    padding: Mapping[str, tuple[Box, ...]]
    name: str
    zeroed: bool

    def __init__(
        self,
        sources: Manifest,
        targets: Manifest,
        links: Iterable[Link],
        padding: Mapping[str, tuple[Box, ...]] | None = None,
        name: str = "map",
        zeroed: bool = False,
    ) -> None:
        grouped: dict[str, list[Link]] = {}
        for link in links:
            grouped.setdefault(link.target, []).append(link)
        fills: dict[str, Filling] = {}
        alike: dict[Fill, Fill] = {}
        for target, mine in grouped.items():
            numbers: dict[str, int] = {}
            slots = tuple(numbers.setdefault(link.source, len(numbers)) for link in mine)
            fill = Fill(tuple((link.box, link.origin) for link in mine), slots)
            fills[target] = (alike.setdefault(fill, fill), tuple(numbers))
        self._settle(sources, targets, fills, padding or {}, name, zeroed, checked=False)

    @classmethod
    def filled(
        cls,
        sources: Manifest,
        targets: Manifest,
        fills: Mapping[str, Filling],
        padding: Mapping[str, tuple[Box, ...]] | None = None,
        name: str = "map",
        zeroed: bool = False,
    ) -> WeightMap:
        """The map a ``MapBuilder`` filled (``fills``: its ``fills``); the other arguments as the class's.

        Raises:
            ManifestError: as the class.
        """
        made = cls.__new__(cls)
        made._settle(sources, targets, fills, padding or {}, name, zeroed, checked=False)
        return made

    def _settle(
        self,
        sources: Manifest,
        targets: Manifest,
        fills: Mapping[str, Filling],
        padding: Mapping[str, tuple[Box, ...]],
        name: str,
        zeroed: bool,
        checked: bool,
    ) -> None:
        """Hold ``fills``, numbering each distinct fill (one object per kind of weight) and each distinct pattern of
        boxes (``pattern``); check them unless ``checked`` (made by ``then`` from two checked maps, a map by
        construction)."""
        self.sources, self.targets, self.padding, self.name, self.zeroed = sources, targets, padding, name, zeroed
        numbered: dict[int, int] = {}  # a fill's id -> its number: fills are shared objects, compared by identity
        self._kinds: list[Fill] = []
        self._fills: dict[str, tuple[int, tuple[str, ...]]] = {}
        self._reads: dict[str, list[tuple[str, int]]] = {}  # source -> (target, slot) of each filling reading it
        self._starts: dict[str, int] = {}  # target -> where its sources' names start among every fill's
        every: list[str] = []
        for target, (fill, names) in fills.items():
            number = numbered.get(id(fill))
            if number is None:
                number = numbered[id(fill)] = len(self._kinds)
                self._kinds.append(fill)
            self._fills[target] = (number, names)
            for slot, source in enumerate(names):
                self._reads.setdefault(source, []).append((target, slot))
            self._starts[target] = len(every)
            every += names
        self._every: tuple[int, ...] | None = None
        """The positions of every fill's sources (``_starts``), found at once while their names are at hand (every
        rank's part asks, ``filling``); None when a name is no source's (``_check`` names it)."""
        with suppress(ManifestError):
            self._every = sources.positions(every)
        patterns: dict[tuple[tuple[Box, Box], ...], int] = {}
        self._patterns = [patterns.setdefault(fill.links, len(patterns)) for fill in self._kinds]
        self._pattern_boxes = tuple(patterns)
        self._slot_links: dict[int, tuple[tuple[int, ...], ...]] = {}
        self._feeds: dict[str, tuple[int, ...]] = {}
        self._links: tuple[Link, ...] | None = None
        self._digest = ""
        if not checked:
            self._check()

    def _check(self) -> None:
        """The class's checks: each fill's links once per (fill, tensors' shapes), each tiling once per (pattern,
        size, padding)."""
        shapes = {tensor.name: tensor.shape for tensor in self.targets}
        sources = self.sources.tensors
        checked: set[tuple[int, tuple[int, ...], tuple[tuple[int, ...], ...]]] = set()
        for target, (number, names) in self._fills.items():
            shape = shapes.get(target)
            if shape is None:  # the manifest's own error, naming the tensor
                shape = self.targets.tensor(target).shape
            positions = self._positions(target, names)
            source_shapes = tuple([sources[position].shape for position in positions])
            if (number, shape, source_shapes) not in checked:
                self._check_links(target, names, shape, source_shapes)
                checked.add((number, shape, source_shapes))
        for name, boxes in self.padding.items():
            tensor = self.targets.tensor(name)
            if not all(_inside(box, tensor.shape) for box in boxes):
                raise ManifestError(f"{self.name}: padding of {tensor_label(name)} reaches outside it")
        tiled: set[tuple[int, int, tuple[Box, ...]]] = set()  # tensors of one pattern, size and padding: one check
        for tensor in self.targets:
            filling = self._fills.get(tensor.name)
            alike = (
                -1 if filling is None else self._patterns[filling[0]],
                tensor.numel,
                self.padding.get(tensor.name, ()),
            )
            if alike not in tiled:
                self._check_tiled(tensor.name, tensor.numel, list(self.into(tensor.name)))
                tiled.add(alike)

    def _check_links(
        self, target: str, names: tuple[str, ...], shape: tuple[int, ...], source_shapes: tuple[tuple[int, ...], ...]
    ) -> None:
        """``target``'s links inside their tensors and of one extent each, alike links (boxes and shapes) once.

        Raises:
            ManifestError: naming the link, as the class says.
        """
        fill = self._kinds[self._fills[target][0]]
        if len(fill.slots) != len(fill.links) or set(fill.slots) != set(range(len(names))):
            raise ManifestError(
                f"{self.name}: {tensor_label(target)}: its fill must give each link one of its {len(names)} source "
                "tensors and read each of them (Fill.slots)"
            )
        alike: set[tuple[Box, Box, tuple[int, ...]]] = set()
        for (box, origin), slot in zip(fill.links, fill.slots):
            source_shape = source_shapes[slot]
            if (box, origin, source_shape) in alike:
                continue
            if not _inside(box, shape) or not _inside(origin, source_shape):
                raise ManifestError(
                    f"{self._where(Link(target, box, names[slot], origin))}: a box reaches outside "
                    f"{tensor_label(target)} {list(shape)} or {tensor_label(names[slot])} {list(source_shape)}: check "
                    "the sizes"
                )
            if _extents(box) != _extents(origin):
                raise ManifestError(
                    f"{self._where(Link(target, box, names[slot], origin))}: the two boxes differ in extent"
                )
            alike.add((box, origin, source_shape))

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
        filling = self._fills.get(target)
        if filling is None:
            return ()
        number, names = filling
        fill = self._kinds[number]
        return tuple(
            [
                from_fields(Link, (target, box, names[slot], origin))
                for (box, origin), slot in zip(fill.links, fill.slots)
            ]
        )

    def boxes(self, target: str) -> tuple[tuple[Box, Box], ...]:
        """(box of ``target``, box of its source) of each link that fills ``target``, in ``into``'s order: its
        links without the source tensors' names, shared by the same weight of every layer."""
        filling = self._fills.get(target)
        return () if filling is None else self._kinds[filling[0]].links

    def feeds(self, target: str) -> tuple[int, ...]:
        """The position among the sources of each link that fills ``target`` (``into``'s order)."""
        found = self._feeds.get(target)
        if found is None:
            filled = self.filling(target)
            if filled is None:
                return ()
            fill, positions = filled
            found = self._feeds[target] = tuple([positions[slot] for slot in fill.slots])
        return found

    def filling(self, target: str) -> tuple[Fill, tuple[int, ...]] | None:
        """How ``target`` is filled: its fill (one object for the same weight of every layer) and the positions
        among the sources of the tensors its slots read; None when nothing fills it."""
        filling = self._fills.get(target)
        if filling is None:
            return None
        number, names = filling
        return self._kinds[number], self._positions(target, names)

    def _positions(self, target: str, names: tuple[str, ...]) -> tuple[int, ...]:
        """The positions of ``names``, the sources ``target``'s slots read, among ``_every``.

        Raises:
            ManifestError: a name that is no source's (the manifest's error, naming it).
        """
        if self._every is None:
            return self.sources.positions(names)
        start = self._starts[target]
        return self._every[start : start + len(names)]

    def pattern(self, target: str) -> int:
        """A number that destination tensors share when their links have the same boxes (the same weight of every
        layer; in another layer, the links read other tensors), so that what depends on boxes alone is found once."""
        return self._patterns[self._fills[target][0]]

    def _numbers(self, number: int) -> tuple[tuple[int, ...], ...]:
        """Per slot of fill ``number``, the numbers of its links reading that slot's source (made once per fill, so
        the same weight of every layer shares them)."""
        found = self._slot_links.get(number)
        if found is None:
            fill = self._kinds[number]
            slots: list[list[int]] = [[] for _ in range(max(fill.slots, default=-1) + 1)]
            for link, slot in enumerate(fill.slots):
                slots[slot].append(link)
            found = self._slot_links[number] = tuple(map(tuple, slots))
        return found

    def out_of(self, source: str) -> tuple[Link, ...]:
        """The links that read source tensor ``source``, destination tensor by destination tensor."""
        links = []
        for target, numbers in self.reads_of(source):
            pairs = self.boxes(target)
            links += [from_fields(Link, (target, pairs[n][0], source, pairs[n][1])) for n in numbers]
        return tuple(links)

    def __eq__(self, other: object) -> bool:
        """Maps are equal when they read and fill the same tensors with the same links, in the same order, and pad
        alike."""
        if not isinstance(other, WeightMap):
            return NotImplemented
        return self is other or (
            (self.name, self.zeroed, dict(self.padding), self.sources, self.targets)
            == (other.name, other.zeroed, dict(other.padding), other.sources, other.targets)
            and self.links == other.links
        )

    __hash__ = None  # type: ignore[assignment]  # equal maps may be made apart: compared by value, not hashed

    def fed_by(self, source: str) -> tuple[str, ...]:
        """The destination tensors ``source`` feeds, in ``out_of``'s order, each once."""
        return tuple([target for target, _ in self._reads.get(source, ())])

    def reads_of(self, source: str) -> tuple[tuple[str, tuple[int, ...]], ...]:
        """(destination tensor, the numbers among the links filling it of those that read ``source``: ``into``'s
        numbering) per destination tensor ``source`` feeds, in ``out_of``'s order. The numbers are one object for
        the same weight of every layer: what a source tensor reads of a destination's image, found without the rest
        and without making its links."""
        return tuple(
            [(target, self._numbers(self._fills[target][0])[slot]) for target, slot in self._reads.get(source, ())]
        )

    def read_by(self, source: str) -> tuple[tuple[str, int], ...]:
        """(destination tensor, number) of each link that reads ``source`` (``reads_of``, link by link)."""
        return tuple((target, link) for target, numbers in self.reads_of(source) for link in numbers)

    def numbers(self, source: str) -> tuple[int, ...]:
        """Deprecated, goes in the next release: ``read_by`` gives each number with its destination tensor."""
        warnings.warn(
            "WeightMap.numbers is deprecated and goes in the next release: use WeightMap.read_by",
            DeprecationWarning,
            stacklevel=2,
        )
        return tuple(number for _, number in self.read_by(source))

    @property
    def links(self) -> tuple[Link, ...]:
        """Every correspondence, destination tensor by destination tensor (made when first asked for)."""
        if self._links is None:
            self._links = tuple(link for target in self._fills for link in self.into(target))
        return self._links

    def then(self, after: WeightMap) -> WeightMap:
        """This map followed by ``after`` (whose sources are this map's targets): one map from this map's
        sources to ``after``'s targets. Padding stays ``after``'s (and whether it is zeroed); an element
        ``after`` reads from this map's padding would be fed by nothing, and is an error. Composed fill by fill:
        once per (``after``'s fill, the fills of the tensors it reads, which of their sources are one tensor).

        Raises:
            ManifestError: the two maps do not meet (naming the tensor), or a composed box reads padding.
        """
        if after.sources is not self.targets:
            raise ManifestError(f"{self.name} then {after.name}: the second map must read the first map's targets")
        fills: dict[str, Filling] = {}
        composed: dict[tuple[object, ...], tuple[Fill, tuple[int, ...]]] = {}
        for target, (number, names) in after._fills.items():
            firsts = [self._fills[name] for name in names]
            slot_of: dict[str, int] = {}  # a source read through two of them (gate and up from one fc1) is one slot
            slots = tuple([slot_of.setdefault(source, len(slot_of)) for _, reads in firsts for source in reads])
            key = (number, tuple([kind for kind, _ in firsts]), slots)
            found = composed.get(key)
            if found is None:
                found = composed[key] = self._through(after, target, (number, names), firsts, slots)
            fill, kept = found
            reads = tuple(slot_of)
            fills[target] = (fill, tuple([reads[slot] for slot in kept]))
        made = WeightMap.__new__(WeightMap)  # two checked maps compose into a map: not checked again
        made._settle(
            self.sources, after.targets, fills, after.padding, f"{self.name} -> {after.name}", after.zeroed, True
        )
        return made

    def _through(
        self,
        after: WeightMap,
        target: str,
        filling: tuple[int, tuple[str, ...]],
        firsts: list[tuple[int, tuple[str, ...]]],
        slots: tuple[int, ...],
    ) -> tuple[Fill, tuple[int, ...]]:
        """``after``'s fill of ``target`` (``filling``) through this map's fills of the tensors it reads (``firsts``):
        per link, the pieces of it each link of theirs feeds; ``slots`` numbers their sources. Returns the composed
        fill and which of ``slots``' sources it reads, in the order its own slots number them (a source that feeds
        none of the pieces is no source of the composed tensor).

        Raises:
            ManifestError: part of a link reads padding of its source that no link feeds.
        """
        number, names = filling
        second = after._kinds[number]
        starts = [0]
        for _, reads in firsts:
            starts.append(starts[-1] + len(reads))
        links: list[tuple[Box, Box]] = []
        composed: list[int] = []
        for (box, origin), k in zip(second.links, second.slots):
            first, fed = self._kinds[firsts[k][0]], 0
            for (first_box, first_origin), j in zip(first.links, first.slots):
                if meets(first_box, origin):
                    shared = overlap(first_box, origin)
                    fed += volume(shared)
                    links.append((translate(shared, origin, box), translate(shared, first_box, first_origin)))
                    composed.append(slots[starts[k] + j])
            if fed != volume(origin):
                raise ManifestError(
                    f"{self.name} then {after.name}: {tensor_label(target)} reads padding of "
                    f"{tensor_label(names[k])} that no source of {self.sources.name!r} feeds"
                )
        kept: dict[int, int] = {}
        renumbered = tuple([kept.setdefault(slot, len(kept)) for slot in composed])
        return Fill(tuple(links), renumbered), tuple(kept)

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
            kinds, patterns = self._kinds, self._patterns
            fills = self._fills.items()
            text = repr((self.name, self._pattern_boxes, sorted(self.padding.items()), self.zeroed))
            found = hashlib.sha256(text.encode())
            found.update(array("q", [patterns[number] for _, (number, _) in fills]).tobytes())
            hash_names(found.update, [target for target, _ in fills])
            hash_names(found.update, [names[slot] for _, (number, names) in fills for slot in kinds[number].slots])
            found.update(array("q", [len(kinds[number].slots) for _, (number, _) in fills]).tobytes())
            self._digest = found.hexdigest()[:16]
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

    __slots__ = ("_entries", "_links", "_made", "_matches", "ranks", "starts")

    def __init__(self, links: tuple[tuple[Box, Box], ...], engine: Placement, position: int) -> None:
        pieces = engine.slices(position)
        spans = list(zip(*(piece.box for piece in pieces)))  # per dim, every slice's [start, stop)
        cut = [d for d, span in enumerate(spans) if len(set(span)) > 1]
        shape = engine.manifest.tensors[position].shape  # a link lies inside it: a slice spanning a dim meets it there
        alike = [(d, span[0]) for d, span in enumerate(spans) if len(set(span)) == 1 and span[0] != (0, shape[d])]
        found: dict[tuple[tuple[int, int], ...], list[Slice]] = {}
        self._matches: list[list[Slice]] = []
        self.starts = [0]
        for link in links:
            box, matches = link[0], []
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
        self.ranks: dict[int, list[tuple[int, Entry]]] = {}

    def link(self, number: int) -> list[Entry]:
        """The slices of link ``number``, in order (the first is the image's ``starts[number]``-th)."""
        made = self._made.get(number)
        if made is None:
            made = self._made[number] = [self._entry(number, piece) for piece in self._matches[number]]
        return made

    def _entry(self, number: int, piece: Slice) -> Entry:
        """The slice of link ``number`` that engine slice ``piece`` holds."""
        link, origin = self._links[number]
        shared = overlap(piece.box, link)
        offset = tuple([o + lo - a for o, (lo, _), (a, _) in zip(piece.offset, shared, piece.box)])
        return (number, translate(shared, link, origin), offset, piece.holders, piece.block)

    @property
    def entries(self) -> list[Entry]:
        """Every slice of the image, in order."""
        if self._entries is None:
            self._entries = [entry for number in range(len(self._links)) for entry in self.link(number)]
        return self._entries

    def of_rank(self, rank: int) -> list[tuple[int, Entry]]:
        """The (order, entry) of each slice ``rank`` holds, in order: found once per image and rank (a layer's
        tensor has the same as every other layer's), made for that rank alone (an engine rank holds an eighth of a
        tp=8 engine's slices)."""
        found = self.ranks.get(rank)
        if found is None:
            found = self.ranks[rank] = []
            made = self._made
            for number, (start, matches) in enumerate(zip(self.starts, self._matches)):
                entries = made.get(number)
                for k, piece in enumerate(matches):
                    if rank in piece.holders.members:
                        found.append((start + k, self._entry(number, piece) if entries is None else entries[k]))
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
        self._image_of: dict[int, _Image] = {}
        self._reads: dict[int, tuple[list[int], list[_Image], tuple[tuple[int, int], ...]]] = {}
        self._met: dict[tuple[object, ...], list[tuple[int, int, Entry]]] = {}
        self._kinds: dict[tuple[tuple[int, int], ...], tuple[HolderSet, ...]] = {}
        self._slots: dict[tuple[int, int, int], tuple[list[int], list[tuple[Slice, ...]], list[int]]] = {}
        """By (image, fill, rank): the slots the rank holds slices of, those slices per slot, and their ids (their
        kinds), as columns (``held_alike``)."""

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

    def _image(self, position: int) -> _Image:
        """Destination tensor ``position``'s image (``_Image``). An image is found once per distinct (engine slices,
        ``WeightMap.pattern``): the same weight of every layer (a MoE layer's 4,096 expert links) has the same, only
        the tensors' names differ; and kept per position (a training rank's slices ask for their destination tensors'
        images many times)."""
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
            found = self._images[key] = _Image(self.weights.boxes(name), self.engine, position)
        self._image_of[position] = found
        return found

    def _of_target(self, position: int) -> tuple[tuple[int, Slice], ...]:
        """Every slice of destination tensor ``position``'s image, with its source tensor's position."""
        found = self._mapped.get(position)
        if found is not None:
            return found
        name = self.weights.targets.tensors[position].name
        image, feeds = self._image(position), self.weights.feeds(name)
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
            targets = sorted(map(self.weights.targets.index, self.weights.fed_by(name)))
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
        targets, images, signature = self._read_of(position)
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

    def _read_of(self, position: int) -> tuple[list[int], list[_Image], tuple[tuple[int, int], ...]]:
        """Source tensor ``position``'s reads of the destination's images: per (destination tensor, link number) in
        ``slices``' order, the destination tensor, its image, and (the image's id, the link number): slices alike in
        every tensor with the same (a stacked tensor's expert in every layer). Found once per position."""
        reads = self._reads.get(position)
        if reads is None:
            targets, images, signature = [], [], []
            for target, numbers in self._reads_by_target(position):
                image = self._image(target)
                targets += [target] * len(numbers)
                images += [image] * len(numbers)
                signature += [(id(image), number) for number in numbers]  # the image is kept alive in _images
            reads = self._reads[position] = (targets, images, tuple(signature))
        return reads

    def _reads_by_target(self, position: int) -> list[tuple[int, tuple[int, ...]]]:
        """(destination tensor's position, the numbers of its links that read source tensor ``position``), by
        destination tensor (``WeightMap.reads_of``) in ``slices``' order."""
        index = self.weights.targets.index
        return sorted(
            (index(target), numbers) for target, numbers in self.weights.reads_of(self.manifest.tensors[position].name)
        )

    def kind_of(self, position: int) -> tuple[Hashable, tuple[HolderSet, ...]]:
        """``Placement.kind_of``, read off the images without making the slices: a source tensor's kind is which links
        of which images it reads (one image and one numbers object for the same weight of every layer, so a stacked
        tensor's expert is of one kind in every layer), and its holders are found once per kind."""
        reads = self._reads_by_target(position)
        kind = tuple([(id(self._image(target)), id(numbers)) for target, numbers in reads])  # both kept alive
        holders = self._kinds.get(kind)
        if holders is None:
            holders = self._kinds[kind] = tuple(
                entry[3]
                for target, numbers in reads
                for number in numbers
                for entry in self._image(target).link(number)
            )
        return kind, holders

    def held(self, rank: int) -> Iterator[HeldTensor]:
        """The rank's tensors, each as the slices of its image the rank holds: made for this rank only (an
        engine rank holds an eighth of a tp=8 engine's), unless every slice is made already."""
        for held in self.engine.held(rank):
            yield from self._held_one(rank, held)

    def _held_one(self, rank: int, held: HeldTensor) -> Iterator[HeldTensor]:
        """``held``'s tensors of one engine tensor the rank holds (``held``), by ascending source position."""
        position = held.position
        name = self.weights.targets.tensors[position].name
        image, feeds = self._image(position), self.weights.feeds(name)
        made = self._mapped.get(position)
        by_source: dict[int, list[Slice]] = {}
        for order, (number, box, offset, holders, block) in image.of_rank(rank):
            piece = (
                made[order][1] if made is not None else from_fields(Slice, (box, offset, holders, block, order, name))
            )
            by_source.setdefault(feeds[number], []).append(piece)
        shape = held.shape
        for source, pieces in sorted(by_source.items()):
            yield from_fields(HeldTensor, (source, shape, tuple(pieces), name))

    def held_alike(self, rank: int) -> Iterator[HeldAlike]:
        """``held``'s tensors by engine tensor, with their kinds: a source tensor's slices of an engine tensor are a
        slot of its fill (``WeightMap.filling``), and the rank's slices of one slot of one image are alike in every
        layer, so they are made once per (image, fill, rank), named by no local tensor, and shared. An engine tensor
        whose fill reads one source in two slots has its slices made as ``held`` makes them, of no kind."""
        names = self.weights.targets.tensors
        for held in self.engine.held(rank):
            position = held.position
            name = names[position].name
            filled = self.weights.filling(name)
            if filled is None:
                continue
            fill, positions = filled
            image = self._image(position)
            key = (id(image), id(fill), rank)  # both kept alive (``_images``, the map's fills)
            slots = self._slots.get(key)
            if slots is None:
                by_slot: dict[int, list[Slice]] = {}
                for order, (number, box, offset, holders, block) in image.of_rank(rank):
                    piece = from_fields(Slice, (box, offset, holders, block, order, ""))
                    by_slot.setdefault(fill.slots[number], []).append(piece)
                made = [tuple(pieces) for pieces in by_slot.values()]
                slots = self._slots[key] = (list(by_slot), made, list(map(id, made)))
            numbers, pieces, kinds = slots
            at = list(map(positions.__getitem__, numbers))
            members: list[Member] = list(zip(at, pieces, kinds))
            members.sort(key=itemgetter(0))
            if len(set(at)) < len(at):  # one source in two slots
                members = [(alone.position, alone.slices, None) for alone in self._held_one(rank, held)]
            if members:  # as ``held``: an engine tensor no source feeds on this rank is not among them
                yield HeldAlike(name, held.shape, members)

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


__all__ = ["Fill", "Filling", "Link", "MapBuilder", "MappedPlacement", "WeightMap", "rows", "translate", "whole"]
