"""Planning through weight maps (torch-free): Megatron shards into the Hugging Face and vLLM layouts and back.

Every destination element is written exactly once (an engine's vocabulary padding never), by a rank that
holds it; replicas share the sending; bad input is a ManifestError naming the tensors, before any plan.
"""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterator
from dataclasses import replace
from math import prod
from typing import Any

import pytest

from shardcore.errors import ManifestError, RefitError
from shardcore.plan.layout import plan_layout
from shardcore.refit import RefitStats
from shardcore.refit.boxes import fitted, meets
from shardcore.refit.families import HFModel, manifest_from_hf_config
from shardcore.refit.hf_config import FAMILIES
from shardcore.refit.holdings import holdings
from shardcore.refit.manifest import Manifest, TensorSpec
from shardcore.refit.part import transfer_order
from shardcore.refit.plan import RefitPlan
from shardcore.refit.planner import plan_refit, plan_refit_from
from shardcore.refit.request import RefitRequest
from shardcore.refit.weightmap import Fill, Link, WeightMap, rows, translate, whole

BASE = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "torch_dtype": "bfloat16",
}
CONFIGS = {
    "llama": {"model_type": "llama", "tie_word_embeddings": True},
    "qwen2": {"model_type": "qwen2"},
    "qwen3": {"model_type": "qwen3", "head_dim": 32},
    "qwen3_moe": {"model_type": "qwen3_moe", "head_dim": 16, "num_experts": 4, "moe_intermediate_size": 32},
    "deepseek_v3": {
        "model_type": "deepseek_v3", "num_hidden_layers": 3, "first_k_dense_replace": 1, "n_routed_experts": 4,
        "n_shared_experts": 1, "moe_intermediate_size": 32, "q_lora_rank": 48, "kv_lora_rank": 32,
        "qk_nope_head_dim": 16, "qk_rope_head_dim": 8, "v_head_dim": 16,
    },
}  # fmt: skip


def model_of(family: str, **more: Any) -> HFModel:
    return manifest_from_hf_config({**BASE, **CONFIGS[family], **more}, vocab_multiple=128)


def local_elements(shape: tuple[int, ...], offset: tuple[int, ...], box_shape: tuple[int, ...]) -> Iterator[int]:
    """The flat indices, in a local tensor of ``shape``, of the box of ``box_shape`` at ``offset``."""
    extents = fitted(box_shape, len(shape))
    strides = [1] * len(shape)
    for d in range(len(shape) - 2, -1, -1):
        strides[d] = strides[d + 1] * shape[d + 1]

    def walk(dim: int, base: int) -> Iterator[int]:
        if dim == len(shape):
            yield base
            return
        for i in range(offset[dim], offset[dim] + extents[dim]):
            yield from walk(dim + 1, base + i * strides[dim])

    return walk(0, 0)


def written(plan: RefitPlan, rank: int) -> tuple[dict[str, tuple[int, ...]], Counter[tuple[str, int]]]:
    """A destination rank's local shapes, and how often each element of each of its tensors is written."""
    mine = plan.for_rank(rank)
    count: Counter[tuple[str, int]] = Counter()
    for transfer in (*mine.recvs, *mine.copies):
        shape = mine.destination_shapes[transfer.destination]
        assert len(transfer.dst_offset) == len(shape)
        for index in local_elements(shape, transfer.dst_offset, transfer.shape):
            count[transfer.destination, index] += 1
    return mine.destination_shapes, count


def padding_rows(model: HFModel, name: str, shape: tuple[int, ...], tp_rank: int) -> int:
    """Rows of an engine's vocabulary padding a tp rank holds (vLLM pads to a multiple of 64)."""
    if not name.endswith(("embed_tokens.weight", "lm_head.weight")):
        return 0
    start = tp_rank * shape[0]
    return max(0, start + shape[0] - max(start, model.vocab))


@pytest.mark.parametrize("family", FAMILIES)
def test_every_destination_element_once_from_a_holder(family: str) -> None:
    model = model_of(family)
    moe = family in ("qwen3_moe", "deepseek_v3")
    source_spec = "tp=2,dp=2,ep=2,expt_tp=1,role=train" if moe else "tp=2,dp=2,role=train"
    engine = "tp=4,ep=2,expt_tp=2" if moe else "tp=4"  # tp=4 over 2 kv heads: each kv head on two ranks
    layout = plan_layout(4 + 1 + 4 + 2, f"{source_spec} + dp=1 + {engine} + dp=2")
    layouts = {1: model.layout("hf"), 2: model.layout("vllm"), 3: model.layout("hf-stacked")}
    plan = plan_refit(layout, 0, [1, 2, 3], model.manifest, layouts=layouts, min_piece_bytes=0)
    source = layout.shards[0]
    every = list(plan.transfers())
    for rank in range(4, layout.world_size):
        shapes, count = written(plan, rank)
        assert shapes, rank
        assert max(count.values()) == 1, rank  # no element written twice
        tp_rank = rank - 5 if 5 <= rank < 9 else 0
        for name, shape in shapes.items():
            numel = prod(shape)
            pad = padding_rows(model, name, shape, tp_rank) * shape[-1] if 5 <= rank < 9 else 0
            assert sum(1 for key in count if key[0] == name) == numel - pad, (rank, name)
        mine = plan.for_rank(rank)
        assert sorted(mine.recvs) == sorted(t for t in every if t.dst == rank and t.src != rank)
    for rank in source.ranks:  # a sender's part, from its own tiles (found once per slice shape), is the plan's
        assert sorted(plan.for_rank(rank).sends) == sorted(t for t in every if t.src == rank and t.dst != rank)
    for transfer in every:
        held = holdings(model.manifest.tensor(transfer.tensor), source, transfer.src, model.manifest)
        assert any(all(a <= lo and hi <= b for (lo, hi), (a, b) in zip(transfer.box, box)) for box, _ in held)
    senders = Counter(t.src for t in every)
    assert set(senders) == {0, 1, 2, 3}  # the dp replicas share the sending
    assert max(senders.values()) <= 2 * min(senders.values())


@pytest.mark.parametrize("family", FAMILIES)
def test_a_training_rank_finds_the_engine_slices_meeting_its_own(family: str) -> None:
    """A training rank's sends ask an engine's image for the slices meeting each of its own
    (``MappedPlacement.overlapping``) without making the rest: the same slices in the same order as every slice
    filtered, and the same part as a plan that made every slice first."""
    moe = family in ("qwen3_moe", "deepseek_v3")
    source_spec = "tp=2,dp=2,ep=2,expt_tp=1,role=train" if moe else "tp=2,dp=2,role=train"
    model, layout = model_of(family), plan_layout(8, f"{source_spec} + {'tp=4,ep=2,expt_tp=2' if moe else 'tp=4'}")

    def fresh() -> RefitPlan:
        return plan_refit(layout, 0, [1], model.manifest, layouts={1: model.layout("vllm")}, min_piece_bytes=0)

    made, asked = fresh(), fresh()
    engine, lazy = made.destination_placements[0], asked.destination_placements[0]
    for position, tensor in enumerate(model.manifest):
        every = engine.slices(position)
        for box in [s.box for s in made.source_placement.slices(position)] + [tuple((0, 1) for _ in tensor.shape)]:
            assert list(lazy.overlapping(position, box)) == [s for s in every if meets(s.box, box)], tensor.name
    for rank in layout.shards[0].ranks:
        assert fresh().for_rank(rank) == made.for_rank(rank)
    for rank in layout.shards[1].ranks:  # an engine rank's part, from images whose links were made a few at a time
        assert asked.for_rank(rank) == made.for_rank(rank)


