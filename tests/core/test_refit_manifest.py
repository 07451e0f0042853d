"""Refit manifests: Megatron-Core's GPT conventions on named tensors, file loading, presets, typed errors."""

from __future__ import annotations

import hashlib
import json
from dataclasses import replace
from pathlib import Path
from typing import Any

import pytest

from shardcore.errors import ManifestError, RefitError, ShardcoreError
from shardcore.plan.arguments import shown
from shardcore.plan.layout import plan_layout
from shardcore.refit import (
    PRESETS,
    Manifest,
    TensorSpec,
    TransformerConfig,
    holdings,
    load_manifest,
    local_shape,
    manifest_from_config,
    plan_refit,
    preset,
)
from shardcore.refit.documents import manifest_from_dict, model_manifest
from shardcore.refit.manifest import hash_names, split_layers

LLAMA = TransformerConfig(layers=4, hidden=64, ffn=96, heads=8, kv_heads=2, vocab=256)


def test_megatron_split_dims_on_named_tensors() -> None:
    manifest = manifest_from_config(LLAMA)
    plan = plan_layout(2, "tp=2").shards[0]
    # column-parallel: dim 0; row-parallel: dim 1; vocab-parallel embedding and output head: dim 0
    assert holdings(manifest.tensor("decoder.layers.0.self_attention.linear_qkv.weight"), plan, 1, manifest) == (
        (((48, 96), (0, 64)), (0, 0)),
    )
    assert holdings(manifest.tensor("decoder.layers.0.self_attention.linear_proj.weight"), plan, 1, manifest) == (
        (((0, 64), (32, 64)), (0, 0)),
    )
    assert holdings(manifest.tensor("decoder.layers.0.mlp.linear_fc2.weight"), plan, 0, manifest)[0][0] == (
        (0, 64),
        (0, 48),
    )
    for name in ("embedding.word_embeddings.weight", "output_layer.weight"):
        assert holdings(manifest.tensor(name), plan, 1, manifest) == ((((128, 256), (0, 64)), (0, 0)),)
    # norms are replicated over tp
    norm = manifest.tensor("decoder.layers.3.input_layernorm.weight")
    assert [holdings(norm, plan, rank, manifest) for rank in (0, 1)] == [((((0, 64),), (0,)),)] * 2


def test_swiglu_fc1_is_two_packed_blocks() -> None:
    manifest = manifest_from_config(LLAMA)
    fc1 = manifest.tensor("decoder.layers.1.mlp.linear_fc1.weight")
    assert fc1.shape == (192, 64) and fc1.blocks == (96, 96)
    plan = plan_layout(4, "tp=4").shards[0]
    # tp rank 2 holds [gate_2; up_2]: rows 48:72 of the gate and 144:168 (the up block) in its 48 local rows
    assert holdings(fc1, plan, 2, manifest) == (
        (((48, 72), (0, 64)), (0, 0)),
        (((144, 168), (0, 64)), (24, 0)),
    )
    assert local_shape(fc1, plan, 2, manifest) == (48, 64)


def test_qkv_splits_by_whole_query_groups() -> None:
    manifest = manifest_from_config(LLAMA)  # 2 query groups of (4 q + k + v) heads of 8
    qkv = manifest.tensor("decoder.layers.0.self_attention.linear_qkv.weight")
    assert qkv.shape == (96, 64) and qkv.unit == 48
    layout = plan_layout(4, "tp=4")
    with pytest.raises(ManifestError, match=r"linear_qkv.weight \[96, 64\].*48-element units over tp=4 of shard 0"):
        plan_refit(layout, 0, 0, manifest)


def test_pipeline_placement_embedding_first_head_last() -> None:
    manifest = manifest_from_config(LLAMA)
    plan = plan_layout(2, "tp=1,pp=2").shards[0]
    assert local_shape(manifest.tensor("embedding.word_embeddings.weight"), plan, 0, manifest) == (256, 64)
    assert local_shape(manifest.tensor("embedding.word_embeddings.weight"), plan, 1, manifest) is None
    for name in ("output_layer.weight", "decoder.final_layernorm.weight", "decoder.layers.2.mlp.linear_fc2.weight"):
        assert local_shape(manifest.tensor(name), plan, 0, manifest) is None
        assert local_shape(manifest.tensor(name), plan, 1, manifest) is not None


