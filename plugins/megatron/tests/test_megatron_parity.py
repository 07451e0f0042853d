"""Parity with the real megatron-core on a fake world: every field, every rank, random configs.

Megatron's side is its own ``megatron.core.inference.shards`` where it has one (0.19 and later, the
module the drop-in replaces: ``build_inference_pg_collection`` and ``build_inference_pg_collections_for_shards``),
else (0.16.1) its HyperCommGrids used the way that module uses them. Where it asserts (or fails otherwise),
the drop-in raises a typed error. Everything runs in one spawned process so the fake world and megatron's
import stay out of the test process.
"""

from __future__ import annotations

import multiprocessing
import random
from concurrent.futures import ProcessPoolExecutor
from typing import Any

import pytest

from plugins.megatron.tests import megatron_recipe  # noqa: F401  # skips this module without megatron-core
from plugins.megatron.tests import megatron_workers as workers


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def random_configs(count: int, seed: int = 1234) -> list[dict[str, Any]]:
    """Random (tp, cp, pp, dp, ep, expt_tp, order, rank_offset, strategy) with a valid expert grid."""
    rng = random.Random(seed)
    configs = []
    while len(configs) < count:
        tp, cp, pp, dp = rng.choice([1, 2, 4]), rng.choice([1, 1, 2]), rng.choice([1, 2, 3]), rng.choice([1, 2, 3])
        size = tp * cp * pp * dp
        etp = rng.choice(_divisors(size // pp))
        ep = rng.choice(_divisors(size // pp // etp))
        if size > 32:
            continue
        offset = rng.choice([0, 0, 1, 3, 4])
        configs.append(
            dict(
                tp=tp,
                cp=cp,
                pp=pp,
                dp=dp,
                ep=ep,
                expt_tp=etp,
                mapping=rng.random() < 0.5,
                offset=offset,
                world=offset + size + rng.choice([0, 0, 2]),
                strategy=rng.choice(["local", "world"]),
            )
        )
    return configs


# hand-picked: cp > 1, tp-pp-dp with dp != expt_dp (Megatron asserts, shardcore raises LayoutError), pp = 3
FIXED = [
    dict(tp=2, cp=2, pp=2, dp=2, ep=2, expt_tp=1, mapping=False, offset=0, world=16, strategy="local"),
    dict(tp=2, cp=1, pp=2, dp=2, ep=1, expt_tp=1, mapping=True, offset=2, world=10, strategy="local"),
    dict(tp=1, cp=1, pp=3, dp=2, ep=2, expt_tp=1, mapping=True, offset=1, world=7, strategy="world"),
]
CONFIGS = FIXED + random_configs(24)


@pytest.fixture(scope="module")
def executor() -> Any:
    with ProcessPoolExecutor(1, mp_context=multiprocessing.get_context("spawn")) as pool:
        yield pool


def test_configs_cover_the_space() -> None:
    assert any(c["mapping"] for c in CONFIGS) and any(not c["mapping"] for c in CONFIGS)
    assert any(c["cp"] > 1 for c in CONFIGS) and any(c["offset"] > 0 for c in CONFIGS)
    assert any(c["expt_tp"] != c["tp"] for c in CONFIGS) and any(c["ep"] > 1 for c in CONFIGS)


def test_every_field_on_every_rank_matches_megatron(executor: Any) -> None:
    problems = executor.submit(workers.parity, CONFIGS).result(timeout=240)
    assert problems == [], "\n".join(problems[:5])


def test_megatron_0_19_and_later_are_compared_with_their_own_inference_shards(executor: Any) -> None:
    from importlib.metadata import version

    major, minor = (int(part) for part in version("megatron-core").split(".")[:2])
    expected = "megatron.core.inference.shards" if (major, minor) >= (0, 19) else "HyperCommGrid recipe"
    assert executor.submit(workers.oracle).result(timeout=120) == expected


# multi-shard layouts as Megatron's builder takes them: shards from rank 0, filling the world, cp = 1
LAYOUTS = [
    ("tp=2,role=prefill+tp=1,dp=2,role=decode", 4, False),
    ("tp=2,pp=2+tp=1,dp=2,ep=2,expt_tp=1", 6, False),
    ("tp=2,pp=2,dp=2;tp=4,ep=2,expt_tp=2", 12, True),
    ("tp=1,pp=3,dp=2,ep=2,expt_tp=1", 6, False),
]


def _needs_inference_shards(executor: Any) -> None:
    if executor.submit(workers.oracle).result(timeout=120) != "megatron.core.inference.shards":
        pytest.skip("megatron-core < 0.19 has no megatron.core.inference.shards (the megatron019 env has)")


def test_every_shard_on_every_rank_matches_megatrons_own_builder(executor: Any) -> None:
    _needs_inference_shards(executor)
    problems = executor.submit(workers.shards_parity, LAYOUTS).result(timeout=240)
    assert problems == [], "\n".join(problems[:5])


REFUSED = [
    ("build_inference_pg_collection", dict(world_size=6, tp_size=4, pp_size=1, cp_size=1, ep_size=1, expt_tp_size=1)),
    ("build_inference_pg_collection", dict(world_size=4, tp_size=2, pp_size=1, cp_size=1, ep_size=4, expt_tp_size=2)),
    ("build_inference_pg_collection", dict(world_size=0, tp_size=1, pp_size=1, cp_size=1, ep_size=1, expt_tp_size=1)),
    ("build_inference_pg_collections_for_shards", dict(total_world_size=2, shards="tp=2,pp=2")),
    ("build_inference_pg_collections_for_shards", dict(total_world_size=8, shards="tp=2")),
    ("build_inference_pg_collections_for_shards", dict(total_world_size=2, shards="TP=2")),
    ("build_inference_pg_collections_for_shards", dict(total_world_size=2, shards="tp=0")),
    ("build_inference_pg_collections_for_shards", dict(total_world_size=2, shards="tp=2,ep=2")),
    ("build_inference_pg_collections_for_shards", dict(total_world_size=2, shards="")),
    ("build_inference_pg_collections_for_shards", dict(total_world_size=2, shards="tp=2,role=both")),
    ("build_inference_pg_collections_for_shards", dict(total_world_size=2, shards=[{"tp": 2, "color": 1}])),
]


def test_what_megatron_refuses_the_drop_in_refuses_with_a_typed_error(executor: Any) -> None:
    _needs_inference_shards(executor)
    answers = executor.submit(workers.refusals, REFUSED).result(timeout=240)
    for (function, kwargs), (theirs, ours, message) in zip(REFUSED, answers):
        assert theirs != "none", (function, kwargs)  # Megatron refuses it (asserts, or fails otherwise)
        assert ours in ("ShardSpecError", "LayoutError"), (function, kwargs, ours, message)
        assert "\n" not in message and message, (function, kwargs)


def test_none_sizes_come_from_parallel_state(executor: Any) -> None:
    reports = executor.submit(workers.defaults_from_parallel_state, 8).result(timeout=120)
    for report in reports:
        assert (report["plain_tp"], report["plain_dp"]) == (1, 8)  # parallel_state not initialised: all 1
        assert (report["tp"], report["pp"], report["dp"]) == (2, 2, 2)  # training's tp=2, pp=2