def test_hf_shapes_and_names_follow_the_model_classes() -> None:
    model = model_of("qwen3_moe")
    hf = {t.name: t.shape for t in model.hf_manifest}
    assert hf["model.layers.0.self_attn.q_proj.weight"] == (4 * 16, 64)
    assert hf["model.layers.0.self_attn.k_norm.weight"] == (16,)
    assert hf["model.layers.1.mlp.experts.3.down_proj.weight"] == (64, 32)
    assert hf["model.layers.0.mlp.gate.weight"] == (4, 64)
    assert hf["model.embed_tokens.weight"] == hf["lm_head.weight"] == (100, 64)
    stacked = {t.name: t.shape for t in model.vllm(2, 1)[0]}
    assert stacked["model.layers.0.mlp.experts.routed_experts.w13_weight"] == (4, 64, 64)
    assert stacked["model.layers.0.self_attn.qkv_proj.weight"] == (2 * (2 + 2) * 16, 64)
    assert stacked["model.embed_tokens.weight"] == (128, 64)  # 100 padded to a multiple of 64
    assert "lm_head.weight" not in {t.name for t in model_of("llama").hf_manifest}  # tied: the embedding


def test_deepseek_v3_names_shapes_and_vllm_packing() -> None:
    """MLA's projections map whole; vLLM fuses [q_a_proj; kv_a_proj_with_mqa] on every rank and splits the
    heads of q_b_proj / kv_b_proj; the shared experts pack like a dense MLP; the first layer stays dense."""
    model = model_of("deepseek_v3")
    hf = {t.name: t.shape for t in model.hf_manifest}
    assert hf["model.layers.1.self_attn.kv_a_proj_with_mqa.weight"] == (32 + 8, 64)
    assert hf["model.layers.1.self_attn.kv_b_proj.weight"] == (4 * (16 + 16), 32)
    assert hf["model.layers.1.self_attn.o_proj.weight"] == (64, 4 * 16)
    assert hf["model.layers.2.mlp.shared_experts.up_proj.weight"] == (32, 64)
    assert "model.layers.0.mlp.gate_proj.weight" in hf and "model.layers.0.mlp.gate.weight" not in hf
    layout = plan_layout(2 + 2, "tp=2,role=train + tp=2,expt_tp=2")
    plan = plan_refit(layout, 0, [1], model.manifest, layouts={1: model.layout("vllm")}, min_piece_bytes=0)
    shapes = plan.for_rank(3).destination_shapes
    assert shapes["model.layers.1.self_attn.fused_qkv_a_proj.weight"] == (48 + 40, 64)
    assert shapes["model.layers.1.self_attn.q_b_proj.weight"] == (2 * 24, 48)
    assert shapes["model.layers.2.mlp.shared_experts.gate_up_proj.weight"] == (32, 64)
    assert shapes["model.layers.2.mlp.experts.routed_experts.w13_weight"] == (4, 32, 64)
    fused = [t for t in plan.for_rank(3).recvs + plan.for_rank(3).copies if "fused_qkv_a" in t.destination]
    layer1 = {(t.tensor.rsplit(".", 2)[-2], t.dst_offset[0]) for t in fused if t.tensor.startswith("decoder.layers.1.")}
    assert layer1 == {("linear_q_down_proj", 0), ("linear_kv_down_proj", 48)}
    with pytest.raises(ManifestError, match="moe_layer_freq"):
        model_of("deepseek_v3", moe_layer_freq=2)


def test_vllm_packing_of_one_rank() -> None:
    """tp rank 1 of 4 over 2 kv heads: q heads 1 of 4, kv head 0 (replicated on ranks 0 and 1)."""
    model = model_of("qwen2")
    layout = plan_layout(2 + 4, "tp=2,role=train + tp=4")
    plan = plan_refit(layout, 0, [1], model.manifest, layouts={1: model.layout("vllm")}, min_piece_bytes=0)
    mine = plan.for_rank(3)  # tp rank 1 of the engine
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    d, span = 16, (2 + 2) * 16  # head size, a Megatron query group's rows: 2 q heads, 1 k, 1 v
    into = sorted((t.dst_offset[0], t.box[0]) for t in mine.recvs if t.destination == qkv)
    assert mine.destination_shapes[qkv] == ((1 + 2) * d, 64)
    # q head 1 is group 0's second q head; k and v are group 0's
    assert into == [(0, (d, 2 * d)), (d, (2 * d, 3 * d)), (2 * d, (3 * d, span))]
    bias = [t for t in mine.recvs if t.destination == qkv.replace("weight", "bias")]
    assert {t.tensor for t in bias} == {"decoder.layers.0.self_attention.linear_qkv.bias"}


def element_source(weights: WeightMap, target: str, at: tuple[int, ...]) -> tuple[str, tuple[int, ...]]:
    """The source tensor and element that ``weights`` fills element ``at`` of ``target`` from, read off its links."""
    (link,) = [link for link in weights.into(target) if all(a <= i < b for i, (a, b) in zip(at, link.box))]
    return link.source, tuple(start for start, _ in translate(tuple((i, i + 1) for i in at), link.box, link.origin))


def test_a_maps_digest_is_moved_by_its_name_its_sources_and_their_boxes() -> None:
    """Ranks compare the map's digest (in the plan's fingerprint): the same links give the same digest, and a map
    named otherwise, or whose links read two sources the other way round, or another box of one, gives another."""
    model = model_of("qwen3_moe", num_hidden_layers=2)
    weights = model.vllm_from_megatron(2, 2)

    def made(links: list[Link], name: str = weights.name) -> WeightMap:
        return WeightMap(weights.sources, weights.targets, tuple(links), weights.padding, name, True)

    links = list(weights.links)
    assert made(links).digest() == weights.digest()
    first = next(i for i, link in enumerate(links) if ".experts." in link.target)
    second = next(
        i
        for i, link in enumerate(links)
        if link.target == links[first].target and link.origin == links[first].origin and i != first
    )
    swapped = list(links)
    swapped[first] = links[first]._replace(source=links[second].source)
    swapped[second] = links[second]._replace(source=links[first].source)
    moved = list(links)
    (start, stop), *rest = links[first].origin
    moved[first] = links[first]._replace(origin=((start + 1, stop + 1), *rest))
    digests = {made(links, "other").digest(), made(swapped).digest(), made(moved).digest(), weights.digest()}
    assert len(digests) == 4


@pytest.mark.parametrize("family", FAMILIES)
def test_a_composed_map_reads_each_element_where_its_two_maps_do(family: str) -> None:
    """Megatron -> vLLM, composed fill by fill (once per kind of weight, for every layer), fills the first and last
    element of every link from where Megatron -> HF and HF -> vLLM, read one after the other, fill it; and a map made
    again from the composed map's links is the same map."""
    model = model_of(family, num_hidden_layers=3)
    first, second = model.to_hf, model.vllm(2, 2)[1]
    composed = model.vllm_from_megatron(2, 2)
    for target in composed.targets:
        for link in composed.into(target.name):
            for point in {tuple(start for start, _ in link.box), tuple(stop - 1 for _, stop in link.box)}:
                via, middle = element_source(second, target.name, point)
                assert element_source(composed, target.name, point) == element_source(first, via, middle)
    again = WeightMap(composed.sources, composed.targets, composed.links, composed.padding, composed.name, True)
    assert again.digest() == composed.digest() and again == composed
    assert WeightMap(composed.sources, composed.targets, composed.links, composed.padding, "other", True) != composed
    for tensor in composed.sources:
        assert (again.out_of(tensor.name), again.read_by(tensor.name)) == (
            composed.out_of(tensor.name),
            composed.read_by(tensor.name),
        )


def test_reverse_from_hf_into_megatron() -> None:
    model = model_of("qwen3_moe")
    layout = plan_layout(2 + 4, "dp=2 + tp=2,pp=2,ep=2,expt_tp=1,role=train")
    plan = plan_refit(layout, 0, [1], model.manifest, layouts={0: model.layout("hf")}, min_piece_bytes=0)
    for rank in range(2, 6):
        shapes, count = written(plan, rank)
        assert max(count.values()) == 1
        for name, shape in shapes.items():
            numel = prod(shape)
            pad = 0
            if name in ("embedding.word_embeddings.weight", "output_layer.weight"):
                rows_held = shape[0]
                start = (rank - 2) % 2 * rows_held
                pad = max(0, start + rows_held - max(start, model.vocab)) * shape[1]
            assert sum(1 for key in count if key[0] == name) == numel - pad, (rank, name)
    assert {t.src for t in plan.transfers()} == {0, 1}
    assert RefitStats.of(plan).total_bytes > 0


