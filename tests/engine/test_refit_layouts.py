"""Refit from Megatron shards into the Hugging Face and vLLM layouts and back, on a live gloo world, checked by
real transformers models: the logits of a model loaded from what each destination received equal the original's."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest

from shardcore.testing import run_world
from tests.core.test_refit_layouts import VLLM_LINEAR

from . import layout_workers as workers

ROOT = Path(__file__).resolve().parents[2]


def _env() -> dict[str, str]:
    """The environment of a ``shardcore`` command run from the checkout (this env has no DTensor backend)."""
    return {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}


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
    [
        ("tp=2,role=train + tp=2", 4, ["--to-layout", "vllm"]),
        ("dp=1 + tp=2,role=train", 3, ["--from-layout", "hf"]),
        # vLLM's tp=4 over 2 kv heads, relayed inside the node of 4: each head's two slices sent once each
        ("tp=2,role=train + tp=4", 6, ["--to-layout", "vllm", "--ranks-per-node", "4", "--fan-out"]),
    ],
)
def test_refit_check_through_a_layout(tmp_path: Path, shards: str, nproc: int, flags: list[str]) -> None:
    """``refit --check`` fills the source with known values and compares every destination byte with the
    source's tensors put through the weight map (the vocabulary padding written as zeros)."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps(workers.hf_config({"model_type": "qwen2"})))
    command = [sys.executable, "-m", "shardcore", "refit", "--check", "--nproc", str(nproc), "--shards", shards]
    command += ["--from", "0", "--to", "1", "--model", f"hf:{config}", "--json", *flags]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    assert "Traceback" not in result.stderr
    document = json.loads(result.stdout)
    assert document["ok"] and [row["shard"] for row in document["shards"]] == [1]
    assert all(row["ok"] and not row["mismatches"] for row in document["shards"])


@pytest.mark.parametrize("index", range(len(workers.CASES)))
def test_hf_layout_is_the_installed_model_class(index: int) -> None:
    """The hf layout (transformers 4) or hf-stacked (transformers 5, experts stacked) has the names, shapes and
    dtypes of the installed transformers' ``model.state_dict()``, and the plan's boxes, copied in one process,
    make a model with the original's logits."""
    import torch
    import transformers

    from shardcore.engine.live.refit_check import cut
    from shardcore.plan.layout import plan_layout
    from shardcore.refit.boxes import fitted
    from shardcore.refit.families import manifest_from_hf_config
    from shardcore.refit.planner import plan_refit

    case, megatron_spec, _ = workers.CASES[index]
    kind = "hf" if transformers.__version__.startswith("4.") else "hf-stacked"
    config = workers.hf_config(case)
    model = manifest_from_hf_config(config, vocab_multiple=128)
    original = workers.reference_model(config, seed=1)
    state = original.state_dict()
    plan = plan_refit(
        plan_layout(3, f"{megatron_spec},role=train + dp=1"), 0, [1], model.manifest, layouts={1: model.layout(kind)}
    )
    shapes = plan.for_rank(2).destination_shapes
    tied = {"lm_head.weight"} if config.get("tie_word_embeddings") else set()
    assert {name: tuple(t.shape) for name, t in state.items() if name not in tied} == shapes
    assert {str(t.dtype) for t in state.values()} == {f"torch.{plan.destination_tensor(n).dtype}" for n in shapes}
    full = workers.megatron_globals(state, model)
    manifest = model.manifest
    sources = {
        rank: {
            n: cut(full[n], manifest.tensor(n), plan.source, rank, manifest) for n in plan.for_rank(rank).source_shapes
        }
        for rank in (0, 1)
    }
    received = {name: torch.zeros(shape) for name, shape in shapes.items()}
    for t in plan.transfers():  # what the executor does, in one process
        piece = sources[t.src][t.tensor][tuple(slice(o, o + n) for o, n in zip(t.src_offset, t.shape))]
        target = received[t.destination]
        view = target[tuple(slice(o, o + n) for o, n in zip(t.dst_offset, fitted(t.shape, target.dim())))]
        view.copy_(piece.reshape(view.shape))
    fresh = workers.reference_model(config, seed=2)
    fresh.load_state_dict(received, strict=not tied)
    assert (workers.logits(fresh) - workers.logits(original)).abs().max().item() <= 1e-5


