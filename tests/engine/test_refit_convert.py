"""Converting refits on live gloo worlds: bf16 -> bf16, fp32 -> bf16, bf16 -> fp32 and bf16 -> fp8 (per tensor,
per 128x128 block), every destination byte and every scale equal to a reference conversion of the global tensor;
the fp8 math checked against its definition."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

pytest.importorskip("torch")

import torch

from shardcore.engine.live.refit_check import cut, known_tensor, reference
from shardcore.engine.transfer.convert import E4M3_MAX, Conversion, amax_of, block_amax, quantize, scale_inv_of
from shardcore.plan.layout import plan_layout
from shardcore.refit import RefitStats, pairing
from shardcore.refit.manifest import scale_shape
from shardcore.testing import run_world
from tests.engine import convert_workers as workers
from tests.engine.test_check import ROOT, _env

TIMEOUT = 8.0
MARGIN = 6.0


# -- the fp8 math, against its definition ------------------------------------------------------------


def _expanded(scale_inv: torch.Tensor, shape: tuple[int, ...]) -> torch.Tensor:
    """Each element's scale, by first principles: every block's scale repeated over its 128 x 128 elements."""
    out = scale_inv.repeat_interleave(128, 0)[: shape[0]]
    return out if len(shape) == 1 else out.repeat_interleave(128, 1)[:, : shape[1]]


def test_a_blocks_largest_magnitude_maps_to_448_and_dequantizes_close() -> None:
    values = torch.randn(300, 200, generator=torch.Generator().manual_seed(1)) * 3
    values[128:256, 128:200] = 0  # an all-zero block: scale 1, zeros
    scale_inv = scale_inv_of(block_amax(values))
    assert scale_inv.shape == (3, 2) and scale_inv.dtype == torch.float32
    assert float(scale_inv[1, 1]) == 1.0
    assert float(scale_inv[0, 0]) == float(values[:128, :128].abs().max() / E4M3_MAX)  # in float32
    q = quantize(values, scale_inv, (0, 0))
    assert q.dtype == torch.float8_e4m3fn
    for r, c in ((0, 0), (2, 1), (1, 0)):  # the block's extreme value becomes +-448 exactly
        block = q[128 * r : 128 * (r + 1), 128 * c : 128 * (c + 1)].float()
        assert float(block.abs().max()) == E4M3_MAX
    assert not q[128:256, 128:200].float().any()
    dequantized = q.float() * _expanded(scale_inv, values.shape)
    assert torch.allclose(dequantized, values, rtol=2**-3, atol=float(scale_inv.max()) * 2**-9)
    assert float(amax_of(values)) == float(values.abs().max())


def test_scale_inv_is_amax_over_448_rounded_once_not_a_reciprocal_product() -> None:
    """float32's correctly rounded quotient is float64's rounded to float32. CUDA divides a tensor by a Python
    number as a product with its reciprocal, which differs in the last bit for most amaxes (an H100 showed it in
    ``scripts/gpu_smoke.py``): ``scale_inv_of`` divides by a tensor, so every device gives the quotient."""
    amax = torch.rand(10_000, generator=torch.Generator().manual_seed(3)) * 10 + 0.01
    quotient = (amax.double() / E4M3_MAX).float()
    assert torch.equal(scale_inv_of(amax), quotient)
    assert not torch.equal(amax * torch.tensor(1 / E4M3_MAX), quotient)  # these amaxes tell the two apart


@pytest.mark.parametrize("shape", [(512, 384), (500, 300), (1000,)])
def test_a_piece_quantized_where_it_lies_equals_the_global_reference(shape: tuple[int, ...]) -> None:
    values = torch.randn(shape, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(2))
    scale_inv = scale_inv_of(block_amax(values))
    by_definition = (values.float() / _expanded(scale_inv, shape)).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(quantize(values, scale_inv, (0,) * len(shape)).view(torch.uint8), by_definition)
    for box in ([(256, 300), (128, 256)], [(3, 400), (100, 299)]):  # pieces on and off block edges
        cut = tuple(slice(a, min(b, size)) for (a, b), size in zip(box, shape))
        start = tuple(a for a, _ in box[: len(shape)])
        local = quantize(values[cut], scale_inv, start)
        assert torch.equal(local.view(torch.uint8), by_definition[cut]), box
    assert not torch.equal(values.to(torch.float8_e4m3fn).view(torch.uint8), by_definition)  # scales matter


def test_stacked_matrices_are_blocked_and_quantized_each_on_its_own() -> None:
    """A stacked tensor (experts) has the block scales of each of its matrices, stacked (``scale_shape``), and
    quantizes as they do one by one, a box at an offset too; a per-tensor scale still scales it whole."""
    values = torch.randn(3, 300, 200, dtype=torch.bfloat16, generator=torch.Generator().manual_seed(3))
    values[1] *= 100  # one expert's magnitudes do not reach another's blocks
    scale_inv = scale_inv_of(block_amax(values))
    assert scale_inv.shape == scale_shape(values.shape) == (3, 3, 2)
    q = quantize(values, scale_inv, (0, 0, 0)).view(torch.uint8)
    for e in range(3):
        own = scale_inv_of(block_amax(values[e]))
        assert torch.equal(scale_inv[e], own)
        assert torch.equal(q[e], quantize(values[e], own, (0, 0)).view(torch.uint8))
    box = (slice(1, 3), slice(128, 300), slice(3, 200))
    assert torch.equal(quantize(values[box], scale_inv, (1, 128, 3)).view(torch.uint8), q[box])
    whole = scale_inv_of(amax_of(values))
    by_definition = (values.float() / whole).to(torch.float8_e4m3fn).view(torch.uint8)
    assert torch.equal(quantize(values, whole, (0, 0, 0)).view(torch.uint8), by_definition)


def test_a_per_tensor_scale_needs_every_tp_parts_amax() -> None:
    plan = workers.plan_of(8, workers.CASES[3])
    manifest, source = plan.manifest, plan.source
    name = "decoder.layers.0.self_attention.linear_qkv.weight"
    spec = manifest.tensor(name)
    full = known_tensor(spec, manifest.index(name))
    parts = [cut(full, spec, source, rank, manifest) for rank in (0, 1)]  # tp ranks 0 and 1
    local = [scale_inv_of(part.abs().amax()) for part in parts]
    global_scale = reference(manifest, f"{name}_scale_inv", lambda _: full)
    assert float(global_scale) == max(float(s) for s in local) and float(local[0]) != float(local[1])


def test_the_partial_amax_exchange_is_in_the_tally_and_both_ends_agree_on_it() -> None:
    """Its batches are made before the first meeting (``Conversion.amax_batches``) and counted in the tally."""
    plan = workers.plan_of(8, workers.CASES[3])
    batches = [Conversion.of(plan, plan.for_rank(r), r).amax_batches(r, 8, 1 << 16, 16) for r in range(8)]
    assert any(batch.messages for per_rank in batches for batch in per_rank)
    assert sum(pairing.tally(per_rank) for per_rank in batches) % pairing.MODULUS == 0
    batches[0] = batches[0][1:]  # rank 0 leaves out its first batch of the exchange
    assert sum(pairing.tally(per_rank) for per_rank in batches) % pairing.MODULUS != 0


# -- live worlds --------------------------------------------------------------------------------------


@pytest.mark.parametrize("options", [{}, {"verify": "checksum", "bucket_bytes": 1 << 16}])
def test_converting_refits_arrive_bitwise(options: dict[str, object]) -> None:
    results = run_world(8, workers.run_cases, workers.CASES, options, timeout=900)
    for index, case in enumerate(workers.CASES):
        reports = [results[rank][index] for rank in range(8)]
        assert not [m for r in reports for m in r["mismatches"]], case[0]
        destination_ranks = [r for r in reports if r["shard"] is not None]
        assert destination_ranks and all(r["checked"] for r in destination_ranks), case[0]
        stats = RefitStats.of(workers.plan_of(8, case))
        received = sum(r["bytes_received"] for r in reports)
        assert received == sum(r["bytes_sent"] for r in reports) == stats.total_bytes, case[0]  # wire bytes
        assert sum(r["bytes_copied"] for r in reports) == stats.local_bytes, case[0]
        scaled = case[2] is not None and case[2][0] == "float8_e4m3fn"
        checked = sum(r["checked"] for r in reports)
        names = sum(len(workers.plan_of(8, case).for_rank(r).destination_shapes) for r in range(8))
        assert checked == names and (stats.scale_bytes > 0) == scaled, case[0]  # the scales were checked too


def test_a_destination_of_the_wrong_dtype_is_one_typed_error_everywhere() -> None:
    results = run_world(8, workers.wrong_destination_dtype, timeout=300)
    for rank, out in enumerate(results):
        assert out.startswith("RefitInputError: ") and "rank 5: destination tensor" in out, (rank, out)
        assert "'decoder.layers.0.mlp.linear_fc1.weight' has dtype torch.bfloat16, expected torch.float8_e4m3fn" in out


def test_a_rank_dying_in_the_amax_exchange_is_named_by_every_other_rank() -> None:
    results = run_world(8, workers.killed_in_the_amax_exchange, 1, TIMEOUT, allow_failures=True, timeout=180)
    assert results[1] == "died (exit code 17)"
    for rank in (0, 2, 3, 4, 5, 6, 7):
        kind, message, ranks, elapsed = results[rank]
        assert kind == "RefitPeerError" and 1 in ranks and "lost ranks [1]" in message, (rank, results[rank])
        assert elapsed < TIMEOUT + MARGIN, (rank, elapsed)


def _checked_rows(result: subprocess.CompletedProcess[str]) -> list[dict]:
    """``refit --check --json``'s rows, once every destination shard (1 and 2) is ok."""
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    rows = json.loads(result.stdout)["shards"]
    assert [row["shard"] for row in rows] == [1, 2] and all(row["ok"] for row in rows), result.stdout
    return rows