def test_hf_config_file_and_dict_agree(tmp_path: Any) -> None:
    config = {**BASE, **CONFIGS["qwen3"]}
    (tmp_path / "config.json").write_text(json.dumps(config))
    from_file = manifest_from_hf_config(tmp_path, vocab_multiple=128)
    assert from_file.manifest.to_dict() == model_of("qwen3").manifest.to_dict()
    assert from_file.config.vocab == 128 and from_file.vocab == 100 and from_file.config.dtype == "bfloat16"


@pytest.mark.parametrize(
    ("config", "words"),
    [
        ({**BASE, "model_type": "gpt2"}, ["gpt2", "llama, qwen2, qwen3, qwen3_moe, deepseek_v3"]),
        ({**{k: v for k, v in BASE.items() if k != "hidden_size"}, "model_type": "llama"}, ["hidden_size"]),
        ({**BASE, "model_type": "llama", "mlp_bias": True}, ["mlp_bias"]),
        ({**BASE, "model_type": "qwen3_moe", "num_experts": 4, "moe_intermediate_size": 8, "mlp_only_layers": [1]},
         ["mlp_only_layers"]),
    ],
)  # fmt: skip
def test_bad_config_names_the_key(config: dict[str, Any], words: list[str]) -> None:
    with pytest.raises(ManifestError) as error:
        manifest_from_hf_config(config)
    for word in words:
        assert word in str(error.value)


def test_bad_layouts_stop_before_planning() -> None:
    model = model_of("llama")
    layout = plan_layout(2 + 2 + 3, "tp=2,role=train + tp=2 + tp=3")
    with pytest.raises(ManifestError, match=r"hf layout holds .* tp=1, pp=1"):
        plan_refit(layout, 0, [1], model.manifest, layouts={1: model.layout("hf")})
    with pytest.raises(ManifestError, match=r"vllm layout of .*tp=3"):
        plan_refit(layout, 0, [2], model.manifest, layouts={2: model.layout("vllm")})
    with pytest.raises(ManifestError, match="a refit starts from megatron or hf"):
        plan_refit(layout, 1, [0], model.manifest, layouts={1: model.layout("vllm")})
    with pytest.raises(ManifestError, match="is not the Megatron manifest"):
        plan_refit(layout, 0, [1], model_of("qwen2").manifest, layouts={1: model.layout("vllm")})
    with pytest.raises(RefitError, match="neither the source nor a destination"):
        plan_refit(layout, 0, [1], model.manifest, layouts={2: model.layout("vllm")})
    with pytest.raises(ManifestError, match="unknown layout 'sglang'"):
        model.layout("sglang")


def test_a_manifest_the_config_disagrees_with_names_both_tensors() -> None:
    model = model_of("qwen2")
    layout = plan_layout(2 + 2, "tp=2,role=train + tp=2")
    other = model_of("qwen2", num_key_value_heads=4)  # the manifest of another config: more kv heads
    with pytest.raises(
        ManifestError,
        match=r"HF config gives decoder.layers.0.self_attention.linear_qkv.weight \[128, 64\] bfloat16 \(it feeds "
        r"model.layers.0.self_attn.k_proj.weight, .*q_proj.weight, .*v_proj.weight\), the manifest has \[192, 64\]",
    ):
        plan_refit(layout, 0, [1], other.manifest, layouts={1: model.layout("vllm")})
    tied = model_of("llama")
    stage = r"has \[128, 64\] bfloat16, stage=\('first',\) \(config: \('first', 'last'\)"
    with pytest.raises(ManifestError, match=stage):
        plan_refit(layout, 0, [1], model_of("llama", tie_word_embeddings=False).manifest,
                   layouts={1: tied.layout("vllm")})  # fmt: skip
    with pytest.raises(ManifestError, match=r"output_layer.weight is no tensor of the HF config's model"):
        untied = manifest_from_hf_config({**BASE, **CONFIGS["llama"], "tie_word_embeddings": False}, vocab_multiple=128)
        mixed = Manifest((*tied.manifest.tensors, untied.manifest.tensor("output_layer.weight")), layers=2)
        plan_refit(layout, 0, [1], mixed, layouts={1: tied.layout("vllm")})
    renamed = Manifest(model.manifest.tensors, layers=model.manifest.layers, name="renamed")
    assert plan_refit(layout, 0, [1], renamed, layouts={1: model.layout("vllm")}).for_rank(2).recvs


def test_vocab_the_engine_pads_differently() -> None:
    model = manifest_from_hf_config(
        {**BASE, "model_type": "llama", "vocab_size": 100, "num_attention_heads": 6, "num_key_value_heads": 6,
         "hidden_size": 96}, vocab_multiple=384,
    )  # fmt: skip
    layout = plan_layout(3 + 3, "tp=3,role=train + tp=3")
    assert model.manifest.tensor("embedding.word_embeddings.weight").shape == (384, 96)  # Megatron's tp=3 splits it
    with pytest.raises(ManifestError, match=r"embed_tokens.weight: vLLM pads the vocabulary 100 to 128 .* tp=3"):
        plan_refit(layout, 0, [1], model.manifest, layouts={1: model.layout("vllm")})


def test_weight_map_checks_name_both_tensors() -> None:
    source = Manifest((TensorSpec("a", (4, 2), stage="all"), TensorSpec("b", (2, 2), stage="all")))
    target = Manifest((TensorSpec("x", (6, 2), stage="all"),))
    with pytest.raises(ManifestError, match=r"x .* <- b .*differ in extent"):
        WeightMap(
            source,
            target,
            (Link("x", rows((6, 2), 0, 4), "a", whole((4, 2))), Link("x", rows((6, 2), 4, 6), "b", rows((2, 2), 0, 1))),
        )
    with pytest.raises(ManifestError, match=r"x has 12 elements but its sources \(a\) feed 8"):
        WeightMap(source, target, (Link("x", rows((6, 2), 0, 4), "a", whole((4, 2))),))
    with pytest.raises(
        ManifestError, match=r"box \[\[0, 4\], \[0, 2\]\] \(from a\) and box \[\[2, 4\], \[0, 2\]\] \(from b\) overlap"
    ):
        WeightMap(
            source,
            target,
            (Link("x", rows((6, 2), 0, 4), "a", whole((4, 2))), Link("x", rows((6, 2), 2, 4), "b", whole((2, 2)))),
        )
    with pytest.raises(ManifestError, match="x is fed by no source tensor"):
        WeightMap(source, target, ())
    fine = WeightMap(
        source,
        target,
        (Link("x", rows((6, 2), 0, 4), "a", whole((4, 2))), Link("x", rows((6, 2), 4, 6), "b", whole((2, 2)))),
    )
    assert fine.reversed().reversed().links == fine.links
    boxes = ((rows((6, 2), 0, 4), whole((4, 2))), (rows((6, 2), 4, 6), whole((2, 2))))
    assert WeightMap.filled(source, target, {"x": (Fill(boxes, (0, 1)), ("a", "b"))}) == fine
    for slots, names in (((0, 2), ("a", "b")), ((0, 0), ("a", "b")), ((0,), ("a", "b"))):
        with pytest.raises(ManifestError, match=r"x: its fill must give each link one of its 2 source tensors"):
            WeightMap.filled(source, target, {"x": (Fill(boxes, slots), names)})


def test_cli_plans_into_a_layout_from_an_hf_config(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    from shardcore.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**BASE, **CONFIGS["qwen2"]}))
    shards = ["refit", "--world", "4", "--shards", "tp=2,role=train + tp=2", "--from", "0", "--to", "1"]
    assert main([*shards, "--model", f"hf:{config}", "--to-layout", "vllm", "--json", "--transfers"]) == 0
    data = json.loads(capsys.readouterr().out)
    targets = {t["target"] for t in data["transfers"]}
    assert "model.layers.1.self_attn.qkv_proj.bias" in targets and "model.embed_tokens.weight" in targets
    assert all(t["target"] for t in data["transfers"])
    assert main([*shards, "--model", "tiny-dense", "--to-layout", "vllm"]) == 2
    assert "needs the model's Hugging Face config: --model hf:PATH" in capsys.readouterr().err
    assert main([*shards, "--model", f"hf:{tmp_path / 'none.json'}", "--to-layout", "hf"]) == 2
    assert "cannot read HF config" in capsys.readouterr().err


