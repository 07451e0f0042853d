"""Refit from Megatron shards into the Hugging Face and vLLM layouts and back, on a live gloo world, checked by
real transformers models: the logits of a model loaded from what each destination received equal the original's."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from shardcore.testing import run_world
from tests.engine.test_check import ROOT, _env

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


@pytest.mark.parametrize(
    ("shards", "nproc", "flags"),
    [("tp=2,role=train + tp=2", 4, ["--to-layout", "vllm"]), ("dp=1 + tp=2,role=train", 3, ["--from-layout", "hf"])],
)
def test_refit_check_through_a_layout(tmp_path: Path, shards: str, nproc: int, flags: list[str]) -> None:
    """``refit --check`` fills the source with known values and compares every destination byte with the
    source's tensors put through the weight map (the vocabulary padding left as allocated)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(workers.hf_config({"model_type": "qwen2"})))
    command = [sys.executable, "-m", "shardcore", "refit", "--check", "--nproc", str(nproc), "--shards", shards]
    command += ["--from", "0", "--to", "1", "--model", f"hf:{config}", *flags]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    assert result.stdout.splitlines()[-1].split()[-1] == "ok"
