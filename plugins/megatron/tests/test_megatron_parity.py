"""Parity with the real megatron-core 0.16.1 on a fake world: every field, every rank, random configs.

Megatron's side is HyperCommGrids used the way its ``build_inference_pg_collection`` uses
them (https://github.com/NVIDIA/Megatron-LM/blob/core_v0.19.0/megatron/core/inference/shards.py).
Everything runs in one spawned process so the fake world and megatron's import stay out of the test process.
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


def test_none_sizes_come_from_parallel_state(executor: Any) -> None:
    reports = executor.submit(workers.defaults_from_parallel_state, 8).result(timeout=120)
    for report in reports:
        assert (report["plain_tp"], report["plain_dp"]) == (1, 8)  # parallel_state not initialised: all 1
        assert (report["tp"], report["pp"], report["dp"]) == (2, 2, 2)  # training's tp=2, pp=2
