"""Functions run in spawned processes by the megatron plugin tests (fake worlds and live gloo worlds)."""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

from plugins.megatron.tests.megatron_fields import DECODER_FIELDS as DECODER
from plugins.megatron.tests.megatron_fields import EXPERT_FIELDS as EXPERT
from plugins.megatron.tests.megatron_recipe import fake_world, quiet
from shardcore.engine import live_group_count

FIELDS = (
    "tp",
    "cp",
    "pp",
    "dp",
    "mp",
    "tp_cp",
    "dp_cp",
    "tp_dp_cp",
    "ep",
    "expt_tp",
    "expt_dp",
    "tp_ep",
    "tp_ep_pp",
    "embd",
    "pos_embd",
)
Ranks = "dict[str, tuple[int, ...] | None]"


def _members(pg: Any) -> tuple[int, ...] | None:
    return None if pg is None else tuple(sorted(dist.get_process_group_ranks(pg)))


def megatron_inference_shards() -> Any:
    """megatron-core's own ``megatron.core.inference.shards`` (0.19 and later), or None where it has none (0.16)."""
    try:
        with quiet():
            from megatron.core.inference import shards
    except ImportError:
        return None
    return shards


def oracle() -> str:
    """What the parity tests compare shardcore's drop-in with on this megatron-core."""
    return "megatron.core.inference.shards" if megatron_inference_shards() else "HyperCommGrid recipe"


def megatron_fields(c: dict[str, Any]) -> dict[str, tuple[int, ...] | None] | str:
    """This rank's fields from megatron-core's own ``build_inference_pg_collection`` where it has one (0.19+),
    else from its HyperCommGrids used the same way (0.16.1)."""
    shards = megatron_inference_shards()
    if shards is None:
        return megatron_recipe(c)
    size = c["tp"] * c["cp"] * c["pp"] * c["dp"]
    try:
        with quiet():
            pgc = shards.build_inference_pg_collection(
                size, c["tp"], c["pp"], c["cp"], c["ep"], c["expt_tp"], c["mapping"], c["offset"]
            )
    except AssertionError as error:
        if "PP groups must match" not in str(error):
            raise
        return "pp mismatch"
    return {name: _members(getattr(pgc, name)) for name in FIELDS}


def megatron_recipe(c: dict[str, Any]) -> dict[str, tuple[int, ...] | None] | str:
    """This rank's fields, built with Megatron's HyperCommGrids the way its inference builder does."""
    with quiet():
        from megatron.core.hyper_comm_grid import HyperCommGrid
    tp, cp, pp, ep, etp, offset = c["tp"], c["cp"], c["pp"], c["ep"], c["expt_tp"], c["offset"]
    size = tp * cp * pp * c["dp"]
    edp = size // (etp * ep * pp)
    if c["mapping"]:
        dec = HyperCommGrid([tp, cp, pp, c["dp"]], ["tp", "cp", "pp", "dp"], rank_offset=offset)
        exp = HyperCommGrid([etp, ep, pp, edp], ["tp", "ep", "pp", "dp"], rank_offset=offset)
    else:
        dec = HyperCommGrid([tp, cp, c["dp"], pp], ["tp", "cp", "dp", "pp"], rank_offset=offset)
        exp = HyperCommGrid([etp, ep, edp, pp], ["tp", "ep", "dp", "pp"], rank_offset=offset)
    out = {name: _members(dec.create_pg(dims)) for name, dims in DECODER.items()}
    if dec.get_rank_enum("pp") != exp.get_rank_enum("pp"):
        return "pp mismatch"
    out.update({name: _members(exp.create_pg(dims)) for name, dims in EXPERT.items()})
    out["embd"] = out["pos_embd"] = None
    rank = dist.get_rank()
    for p in dec.get_rank_enum("pp"):
        embd = [p[0], p[-1]] if len(p) > 1 else [p[0]]
        for key, ranks in (("embd", embd), ("pos_embd", [p[0]])):
            group = dist.new_group(ranks)
            if rank in ranks:
                out[key] = _members(group)
    return out


def shardcore_dropin(c: dict[str, Any], via_shards: bool) -> dict[str, tuple[int, ...] | None] | str:
    """This rank's fields from shardcore_megatron's drop-in builders."""
    from shardcore.errors import LayoutError
    from shardcore_megatron.shards import build_inference_pg_collection, build_inference_pg_collections_for_shards

    size = c["tp"] * c["cp"] * c["pp"] * c["dp"]
    try:
        if via_shards:
            spec = {k: c[k] for k in ("tp", "cp", "pp", "dp", "ep", "expt_tp")}
            built = build_inference_pg_collections_for_shards(
                c["world"], [spec], c["mapping"], rank_offset=c["offset"], allow_idle=True, strategy=c["strategy"]
            )
            pgc = built[0].pg_collection
            if pgc is None:
                return dict.fromkeys(FIELDS)
        else:
            pgc = build_inference_pg_collection(
                size,
                c["tp"],
                c["pp"],
                c["cp"],
                c["ep"],
                c["expt_tp"],
                c["mapping"],
                c["offset"],
                strategy=c["strategy"],
            )
    except LayoutError:
        return "pp mismatch"
    return {name: _members(getattr(pgc, name)) for name in FIELDS}