def test_tied_embeddings_sit_on_first_and_last_stage() -> None:
    manifest = preset("tiny-dense")
    assert "output_layer.weight" not in {t.name for t in manifest}
    embedding = manifest.tensor("embedding.word_embeddings.weight")
    plan = plan_layout(4, "tp=1,pp=4").shards[0]
    assert [local_shape(embedding, plan, rank, manifest) is not None for rank in range(4)] == [True, False, False, True]


def test_uneven_pipeline_split_follows_megatron() -> None:
    assert split_layers(61, 16, 3, 2) == (range(3), *(range(3 + 4 * i, 7 + 4 * i) for i in range(14)), range(59, 61))
    assert split_layers(10, 4, None, 1) == (range(3), range(3, 6), range(6, 9), range(9, 10))
    assert split_layers(8, 1, 3, 3) == (range(8),)
    with pytest.raises(ManifestError, match="61 layers over pp=16 do not split evenly"):
        split_layers(61, 16)


def test_experts_spread_over_ep_split_over_expt_tp_replicated_over_expt_dp() -> None:
    manifest = preset("tiny-moe")  # 8 experts, layers 1-3 MoE
    plan = plan_layout(8, "tp=2,dp=4,ep=4,expt_tp=1").shards[0]  # expt_dp = 2
    fc1 = manifest.tensor("decoder.layers.2.mlp.experts.linear_fc1.weight5")
    owners = [rank for rank in range(8) if local_shape(fc1, plan, rank, manifest) is not None]
    assert len(owners) == 2  # ep rank 2 of 4 (experts 4-5), two expt_dp replicas
    assert all(plan.expert_grid.coords(rank)["ep"] == 2 for rank in owners)
    assert local_shape(fc1, plan, owners[0], manifest) == fc1.shape  # expt_tp=1: whole
    shared = manifest.tensor("decoder.layers.2.mlp.shared_experts.linear_fc1.weight")
    assert local_shape(shared, plan, 0, manifest) == (64, 128)  # split over tp like a dense MLP
    router = manifest.tensor("decoder.layers.2.mlp.router.weight")
    assert router.tp_dim is None and router.shape == (8, 128)
    with pytest.raises(ManifestError, match="8 experts do not divide by ep=3"):
        plan_refit(plan_layout(6, "tp=1,dp=6,ep=3"), 0, 0, manifest)


def test_presets() -> None:
    assert set(PRESETS) >= {"llama3-8b", "llama3-70b", "deepseek-v3", "tiny-dense", "tiny-moe"}
    deepseek = preset("deepseek-v3")
    assert deepseek.layers == 61 and deepseek.experts == 256
    assert 1.3e12 < deepseek.nbytes < 1.4e12  # 671B parameters in bf16, without the MTP layer
    assert 15e9 < preset("llama3-8b").nbytes < 17e9
    assert 1e6 < preset("tiny-dense").nbytes < 10e6 and 1e6 < preset("tiny-moe").nbytes < 10e6
    with pytest.raises(ManifestError, match="unknown model preset 'gpt5'"):
        preset("gpt5")


def test_shapes_names_and_converting_tensors_read_the_manifests_own() -> None:
    model = manifest_from_config(LLAMA)
    assert dict(model.shapes) == {tensor.name: tensor.shape for tensor in model} and len(model.shapes) == len(model)
    with pytest.raises(KeyError):
        model.shapes["decoder.layers.9.mlp.linear_fc1.weight"]
    assert model.names == {tensor.name for tensor in model}
    assert model.converting == frozenset() and not model.converts
    fp8 = model.converted("float8_e4m3fn", scale="tensor")
    assert fp8.converting == {tensor.name for tensor in fp8 if tensor.to_dtype is not None} and fp8.converts
    assert "decoder.layers.0.mlp.linear_fc1.weight" in fp8.converting
    assert "decoder.final_layernorm.weight" not in fp8.converting  # a norm keeps its dtype


