"""Building process groups: shardcore vs Megatron-Core's HyperCommGrid vs torch's init_device_mesh.

Layout tp=8, cp=2, pp=4 (dp = world / 64) in torch's fake-backend worlds of 1,024 to 262,144
ranks, simulated one rank at a time, and tp=2, cp=2, pp=2 (dp = world / 8) on live local gloo
worlds of 8, 16 and 32 processes. Per rank: build seconds and process groups created
(communicators: groups the rank is a member of).

* shardcore ``local``: ``build_shards`` (members-only creation); once with a groups-only
  backend registered in-process (the fair match for HyperCommGrid) and once with the default
  DTensor backend (three DeviceMeshes too; the match for init_device_mesh).
* Megatron-Core: ``HyperCommGrid(shape, names).create_pg(dims)`` for the groups Megatron
  builds: tp, cp, pp, dp, mp (tp-pp), tp_cp, dp_cp, tp_dp_cp on the decoder grid and ep,
  expt_tp, expt_dp, tp_ep, tp_ep_pp on the expert grid. Every rank calls every new_group.
* torch: ``init_device_mesh("cpu", (pp, dp, cp, tp))`` plus ``mesh["dp", "cp"]._flatten()``.

    python benchmarks/bench_groups.py            # full run (< 20 min on 2 cores)
    python benchmarks/bench_groups.py --quick    # worlds 1,024-16,384 and live 8
"""

from __future__ import annotations

import argparse
import logging
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run from a checkout without installing

FAKE_WORLDS = (1024, 4096, 16384, 65536, 262144)
LIVE_WORLDS = (8, 16, 32)


# ---------------------------------------------------------------- shared helpers


def _quiet() -> None:
    warnings.filterwarnings("ignore")
    logging.disable(logging.WARNING)
    os.environ.pop("WORLD_SIZE", None) if os.environ.get("SHARDCORE_BENCH_FAKE") else None


def _register_groups_backend() -> None:
    import shardcore
    from shardcore.engine.backends.backend import Backend

    class GroupsOnly(Backend):
        name = "groups-only"
        description = "benchmark: the engine's groups, no framework object"

        def make_handle(self, plan: Any, rank: int, groups: Any, options: Any) -> Any:
            return groups

    shardcore.register_backend(GroupsOnly())


def _pg_names() -> set:
    from torch.distributed import distributed_c10d as c10d

    return set(c10d._world.pg_names)


def _destroy_new(before: set) -> int:
    """Destroy every group created since ``before``; return how many there were."""
    import torch.distributed as dist
    from torch.distributed import distributed_c10d as c10d

    new = [pg for pg in list(c10d._world.pg_names) if pg not in before]
    for pg in new:
        dist.destroy_process_group(pg)
    return len(new)


def megatron_groups(tp: int, cp: int, dp: int, pp: int, ep: int = 1, expt_tp: int = 1) -> None:
    """The groups Megatron-Core builds for this layout, through HyperCommGrid (every rank, every group)."""
    from megatron.core.hyper_comm_grid import HyperCommGrid

    decoder = HyperCommGrid([tp, cp, dp, pp], ["tp", "cp", "dp", "pp"])
    for dims in ("tp", "cp", "pp", "dp", ["tp", "pp"], ["tp", "cp"], ["cp", "dp"], ["tp", "cp", "dp"]):
        decoder.create_pg(dims)
    expt_dp = tp * cp * dp // (ep * expt_tp)
    expert = HyperCommGrid([expt_tp, ep, expt_dp, pp], ["expt_tp", "ep", "expt_dp", "pp"])
    for dims in ("ep", "expt_tp", "expt_dp", ["expt_tp", "ep"], ["expt_tp", "ep", "pp"]):
        expert.create_pg(dims)


def device_mesh_groups(tp: int, cp: int, dp: int, pp: int) -> Any:
    from torch.distributed.device_mesh import init_device_mesh

    mesh = init_device_mesh("cpu", (pp, dp, cp, tp), mesh_dim_names=("pp", "dp", "cp", "tp"))
    mesh["dp", "cp"]._flatten("dp_cp")
    return mesh


# ---------------------------------------------------------------- fake-backend worlds


