"""Refit execution on live gloo worlds: every destination byte equals the source's, bitwise; bad inputs and
dead or absent ranks end every rank within the timeout with a typed error naming the rank at fault."""

from __future__ import annotations

import re

import pytest

pytest.importorskip("torch")

from shardcore.testing import run_world
from tests.engine import refit_workers as workers

TIMEOUT = 8.0
MARGIN = 6.0  # store round trips, gloo teardown, a loaded 2-core machine


@pytest.mark.parametrize("bucket_bytes", [1 << 16, 64 << 20])
def test_eight_rank_cases_arrive_bitwise(bucket_bytes: int) -> None:
    results = run_world(8, workers.run_cases, workers.CASES_8, bucket_bytes, timeout=600)
    for index, case in enumerate(workers.CASES_8):
        reports = [results[rank][index] for rank in range(8)]
        assert not [m for r in reports for m in r["mismatches"]], case[0]
        destination_ranks = [r for r in reports if r["shard"] is not None]
        assert destination_ranks and all(r["checked"] for r in destination_ranks), case[0]
        sent, received = sum(r["bytes_sent"] for r in reports), sum(r["bytes_received"] for r in reports)
        assert sent == received, case[0]
        if case[4] is None:  # disaggregated: nothing is local
            assert sum(r["bytes_copied"] for r in reports) == 0 and received > 0, case[0]
        else:
            assert sum(r["bytes_copied"] for r in reports) > 0, case[0]


def test_bad_inputs_are_one_typed_error_everywhere_before_any_byte() -> None:
    results = run_world(4, workers.bad_inputs, timeout=300)
    for rank, out in enumerate(results):
        assert out["shape"].startswith("RefitInputError"), (rank, out["shape"])
        assert (
            "rank 0:" in out["shape"]
            and "'decoder.layers.0.mlp.linear_fc2.weight' has shape [128, 512]" in out["shape"]
            and "expected [128, 256]" in out["shape"]
        )
        assert "'decoder.layers.1.self_attention.linear_qkv.weight' is missing" in out["missing"]
        assert "expected local shape [192, 128]" in out["missing"] and "rank 3:" in out["missing"]
        assert "torch.float16, expected torch.float32" in out["dtype"]
        assert "rank 3: tensors are on several devices (cpu, meta)" in out["devices"], out["devices"]
        assert "rank 3: tensors are on meta but the refit's group (gloo) moves tensors on cpu" in out["library"]
        assert "rank 3: tensors are on several devices (cpu, meta)" in out["source's device"], out["source's device"]
        labels = ("shape", "missing", "dtype", "many", "devices", "library", "source's device")
        assert all(out[f"{label} untouched"] == "True" for label in labels), out
        many = out["many"]  # every destination of rank 3 misshapen: its own error in full, the others' shortened
        assert many.startswith(f"RefitInputError: rank {rank}:") and "\n" not in many, many
        if rank == 3:
            assert "; and " in many and " more" in many and len(many) > 500, many
            continue
        said = many.split("rank 3 failed: ", 1)[1].split(" (at 'open' of refit", 1)[0]
        *whole, rest = said.split("; ")
        assert re.fullmatch(r"\.\.\. \(\d+ more left out\)", rest), said  # whole items, then what was left out
        assert whole and all(re.search(r"has shape \[[\d, ]+\], expected \[[\d, ]+\]$", item) for item in whole), said
        assert len(said) <= 500, said


def _within(elapsed: float) -> None:
    assert elapsed < TIMEOUT + MARGIN, f"took {elapsed:.1f}s, over the {TIMEOUT:g}s timeout + {MARGIN:g}s"


def test_destination_rank_killed_mid_transfer_is_named_by_every_other_rank() -> None:
    results = run_world(4, workers.killed_mid_transfer, 2, TIMEOUT, allow_failures=True, timeout=120)
    assert results[2] == "died (exit code 17)"
    for rank in (0, 1, 3):
        kind, message, ranks, elapsed = results[rank]
        assert kind == "RefitPeerError", (rank, results[rank])
        assert ranks == (2,) and "2" in message, (rank, message)
        _within(elapsed)


def test_rank_that_never_calls_execute_is_named() -> None:
    results = run_world(4, workers.absent, 1, TIMEOUT, allow_failures=True, timeout=120)
    for rank in (0, 2, 3):
        kind, message, ranks, elapsed = results[rank]
        assert kind == "RefitPeerError" and ranks == (1,), (rank, results[rank])
        assert "ranks [1] (1 rank) did not reach 'open' of refit" in message, message
        _within(elapsed)


def _slab(transfer: object) -> int:
    """Bytes of one step along a transfer's first dim with extent > 1: the least a cut piece can be."""
    shape = [stop - start for start, stop in transfer.box]  # type: ignore[attr-defined]
    return transfer.bytes // next((n for n in shape if n > 1), 1)  # type: ignore[attr-defined]