def parity(configs: list[dict[str, Any]]) -> list[str]:
    """Compare every rank of every config; return one line per difference (empty when in parity)."""
    problems: list[str] = []
    for c in configs:
        for rank in range(c["world"]):
            fake_world(rank, c["world"])
            theirs = megatron_fields(c)
            for via_shards in (False, True):
                fake_world(rank, c["world"])
                ours = shardcore_dropin(c, via_shards)
                if ours != theirs:
                    problems.append(f"{c} rank {rank} via_shards={via_shards}: megatron {theirs} shardcore {ours}")
    if dist.is_initialized():
        dist.destroy_process_group()
    return problems


def _shard_view(shard: Any) -> tuple[Any, ...]:
    """What a rank sees of one shard, Megatron's ``InferenceShard`` or the drop-in's, comparably."""
    spec = tuple(getattr(shard.spec, key) for key in ("tp", "pp", "dp", "ep", "expt_tp", "role"))
    pgc = shard.pg_collection
    fields = None if pgc is None else tuple(_members(getattr(pgc, name)) for name in FIELDS)
    return spec, shard.rank_offset, shard.world_size, fields


def shards_parity(layouts: list[tuple[str, int, bool]]) -> list[str]:
    """Every rank's shards from megatron-core's own ``build_inference_pg_collections_for_shards`` and from the
    drop-in, given the spec string and Megatron's own ``InferenceShardSpec`` objects; one line per difference."""
    from shardcore_megatron.shards import build_inference_pg_collections_for_shards

    shards = megatron_inference_shards()
    problems = []
    for spec, world, mapping in layouts:
        with quiet():
            objects = shards.normalize_shard_specs(spec, world)
        for rank in range(world):
            fake_world(rank, world)
            with quiet():
                built = shards.build_inference_pg_collections_for_shards(world, spec, mapping)
            theirs = [_shard_view(s) for s in built]
            for given in (spec, objects):
                fake_world(rank, world)
                ours = [_shard_view(s) for s in build_inference_pg_collections_for_shards(world, given, mapping)]
                if ours != theirs:
                    problems.append(f"{spec!r} world {world} rank {rank} ({type(given).__name__}): {ours} != {theirs}")
    dist.destroy_process_group()
    return problems


def refusals(cases: list[tuple[str, dict[str, Any]]]) -> list[tuple[str, str, str]]:
    """Each call of megatron-core's own builder (by name) that fails, and the drop-in's answer to the same
    call: (Megatron's exception type, the drop-in's exception type, the drop-in's message)."""
    import shardcore_megatron.shards as dropin

    shards = megatron_inference_shards()
    out = []
    for function, kwargs in cases:
        answers = []
        for module in (shards, dropin):
            fake_world(0, 8)
            try:
                with quiet():
                    getattr(module, function)(**kwargs)
                answers.append(("none", ""))
            except Exception as error:
                answers.append((type(error).__name__, str(error)))
        out.append((answers[0][0], answers[1][0], answers[1][1]))
    dist.destroy_process_group()
    return out


def defaults_from_parallel_state(world: int) -> list[dict[str, Any]]:
    """Sizes left None: 1 without parallel_state, training's sizes once it is initialised."""
    from megatron.core import parallel_state as mpu

    from shardcore_megatron.shards import build_inference_pg_collection

    out = []
    for rank in (0, world - 1):
        fake_world(rank, world)
        plain = build_inference_pg_collection(world)
        mpu.initialize_model_parallel(
            tensor_model_parallel_size=2, pipeline_model_parallel_size=2, create_gloo_process_groups=False
        )
        trained = build_inference_pg_collection(world)
        out.append(
            {
                "plain_tp": plain.tp.size(),
                "plain_dp": plain.dp.size(),
                "tp": trained.tp.size(),
                "pp": trained.pp.size(),
                "dp": trained.dp.size(),
            }
        )
        mpu.destroy_model_parallel()
    dist.destroy_process_group()
    return out


def live_collections(rank: int, world: int, cases: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """For each case build the collections, then all-reduce and all-gather over every field of this rank's."""
    from shardcore_megatron.backend import collection_fields
    from shardcore_megatron.shards import (
        build_inference_pg_collection,
        build_inference_pg_collections_for_shards,
        destroy_inference_process_groups,
    )

    reports = []
    for case in cases:
        before = live_group_count()
        if case["call"] == "single":
            pgc = build_inference_pg_collection(**case["kwargs"])
            mine = {"index": 0 if pgc.tp is not None else None, "pgc": pgc}
        else:
            built = build_inference_pg_collections_for_shards(**case["kwargs"])
            members = [i for i, s in enumerate(built) if s.pg_collection is not None]
            mine = {
                "index": members[0] if members else None,
                "pgc": built[members[0]].pg_collection if members else None,
                "n_members": len(members),
                "type": type(built[0]).__name__,
            }
        fields: dict[str, Any] = {}
        distinct: set[int] = set()
        if mine["pgc"] is not None:
            for name in collection_fields():
                group = getattr(mine["pgc"], name)
                if group is None:
                    fields[name] = None
                    continue
                distinct.add(id(group))
                ones = torch.ones(1)
                dist.all_reduce(ones, group=group)
                out = [torch.zeros(1, dtype=torch.int64) for _ in range(group.size())]
                dist.all_gather(out, torch.tensor([rank]), group=group)
                fields[name] = {"sum": int(ones.item()), "size": group.size(), "ranks": [int(t.item()) for t in out]}
        created = live_group_count() - before
        destroy_inference_process_groups()
        dist.barrier()
        reports.append(
            {
                "shard": mine["index"],
                "fields": fields,
                "created": created,
                "distinct": len(distinct),
                "leftover": live_group_count() - before,
                "type": type(mine["pgc"]).__name__,
                "n_members": mine.get("n_members"),
            }
        )
    return reports
