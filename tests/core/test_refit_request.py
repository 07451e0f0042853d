"""One owner per job: ``RefitRequest`` (what to refit, planned in one place) and ``ExecuteOptions`` (how, checked
once), as the CLI, the live check's workers and the tests use them (no torch)."""

from __future__ import annotations

import pickle
from dataclasses import replace
from datetime import timedelta

import pytest

from shardcore.errors import LayoutError, RefitError, RefitInputError
from shardcore.plan.layout import plan_layout
from shardcore.refit import ExecuteOptions, RefitRequest, plan_refit, preset, tensors_matching
from shardcore.refit.options import DEFAULT_BUCKET_BYTES, DEFAULT_MAX_OPS, MIN_BUCKET_BYTES
from shardcore.refit.schedule import ALIGN

REQUEST = RefitRequest("tiny-dense", "tp=2,role=train + tp=1 + tp=1", 0, (1, 2))


def test_a_request_plans_what_plan_refit_plans() -> None:
    plan = REQUEST.plan(4)
    assert (
        plan.fingerprint() == plan_refit(plan_layout(4, REQUEST.shards), 0, [1, 2], preset("tiny-dense")).fingerprint()
    )
    again = pickle.loads(pickle.dumps(REQUEST)).plan(4)  # what a worker gets, and plans
    assert again.fingerprint() == plan.fingerprint()


def test_every_option_reaches_the_plan() -> None:
    request = replace(REQUEST, ranks_per_node=2, fan_out=True, min_piece_bytes=0, tensors=("*.mlp.*",))
    plan = request.plan(4)
    assert (plan.ranks_per_node, plan.fan_out, plan.min_piece_bytes) == (2, True, 0)
    manifest = preset("tiny-dense")
    assert plan.tensors == REQUEST.plan(4).subset(tensors_matching(manifest, "*.mlp.*")).tensors
    converted = replace(REQUEST, to_dtype="float8_e4m3fn", scale="tensor").plan(4)
    assert converted.manifest.converts and {t.scale for t in converted.manifest if t.to_dtype} == {"tensor"}


def test_allow_idle_is_the_requests_own() -> None:
    # the CLI's parent planned with --allow-idle as given, its workers with True: now both plan the same request
    strict = RefitRequest("tiny-dense", "tp=2 + tp=1", 0, (1,))
    with pytest.raises(LayoutError, match="idle"):
        strict.plan(4)
    assert replace(strict, allow_idle=True).plan(4).layout.idle == (range(3, 4),)


def test_a_destination_in_another_layout_of_the_same_world() -> None:
    request = RefitRequest(preset("tiny-dense"), "tp=2,dp=2", 0, (0,), dst_shards="tp=4")
    plan = request.plan(4)
    assert str(plan.destinations[0].spec) == "tp=4" and plan.source.index == 0
    with pytest.raises(RefitError, match="destination shard 1: the destination layout 'tp=4' has shards 0 to 0"):
        replace(request, dst=(1,)).plan(4)


def test_execute_options_are_checked_when_made() -> None:
    assert MIN_BUCKET_BYTES == 2 * ALIGN == 32  # the schedule's smallest bucket: two aligned pieces
    assert ExecuteOptions(bucket_bytes=MIN_BUCKET_BYTES).bucket_bytes == 32
    for options, message in (
        ({"bucket_bytes": 31}, "bucket_bytes=31: expected a whole number from 32"),
        ({"bucket_bytes": True}, "bucket_bytes=True"),
        ({"max_ops": 1}, "max_ops=1: expected a whole number from 2"),
        ({"verify": "crc"}, "verify='crc': expected one of size, checksum"),
        ({"version": -1}, "version=-1"),
        ({"timeout": 0}, "timeout=0: expected seconds"),
        ({"timeout": "soon"}, "timeout='soon'"),
    ):
        with pytest.raises(RefitInputError, match=message):
            ExecuteOptions(**options)  # type: ignore[arg-type]


def test_keywords_take_the_place_of_the_options_fields() -> None:
    base = ExecuteOptions(timeout=30, bucket_bytes=4096, max_ops=8, verify="checksum", version=3)
    assert ExecuteOptions.merged(base) is base  # checked when made, not again per refit
    assert ExecuteOptions.merged(base, bucket_bytes=None, max_ops=16) == replace(base, max_ops=16)
    assert ExecuteOptions.merged(None, version=5) == ExecuteOptions(version=5)
    defaults = ExecuteOptions()
    assert (defaults.bucket_bytes, defaults.max_ops, defaults.verify) == (DEFAULT_BUCKET_BYTES, DEFAULT_MAX_OPS, "size")
    assert defaults.wait == timedelta(minutes=5) and base.wait == timedelta(seconds=30)
    with pytest.raises(RefitInputError, match="bucket_bytes=1"):
        ExecuteOptions.merged(base, bucket_bytes=1)
    with pytest.raises(RefitInputError, match=r"expected a shardcore\.ExecuteOptions"):
        ExecuteOptions.merged({"bucket_bytes": 4096})  # type: ignore[arg-type]