def test_staging_stays_within_bucket_bytes_on_a_live_world() -> None:
    cases = [workers.CASES_8[0], workers.CASES_8[-1]]  # collocated tp 8->2 (row-parallel strides), bf16 to two shards
    for bucket_bytes in (1 << 14, 64 << 20):
        results = run_world(8, workers.staging_peaks, cases, bucket_bytes, timeout=600)
        for index, case in enumerate(cases):
            plan = workers._plan(8, case)
            for rank, per_case in enumerate(results):
                peak, messages, matched = per_case[index]
                mine = plan.for_rank(rank)
                largest = max((_slab(t) for t in (*mine.sends, *mine.recvs)), default=0)
                assert matched, (case[0], rank)
                assert peak <= bucket_bytes + largest, (case[0], rank, peak, bucket_bytes)
                assert (messages > 0) == bool(mine.sends or mine.recvs), (case[0], rank)
                if bucket_bytes == 64 << 20:
                    assert peak <= bucket_bytes, (case[0], rank, peak)


def test_fan_out_floor_and_partial_refits_arrive_bitwise() -> None:
    """Fan-out (relays forward from their destinations in a second hop), a floor and subsets, executed on one
    live world at a small bucket (many batches per hop) and the default: every destination byte checked."""
    from shardcore.refit import RefitStats

    buckets = [1 << 16, 64 << 20]
    results = run_world(8, workers.run_cases_each_bucket, workers.CASES_OPTIONS_8, buckets, timeout=900)
    for index, case in enumerate(workers.CASES_OPTIONS_8):
        plan = workers._plan(8, case)
        stats = RefitStats.of(plan)
        if plan.fan_out:
            assert stats.relayed_bytes > 0 and stats.inter_node_bytes < stats.inter_node_bytes_without_fan_out, case[0]
        for bucket, per_bucket in enumerate(buckets):
            reports = [results[rank][bucket][index] for rank in range(8)]
            assert not [m for r in reports for m in r["mismatches"]], (case[0], per_bucket)
            checked = [r for r in reports if r["shard"] is not None]
            assert checked and all(r["checked"] for r in checked), case[0]
            if plan.tensors is not None:  # a partial refit checks and moves its tensors only
                assert sum(r["checked"] for r in checked) == sum(
                    len(plan.for_rank(r).destination_shapes) for r in range(8)
                )
            assert (
                sum(r["bytes_received"] for r in reports) == sum(r["bytes_sent"] for r in reports) == stats.total_bytes
            )


def test_a_partial_refit_writes_its_tensors_only_and_ranks_must_agree_on_it() -> None:
    results = run_world(4, workers.partial_refits, timeout=300)
    for rank, out in enumerate(results):
        assert out["mixed"].startswith("RefitMismatchError"), (rank, out["mixed"])
        assert "a subset of" in out["mixed"], out["mixed"]
        assert out["untouched after mixed"], rank
        assert not out["wrong"], (rank, out["wrong"])
        if rank >= 2:  # the destination ranks
            assert out["written"] and out["kept"] and out["bytes_received"] > 0, (rank, out)


def test_a_second_refit_of_a_plan_lands_in_its_own_tensors() -> None:
    for rank, out in enumerate(run_world(4, workers.refit_again_into_other_tensors, timeout=300)):
        assert all(out.values()), (rank, out)


def test_a_refit_in_a_session_of_its_own_keeps_its_state_apart_from_the_default_one() -> None:
    for rank, out in enumerate(run_world(4, workers.refits_in_two_sessions, timeout=300)):
        if out["has destinations"]:
            assert out["default"] == (1, True) and out["own"] == (2, True), (rank, out)
        assert out["default schedule kept"] and out["own schedule"] and out["correct"], (rank, out)


def test_parts_that_disagree_stop_every_rank_before_a_byte_moves_naming_the_pair() -> None:
    """Before the tally, a send one end did not expect reached the wire: gloo aborts a receiver on a size mismatch,
    NCCL hangs or writes wrong bytes."""
    results = run_world(4, workers.parts_disagree, 0, timeout=300)
    sender, receiver = results[0]["dropped"]
    for rank, out in enumerate(results):
        assert out["error"].startswith("RefitMismatchError"), (rank, out["error"])
        assert "parts of the plan disagree" in out["error"] and "no byte moved" in out["error"], out["error"]
        assert out["untouched"] and out["then correct"], (rank, out)
        assert out["seconds"] < 30, (rank, out["seconds"])  # at the first meeting, not at the timeout
        assert f"{sender}->{receiver}: rank {sender} sends" in out["error"], out["error"]  # every rank hears it
        assert out["ranks"] == [sender, receiver], out
        if rank not in (sender, receiver):
            assert f"not on this rank's own pairs; ranks [{sender}, {receiver}]" in out["error"], out["error"]