def test_json_and_yaml_round_trip(tmp_path: Path) -> None:
    manifest = preset("tiny-moe")
    path = tmp_path / "m.json"
    path.write_text(json.dumps(manifest.to_dict()))
    assert load_manifest(path) == manifest
    yaml_text = """
name: two
layers: 1
dtype: float32
tensors:
  - {name: emb, shape: [8, 4], tp_dim: 0, stage: [first, last]}
  - {name: fc1, shape: [8, 4], tp_dim: 0, blocks: [4, 4], layer: 0, dtype: bfloat16}
"""
    path = tmp_path / "m.yaml"
    path.write_text(yaml_text)
    loaded = load_manifest(path)
    assert loaded.tensor("emb").stage == ("first", "last") and loaded.tensor("emb").itemsize == 4
    assert loaded.tensor("fc1").blocks == (4, 4) and loaded.tensor("fc1").itemsize == 2
    path.write_text(
        json.dumps({"name": "cfg", "config": {"layers": 2, "hidden": 64, "ffn": 128, "heads": 4, "vocab": 128}})
    )
    assert len(load_manifest(path)) == 1 + 2 * 6 + 2


def test_the_digest_is_shared_by_equal_manifests_and_moved_by_any_field() -> None:
    """Ranks compare the manifest's digest before a refit: a manifest read back from its file form has its
    original's, and a change to any one field a file writes (of one tensor, or of the model) gives another."""
    manifest = preset("tiny-moe")
    assert manifest_from_dict(manifest.to_dict()).digest() == manifest.digest()
    fc1 = manifest.index("decoder.layers.0.mlp.linear_fc1.weight")
    expert = next(p for p, tensor in enumerate(manifest.tensors) if tensor.expert is not None)
    changes: list[tuple[int, dict[str, Any]]] = [
        (0, {"name": "renamed"}),
        (0, {"dtype": "bfloat16"}),
        (0, {"stage": ("first", "last")}),
        (0, {"unit": 2}),
        (0, {"tp_dim": 1, "blocks": (128,)}),
        (fc1, {"blocks": (256, 768)}),
        (fc1, {"shape": (2048, 128), "blocks": (1024, 1024)}),
        (fc1, {"layer": 1}),
        (fc1, {"to_dtype": "bfloat16"}),
        (fc1, {"to_dtype": "float8_e4m3fn"}),
        (fc1, {"to_dtype": "float8_e4m3fn", "scale": "tensor"}),
        (expert, {"expert": manifest.tensors[expert].expert + 1}),
    ]
    digests = {manifest.digest()}
    for position, change in changes:
        tensors = [tensor for tensor in manifest.tensors if tensor.scale_of is None]
        tensors[position] = replace(tensors[position], **change)
        changed = replace(manifest, tensors=tuple(tensors))
        assert changed.digest() not in digests, change
        digests.add(changed.digest())
    for model in ({"name": "other"}, {"layers": manifest.layers + 1}, {"experts": manifest.experts + 1}):
        changed = replace(manifest, **model)
        assert changed.digest() not in digests, model
        digests.add(changed.digest())


