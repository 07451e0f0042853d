"""shardcore_megatron.refit on live gloo: tiny megatron-core 0.16.1 GPT models on CPU, bitwise after refit."""

from __future__ import annotations

import pytest

pytest.importorskip("megatron.core")

from plugins.megatron.tests import megatron_refit_workers as workers
from shardcore.testing import run_world


def test_refit_between_megatron_models() -> None:
    results = run_world(4, workers.refit_models, timeout=900)
    for index, (label, *_rest) in enumerate(workers.CASES):
        per_rank = [r[index] for r in results]
        destinations = [r for r in per_rank if r["matches"]]
        assert destinations, label
        for rank, r in enumerate(per_rank):
            assert all(r["matches"].values()), (label, rank, [n for n, ok in r["matches"].items() if not ok])
    collocated, moe = ([r[i] for r in results] for i in range(2))
    assert all(r["copied"] > 0 for r in collocated)  # each tp=4 rank held part of its weights already
    assert {n for r in moe for n in r["names"]} >= {
        f"decoder.layers.0.mlp.experts.local_experts.{e}.linear_fc1.weight" for e in range(4)
    }
    assert {n for r in collocated for n in r["names"]} >= {
        "decoder.layers.3.self_attention.linear_qkv.weight",
        "output_layer.weight",
        "embedding.word_embeddings.weight",
    }
