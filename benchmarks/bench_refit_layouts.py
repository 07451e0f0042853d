"""Planning a refit into an inference engine's layout (vLLM tp=8) for the largest MoE models.

For each model, from a Hugging Face config's sizes: the time to make the model's maps (Megatron -> HF ->
vLLM, once per model and engine tp), to plan the whole refit (``plan_refit``), one engine rank's part
(``for_rank``), the whole plan's stats (``RefitStats.of``), and one training rank's part (rank 0's, of a fresh
plan: cold, as in a training process), and the same with fan-out (``ranks_per_node=8, fan_out=True``). Beside
the engine rank's part, its floor: its receives made as Transfers and put in order, nothing planned (``floor``).
Run: ``python benchmarks/bench_refit_layouts.py`` (``--profile`` prints cProfile's top entries of each;
``--model DeepSeek-V3`` plans that model alone, in a fresh process).

``--as-user`` measures as a user plans: the config written to a file, ``RefitRequest("hf:PATH", ...,
to_layout="vllm").plan(world)``, and each measure in a process of its own (the whole plan with its stats, the maps
included; one engine rank's part; one training rank's part), ``--rounds`` times.
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import subprocess
import sys
import tempfile
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
from shardcore.refit.request import RefitRequest

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


MEASURES = ("plan and stats", "engine rank's part", "training rank's part")


def as_user(label: str, measure: str, config_path: str) -> None:
    """One measure of ``--as-user``, in this process (a fresh one): prints its seconds."""
    _, _, spec = next(case for case in CASES if case[0] == label)
    shards = parse_shards(spec)
    world = sum(shard.world_size for shard in shards)
    request = RefitRequest(f"hf:{config_path}", spec, 0, (1,), to_layout="vllm")
    start = time.perf_counter()
    plan = request.plan(world)
    if measure == MEASURES[0]:
        RefitStats.of(plan)
        print(time.perf_counter() - start)
        return
    rank = shards[0].world_size if measure == MEASURES[1] else 0  # the engine's first rank, or the trainer's
    start = time.perf_counter()
    plan.for_rank(rank)
    print(time.perf_counter() - start)


def run_as_user(rounds: int, only: str | None) -> None:
    """Every measure of ``--as-user``, each in a fresh process, ``rounds`` times, as a table."""
    print("| model | " + " | ".join(MEASURES) + " |")
    print("|---|" + "---:|" * len(MEASURES))
    with tempfile.TemporaryDirectory() as folder:
        for label, config, _ in CASES:
            if only not in (None, label):
                continue
            path = os.path.join(folder, f"{label}.json")
            with open(path, "w") as file:
                json.dump(config, file)
            found: dict[str, list[float]] = {measure: [] for measure in MEASURES}
            for _ in range(rounds):
                for measure in MEASURES:
                    command = [sys.executable, __file__, "--one", label, measure, path]
                    found[measure].append(
                        float(subprocess.run(command, check=True, capture_output=True, text=True).stdout)
                    )
            shown = [
                ", ".join(f"{s:.2f} s" if n == 0 else f"{1000 * s:.0f} ms" for s in found[measure])
                for n, measure in enumerate(MEASURES)
            ]
            print(f"| {label} | " + " | ".join(shown) + " |")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", action="store_true", help="print cProfile's top entries per case")
    parser.add_argument(
        "--model", choices=[label for label, _, _ in CASES], help="this model alone (a fresh process per model)"
    )
    parser.add_argument(
        "--as-user", action="store_true", help="plan through RefitRequest, each measure in a fresh process"
    )
    parser.add_argument("--rounds", type=int, default=2, help="--as-user: processes per measure (default 2)")
    parser.add_argument("--one", nargs=3, metavar=("MODEL", "MEASURE", "CONFIG"), help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.one:
        as_user(*args.one)
        return
    if args.as_user:
        run_as_user(args.rounds, args.model)
        return
    columns = ["model", "tensors (Megatron -> vLLM)", "shards", "maps", "plan_refit", "one engine rank's part"]
    columns += ["its floor", "stats", "moved", "one training rank's part", "the same with fan-out (8 ranks a node)"]
    print("| " + " | ".join(columns) + " |")
    print("|" + "---|" * len(columns))
    for label, config, spec in CASES:
        if args.model in (None, label):
            run_case(label, config, spec, args.profile)


if __name__ == "__main__":
    main()
