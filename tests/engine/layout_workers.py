"""Rank functions for refits into the engines' layouts, checked against real transformers models.

Every rank builds the same small transformers model (fp32, 2 layers, weights drawn from a seed). Its
weights, packed into Megatron-Core's layout here with torch (the oracle of that layout: per query group its q
heads, then its k, then its v; [gate; up]; the vocabulary padded), are cut into the Megatron shard's local
tensors; the plan refits them into the HF layout (one rank) and the vLLM tp=2 layout (two ranks). The HF rank
loads what it received into a fresh model and compares logits with the original; the vLLM ranks send their
tensors back, and the test unpacks them as vLLM's packing is documented and does the same. Then the reverse:
the HF rank's tensors refit into the Megatron shard, which must hold what it started with.
"""

from __future__ import annotations

from typing import Any

import torch

from shardcore import execute_refit
from shardcore.engine.live.refit_check import cut
from shardcore.plan.layout import plan_layout
from shardcore.refit.families import HFModel, manifest_from_hf_config
from shardcore.refit.planner import plan_refit
from tests.core.test_refit_layouts import BASE as PLANNED

TOKENS = [[3, 17, 42, 9, 77, 5, 61, 20]]

BASE = {**PLANNED, "torch_dtype": "float32"}  # the planning tests' small model, compared in fp32

# (family config, Megatron shard spec, vLLM shard spec): the world is [Megatron (2) | HF (1) | vLLM (2)]
CASES: list[tuple[dict[str, Any], str, str]] = [
    ({"model_type": "llama", "num_key_value_heads": 1}, "tp=1,dp=2", "tp=2"),  # one kv head: vLLM replicates it
    ({"model_type": "llama", "tie_word_embeddings": True}, "tp=2", "tp=2"),
    ({"model_type": "qwen2"}, "tp=2", "tp=2"),
    ({"model_type": "qwen3", "head_dim": 32}, "tp=2", "tp=2"),
    (
        {"model_type": "qwen3_moe", "head_dim": 16, "num_experts": 4, "num_experts_per_tok": 2,
         "moe_intermediate_size": 32, "norm_topk_prob": True},
        "tp=2,ep=2,expt_tp=1",
        "tp=2,expt_tp=2",
    ),
]  # fmt: skip


def hf_config(case: dict[str, Any]) -> dict[str, Any]:
    return {**BASE, **case}


def reference_model(config: dict[str, Any], seed: int) -> Any:
    """The transformers model of ``config``, every weight (norms included) drawn from ``seed``."""
    from transformers import AutoConfig, AutoModelForCausalLM

    settings = {k: v for k, v in config.items() if k not in ("model_type", "torch_dtype")}
    model = AutoModelForCausalLM.from_config(AutoConfig.for_model(config["model_type"], **settings))
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for parameter in model.parameters():
            parameter.copy_(torch.randn(parameter.shape, generator=generator) * 0.1)
    return model.eval()


def logits(model: Any) -> torch.Tensor:
    with torch.no_grad():
        return model(torch.tensor(TOKENS)).logits


