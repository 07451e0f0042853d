"""A message's pieces as strided runs (``transfer.runs``): fewer copies, the same bytes.

Each case packs a message's pieces as a sender does (each piece's box, row-major, at its aligned offset), then
lands it twice: piece by piece (a view and a copy each, the executor's path before runs) and through the runs;
both must write the same bytes, the runs must be as few as the layout allows, and packing the landed tensors again
through the runs must give the message's bytes back.
"""

from __future__ import annotations

import random

import pytest
import torch

from shardcore.engine.transfer.pieces import Plain
from shardcore.engine.transfer.runs import run_views, runs
from shardcore.refit.boxes import fitted
from shardcore.refit.schedule import Message, Piece, aligned


def _message(pieces: list[tuple[str, tuple[int, ...], tuple[int, ...]]], tensors: dict[str, torch.Tensor]):
    """(name, shape, offset) per piece -> the message's (Piece, byte offset) and its bytes, filled with each
    piece's elements of a random source, as a sender packs them."""
    made, at, chunks = [], 0, []
    for name, shape, offset in pieces:
        tensor = tensors[name]
        values = torch.randn(shape).to(tensor.dtype)
        nbytes = values.numel() * values.element_size()
        made.append((Piece(name, shape, offset, offset, nbytes), at))
        chunk = torch.zeros(aligned(nbytes), dtype=torch.uint8)
        chunk[:nbytes] = values.reshape(-1).view(torch.uint8)
        chunks.append(chunk)
        at += aligned(nbytes)
    return made, torch.cat(chunks)


def _piece_by_piece(made, wire: torch.Tensor, tensors: dict[str, torch.Tensor]) -> None:
    for piece, offset in made:
        tensor = tensors[piece.destination]
        box = fitted(piece.shape, tensor.dim())
        view = tensor[tuple(slice(o, o + n) for o, n in zip(piece.dst_offset, box))]
        view.copy_(wire[offset : offset + piece.nbytes].view(tensor.dtype).view(view.shape))


def _where(tensors: dict[str, torch.Tensor]):
    return lambda tensor, target: (
        target or tensor,
        tuple(tensors[target or tensor].shape),
        tensors[target or tensor].dtype,
    )


def _by_runs(made, wire: torch.Tensor, tensors: dict[str, torch.Tensor]) -> tuple[int, int]:
    together, single = runs(made, _where(tensors), sending=False)
    for run in together:
        target, source = run_views(run, tensors[run.name], wire)
        target.copy_(source)
    _piece_by_piece(single, wire, tensors)
    return len(together), len(single)


def _packed_by_runs(made, size: int, tensors: dict[str, torch.Tensor]) -> torch.Tensor:
    """The message's bytes packed from ``tensors`` as a sender packs them with runs (the rest piece by piece)."""
    wire = torch.zeros(size, dtype=torch.uint8)
    together, single = runs(made, _where(tensors), sending=False)
    for run in together:
        source, target = run_views(run, tensors[run.name], wire)
        target.copy_(source)
    for piece, offset in single:
        _pack_alone(piece, offset, tensors, wire)
    return wire


def _pack_alone(piece: Piece, offset: int, tensors: dict[str, torch.Tensor], wire: torch.Tensor) -> None:
    """Copy ``piece``'s box of its tensor (at its ``dst_offset``: the tests' pieces have equal offsets at both ends)
    into ``wire`` at ``offset``, alone."""
    tensor = tensors[piece.destination]
    box = fitted(piece.shape, tensor.dim())
    view = tensor[tuple(slice(o, o + n) for o, n in zip(piece.dst_offset, box))]
    wire[offset : offset + piece.nbytes].view(tensor.dtype).view(view.shape).copy_(view)


def _landed_alike(pieces, shapes: dict[str, tuple[int, ...]], dtype: torch.dtype = torch.bfloat16) -> tuple[int, int]:
    one = {name: torch.zeros(shape, dtype=dtype) for name, shape in shapes.items()}
    other = {name: torch.zeros(shape, dtype=dtype) for name, shape in shapes.items()}
    made, wire = _message(pieces, one)
    _piece_by_piece(made, wire, one)
    counts = _by_runs(made, wire, other)
    for name in shapes:
        assert torch.equal(one[name].view(torch.uint8), other[name].view(torch.uint8)), name
    repacked = _packed_by_runs(made, wire.numel(), other)  # and back: a sender's runs give the message's bytes
    for piece, offset in made:
        assert torch.equal(repacked[offset : offset + piece.nbytes], wire[offset : offset + piece.nbytes])
    return counts


def test_experts_gate_up_and_down_land_as_one_run_per_tensor() -> None:
    """A MoE layer's experts from one sender: each expert's gate rows then up rows of ``w13_weight`` (one stretch
    once merged), then its ``w2_weight``: two runs for the whole layer, whatever the number of experts."""
    experts, ffn, hidden = 16, 8, 12
    pieces = []
    for e in range(experts):
        pieces.append(("w13", (1, ffn, hidden), (e, 0, 0)))
        pieces.append(("w13", (1, ffn, hidden), (e, ffn, 0)))
        pieces.append(("w2", (1, hidden, ffn), (e, 0, 0)))
    counts = _landed_alike(pieces, {"w13": (experts, 2 * ffn, hidden), "w2": (experts, hidden, ffn)})
    assert counts == (2, 0)


