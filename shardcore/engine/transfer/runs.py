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
from typing import TYPE_CHECKING, Any, NamedTuple

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


Where = Callable[[Piece], "tuple[str, tuple[int, ...], torch.dtype] | None"]
"""Where a piece's tensor lies on this rank: (its local tensor, that tensor's shape, the dtype the piece travels
in), or None when each of its pieces must be copied alone (quantized on its way out). Asked once per (tensor,
target) of a message: it depends on them alone."""


def runs(pieces: Sequence[tuple[Piece, int]], where: Where, sending: bool) -> tuple[list[Run], list[tuple[Piece, int]]]:
    """A message's ``pieces`` (with their byte offsets) as runs, and the pieces that join none (not one stretch of
    their tensor, a block of columns; or copied alone), in their order. The local tensors are contiguous
    (``execute_refit`` checks them; a staging copy is made so), so the runs depend on the plan's part alone, and a
    schedule keeps them for its next refits (``Schedule.runs``). A message can hold tens of thousands of pieces, so
    what depends on a piece's tensor (``where``) or on its shape in that tensor is found once per message.

    Args:
        pieces: The message's pieces and their offsets.
        where: Where each piece's tensor lies on this rank (``Where``).
        sending: Whether the pieces are read from this rank's tensors at their ``src_offset`` (a send), or
            written at their ``dst_offset`` (a receive).
    """
    builders: dict[tuple[str, torch.dtype], _Builder] = {}
    of_tensor: dict[tuple[str, str], _Builder | None] = {}
    single: list[tuple[Piece, int]] = []
    for item in pieces:
        piece, offset = item
        key = (piece.tensor, piece.target)
        builder = of_tensor.get(key, _UNSEEN)
        if builder is _UNSEEN:
            builder = of_tensor[key] = _builder(builders, where(piece))
        if builder is None or not builder.stretch(piece.shape):  # copied alone, or a block of columns
            single.append(item)
            continue
        at = piece.src_offset if sending else piece.dst_offset
        builder.add(sum(map(mul, at, builder.strides)), offset, piece.nbytes)
    return [run for builder in builders.values() for run in builder.done()], single


def _builder(
    builders: dict[tuple[str, torch.dtype], _Builder], found: tuple[str, tuple[int, ...], torch.dtype] | None
) -> _Builder | None:
    """The builder of the runs of a piece's tensor where it lies (``found``, a ``Where``'s answer; None: none)."""
    if found is None:
        return None
    name, shape, dtype = found
    builder = builders.get((name, dtype))
    if builder is None:
        builder = builders[name, dtype] = _Builder(name, dtype, shape)
    return builder


_UNSEEN: Any = object()
"""``runs``' mark of a (tensor, target) not yet looked up (None is an answer: copied alone)."""


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

    def __init__(self, name: str, dtype: torch.dtype, shape: tuple[int, ...]) -> None:
        self.name, self.dtype, self.itemsize, self.shape = name, dtype, dtype.itemsize, shape
        self.strides = _strides(shape)
        self.stretches: dict[tuple[int, ...], bool] = {}
        self.runs: list[Run] = []
        self.run: list[int] | None = None  # [start, wire, numel, segments, step, wire_step]
        self.segment: list[int] | None = None  # [start, wire, numel]

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

    def add(self, start: int, wire: int, nbytes: int) -> None:
        """A stretch of ``nbytes`` from element ``start`` of the tensor, at byte ``wire`` of the message."""
        segment = self.segment
        if segment is not None and start == segment[0] + segment[2] and wire == segment[1] + segment[2] * self.itemsize:
            segment[2] += nbytes // self.itemsize
            return
        if segment is not None:
            self._append(segment)
        self.segment = [start, wire, nbytes // self.itemsize]

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
