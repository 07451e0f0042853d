"""Converting refits, planned: destination dtypes, wire bytes, fp8 scale tensors and where they come from (no torch)."""

from __future__ import annotations

import json
import re
from dataclasses import replace
from pathlib import Path

import pytest

from shardcore.cli import main
from shardcore.errors import ManifestError, RefitError
from shardcore.plan.layout import plan_layout
from shardcore.refit import (
    ExplicitPlacement,
    HeldBox,
    Manifest,
    RefitPlan,
    RefitStats,
    ShardPlacement,
    TensorSpec,
    TransformerConfig,
    holdings,
    load_manifest,
    manifest_from_config,
    plan_refit,
    plan_refit_from,
    preset,
    tensors_matching,
)
from shardcore.refit.documents import manifest_from_dict
from shardcore.refit.manifest import blocked_from, scale_shape
from shardcore.refit.placement import check_fits
from shardcore.refit.scales import amax_exchange

# a model whose tp parts are whole 128x128 blocks at tp <= 2: head_dim 128, hidden 256
BLOCKY = TransformerConfig(layers=2, hidden=256, ffn=512, heads=2, kv_heads=2, vocab=1024, dtype="bfloat16")


def _blocky(to_dtype: str = "float8_e4m3fn", scale: str | None = None) -> Manifest:
    return manifest_from_config(BLOCKY, name="blocky").converted(to_dtype, scale)


# -- the manifest ---------------------------------------------------------------------------------


def test_wire_dtype_is_the_narrower_and_the_destination_when_as_wide() -> None:
    cases = {
        ("float32", "bfloat16"): ("bfloat16", 2),  # narrows: the sender casts
        ("bfloat16", "float32"): ("bfloat16", 2),  # widens: the receiver casts
        ("bfloat16", "float16"): ("float16", 2),  # as wide: the sender casts, the receiver writes in place
        ("bfloat16", "float8_e4m3fn"): ("float8_e4m3fn", 1),
        ("float8_e5m2", "float32"): ("float8_e5m2", 1),
    }
    for (dtype, to_dtype), (wire, size) in cases.items():
        tensor = TensorSpec("w", (256,), dtype, stage="all", to_dtype=to_dtype)
        assert (tensor.destination_dtype, tensor.wire_dtype, tensor.wire_itemsize) == (to_dtype, wire, size)
    same = TensorSpec("w", (4,), "float32", stage="all", to_dtype="float32")
    assert (
        same.to_dtype is None and same.wire_dtype == "float32" and same == TensorSpec("w", (4,), "float32", stage="all")
    )


LINEAR = ("linear_qkv.weight", "linear_proj.weight", "linear_fc1.weight", "linear_fc2.weight")
"""The linear layers' weights of a dense Megatron layer: what a model-wide fp8 conversion quantizes."""


def test_fp8_weights_bring_their_scale_tensors() -> None:
    plain = manifest_from_config(BLOCKY)
    blocks, per_tensor = _blocky(), _blocky(scale="tensor")
    linear = [t.name for t in plain if t.name.endswith(LINEAR)]
    assert len(linear) == 4 * BLOCKY.layers
    for manifest in (blocks, per_tensor):  # the linear weights, one scale tensor each; nothing else converts
        assert [t.name for t in manifest if t.to_dtype is not None] == linear
        assert [t.scale_of for t in manifest if t.scale_of is not None] == linear
    assert len(blocks) == len(per_tensor) == len(plain) + len(linear)
    assert blocks.tensors[: len(plain)] != plain.tensors and blocks.nbytes == plain.nbytes  # scales not counted
    fc1 = blocks.tensor("decoder.layers.1.mlp.linear_fc1.weight")
    assert (fc1.shape, fc1.blocks, fc1.scale) == ((1024, 256), (512, 512), "block")
    scale = blocks.tensor("decoder.layers.1.mlp.linear_fc1.weight_scale_inv")
    assert (scale.shape, scale.blocks, scale.tp_dim, scale.layer, scale.dtype, scale.scale_of) == (
        (8, 2),
        (4, 4),
        0,
        1,
        "float32",
        fc1.name,
    )
    assert blocks.index(scale.name) >= len(plain)  # appended: the weights keep their positions
    norm = Manifest((TensorSpec("norm", (256,), stage="all", to_dtype="float8_e4m3fn"),)).tensor("norm_scale_inv")
    assert norm.shape == (2,) and norm.tp_dim is None  # 1-d, converted on its own: one scale per 128 elements
    proj = per_tensor.tensor("decoder.layers.0.self_attention.linear_proj.weight_scale_inv")
    assert (proj.shape, proj.tp_dim, proj.layer) == ((1,), None, 0)
    assert Manifest(blocks.tensors, layers=2, name="blocky") == blocks  # a manifest of its own tensors is itself
    assert blocks.digest() != plain.digest() != per_tensor.digest() != blocks.digest()


