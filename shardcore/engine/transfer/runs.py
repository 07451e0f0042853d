"""A message's pieces as strided runs: one copy for many pieces, packed or landed.

A message can carry tens of thousands of small pieces: an engine rank of a MoE model receives, from each training
rank, every expert's gate rows, up rows and down columns, a few hundred bytes to a few MB each. One copy per piece
costs the CPU a view and a copy's dispatch each, ~10 us, whatever its size. Pieces that lie one after the other in
their tensor and in the message merge into one segment (an expert's gate rows, then its up rows, of
``w13_weight``), and segments of one size whose starts step alike in the tensor and in the message (expert after
expert) form a run, copied with one strided view on each side (``Tensor.as_strided``). What is not one stretch of
its tensor (a column block), or is quantized on its way out, is copied piece by piece.
"""

from __future__ import annotations

from collections.abc import Callable, Container, Sequence
from itertools import repeat
from operator import mul
from typing import TYPE_CHECKING, Any, NamedTuple

from ...refit.boxes import fitted, from_fields
from ...refit.part import Row
from ...refit.schedule import MessagePieces, Piece, packed_pieces

if TYPE_CHECKING:
    import torch


class Run(NamedTuple):
    """``segments`` stretches of ``numel`` elements of local tensor ``name``, each ``step`` elements after the last
    there and ``wire_step`` bytes after the last in the message, travelling in ``dtype``.

    Attributes:
        name: The local tensor.
        dtype: The dtype the elements travel in (the copy casts them into the tensor's).
        start: The first segment's first element, from the tensor's own first (not its storage's).
        wire: The first segment's byte offset in the message.
        numel: Elements per segment.
        segments: How many stretches.
        step: Elements from one segment's start to the next's in the tensor.
        wire_step: Bytes from one segment's start to the next's in the message.
    """

    name: str
    dtype: torch.dtype
    start: int
    wire: int
    numel: int
    segments: int
    step: int
    wire_step: int


Segments = tuple[tuple[int, int, int], ...]
"""A kind's received boxes in a local tensor: (first element, byte from the first box's, elements) each
(``_Builder.segments``)."""

Where = Callable[[str, str], "tuple[str, tuple[int, ...], torch.dtype] | None"]
"""Where the pieces of a manifest tensor (and a weight map's target, ``Piece.target``) lie on this rank: (their
local tensor, that tensor's shape, the dtype they travel in), or None when each must be copied alone (quantized on
its way out). Asked once per (tensor, target) of a message: it depends on them alone."""


