"""Refits between two jobs, each with its own world (a trainer of 4 ranks, an engine of 4 workers), over a refit
group of their own: every destination byte right, 20 refits in a row; a dead worker named in time with the
trainer's world still working; a restarted engine refit whole; a second engine beside the first; bad input one
typed error within the timeout, and parts of a plan that disagree named on both sides before a byte moves."""

from __future__ import annotations

import json
import time
from pathlib import Path

import pytest

pytest.importorskip("torch")

from shardcore.engine.live.ports import free_port
from shardcore.testing import run_jobs
from tests.engine import group_workers as workers

TIMEOUT = 8.0
MARGIN = 6.0  # store round trips, gloo teardown, a loaded 2-core machine


@pytest.fixture
def config(tmp_path: Path) -> str:
    path = tmp_path / "config.json"
    path.write_text(json.dumps(workers.CONFIG))
    return str(path)


def _within(elapsed: float, timeout: float = TIMEOUT) -> None:
    assert elapsed < timeout + MARGIN, f"took {elapsed:.1f}s, over the {timeout:g}s timeout + {MARGIN:g}s"


def test_twenty_refits_across_jobs_arrive_bitwise_and_a_second_engine_joins(config: str) -> None:
    address = f"127.0.0.1:{free_port()}"
    trainer, engine, second = run_jobs(
        [
            (4, workers.trainer_refits, (address, config, 20, 60.0)),
            (4, workers.engine_refits, (address, config, 20, 60.0)),
            (2, workers.second_engine, (address, config, 60.0)),
        ],
        timeout=300,
    )
    for rank, out in enumerate(engine):
        assert out["group_rank"] == 4 + rank
        assert out["before"] is None and out["checked"] > 0, out
        assert out["wrong"] == [], (rank, out["wrong"][:3])
        assert out["versions"] == [(step, True) for step in range(20)], out["versions"]
        assert out["kept_wrong"] == [] and out["kept_version"] == (19, True), out  # untouched by engine b's refit
        assert out["world"] == 4.0  # the engine's own world serves on
    for out in second:
        assert out["wrong"] == [] and out["version"] == (100, True), out
    for out in trainer:
        assert all(moved > 0 for moved in out["moved"]) and len(out["moved"]) == 20
        assert out["world"] == 4.0


def test_a_dead_worker_or_trainer_rank_is_named_in_time_and_a_restarted_engine_is_refit_whole(
    config: str, tmp_path: Path
) -> None:
    address = f"127.0.0.1:{free_port()}"
    flag = str(tmp_path / "restart")
    trainer, killed, restarted = run_jobs(
        [
            (4, workers.trainer_through_restart, (address, config, flag, TIMEOUT)),
            (4, workers.engine_killed, (address, config, TIMEOUT)),
            (4, workers.engine_restarted, (address, config, flag, TIMEOUT)),
        ],
        timeout=300,
        allow_failures=True,
    )
    victim = 4 + workers.VICTIM
    assert killed[workers.VICTIM] == "died (exit code 17)"
    assert trainer[workers.LEAVER] == "died (exit code 17)"
    for rank, out in enumerate(trainer):
        if rank == workers.LEAVER:
            continue
        kind, message, ranks, elapsed = out["fault"]
        assert kind == "RefitPeerError" and ranks == (victim,), (rank, out["fault"])
        assert f"rank {victim} is engine rank {workers.VICTIM}" in message and "\n" not in message, message
        _within(elapsed)
        assert out["world"] == 6.0  # 0 + 1 + 2 + 3 on the trainer's own world, after the fault
        assert out["after"][0] == "ok", out["after"]
        first, second = out["generations"]
        assert second > first
        assert out["left"][0] == "RefitPeerError" and workers.LEAVER in out["left"][2], out["left"]
    for rank, out in enumerate(killed):
        if rank != workers.VICTIM:
            kind, message, ranks, elapsed = out
            assert kind == "RefitPeerError" and victim in ranks, (rank, out)
            assert f"rank {victim} is engine rank {workers.VICTIM}" in message, message
            _within(elapsed)
    for out in restarted:
        assert out["before"] is None and out["wrong"] == [] and out["version"] == (2, True), out
        assert out["world"] == 4.0
        kind, message, ranks, elapsed = out["left"]  # the trainer's rank that went away, named here in time
        assert kind == "RefitPeerError" and ranks == (workers.LEAVER,), out["left"]
        assert f"rank {workers.LEAVER} is trainer rank {workers.LEAVER}" in message, message
        _within(elapsed)