def test_refit_check_to_dtype_on_the_command_line() -> None:
    shards = "tp=2,role=train+tp=1,role=decode+tp=1,role=decode"
    argv = [sys.executable, "-m", "shardcore", "refit", "--check", "--nproc", "4", "--shards", shards]
    argv += ["--from", "0", "--to", "1,2", "--model", "tiny-dense", "--to-dtype", "float8_e4m3fn", "--scale", "tensor"]
    rows = _checked_rows(
        subprocess.run([*argv, "--json"], capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    )
    from shardcore.refit import plan_refit, preset

    manifest = preset("tiny-dense").converted("float8_e4m3fn", "tensor")
    stats = RefitStats.of(plan_refit(plan_layout(4, shards), 0, [1, 2], manifest))
    assert sum(row["bytes"] for row in rows) == stats.total_bytes  # fp8 wire bytes and the scales, counted live


def test_a_converting_refit_with_fan_out_relays_the_converted_bytes() -> None:
    # node 0 (ranks 0, 1) trains; node 1 holds two decode shards that need the same bytes: each tile crosses
    # once in fp8 and the relay forwards what it received (already converted), scales included
    shards = "tp=2,role=train+tp=1,role=decode+tp=1,role=decode"
    argv = [sys.executable, "-m", "shardcore", "refit", "--check", "--nproc", "4", "--shards", shards, "--from", "0"]
    argv += ["--to", "1,2", "--model", "tiny-dense", "--ranks-per-node", "2", "--fan-out"]
    argv += ["--to-dtype", "float8_e4m3fn", "--scale", "tensor", "--json"]
    rows = _checked_rows(subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT))
    from shardcore.refit import plan_refit, preset

    manifest = preset("tiny-dense").converted("float8_e4m3fn", "tensor")
    plan = plan_refit(plan_layout(4, shards), 0, [1, 2], manifest, 2, fan_out=True)
    stats = RefitStats.of(plan)
    assert stats.relayed_bytes > 0 and stats.scale_bytes > 0
    assert any(t.hop == 1 and t.tensor.endswith("_scale_inv") for t in plan.transfers())  # scales relayed too
    assert sum(row["bytes"] for row in rows) == stats.total_bytes  # both hops' wire bytes, counted live