@pytest.mark.parametrize(
    ("data", "message"),
    [
        ({"tensors": [{"name": "w", "shape": [4, 0], "stage": "all"}]}, "tensor w: shape entry=0"),
        ({"tensors": [{"name": "w", "shape": [4], "tp_dim": 1, "stage": "all"}]}, r"tensor w \[4\]: tp_dim=1"),
        ({"tensors": [{"name": "w", "shape": [8], "tp_dim": 0, "blocks": [4, 3], "stage": "all"}]}, "sum to 7"),
        ({"tensors": [{"name": "w", "shape": [4]}]}, "tensor w: give exactly one of layer"),
        ({"tensors": [{"name": "w", "shape": [4], "stage": "middle"}]}, "stage='middle': expected first"),
        ({"tensors": [{"name": "w", "shape": [4], "layer": 2}], "layers": 2}, "layer 2 is outside the model's 2"),
        ({"tensors": [{"name": "w", "shape": [4], "layer": 0, "expert": 4}], "layers": 1, "experts": 4}, "expert 4"),
        ({"tensors": [{"name": "w", "shape": [4], "stage": "all", "dtype": "float128"}]}, "dtype='float128'"),
        ({"tensors": [{"name": "w", "shape": [4], "stage": "all", "size": 3}]}, "unknown key 'size'"),
        ({"tensors": [{"name": "w", "shape": [4], "stage": "all"}] * 2}, "tensor w appears twice"),
        ({"tensorz": []}, "unknown key 'tensorz'"),
        ({"config": {"layers": 2, "hidden": 64}}, "config is missing ffn, heads, vocab"),
        ({"config": {"layers": 2, "hidden": 64, "ffn": 8, "heads": 3, "kv_heads": 2, "vocab": 8}}, "heads=3"),
    ],
)
def test_bad_manifests_are_typed_errors(data: dict[str, object], message: str) -> None:
    with pytest.raises(ManifestError, match=message) as raised:
        manifest_from_dict(data)
    assert isinstance(raised.value, (RefitError, ShardcoreError, ValueError))


def _tensor(**fields: object) -> dict[str, object]:
    """A one-tensor document whose tensor ``w`` has ``fields`` over a valid base."""
    return {"layers": 1, "tensors": [{"name": "w", "shape": [8, 4], "stage": "all", **fields}]}


CONFIG = {"layers": 2, "hidden": 64, "ffn": 128, "heads": 4, "vocab": 128}
MAX_MESSAGE = 1024

# Each raised TypeError, AttributeError or ValueError before: (document, the text the message must hold)
MALFORMED: list[tuple[object, str]] = [
    (_tensor(stage=5), "tensor w: stage=5: expected first, last, [first, last] or all"),
    (_tensor(stage=None), "tensor w: stage=None: expected first"),
    (_tensor(stage=[["first"]]), "tensor w: stage=[['first']]: expected first"),
    (_tensor(stage=["first", 3]), "tensor w: stage=['first', 3]"),
    (_tensor(tp_dim=0, blocks=8), "tensor w: blocks=8: expected a list of positive integers"),
    (_tensor(tp_dim=0, blocks=["4", "4"]), "tensor w: blocks entry='4'"),
    (_tensor(dtype=["float32"]), "tensor w: dtype=['float32']: expected one of float64, float32"),
    (_tensor(dtype={"a": 1}), "tensor w: dtype={'a': 1}"),
    (_tensor(shape={"a": 1}), "tensor w: shape={'a': 1}: expected a list of positive integers"),
    (_tensor(shape=None), "tensor w: shape=None"),
    (_tensor(shape=[]), "tensor w: shape=[]"),
    (_tensor(shape=[2**30, 2**30]), "tensor w [1073741824, 1073741824]: over 281474976710656 elements"),
    (_tensor(shape=[10**5000]), "tensor w: shape entry=100000000000... (5001 digits)"),
    (_tensor(unit="2", tp_dim=0), "tensor w: unit='2': expected a whole number from 1"),
    (_tensor(tp_dim=True), "tensor w: tp_dim=True: expected a whole number from 0"),
    (_tensor(stage=None, layer=[0]), "tensor w: stage=None"),
    (_tensor(stage=(), layer=[0]), "tensor w: layer=[0]: expected a whole number from 0"),
    ({"tensors": [{"name": ["w"], "shape": [4], "stage": "all"}]}, "tensor entry 0: name=['w']"),
    ({"tensors": [{"name": "w", "shape": [4], "stage": "all", 3: 4}]}, "tensor w has unknown key 3"),
    ({"tensors": [7]}, "tensor entry 0 must be a mapping"),
    ({"tensors": "w"}, "tensors='w': expected a list of tensor entries"),
    ({**_tensor(), "dtype": ["float32"]}, "the manifest: dtype=['float32']: expected one of"),
    ({**_tensor(), "layers": "2"}, "layers='2': expected a whole number from 0"),
    ({**_tensor(), "experts": None}, "experts=None"),
    ({**_tensor(), "first_stage_layers": 1.5}, "first_stage_layers=1.5"),
    ({**_tensor(), "name": 10**5000}, "name=100000000000... (5001 digits): expected a non-empty string"),
    ({**_tensor(), "name": ["m"]}, "name=['m']"),
    ({"config": [1]}, "config=[1]: expected a mapping of layers, hidden"),
    ({"config": {**CONFIG, "dtype": ["bfloat16"]}}, "config dtype=['bfloat16']: expected one of"),
    ({"config": {**CONFIG, "heads": None}}, "config heads=None: expected a whole number from 1"),
    ({"config": {**CONFIG, "experts": None}}, "config experts=None"),
    ({"config": {**CONFIG, "dense_layers": None}}, "config dense_layers=None"),
    ({"config": {**CONFIG, "hidden": 2}}, "config hidden=2 is below heads=4"),
    ({"config": {**CONFIG, "layers": 2**40}}, "config layers=1099511627776 with experts=0 makes about"),
    ({"config": {**CONFIG, "tied_embeddings": "yes"}}, "config tied_embeddings='yes': expected true or false"),
    ({"config": {**CONFIG, 5: 1}}, "unknown config key 5"),
    ({"config": CONFIG, "name": 5}, "name=5: expected a non-empty string"),
]