def test_bad_input_is_one_typed_error_within_the_timeout() -> None:
    address = f"127.0.0.1:{free_port()}"
    timeout = 20.0  # every error here is immediate; the copy job waits for the trainer's two rounds and two starts
    trainer, engine, copy = run_jobs(
        [
            (2, workers.bad_trainer, (address, timeout)),
            (2, workers.bad_engine, (address, timeout, False)),
            (2, workers.bad_engine, (address, timeout, True)),
        ],
        timeout=120,
    )
    for out in trainer + engine:  # counts that disagree: named on both sides, at once
        kind, message, _, elapsed = out["counts"]
        assert kind == "RefitGroupError" and "\n" not in message, message
        assert "trainer_ranks=3" in message and "trainer_ranks=2" in message, message
        _within(elapsed, timeout)
    twice = [out["twice"] for out in engine + copy if out["twice"][0] != "ok"]
    assert len(twice) == 2, (engine, copy)  # one engine job's two ranks: the other holds them
    for kind, message, _, elapsed in twice:
        assert kind == "RefitGroupError" and "twice" in message and "already holds engine rank" in message, message
        _within(elapsed, timeout)
    for out in trainer:
        assert out["twice"][0] == "ok", out["twice"]
        kind, message, _, elapsed = out["local twice"]
        assert kind == "RefitGroupError" and "already joined refit group 'twice'" in message, message
        assert elapsed < 1.0
    parts = [out["parts"] for out in trainer + engine + copy if "parts" in out]
    assert len(parts) == 4, parts  # the trainer's 2 ranks and the 2 of the engine job that holds the group
    sender, receiver = parts[0]["dropped"]
    assert sorted(out["rank"] for out in parts) == [0, 1, 2, 3], parts
    for out in parts:  # parts that disagree, over the group's own store: named, nothing written
        kind, message, ranks, elapsed = out["outcome"]
        assert kind == "RefitMismatchError" and "parts of the plan disagree" in message, message
        assert out["untouched"], out
        _within(elapsed, timeout)
        assert f"{sender}->{receiver}: rank {sender} sends" in message and ranks == (sender, receiver), out


def test_an_address_nobody_serves_is_named_within_the_timeout() -> None:
    from shardcore import RefitGroupError, connect_refit

    address = f"127.0.0.1:{free_port()}"
    started = time.monotonic()
    with pytest.raises(RefitGroupError, match=f"nobody serves the refit group's store at {address}"):
        connect_refit(address, side="engine", rank=0, trainer_ranks=1, engine_ranks=1, timeout=2.0)
    _within(time.monotonic() - started, 2.0)


def test_refits_into_a_one_process_job_without_a_default_group_meet_on_the_group_store_alone(config: str) -> None:
    """A 2-rank trainer job and a 1-process engine job whose process has no default group: every refit completes
    bitwise, every meeting (the lingering end meeting too) is counted on the group's store, none on a job's own
    (the trainer's store has the keys it had), so no store host waits out its grace for a count that went
    elsewhere."""
    address = f"127.0.0.1:{free_port()}"
    refits = 4
    trainer, (engine,) = run_jobs(
        [
            (2, workers.trainer_to_one_process, (address, config, refits, 30.0)),
            (1, workers.engine_without_default_group, (address, config, refits, 30.0)),
        ],
        timeout=180,
    )
    assert engine["default"] is False  # it ran without a default group throughout
    assert [kind for kind, *_ in engine["outcomes"]] == ["ok"] * refits, engine["outcomes"]
    assert engine["wrong"] == [], engine["wrong"][:3]
    assert engine["versions"] == [(step, True) for step in range(refits)], engine["versions"]
    for rank, out in enumerate(trainer):
        before, after = out["keys"]
        assert after == before, (rank, out["keys"])  # nothing of the group's meetings on the trainer's own store
        assert len(out["moved"]) == refits and all(out["moved"]), out["moved"]
    assert [heard for out in [*trainer, engine] for heard in out["heard"]] == []  # no grace waited out
