"""A third-party backend, installed as its own distribution, is found through its entry point.

``tests/plugins/shardcore-toy`` is a separate package (``pip install -e tests/plugins/shardcore-toy``);
shardcore has no line of code that names it.
"""

from __future__ import annotations

from typing import Any

import pytest

pytest.importorskip("torch")
pytest.importorskip("shardcore_toy")

import shardcore
from shardcore.testing import run_world

SPEC = "tp=2,role=prefill+tp=2,role=decode"


def test_listed_with_its_distribution() -> None:
    toy = {info.name: info for info in shardcore.list_backends()}["toy"]
    assert toy.distribution == "shardcore-toy"
    assert toy.version == "0.0.1"
    assert toy.available and toy.reason is None


def test_get_backend_by_name() -> None:
    backend = shardcore.get_backend("toy")
    assert backend.name == "toy"
    assert isinstance(backend, shardcore.Backend)
    assert type(backend).__module__ == "shardcore_toy"


def build_with_toy(rank: int, world: int) -> dict[str, Any]:
    shards = shardcore.build_shards(world, SPEC, backend="toy", timeout=60)
    mine = shardcore.my_shard(shards)
    handle = mine.handle
    shardcore.destroy_shards(shards)
    return {"shard": mine.index, "handle": handle}


def test_live_world_builds_with_toy() -> None:
    results = run_world(4, build_with_toy, timeout=180)
    assert [r["shard"] for r in results] == [0, 0, 1, 1]
    for result in results:
        handle = result["handle"]
        assert handle["tp"] == 2 and handle["pp"] == 1 and handle["dp"] == 1
        assert set(handle) >= {"tp", "cp", "pp", "dp", "mp", "tp_cp", "dp_cp", "ep", "expt_tp", "tp_ep"}
