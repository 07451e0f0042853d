"""Listing, lazy import, the unavailable path, and the typed errors of the drop-in builders and of refit (no world)."""

from __future__ import annotations

import importlib.util
import subprocess
import sys
from dataclasses import dataclass
from typing import Any

import pytest

import shardcore
from shardcore import LayoutError, ShardSpecError
from shardcore.errors import BackendUnavailableError, GroupCreationError, RefitInputError
from shardcore_megatron import backend as megatron_backend
from shardcore_megatron.refit import manifest_from_records
from shardcore_megatron.shards import (
    InferenceShard,
    build_inference_pg_collection,
    build_inference_pg_collections_for_shards,
    normalize_shard_specs,
)


def _hide_megatron(monkeypatch: pytest.MonkeyPatch) -> None:
    real = importlib.util.find_spec

    def find_spec(name: str, *args: object) -> object:
        return None if name.split(".")[0] == "megatron" else real(name, *args)

    monkeypatch.setattr(megatron_backend.importlib.util, "find_spec", find_spec)


def test_listed_without_importing_megatron() -> None:
    code = (
        "import sys, shardcore; b = {i.name: i for i in shardcore.list_backends()}['megatron']; "
        "print(b.available, b.distribution, any(m.split('.')[0] == 'megatron' for m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True).stdout.split()
    assert out == ["True", "shardcore-megatron", "False"]


def test_unavailable_without_megatron_core(monkeypatch: pytest.MonkeyPatch) -> None:
    _hide_megatron(monkeypatch)
    info = {i.name: i for i in shardcore.list_backends()}["megatron"]
    assert not info.available
    assert info.reason == "megatron-core is not installed: pip install 'megatron-core>=0.16.1' einops"
    with pytest.raises(BackendUnavailableError, match=r"pip install 'megatron-core>=0\.16\.1' einops"):
        shardcore.get_backend("megatron")
    with pytest.raises(BackendUnavailableError, match="megatron-core is not installed"):
        build_inference_pg_collection(4, 2, 1, 1, 1, 2)


@pytest.mark.parametrize(
    "spec, world, error, match",
    [
        ("TP=2", 2, ShardSpecError, "keys are lower case"),
        ("tp", 1, ShardSpecError, "expected key=value"),
        ("tp=a", 1, ShardSpecError, "positive integer"),
        ("role=", 1, ShardSpecError, "role"),
        (";+;", 1, ShardSpecError, "empty"),
        ("tp=2,pp=2", 2, LayoutError, "need 4 ranks"),
        ("tp=2", 4, LayoutError, "idle"),
        ("tp=2,ep=2", 2, ShardSpecError, "does not divide"),
        ("tp=0", 1, ShardSpecError, "tp=0: expected a whole number from 1"),
        ("tp=" + "9" * 5000, 1, ShardSpecError, r"tp=999999999999\.\.\. \(5000 digits\)"),
        ("tp=1+tp=0", 2, ShardSpecError, r"shard 1 \('tp=0'\)"),
        ("tp=2,pp=2,dp=2,ep=2,expt_tp=2", 8, LayoutError, None),
    ],
)
def test_for_shards_raises_typed_errors(spec: str, world: int, error: type, match: str | None) -> None:
    mapping = match is None  # the last case: tp-pp-dp with decoder and expert pp groups apart
    with pytest.raises(error, match=match or "pp groups differ"):
        build_inference_pg_collections_for_shards(world, spec, mapping)


def test_all_typed_errors_are_value_errors_where_megatron_asserts() -> None:
    with pytest.raises(ValueError):
        build_inference_pg_collections_for_shards(4, "tp=2,foo=1")
    with pytest.raises(ShardSpecError, match="InferenceShardSpec"):
        build_inference_pg_collections_for_shards(4, [42])
    with pytest.raises(ShardSpecError):
        build_inference_pg_collections_for_shards(4, 42)
    with pytest.raises(LayoutError, match="rank_offset"):
        build_inference_pg_collections_for_shards(4, "tp=2", rank_offset=4)


@pytest.mark.parametrize(
    "args, match",
    [
        ((0,), "world_size=0"),
        ((6, 4, 1, 1, 1, 4), "not divisible by tp\\*cp\\*pp"),
        ((4, 2, 1, 1, 4, 2), "does not divide"),
        ((4, -1), "tp_size=-1"),
        ((4, 2, 1, 1, 1, 2, False, -1), "rank_offset"),
    ],
)
def test_single_builder_raises_typed_errors(args: tuple, match: str) -> None:
    pytest.importorskip("torch")
    with pytest.raises((ShardSpecError, LayoutError), match=match):
        build_inference_pg_collection(*args)


@dataclass(frozen=True)
class SpecLike:
    """Stands in for Megatron's InferenceShardSpec (not in 0.16.1)."""

    tp: int = 1
    pp: int = 1
    ep: int = 1
    dp: int = 1
    cp: int = 1
    expt_tp: int | None = None
    role: str | None = None


HUGE = 10**5000
"""Past Python's int-conversion limit: printing it raises ValueError, which must never escape."""


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: build_inference_pg_collection(HUGE), r"world_size=100000000000\.\.\. \(5001 digits\)"),
        (lambda: build_inference_pg_collection(4, HUGE), r"tp_size=100000000000\.\.\."),
        (lambda: build_inference_pg_collection(4, 2, rank_offset=HUGE), r"rank_offset=100000000000\.\.\."),
        (lambda: build_inference_pg_collection(4, 2, 1, 1, 1, 2, "yes"), "use_tp_pp_dp_mapping='yes'"),
        (lambda: build_inference_pg_collection(4, 2, 1, 1, 1, 2, strategy="all"), "strategy='all'"),
        (lambda: build_inference_pg_collection(4, 2, 1, 1, 1, 2, timeout=float("nan")), "timeout=nan"),
        (lambda: build_inference_pg_collections_for_shards(HUGE, "tp=2"), r"total_world_size=100000000000\.\.\."),
        (lambda: build_inference_pg_collections_for_shards(4, [{"tp": HUGE}]), r"shard 0 .*tp=100000000000\.\.\."),
        (lambda: build_inference_pg_collections_for_shards(4, [SpecLike(tp=2), SpecLike(dp=HUGE)]), r"shard 1 .*dp="),
        (lambda: build_inference_pg_collections_for_shards(4, "tp=4", timeout="soon"), "timeout='soon'"),
        (lambda: build_inference_pg_collections_for_shards(4, "tp=4", strategy=None), "strategy=None"),
        (lambda: build_inference_pg_collections_for_shards(4, "tp=2", allow_idle="no"), "allow_idle='no'"),
        (lambda: build_inference_pg_collections_for_shards(4, "tp=4", [1]), r"use_tp_pp_dp_mapping=\[1\]"),
        (lambda: normalize_shard_specs({"tp": 2, "name": "a\x1b[0m"}), "must be printable"),
        (lambda: normalize_shard_specs([SpecLike(tp=2), 7]), "shard 1: a shard must be"),
    ],
)
def test_every_argument_is_checked_before_torch(call: Any, match: str) -> None:
    """Bad input is a typed error naming the argument, shown short, before torch or Megatron is touched."""
    with pytest.raises((ShardSpecError, LayoutError), match=match) as info:
        call()
    assert len(str(info.value)) < 400


