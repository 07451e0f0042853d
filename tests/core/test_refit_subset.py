"""Partial refits: ``plan.subset(names or predicate)`` is a plan like any other, over some tensors only."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable

import pytest

from shardcore.errors import RefitError
from shardcore.plan.layout import plan_layout
from shardcore.refit import RefitPlan, RefitStats, Transfer, plan_refit, preset, tensors_matching
from tests.core.test_refit_plan import _tiny, check_for_rank, check_stats, simulate

MOE = "tp=2,pp=2,dp=2,ep=2,role=train + tp=4,ep=4,expt_tp=1,role=prefill + tp=1,dp=4,ep=2,role=decode"


def _delivered(transfers: Iterable[Transfer]) -> Counter[tuple[str, int, bool]]:
    """Bytes per (tensor, receiving rank, local copy or not)."""
    found: Counter[tuple[str, int, bool]] = Counter()
    for t in transfers:
        found[t.tensor, t.dst, t.is_local] += t.bytes
    return found


def _full() -> RefitPlan:
    return plan_refit(plan_layout(16, MOE), 0, [1, 2], _tiny(), 4, min_piece_bytes=64)


@pytest.mark.parametrize(
    "selection",
    [
        lambda t: t.expert in (0, 1),  # some experts
        lambda t: t.name.endswith(".ln"),  # small tensors only
        "l1.fc1",  # one name
        ["emb", "norm", "l3.e2"],  # tensors that changed
    ],
)
def test_a_subset_moves_exactly_what_the_full_plan_moves_of_those_tensors(selection: object) -> None:
    full = _full()
    part = full.subset(selection)  # type: ignore[arg-type]
    kept = {full.manifest.tensors[p].name for p in part.tensors}  # type: ignore[union-attr]
    assert kept and len(kept) < len(full.manifest)
    transfers = simulate(part)  # the same bytes into the same ranks, spread over the holders anew (its own runs)
    assert _delivered(transfers) == _delivered(t for t in full.transfers() if t.tensor in kept)
    check_for_rank(part, transfers)
    check_stats(part, transfers)
    stats = RefitStats.of(part)
    assert stats.total_bytes == sum(t.bytes for t in transfers if not t.is_local) < RefitStats.of(full).total_bytes
    for rank in (0, 5, 8, 12):
        mine = part.for_rank(rank)
        assert set(mine.source_shapes) <= kept and set(mine.destination_shapes) <= kept


def test_the_fingerprint_tells_subsets_apart() -> None:
    full = _full()
    experts = full.subset(lambda t: t.expert == 0)
    assert experts.fingerprint()["manifest"] != full.fingerprint()["manifest"]
    assert "a subset of" in experts.fingerprint()["manifest"] and "a subset" not in full.fingerprint()["manifest"]
    assert experts.fingerprint() == _full().subset(lambda t: t.expert == 0).fingerprint()
    assert experts.fingerprint() != full.subset(lambda t: t.expert == 1).fingerprint()
    names = [full.manifest.tensors[p].name for p in sorted(experts.tensors)]  # type: ignore[arg-type]
    assert full.subset(names).fingerprint() == experts.fingerprint()  # by names or predicate alike


def test_a_subset_of_a_subset_keeps_to_it() -> None:
    full = _full()
    experts = full.subset(lambda t: t.expert is not None)
    first = experts.subset(lambda t: t.expert == 0)
    assert first.tensors == full.subset(lambda t: t.expert == 0).tensors
    with pytest.raises(RefitError, match=r"tensor 'norm' is not in this plan's tensors"):
        experts.subset(["norm"])


@pytest.mark.parametrize(
    ("selection", "match"),
    [
        (["no.such.tensor"], r"subset: tensor 'no.such.tensor' is not in the manifest: name tensors of "),
        ([3], "subset: tensor 3 is not in the manifest"),
        (lambda t: False, "selects none of the "),
        ([], "selects none of the "),
        (7, r"subset\(7\): expected tensor names or a predicate"),
        ({"a": 1}, r"expected tensor names or a predicate"),
        (b"bytes", r"expected tensor names or a predicate"),
    ],
)
def test_bad_subsets_are_refit_errors(selection: object, match: str) -> None:
    with pytest.raises(RefitError, match=match) as caught:
        _full().subset(selection)  # type: ignore[arg-type]
    assert len(str(caught.value)) < 400


def test_selecting_experts_of_a_dense_model_says_it_has_none() -> None:
    plan = plan_refit(plan_layout(16, "tp=8,role=train + tp=8"), 0, 1, preset("llama3-8b"))
    with pytest.raises(RefitError, match=r"selects none of the 195 tensors of 'llama3-8b', none an expert's"):
        plan.subset(lambda tensor: tensor.expert is not None)


def test_tensors_matching_finds_names_by_pattern() -> None:
    manifest = preset("tiny-moe")
    experts = tensors_matching(manifest, "*.experts.*")
    assert experts and all(".experts." in name for name in experts)
    assert tensors_matching(manifest, ["*.experts.*", "embedding.*"]) == tuple(
        t.name for t in manifest if ".experts." in t.name or t.name.startswith("embedding.")
    )
    with pytest.raises(RefitError, match=r"tensor pattern '\*lora\*' matches no tensor of 'tiny-moe'"):
        tensors_matching(manifest, ["*.experts.*", "*lora*"])
    with pytest.raises(RefitError, match="tensor pattern 5: expected text"):
        tensors_matching(manifest, [5])  # type: ignore[list-item]


def test_a_weight_and_its_fp8_scales_are_refitted_together() -> None:
    manifest = preset("tiny-dense").converted("float8_e4m3fn", "tensor")
    full = plan_refit(plan_layout(4, "tp=2,role=train+tp=1+tp=1"), 0, [1, 2], manifest)
    weight = "decoder.layers.0.mlp.linear_fc1.weight"
    for selection in (weight, f"{weight}_scale_inv"):  # either one brings the other
        part = full.subset(selection)
        kept = {full.manifest.tensors[p].name for p in part.tensors}  # type: ignore[union-attr]
        assert kept == {weight, f"{weight}_scale_inv"}, selection
        assert {t.tensor for t in part.transfers()} == kept
