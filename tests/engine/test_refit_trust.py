"""Refit you can trust (issue 20), on live gloo worlds: agreement before a byte moves, every message checked,
recovery after any one-rank failure, versions, parameters, and rounds bounded for NCCL.

Background: NCCL's batched point-to-point hazards are pytorch/pytorch#174288 (hangs with ~1,000 ops per
batch) and NVIDIA/nccl#2130 (asymmetric batches); https://github.com/pytorch/pytorch/pull/174942 proposed
chunking at 256 ops with a symmetric round-robin pairing.
"""

from __future__ import annotations

import multiprocessing
import queue

import pytest

pytest.importorskip("torch")

from shardcore.engine.live.ports import free_port
from shardcore.testing import run_world
from tests.engine import trust_workers as workers

TIMEOUT = 8.0


def test_a_rank_with_another_plan_is_named_with_what_differs_and_no_byte_moves() -> None:
    """Before: every rank returned success and some destinations held wrong bytes."""
    results = run_world(4, workers.disagreeing_plans, timeout=300)
    for rank, out in enumerate(results):
        kind, message, ranks, _ = out["destination"]
        assert kind == "RefitMismatchError" and ranks == (3,), (rank, out["destination"])
        assert "ranks [3] (1 rank) have destinations" in message and "'tp=2'" in message, message
        kind, message, ranks, _ = out["manifest"]
        assert kind == "RefitMismatchError" and ranks == (2,), (rank, out["manifest"])
        assert "manifest 'tiny-moe" in message and "tiny-dense" in message, message
        kind, message, ranks, _ = out["version"]
        assert kind == "RefitMismatchError" and ranks == (1,) and "version 5" in message, (rank, message)
        assert out["destination untouched"] and out["manifest untouched"], rank
        assert out["after"][0] == "ok" and out["after correct"], (rank, out["after"])


def test_after_each_kind_of_failure_the_next_refit_succeeds_everywhere() -> None:
    """Before: refits were numbered by a counter in each process, so one rank's failure (a bad argument, a
    skipped call) shifted its number and every later refit failed on every rank; an exception in the middle
    of the exchange left the others waiting the full timeout."""
    results = run_world(4, workers.one_failure_each, TIMEOUT, timeout=600)
    by_label = [{step["label"]: step for step in steps} for steps in results]
    for rank, steps in enumerate(by_label):
        for label in ("good 1", "good 3", "good 5", "good 7"):
            assert steps[label]["kind"] == "ok" and steps[label]["correct"], (rank, label, steps[label])
        bad = steps["bad argument"]
        assert bad["kind"] == "RefitInputError" and "bucket_bytes=1" in bad["message"] and "rank 2" in bad["message"]
        assert bad["elapsed"] < TIMEOUT, bad
        if rank != 1:
            skipped = steps["skipped"]
            assert skipped["kind"] == "RefitPeerError" and skipped["ranks"] == (1,), skipped
        failed = steps["exception"]
        assert failed["kind"] in ("RefitPeerError", "RefitInputError"), failed
        assert "rank 0" in failed["message"] and "injected failure" in failed["message"], failed
        assert failed["elapsed"] < TIMEOUT, failed  # published at once: nobody waits out the timeout
    for rank in (2, 3):  # the destination ranks: versions kept across failures
        steps = by_label[rank]
        assert steps["good 1"]["held"] == (1, True) and steps["bad argument"]["held"] == (1, True), steps
        assert steps["good 5"]["held"] == (5, True) and steps["good 7"]["held"] == (7, True), steps
        held = steps["exception"]["held"]
        assert held is None or held.intact is False, held  # fresh tensors, partly written by the failed refit


def test_a_rank_without_staging_memory_fails_every_rank_at_once_and_the_next_refit_works() -> None:
    """Before: a rank whose staging allocation failed drained, then raised a raw TypeError at its first staged
    message (the buffer was None), and its peers waited for messages it never posted."""
    for rank, (failed, good) in enumerate(run_world(4, workers.staging_that_cannot_be_allocated, TIMEOUT, timeout=300)):
        assert failed["kind"] in ("RefitPeerError", "RefitInputError"), (rank, failed)
        assert "rank 2" in failed["message"] and failed["elapsed"] < TIMEOUT, (rank, failed)
        assert "TypeError" not in failed["message"], (rank, failed)
        assert good["kind"] == "ok" and good["correct"], (rank, good)


def test_parameters_are_written_in_place_and_keep_requiring_grad() -> None:
    """Before: a destination that is an nn.Parameter raised a raw RuntimeError on its rank."""
    for rank, out in enumerate(run_world(4, workers.parameters, timeout=300)):
        assert out["correct"] and out["requires_grad"], (rank, out)
        if rank >= 2:
            assert out["version"] == 3 and out["held"] == (3, True), out