def _fake_world(rank: int, world: int) -> None:
    import torch.distributed as dist
    from torch.testing._internal.distributed.fake_pg import FakeStore

    dist.init_process_group("fake", rank=rank, world_size=world, store=FakeStore())


def _timed_fake(rank: int, world: int, call: Any) -> tuple[float, int]:
    import torch.distributed as dist

    _fake_world(rank, world)
    try:
        before = _pg_names()
        started = time.perf_counter()
        result = call()
        seconds = time.perf_counter() - started
        created = len(_pg_names() - before)
        del result
        _destroy_new(before)
        return seconds, created
    finally:
        dist.destroy_process_group()


def dtensor_meshes(world: int, layout: Any) -> Any:
    """build_shards with the DTensor backend, then the dense and dp×cp meshes (built on first use),
    which is what init_device_mesh + _flatten("dp_cp") provides."""
    import shardcore

    shards = shardcore.build_shards(world, layout, backend="dtensor", device_type="cpu")
    handle = shardcore.my_shard(shards).handle
    _ = handle.mesh, handle.dp_cp  # built on first use: include them in the timing
    return shards


def fake_rows(worlds: list[int], max_peer_world: int, samples: int) -> list[dict[str, Any]]:
    import shardcore
    from shardcore.plan.layout import plan_layout

    warm = plan_layout(64, "tp=8,cp=2,pp=4")  # lazy imports and plugin loading, untimed
    _timed_fake(0, 64, lambda: shardcore.build_shards(64, warm, backend="groups-only"))
    _timed_fake(0, 64, lambda: dtensor_meshes(64, warm))
    rows = []
    for world in worlds:
        tp, cp, pp, dp = 8, 2, 4, world // 64
        layout = plan_layout(world, f"tp={tp},cp={cp},pp={pp},dp={dp}")
        ranks = [world // 2 + 3, world - 1, 1, world // 3][:samples]
        row: dict[str, Any] = {"world": world}
        builds = {
            "sc_groups": lambda: shardcore.build_shards(world, layout, backend="groups-only"),
            "sc_dtensor": lambda: dtensor_meshes(world, layout),
        }
        for key, build in builds.items():
            timed = [_timed_fake(r, world, build) for r in ranks]
            row[key] = statistics.median(t for t, _ in timed)
            row[key + "_pgs"] = max(n for _, n in timed)
        peer_rank = world // 2 + 3  # not rank 0: HyperCommGrid formats every enumeration into a log line there
        if world <= max_peer_world:
            row["megatron"], row["megatron_pgs"] = _timed_fake(
                peer_rank, world, lambda: megatron_groups(tp, cp, dp, pp)
            )
            row["mesh"], row["mesh_pgs"] = _timed_fake(peer_rank, world, lambda: device_mesh_groups(tp, cp, dp, pp))
        rows.append(row)
        print(f"  fake world {world}: {_fmt_row(row)}", file=sys.stderr, flush=True)
    return rows


def _fmt_row(row: dict[str, Any]) -> str:
    return ", ".join(f"{k}={v:.4f}" if isinstance(v, float) else f"{k}={v}" for k, v in row.items())


# ---------------------------------------------------------------- live gloo worlds


def live_worker(rank: int, world: int, rounds: int) -> dict[str, Any]:
    """On every rank: time shardcore local, HyperCommGrid and init_device_mesh, each between barriers."""
    _quiet()
    import torch.distributed as dist

    import shardcore

    _register_groups_backend()
    import megatron.core.hyper_comm_grid  # noqa: F401  (imports outside the timings)
    import torch.distributed.device_mesh  # noqa: F401

    tp, cp, pp, dp = 2, 2, 2, world // 8
    spec = f"tp={tp},cp={cp},pp={pp},dp={dp}"
    calls = {
        "sc_groups": lambda: shardcore.build_shards(world, spec, backend="groups-only"),
        "sc_dtensor": lambda: dtensor_meshes(world, spec),
        "megatron": lambda: megatron_groups(tp, cp, dp, pp),
        "mesh": lambda: device_mesh_groups(tp, cp, dp, pp),
    }
    best: dict[str, float] = {}
    created: dict[str, int] = {}
    for round_index in range(rounds + 1):  # round 0 warms up (first gloo connections, lazy imports), untimed
        for key, call in calls.items():
            dist.barrier()
            before = _pg_names()
            started = time.perf_counter()
            result = call()
            seconds = time.perf_counter() - started
            dist.barrier()
            if key.startswith("sc_"):
                created[key] = len(_pg_names() - before)
                shardcore.destroy_shards(result)
            else:
                del result
                created[key] = _destroy_new(before)
            dist.barrier()
            if round_index:
                best[key] = min(best.get(key, float("inf")), seconds)
    return {"seconds": best, "created": created}


def live_rows(worlds: list[int], rounds: int) -> list[dict[str, Any]]:
    from shardcore.testing import run_world

    rows = []
    for world in worlds:
        reports = run_world(world, live_worker, rounds, timeout=900, pg_timeout=300)
        row: dict[str, Any] = {"world": world}
        for key in ("sc_groups", "sc_dtensor", "megatron", "mesh"):
            row[key] = max(r["seconds"][key] for r in reports)
            row[key + "_pgs"] = max(r["created"][key] for r in reports)
        rows.append(row)
        print(f"  live world {world}: {_fmt_row(row)}", file=sys.stderr, flush=True)
    return rows


# ---------------------------------------------------------------- report


def _s(value: float | None) -> str:
    if value is None:
        return "-"
    return f"{value * 1000:.1f} ms" if value < 1 else f"{value:.2f} s"


def _x(peer: float | None, ours: float) -> str:
    return "-" if peer is None else f"{peer / ours:,.0f}x" if peer / ours >= 10 else f"{peer / ours:.1f}x"


def table(rows: list[dict[str, Any]], title: str) -> str:
    lines = [
        f"**{title}**",
        "",
        "| world | shardcore local (groups) | shardcore local + DTensor | Megatron HyperCommGrid | init_device_mesh "
        "| Megatron / shardcore | init_device_mesh / shardcore+DTensor "
        "| process groups per rank: shardcore / Megatron / init_device_mesh |",
        "|---:|---:|---:|---:|---:|---:|---:|---:|",
    ]
    for row in rows:
        meg, mesh = row.get("megatron"), row.get("mesh")
        lines.append(
            f"| {row['world']:,} | {_s(row['sc_groups'])} | {_s(row['sc_dtensor'])} | {_s(meg)} | {_s(mesh)} "
            f"| {_x(meg, row['sc_groups'])} | {_x(mesh, row['sc_dtensor'])} "
            f"| {row['sc_groups_pgs']} / {row.get('megatron_pgs', '-')} / {row.get('mesh_pgs', '-')} |"
        )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--quick", action="store_true", help="fake worlds 1,024-16,384, live world 8, one round")
    parser.add_argument(
        "--max-peer-world",
        type=int,
        default=262144,
        help="time Megatron and init_device_mesh only up to this world size (they are O(world))",
    )
    parser.add_argument("--no-live", action="store_true", help="skip the live gloo worlds")
    args = parser.parse_args(argv)
    os.environ["SHARDCORE_BENCH_FAKE"] = "1"
    _quiet()
    _register_groups_backend()
    import megatron.core.hyper_comm_grid  # noqa: F401
    import torch

    fake_worlds = [w for w in FAKE_WORLDS if not args.quick or w <= 16384]
    live_worlds = [] if args.no_live else [w for w in LIVE_WORLDS if not args.quick or w <= 8]
    started = time.perf_counter()
    fake = fake_rows(fake_worlds, args.max_peer_world, samples=3)
    live = live_rows(live_worlds, rounds=1 if args.quick else 2) if live_worlds else []
    print(
        f"Python {platform.python_version()}, torch {torch.__version__}, {os.cpu_count()} CPUs; "
        f"total {time.perf_counter() - started:.0f} s\n"
    )
    print(table(fake, "Fake backend, tp=8, cp=2, pp=4 (one simulated rank; shardcore: median of 3 ranks)"))
    if live:
        print()
        print(table(live, "Live gloo, tp=2, cp=2, pp=2 (max over ranks, best of rounds after a warm-up round)"))
    first, last = fake[0], fake[-1]
    print()
    print(
        f"shardcore local (groups) at {last['world']:,} / at {first['world']:,}: "
        f"{last['sc_groups'] / first['sc_groups']:.2f}x; with DTensor: {last['sc_dtensor'] / first['sc_dtensor']:.2f}x"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
