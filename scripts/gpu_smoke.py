"""GPU smoke check: one NCCL rank per GPU, the recommended GPU path (``docs/install.md``) with the defaults.

Run it on one machine with CUDA, one process per GPU::

    torchrun --standalone --nproc-per-node "$(nvidia-smi -L | wc -l)" scripts/gpu_smoke.py

What it checks, in that world:

1. ``shardcore_dtensor.ensure_distributed_initialized()`` picks nccl, makes the ``LOCAL_RANK``
   GPU current on every rank and binds the default group to it;
2. ``build_shards`` with the default strategy (``auto``) chooses ``world`` there, and an
   explicit ``strategy="local"`` is refused before any rank communicates;
3. ``shardcore check``'s verification (``check_groups``): every group all-gathers its planned
   ranks, on the GPU;
4. a DTensor op on a shard's mesh: a tensor sharded over the shard's tp dim and gathered back;
5. the refit's fp8 conversion on the GPU (block amaxes, ``scale_inv``, quantization of boxes at
   offsets, a stacked tensor, a per-tensor scale) equals the CPU's byte for byte: what the CPU tests
   pin is what a GPU sender puts on the wire.
6. collocated refits between two layouts over the whole world, their tensors on the GPUs
   (``check_refit``, what ``refit --check`` runs), every destination byte equal to a reference made
   on the CPU: fp32 -> fp8 per 128x128 block, a delta refit after a 2 % step (checksummed), and a
   Qwen3-MoE config into vLLM's layout quantized where it lands.

The backend is the default (dtensor) or ``$SHARDCORE_BACKEND``'s; step 4 needs the dtensor one (a
torch it does not support fails its import in one line naming the internal it lacks, and another
backend, the test plugin ``toy`` say, still checks the groups on the GPU).

On a machine without CUDA it runs steps 1, 3, 4 and 6 on gloo/CPU (nothing GPU-specific is then
verified). Rank 0 prints one line per step and exits non-zero on the first failure.
"""

from __future__ import annotations

import os
import sys
from typing import Any


def spec_for(world: int) -> str:
    """A heterogeneous layout that uses every GPU: a tp shard and a dp shard (one shard on one GPU)."""
    if world == 1:
        return "tp=1,role=train"
    half = world // 2
    return f"tp={half},role=train+tp=1,dp={world - half},role=decode"


def main() -> int:
    import torch
    import torch.distributed as dist

    from shardcore import GroupCreationError, build_shards, get_backend
    from shardcore.engine.backends.shards import destroy_shards, my_shard
    from shardcore.engine.groups.strategy import choose_strategy
    from shardcore.engine.live.check import CheckOptions, check_groups
    from shardcore_dtensor import ensure_distributed_initialized

    ensure_distributed_initialized()
    rank, world = dist.get_rank(), dist.get_world_size()
    cuda = torch.cuda.is_available()
    device = torch.device("cuda", torch.cuda.current_device()) if cuda else torch.device("cpu")

    def say(text: str) -> None:
        if rank == 0:
            print(f"gpu smoke: {text}", flush=True)

    say(f"{world} ranks, backend {dist.get_backend()}, devices {'cuda' if cuda else 'cpu (no CUDA here)'}")
    if cuda and torch.cuda.current_device() != int(os.environ.get("LOCAL_RANK", "0")):
        raise SystemExit(f"rank {rank}: current device {torch.cuda.current_device()} is not LOCAL_RANK")
    strategy, why = choose_strategy("auto")
    say(f"1. auto strategy: {strategy}: {why}")
    if cuda and str(strategy) != "world":
        raise SystemExit("a device-bound NCCL world must make auto choose 'world'")
    if cuda:
        try:
            choose_strategy("local")
        except GroupCreationError as error:
            say(f"2. explicit local refused: {error}")
        else:
            raise SystemExit("explicit strategy='local' was not refused on a device-bound world")
    spec = spec_for(world)
    report = check_groups(CheckOptions(shards=spec, timeout=300))
    if report.failures:
        raise SystemExit(f"rank {rank}: {report.failures}")
    say(f"3. check {spec!r}: every group verified ({report.strategy})")
    shards = build_shards(world, spec, timeout=300)
    try:
        mine = my_shard(shards)
        if mine is None:
            raise SystemExit(f"rank {rank}: the layout left it idle")
        if hasattr(mine.handle, "mesh"):
            dtensor_round_trip(rank, mine.handle.mesh["tp"], device)
            say("4. DTensor: shard, gather and sum over each shard's tp mesh: ok")
        else:
            say(f"4. skipped: the {get_backend().name} backend's handle holds no DeviceMesh")
    finally:
        destroy_shards(shards)
    try:
        if cuda:
            say(f"5. fp8 conversion on {device} equals the CPU's byte for byte: {fp8_matches_cpu(device)} tensors")
        for label, checked in collocated_refits(rank, world):
            say(f"6. refit {label}: rank 0's {checked} destination tensors equal the CPU's references")
    finally:
        dist.destroy_process_group()
    say("ok")
    return 0