def test_a_request_takes_the_parsed_model_as_it_takes_its_hf_path(tmp_path: Any) -> None:
    """An ``HFModel`` (a config parsed already, from its contents: vLLM's init info) plans what ``hf:PATH`` of the
    same config plans, and is used as it is, never parsed again; a ``Manifest`` still plans no layout."""
    from shardcore.refit import RefitRequest
    from shardcore.refit.families import hf_model_of, shard_layouts

    contents = {**BASE, **CONFIGS["qwen2"]}
    config = tmp_path / "config.json"
    config.write_text(json.dumps(contents))
    model = manifest_from_hf_config(contents)
    assert hf_model_of(model) is model
    layouts = shard_layouts(model, 0, [1], "hf", "vllm")
    assert layouts is not None and {layout.model for layout in layouts.values()} == {model}
    by_path = RefitRequest(f"hf:{config}", "tp=1,role=train + tp=2", 0, (1,), from_layout="hf", to_layout="vllm")
    parsed = replace(by_path, model=model)
    assert parsed.plan(3).fingerprint() == by_path.plan(3).fingerprint()
    assert parsed.manifest() is model.manifest
    with pytest.raises(ManifestError, match="needs the model as a Hugging Face config"):
        replace(by_path, model=model.manifest).plan(3)


