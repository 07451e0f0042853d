"""The test worlds themselves (``shardcore.testing.run_world`` inside ``kept_worlds``, as every test session
runs it): a call reuses the processes of the last, whatever its size; a call that fails, hangs, loses a rank or
leaves shardcore's code patched is named as before, and the next call runs on new, unpatched processes."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from shardcore.errors import WorldError
from shardcore.testing import run_world
from tests.engine import world_workers as workers


def test_a_kept_world_serves_the_next_call_of_any_size() -> None:
    two = run_world(2, workers.pid)
    assert run_world(2, workers.pid) == two
    three = run_world(3, workers.pid)
    assert [pid for pid, _, _ in three[:2]] == [pid for pid, _, _ in two]
    assert [size for _, size, _ in three] == [3, 3, 3]


@pytest.mark.parametrize(
    ("how", "message"),
    [
        ("raises", r"ranks \[1\] failed; rank 1:\n(.|\n)*RuntimeError: rank 1 raises on purpose"),
        ("hangs", r"ranks \[1\] of a 2-rank world did not finish within 5s"),
        ("dies", r"ranks \[1\] died \(exit codes \[17\]\)"),
    ],
)
def test_a_broken_world_names_its_ranks_and_the_next_call_gets_new_processes(how: str, message: str) -> None:
    before = {pid for pid, _, _ in run_world(2, workers.pid)}
    with pytest.raises(WorldError, match=message):
        run_world(2, workers.fails_on, 1, how, timeout=5)
    after = run_world(2, workers.pid)
    assert before.isdisjoint(pid for pid, _, _ in after) and all(own for _, _, own in after)


def test_a_call_that_leaves_shardcore_patched_is_named_and_its_processes_end() -> None:
    before = run_world(2, workers.pid)
    with pytest.warns(UserWarning, match=r"left shardcore\.engine\.transfer\.exchange\.Exchange\.staging_bytes"):
        assert run_world(2, workers.fails_on, 0, "patches")[1] == before[1][0]
    after = run_world(2, workers.pid)
    assert {pid for pid, _, _ in before}.isdisjoint(pid for pid, _, _ in after)
    assert all(own for _, _, own in after)  # the patch went with its process


def test_allow_failures_reports_each_rank_and_never_keeps_the_world() -> None:
    before = {pid for pid, _, _ in run_world(2, workers.pid)}
    results = run_world(2, workers.fails_on, 1, "dies", allow_failures=True)
    assert results[0] in before and results[1] == "died (exit code 17)"
    assert before.isdisjoint(pid for pid, _, _ in run_world(2, workers.pid))


def test_a_variable_a_call_sets_does_not_reach_the_next() -> None:
    assert run_world(2, workers.sets_a_variable) == [None, None]
    assert run_world(2, workers.sets_a_variable) == [None, None]