@pytest.mark.parametrize(("data", "message"), MALFORMED, ids=[shown(row[1])[:50] for row in MALFORMED])
def test_malformed_manifests_name_the_field(data: object, message: str) -> None:
    with pytest.raises(ManifestError) as raised:
        manifest_from_dict(data)  # type: ignore[arg-type]
    text = str(raised.value)
    assert message in text and "\n" not in text and len(text) < MAX_MESSAGE, text


LONG = "w" * 100_000


@pytest.mark.parametrize(
    ("data", "token"),
    [
        ({"tensors": [{"name": LONG, "shape": [4], "stage": 5}]}, "(100000 characters): stage=5"),
        ({"tensors": [{"name": "w\n", "shape": [4], "stage": 5}]}, "tensor 'w\\n': stage=5"),
        (_tensor(shape=[1] * 100_000 + [0]), "tensor w: shape entry=0"),
        (_tensor(shape=[2**40] * 100_000), "tensor w [1099511627776, 1099511627776, "),
        (_tensor(tp_dim=0, blocks=[1] * 100_000), "blocks [1, 1, 1, 1, 1, 1, ...] sum to 100000"),
        (_tensor(stage=["first"] * 100_000), "stage=['first', 'first', 'first'"),
        (_tensor(dtype="x" * 100_000), "(100000 characters): expected one of"),
        ({"tensors": [{"name": "w", "shape": [4], "stage": "all", LONG: 1}]}, "unknown key 'wwww"),
        ({LONG: 1}, "the manifest: unknown key 'wwww"),
        ({"tensors": [[[[[[[[LONG] * 9] * 9] * 9] * 9] * 9] * 9]]}, "tensor entry 0 must be a mapping"),
    ],
)
def test_huge_values_give_short_messages(data: object, token: str) -> None:
    with pytest.raises(ManifestError) as raised:
        manifest_from_dict(data)  # type: ignore[arg-type]
    assert token in str(raised.value) and len(str(raised.value)) < MAX_MESSAGE, str(raised.value)[:2000]