def test_a_partial_refit_with_per_tensor_scales_needs_only_its_own_sources() -> None:
    # ranks passing only for_rank(r).source_shapes met a raw KeyError on a weight outside the selection
    results = run_world(8, workers.partial_per_tensor_scales, timeout=300)
    reports = [results[rank]["report"] for rank in range(8)]
    assert not [m for r in reports for m in r["mismatches"]]
    assert sum(r["checked"] for r in reports) > 0 and all(r["checked"] for r in reports if r["shard"] is not None)
    for rank in range(8):
        missing = results[rank]["missing"]
        assert missing.startswith("RefitInputError: ") and "KeyError" not in missing, (rank, missing)
        assert "rank 0: source tensor 'decoder.layers.0.mlp.linear_fc1.weight' is missing" in missing, (rank, missing)


def test_refit_check_of_a_partial_refit_with_per_tensor_scales() -> None:
    shards = "tp=2,role=train+tp=1,role=decode+tp=1,role=decode"
    argv = [sys.executable, "-m", "shardcore", "refit", "--check", "--nproc", "4", "--shards", shards, "--json"]
    argv += ["--from", "0", "--to", "1,2", "--model", "tiny-dense", "--to-dtype", "float8_e4m3fn", "--scale", "tensor"]
    argv += ["--tensors", "*linear_fc1*"]
    result = subprocess.run(argv, capture_output=True, text=True, env=_env(), timeout=300, cwd=ROOT)
    assert result.returncode == 0 and "Traceback" not in result.stderr, result.stderr
    document = json.loads(result.stdout)
    assert document["ok"] and [row["shard"] for row in document["shards"]] == [1, 2]
    from shardcore.refit import plan_refit, preset, tensors_matching

    manifest = preset("tiny-dense").converted("float8_e4m3fn", "tensor")
    plan = plan_refit(plan_layout(4, shards), 0, [1, 2], manifest).subset(tensors_matching(manifest, "*linear_fc1*"))
    assert document["refitted_tensors"] == len(plan.tensors) < len(manifest)  # weights and their scales only
    assert sum(row["bytes"] for row in document["shards"]) == RefitStats.of(plan).total_bytes