def test_a_request_reads_its_hf_config_once(tmp_path: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Planning a request of ``hf:PATH`` into another layout parses the config once, for the manifest and the
    layouts both (a DeepSeek-V3 config makes 30,000 tensors)."""
    from shardcore.refit import RefitRequest, families

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**BASE, **CONFIGS["qwen2"]}))
    parse, parsed = families.manifest_from_hf_config, []
    monkeypatch.setattr(families, "manifest_from_hf_config", lambda path: parsed.append(path) or parse(path))
    request = RefitRequest(f"hf:{config}", "tp=1,role=train + tp=2", 0, (1,), to_layout="vllm")
    assert request.plan(3).for_rank(1).recvs
    assert parsed == [str(config)]


def test_fan_out_and_subsets_compose_with_layouts() -> None:
    """Fan-out relays a tile into a node once, into the engine's own tensors; a subset keeps its tensors' pieces."""
    model = model_of("qwen3_moe")
    layout = plan_layout(2 + 4 + 4, "tp=2,ep=2,expt_tp=1,role=train + dp=4 + tp=2,dp=2,ep=2,expt_tp=1")
    layouts = {1: model.layout("hf-stacked"), 2: model.layout("vllm")}
    plan = plan_refit(layout, 0, [1, 2], model.manifest, ranks_per_node=2, fan_out=True, layouts=layouts)
    every = list(plan.transfers())
    assert any(t.hop for t in every)  # relays forward inside their node
    assert all(t.target for t in every)
    for rank in range(2, 10):
        shapes, count = written(plan, rank)
        assert max(count.values()) == 1, rank
        for name, shape in shapes.items():
            pad = padding_rows(model, name, shape, (rank - 6) % 2) * shape[-1] if rank >= 6 else 0
            numel = prod(shape)
            assert sum(1 for key in count if key[0] == name) == numel - pad, (rank, name)
    relayed = [t for t in every if t.hop]
    assert all(t.src // 2 == t.dst // 2 for t in relayed)  # a forward stays inside the node
    experts = plan.subset(lambda tensor: tensor.expert == 1)
    kept = [t for t in every if t.tensor.endswith("weight1")]
    assert kept and sorted(experts.transfers()) == sorted(kept)
    assert {t.destination for t in kept} >= {
        "model.layers.0.mlp.experts.routed_experts.w13_weight",
        "model.layers.0.mlp.experts.gate_up_proj",
    }


@pytest.mark.parametrize("source", ["tp=1", "tp=2", "dp=2"])
def test_fan_out_into_kv_heads_the_engine_replicates_sends_each_once(source: str) -> None:
    """vLLM at tp=4 over 2 kv heads holds each k and v head on two of its ranks: one destination, two slices of one
    box. Both are members of the box's fan-out group, so each is sent once and every rank's part is its share of the
    whole plan (a group holding its own slice twice had a sender send a head twice, into a receive of one)."""
    model = model_of("qwen2")
    world = int(source[-1]) + 4
    layout = plan_layout(world, f"{source},role=train + tp=4")
    layouts = {1: model.layout("vllm")}
    plan = plan_refit(layout, 0, [1], model.manifest, layouts=layouts, ranks_per_node=4, fan_out=True)
    every = list(plan.transfers())
    assert len(set(every)) == len(every)
    for rank in range(world):
        mine = plan.for_rank(rank)
        assert sorted((*mine.sends, *mine.recvs, *mine.copies)) == sorted(t for t in every if rank in (t.src, t.dst))
    for rank in range(world - 4, world):
        shapes, count = written(plan, rank)
        assert max(count.values()) == 1, rank
        for name, shape in shapes.items():
            pad = padding_rows(model, name, shape, rank - world + 4) * shape[-1]
            assert sum(1 for key in count if key[0] == name) == prod(shape) - pad, (rank, name)


FP8 = {**BASE, "hidden_size": 512, "intermediate_size": 256, "vocab_size": 256, "head_dim": 128}
"""A model whose vLLM tp=2 tensors are whole 128x128 blocks, packed parts too (q 256, k 128, v 128 rows a rank)."""


def test_fp8_through_a_layout_is_planned_in_the_source_dtype() -> None:
    """A manifest converting to fp8 with block scales plans into vLLM's tensors in the source dtype (the wire's);
    each destination rank is given its engine tensors in fp8 with a scale tensor of its local blocks, the
    conversion is in the fingerprint, and a subset keeps every source of a tensor quantized whole."""
    model = manifest_from_hf_config({**FP8, **CONFIGS["qwen2"]}, vocab_multiple=128)
    layout = plan_layout(4, "tp=2,role=train + tp=2")
    fp8 = model.manifest.converted("float8_e4m3fn")
    plan = plan_refit(layout, 0, [1], fp8, layouts={1: model.layout("vllm")})
    plain = plan_refit(layout, 0, [1], model.manifest, layouts={1: model.layout("vllm")})
    assert plan.manifest == model.manifest  # no Megatron scale tensor travels
    assert sorted(plan.transfers()) == sorted(plain.transfers())
    assert RefitStats.of(plan).total_bytes == RefitStats.of(plain).total_bytes  # bf16 on the wire
    shapes = plan.for_rank(2).destination_shapes
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert shapes[qkv] == (512, 512) and shapes[f"{qkv}_scale_inv"] == (4, 4)
    linear = {name for name in plain.for_rank(2).destination_shapes if name.endswith(VLLM_LINEAR)}
    assert set(shapes) == {*plain.for_rank(2).destination_shapes, *(f"{name}_scale_inv" for name in linear)}
    assert plan.destination_tensor(qkv).destination_dtype == "float8_e4m3fn"
    assert plan.destination_tensor(f"{qkv}_scale_inv").dtype == "float32"
    assert "quantizing" in plan.fingerprint()["destinations"]
    assert plan.fingerprint()["destinations"] != plain.fingerprint()["destinations"]
    one = plan.subset(["decoder.layers.0.self_attention.linear_qkv.weight"])
    assert set(one.for_rank(3).destination_shapes) == {qkv, f"{qkv}_scale_inv"}


def test_a_restricted_engine_destination_keeps_its_tensors_and_landing() -> None:
    """``restrict`` on an engine's side (the engine's workers renumbered, as in a group of their own) keeps its
    local tensors and what it quantizes on landing: the same receives, into the same fp8 tensors and scales."""
    model = manifest_from_hf_config({**FP8, **CONFIGS["qwen2"]}, vocab_multiple=128)
    plan = plan_refit(plan_layout(4, "tp=2,role=train + tp=2"), 0, [1], model.manifest.converted("float8_e4m3fn"),
                      layouts={1: model.layout("vllm")})  # fmt: skip
    engine = plan.destination_placements[0].restrict({2: 5, 3: 4})
    moved = plan_refit_from(plan.source_placement, [engine], min_piece_bytes=plan.min_piece_bytes)
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert moved.destination_tensor(qkv).destination_dtype == "float8_e4m3fn"
    assert "quantizing" in moved.fingerprint()["destinations"]
    for old, new in ((2, 5), (3, 4)):
        assert moved.for_rank(new).destination_shapes == plan.for_rank(old).destination_shapes
        landed = Counter((t.target, t.dst_offset, t.box, t.tensor) for t in moved.for_rank(new).recvs)  # any sender
        assert landed == Counter((t.target, t.dst_offset, t.box, t.tensor) for t in plan.for_rank(old).recvs)


def test_fp8_through_a_layout_refuses_what_it_cannot_block() -> None:
    """Before any plan: a rank's box or a packed part that cuts a scale block, names the tensor (this replaces
    the refusal of every converting manifest through a layout); per-tensor scales and plain casts, too."""
    layout = plan_layout(4, "tp=2,role=train + tp=2")
    # 8 heads of 64 over 2 kv heads: a tp rank's qkv_proj is [256 q; 64 k; 64 v] rows: v starts inside a block
    narrow = manifest_from_hf_config({**FP8, **CONFIGS["qwen2"], "num_attention_heads": 8, "head_dim": 64},
                                     vocab_multiple=128)  # fmt: skip
    packed = r"qkv_proj.weight \[768, 512\]: the engine packs .*k_proj.weight and .*v_proj.weight into it at row 320"
    with pytest.raises(ManifestError, match=packed):
        plan_refit(layout, 0, [1], narrow.manifest.converted("float8_e4m3fn"), layouts={1: narrow.layout("vllm")})
    # a 384-wide ffn: a tp rank's gate_up_proj is [192 gate; 192 up] rows, and its down_proj 192 columns
    wide = manifest_from_hf_config({**FP8, **CONFIGS["llama"], "intermediate_size": 384}, vocab_multiple=128)
    with pytest.raises(ManifestError, match=r"gate_up_proj.weight \[768, 512\]: the engine packs .*gate_proj"):
        plan_refit(layout, 0, [1], wide.manifest.converted("float8_e4m3fn"), layouts={1: wide.layout("vllm")})
    down = Manifest(
        tuple(replace(t, to_dtype="float8_e4m3fn") if "linear_fc2" in t.name else t for t in wide.manifest.tensors),
        layers=2,
    )
    cut = r"down_proj.weight \[512, 384\]: rank \d holds \[\d+, \d+\) of dim 1, which cuts"
    with pytest.raises(ManifestError, match=cut):
        plan_refit(layout, 0, [1], down, layouts={1: wide.layout("vllm")})
    model = manifest_from_hf_config({**FP8, **CONFIGS["qwen2"]}, vocab_multiple=128)
    for converted, words in (
        (model.manifest.converted("float8_e4m3fn", "tensor"), "with tensor scales is not planned through a layout"),
        (model.manifest.converted("float16"), "a cast to float16 is not planned through a layout"),
    ):
        with pytest.raises(ManifestError, match=words):
            plan_refit(layout, 0, [1], converted, layouts={1: model.layout("vllm")})


FP8_MOE = {**FP8, **CONFIGS["qwen3_moe"], "head_dim": 128, "moe_intermediate_size": 256}
"""A Qwen3-MoE model whose experts are whole 128x128 blocks in vLLM at expt_tp <= 2 (and hf-stacked)."""

FP8_MLA = {
    **FP8, **CONFIGS["deepseek_v3"], "q_lora_rank": 256, "kv_lora_rank": 128, "qk_nope_head_dim": 64,
    "qk_rope_head_dim": 64, "v_head_dim": 64, "moe_intermediate_size": 256,
}  # fmt: skip
"""A DeepSeek-V3 model whose vLLM tensors at tp <= 2 are whole 128x128 blocks (q_a_proj's rows in fused_qkv_a_proj)."""

VLLM_LINEAR = (
    "qkv_proj.weight", "o_proj.weight", "gate_up_proj.weight", "down_proj.weight", "w13_weight", "w2_weight",
    "fused_qkv_a_proj.weight", "q_b_proj.weight", "kv_b_proj.weight",
)  # fmt: skip
"""The weights of vLLM's linear layers (``LinearBase``) and experts (``FusedMoE``), which its fp8 quantizes: not its
embedding or head (``VocabParallelEmbedding``, ``ParallelLMHead``), norms, biases or router (``mlp.gate``, built
without a quantization config)."""


@pytest.mark.parametrize(
    ("config", "shards"),
    [
        ({**FP8, **CONFIGS["qwen2"]}, "tp=2"),
        ({**FP8, **CONFIGS["llama"]}, "tp=2"),
        (FP8_MOE, "tp=2,ep=2,expt_tp=1"),
        (FP8_MLA, "tp=2,ep=2,expt_tp=1"),
    ],
    ids=["qwen2", "llama", "qwen3_moe", "deepseek_v3"],
)
def test_fp8_into_vllm_quantizes_its_linear_weights_only(config: dict[str, Any], shards: str) -> None:
    """``--to-layout vllm --to-dtype float8_e4m3fn``: the engine ranks quantize exactly vLLM's linear and expert
    weights on landing; its embedding, head, norms (q/k and MLA's too), qkv bias and router land in the model's dtype,
    with no scale tensor vLLM would have no place for."""
    model = manifest_from_hf_config(config, vocab_multiple=128)
    plan = plan_refit(plan_layout(4, f"{shards},role=train + {shards}"), 0, [1], model.manifest.converted(
        "float8_e4m3fn"), layouts={1: model.layout("vllm")})  # fmt: skip
    (engine,) = plan.destination_placements
    landing = engine.landing
    assert landing is not None
    quantized = {t.name for t in landing if t.scale is not None}
    assert quantized == {t.name for t in engine.weights.targets if t.name.endswith(VLLM_LINEAR)}
    assert {t.scale_of for t in landing if t.scale_of is not None} == quantized
    kept = [t for t in landing if t.scale_of is None and t.name not in quantized]
    assert kept and all(t.destination_dtype == "bfloat16" and t.to_dtype is None for t in kept)
    unquantized = ("embed_tokens.weight", "lm_head.weight", "norm.weight", "layernorm.weight", "qkv_proj.bias")
    assert all(t.name.endswith((*unquantized, "mlp.gate.weight")) for t in kept)
    assert any(t.name.endswith("mlp.gate.weight") for t in kept) == bool(model.config.experts)
    for rank in (2, 3):
        local = plan.for_rank(rank).destination_shapes
        scales = {name.removesuffix("_scale_inv") for name in local if name.endswith("_scale_inv")}
        assert scales == {name for name in local if name in quantized}


def test_fp8_stacked_experts_are_blocked_per_expert() -> None:
    """Stacked experts quantized on landing have block scales per expert, as vLLM's block-quantized FusedMoE
    holds them (``w13_weight_scale_inv [local experts, 2*ffn/tp / 128, hidden / 128]``), in vLLM with ep or
    expt_tp and in hf-stacked; the expert dim is split anywhere (2 experts a rank), never blocked."""
    model = manifest_from_hf_config(FP8_MOE, vocab_multiple=128)
    fp8 = model.manifest.converted("float8_e4m3fn")
    w13, w2 = (
        "model.layers.1.mlp.experts.routed_experts.w13_weight",
        "model.layers.1.mlp.experts.routed_experts.w2_weight",
    )
    for engine, shapes in (
        ("tp=2,ep=2,expt_tp=1", {w13: (2, 512, 512), w2: (2, 512, 256)}),
        ("tp=2,expt_tp=2", {w13: (4, 256, 512), w2: (4, 512, 128)}),
    ):
        layout = plan_layout(4, f"tp=2,ep=2,expt_tp=1,role=train + {engine}")
        plan = plan_refit(layout, 0, [1], fp8, layouts={1: model.layout("vllm")})
        plain = plan_refit(layout, 0, [1], model.manifest, layouts={1: model.layout("vllm")})
        assert sorted(plan.transfers()) == sorted(plain.transfers())  # the source dtype on the wire
        fingerprint = plan.fingerprint()["destinations"]
        assert "quantizing" in fingerprint and fingerprint != plain.fingerprint()["destinations"]
        for rank in (2, 3):
            local = plan.for_rank(rank).destination_shapes
            for name, shape in shapes.items():
                blocks = (shape[0], shape[1] // 128, shape[2] // 128)
                assert local[name] == shape and local[f"{name}_scale_inv"] == blocks, (engine, rank, name)
        scale = plan.destination_tensor(f"{w13}_scale_inv")
        assert (scale.shape, scale.dtype, scale.scale_of) == ((4, 4, 4), "float32", w13)  # the engine's whole
        assert plan.destination_tensor(w2).destination_dtype == "float8_e4m3fn"
        expert = plan.subset(["decoder.layers.1.mlp.experts.linear_fc1.weight3"])  # w13 is quantized whole
        assert {t.tensor for t in expert.transfers()} == {
            f"decoder.layers.1.mlp.experts.linear_fc1.weight{e}" for e in range(4)
        }
    stacked = plan_refit(plan_layout(3, "tp=2,ep=2,expt_tp=1,role=train + dp=1"), 0, [1], fp8,
                         layouts={1: model.layout("hf-stacked")})  # fmt: skip
    local = stacked.for_rank(2).destination_shapes
    assert local["model.layers.0.mlp.experts.gate_up_proj_scale_inv"] == (4, 4, 4)
    assert local["model.layers.0.mlp.experts.down_proj_scale_inv"] == (4, 4, 2)


def test_fp8_stacked_experts_refuse_what_cuts_an_experts_block() -> None:
    """Each expert's gate and up in ``w13_weight`` are whole blocks, and a rank's box is whole blocks along the
    last two dims: else a ManifestError names the tensor and the fix, before any plan."""
    layout = plan_layout(4, "tp=2,ep=2,expt_tp=1,role=train + tp=2,expt_tp=2")
    wide = manifest_from_hf_config({**FP8_MOE, "moe_intermediate_size": 384}, vocab_multiple=128)
    packed = (
        r"w13_weight \[4, 768, 512\]: the engine packs model.layers.0.mlp.experts.0.gate_proj.weight and "
        r"model.layers.0.mlp.experts.0.up_proj.weight into it at row 192, inside a 128-row scale block"
    )
    with pytest.raises(ManifestError, match=packed):
        plan_refit(layout, 0, [1], wide.manifest.converted("float8_e4m3fn"), layouts={1: wide.layout("vllm")})
    down = Manifest(
        tuple(replace(t, to_dtype="float8_e4m3fn") if "linear_fc2" in t.name else t for t in wide.manifest.tensors),
        layers=2,
        experts=4,
    )
    cut = r"w2_weight \[4, 512, 384\]: rank \d holds \[\d+, \d+\) of dim 2, which cuts a 128x128 scale block"
    with pytest.raises(ManifestError, match=cut):
        plan_refit(layout, 0, [1], down, layouts={1: wide.layout("vllm")})


def test_cli_says_what_is_quantized_on_landing(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``--to-layout vllm --to-dtype float8_e4m3fn``: the summary counts wire bytes in the source dtype and says
    which tensors the engine ranks quantize; a layout that cuts a block fails as one line, exit 2."""
    from shardcore.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**FP8, **CONFIGS["qwen2"]}))
    shards = ["refit", "--world", "4", "--shards", "tp=2,role=train + tp=2", "--from", "0", "--to", "1"]
    assert main([*shards, "--model", f"hf:{config}", "--to-layout", "vllm", "--to-dtype", "float8_e4m3fn"]) == 0
    out = capsys.readouterr().out
    assert "quantized on landing: 8 destination tensors to float8_e4m3fn" in out and "in the source dtype" in out
    assert (
        main([*shards, "--model", f"hf:{config}", "--to-layout", "vllm", "--to-dtype", "float8_e4m3fn", "--json"]) == 0
    )
    data = json.loads(capsys.readouterr().out)
    assert (
        data["to_layout"] == "vllm" and data["from_layout"] == "megatron" and list(data["destination_tensors"]) == ["1"]
    )
    engine = data["destination_tensors"]["1"]
    qkv = engine["model.layers.0.self_attn.qkv_proj.weight"]
    assert qkv["dtype"] == "bfloat16" and qkv["to_dtype"] == "float8_e4m3fn" and qkv["scale"] == "block"
    scale = engine["model.layers.0.self_attn.qkv_proj.weight_scale_inv"]
    assert scale["scale_of"] == "model.layers.0.self_attn.qkv_proj.weight" and scale["dtype"] == "float32"
    assert sum("scale" in entry for entry in engine.values()) == 8  # the same count as the summary's
    for kept in ("model.embed_tokens.weight", "model.layers.0.self_attn.qkv_proj.bias", "model.norm.weight"):
        assert "to_dtype" not in engine[kept] and f"{kept}_scale_inv" not in engine[kept]
    config.write_text(json.dumps({**FP8, **CONFIGS["qwen2"], "num_attention_heads": 8, "head_dim": 64}))
    assert main([*shards, "--model", f"hf:{config}", "--to-layout", "vllm", "--to-dtype", "float8_e4m3fn"]) == 2
    assert "qkv_proj.weight [768, 512]: the engine packs" in capsys.readouterr().err


@pytest.mark.parametrize(("config", "engine"), [(CONFIGS["qwen2"], "tp=2"), (FP8_MOE, "tp=2,expt_tp=2")])
def test_fp8_from_an_hf_layout_quantizes_what_megatron_shards_would(config: dict[str, Any], engine: str) -> None:
    """A source in an HF layout (a checkpoint) converts each of its tensors as the Megatron tensors that feed it:
    into vLLM the same tensors are quantized on landing, with the same scale shapes, as from Megatron shards; into
    Megatron shards, the same tensors and scale tensors as a refit between Megatron shards makes. A subset of q_proj
    refits k_proj and v_proj with it: qkv_proj is quantized whole."""
    model = manifest_from_hf_config({**FP8, **config}, vocab_multiple=128)
    fp8 = model.manifest.converted("float8_e4m3fn")
    vllm = model.layout("vllm")
    from_megatron = plan_refit(plan_layout(4, f"tp=2,role=train + {engine}"), 0, [1], fp8, layouts={1: vllm})
    for start in ("hf", "hf-stacked"):
        layout = plan_layout(3, f"dp=1,role=train + {engine}")
        from_hf = plan_refit(layout, 0, [1], fp8, layouts={0: model.layout(start), 1: vllm})
        for rank in (1, 2):
            assert from_hf.for_rank(rank).destination_shapes == from_megatron.for_rank(rank + 1).destination_shapes
    q_proj = from_hf.subset(["model.layers.0.self_attn.q_proj.weight"])  # k and v land in the same qkv_proj
    qkv = "model.layers.0.self_attn.qkv_proj.weight"
    assert set(q_proj.for_rank(1).destination_shapes) == {qkv, f"{qkv}_scale_inv"}
    assert {name.split(".")[-2] for name in q_proj.for_rank(0).source_shapes} == {"q_proj", "k_proj", "v_proj"}
    into_megatron = plan_refit(plan_layout(3, "dp=1,role=train + tp=2"), 0, [1], fp8, layouts={0: model.layout("hf")})
    between_shards = plan_refit(plan_layout(4, "tp=2,role=train + tp=2"), 0, [1], fp8)
    shapes = into_megatron.for_rank(1).destination_shapes
    assert shapes == between_shards.for_rank(2).destination_shapes
    assert sum(name.endswith("_scale_inv") for name in shapes) == sum(t.scale_of is not None for t in fp8)


def test_fp8_from_an_hf_layout_refuses_a_tensor_fed_by_tensors_converted_unlike() -> None:
    """hf-stacked's ``gate_up_proj`` holds every expert of a layer: one expert left in bf16 by the converting
    manifest cannot be quantized with the rest, a ManifestError naming both tensors, before any plan."""
    model = manifest_from_hf_config({**FP8, **FP8_MOE}, vocab_multiple=128)
    kept = "decoder.layers.0.mlp.experts.linear_fc1.weight1"
    fp8 = model.manifest.converted("float8_e4m3fn")
    fp8 = replace(fp8, tensors=tuple(
        replace(t, to_dtype=None, scale=None) if t.name == kept else t for t in fp8 if t.scale_of != kept
    ))  # fmt: skip
    layouts = {0: model.layout("hf-stacked"), 1: model.layout("vllm")}
    words = r"gate_up_proj is made of tensors converted unlike \(.*linear_fc1.weight1 to its dtype"
    with pytest.raises(ManifestError, match=words):
        plan_refit(plan_layout(3, "dp=1,role=train + tp=2,expt_tp=2"), 0, [1], fp8, layouts=layouts)


def test_cli_fp8_from_the_hf_layout(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``refit --from-layout hf --to-layout vllm --to-dtype float8_e4m3fn`` plans (it was refused): the summary
    says what the engine ranks quantize, as from Megatron shards."""
    from shardcore.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**FP8, **CONFIGS["qwen2"]}))
    argv = ["refit", "--world", "3", "--shards", "dp=1,role=train + tp=2", "--from", "0", "--to", "1"]
    argv += ["--model", f"hf:{config}", "--from-layout", "hf", "--to-layout", "vllm", "--to-dtype", "float8_e4m3fn"]
    assert main(argv) == 0
    assert "quantized on landing: 8 destination tensors to float8_e4m3fn" in capsys.readouterr().out


