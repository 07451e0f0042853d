"""Delta refits (issue 34): only the elements that changed since the version each destination holds travel, and
every destination stays bitwise equal to what a dense refit leaves there, through missed steps, failures,
restarts, fp8 conversion, fan-out and partial refits.

The live tests run 4-rank gloo worlds (a tp=2 source, two one-rank destinations) of a small bf16 model, and
compare every destination after every refit with its slice of the known global tensors, the bytes every dense
refit is checked against (``tests/engine/test_refit_execute.py``); one step of the first run is a dense refit.
"""

from __future__ import annotations

import random
from typing import Any

import pytest

pytest.importorskip("torch")

import torch

from shardcore import ExecuteOptions
from shardcore.engine.transfer.delta_codec import (
    BITMAP,
    DENSE,
    INDICES,
    apply_piece,
    changed_elements,
    cheapest,
    encode_piece,
    piece_bytes,
    write_encoding,
)
from shardcore.errors import RefitInputError
from shardcore.testing import run_world
from tests.engine import delta_workers as workers

# -- the encoding, on one process ------------------------------------------------------------------------


def _bytes(tensor: torch.Tensor) -> torch.Tensor:
    return tensor.contiguous().view(-1).view(torch.uint8)


def _encoded(after: torch.Tensor, before: torch.Tensor) -> tuple[int, int, torch.Tensor]:
    """``after`` encoded against a snapshot of ``before`` as the executor encodes a piece: (kind, changed elements,
    the bytes on the wire); the snapshot is then ``after``'s bytes, the next step's base."""
    snapshot = _bytes(before).clone()
    kind, count, parts = encode_piece(_bytes(after), snapshot, after.element_size())
    assert torch.equal(snapshot, _bytes(after))
    if parts is None:
        return kind, count, _bytes(after)
    out = torch.zeros(after.numel() * after.element_size() + 4096, dtype=torch.uint8)
    return kind, count, out[: write_encoding(out, *parts)]


def _changed(before: torch.Tensor, fraction: float, seed: int) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    chosen = torch.rand(before.shape, generator=generator) < fraction
    return torch.where(chosen, (before.float() + 1).to(before.dtype), before)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32, torch.float8_e4m3fn, torch.float16])
@pytest.mark.parametrize("fraction", [0.0, 0.001, 0.02, 0.3, 1.0])
def test_a_piece_encoded_and_applied_is_bitwise_the_new_piece(dtype: torch.dtype, fraction: float) -> None:
    before = torch.randn(67, 45).to(dtype)
    after = _changed(before, fraction, 3)
    itemsize = before.element_size()
    changed = changed_elements(_bytes(after), _bytes(before), itemsize)
    truth = torch.ne(_bytes(after).view(-1, itemsize), _bytes(before).view(-1, itemsize)).any(1).nonzero().view(-1)
    if changed is not None:
        assert torch.equal(changed.indices(), truth) and changed.count == truth.numel()
        assert torch.equal(changed.mask()[: after.numel()].nonzero().view(-1), truth)
    kind, count, wire = _encoded(after, before)
    assert kind == (DENSE if changed is None else cheapest(changed.count, after.numel(), itemsize))
    if kind != DENSE:
        assert count == truth.numel() and wire.numel() == piece_bytes(kind, count, after.numel(), itemsize)
    size = wire.numel()
    target = before.clone()
    assert apply_piece(target, wire, kind, count, dtype) is None
    assert torch.equal(_bytes(target), _bytes(after))
    if fraction == 0.001:
        assert kind == INDICES and size < after.numel() * itemsize // 10
    if fraction == 1.0:
        assert kind == DENSE


def test_a_piece_lands_in_a_strided_box_and_widens_where_the_refit_casts() -> None:
    before = torch.randn(40, 64).to(torch.bfloat16)
    after = _changed(before, 0.3, 5)
    kind, count, wire = _encoded(after, before)
    assert kind == BITMAP
    whole = torch.zeros(40, 100, dtype=torch.float32)
    whole[:, 10:74] = before.float()
    assert apply_piece(whole[:, 10:74], wire, kind, count, torch.bfloat16) is None  # strided, fp32
    assert torch.equal(whole[:, 10:74], after.float()) and not whole[:, :10].any() and not whole[:, 74:].any()