def test_a_column_block_lands_piece_by_piece() -> None:
    """Columns of a matrix are no stretch of it: those pieces are copied one by one, beside the runs."""
    pieces = [("a", (4, 3), (0, 3)), ("a", (4, 3), (4, 3)), ("b", (2, 6), (0, 0)), ("b", (2, 6), (2, 0))]
    counts = _landed_alike(pieces, {"a": (8, 6), "b": (4, 6)})
    assert counts == (1, 2)


def test_pieces_through_a_map_with_fewer_dims_than_their_tensor() -> None:
    """An expert's own 2-d box lands in a slot of a stacked 3-d tensor (unit dims on the left)."""
    pieces = [("w", (5, 4), (e, 0, 0)) for e in (0, 1, 2, 5, 6)]
    counts = _landed_alike(pieces, {"w": (8, 5, 4)})
    assert counts == (2, 0)  # 0-2 one progression, 5-6 another (the step breaks)


@pytest.mark.parametrize("seed", range(20))
def test_drawn_pieces_land_as_piece_by_piece(seed: int) -> None:
    """Random disjoint row and column blocks of a few tensors, in a random order: the same bytes either way."""
    draw = random.Random(seed)
    shapes = {"x": (draw.randint(1, 6), draw.randint(1, 9), draw.randint(1, 5)), "y": (draw.randint(2, 40), 3)}
    pieces = []
    for name, shape in shapes.items():
        rows = sorted(draw.sample(range(1, shape[0]), min(draw.randint(0, 4), shape[0] - 1)))
        for start, stop in zip([0, *rows], [*rows, shape[0]]):
            if len(shape) == 3 or draw.random() < 0.5:
                pieces.append((name, (stop - start, *shape[1:]), (start, *(0,) * (len(shape) - 1))))
            else:  # two column blocks of these rows
                cut = draw.randint(1, shape[1] - 1)
                pieces.append((name, (stop - start, cut), (start, 0)))
                pieces.append((name, (stop - start, shape[1] - cut), (start, cut)))
    draw.shuffle(pieces)
    dtype = draw.choice([torch.bfloat16, torch.float32, torch.float16])
    _landed_alike(pieces, shapes, dtype)


@pytest.mark.parametrize("seed", range(10))
def test_a_send_packs_its_runs_as_piece_by_piece(seed: int) -> None:
    """A sender packs whole tensors, row blocks, strided runs of a stacked tensor and column blocks, of two dtypes,
    with and without alignment gaps between them (``Plain.pack_pieces``: runs back to back in one call, the others
    one by one): its bytes are those of each piece copied alone."""
    draw = random.Random(seed)
    dtypes = [torch.bfloat16, torch.float32]
    sources = {
        f"e{k}": torch.randn(draw.randint(1, 4), draw.choice([4, 8, 5]), dtype=draw.choice(dtypes)) for k in range(12)
    }
    sources["stack"] = torch.randn(4, 6, 8, dtype=torch.bfloat16)
    sources["cols"] = torch.randn(6, 10, dtype=torch.float32)
    pieces = [(name, tuple(sources[name].shape), (0, 0)) for name in sources if name.startswith("e")]
    rows = sources["e0"].shape[0]
    if rows > 1:  # a row block of a tensor: a stretch, not the whole
        pieces[0] = ("e0", (rows - 1, sources["e0"].shape[1]), (1, 0))
    pieces += [("stack", (1, 3, 8), (e, 0, 0)) for e in range(4)]  # one strided run of four segments
    pieces += [("cols", (6, 4), (0, 3))]  # a block of columns: copied alone
    draw.shuffle(pieces)
    made, received = _message(pieces, sources)  # its pieces at aligned offsets (the bytes are not these)
    size = received.numel()
    message = Message((0, 0, 1, 0), 1, True, tuple(made), size)
    wire = torch.zeros(size, dtype=torch.uint8)
    Plain(sources=sources).pack_pieces(message, wire)
    expected = torch.zeros(size, dtype=torch.uint8)
    for piece, offset in made:
        _pack_alone(piece, offset, sources, expected)
    assert torch.equal(wire, expected)


@pytest.mark.parametrize("family", ["qwen3_moe", "deepseek_v3"])
def test_a_kinds_packed_boxes_make_the_runs_of_their_pieces(family: str) -> None:
    """An engine rank's messages hold each tensor's received boxes packed whole (``schedule.MessagePieces``); their
    runs, found once per kind, equal those found piece by piece from the same message: with some tensors cast on the
    way (``casts``: asked per tensor) and some local tensors whose pieces are copied alone."""
    from shardcore.refit.schedule import rank_batches
    from tests.core.test_refit_rows import engine_plan

    plan = engine_plan(family)
    shapes = {tensor.name: tensor.shape for tensor in plan.manifest}
    mine = plan.for_rank(2)
    local = mine.destination_shapes
    names = sorted(tensor.name for tensor in plan.manifest)
    casts, alone = set(names[::7]), set(sorted(local)[3::11])

    def where(tensor: str, target: str) -> tuple[str, tuple[int, ...], torch.dtype] | None:
        name = target or tensor
        return None if name in alone else (name, local[name], torch.float16 if tensor in casts else torch.bfloat16)

    received = [m for b in rank_batches(mine, 2, 6, 1 << 20, 8, shapes) for m in b.messages if m.pieces and not m.send]
    assert all(any(layout is not None for layout in m.pieces.layouts) for m in received)
    differ = 0
    for message in received:
        expected = runs(tuple(message.pieces), where, False)
        assert runs(message.pieces, where, False, casts) == expected
        differ += runs(message.pieces, where, False) != expected  # the casts matter: asked per local tensor, wrong
    assert differ