def test_fp8_into_a_destination_in_the_source_layout_is_refused_naming_the_fix() -> None:
    """A plan through a layout converts on landing where the layout changes; a Megatron destination beside a vLLM
    one, from Megatron shards, would need the senders' quantizing of a plan between shards: refused, naming it."""
    model = manifest_from_hf_config({**FP8, **CONFIGS["qwen2"]}, vocab_multiple=128)
    layout = plan_layout(6, "tp=2,role=train + tp=2 + tp=2")
    words = r"shard 2 .* holds the source's own layout: .* convert into this shard in a refit of its own"
    with pytest.raises(ManifestError, match=words):
        plan_refit(layout, 0, [1, 2], model.manifest.converted("float8_e4m3fn"), layouts={1: model.layout("vllm")})


def test_a_rank_part_gives_dtypes_beside_shapes() -> None:
    """``RankRefit`` names the dtype of every tensor it names a shape of, as the executor checks them: the source's
    bf16 on the trainer; on an engine rank quantizing fp8 on landing, its linear weights in float8_e4m3fn, their
    scale tensors in float32, and what it keeps (embedding, norms, biases) in bf16."""
    model = manifest_from_hf_config({**FP8, **CONFIGS["qwen2"]}, vocab_multiple=128)
    plan = plan_refit(plan_layout(4, "tp=2,role=train + tp=2"), 0, [1], model.manifest.converted("float8_e4m3fn"),
                      layouts={1: model.layout("vllm")})  # fmt: skip
    trainer, engine = plan.for_rank(0), plan.for_rank(2)
    assert trainer.source_dtypes.keys() == trainer.source_shapes.keys() and set(trainer.source_dtypes.values()) == {
        "bfloat16"
    }
    assert engine.destination_dtypes.keys() == engine.destination_shapes.keys()
    dtypes = engine.destination_dtypes
    assert dtypes["model.layers.0.self_attn.qkv_proj.weight"] == "float8_e4m3fn"
    assert dtypes["model.layers.0.self_attn.qkv_proj.weight_scale_inv"] == "float32"
    assert dtypes["model.embed_tokens.weight"] == dtypes["model.layers.0.self_attn.qkv_proj.bias"] == "bfloat16"
    for name, dtype in dtypes.items():  # the executor's own expectation, tensor by tensor
        assert plan.destination_tensor(name).destination_dtype == dtype, name


