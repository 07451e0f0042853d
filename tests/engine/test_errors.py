"""build_shards refuses bad calls with typed errors before touching torch.distributed."""

from __future__ import annotations

import pytest

pytest.importorskip("torch")

from shardcore import GroupCreationError, build_shards
from shardcore.testing import run_world
from tests.engine import engine_workers as workers


def test_without_an_initialised_world() -> None:
    with pytest.raises(GroupCreationError, match="init_process_group"):
        build_shards(4, "tp=4")


def test_bad_calls_in_a_live_world() -> None:
    results = run_world(2, workers.bad_calls, timeout=120)
    for messages in results:
        assert "torch world has 2 ranks" in messages["world"]
        assert "strategy='nowhere'" in messages["strategy"]
        assert "no backend named 'nope'" in messages["backend"]
        assert "timeout=-1" in messages["timeout"]
        assert "unknown group name 'bogus'" in messages["groups"]
        assert "plans 4 ranks but total_world_size=2" in messages["layout"]