ORACLE_CASES: list[tuple[dict[str, Any], str]] = [
    (workers.hf_config({"model_type": "llama"}), "tp=2,pp=2"),
    (workers.hf_config({"model_type": "llama", "tie_word_embeddings": True}), "tp=2,pp=2"),
    (workers.hf_config({"model_type": "qwen2"}), "tp=2,pp=2"),
    (workers.hf_config({"model_type": "qwen3", "head_dim": 32}), "tp=2,pp=2"),
    (workers.hf_config(workers.CASES[-1][0]), "tp=2,pp=2,ep=2,expt_tp=1"),
]
"""(HF config, Megatron spec): every family at tp=2, pp=2 (ep=2 for the experts), fp32, 2 layers."""


def test_megatron_gpt_into_transformers_and_vllm_and_back() -> None:
    """The real oracle: megatron-core's own GPTModel (tp=2, pp=2) refit into transformers' model class and
    into the vLLM tp=2 layout gives Megatron's logits; a transformers model refit into the Megatron shards
    gives its own (``megatron_layout_workers``)."""
    import torch

    from shardcore.refit.families import manifest_from_hf_config

    from . import megatron_layout_workers as oracle

    results = run_world(oracle.WORLD, oracle.run_cases, ORACLE_CASES, timeout=600)
    for index, (config, _) in enumerate(ORACLE_CASES):
        family = f"{config['model_type']}{' tied' if config.get('tie_word_embeddings') else ''}"
        per_rank = [rank_results[index] for rank_results in results]
        hf = per_rank[oracle.HF_RANK]
        vocab = config["vocab_size"]
        megatron, back = (
            [torch.from_numpy(r[key])[..., :vocab] for r in per_rank if r.get(key) is not None]
            for key in ("megatron", "megatron_back")
        )
        assert len(megatron) == len(back) == 2, family  # the last stage's two tp ranks
        tied = ["lm_head.weight"] if config.get("tie_word_embeddings") else []
        assert hf["unexpected"] == [] and hf["missing"] == tied, (family, hf["missing"], hf["unexpected"])
        assert (torch.from_numpy(hf["hf"]) - megatron[0]).abs().max().item() <= 1e-5, family
        model = manifest_from_hf_config(config, vocab_multiple=128)
        vllm = [{n: torch.from_numpy(a) for n, a in per_rank[r]["vllm"].items()} for r in oracle.VLLM_RANKS]
        state = workers.vllm_to_hf(vllm, model, expt_tp=2 if model.config.experts else 1)
        fresh = workers.reference_model(config, seed=4)
        missing, unexpected = fresh.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (family, missing, unexpected)
        assert (workers.logits(fresh) - megatron[0]).abs().max().item() <= 1e-5, family
        original = torch.from_numpy(hf["original"])
        assert all((logits - original).abs().max().item() <= 1e-5 for logits in back), family


