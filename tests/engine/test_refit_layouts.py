"""Refit from Megatron shards into the Hugging Face and vLLM layouts and back, on a live gloo world, checked by
real transformers models: the logits of a model loaded from what each destination received equal the original's."""

from __future__ import annotations

import pytest

pytest.importorskip("transformers", reason="the layout refits are checked against transformers' model classes")

from shardcore.testing import run_world

from . import layout_workers as workers


def test_refit_into_hf_and_vllm_and_back() -> None:
    results = run_world(5, workers.run_cases, workers.CASES, timeout=600)
    for index, (case, _, _) in enumerate(workers.CASES):
        family = case["model_type"]
        hf = results[2][index]
        tied = case.get("tie_word_embeddings", False)
        assert hf["unexpected"] == [], family
        assert hf["missing"] == (["lm_head.weight"] if tied else []), family
        assert hf["hf_diff"] <= 1e-5, (family, hf["hf_diff"])
        for rank in (0, 1):
            back = results[rank][index]
            assert back["back_names"] and back["back_equal"] == back["back_names"], (family, rank, back)
    for case, diff in zip(workers.CASES, workers.check_vllm(results, workers.CASES)):
        assert diff <= 1e-5, (case["model_type"], diff)