def test_needs_an_initialised_world() -> None:
    pytest.importorskip("torch")
    with pytest.raises(GroupCreationError, match="init_process_group"):
        build_inference_pg_collections_for_shards(4, "tp=2,role=prefill+tp=1,dp=2,role=decode")


def test_spec_inputs_agree() -> None:
    text = normalize_shard_specs("tp=2,role=prefill+tp=1,dp=2,role=decode")
    objects = normalize_shard_specs([SpecLike(tp=2, role="prefill"), SpecLike(tp=1, dp=2, role="decode")])
    dicts = normalize_shard_specs([{"tp": 2, "role": "prefill"}, {"tp": 1, "dp": 2, "role": "decode"}])
    assert text == objects == dicts
    assert text[0].expt_tp == 2 and text[1].world_size == 2
    assert normalize_shard_specs([SpecLike(tp=2, cp=2, role="train")])[0].world_size == 4  # cp > 1, role=train
    assert [f for f in InferenceShard.__dataclass_fields__][:4] == [
        "spec",
        "rank_offset",
        "world_size",
        "pg_collection",
    ]


def _layer_record(side: str, rank: int, stage: int, layer: int) -> dict[str, Any]:
    """What one rank of a pp=2 model reports for a layer's norm (``shardcore_megatron.refit``'s records)."""
    name = f"decoder.layers.{layer}.input_layernorm.weight"
    return {
        "side": side,
        "rank": rank,
        "stage": stage,
        "pp": 2,
        "local": name,
        "fields": {"name": name, "dtype": "float32", "shape": (64,), "layer": layer},
    }


def _facts(side: str, pp: int, first: int | None = None, last: int | None = None) -> dict[str, Any]:
    """A model's facts as ``shardcore_megatron.refit`` reads them: a pp=1 model has no pipeline split."""
    return {"side": side, "pp": pp, "model": {"layers": 4, "experts": 0}, "split": (first, last) if pp > 1 else None}


def test_the_pipeline_split_comes_from_the_pipelined_model() -> None:
    """Megatron refuses num_layers_in_first/last_pipeline_stage at pp=1: that side has no split to compare."""
    records = [_layer_record("src", 0, 0, 0)] + [_layer_record("src", 1, 1, layer) for layer in (1, 2, 3)]
    manifest = manifest_from_records(records, [_facts("src", 2, 1, 3), _facts("dst", 1)])
    assert (manifest.first_stage_layers, manifest.last_stage_layers) == (1, 3)
    assert manifest.stage_layers(2) == (range(0, 1), range(1, 4))


def test_two_pipelined_models_with_other_splits_are_refused() -> None:
    with pytest.raises(RefitInputError, match=r"src model \(pp=2\) splits its layers num_layers_in_first.*=1") as info:
        manifest_from_records([_layer_record("src", 0, 0, 0)], [_facts("src", 2, 1, 3), _facts("dst", 2)])
    assert "dst model (pp=2) evenly" in str(info.value) and len(str(info.value)) < 1000


def test_a_layer_off_its_stage_is_refused() -> None:
    """A split refit cannot read (pipeline_model_parallel_layout): layer 1 on stage 1 of an even pp=2 split."""
    records = [_layer_record("dst", 3, 1, 1)]
    with pytest.raises(RefitInputError, match=r"stage 1 of the dst model \(rank 3\).* puts layer 1 on stage 0"):
        manifest_from_records([_layer_record("src", 0, 0, 1), *records], [_facts("src", 1), _facts("dst", 2)])


def test_the_renamed_refit_names_still_work_with_a_warning() -> None:
    from shardcore_megatron import refit

    with pytest.warns(DeprecationWarning, match="parameters is now refit_tensors"):
        assert refit.parameters is refit.refit_tensors
    with pytest.warns(DeprecationWarning, match="Parameter is now RefitTensor"):
        assert refit.Parameter is refit.RefitTensor
    with pytest.raises(AttributeError):
        refit.params  # noqa: B018
