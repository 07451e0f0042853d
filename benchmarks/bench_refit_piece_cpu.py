"""The executor's CPU per received piece: a refit of tens of thousands of small pieces into one vLLM engine rank.

A model with DeepSeek-V3's structure (61 layers, 58 of them MoE with 256 routed experts and a shared one, MLA
attention) and tiny widths, so the pieces are DeepSeek-V3's in number and a few hundred bytes each: what is left
is the executor's Python per piece. A training shard ``tp=1,dp=4,ep=4,expt_tp=1`` refits into a vLLM engine at
``tp=1`` (its own tensors: ``w13_weight`` and ``w2_weight`` stacked per layer) on a live local gloo world of five
ranks, with a kept plan (``execute_refit`` alone is timed). The engine rank receives every expert's gate rows, up
rows and down columns from the training rank holding it: about 45,000 pieces. Reported: its receives (the plan's
``Transfer``s), the CPU time of its part of the plan (``for_rank``, what a fresh process pays before its first
refit), its CPU time in ``execute_refit`` in the first refit of the plan (which finds each message's runs,
``transfer.runs``) and in the later ones (best of ``--repeat`` - 1: an RL job's refits, which reuse them), and that
CPU per received piece; the same for the training rank that sends the most pieces (it packs them in runs too).
Each CPU time is given twice: the process's (``time.process_time``: the machine's cores are shared), which also
counts gloo's own threads moving the bytes through loopback TCP (about 50 MB a refit here; NCCL moves them on the
device), and the executor's own thread's (``time.thread_time``): the executor's Python and its copies
(``torch.set_num_threads(1)``). After the last round the engine's tensors must equal the known weights put through
the weight map, or the run fails. ``--profile`` prints cProfile's top entries of the engine rank's last round, in
its thread's CPU time.

Run: ``python benchmarks/bench_refit_piece_cpu.py [--repeat 3] [--profile]``
"""

from __future__ import annotations

import argparse
import time
from typing import Any

from bench_refit import known_sources
from bench_refit_layouts import DEEPSEEK_V3

TINY_DEEPSEEK_V3 = {
    **DEEPSEEK_V3, "hidden_size": 64, "intermediate_size": 64, "moe_intermediate_size": 8,
    "num_attention_heads": 4, "q_lora_rank": 32, "kv_lora_rank": 16, "qk_nope_head_dim": 8,
    "qk_rope_head_dim": 8, "v_head_dim": 8, "vocab_size": 1024,
}  # fmt: skip
"""DeepSeek-V3's structure at tiny widths: the real number of tensors and pieces, a few MB in all."""
SPEC = "tp=1,dp=4,ep=4,expt_tp=1,role=train + tp=1,expt_tp=1"
ENGINE = 4
"""The engine's one rank (after the four training ranks)."""


def bench_rank(rank: int, world: int, repeat: int, profile: bool) -> dict[str, Any]:
    import cProfile
    import io
    import pstats

    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)
    from bench_refit_engine_layout import _filled

    from shardcore import execute_refit
    from shardcore.engine.live.layout_check import through_map
    from shardcore.engine.live.refit_check import KnownWeights, mismatches
    from shardcore.plan.layout import plan_layout
    from shardcore.refit.families import manifest_from_hf_config
    from shardcore.refit.planner import plan_refit

    model = manifest_from_hf_config(TINY_DEEPSEEK_V3)
    plan = plan_refit(plan_layout(world, SPEC), 0, [1], model.manifest, layouts={1: model.layout("vllm")})
    started = time.process_time()
    mine = plan.for_rank(rank)  # a fresh process's part, before its first refit
    part = time.process_time() - started
    sources = known_sources(plan, rank)
    cpu: list[tuple[float, float]] = []  # (the process's, the executor's thread's)
    profiler = cProfile.Profile(time.thread_time) if profile and rank == ENGINE else None
    destinations: dict[str, Any] = {}
    for round_ in range(repeat):
        destinations = _filled(plan, rank)
        dist.barrier()
        if profiler is not None and round_ == repeat - 1:
            profiler.enable()
        started, started_thread = time.process_time(), time.thread_time()
        execute_refit(plan, sources, destinations, timeout=600)
        cpu.append((time.process_time() - started, time.thread_time() - started_thread))
        if profiler is not None:
            profiler.disable()
        dist.barrier()
    differ = mismatches(plan, rank, destinations, KnownWeights(plan.manifest), through_map(plan, rank))
    if differ:
        raise AssertionError("; ".join(differ[:5]))
    shown = ""
    if profiler is not None:
        out = io.StringIO()
        pstats.Stats(profiler, stream=out).sort_stats("tottime").print_stats(25)
        shown = out.getvalue()
    later = min(cpu[1:], key=lambda pair: pair[1])
    found = {"recvs": len(mine.recvs), "sends": len(mine.sends), "part": part, "first": cpu[0], "later": later}
    return {**found, "profile": shown}


def main() -> None:
    from shardcore.plan.spec import parse_shards
    from shardcore.testing import run_world

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=4, help="refits of the plan (at least 2)")
    parser.add_argument("--profile", action="store_true", help="cProfile the engine rank's last round")
    args = parser.parse_args()
    world = sum(shard.world_size for shard in parse_shards(SPEC))
    results = run_world(world, bench_rank, args.repeat, args.profile, timeout=1800, pg_timeout=900)
    engine = results[ENGINE]
    sender = max(results[:ENGINE], key=lambda result: result["sends"])
    print(
        f"`{SPEC}`: the engine rank receives {engine['recvs']:,} pieces; the busiest training rank sends "
        f"{sender['sends']:,}. Its part (`for_rank`): {engine['part']:.2f} s of CPU.\n"
    )
    print("| CPU in `execute_refit` | the process's | per piece | the executor's thread's | per piece |")
    print("|---|---:|---:|---:|---:|")
    for label, result, key, pieces in (
        ("the engine rank's first refit", engine, "first", engine["recvs"]),
        (f"the engine rank's later ones (best of {args.repeat - 1})", engine, "later", engine["recvs"]),
        (f"the busiest sender's later ones (best of {args.repeat - 1})", sender, "later", sender["sends"]),
    ):
        process, thread = result[key]
        print(
            f"| {label} | {process:.3f} s | {1e6 * process / pieces:.1f} µs | {thread:.3f} s "
            f"| {1e6 * thread / pieces:.1f} µs |"
        )
    if engine["profile"]:
        print(engine["profile"])


if __name__ == "__main__":
    main()
