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

from collections.abc import Callable, Iterator, Sequence
from operator import mul
from typing import TYPE_CHECKING, NamedTuple

from ...refit.boxes import fitted
from ...refit.schedule import Piece

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


Where = Callable[[Piece], "tuple[str, tuple[int, ...], tuple[int, ...], torch.dtype] | None"]
"""Where a piece lies on this rank: (its local tensor, its offset there, the tensor's shape, the dtype it travels
in), or None when it must be copied alone (quantized on its way out)."""


def runs(pieces: Sequence[tuple[Piece, int]], where: Where) -> tuple[list[Run], list[tuple[Piece, int]]]:
    """A message's ``pieces`` (with their byte offsets) as runs, and the pieces that join none (not one stretch of
    their tensor, a block of columns; or copied alone), in their order. The local tensors are contiguous
    (``execute_refit`` checks them; a staging copy is made so), so the runs depend on the plan's part alone, and a
    schedule keeps them for its next refits (``Schedule.runs``).

    Args:
        pieces: The message's pieces and their offsets.
        where: Where each piece lies in this rank's tensors (``Where``).
    """
    builders: dict[tuple[str, torch.dtype], _Builder] = {}
    single: list[tuple[Piece, int]] = []
    for item in pieces:
        piece, offset = item
        found = where(piece)
        if found is None:
            single.append(item)
            continue
        name, at, shape, dtype = found
        box = piece.shape if len(piece.shape) == len(shape) else fitted(piece.shape, len(shape))
        lead = 0
        while lead < len(box) - 1 and box[lead] == 1:
            lead += 1
        if box[lead + 1 :] != shape[lead + 1 :]:  # a block of columns: not one stretch of its tensor
            single.append(item)
            continue
        builder = builders.get((name, dtype))
        if builder is None:
            builder = builders[name, dtype] = _Builder(name, dtype, _strides(shape))
        builder.add(sum(map(mul, at, builder.strides)), offset, piece.nbytes // dtype.itemsize)
    return [run for builder in builders.values() for run in builder.done()], single


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

    def __init__(self, name: str, dtype: torch.dtype, strides: tuple[int, ...]) -> None:
        self.name, self.dtype, self.itemsize, self.strides = name, dtype, dtype.itemsize, strides
        self.runs: list[Run] = []
        self.run: list[int] | None = None  # [start, wire, numel, segments, step, wire_step]
        self.segment: list[int] | None = None  # [start, wire, numel]

    def add(self, start: int, wire: int, numel: int) -> None:
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
            self.runs.append(Run(self.name, self.dtype, *run))
        self.run = [start, wire, numel, 1, 0, 0]

    def done(self) -> Iterator[Run]:
        if self.segment is not None:
            self._append(self.segment)
        if self.run is not None:
            self.runs.append(Run(self.name, self.dtype, *self.run))
        return iter(self.runs)


def run_views(run: Run, tensor: torch.Tensor, wire: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """``run``'s elements in its local ``tensor`` (contiguous) and in the message's bytes ``wire``: two views of
    (segments, numel), to copy one into the other (the copy casts between their dtypes)."""
    itemsize = run.dtype.itemsize
    typed = wire[run.wire : run.wire + (run.segments - 1) * run.wire_step + run.numel * itemsize].view(run.dtype)
    in_wire = typed.as_strided((run.segments, run.numel), (run.wire_step // itemsize, 1))
    in_tensor = tensor.as_strided((run.segments, run.numel), (run.step, 1), tensor.storage_offset() + run.start)
    return in_tensor, in_wire


__all__ = ["Run", "Where", "run_views", "runs"]
