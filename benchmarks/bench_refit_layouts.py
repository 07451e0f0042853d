"""Planning a refit into an inference engine's layout (vLLM tp=8) for the largest MoE models.

For each model, from a Hugging Face config's sizes: the time to make the model's maps (Megatron -> HF ->
vLLM, once per model and engine tp), to plan the whole refit (``plan_refit``), one engine rank's part
(``for_rank``), the whole plan's stats (``RefitStats.of``), and one training rank's part (rank 0's, of a fresh
plan: cold, as in a training process), and the same with fan-out (``ranks_per_node=8, fan_out=True``). Beside
the engine rank's part, its floor: its receives made as Transfers and put in order, nothing planned (``floor``).
Run: ``python benchmarks/bench_refit_layouts.py`` (``--profile`` prints cProfile's top entries of each;
``--model DeepSeek-V3`` plans that model alone, in a fresh process).
"""

from __future__ import annotations

import argparse
import cProfile
import pstats
import time
from functools import partial
from typing import Any

from shardcore.plan.layout import plan_layout
from shardcore.plan.spec import parse_shards
from shardcore.refit import RefitStats
from shardcore.refit.boxes import from_fields
from shardcore.refit.collector import gc_paused
from shardcore.refit.families import manifest_from_hf_config
from shardcore.refit.manifest import Manifest
from shardcore.refit.part import PartBuilder, RankRefit, Transfer
from shardcore.refit.planner import plan_refit

QWEN3_235B = {
    "model_type": "qwen3_moe", "hidden_size": 4096, "intermediate_size": 12288, "moe_intermediate_size": 1536,
    "num_hidden_layers": 94, "num_attention_heads": 64, "num_key_value_heads": 4, "head_dim": 128,
    "num_experts": 128, "vocab_size": 151936, "torch_dtype": "bfloat16",
}  # fmt: skip
DEEPSEEK_V3 = {
    "model_type": "deepseek_v3", "hidden_size": 7168, "intermediate_size": 18432, "moe_intermediate_size": 2048,
    "num_hidden_layers": 61, "first_k_dense_replace": 3, "n_routed_experts": 256, "n_shared_experts": 1,
    "num_attention_heads": 128, "q_lora_rank": 1536, "kv_lora_rank": 512, "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64, "v_head_dim": 128, "vocab_size": 129280, "torch_dtype": "bfloat16",
}  # fmt: skip
CASES: list[tuple[str, dict[str, Any], str]] = [
    ("Qwen3-235B-A22B", QWEN3_235B, "tp=4,dp=16,ep=64,expt_tp=1,role=train + tp=8,expt_tp=8"),
    ("DeepSeek-V3", DEEPSEEK_V3, "tp=8,dp=8,ep=64,expt_tp=1,role=train + tp=8,expt_tp=8"),
]


def floor(mine: RankRefit, manifest: Manifest, world_size: int) -> float:
    """Seconds to make ``mine``'s receives as Transfers from their fields and put them in ``RankRefit``'s order by
    the plan's own ``PartBuilder`` (the collector off, as in ``for_rank``): what a rank's part of those receives
    costs in that form, however it is planned."""
    position = {tensor.name: n for n, tensor in enumerate(manifest.tensors)}
    received = [(position[transfer.tensor], tuple(transfer)) for transfer in mine.recvs]
    part = PartBuilder(world_size, manifest.tensors)
    with gc_paused():
        start = time.perf_counter()
        for at, values in received:
            part.extend(at, (from_fields(Transfer, values),))
        part.split(mine.rank)
        return time.perf_counter() - start


def run_case(label: str, config: dict[str, Any], spec: str, profile: bool) -> None:
    profiler = cProfile.Profile() if profile else None
    if profiler:
        profiler.enable()
    start = time.perf_counter()
    model = manifest_from_hf_config(config)
    layout = plan_layout(sum(shard.world_size for shard in parse_shards(spec)), spec)
    engine = layout.shards[1]
    model.vllm_from_megatron(engine.spec.tp, engine.spec.expt_tp)
    maps = time.perf_counter()
    refit = partial(plan_refit, layout, 0, [1], model.manifest, layouts={1: model.layout("vllm")})
    plan = refit()
    planned = time.perf_counter()
    mine = plan.for_rank(engine.ranks[0])
    part = time.perf_counter()
    stats = RefitStats.of(plan)
    done = time.perf_counter()
    least = floor(mine, model.manifest, layout.world_size)
    fresh = refit()
    sending = time.perf_counter()
    sends = len(fresh.for_rank(layout.shards[0].ranks[0]).sends)
    sent = time.perf_counter()
    fanned = refit(ranks_per_node=8, fan_out=True)
    relaying = time.perf_counter()
    relayed = len(fanned.for_rank(layout.shards[0].ranks[0]).sends)
    relays = time.perf_counter()
    if profiler:
        profiler.disable()
    print(
        f"| {label} | {len(model.manifest):,} -> {len(model.vllm(engine.spec.tp, engine.spec.expt_tp)[0]):,} "
        f"| `{spec}` | {maps - start:.2f} s | {planned - maps:.2f} s | {1000 * (part - planned):.0f} ms "
        f"({len(mine.recvs):,} recvs) | {1000 * least:.0f} ms | {done - part:.2f} s "
        f"| {stats.total_bytes / 1e9:,.0f} GB "
        f"| {1000 * (sent - sending):.0f} ms ({sends:,} sends) "
        f"| {1000 * (relays - relaying):.0f} ms ({relayed:,} sends) |"
    )
    if profiler:
        pstats.Stats(profiler).sort_stats("tottime").print_stats(15)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries per case")
    parser.add_argument(
        "--model", choices=[label for label, _, _ in CASES], help="this model alone (a fresh process per model)"
    )
    args = parser.parse_args()
    columns = ["model", "tensors (Megatron -> vLLM)", "shards", "maps", "plan_refit", "one engine rank's part"]
    columns += ["its floor", "stats", "moved", "one training rank's part", "the same with fan-out (8 ranks a node)"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for label, config, spec in CASES:
        if args.model in (None, label):
            run_case(label, config, spec, args.profile)


if __name__ == "__main__":
    main()