@pytest.mark.parametrize(
    ("call", "message"),
    [
        (lambda: preset(["x"]), "unknown model preset ['x']: presets are llama3-8b"),
        (lambda: preset(None), "unknown model preset None"),
        (lambda: preset("x" * 100_000), "(100000 characters): presets are"),
        (lambda: model_manifest(None), "model=None: expected a manifest file's path"),
        (lambda: model_manifest(5), "model=5"),
        (lambda: load_manifest(None), "source=None: expected a manifest file's path"),
        (lambda: load_manifest(["m.yaml"]), "source=['m.yaml']"),
        (lambda: load_manifest("/nonexistent/" + LONG), "(100013 characters): File name too long"),
        (lambda: model_manifest("a\x00b"), "cannot read manifest 'a\\x00b'"),
        (lambda: manifest_from_config({"layers": 1}), "config={'layers': 1}: expected a TransformerConfig"),
        (lambda: manifest_from_config(LLAMA, name=None), "manifest name=None: expected a non-empty string"),
        (lambda: TransformerConfig.from_dict(None), "config=None: expected a mapping"),  # type: ignore[arg-type]
        (lambda: TransformerConfig(**{**CONFIG, "vocab": 10**5000}), "config vocab=100000000000... (5001 digits)"),
        (lambda: TransformerConfig(**{**CONFIG, "dtype": ["x"]}), "config dtype=['x']"),
        (lambda: Manifest("w"), "tensors='w': expected a list of TensorSpec"),  # type: ignore[arg-type]
        (lambda: Manifest(5), "tensors=5"),  # type: ignore[arg-type]
        (lambda: TensorSpec("w", (4,), stage=None), "tensor w: stage=None"),  # type: ignore[arg-type]
        (lambda: TensorSpec("w", (4,), dtype=None, stage="all"), "tensor w: dtype=None"),  # type: ignore[arg-type]
        (lambda: preset("tiny-dense").tensor(["w"]), "no tensor named ['w'] in manifest 'tiny-dense'"),
    ],
)
def test_manifest_api_arguments(call: Any, message: str) -> None:
    with pytest.raises(ManifestError) as raised:
        call()
    assert message in str(raised.value) and len(str(raised.value)) < MAX_MESSAGE, str(raised.value)


_EXPERT: dict[str, Any] = {"shape": (2048, 7168), "layer": 3, "expert": 1}
_SPLIT: dict[str, Any] = {"shape": (2048, 64), "tp_dim": 0, "layer": 0}


@pytest.mark.parametrize(
    ("good", "bad", "message"),
    [
        ({"shape": (1, 2048), "layer": 0}, {"shape": (True, 2048)}, "tensor w: shape entry=True: expected a whole"),
        ({"shape": (2048, 7168), "layer": 0}, {"shape": (2048.0, 7168)}, "tensor w: shape entry=2048.0: expected"),
        ({"shape": [2048, 7168], "layer": 0}, {"shape": [2048, 7168.0]}, "tensor w: shape entry=7168.0: expected"),
        (_SPLIT, {"tp_dim": False}, "tensor w: tp_dim=False: expected a whole number"),
        (_SPLIT, {"unit": True}, "tensor w: unit=True: expected a whole number"),
        ({**_SPLIT, "blocks": (1024, 1024)}, {"blocks": (1024.0, 1024)}, "tensor w: blocks entry=1024.0: expected"),
        (_EXPERT, {"layer": -1}, "tensor w: layer=-1: expected a whole number from 0"),
        (_EXPERT, {"layer": True}, "tensor w: layer=True: expected a whole number from 0"),
        (_EXPERT, {"expert": True}, "tensor w: expert=True: expected a whole number from 0"),
        ({"shape": (2048, 7168), "stage": ("all",)}, {"expert": 1}, "tensor w: an expert tensor needs the layer"),
        (_EXPERT, {"name": 7}, "tensor name 7: expected a non-empty string"),
        (_EXPERT, {"name": ""}, "tensor name '': expected a non-empty string"),
    ],
)
def test_bad_spec_after_an_alike_good_one(good: dict[str, Any], bad: dict[str, Any], message: str) -> None:
    """TensorSpec keeps the checks of specs alike but for name, layer and expert; True == 1 and 2048.0 == 2048
    compare alike, so a bad spec after good ones must still be refused with its own message."""
    for name in ("v", "w"):
        TensorSpec(**{"name": name, **good})
    with pytest.raises(ManifestError) as raised:
        TensorSpec(**{"name": "w", **good, **bad})
    assert str(raised.value).startswith(message), str(raised.value)


def test_bad_counts_read_alike_everywhere() -> None:
    """One validator (plan.arguments.check_count) for the spec, the manifest, the config and the refit CLI."""
    said = []
    for call in (
        lambda: plan_layout(2, [{"tp": -1}]),
        lambda: manifest_from_dict({**_tensor(), "layers": -1}),
        lambda: TransformerConfig(**{**CONFIG, "hidden": -1}),
        lambda: TensorSpec("w", (4,), stage="all", unit=-1),
    ):
        with pytest.raises(ShardcoreError) as raised:
            call()
        said.append(str(raised.value))
    assert all("=-1: expected a whole number from " in text for text in said), said