def test_fp8_by_default_converts_the_linear_layers_weights_only() -> None:
    """``converted`` to fp8 (``--to-dtype``, a file's top-level ``to_dtype``) quantizes the linear layers' weights,
    as Transformer Engine and vLLM do: attention (MLA's projections too), MLP, expert and shared-expert weights;
    norms, q/k norms, biases, the embedding, the output layer and the router keep their dtype. A cast converts every
    floating tensor, and a tensor fp8 leaves alone keeps a conversion of its own."""
    qwen = TransformerConfig(layers=2, hidden=128, ffn=256, heads=2, vocab=256, qkv_bias=True, qk_norm=True)
    mla = TransformerConfig(
        layers=2, hidden=128, ffn=256, heads=2, vocab=256, experts=4, moe_ffn=64, shared_experts=1, dense_layers=1,
        q_lora_rank=64, kv_lora_rank=32, qk_head_dim=32, qk_pos_emb_head_dim=16, v_head_dim=32,
    )  # fmt: skip
    for model in (manifest_from_config(qwen), preset("tiny-moe"), manifest_from_config(mla)):
        fp8 = model.converted("float8_e4m3fn", "tensor")  # tiny-moe: gate and up of 64 rows each
        kept = {t.name for t in fp8 if t.to_dtype is None and t.scale_of is None}
        linear = {t.name for t in model if t.name not in kept}
        assert all(t.linear == (t.name in linear) for t in model)
        assert kept == {t.name for t in model if t.name.endswith(("norm.weight", "bias"))} | {
            t.name for t in model if t.name.endswith(("router.weight", "embeddings.weight", "output_layer.weight"))
        }, model.name
        assert all(".linear_" in name for name in linear), model.name
        assert all(t.to_dtype == "float16" for t in model.converted("float16") if t.dtype != "float16")
    mixed = preset("tiny-moe").converted("bfloat16").converted("float8_e4m3fn", "tensor")
    assert mixed.tensor("decoder.layers.1.mlp.router.weight").to_dtype == "bfloat16"
    assert mixed.tensor("decoder.layers.1.mlp.experts.linear_fc2.weight7").scale == "tensor"
    stacked = TensorSpec("mlp.experts.w13_weight", (4, 256, 128), stage="all")
    assert stacked.linear and not TensorSpec("model.layers.0.mlp.gate.weight", (4, 128), stage="all").linear
    assert not TensorSpec("lm_head.weight", (256, 128), stage="last").linear
    assert TensorSpec("model.layers.0.mlp.gate_proj.weight", (256, 128), stage="all").linear


def test_converted_leaves_non_floating_tensors_alone() -> None:
    manifest = Manifest(
        (TensorSpec("ids", (8,), "int64", stage="all"), TensorSpec("w", (300, 200), "float32", stage="all"))
    ).converted("float8_e4m3fn")
    assert manifest.tensor("ids").to_dtype is None
    assert manifest.tensor("w_scale_inv").shape == (3, 2)  # a block cut by the tensor's end still has a scale
    assert manifest.converted("bfloat16").tensor("w").scale is None and len(manifest.converted("bfloat16")) == 2