def test_boxes_in_the_destination_tensors_own_coordinates(tmp_path: Any, capsys: pytest.CaptureFixture[str]) -> None:
    """``--coords dest``: a vLLM rank's receives shown as rows of its own local ``qkv_proj`` (tp rank 1's start at 0,
    where their global boxes start past tp rank 0's), each element written once; JSON adds ``dst_box``; the
    default stays global, and the flag without --rank or --transfers is refused."""
    from shardcore.cli import main

    config = tmp_path / "config.json"
    config.write_text(json.dumps({**BASE, **CONFIGS["qwen2"]}))
    argv = ["refit", "--world", "4", "--shards", "tp=2,role=train + tp=2", "--from", "0", "--to", "1"]
    argv += ["--model", f"hf:{config}", "--to-layout", "vllm", "--rank", "3"]
    plan = plan_refit(plan_layout(4, "tp=2,role=train + tp=2"), 0, [1], model_of("qwen2").manifest,
                      layouts={1: model_of("qwen2").layout("vllm")})  # fmt: skip
    mine = plan.for_rank(3)
    qkv = [t for t in mine.recvs if t.destination == "model.layers.0.self_attn.qkv_proj.weight"]
    assert min(t.box[0][0] for t in qkv) > 0 and min(t.dst_box[0][0] for t in qkv) == 0
    shapes, count = written(plan, 3)
    for transfer in (*mine.recvs, *mine.copies):  # each dst_box lies inside its local tensor, and they tile it
        shape = shapes[transfer.destination]
        assert all(0 <= start < stop <= size for (start, stop), size in zip(transfer.dst_box, shape))
    assert sum(prod(t.shape) for t in (*mine.recvs, *mine.copies)) == len(count) and set(count.values()) == {1}
    assert main([*argv, "--coords", "dest"]) == 0
    out = capsys.readouterr().out
    assert "box in the destination rank's tensor" in out
    shown = "[" + ", ".join(f"{a}:{b}" for a, b in qkv[0].dst_box) + "]"
    assert any("qkv_proj.weight" in line and shown in line for line in out.splitlines())
    assert main(argv) == 0 and "global box" in capsys.readouterr().out
    assert main([*argv, "--coords", "dest", "--json"]) == 0
    recvs = json.loads(capsys.readouterr().out)["rank"]["recvs"]
    for recv in recvs:  # at its offset in the destination's tensor, as large as its global box
        assert [start for start, _ in recv["dst_box"]] == recv["dst_offset"]
        assert prod(b - a for a, b in recv["dst_box"]) == prod(b - a for a, b in recv["box"])
    assert main([*argv[:-2], "--coords", "dest"]) == 2
    assert "--coords needs --rank or --transfers" in capsys.readouterr().err


@pytest.mark.parametrize(
    ("family", "keys"),
    [
        ("qwen3_moe", {"num_experts": 4}),  # transformers 4
        ("qwen3_moe", {"num_local_experts": 4}),  # transformers 5
        ("qwen3_moe", {"num_experts": 4, "num_local_experts": 4}),
        ("deepseek_v3", {"n_routed_experts": 4}),
        ("deepseek_v3", {"num_local_experts": 4}),  # transformers 5's other name for it
    ],
)
def test_every_key_transformers_saves_the_expert_count_under_gives_the_moe_model(
    family: str, keys: dict[str, int]
) -> None:
    config = {k: v for k, v in CONFIGS[family].items() if k not in ("num_experts", "n_routed_experts")}
    model = manifest_from_hf_config({**BASE, **config, **keys}, vocab_multiple=128)
    assert model.config.experts == 4
    assert model.manifest == model_of(family).manifest
    assert any(".mlp.experts." in tensor.name for tensor in model.manifest)


