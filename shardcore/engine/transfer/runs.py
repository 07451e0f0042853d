"""A received message's pieces as strided runs: one copy for many pieces.

A message can carry tens of thousands of small pieces: an engine rank of a MoE model receives, from each training
rank, every expert's gate rows, up rows and down columns, a few hundred bytes to a few MB each. One copy per piece
costs the receiver's CPU a view and a copy's dispatch each, ~10 us, whatever its size. Pieces that lie one after
the other in their tensor and in the message merge into one segment (an expert's gate rows, then its up rows, of
``w13_weight``), and segments of one size whose starts step alike in the tensor and in the message (expert after
expert) form a run, copied with one strided view on each side (``Tensor.as_strided``). What is not contiguous in
its tensor (a column block) is copied piece by piece, as before.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator, Sequence
from typing import TYPE_CHECKING, NamedTuple

from ...refit.boxes import fitted
from ...refit.schedule import Piece

if TYPE_CHECKING:
    import torch


class Run(NamedTuple):
    """``segments`` segments of ``numel`` elements of local tensor ``name``, each ``step`` elements after the last there
    and ``wire_step`` bytes after the last in the message, travelling in ``dtype``.

    Attributes:
        name: The local tensor.
        dtype: The dtype the elements travel in (the copy casts them into the tensor's).
        start: The first segment's first element, from the tensor's own first (not its storage's).
        wire: The first segment's byte offset in the message.
        numel: Elements per segment.
        segments: Segments.
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


def runs(
    pieces: Sequence[tuple[Piece, int]],
    shape_of: Callable[[str], tuple[int, ...]],
    dtype_of: Callable[[Piece], torch.dtype],
) -> tuple[list[Run], list[tuple[Piece, int]]]:
    """A message's received ``pieces`` (with their byte offsets) as runs, and the pieces that join none (not one
    stretch of their tensor: a block of columns), in their order. The local tensors are contiguous (``execute_refit``
    checks the destinations; a staging copy is made so), so the runs depend on the plan's part alone, and a
    schedule keeps them for its next refits (``Schedule.runs``).

    Args:
        pieces: The message's pieces and their offsets.
        shape_of: The shape of the local tensor a piece lands in, by name.
        dtype_of: The dtype a piece travels in.
    """
    strides_of: dict[str, tuple[tuple[int, ...], tuple[int, ...]]] = {}
    builders: dict[tuple[str, torch.dtype], _Builder] = {}
    single: list[tuple[Piece, int]] = []
    for item in pieces:
        piece, offset = item
        name = piece.target or piece.tensor
        known = strides_of.get(name)
        if known is None:
            shape = shape_of(name)
            known = strides_of[name] = (shape, _strides(shape))
        shape, strides = known
        box = piece.shape if len(piece.shape) == len(shape) else fitted(piece.shape, len(shape))
        lead = 0
        while lead < len(box) - 1 and box[lead] == 1:
            lead += 1
        if box[lead + 1 :] != shape[lead + 1 :]:  # a block of columns: not one stretch of its tensor
            single.append(item)
            continue
        dtype = dtype_of(piece)
        builder = builders.get((name, dtype))
        if builder is None:
            builder = builders[name, dtype] = _Builder(name, dtype)
        start = sum(o * s for o, s in zip(piece.dst_offset, strides))
        builder.add(start, offset, piece.nbytes // dtype.itemsize)
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

    def __init__(self, name: str, dtype: torch.dtype) -> None:
        self.name, self.dtype, self.itemsize = name, dtype, dtype.itemsize
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


def copy_run(run: Run, tensor: torch.Tensor, wire: torch.Tensor) -> None:
    """Copy ``run`` from the message's bytes ``wire`` into its local ``tensor`` (contiguous), casting as it goes."""
    itemsize = run.dtype.itemsize
    typed = wire[run.wire : run.wire + (run.segments - 1) * run.wire_step + run.numel * itemsize].view(run.dtype)
    source = typed.as_strided((run.segments, run.numel), (run.wire_step // itemsize, 1))
    target = tensor.as_strided((run.segments, run.numel), (run.step, 1), tensor.storage_offset() + run.start)
    target.copy_(source)


__all__ = ["Run", "copy_run", "runs"]
