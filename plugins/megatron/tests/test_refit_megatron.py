"""shardcore_megatron.refit on a live 4-rank gloo world: tiny megatron-core GPTs on CPU (0.16.1; 0.19.2 in megatron019).

After each refit the destination's weights, gathered to full tensors over its own groups, equal the
source's bitwise, and both models' forward passes on the same tokens give the same logits: bitwise
where the two sides have the same tp and cp (pp and dp only move whole computations between ranks),
within ``LOGIT_TOLERANCE`` otherwise (see there). All cases share one world: each costs about a second,
the world's start (torch and megatron-core imported on every rank) most of the test's time.
"""

from __future__ import annotations

from typing import Any

import pytest

from plugins.megatron.tests import megatron_recipe as recipe  # skips this module without megatron-core
from plugins.megatron.tests import megatron_refit_workers as workers
from plugins.megatron.tests.megatron_refit_workers import Case
from shardcore import plan_layout
from shardcore.plan import ShardSpec
from shardcore.testing import run_world

EMBEDDING = "embedding.word_embeddings.weight"
Tiny = recipe.Tiny
CASES = [
    Case("collocated tp=2,pp=2 -> tp=4", "tp=2,pp=2", "tp=4"),
    Case("MoE dp=2,ep=2,expt_tp=1 -> tp=2 (expt_tp=2)", "dp=2,ep=2,expt_tp=1 + tp=2", model=Tiny(experts=4)),
    Case("cp=2 -> tp=2", "cp=2 + tp=2"),
    Case("tp=2 -> cp=2", "tp=2 + cp=2"),
    Case("collocated tp=2,cp=2 -> cp=2,pp=2, tied", "tp=2,cp=2", "cp=2,pp=2", model=Tiny(tied=True)),
    Case(
        "pp=2 split 1+3, tied -> dp=2", "pp=2 + dp=2", model=Tiny(tied=True, first_stage_layers=1, last_stage_layers=3)
    ),
    Case(
        "tp=2,pp=2 -> cp=2,pp=2, split 3+1, tied", "tp=2,pp=2", "cp=2,pp=2", model=Tiny(tied=True, first_stage_layers=3)
    ),
    Case(
        "MoE bf16, float32 expert_bias: tp=2,ep=2,expt_tp=1 -> dp=2,ep=2",
        "tp=2,ep=2,expt_tp=1 + dp=2,ep=2,expt_tp=1",
        model=Tiny(experts=4, expert_bias=True, bf16=True),
    ),
    Case("packed blocks (Mamba's in_proj): collocated tp=2,dp=2 -> tp=4", "tp=2,dp=2", "tp=4", model=Tiny(packed=True)),
    Case("packed blocks (Mamba's in_proj): tp=2 -> dp=2", "tp=2 + dp=2", model=Tiny(packed=True)),
]
REFUSED = [
    Case(
        "pp=2 split 1+3 -> pp=2 even",
        "pp=2,tp=2",
        "pp=2,dp=2",
        model=Tiny(first_stage_layers=1, last_stage_layers=3),
        target_model=Tiny(),
    ),
]
LOGIT_TOLERANCE = 1e-5
"""Largest difference of two logits, relative to the largest logit, between models whose tp or cp differ.

The weights are equal bitwise, so only the order of float32 additions differs: row-parallel layers
(``linear_proj``, ``linear_fc2``) add tp partial sums, the vocab-parallel embedding adds zeros
(exact), and cp attention multiplies other shapes. A reordered sum of n terms moves by at most about
(n - 1) * 2^-24 of the sum of its terms' magnitudes; the widest sums here have n = 128
(``ffn_hidden_size``): 8e-6, and each layer norm rescales what it passes on, so four layers stay
near that. Measured: at most 7.2e-7 absolute on logits up to 1.7-2.0 (4e-7 relative)."""


@pytest.fixture(scope="module")
def world() -> list[tuple[list[dict[str, Any]], list[dict[str, Any]]]]:
    return run_world(4, workers.refit_world, CASES + REFUSED, timeout=600)


@pytest.fixture(scope="module")
def results(world: Any) -> list[list[dict[str, Any]]]:
    return [cases for cases, _ in world]


def _case(results: Any, index: int) -> list[dict[str, Any]]:
    per_rank = [rank_results[index] for rank_results in results]
    for rank, result in enumerate(per_rank):
        assert result["error"] is None, (CASES[index].label, rank, result["error"])
    return per_rank


def _sides(case: Case) -> tuple[ShardSpec, ShardSpec]:
    source = plan_layout(4, case.source)
    target = plan_layout(4, case.target).shards[0] if case.target else source.shards[1]
    return source.shards[0].spec, target.spec


