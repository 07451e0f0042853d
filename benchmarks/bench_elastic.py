"""The live elastic restore: 16 local gloo ranks, 2 lost (SIGKILLed); the survivors form their world, build the
new layout and restore every weight from their memory (``shardcore replan --check``'s job, verified bitwise).

Per case: the slowest survivor's seconds to form the new world, build the new layout, plan the restore and
execute it; the bytes restored (received over the wire and copied locally); and the whole run's wall time,
most of it 16 processes importing torch on a small machine. Times are inside the survivors, so the start-up
of the processes does not count in them.

Run: ``python benchmarks/bench_elastic.py`` (``--quick``: the tiny model only).
"""

from __future__ import annotations

import argparse
import json
import tempfile
import time
from dataclasses import replace
from pathlib import Path

from shardcore.engine.live.ports import free_port
from shardcore.engine.live.restore_check import PHASES, RestoreCheckOptions, choose_option, run_local
from shardcore.refit import ExecuteOptions, RefitStats
from shardcore.replan import ReplanRequest, restore_plan

SMALL_CONFIG = {
    "name": "bench-0.13b",
    "config": {
        "layers": 8,
        "hidden": 1024,
        "ffn": 2816,
        "heads": 16,
        "kv_heads": 8,
        "vocab": 32768,
        "tied_embeddings": True,
        "dtype": "bfloat16",
    },
}
"""A 0.13 B-parameter bfloat16 model (256 MB): big enough that moving it takes measurable time on CPU."""
TWO_SHARDS = "tp=2,pp=2,dp=2,role=train+tp=2,dp=4,role=prefill"
MOE_SHARDS = "tp=2,pp=2,ep=2,dp=2,role=train+tp=4,dp=2,role=prefill"


def cases(small_model: str | None) -> list[tuple[str, RestoreCheckOptions]]:
    found = [
        ("tiny-moe, lose 1-2: train re-laid out (6 ranks restored), new gloo world on the old store",
         RestoreCheckOptions(ReplanRequest("tiny-moe", TWO_SHARDS, 16, (1, 2)))),
        ("tiny-moe, lose 1-2, gloo stand-in that can shrink: torch's shrink_group",
         RestoreCheckOptions(ReplanRequest("tiny-moe", TWO_SHARDS, 16, (1, 2)), shrink=True)),
        ("tiny-moe, lose 0 (the store's host) and 9, option 2: both shards re-laid out, 14 restored, new store",
         RestoreCheckOptions(ReplanRequest("tiny-moe", MOE_SHARDS, 16, (0, 9)), option=2)),
    ]  # fmt: skip
    if small_model is not None:
        found.append(
            (
                "0.13 B bf16, lose 1-2: train re-laid out, new gloo world on the old store",
                RestoreCheckOptions(
                    ReplanRequest(small_model, TWO_SHARDS, 16, (1, 2)), execute=ExecuteOptions(timeout=600)
                ),
            )
        )
    return found


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="the tiny model only")
    quick = parser.parse_args().quick
    with tempfile.TemporaryDirectory() as folder:
        small = None
        if not quick:
            small = str(Path(folder) / "bench-0.13b.json")
            Path(small).write_text(json.dumps(SMALL_CONFIG))
        print("| case | formed by | survivors | restored ranks | " + " | ".join(PHASES[1:]) + " | bytes restored | "
              "over the wire | planned in the parent | wall |")  # fmt: skip
        print("|---|---|---:|---:|" + "---:|" * (len(PHASES) - 1) + "---:|---:|---:|---:|")
        for title, options in cases(small):
            options = replace(options, rendezvous_port=free_port())
            started = time.perf_counter()
            option = choose_option(options)
            planned = time.perf_counter() - started
            stats = RefitStats.of(restore_plan(option))
            reports = run_local(options)
            wall = time.perf_counter() - started
            assert not [m for report in reports for m in report.mismatches], title
            received = sum(report.bytes_received for report in reports)
            restored = received + sum(report.bytes_copied for report in reports)
            assert restored == sum(shard.bytes + shard.local_bytes for shard in stats.shards), title
            slowest = [max(report.seconds[phase] for report in reports) for phase in PHASES[1:]]
            print(
                f"| {title} | {reports[0].how} | {len(reports)} | {sum(r.restored for r in reports)} | "
                + " | ".join(f"{seconds:.2f} s" for seconds in slowest)
                + f" | {restored / 1e6:,.1f} MB | {received / 1e6:,.1f} MB | {planned:.2f} s | {wall:.0f} s |",
                flush=True,
            )


if __name__ == "__main__":
    main()