def test_deepseek_v3_hf_layout_is_the_installed_model_class() -> None:
    """DeepSeek-V3's hf layout (MLA, shared experts, a dense first layer) has the names, shapes and dtypes of
    the installed transformers' ``model.state_dict()``, less the router bias no refit moves (``UNMAPPED``)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    from shardcore.refit.families import UNMAPPED, manifest_from_hf_config
    from tests.core.test_refit_layouts import CONFIGS

    config = {**workers.BASE, **CONFIGS["deepseek_v3"], "n_group": 1, "topk_group": 1, "num_experts_per_tok": 2}
    model = manifest_from_hf_config(config, vocab_multiple=128)
    settings = {k: v for k, v in config.items() if k not in ("model_type", "torch_dtype")}
    state = AutoModelForCausalLM.from_config(AutoConfig.for_model("deepseek_v3", **settings)).state_dict()
    kept = {name: (tuple(t.shape), str(t.dtype)) for name, t in state.items() if not name.endswith(UNMAPPED)}
    assert kept == {t.name: (t.shape, f"torch.{t.dtype}") for t in model.hf_manifest}
    assert any(name.endswith(UNMAPPED) for name in state)


def test_fp8_into_the_vllm_layout_is_quantized_by_the_engine_ranks() -> None:
    """Megatron shards refit into vLLM tp=2 in fp8 with block scales: on every engine rank exactly vLLM's linear and
    expert weights are fp8, each with its ``_scale_inv``, bitwise those of quantizing (with the project's
    functions) the local vLLM tensor built here from the HF tensors, padding zero; its embedding, head, norms, qkv
    bias and router land in bf16 with no scale tensor, bitwise the local tensors; with relays (fan-out), and after
    a partial refit at a new
    version, which renews the fused ``qkv_proj`` whole and leaves the rest; a delta refit is refused on every
    rank (the destinations hold fp8, not the wire bytes a delta builds on). A MoE's stacked experts (from
    Megatron with ep, into vLLM with ep or expt_tp) are blocked per expert, ``w13_weight_scale_inv`` [local
    experts, 2*ffn/tp / 128, hidden / 128], and a partial refit of one expert renews its layer's w13 whole."""
    results = run_world(4, workers.run_fp8, workers.FP8_CASES, timeout=600)
    for index, (case, _, per_node, engine_spec) in enumerate(workers.FP8_CASES):
        family = (case["model_type"], engine_spec)
        engine = [results[rank][index] for rank in (2, 3)]
        renewed = ["model.layers.0.self_attn.qkv_proj.weight"]
        if "num_experts" in case:
            renewed.append("model.layers.0.mlp.experts.routed_experts.w13_weight")
        for got in engine:
            dtypes = got["dtypes"]
            weights = {n for n in dtypes if n.endswith(VLLM_LINEAR)}
            scales = {n for n in dtypes if n.endswith("_scale_inv")}
            assert weights and scales == {f"{w}_scale_inv" for w in weights}, family
            assert all(dtypes[w] == "torch.float8_e4m3fn" for w in weights), family
            kept = set(dtypes) - weights - scales
            assert kept and all(dtypes[n] == "torch.bfloat16" for n in kept), family
            assert any(n.endswith("mlp.gate.weight") for n in kept) == ("num_experts" in case), family
            assert set(renewed) <= weights, family
            assert got["first"] == [] and got["partial"] == [], (family, got["first"], got["partial"])
            assert got["partial_names"] == sorted(n for w in renewed for n in (w, f"{w}_scale_inv")), family
            assert [held.version for held in got["versions"]] == [2, 1] and all(h.intact for h in got["versions"])
            assert got["landing_peak_bytes"] > 0
        assert all("delta=True with fp8 through a layout" in results[r][index]["delta"] for r in range(4)), family
        if per_node is not None:  # a relay of the engine's node forwarded from its staging copies
            assert sum(got["hops"] for got in engine) > 0, family