@pytest.mark.parametrize("mode", ["corrupt", "short"])
def test_a_faulty_message_is_named_by_its_sender_receiver_and_tensor(mode: str) -> None:
    """Before: gloo took a shorter message for a longer receive, and nobody checked what arrived."""
    results = run_world(4, workers.faulty_message, mode, timeout=300)
    kind, message, ranks, _ = results[2]
    assert kind == "RefitIntegrityError" and ranks == (0,), results[2]
    assert "rank 2 received from rank 0 a message of" in message, message
    what = "does not match the checksum its sender computed" if mode == "corrupt" else "bytes as sent"
    assert what in message, message
    for rank in (0, 1, 3):
        kind, message, ranks, _ = results[rank]
        assert kind == "RefitPeerError" and "RefitIntegrityError" in message and "rank 2" in message, results[rank]


def test_a_failure_with_two_batches_in_flight_drains_names_the_rank_and_the_next_refit_works() -> None:
    """Rank 2 fails while it unpacks one batch and the next is already on the wire: every rank still completes
    every batch (the failing one drains), names rank 2 within the timeout, and the next refit is bitwise."""
    results = run_world(4, workers.failing_with_two_in_flight, TIMEOUT, timeout=300)
    assert results[2]["ahead"], "no batch was posted ahead at this bucket: the case does not test two in flight"
    for rank, out in enumerate(results):
        kind, message, ranks, elapsed = out["failed"]
        assert kind == "RefitPeerError" and 2 in ranks and "injected failure" in message, (rank, out["failed"])
        assert elapsed < TIMEOUT, (rank, elapsed)  # drained, not timed out
        assert out["after"][0] == "ok" and out["correct"], (rank, out["after"])
        assert out["batches"] > 2, out


def test_a_plan_of_over_100000_transfers_runs_in_bounded_batches() -> None:
    results = run_world(16, workers.many_transfers, 13_000, timeout=900)
    assert sum(out["transfers"] for out in results) > 100_000
    for rank, out in enumerate(results):
        assert out["correct"], rank
        if out["messages"]:
            assert out["messages"] <= out["batches"] * 256, out


def test_a_dead_peer_that_was_replaced_does_not_break_the_next_refit() -> None:
    """The survivors re-form the world with a new process in the dead rank's place; refits are numbered by the
    store, so nothing any survivor remembers can shift the next one."""
    context = multiprocessing.get_context("spawn")
    results = context.Queue()
    ports = (free_port(), free_port())
    world = 4
    processes = [
        context.Process(target=workers.replaced_world_rank, args=(rank, world, ports, 1, results), daemon=True)
        for rank in range(world)
    ]
    for process in processes:
        process.start()
    processes[-1].join(120)
    assert processes[-1].exitcode == 17
    replacement = context.Process(
        target=workers.replaced_world_rank, args=(world - 1, world, ports, 2, results), daemon=True
    )
    replacement.start()
    seen = {}
    try:
        while len(seen) < world:
            rank, generation, first, second, correct = results.get(timeout=180)
            seen[rank] = (generation, first, second, correct)
    except queue.Empty:
        pytest.fail(f"ranks {sorted(set(range(world)) - set(seen))} never reported")
    finally:
        for process in [*processes, replacement]:
            process.join(10)
            if process.is_alive():
                process.kill()
    for rank in range(world - 1):
        generation, first, second, correct = seen[rank]
        assert first[0] == "RefitPeerError" and 3 in first[2], (rank, first)
        assert second[0] == "ok" and correct, (rank, second)
    generation, _, second, correct = seen[world - 1]
    assert generation == 2 and second[0] == "ok" and correct


@pytest.mark.parametrize("size", [4096 * 8, 4096 * 8 + 4, 4096 * 8 + 3, 100])  # int64, int32 and byte words
def test_the_checksum_sees_a_flipped_bit_swapped_words_and_a_short_message(size: int) -> None:
    import torch

    from shardcore.engine.transfer.exchange import checksum

    data = torch.randint(0, 256, (size,), dtype=torch.uint8, generator=torch.Generator().manual_seed(size))
    good = checksum(data)
    assert checksum(data.clone()) == good
    flipped = data.clone()
    flipped[size // 2] ^= 1
    swapped = data.clone()
    swapped[0:8], swapped[8:16] = data[8:16].clone(), data[0:8].clone()
    assert not torch.equal(swapped, data)
    assert len({good, checksum(flipped), checksum(swapped), checksum(data[:-1]), checksum(data[:-8])}) == 5