def per_expert(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """A state dict with transformers 5's stacked experts (``gate_up_proj [E, 2F, H]``: gate, then up) as
    transformers 4 and checkpoints name them, one MLP per expert."""
    out = dict(state)
    for name in [n for n in state if n.endswith("mlp.experts.gate_up_proj")]:
        prefix = name.removesuffix("gate_up_proj")
        gate_up, down = out.pop(name), out.pop(f"{prefix}down_proj")
        half = gate_up.shape[1] // 2
        for e in range(gate_up.shape[0]):
            out[f"{prefix}{e}.gate_proj.weight"] = gate_up[e, :half]
            out[f"{prefix}{e}.up_proj.weight"] = gate_up[e, half:]
            out[f"{prefix}{e}.down_proj.weight"] = down[e]
    return out


def megatron_globals(state: dict[str, torch.Tensor], model: HFModel) -> dict[str, torch.Tensor]:
    """The model's weights packed as Megatron-Core's GPT holds them, written straight from Megatron's layout."""
    state = per_expert(state)
    c = model.config
    d = c.head_dim or c.hidden // c.heads
    groups = c.kv_heads or c.heads
    per = c.heads // groups

    def padded(weight: torch.Tensor) -> torch.Tensor:
        return torch.cat([weight, torch.zeros(c.vocab - weight.shape[0], weight.shape[1])])

    out = {"embedding.word_embeddings.weight": padded(state["model.embed_tokens.weight"])}
    for layer in range(c.layers):
        h, m = f"model.layers.{layer}.", f"decoder.layers.{layer}."
        out[f"{m}input_layernorm.weight"] = state[f"{h}input_layernorm.weight"]
        for kind in ("weight", "bias") if c.qkv_bias else ("weight",):
            q, k, v = (state[f"{h}self_attn.{p}_proj.{kind}"] for p in "qkv")
            out[f"{m}self_attention.linear_qkv.{kind}"] = torch.cat(
                [
                    torch.cat([q[g * per * d : (g + 1) * per * d], k[g * d : (g + 1) * d], v[g * d : (g + 1) * d]])
                    for g in range(groups)
                ]
            )
        if c.qk_norm:
            out[f"{m}self_attention.q_layernorm.weight"] = state[f"{h}self_attn.q_norm.weight"]
            out[f"{m}self_attention.k_layernorm.weight"] = state[f"{h}self_attn.k_norm.weight"]
        out[f"{m}self_attention.linear_proj.weight"] = state[f"{h}self_attn.o_proj.weight"]
        out[f"{m}pre_mlp_layernorm.weight"] = state[f"{h}post_attention_layernorm.weight"]
        if c.experts:
            out[f"{m}mlp.router.weight"] = state[f"{h}mlp.gate.weight"]
            for e in range(c.experts):
                x = f"{h}mlp.experts.{e}."
                gate_up = torch.cat([state[f"{x}gate_proj.weight"], state[f"{x}up_proj.weight"]])
                out[f"{m}mlp.experts.linear_fc1.weight{e}"] = gate_up
                out[f"{m}mlp.experts.linear_fc2.weight{e}"] = state[f"{x}down_proj.weight"]
        else:
            gate_up = torch.cat([state[f"{h}mlp.gate_proj.weight"], state[f"{h}mlp.up_proj.weight"]])
            out[f"{m}mlp.linear_fc1.weight"] = gate_up
            out[f"{m}mlp.linear_fc2.weight"] = state[f"{h}mlp.down_proj.weight"]
    out["decoder.final_layernorm.weight"] = state["model.norm.weight"]
    if not c.tied_embeddings:
        out["output_layer.weight"] = padded(state["lm_head.weight"])
    return out


def vllm_to_hf(ranks: list[dict[str, torch.Tensor]], model: HFModel, expt_tp: int) -> dict[str, torch.Tensor]:
    """The HF state dict in a vLLM tp engine's local tensors (one dict per tp rank), unpacked as vLLM packs
    them: qkv_proj = [q heads; kv heads] per rank (kv replicated when tp exceeds them), gate_up_proj = [gate; up]
    per rank, o_proj / down_proj split on dim 1, the vocabulary padded to 64 and split on dim 0, and FusedMoE's
    w13 = per expert [gate; up] of its expt_tp rank, w2 split on dim 2. Padding must be zero."""
    c, tp = model.config, len(ranks)
    d = c.head_dim or c.hidden // c.heads
    kv = c.kv_heads or c.heads
    q_rows, kv_rows = c.heads // tp * d, max(1, kv // tp) * d
    replicas = max(1, tp // kv)
    out: dict[str, torch.Tensor] = {}
    for name in ranks[0]:
        parts = [rank[name] for rank in ranks]
        if "qkv_proj" in name:
            for p, (lo, hi) in zip("qkv", ((0, q_rows), (q_rows, q_rows + kv_rows), (q_rows + kv_rows, None))):
                chosen = [t[lo:hi] for r, t in enumerate(parts) if p == "q" or r % replicas == 0]
                for r, t in enumerate(parts):  # a replicated kv head is the same on every replica
                    assert p == "q" or torch.equal(t[lo:hi], parts[r - r % replicas][lo:hi])
                out[name.replace("qkv_proj", f"{p}_proj")] = torch.cat(chosen)
        elif "gate_up_proj" in name:
            half = parts[0].shape[0] // 2
            out[name.replace("gate_up_proj", "gate_proj")] = torch.cat([t[:half] for t in parts])
            out[name.replace("gate_up_proj", "up_proj")] = torch.cat([t[half:] for t in parts])
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = torch.cat(parts, dim=1)
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            full = torch.cat(parts)
            assert full.shape[0] % 64 == 0 and not full[model.vocab :].any(), "vocab padding written"
            out[name] = full[: model.vocab]
        elif name.endswith("w13_weight"):
            w13 = torch.cat(parts[:: tp // expt_tp], dim=1) if expt_tp > 1 else parts[0]
            f = w13.shape[1] // 2 // expt_tp
            prefix = name.removesuffix("routed_experts.w13_weight")
            for e in range(w13.shape[0]):
                chunks = [w13[e, r * 2 * f : (r + 1) * 2 * f] for r in range(expt_tp)]
                out[f"{prefix}{e}.gate_proj.weight"] = torch.cat([chunk[:f] for chunk in chunks])
                out[f"{prefix}{e}.up_proj.weight"] = torch.cat([chunk[f:] for chunk in chunks])
        elif name.endswith("w2_weight"):
            w2 = torch.cat(parts[:: tp // expt_tp], dim=2) if expt_tp > 1 else parts[0]
            prefix = name.removesuffix("routed_experts.w2_weight")
            for e in range(w2.shape[0]):
                out[f"{prefix}{e}.down_proj.weight"] = w2[e]
        else:
            out[name] = parts[0]
    return out


def run_cases(rank: int, world_size: int, cases: list[tuple[dict[str, Any], str, str]]) -> list[dict[str, Any]]:
    """Every case on this rank: into hf and vllm, then back from hf into Megatron. Ranks 0-1 are the Megatron
    shard, rank 2 the HF model, ranks 3-4 the vLLM engine."""
    results = []
    for case, megatron_spec, vllm_spec in cases:
        config = hf_config(case)
        model = manifest_from_hf_config(config, vocab_multiple=128)
        manifest = model.manifest
        original = reference_model(config, seed=1) if rank < 3 else None  # the engine ranks need no model
        layout = plan_layout(5, f"{megatron_spec},role=train + dp=1 + {vllm_spec}")
        plan = plan_refit(
            layout, 0, [1, 2], manifest, layouts={1: model.layout("hf"), 2: model.layout("vllm")}, min_piece_bytes=0
        )
        mine = plan.for_rank(rank)
        sources = {}
        if original is not None:
            full = megatron_globals(original.state_dict(), model)
            sources = {n: cut(full[n], manifest.tensor(n), plan.source, rank, manifest) for n in mine.source_shapes}
        destinations = {name: torch.zeros(shape) for name, shape in mine.destination_shapes.items()}
        execute_refit(plan, sources, destinations, timeout=60)
        result: dict[str, Any] = {"case": case["model_type"], "rank": rank}
        if rank == 2:
            fresh = reference_model(config, seed=2)
            missing, unexpected = fresh.load_state_dict(destinations, strict=False)
            result["missing"], result["unexpected"] = sorted(missing), sorted(unexpected)
            result["hf_diff"] = (logits(fresh) - logits(original)).abs().max().item()
        if rank in (3, 4):
            result["vllm"] = {name: tensor.numpy() for name, tensor in destinations.items()}  # pickled, not shared
        # the reverse: the HF model's tensors into the Megatron shard
        back = plan_refit(layout, 1, [0], manifest, layouts={1: model.layout("hf")}, min_piece_bytes=0)
        theirs = back.for_rank(rank)
        given = destinations if rank == 2 else {}
        received = {name: torch.zeros(shape) for name, shape in theirs.destination_shapes.items()}
        execute_refit(back, given, received, timeout=60)
        if rank in (0, 1):
            result["back_equal"] = sorted(name for name in received if torch.equal(received[name], sources[name]))
            result["back_names"] = sorted(received)
        results.append(result)
    return results


def check_vllm(results: list[list[dict[str, Any]]], cases: list[tuple[dict[str, Any], str, str]]) -> list[float]:
    """Per case, the max logit difference of the model loaded from the vLLM ranks' tensors, unpacked."""
    diffs = []
    for index, (case, _, vllm_spec) in enumerate(cases):
        config = hf_config(case)
        model = manifest_from_hf_config(config, vocab_multiple=128)
        expt_tp = 2 if "expt_tp=2" in vllm_spec else 1
        ranks = [{name: torch.from_numpy(array) for name, array in results[r][index]["vllm"].items()} for r in (3, 4)]
        state = vllm_to_hf(ranks, model, expt_tp)
        fresh = reference_model(config, seed=3)
        missing, unexpected = fresh.load_state_dict(state, strict=False)
        assert not unexpected and set(missing) <= {"lm_head.weight"}, (missing, unexpected)
        diffs.append((logits(fresh) - logits(reference_model(config, seed=1))).abs().max().item())
    return diffs


# fp8 into the vLLM layout: quantized by the engine ranks, checked against the HF tensors sliced the vLLM way

FP8_BASE = {**BASE, "hidden_size": 512, "intermediate_size": 256, "vocab_size": 200, "head_dim": 128,
            "torch_dtype": "bfloat16"}  # fmt: skip
"""A model whose vLLM tp=2 tensors are whole 128x128 blocks (q 256, k 128, v 128 rows a rank), in bf16; its
vocabulary (200) padded to 256, so the second rank quantizes 56 rows of padding (zeros) with its last rows."""

FP8_MOE = {"model_type": "qwen3_moe", "num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 256,
           "norm_topk_prob": True}  # fmt: skip
"""Qwen3-MoE whose experts are whole 128x128 blocks in vLLM at expt_tp <= 2: per expert gate and up 256 rows
(128 a rank at expt_tp=2), hidden 512."""

# (family config, Megatron shard spec, ranks per node and fan-out, vLLM shard spec): the world is
# [Megatron (2) | vLLM (2)]
FP8_CASES: list[tuple[dict[str, Any], str, int | None, str]] = [
    ({"model_type": "qwen2"}, "tp=2", None, "tp=2"),
    ({"model_type": "llama", "num_key_value_heads": 1}, "tp=1,dp=2", 2, "tp=2"),  # nodes of 2: the engine's relays
    (FP8_MOE, "tp=2,ep=2,expt_tp=1", None, "tp=2,ep=2,expt_tp=1"),  # 2 experts an engine rank
    (FP8_MOE, "tp=2,ep=2,expt_tp=1", 2, "tp=2,expt_tp=2"),  # each expert's w13 split, relayed
]


def hf_to_vllm(
    state: dict[str, torch.Tensor], model: HFModel, tp: int, r: int, ep: int = 1, expt_tp: int = 1
) -> dict[str, torch.Tensor]:
    """Tp rank r's local tensors of a vLLM engine, from the HF state dict, sliced as vLLM's weight loaders do:
    qkv_proj = [its q heads; its kv heads] (a kv head replicated over tp / kv ranks), gate_up_proj = [its gate rows;
    its up rows], o_proj / down_proj split on dim 1, the vocabulary padded with zeros to a multiple of 64 and split
    on dim 0; FusedMoE's w13_weight = for each of its ep rank's experts (a contiguous range) [its gate rows; its up
    rows] of its expt_tp rank (r % expt_tp), w2_weight = each one's down_proj split on dim 1; the rest whole."""
    c = model.config
    d = c.head_dim or c.hidden // c.heads
    kv = c.kv_heads or c.heads
    q_heads, kv_heads = c.heads // tp, max(1, kv // tp)
    first_kv = (r // max(1, tp // kv)) * kv_heads
    out: dict[str, torch.Tensor] = {}
    state = per_expert(state)
    for layer in range(c.layers if c.experts else 0):
        prefix, local = f"model.layers.{layer}.mlp.experts.", c.experts // ep
        mine = range(r // expt_tp % ep * local, (r // expt_tp % ep + 1) * local)
        gate_up, down = [], []
        for e in range(c.experts):
            gate, up, w2 = (state.pop(f"{prefix}{e}.{p}_proj.weight") for p in ("gate", "up", "down"))
            if e not in mine:
                continue
            share = gate.shape[0] // expt_tp
            rows = slice(r % expt_tp * share, (r % expt_tp + 1) * share)
            gate_up.append(torch.cat([gate[rows], up[rows]]))
            down.append(w2[:, rows])
        out[f"{prefix}routed_experts.w13_weight"], out[f"{prefix}routed_experts.w2_weight"] = (
            torch.stack(gate_up),
            torch.stack(down),
        )
    for name, tensor in state.items():
        h, _, end = name.rpartition("self_attn.q_proj.")
        if end != name:
            q, k, v = (state[f"{h}self_attn.{p}_proj.{end}"] for p in "qkv")
            kv_rows = slice(first_kv * d, (first_kv + kv_heads) * d)
            out[f"{h}self_attn.qkv_proj.{end}"] = torch.cat(
                [q[r * q_heads * d : (r + 1) * q_heads * d], k[kv_rows], v[kv_rows]]
            )
        elif name.endswith("mlp.gate_proj.weight"):
            up = state[name.replace("gate_proj", "up_proj")]
            share = tensor.shape[0] // tp
            out[name.replace("gate_proj", "gate_up_proj")] = torch.cat(
                [tensor[r * share : (r + 1) * share], up[r * share : (r + 1) * share]]
            )
        elif name.endswith(("o_proj.weight", "down_proj.weight")):
            out[name] = tensor.chunk(tp, dim=1)[r]
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            padded = -(-tensor.shape[0] // 64) * 64
            out[name] = torch.cat([tensor, torch.zeros(padded - tensor.shape[0], tensor.shape[1])]).chunk(tp)[r]
        elif not name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias", "up_proj.weight")):
            out[name] = tensor
    return {name: tensor.to(torch.bfloat16) for name, tensor in out.items()}


def fp8_mismatches(destinations: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> list[str]:
    """The destination tensors not bitwise equal to what they should hold: a quantized one (it has a
    ``_scale_inv``) and its scales to quantizing the expected high-precision local tensor with the project's own
    functions, any other (norms, embeddings, biases, the router) to the expected local tensor itself."""
    from shardcore.engine.transfer.convert import block_amax, quantize, scale_inv_of

    wrong = []
    for name, values in expected.items():
        got, scale = destinations[name], destinations.get(f"{name}_scale_inv")
        if scale is None:  # landed as sent
            bits = values.contiguous().view(torch.uint8)
            if got.dtype != values.dtype or not torch.equal(got.view(torch.uint8), bits):
                wrong.append(name)
            continue
        scale_inv = scale_inv_of(block_amax(values))
        weight = quantize(values, scale_inv, (0,) * values.dim())
        if got.dtype != torch.float8_e4m3fn or not torch.equal(got.view(torch.uint8), weight.view(torch.uint8)):
            wrong.append(name)
        if not torch.equal(scale.view(torch.int32), scale_inv.view(torch.int32)):
            wrong.append(f"{name}_scale_inv")
    return wrong


def run_fp8(
    rank: int, world_size: int, cases: list[tuple[dict[str, Any], str, int | None, str]]
) -> list[dict[str, Any]]:
    """Every case: a Megatron shard (ranks 0-1) refit into the vLLM tp=2 layout (ranks 2-3) in fp8 with block
    scales, at version 1; then a partial refit of layer 0's qkv (and of a MoE's expert 3's linear_fc1, whose
    w13_weight is quantized whole) from new weights, at version 2. The engine ranks report which tensors differ
    from quantizing the expected local tensors, after each refit. Last, a delta refit, refused on every rank
    before a byte moves."""
    from shardcore import ExecuteOptions, RefitInputError, held_version

    results = []
    for case, megatron_spec, per_node, vllm_spec in cases:
        config = {**FP8_BASE, **case}
        model = manifest_from_hf_config(config, vocab_multiple=128)
        layout = plan_layout(4, f"{megatron_spec},role=train + {vllm_spec}")
        engine = layout.shards[1].spec

        def expected_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            return hf_to_vllm(state, model, engine.tp, rank - 2, engine.ep, engine.expt_tp)

        plan = plan_refit(
            layout, 0, [1], model.manifest.converted("float8_e4m3fn", "block"), per_node,
            fan_out=per_node is not None, layouts={1: model.layout("vllm")}, min_piece_bytes=0,
        )  # fmt: skip
        mine = plan.for_rank(rank)
        states = [{n: t.to(torch.bfloat16) for n, t in reference_model(config, seed).state_dict().items()}
                  for seed in (1, 2)]  # fmt: skip
        manifest = plan.manifest

        def sources_of(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
            full = megatron_globals(state, model)
            return {n: cut(full[n].to(torch.bfloat16), manifest.tensor(n), plan.source, rank, manifest)
                    for n in mine.source_shapes}  # fmt: skip

        destinations = {  # -1 where no refit writes shows (the vocabulary padding is written as zeros)
            name: torch.full(shape, -1.0, dtype=getattr(torch, plan.destination_tensor(name).destination_dtype))
            for name, shape in mine.destination_shapes.items()
        }
        result: dict[str, Any] = {"case": case["model_type"], "rank": rank, "hops": sum(t.hop for t in mine.sends)}
        stats = execute_refit(plan, sources_of(states[0]), destinations, timeout=60, version=1)
        if rank >= 2:
            result["dtypes"] = {name: str(tensor.dtype) for name, tensor in destinations.items()}
            result["first"] = fp8_mismatches(destinations, expected_of(states[0]))
            result["landing_peak_bytes"] = stats.landing_peak_bytes
        chosen = ["decoder.layers.0.self_attention.linear_qkv.weight"]
        renewed = ["model.layers.0.self_attn.qkv_proj.weight"]
        if model.config.experts:
            chosen.append("decoder.layers.0.mlp.experts.linear_fc1.weight3")
            renewed.append("model.layers.0.mlp.experts.routed_experts.w13_weight")
        partial = plan.subset(chosen)
        theirs = partial.for_rank(rank)
        given = {n: t for n, t in destinations.items() if n in theirs.destination_shapes}
        execute_refit(partial, sources_of(states[1]), given, timeout=60, version=2)
        if rank >= 2:
            expected, new = expected_of(states[0]), expected_of(states[1])
            expected.update({name: new[name] for name in renewed})
            result["partial"] = fp8_mismatches(destinations, expected)
            result["partial_names"] = sorted(given)
            result["versions"] = (held_version(given), held_version({"x": destinations["model.norm.weight"]}))
        try:
            execute_refit(plan, sources_of(states[1]), destinations, options=ExecuteOptions(60, version=3, delta=True))
        except RefitInputError as error:
            result["delta"] = str(error)
        results.append(result)
    return results


# ----------------------------------------------------------------------------- the engine's vocabulary padding

PADDED = {**BASE, "model_type": "qwen2"}
"""An untied Qwen2 whose vocabulary (100) vLLM pads to 128: engine tp rank 1 holds 28 rows of padding in both its
embedding and its head (global rows 100-127, its local rows 36-63)."""


def garbage_padding(rank: int, world_size: int) -> dict[str, Any]:
    """Megatron tp=2 (ranks 0-1) into a vLLM tp=2 engine (ranks 2-3) whose tensors hold garbage (NaN, then 7.0:
    what vLLM's reload path leaves in its freshly materialised tensors): after each refit every engine element
    is the source's, or 0 in the vocabulary padding."""
    from shardcore.engine.live.layout_check import through_map
    from shardcore.engine.live.refit_check import known_tensor

    model = manifest_from_hf_config(PADDED, vocab_multiple=128)
    manifest = model.manifest
    plan = plan_refit(
        plan_layout(world_size, "tp=2,role=train + tp=2"), 0, [1], manifest, layouts={1: model.layout("vllm")}
    )
    mine = plan.for_rank(rank)
    expected = through_map(plan, rank)
    out: dict[str, Any] = {"wrong": [], "padding": {}}
    for step, garbage in enumerate((float("nan"), 7.0)):

        def full(name: str, step: int = step) -> torch.Tensor:
            return known_tensor(manifest.tensor(name), manifest.index(name)) + step

        sources = {n: cut(full(n), manifest.tensor(n), plan.source, rank, manifest) for n in mine.source_shapes}
        destinations = {name: torch.full(shape, garbage) for name, shape in mine.destination_shapes.items()}
        execute_refit(plan, sources, destinations, timeout=60)
        if expected is None:
            continue
        tp_rank = rank - 2
        for name, got in destinations.items():
            if name.endswith(("embed_tokens.weight", "lm_head.weight")):  # global row = 64 * tp rank + local row
                pad = [row for row in range(got.shape[0]) if 64 * tp_rank + row >= model.vocab]
                out["padding"][name] = (len(pad), bool(pad) and bool((got[pad] == 0).all()))
                real = [row for row in range(got.shape[0]) if row not in pad]
                if not torch.equal(got[real], full(_MEGATRON_OF[name])[[64 * tp_rank + r for r in real]]):
                    out["wrong"].append((step, name, "real rows"))
            if not torch.equal(got, expected(name, full)):
                out["wrong"].append((step, name))
    return out


_MEGATRON_OF = {
    "model.embed_tokens.weight": "embedding.word_embeddings.weight",
    "lm_head.weight": "output_layer.weight",
}
"""The Megatron tensor whose rows a vLLM vocabulary tensor holds (the same rows, up to the HF vocabulary)."""