@pytest.mark.parametrize(
    ("case", "shards", "nproc", "layouts", "checked"),
    [
        # 17 tensors a rank, 8 of them (qkv_proj, o_proj, gate_up_proj, down_proj) quantized with a scale tensor
        ({"model_type": "qwen2"}, "tp=2,role=train + tp=2", 4, ["--to-layout", "vllm"], 2 * (17 + 8)),
        # 21 tensors a rank, 8 quantized: qkv_proj, o_proj, w13 and w2 (stacked experts, blocked per expert)
        (workers.FP8_MOE, "tp=2,ep=2,expt_tp=1,role=train + tp=2,expt_tp=2", 4, ["--to-layout", "vllm"], 2 * (21 + 8)),
        # 25 tensors, 12 quantized: q, k, v and o_proj, gate_up_proj [4, 512, 512] and down_proj
        (workers.FP8_MOE, "tp=2,ep=2,expt_tp=1,role=train + dp=1", 3, ["--to-layout", "hf-stacked"], 25 + 12),
        # from a checkpoint: the same engine tensors quantized as from Megatron shards
        ({"model_type": "qwen2"}, "dp=1,role=train + tp=2", 3, ["--from-layout", "hf", "--to-layout", "vllm"], 50),
        (
            workers.FP8_MOE,
            "dp=1,role=train + tp=2,expt_tp=2",
            3,
            ["--from-layout", "hf-stacked", "--to-layout", "vllm"],
            2 * (21 + 8),
        ),
        # into Megatron shards with ep: 24 tensors a rank, 12 quantized (linear_qkv, linear_proj, each local expert's
        # linear_fc1 and linear_fc2)
        (workers.FP8_MOE, "dp=1,role=train + tp=2,ep=2,expt_tp=1", 3, ["--from-layout", "hf"], 2 * (24 + 12)),
    ],
)
def test_refit_check_fp8_through_a_layout(
    tmp_path: Path, case: dict[str, Any], shards: str, nproc: int, layouts: list[str], checked: int
) -> None:
    """``refit --check --to-dtype float8_e4m3fn --scale block`` through a layout (into vllm or hf-stacked; from
    Megatron shards or a checkpoint's hf layout, also into Megatron shards) quantizes the expected local linear
    weights as the destination ranks must, and compares every fp8 byte and scale bitwise, and every norm,
    embedding, head and router byte as sent; a MoE's stacked experts (vLLM's w13/w2, hf-stacked's
    gate_up_proj/down_proj) blocked per expert."""
    config = tmp_path / "config.json"
    config.write_text(json.dumps({**workers.FP8_BASE, **case}))
    command = [sys.executable, "-m", "shardcore", "refit", "--check", "--nproc", str(nproc), "--json"]
    command += ["--shards", shards, "--from", "0", "--to", "1", "--model", f"hf:{config}", *layouts]
    command += ["--to-dtype", "float8_e4m3fn", "--scale", "block"]
    result = subprocess.run(command, capture_output=True, text=True, cwd=ROOT, env=_env(), timeout=300)
    assert result.returncode == 0, result.stderr
    document = json.loads(result.stdout)
    assert document["ok"] and [row["shard"] for row in document["shards"]] == [1]
    assert all(row["ok"] and not row["mismatches"] for row in document["shards"])
    assert [row["tensors_checked"] for row in document["shards"]] == [checked]
    echoed = {"to_layout": layouts[layouts.index("--to-layout") + 1] if "--to-layout" in layouts else "megatron"}
    echoed |= {"to_dtype": "float8_e4m3fn", "scale": "block", "delta": "off"}
    assert {key: document["checked"][key] for key in echoed} == echoed  # what it checked, echoed


def test_the_engine_vocabulary_padding_is_zeroed_whatever_it_held() -> None:
    """vLLM's loader zeroes its vocabulary padding and its reload path leaves it uninitialised: a refit into the
    vllm layout writes it as zeros over NaN or any garbage, every refit, and the real rows are the source's."""
    results = run_world(4, workers.garbage_padding, timeout=300)
    for rank in (2, 3):
        out = results[rank]
        assert out["wrong"] == [], (rank, out["wrong"])
        padding = {name: rows for name, (rows, _) in out["padding"].items()}
        assert padding == {"model.embed_tokens.weight": 28 * (rank - 2), "lm_head.weight": 28 * (rank - 2)}, out
        assert all(zero for rows, zero in out["padding"].values() if rows), out["padding"]