def test_bad_files(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="cannot read manifest"):
        load_manifest(tmp_path / "missing.json")
    bad = tmp_path / "bad.yaml"
    bad.write_text("tensors: [unclosed")
    with pytest.raises(ManifestError, match="neither JSON nor YAML"):
        load_manifest(bad)


def test_bad_refit_requests() -> None:
    manifest = Manifest((TensorSpec("w", (8,), stage=("all",)),))
    layout = plan_layout(8, "tp=1,dp=4 + tp=1,dp=2 + tp=1,dp=2")
    with pytest.raises(RefitError, match="destination shard 3"):
        plan_refit(layout, 0, [1, 3], manifest)
    with pytest.raises(RefitError, match="source shard -1"):
        plan_refit(layout, -1, 1, manifest)
    other = plan_layout(8, "tp=1,dp=8").shards[0]
    with pytest.raises(RefitError, match="overlap"):
        plan_refit(layout, 0, [1, other], manifest)
    bigger = plan_layout(16, "tp=1,dp=16").shards[0]
    with pytest.raises(RefitError, match="outside the world of 8"):
        plan_refit(layout, 0, bigger, manifest)
    with pytest.raises(RefitError, match="ranks_per_node=0"):
        plan_refit(layout, 0, 1, manifest, 0)
    with pytest.raises(RefitError, match="no destination"):
        plan_refit(layout, 0, [], manifest)


def test_names_hash_with_their_boundaries() -> None:
    """``hash_names`` joins the names: where one ends is part of what is hashed, and any string hashes (a lone
    surrogate too, which UTF-8 alone refuses)."""

    def hashed(names: list[str]) -> str:
        found = hashlib.sha256()
        hash_names(found.update, names)
        return found.hexdigest()

    assert hashed(["ab", "c"]) != hashed(["a", "bc"]) != hashed(["abc"]) != hashed(["ab", "c", ""])
    assert hashed(["ab", "c"]) == hashed(["a" + "b", "c"]) and hashed(["\ud800"]) != hashed(["\ud801"])


def test_alike_numbers_tell_the_same_weight_of_every_layer_apart_from_any_other() -> None:
    """``Manifest.alike_numbers`` is what a rank's part compares instead of each spec's fields: equal exactly when two
    tensors share every field but name, layer and expert (a layer in another dtype differs), and the digest numbered
    from it is the one of the same tensors given without their derived scales' places."""
    base = preset("tiny-moe")
    odd = tuple(
        replace(t, dtype="float32") if t.layer == 1 and t.name.endswith("linear_fc1.weight") else t
        for t in base.tensors
    )
    manifest = replace(base, tensors=odd)
    fields = [(t.shape, t.dtype, t.tp_dim, t.blocks, t.unit, t.stage, t.to_dtype, t.scale) for t in manifest]
    for a, first in enumerate(fields):
        for b, second in enumerate(fields):
            assert (manifest.alike_numbers[a] == manifest.alike_numbers[b]) == (first == second)
    assert manifest.ordered_names == tuple(t.name for t in manifest)
    fc1 = [p for p, t in enumerate(manifest) if t.name.endswith("linear_fc1.weight") and t.expert is None]
    assert len({manifest.alike_numbers[p] for p in fc1}) == 2  # layer 1's float32 fc1 apart from the others
    scaled = base.converted("float8_e4m3fn", "tensor")
    given = [t for t in scaled if t.scale_of is None]
    first = next(n for n, t in enumerate(given) if t.scale is not None)
    scale = scaled.tensor(f"{given[first].name}_scale_inv")
    moved = replace(scaled, tensors=(*given[: first + 1], scale, *given[first + 1 :]))
    assert [t.name for t in moved] != [t.name for t in scaled]
    assert moved.digest() == scaled.digest()  # a scale tensor's place among the given ones leaves the digest