QWEN3_MOE = {
    "model_type": "qwen3_moe", "hidden_size": 256, "intermediate_size": 512, "num_hidden_layers": 2,
    "num_attention_heads": 8, "num_key_value_heads": 8, "head_dim": 32, "vocab_size": 1000, "num_experts": 8,
    "num_experts_per_tok": 2, "moe_intermediate_size": 128, "torch_dtype": "bfloat16",
}  # fmt: skip
"""A small Qwen3-MoE Hugging Face config (vLLM packs its experts into FusedMoE's stacked tensors)."""


def collocated_refits(rank: int, world: int) -> list[tuple[str, int]]:
    """Step 6: each refit checked on this world (the default group's device), with this rank's count of
    destination tensors checked.

    Raises:
        SystemExit: this rank's first mismatch, named.
    """
    from math import gcd

    from shardcore.engine.live.refit_check import check_refit
    from shardcore.refit import RefitRequest, manifest_from_hf_config

    tp, pp = gcd(world, 8), 2 if world % 2 == 0 else 1  # the tiny model's 8 heads; a pp source keeps fp8 blocks whole
    split, staged, target = f"tp={tp},dp={world // tp}", f"pp={pp},dp={world // pp}", f"tp=1,dp={world}"
    fp8 = {"to_dtype": "float8_e4m3fn", "scale": "block"}
    delta = {"changes": (0.02,), "version": 1, "delta": True, "delta_checksum": True}
    qwen = manifest_from_hf_config(QWEN3_MOE)
    cases = [
        (
            f"{staged} -> {target}, fp32 -> fp8 per block",
            RefitRequest("tiny-dense", staged, 0, (0,), target, **fp8),
            {},
        ),
        (f"{split} -> {target}, a delta after a 2 % step", RefitRequest("tiny-dense", split, 0, (0,), target), delta),
        (
            f"Qwen3-MoE {staged} -> vLLM {target}, fp8 per block",
            RefitRequest(qwen, staged, 0, (0,), target, to_layout="vllm", **fp8),
            {},
        ),
    ]
    done = []
    for label, request, options in cases:
        report = check_refit(request.plan(world), rank, timeout=300, **options)
        if report.mismatches:
            raise SystemExit(f"rank {rank}: refit {label}: {report.mismatches[0]}")
        done.append((label, report.checked))
    return done


def dtensor_round_trip(rank: int, tp_mesh: Any, device: Any) -> None:
    """Shard a tensor over ``tp_mesh``, gather it back and sum it: DTensor's collectives on the shard's own mesh.

    Raises:
        SystemExit: naming the rank and what differs.
    """
    import torch
    import torch.distributed as dist
    from torch.distributed.tensor import Shard, distribute_tensor

    full = torch.arange(4 * tp_mesh.size(), dtype=torch.float32, device=device)
    sharded = distribute_tensor(full, tp_mesh, [Shard(0)])
    if not torch.equal(sharded.full_tensor(), full) or sharded.to_local().numel() != 4:
        raise SystemExit(f"rank {rank}: DTensor round trip over {tp_mesh} differs")
    total = (sharded * 2).sum().full_tensor()
    if float(total) != float(full.sum() * 2):
        raise SystemExit(f"rank {rank}: DTensor sum {float(total)} != {float(full.sum() * 2)}")
    dist.barrier()


def fp8_matches_cpu(device: object) -> int:
    """Block amaxes, scales and quantized boxes of a few bf16 tensors computed on ``device`` and on the CPU
    must be equal byte for byte; returns how many tensors were compared.

    Raises:
        SystemExit: naming each result that differs, and in how many elements.
    """
    import torch

    from shardcore.engine.transfer.convert import amax_of, block_amax, quantize, scale_inv_of

    generator = torch.Generator().manual_seed(0)
    differ: list[str] = []
    # (shape, box start, box end): cut blocks, whole blocks, a stacked tensor, a 1-d tensor
    cases = [
        ((300, 260), (5, 7), (290, 259)),
        ((256, 384), (128, 0), (256, 384)),
        ((2, 256, 200), (1, 3, 0), (2, 250, 200)),
        ((1000,), (130,), (999,)),
    ]
    for shape, start, end in cases:
        full = (torch.randn(shape, generator=generator) * 3).to(torch.bfloat16)
        full.view(-1)[:: max(1, full.numel() // 5)] = 0
        box = tuple(slice(a, b) for a, b in zip(start, end))
        for scales in ("block", "tensor"):
            results = []
            for where in (torch.device("cpu"), device):
                local = full.to(where)
                amax = block_amax(local) if scales == "block" else amax_of(local)
                scale_inv = scale_inv_of(amax)
                quantized = quantize(local[box], scale_inv, start)
                results.append((amax.cpu(), scale_inv.cpu(), quantized.cpu().view(torch.uint8)))
            for what, on_cpu, on_device in zip(("amax", "scale_inv", "quantized"), *results):
                if not torch.equal(on_cpu, on_device):
                    differ.append(f"{what} of {shape} ({scales} scales): {int((on_cpu != on_device).sum())} elements")
    if differ:
        raise SystemExit(f"fp8 conversion differs between cpu and {device}: {'; '.join(differ)}")
    return len(cases) * 2


if __name__ == "__main__":
    sys.exit(main())