@pytest.mark.parametrize("index", range(len(CASES)), ids=[case.label for case in CASES])
def test_destination_weights_gathered_equal_the_source(results: Any, index: int) -> None:
    per_rank = _case(results, index)
    source: dict[str, set[tuple[Any, ...]]] = {}
    for result in per_rank:
        for name, _, shape, digest in result["src"]:
            source.setdefault(name, set()).add((shape, digest))
    assert all(len(seen) == 1 for seen in source.values()), "source replicas differ: the fill is wrong"
    received = {name for result in per_rank for name, *_ in result["dst"]}
    assert received == set(source)  # every tensor of the model reached some destination rank
    for rank, result in enumerate(per_rank):
        wrong = [local for name, local, shape, digest in result["dst"] if source[name] != {(shape, digest)}]
        assert not wrong, (CASES[index].label, rank, wrong)


DENSE = [index for index, case in enumerate(CASES) if case.runs_forward]


@pytest.mark.parametrize("index", DENSE, ids=[CASES[index].label for index in DENSE])
def test_both_models_give_the_same_logits(results: Any, index: int) -> None:
    case = CASES[index]
    logits = _case(results, index)[0]["logits"]
    source, target = _sides(case)
    assert logits["copies"] == (source.tp * source.cp * source.dp, target.tp * target.cp * target.dp)
    assert logits["replicas_agree"]
    if (source.tp, source.cp) == (target.tp, target.cp):
        assert logits["max_diff"] == 0.0
    else:
        assert logits["max_diff"] <= LOGIT_TOLERANCE * logits["max_logit"], logits


def test_the_tied_copy_on_the_last_stage_is_filled(results: Any) -> None:
    """With pp=2 the output layer's weight on the last stage is the embedding: refit fills it there."""
    for index, case in enumerate(CASES):
        if not case.model.tied or _sides(case)[1].pp == 1:
            continue
        copies = [
            (name, digest)
            for result in _case(results, index)
            for name, local, _, digest in result["dst"]
            if local == "output_layer.weight"
        ]
        embedding = {
            digest for result in _case(results, index) for name, _, _, digest in result["src"] if name == EMBEDDING
        }
        assert copies and {name for name, _ in copies} == {EMBEDDING}, case.label
        assert {digest for _, digest in copies} == embedding, case.label


def test_collocated_ranks_copy_and_moe_experts_arrive(results: Any) -> None:
    collocated, moe = _case(results, 0), _case(results, 1)
    assert all(r["copied"] > 0 for r in collocated)  # each tp=4 rank held part of its weights already
    assert all(r["received"] > 0 for r in moe[2:])
    names = {name for r in moe for name, *_ in r["dst"]}
    assert names >= {
        f"decoder.layers.{layer}.mlp.experts.local_experts.{e}.linear_fc1.weight"
        for layer in range(4)
        for e in range(4)
    }


@pytest.mark.parametrize("index", range(len(REFUSED)), ids=[case.label for case in REFUSED])
def test_two_pipeline_splits_are_refused_on_every_rank(results: Any, index: int) -> None:
    messages = {rank_results[len(CASES) + index]["error"] for rank_results in results}
    assert len(messages) == 1 and None not in messages
    message = messages.pop()
    assert "num_layers_in_first_pipeline_stage=1, num_layers_in_last_pipeline_stage=3" in message
    assert "evenly" in message and len(message) < 1000


def test_expert_bias_arrives_in_the_source_dtype(results: Any) -> None:
    """The trainer's router keeps expert_bias in float32, the fresh bf16 model holds it in bf16: refit moves it
    (its digest equals the source's, checked above) and the destination's buffer becomes float32."""
    index = next(i for i, case in enumerate(CASES) if case.model.expert_bias)
    per_rank = _case(results, index)
    names = {f"decoder.layers.{layer}.mlp.router.expert_bias" for layer in range(4)}
    for side in ("src", "dst"):
        held = {(name, dtype) for result in per_rank for name, dtype in result["buffers"][side]}
        assert {name for name, _ in held} == names, side
        assert {dtype for _, dtype in held} == {"torch.float32"}, side
    received = {name for result in per_rank for name, *_ in result["dst"]}
    assert names <= received


def test_packed_blocks_are_split_block_by_block(results: Any) -> None:
    """partition_sizes (unequal blocks): the gathered destination equals the source (checked above) and
    every layer's packed projection took part."""
    for index, case in enumerate(CASES):
        if case.model.packed:
            names = {name for result in _case(results, index) for name, *_ in result["dst"]}
            assert {f"decoder.layers.{layer}.in_proj.weight" for layer in range(4)} <= names, case.label


def test_a_kept_plan_serves_the_next_call_and_a_changed_key_plans_again(world: Any) -> None:
    steps = [ranks for _, ranks in world]
    for step in range(4):
        per_rank = [rank_steps[step] for rank_steps in steps]
        expected = (1, 0) if step in (0, 2) else (0, 1)  # steps 1 and 3 bring a key seen before
        assert {(r["built"], r["kept"]) for r in per_rank} == {expected}, (step, per_rank[0]["target"])
        source = {name: (shape, digest) for r in per_rank for name, _, shape, digest in r["src"]}
        wrong = [
            (rank, local)
            for rank, r in enumerate(per_rank)
            for name, local, shape, digest in r["dst"]
            if source[name] != (shape, digest)
        ]
        assert not wrong, (step, wrong)  # the kept plan moved the new step's weights