def test_file_form_round_trips_with_per_tensor_and_default_conversions(tmp_path: Path) -> None:
    yaml_text = """
name: mixed
layers: 1
to_dtype: float8_e4m3fn
scale: tensor
tensors:
  - {name: emb, shape: [256, 128], tp_dim: 0, stage: first, dtype: float32}
  - {name: fc1, shape: [256, 128], tp_dim: 0, blocks: [128, 128], layer: 0, scale: block}
  - {name: norm, shape: [128], layer: 0, to_dtype: bfloat16, dtype: float32}
  - {name: ids, shape: [8], layer: 0, dtype: int32}
  - {name: embedding.word_embeddings.weight, shape: [256, 128], tp_dim: 0, stage: first}
  - {name: fc2, shape: [128, 128], tp_dim: 1, layer: 0, to_dtype: null}
  - {name: q_norm, shape: [128], layer: 0, to_dtype: float8_e4m3fn}
  - {name: k_norm, shape: [128], layer: 0}
"""
    path = tmp_path / "m.yaml"
    path.write_text(yaml_text)
    loaded = load_manifest(path)
    assert [(t.name, t.to_dtype, t.scale) for t in loaded] == [
        ("emb", "float8_e4m3fn", "tensor"),  # a matrix by a name the rule does not know: a linear weight
        ("fc1", "float8_e4m3fn", "block"),
        ("norm", "bfloat16", None),
        ("ids", None, None),
        ("embedding.word_embeddings.weight", None, None),  # fp8 by default: linear layers' weights only
        ("fc2", None, None),  # a tensor's own to_dtype wins, both ways
        ("q_norm", "float8_e4m3fn", "tensor"),
        ("k_norm", None, None),
        ("emb_scale_inv", None, None),
        ("fc1_scale_inv", None, None),
        ("q_norm_scale_inv", None, None),
    ]
    assert loaded.to_dict()["tensors"][1] == {
        "name": "fc1",
        "shape": [256, 128],
        "dtype": "bfloat16",
        "tp_dim": 0,
        "blocks": [128, 128],
        "layer": 0,
        "to_dtype": "float8_e4m3fn",
        "scale": "block",
    }
    path.write_text(json.dumps(loaded.to_dict()))
    assert load_manifest(path) == loaded
    config = manifest_from_dict({"config": BLOCKY.__dict__, "to_dtype": "float8_e4m3fn", "scale": "tensor"})
    assert config == manifest_from_config(BLOCKY).converted("float8_e4m3fn", "tensor")


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"to_dtype": "float9"}, r"tensor w: to_dtype 'float9' is not a dtype: choose one of float64, .*float8_e4m3fn"),
        ({"to_dtype": ["bf16"]}, r"to_dtype \['bf16'\] is not a dtype"),
        ({"dtype": "int64", "to_dtype": "float8_e4m3fn"}, "tensor w: cannot convert int64 to float8_e4m3fn"),
        ({"to_dtype": "int8"}, "tensor w: cannot convert bfloat16 to int8: a refit converts only between"),
        ({"to_dtype": "float8_e8m0fnu"}, "cannot convert bfloat16 to float8_e8m0fnu"),
        ({"to_dtype": "bfloat16", "dtype": "float32", "scale": "block"}, "scale='block' needs to_dtype float8_e4m3fn"),
        ({"to_dtype": "float8_e4m3fn", "scale": "row"}, "scale 'row' is not one of block, tensor"),
        (
            {"to_dtype": "float8_e4m3fn", "shape": (2, 256, 128), "tp_dim": 1, "blocks": (100, 156)},
            r"w \[2, 256, 128\]: packed blocks \[100, 156\] must be",
        ),
        ({"to_dtype": "float8_e4m3fn", "tp_dim": 0, "blocks": (100, 156)}, r"packed blocks \[100, 156\] must be"),
        ({"to_dtype": "x" * 5000}, "is not a dtype"),
    ],
)
def test_bad_conversions_are_typed_errors_naming_the_tensor(fields: dict[str, object], message: str) -> None:
    spec = {"name": "w", "shape": (256, 128), "stage": "all", **fields}
    with pytest.raises(ManifestError, match=message) as raised:
        TensorSpec(**spec)  # type: ignore[arg-type]
    assert len(str(raised.value)) < 1000


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"to_dtype": "float9", "tensors": [{"name": "w", "shape": [4], "stage": "all"}]}, "the manifest: to_dtype"),
        ({"scale": "tensor", "tensors": [{"name": "w", "shape": [4], "stage": "all"}]}, "scale='tensor' needs"),
        ({"config": BLOCKY.__dict__, "to_dtype": "int8"}, "'int8' is not a floating dtype a refit converts to"),
        (
            {"to_dtype": "float8_e4m3fn", "tensors": [{"name": "n", "shape": [4], "stage": "all", "scale": "block"}]},
            "tensor n: scale='block' needs to_dtype float8_e4m3fn",  # fp8 by default leaves a norm alone
        ),
        (
            {
                "tensors": [
                    {"name": "w", "shape": [4], "stage": "all", "to_dtype": "float8_e4m3fn"},
                    {"name": "w_scale_inv", "shape": [4], "stage": "all"},
                ]
            },
            "tensor w_scale_inv: that name holds the block scales of w",
        ),
    ],
)
def test_bad_conversion_documents(data: dict[str, object], message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        manifest_from_dict(data)


def test_a_scale_tensor_needs_its_weight() -> None:
    orphan = TensorSpec("w_scale_inv", (1,), "float32", stage="all", scale_of="w")
    with pytest.raises(ManifestError, match="scale_of='w' names no fp8 weight"):
        Manifest((orphan,))
    with pytest.raises(ManifestError, match="is float32 both sides"):
        TensorSpec("s", (1,), "bfloat16", stage="all", scale_of="w")


# -- planning: wire bytes and where the scales lie ---------------------------------------------------


def _stats(manifest: Manifest, spec: str = "tp=2,dp=2,role=train + tp=1,dp=2 + tp=2") -> RefitStats:
    layout = plan_layout(8, spec)
    return RefitStats.of(plan_refit(layout, 0, [1, 2], manifest))


def test_the_plan_and_the_cost_model_count_wire_bytes() -> None:
    plain = manifest_from_config(BLOCKY)
    base = _stats(plain)
    assert _stats(plain.converted("float32")).total_bytes == base.total_bytes  # widening: bf16 on the wire
    wide = manifest_from_config(BLOCKY.__class__(**{**BLOCKY.__dict__, "dtype": "float32"}))
    assert _stats(wide).total_bytes == 2 * base.total_bytes
    assert _stats(wide.converted("bfloat16")).total_bytes == base.total_bytes  # narrowing: bf16 on the wire
    layout = plan_layout(8, "tp=2,dp=2,role=train + tp=1,dp=2 + tp=2")
    sent = [t for t in plan_refit(layout, 0, [1, 2], plain).transfers() if not t.is_local]
    linear = sum(t.bytes for t in sent if t.tensor.endswith(LINEAR))
    assert 0 < linear < base.total_bytes
    for scale in ("block", "tensor"):  # the linear weights in fp8 and their scales, the rest in bf16
        fp8 = _stats(_blocky(scale=scale))
        assert fp8.scale_bytes > 0 and fp8.total_bytes == base.total_bytes - linear // 2 + fp8.scale_bytes
        assert fp8.to_dict()["scale_bytes"] == fp8.scale_bytes
    plan = plan_refit(layout, 0, [1, 2], _blocky())
    scales = [t for t in plan.transfers() if t.tensor.endswith("_scale_inv")]
    assert sum(t.bytes for t in scales if not t.is_local) == RefitStats.of(plan).scale_bytes
    assert all(
        t.bytes == 4 * (t.box[0][1] - t.box[0][0]) * (t.box[1][1] - t.box[1][0]) for t in scales if len(t.box) == 2
    )
    assert (
        plan.fingerprint()["manifest"]
        != plan_refit(layout, 0, [1, 2], manifest_from_config(BLOCKY)).fingerprint()["manifest"]
    )


def test_stacked_tensors_are_blocked_per_matrix() -> None:
    """A tensor of more than 2 dims (stacked experts) has block scales per matrix: its leading dims are batch,
    kept as they are in the scale tensor; only its last two are blocked, so only a split along those must keep
    whole blocks (a split of the experts may fall anywhere), and packed blocks along a batch dim are not scaled."""
    assert [blocked_from(n) for n in (1, 2, 3, 4)] == [0, 0, 1, 2]
    assert scale_shape((300,)) == (3,) and scale_shape((300, 200)) == (3, 2)
    assert scale_shape((6, 512, 200)) == (6, 4, 2) and scale_shape((2, 3, 129, 128)) == (2, 3, 2, 1)
    rows = TensorSpec("w13", (6, 512, 256), tp_dim=1, blocks=(256, 256), stage="all", to_dtype="float8_e4m3fn")
    experts = TensorSpec("w2", (6, 256, 384), tp_dim=0, blocks=(2, 4), stage="all", to_dtype="float8_e4m3fn")
    scales = Manifest((rows, experts))
    assert (scales.tensor("w13_scale_inv").shape, scales.tensor("w13_scale_inv").blocks) == ((6, 4, 2), (2, 2))
    assert (scales.tensor("w2_scale_inv").shape, scales.tensor("w2_scale_inv").blocks) == ((6, 2, 3), (2, 4))
    for spec in ("tp=2,dp=2", "tp=1,dp=4"):  # experts 1 and 2 of each packed block a tp=2 rank
        plan = plan_layout(4, spec).shards[0]
        check_fits(scales, plan)
        for weight in (rows, experts):
            for rank in range(4):
                held = holdings(weight, plan, rank, scales)
                cells = tuple(
                    (
                        (box[0], *((start // 128, -(-stop // 128)) for start, stop in box[1:])),
                        (offset[0], *(o // 128 for o in offset[1:])),
                    )
                    for box, offset in held
                )
                assert holdings(scales.tensor(f"{weight.name}_scale_inv"), plan, rank, scales) == cells
    odd = Manifest((TensorSpec("w", (2, 200, 128), tp_dim=1, stage="all", to_dtype="float8_e4m3fn"),))
    with pytest.raises(ManifestError, match=r"w \[2, 200, 128\]: its dim 1 \(200\) splits into parts of 100"):
        check_fits(odd, plan_layout(2, "tp=2").shards[0])
    assert _moved(plan_refit(plan_layout(4, "tp=2,role=train + tp=1,dp=2"), 0, 1, scales)) == {
        "w13", "w2", "w13_scale_inv", "w2_scale_inv"
    }  # fmt: skip


def test_block_scales_lie_with_their_blocks_on_every_rank() -> None:
    manifest = _blocky()
    for spec in ("tp=2,dp=2", "tp=1,pp=2,dp=2", "tp=2,cp=2"):
        plan = plan_layout(4, spec).shards[0]
        for weight in manifest:
            scale = weight.scale_spec()
            if scale is None:
                continue
            for rank in range(4):
                held = holdings(weight, plan, rank, manifest)
                cells = tuple(
                    (tuple((start // 128, -(-stop // 128)) for start, stop in box), tuple(o // 128 for o in offset))
                    for box, offset in held
                )
                assert holdings(manifest.tensor(scale.name), plan, rank, manifest) == cells, (spec, weight.name, rank)


def test_the_caller_passes_weights_and_receives_scales() -> None:
    layout = plan_layout(8, "tp=2,dp=2,role=train + tp=1,dp=2 + tp=2")
    plan = plan_refit(layout, 0, [1, 2], _blocky(scale="tensor"))
    source, destination = plan.for_rank(0), plan.for_rank(4)
    name = "decoder.layers.0.mlp.linear_fc2.weight"
    assert name in source.source_shapes and f"{name}_scale_inv" not in source.source_shapes  # computed
    assert destination.destination_shapes[f"{name}_scale_inv"] == (1,)
    assert any(t.tensor == f"{name}_scale_inv" for t in destination.recvs)
    assert destination.destination_shapes[name] == (256, 512)


def test_a_block_that_straddles_a_tp_part_is_refused_before_planning() -> None:
    manifest = preset("tiny-dense").converted("float8_e4m3fn")  # linear_qkv: 384 rows, 192 per tp=2 part
    layout = plan_layout(4, "tp=2,role=train + tp=1,dp=2")
    with pytest.raises(ManifestError) as raised:
        plan_refit(layout, 0, 1, manifest)
    message = str(raised.value)
    assert "linear_qkv.weight [384, 128]" in message and "parts of 192 over tp=2 of shard 0" in message
    assert "choose a tp that divides its 3 blocks; or give it scale: tensor" in message
    odd = Manifest((TensorSpec("w", (200, 128), tp_dim=0, stage="all", to_dtype="float8_e4m3fn"),))
    with pytest.raises(ManifestError, match=r"w \[200, 128\]: .* shard 1 .*200 is no multiple of 128, so only tp=1"):
        plan_refit(plan_layout(3, "tp=1,role=train + tp=2"), 0, 1, odd)
    cut = plan_refit(plan_layout(3, "tp=1,role=train + tp=1,dp=2"), 0, 1, odd)  # tp=1: the last block may be cut
    assert _moved(cut) == {"w", "w_scale_inv"}
    per_tensor = plan_refit(layout, 0, 1, manifest.converted("float8_e4m3fn", "tensor"))  # per tensor: any split
    assert _moved(per_tensor) == {tensor.name for tensor in per_tensor.manifest}


def test_presets_keep_whole_blocks_at_tp_up_to_8() -> None:
    for name in ("llama3-8b", "llama3-70b", "deepseek-v3"):
        manifest = preset(name).converted("float8_e4m3fn")
        for tp in (2, 8):
            plan_refit(plan_layout(2 * tp, f"tp={tp},role=train + tp={tp}"), 0, 1, manifest)


def test_tiny_fp8_keeps_whole_blocks_at_tp_up_to_4_for_live_checks() -> None:
    manifest = preset("tiny-fp8").converted("float8_e4m3fn")
    assert manifest.nbytes < 10e6
    for source, destination in ((1, 4), (2, 1), (4, 2), (2, 2)):
        layout = plan_layout(source + 2 * destination, f"tp={source},role=train + tp={destination},dp=2")
        stats = RefitStats.of(plan_refit(layout, 0, 1, manifest))
        assert stats.scale_bytes > 0
    with pytest.raises(ManifestError, match="choose a tp that divides"):
        plan_refit(plan_layout(16, "tp=8,role=train + tp=8"), 0, 1, manifest)


def test_explicit_placements_do_not_carry_scales() -> None:
    manifest = Manifest((TensorSpec("w", (4, 4), "float32", stage="all", to_dtype="float8_e4m3fn", scale="tensor"),))
    source = ExplicitPlacement(manifest, [HeldBox("w", 0, ((0, 4), (0, 4))), HeldBox("w_scale_inv", 0, ((0, 1),))])
    target = ExplicitPlacement(manifest, [HeldBox("w", 1, ((0, 4), (0, 4))), HeldBox("w_scale_inv", 1, ((0, 1),))])
    with pytest.raises(RefitError, match="explicit: tensor w converts to float8_e4m3fn with scales"):
        plan_refit_from(source, target)
    shards = plan_layout(4, "tp=2 + tp=2")
    cast = Manifest((TensorSpec("w", (4, 4), "float32", stage="all", to_dtype="bfloat16"),))
    casting = plan_refit_from(
        ExplicitPlacement(cast, [HeldBox("w", 0, ((0, 4), (0, 4)))]),
        ExplicitPlacement(cast, [HeldBox("w", 1, ((0, 4), (0, 4)))]),
    )
    assert [(t.tensor, t.src, t.dst, t.bytes) for t in casting.transfers()] == [("w", 0, 1, 4 * 4 * 2)]  # bf16 wire
    fp8 = _blocky(scale="tensor")
    restricted = ShardPlacement(shards.shards[0], fp8).restrict({0: 0, 1: 1})
    shard_scales = plan_refit_from(restricted, ShardPlacement(shards.shards[1], fp8))
    assert _moved(shard_scales) == {tensor.name for tensor in fp8}  # a shard placement carries the scales


def _moved(plan: RefitPlan) -> set[str]:
    """The tensors a plan moves (``assert plan_refit(...)`` could never fail: a plan has no ``__bool__``)."""
    return {transfer.tensor for transfer in plan.transfers()}


# -- the partial-amax exchange of per-tensor scales -------------------------------------------------


def test_every_holder_gets_every_other_parts_amax_from_its_own_replica() -> None:
    layout = plan_layout(12, "tp=2,dp=2,cp=2,role=train + tp=2,dp=2")
    whole = "decoder.layers.0.input_layernorm.weight"  # converted on its own: a tensor every tp rank holds whole
    manifest = _blocky(scale="tensor")
    tensors = tuple(replace(t, to_dtype="float8_e4m3fn", scale="tensor") if t.name == whole else t for t in manifest)
    plan = plan_refit(layout, 0, 1, Manifest(tensors, layers=BLOCKY.layers))
    parts = {rank: amax_exchange(plan, rank) for rank in range(12)}
    sends = sorted(t for part in parts.values() for t in part.sends)
    assert sends == sorted(t for part in parts.values() for t in part.recvs)  # both ends derive each message
    grid = layout.shards[0].decoder_grid
    for transfer in sends:
        a, b = grid.coords(transfer.src), grid.coords(transfer.dst)
        assert (a["dp"], a["cp"], a["pp"]) == (b["dp"], b["cp"], b["pp"]) and a["tp"] != b["tp"]
    split = "decoder.layers.0.mlp.linear_fc1.weight"
    for rank in range(8):
        assert parts[rank].parts[split] == (grid.coords(rank)["tp"], 2) and parts[rank].parts[whole] == (0, 1)
        assert [t.src for t in parts[rank].recvs if t.tensor == split] == [rank ^ 1]  # the other tp rank
        assert not [t for t in parts[rank].recvs if t.tensor == whole]  # held whole: nothing to exchange
    assert all(not part.sends and not part.parts for rank, part in parts.items() if rank >= 8)
    assert not amax_exchange(plan_refit(layout, 0, 1, _blocky()), 0).sends  # block scales: none


def test_a_partial_refit_exchanges_the_amaxes_of_its_own_weights_only() -> None:
    # the CLI's `--tensors '*linear_fc1*' --scale tensor` made every source rank wait for (and need the source
    # tensors of) every per-tensor-scaled weight it held: a raw KeyError on a tensor outside the selection
    layout = plan_layout(4, "tp=2,role=train + tp=2")
    full = plan_refit(layout, 0, 1, _blocky(scale="tensor"))
    part = full.subset(tensors_matching(full.manifest, "*linear_fc1*"))
    for rank in range(2):
        mine, exchange = part.for_rank(rank), amax_exchange(part, rank)
        moved = {t.tensor for t in (*exchange.sends, *exchange.recvs)} | set(exchange.parts)
        assert moved and all("linear_fc1" in name for name in moved), moved
        assert moved <= set(mine.source_shapes)  # what a rank passes from for_rank(r).source_shapes suffices
        assert len(amax_exchange(full, rank).parts) > len(exchange.parts)


def test_survivors_with_uneven_replicas_still_get_every_part() -> None:
    layout = plan_layout(8, "tp=2,dp=3 + tp=2")
    manifest = _blocky(scale="tensor")
    source = ShardPlacement(layout.shards[0], manifest).restrict({0: 0, 1: 1, 2: 2, 4: 3, 5: 4})  # lost rank 3
    plan = plan_refit_from(source, ShardPlacement(layout.shards[1], manifest), world_size=8)
    parts = {rank: amax_exchange(plan, rank) for rank in range(5)}
    assert sorted(t for p in parts.values() for t in p.sends) == sorted(t for p in parts.values() for t in p.recvs)
    name = "decoder.layers.1.self_attention.linear_qkv.weight"
    for rank in range(5):
        got = {t.box[0][0] for t in parts[rank].recvs if t.tensor == name} | {parts[rank].parts[name][0]}
        assert got == {0, 1}


# -- the CLI ---------------------------------------------------------------------------------------

SPEC = "tp=2,role=train + tp=1,dp=2"
BASE = ("refit", "--world", "4", "--shards", SPEC, "--from", "0", "--to", "1", "--model", "tiny-dense")


def _run(capsys: pytest.CaptureFixture[str], *argv: str) -> tuple[int, str, str]:
    code = main(list(argv))
    out, err = capsys.readouterr()
    return code, out, err


def test_cli_to_dtype_plans_wire_bytes(capsys: pytest.CaptureFixture[str]) -> None:
    code, out, err = _run(capsys, *BASE, "--to-dtype", "bfloat16")
    assert code == 0 and err == ""
    assert "converting 26 tensors (26 float32 -> bfloat16): bytes are wire bytes" in out
    code, out, _ = _run(capsys, *BASE, "--to-dtype", "float8_e4m3fn", "--scale", "tensor")
    assert "converting 16 tensors (16 float32 -> float8_e4m3fn with tensor scales)" in out  # 4 linear weights a layer
    code, out, _ = _run(capsys, *BASE, "--to-dtype", "float8_e4m3fn", "--scale", "tensor", "--json")
    data = json.loads(out)
    manifest = preset("tiny-dense").converted("float8_e4m3fn", "tensor")
    stats = RefitStats.of(plan_refit(plan_layout(4, SPEC), 0, 1, manifest))
    assert data["total_bytes"] == stats.total_bytes and data["scale_bytes"] == stats.scale_bytes > 0
    fc1 = "decoder.layers.0.mlp.linear_fc1.weight"
    assert data["tensors"][fc1] == {
        "shape": [1024, 128],
        "dtype": "float32",
        "itemsize": 4,
        "to_dtype": "float8_e4m3fn",
        "wire_dtype": "float8_e4m3fn",
        "wire_itemsize": 1,
        "scale": "tensor",
    }
    assert data["tensors"][f"{fc1}_scale_inv"]["scale_of"] == fc1
    for kept in ("embedding.word_embeddings.weight", "decoder.layers.0.input_layernorm.weight"):
        assert "to_dtype" not in data["tensors"][kept] and f"{kept}_scale_inv" not in data["tensors"]


@pytest.mark.parametrize(
    ("extra", "message"),
    [
        (("--to-dtype", "float9"), "to_dtype 'float9' is not a dtype"),
        (("--to-dtype", "int8"), "'int8' is not a floating dtype a refit converts to"),
        (("--scale", "tensor"), "--scale tensor needs --to-dtype float8_e4m3fn"),
        (("--to-dtype", "bfloat16", "--scale", "block"), "scale='block' needs to_dtype float8_e4m3fn"),
        (("--to-dtype", "float8_e4m3fn"), r"linear_qkv.weight \[384, 128\]: .* or give it scale: tensor"),
    ],
)
def test_cli_bad_conversions_are_one_line(
    capsys: pytest.CaptureFixture[str], extra: tuple[str, ...], message: str
) -> None:
    code, out, err = _run(capsys, *BASE, *extra)
    assert code == 2 and out == ""
    assert err.startswith("shardcore: error: ") and len(err.strip().splitlines()) == 1
    assert re.search(message, err), err


def test_cli_search_refuses_to_dtype(capsys: pytest.CaptureFixture[str]) -> None:
    argv = ("refit", "--search", "--world", "4", "--shards", "tp=2", "--from", "0", "--ranks", "2")
    code, _, err = _run(capsys, *argv, "--memory-gb", "80", "--model", "tiny-dense", "--to-dtype", "bfloat16")
    assert code == 2 and "--search ranks layouts by the manifest's own dtypes" in err