def test_the_cheapest_encoding_is_chosen_and_never_bigger_than_dense() -> None:
    elements = 1 << 20
    assert cheapest(elements // 1000, elements, 2) == INDICES
    assert cheapest(elements // 4, elements, 2) == BITMAP
    assert cheapest(elements, elements, 2) == DENSE
    for count in (0, 1, 100, elements // 16, elements // 2, elements):
        kind = cheapest(count, elements, 1)
        assert piece_bytes(kind, count, elements, 1) <= piece_bytes(DENSE, count, elements, 1)


def test_delta_options_are_checked_where_they_are_made() -> None:
    with pytest.raises(RefitInputError, match="delta=True too"):
        ExecuteOptions(anchor_every=4)
    with pytest.raises(RefitInputError, match="anchor_every"):
        ExecuteOptions(delta=True, anchor_every=0)
    with pytest.raises(RefitInputError, match="expected bools"):
        ExecuteOptions(delta="yes")  # type: ignore[arg-type]
    assert ExecuteOptions(delta=True, anchor_every=5, version=10).anchor
    assert not ExecuteOptions(delta=True, anchor_every=5, version=11).anchor
    assert ExecuteOptions().delta_terms == "off" != ExecuteOptions(delta=True).delta_terms


# -- live worlds -----------------------------------------------------------------------------------------------


def _ok_and_equal(results: list[list[dict[str, Any]]], failing: tuple[int, ...] = ()) -> None:
    """Every refit but ``failing`` succeeded on every rank and left every destination it wrote bitwise right."""
    for rank, seen in enumerate(results):
        for index, step in enumerate(seen):
            if index in failing:
                assert step["outcome"] != "ok", (rank, index)
                continue
            assert step["outcome"] == "ok" and not step["mismatches"], (rank, index, step)


def _received(results: list[list[dict[str, Any]]], index: int) -> tuple[int, int]:
    """Wire bytes and tensor bytes the destinations (ranks 2 and 3) received in refit ``index``."""
    return sum(results[r][index]["wire"] for r in (2, 3)), sum(results[r][index]["dense"] for r in (2, 3))


def test_a_hundred_optimizer_steps_at_two_percent_arrive_bitwise_as_a_tenth_of_the_bytes() -> None:
    results = run_world(4, workers.steps, {"fractions": [0.02] * 100, "events": {50: "dense"}}, timeout=600)
    _ok_and_equal(results)
    changed = [results[0][i]["changed"] for i in range(1, 100)]
    measured = sum(c for c, _ in changed) / sum(n for _, n in changed)
    assert 0.015 < measured < 0.025, measured  # about 2 % of the elements changed per step, as measured
    for index in range(1, 100):
        wire, dense = _received(results, index)
        if index in (50, 51):  # a dense refit, and the one after it (no snapshot holds its version)
            assert wire >= dense, (index, wire, dense)
        else:
            assert wire <= dense // 10, (index, wire, dense)
    first = results[0][0]
    assert first["snapshots"] == first["sent"]  # the sender keeps one copy of what it sends


def test_missed_steps_failures_restarts_subsets_and_reshaped_tensors_get_dense_pieces_never_wrong_bytes() -> None:
    events = {
        2: "miss",
        4: "fail",
        6: "fresh destination",
        8: "fresh sender",
        10: "subset",
        12: "reshaped",
    }
    results = run_world(4, workers.steps, {"fractions": [0.02] * 14, "events": events}, timeout=600)
    _ok_and_equal(results, failing=(4,))
    for rank in (0, 1, 2, 3):  # the failure is named everywhere, with its cause
        assert "injected: applying a delta failed" in results[rank][4]["outcome"], results[rank][4]
    assert results[3][2]["dense"] == 0 and results[3][3]["wire"] < results[3][3]["dense"] // 5  # two steps' delta
    assert _received(results, 5)[0] >= _received(results, 5)[1]  # after the failure: dense
    assert results[3][6]["wire"] >= results[3][6]["dense"] > results[2][6]["wire"] * 5  # the new engine: dense
    assert results[0][8]["sent_wire"] >= results[0][8]["sent"] > results[1][8]["sent_wire"] * 5  # new sender
    assert _received(results, 11)[0] < _received(results, 11)[1] // 10  # after the subset: delta again
    assert _received(results, 13)[0] < _received(results, 13)[1] // 10  # after the reshape: delta again


def test_fp8_conversion_sends_the_delta_of_the_quantized_bytes_and_its_scales() -> None:
    events = {3: "miss", 5: "fail"}
    for scale in ("block", "tensor"):
        run = {"fractions": [0.002] * 8, "events": events, "conversion": ("float8_e4m3fn", scale)}
        results = run_world(4, workers.steps, run, timeout=600)
        _ok_and_equal(results, failing=(5,))
        wire, dense = _received(results, 2)
        assert wire < dense // 2, (scale, wire, dense)


def test_a_random_mix_of_changed_fractions_is_bitwise_every_time_with_anchors_and_checksums() -> None:
    chooser = random.Random(34)
    fractions = [chooser.choice([0.0, 0.001, 0.02, 0.3, 1.0]) for _ in range(30)]
    run = {"fractions": fractions, "options": {"anchor_every": 7, "delta_checksum": True}}
    results = run_world(4, workers.steps, run, timeout=600)
    _ok_and_equal(results)
    for index in range(1, 30):
        wire, dense = _received(results, index)
        if (index + 1) % 7 == 0:  # an anchor: a full refit
            assert wire >= dense, index
        elif fractions[index] == 0.0:
            assert wire < dense // 100, index


def test_relays_forward_a_delta_too_and_every_message_matches_its_senders_checksum() -> None:
    run = {
        "fractions": [0.02] * 4,
        "planner": {"ranks_per_node": 2, "fan_out": True},
        "options": {"verify": "checksum"},
    }
    results = run_world(4, workers.steps, run, timeout=600)
    _ok_and_equal(results)
    relay = next(rank for rank in (2, 3) if results[rank][0]["sent"])  # the destination that forwards
    assert results[relay][3]["sent_wire"] < results[relay][3]["sent"] // 10


def test_a_base_changed_behind_the_refits_back_is_a_typed_error_naming_the_tensor_with_the_checksum() -> None:
    run = {"fractions": [0.02] * 4, "events": {2: "behind its back"}, "options": {"delta_checksum": True}}
    results = run_world(4, workers.steps, run, timeout=600)
    _ok_and_equal(results, failing=(2,))
    assert results[2][2]["outcome"].startswith("RefitIntegrityError"), results[2][2]
    assert "decoder.layers.0.mlp.linear_fc1.weight" in results[2][2]["outcome"], results[2][2]


def test_a_delta_refit_without_a_version_is_refused_on_every_rank_before_a_byte_moves() -> None:
    for outcome in run_world(4, workers.without_version, timeout=120):
        assert outcome.startswith("RefitInputError") and "delta=True needs version=" in outcome, outcome