@pytest.mark.parametrize(
    ("family", "keys", "words"),
    [
        ("qwen3_moe", {}, ["no expert count", "num_experts or num_local_experts"]),
        ("deepseek_v3", {}, ["no expert count", "n_routed_experts or num_local_experts"]),
        ("qwen3_moe", {"num_local_experts": "4"}, ["num_local_experts='4'", "integer"]),
        ("qwen3_moe", {"num_experts": 4.0}, ["num_experts=4.0", "integer"]),
        ("qwen3_moe", {"num_local_experts": True}, ["num_local_experts=True"]),
        ("deepseek_v3", {"n_routed_experts": -1}, ["n_routed_experts=-1"]),
        ("qwen3_moe", {"num_experts": 4, "num_local_experts": 8}, ["num_experts=4, num_local_experts=8", "keep one"]),
    ],
)
def test_an_expert_count_that_cannot_be_read_is_refused_never_a_dense_plan(
    family: str, keys: dict[str, Any], words: list[str]
) -> None:
    config = {k: v for k, v in CONFIGS[family].items() if k not in ("num_experts", "n_routed_experts")}
    with pytest.raises(ManifestError) as error:
        manifest_from_hf_config({**BASE, **config, **keys})
    message = str(error.value)
    assert "\n" not in message and len(message) < 300, message
    for word in words:
        assert word in message, message


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_the_vllm_vocabulary_padding_is_zeroed_and_megatrons_left_alone(family: str) -> None:
    """vLLM's loader zeroes its vocabulary padding (a refit writes it so, on the tp ranks that hold it, in their
    local coordinates); Megatron's padding, refit from a checkpoint, is left as it is."""
    model = model_of(family)
    hidden = BASE["hidden_size"]
    layout = plan_layout(2 + 2, "tp=2,role=train + tp=2")
    (engine,) = plan_refit(layout, 0, [1], model.manifest, layouts={1: model.layout("vllm")}).destination_placements
    heads = ["model.embed_tokens.weight"] + ([] if model.config.tied_embeddings else ["lm_head.weight"])
    assert engine.zeroed(2) == {}  # its rows 0-63 are all real
    assert engine.zeroed(3) == {name: (((100 - 64, 64), (0, hidden)),) for name in heads}  # global rows 100-127
    assert engine.zeroed(0) == {}  # not an engine rank
    back = plan_layout(1 + 2, "dp=1 + tp=2,role=train")
    (megatron,) = plan_refit(back, 0, [1], model.manifest, layouts={0: model.layout("hf")}).destination_placements
    assert megatron.weights.padding and all(megatron.zeroed(rank) == {} for rank in (1, 2))


@pytest.mark.parametrize("family", FAMILIES)
def test_stats_made_by_kind_are_the_stats_of_every_tile(family: str) -> None:
    """``RefitStats.of`` adds up routes' runs made without their tiles, once per kind of tensor (``_kind_runs``):
    the same figures as adding every tile's pieces, into every layout, fp8 with its scale tensors included."""
    from tests.core.test_refit_plan import stats_tile_by_tile

    model = model_of(family, num_hidden_layers=3)
    layout = plan_layout(4 + 2 + 2, "tp=2,dp=2,role=train + tp=2 + dp=2")
    for kind in ("megatron", "hf", "hf-stacked"):
        layouts = {1: model.layout("vllm"), 2: model.layout(kind)}
        plan = plan_refit(layout, 0, [1, 2], model.manifest, 4, layouts=layouts)
        assert RefitStats.of(plan) == stats_tile_by_tile(plan), kind
    from tests.core.test_refit_convert import _blocky

    for fp8 in (model.manifest.converted("float8_e4m3fn", "tensor"), _blocky(scale="block")):
        plan = plan_refit(plan_layout(8, "tp=2,dp=2,role=train + tp=1,dp=4"), 0, [1], fp8, 4, min_piece_bytes=0)
        stats = RefitStats.of(plan)
        assert stats == stats_tile_by_tile(plan) and stats.scale_bytes > 0


def test_stats_by_kind_order_a_routes_rows_by_their_boxes() -> None:
    """A map whose links read their source out of order (its last row first) gives a route its rows in link order;
    the stats made by kind lay the run out in box order, as every tile's run is, so the line's cuts fall where
    they fall for every tile (three holders: a cut inside a tile costs a piece more)."""
    from shardcore.refit.placement import ExplicitPlacement, HeldBox
    from shardcore.refit.weightmap import MappedPlacement
    from tests.core.test_refit_plan import stats_tile_by_tile

    source = Manifest(tuple(TensorSpec(name, (4, 2), stage="all") for name in ("a", "b")))
    target = Manifest(tuple(TensorSpec(name, (4, 2), stage="all") for name in ("x", "y")))
    links = [Link(t, rows((4, 2), 0, 1), s, rows((4, 2), 3, 4)) for t, s in (("x", "a"), ("y", "b"))]
    links += [Link(t, rows((4, 2), 1, 4), s, rows((4, 2), 0, 3)) for t, s in (("x", "a"), ("y", "b"))]
    weights = WeightMap(source, target, links)
    held = ExplicitPlacement(source, [HeldBox(name, rank, ((0, 4), (0, 2))) for name in "ab" for rank in (0, 3, 4)])
    engine = ExplicitPlacement(target, [HeldBox(name, rank, ((0, 4), (0, 2))) for name in "xy" for rank in (1, 2)])
    plan = plan_refit_from(held, MappedPlacement(engine, weights), min_piece_bytes=0, world_size=5)
    assert [link.origin for link in weights.into("x")] == [rows((4, 2), 3, 4), rows((4, 2), 0, 3)]
    assert RefitStats.of(plan) == stats_tile_by_tile(plan)


@pytest.mark.parametrize("family", FAMILIES)
def test_parts_received_by_kind_are_the_plans(family: str) -> None:
    """A source slice with one holder (no dp replicas): each of its tiles comes whole from that holder, so a rank's
    receives of tensors held alike are found once per kind (``HeldAlike``) without cutting runs; a slice held by
    both tp ranks (a norm) goes the general way. Both are the plan's, in the part's one order, into an engine, into
    Hugging Face's stacked layout and into Megatron's own shards."""
    model = model_of(family)
    moe = family in ("qwen3_moe", "deepseek_v3")
    source = "tp=2,ep=2,expt_tp=1,role=train" if moe else "tp=2,role=train"
    engine = "tp=4,ep=2,expt_tp=2" if moe else "tp=4"
    megatron = "tp=2,dp=2,ep=2,expt_tp=1" if moe else "tp=2,dp=2"
    layout = plan_layout(2 + 4 + 4 + 1, f"{source} + {engine} + {megatron} + dp=1")
    layouts = {1: model.layout("vllm"), 3: model.layout("hf-stacked")}
    plan = plan_refit(layout, 0, [1, 2, 3], model.manifest, layouts=layouts, min_piece_bytes=0)
    sources = plan.source_placement
    holders = {len(piece.holders.ranks) for p in range(len(model.manifest)) for piece in sources.slices(p)}
    assert holders == {1, 2}
    every = list(plan.transfers())
    order = transfer_order(model.manifest)
    for rank in range(2, layout.world_size):
        received = [t for t in every if t.dst == rank and t.src != rank]
        assert received and list(plan.for_rank(rank).recvs) == sorted(received, key=order), rank


@pytest.mark.parametrize("family", ["llama", "qwen3_moe", "deepseek_v3"])
@pytest.mark.parametrize("into", ["vllm", "megatron"])
def test_held_alike_is_held(family: str, into: str) -> None:
    """Tensors held alike through a map (``held_alike``) are those ``held`` gives, local tensor by local tensor, their
    slices named by the local tensor, and tensors of one kind have equal slices: into an engine's tensors, and from a
    checkpoint's into Megatron's (whose last tp rank holds only vocabulary padding of the embedding: no source feeds
    it, so it is not among them)."""
    model = manifest_from_hf_config({**BASE, **CONFIGS[family]}, vocab_multiple=512)  # 100 rows padded to 512
    if into == "vllm":
        layout = plan_layout(2 + 4, "tp=2,role=train + tp=4,ep=2,expt_tp=2")
        plan = plan_refit(layout, 0, [1], model.manifest, layouts={1: model.layout("vllm")})
    else:
        plan = RefitRequest(model, "dp=1,role=train + tp=2", 0, (1,), from_layout="hf").plan(3)
    placement = plan.destination_placements[0]
    for rank in placement.ranks:
        alike = list(placement.held_alike(rank))
        named = [
            (position, held.shape, tuple(s._replace(target=held.name) for s in slices), held.name)
            for held in alike
            for position, slices, _ in held.members
        ]
        assert named == [tuple(h) for h in placement.held(rank)]
        kinds: dict[Any, tuple[Any, ...]] = {}
        for held in alike:
            for _, slices, kind in held.members:
                assert kind is not None and kinds.setdefault(kind, slices) == slices
        assert len(kinds) < len(named)  # the same weight of every layer is of one kind
    engine = placement.engine  # type: ignore[attr-defined]
    assert len(list(placement.held_alike(2))) < len(list(engine.held(2))) or into == "vllm"