def runs(
    pieces: Sequence[tuple[Piece, int]], where: Where, sending: bool, casts: Container[str] = ()
) -> tuple[list[Run], list[tuple[Piece, int]]]:
    """A message's ``pieces`` (with their byte offsets) as runs, and the pieces that join none (not one stretch of
    their tensor, a block of columns; or copied alone), in their order. The local tensors are contiguous
    (``execute_refit`` checks them; a staging copy is made so), so the runs depend on the plan's part alone, and a
    schedule keeps them for its next refits (``Schedule.runs``). A message can hold tens of thousands of pieces, so
    what depends on a piece's tensor (``where``) or on its shape in that tensor is found once per message, and the
    segments of a kind's boxes packed whole (``schedule.MessagePieces``) once per kind and local shape.

    Args:
        pieces: The message's pieces and their offsets (a ``MessagePieces``' entries are read as they are).
        where: Where each piece's tensor lies on this rank (``Where``).
        sending: Whether the pieces are read from this rank's tensors at their ``src_offset`` (a send), or
            written at their ``dst_offset`` (a receive).
        casts: The tensors whose pieces may travel in another dtype than their local tensor's (a converting
            refit's). A received kind's boxes of any other tensor go where their local tensor is, so ``where`` is
            asked once per local tensor for them (a stacked ``w13_weight`` receives hundreds of experts' boxes).
    """
    builders: dict[tuple[str, torch.dtype], _Builder] = {}
    of_tensor: dict[tuple[str, str], _Builder | None] = {}
    kinds: dict[tuple[int, int], Segments | None] = {}  # by the id of a kind's rows and the local tensor's shape
    shapes: dict[tuple[tuple[int, ...], int], int] = {}  # a number per local tensor's shape and itemsize
    templates: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[tuple[int, ...]]] = {}
    single: list[tuple[Piece, int]] = []

    def builder_of(tensor: str, target: str, key: tuple[str, str]) -> _Builder | None:
        builder = of_tensor[key] = None
        found = where(tensor, target)
        if found is not None:
            name, shape, dtype = found
            builder = of_tensor[key] = builders.get((name, dtype))
            if builder is None:
                shaped = shapes.setdefault((shape, dtype.itemsize), len(shapes))
                builder = of_tensor[key] = builders[name, dtype] = _Builder(name, dtype, shape, shaped)
        return builder

    columns = (
        zip(pieces.entries, pieces.bases, pieces.layouts)
        if isinstance(pieces, MessagePieces)
        else zip(pieces, repeat(0), repeat(None))
    )
    for entry, base, layout in columns:
        if layout is not None:  # a tensor's boxes packed whole (a ``Received``): their segments found once per kind
            tensor, target, rows = entry.tensor, entry.target, entry.rows  # type: ignore[union-attr]
            key = (tensor, target) if tensor in casts else ("", target or tensor)  # no tensor is named ""
            builder = of_tensor[key] if key in of_tensor else builder_of(tensor, target, key)
            if builder is not None and not sending:
                segments = kinds.get((id(rows), builder.shaped), _UNSEEN)
                if segments is _UNSEEN:
                    segments = kinds[id(rows), builder.shaped] = builder.segments(rows, layout.offsets)
                if segments is not None:
                    if builder.queued is None:
                        builder.add_all(segments, base)
                    else:
                        builder.queued.append((segments, base))
                    continue
            items = packed_pieces(entry, base, layout)  # type: ignore[arg-type]  # copied alone, or not stretches
        else:
            items = [entry]  # type: ignore[list-item]  # a loose (Piece, offset)
        for item in items:
            piece, offset = item
            key = (piece.tensor, piece.target)
            builder = of_tensor[key] if key in of_tensor else builder_of(*key, key)
            if builder is None or not builder.stretch(piece.shape):  # copied alone, or a block of columns
                single.append(item)
                continue
            at = piece.src_offset if sending else piece.dst_offset
            if builder.queued is not None:
                builder.flush()
            builder.add(sum(map(mul, at, builder.strides)), offset, piece.nbytes // builder.itemsize)
    return [run for builder in builders.values() for run in builder.done(templates)], single


_UNSEEN: Any = object()
"""``runs``' mark of a kind not yet looked up (None is an answer: not stretches)."""


def _strides(shape: tuple[int, ...]) -> tuple[int, ...]:
    """A contiguous tensor's strides, in elements."""
    strides, step = [], 1
    for size in reversed(shape):
        strides.append(step)
        step *= size
    return tuple(reversed(strides))


class _Builder:
    """The runs of one (tensor, dtype): segments merged while they continue each other on both sides, each
    finished segment appended to the run it steps on from, or starting a new one."""

    def __init__(self, name: str, dtype: torch.dtype, shape: tuple[int, ...], shaped: int) -> None:
        self.name, self.dtype, self.itemsize, self.shape = name, dtype, dtype.itemsize, shape
        self.shaped = shaped  # a number per (shape, itemsize) of the message's local tensors
        self.strides = _strides(shape)
        self.stretches: dict[tuple[int, ...], bool] = {}
        self.runs: list[tuple[int, ...]] = []  # (start, wire, numel, segments, step, wire_step) each
        self.run: list[int] | None = None  # [start, wire, numel, segments, step, wire_step]
        self.segment: list[int] | None = None  # [start, wire, numel]
        self.queued: list[tuple[Segments, int]] | None = []
        """Kinds' segments and the byte their boxes start at, not yet added, while nothing else came: ``done`` finds
        their runs once per pattern (the same kinds at the same distances: each MoE layer's stacked tensor gets its
        experts' boxes so), the others shifted. None once a loose piece came."""

    def stretch(self, box: tuple[int, ...]) -> bool:
        """Whether a box of this extent is one stretch of the tensor: whole in every dim after its first that is
        not 1 (a block of columns is not)."""
        found = self.stretches.get(box)
        if found is None:
            shape = self.shape
            fit = box if len(box) == len(shape) else fitted(box, len(shape))
            lead = 0
            while lead < len(fit) - 1 and fit[lead] == 1:
                lead += 1
            found = self.stretches[box] = fit[lead + 1 :] == shape[lead + 1 :]
        return found

    def segments(self, rows: Sequence[Row], offsets: tuple[int, ...]) -> Segments | None:
        """A kind's received boxes (``rows``, packed at ``offsets`` from a message's byte) as segments of this tensor:
        (first element, byte from the first box's, elements) each, merged by ``add``; None when one is not a
        stretch. ``runs`` keeps them per kind and local shape: the tensors of a kind share rows, and each layer's
        tensor has the same shape."""
        if not all(self.stretch(row[1]) for row in rows):
            return None
        itemsize, strides = self.itemsize, self.strides
        return tuple((sum(map(mul, row[3], strides)), wire, row[4] // itemsize) for row, wire in zip(rows, offsets))

    def add_all(self, segments: Segments, base: int) -> None:
        """A kind's ``segments``, its boxes packed from byte ``base`` of the message."""
        for start, wire, numel in segments:
            self.add(start, base + wire, numel)

    def flush(self) -> None:
        """Add the queued kinds' segments: a loose piece comes next."""
        for segments, base in self.queued or ():
            self.add_all(segments, base)
        self.queued = None

    def add(self, start: int, wire: int, numel: int) -> None:
        """A stretch of ``numel`` elements from element ``start`` of the tensor, at byte ``wire`` of the message."""
        segment = self.segment
        if segment is not None and start == segment[0] + segment[2] and wire == segment[1] + segment[2] * self.itemsize:
            segment[2] += numel
            return
        if segment is not None:
            self._append(segment)
        self.segment = [start, wire, numel]

    def _append(self, segment: list[int]) -> None:
        run, (start, wire, numel) = self.run, segment
        if run is not None and run[2] == numel:
            step, wire_step = start - (run[0] + (run[3] - 1) * run[4]), wire - (run[1] + (run[3] - 1) * run[5])
            if run[3] == 1 and step >= numel and wire_step >= numel * self.itemsize and not wire_step % self.itemsize:
                run[3], run[4], run[5] = 2, step, wire_step
                return
            if run[3] > 1 and step == run[4] and wire_step == run[5]:
                run[3] += 1
                return
        if run is not None:
            self.runs.append(tuple(run))
        self.run = [start, wire, numel, 1, 0, 0]

    def done(self, templates: dict[tuple[int, tuple[int, ...], tuple[int, ...]], list[tuple[int, ...]]]) -> list[Run]:
        """The runs, once every piece is added. Queued kinds alone (``queued``) are laid from the first one's byte:
        their runs are found once per pattern (``templates``: the kinds, each one's distance from the first, the
        itemsize) and shifted to where this builder's first kind starts."""
        name, dtype, queued = self.name, self.dtype, self.queued
        if not queued:
            return [from_fields(Run, (name, dtype, *run)) for run in self._finished()]
        first = queued[0][1]
        key = (self.itemsize, tuple([id(segments) for segments, _ in queued]), tuple([b - first for _, b in queued]))
        found = templates.get(key)
        if found is None:
            for segments, base in queued:
                self.add_all(segments, base - first)
            found = templates[key] = self._finished()
        return [from_fields(Run, (name, dtype, start, wire + first, *rest)) for start, wire, *rest in found]

    def _finished(self) -> list[tuple[int, ...]]:
        if self.segment is not None:
            self._append(self.segment)
        if self.run is not None:
            self.runs.append(tuple(self.run))
        return self.runs


def run_views(run: Run, tensor: torch.Tensor, wire: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``run``'s elements in its local ``tensor`` (contiguous) and in the message's bytes ``wire``: two views of
    (segments, numel), to copy one into the other (the copy casts between their dtypes)."""
    itemsize = run.dtype.itemsize
    typed = wire[run.wire : run.wire + (run.segments - 1) * run.wire_step + run.numel * itemsize].view(run.dtype)
    in_wire = typed.as_strided((run.segments, run.numel), (run.wire_step // itemsize, 1))
    in_tensor = tensor.as_strided((run.segments, run.numel), (run.step, 1), tensor.storage_offset() + run.start)
    return in_tensor, in_wire


__all__ = ["Run", "Where", "run_views", "runs"]
