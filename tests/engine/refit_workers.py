"""Rank functions for the refit execution tests: many plans per spawned world (a world costs seconds)."""

from __future__ import annotations

import os
import time
from dataclasses import asdict, replace
from typing import Any

from shardcore import execute_refit
from shardcore.engine.live.refit_check import check_refit
from shardcore.errors import ShardcoreError
from shardcore.plan.layout import plan_layout
from shardcore.refit import RefitRequest
from shardcore.refit.models import PRESET_CONFIGS, manifest_from_config, preset
from shardcore.refit.plan import tensors_matching
from shardcore.refit.planner import plan_refit

# (label, model, source layout, source shard, destination layout or None (same), destination shards)
CASES_8 = [
    ("tp 8->2 collocated, dp replicas on the destination", "tiny-dense", "tp=8", 0, "tp=2,dp=4", [0]),
    (
        "tp 2->4, pp 2->1, dp replicas on the source, cp=2 on the destination",
        "tiny-dense",
        "tp=2,pp=2,dp=2",
        0,
        "tp=4,cp=2",
        [0],
    ),
    ("pp 1->2, cp=2 on the source", "tiny-dense", "tp=2,cp=2,dp=2", 0, "tp=2,pp=2,cp=2", [0]),
    ("tp 4->1 and tp 4->2 at once, disaggregated, one idle rank", "tiny-dense", "tp=4 + tp=1 + tp=2", 0, None, [1, 2]),
    ("ep 4->2 and expt_tp 1->2, collocated", "tiny-moe", "tp=2,dp=4,ep=4", 0, "tp=4,dp=2,ep=2,expt_tp=2", [0]),
    ("ep 2->8 with pp 2->1, collocated", "tiny-moe", "tp=2,pp=2,dp=2,ep=2", 0, "dp=8,ep=8", [0]),
    ("bf16: training tp=2,pp=2 to two tp=2 shards", "bf16", "tp=2,pp=2,role=train + tp=2 + tp=2", 0, None, [1, 2]),
]


def _manifest(name: str) -> Any:
    if name == "bf16":
        config = PRESET_CONFIGS["tiny-dense"]
        return manifest_from_config(type(config)(**{**config.__dict__, "dtype": "bfloat16"}), name="tiny-dense-bf16")
    return preset(name)


# the same, with the planner's options: ranks_per_node, fan_out, min_piece_bytes, and tensors (name patterns)
CASES_OPTIONS_8 = [
    (
        "fan-out: two tp=2 destinations on the node without the tp=4 source",
        "tiny-dense",
        "tp=4,role=train + tp=2 + tp=2",
        0,
        None,
        [1, 2],
        {"ranks_per_node": 4, "fan_out": True},
    ),
    (
        "fan-out: dp=6 replicas over three nodes of 2, bf16",
        "bf16",
        "tp=2,role=train + tp=1,dp=6",
        0,
        None,
        [1],
        {"ranks_per_node": 2, "fan_out": True},
    ),
    (
        "partial, collocated: experts only, ep 4->2 and expt_tp 1->2",
        "tiny-moe",
        "tp=2,dp=4,ep=4",
        0,
        "tp=4,dp=2,ep=2,expt_tp=2",
        [0],
        {"tensors": ("*.experts.*",)},
    ),
    (
        "partial with fan-out and a 64 KiB floor: the MLP weights",
        "tiny-dense",
        "tp=4,role=train + tp=2 + tp=2",
        0,
        None,
        [1, 2],
        {"ranks_per_node": 4, "fan_out": True, "min_piece_bytes": 64 << 10, "tensors": ("*.mlp.*",)},
    ),
]


def _plan(world: int, case: tuple) -> Any:
    """The case's plan, as the CLI and ``refit --check`` build theirs: from a ``RefitRequest``."""
    _, model, src_spec, src, dst_spec, dst, *more = case
    options = dict(more[0]) if more else {}
    request = RefitRequest(_manifest(model), src_spec, src, tuple(dst), dst_spec, allow_idle=True, **options)
    return request.plan(world)


def run_cases(rank: int, world: int, cases: list[tuple], bucket_bytes: int) -> list[dict[str, Any]]:
    """Check every case on this world: per case, this rank's report as a dict."""
    return [asdict(check_refit(_plan(world, case), rank, bucket_bytes=bucket_bytes, timeout=120)) for case in cases]


def run_cases_each_bucket(rank: int, world: int, cases: list[tuple], buckets: list[int]) -> list[list[dict[str, Any]]]:
    """``run_cases`` once per bucket size, in one world."""
    return [run_cases(rank, world, cases, bucket_bytes) for bucket_bytes in buckets]


def partial_refits(rank: int, world: int) -> dict[str, Any]:
    """A partial refit writes its tensors only (the others keep their bytes); ranks that bring different
    subsets are stopped, every one, before a byte moves."""
    import torch

    from shardcore.engine.live.refit_check import cut, known_tensor
    from tests.engine.trust_workers import _tensors

    full = plan_refit(plan_layout(world, "tp=2,role=train + tp=1,dp=2"), 0, [1], preset("tiny-dense"))
    manifest = full.manifest
    sources, destinations = _tensors(full, rank)
    out: dict[str, Any] = {}
    mixed = full.subset(tensors_matching(manifest, "*.mlp.*" if rank == 0 else "*.self_attention.*"))
    try:
        execute_refit(mixed, sources, destinations, timeout=30)
        out["mixed"] = "no error"
    except ShardcoreError as error:
        out["mixed"] = f"{type(error).__name__}: {error}"
    out["untouched after mixed"] = all(bool((t == -1).all()) for t in destinations.values())
    part = full.subset(tensors_matching(manifest, "*.mlp.*"))
    stats = execute_refit(part, sources, destinations, timeout=30)
    target = full.destinations[0]
    out["bytes_received"] = stats.bytes_received
    out["written"], out["kept"], out["wrong"] = [], [], []
    for name, got in destinations.items():
        if ".mlp." in name:
            expected = cut(
                known_tensor(manifest.tensor(name), manifest.index(name)), manifest.tensor(name), target, rank, manifest
            )
            (out["written"] if torch.equal(got, expected) else out["wrong"]).append(name)
        elif bool((got == -1).all()):
            out["kept"].append(name)
        else:
            out["wrong"].append(name)
    return out


def bad_inputs(rank: int, world: int) -> dict[str, str]:
    """Wrong tensors on one rank: every rank gets the same typed error, naming tensor and shapes, before any byte."""
    disjoint = plan_refit(plan_layout(world, "tp=2 + tp=2"), 0, [1], preset("tiny-dense"))
    collocated = _plan(world, ("", "tiny-dense", "tp=2,dp=2", 0, "tp=4", [0]))  # one name on both sides of a rank
    import torch

    def tensors(shapes: dict) -> dict:
        return {name: torch.zeros(shape) for name, shape in shapes.items()}

    out = {}
    for label, culprit_change in (
        ("shape", lambda s, d: s.update({"decoder.layers.0.mlp.linear_fc2.weight": torch.zeros(128, 512)})),
        ("missing", lambda s, d: d.pop("decoder.layers.1.self_attention.linear_qkv.weight")),
        ("dtype", lambda s, d: d.update({"decoder.final_layernorm.weight": torch.zeros(128, dtype=torch.float16)})),
        ("many", lambda s, d: d.update({n: torch.zeros(t.shape[0] + 1, *t.shape[1:]) for n, t in d.items()})),
        ("devices", lambda s, d: d.update({"decoder.final_layernorm.weight": torch.zeros(128, device="meta")})),
        ("library", lambda s, d: [side.update({n: t.to("meta") for n, t in side.items()}) for side in (s, d)]),
        ("source's device", lambda s, d: s.update({"decoder.final_layernorm.weight": torch.zeros(128, device="meta")})),
    ):
        plan = collocated if label == "source's device" else disjoint
        mine = plan.for_rank(rank)
        sources, destinations = tensors(mine.source_shapes), tensors(mine.destination_shapes)
        if rank == (0 if label == "shape" else 3):
            culprit_change(sources, destinations)
        before = {name: t.clone() for name, t in destinations.items()}
        try:
            execute_refit(plan, sources, destinations, timeout=30)
            out[label] = "no error"
        except ShardcoreError as error:
            out[label] = f"{type(error).__name__}: {error}"
        out[label + " untouched"] = str(
            all(torch.equal(before[n], t) for n, t in destinations.items() if t.device.type != "meta")
        )
    return out


def timed_outcome(plan: Any, rank: int, **execute_options: Any) -> tuple[str, str, tuple, float]:
    """``check_refit``'s outcome on this rank, and its seconds: ("ok", "", (), s), or the error's class name,
    text and the ranks it names (the fault tests check that a dead or absent peer is named in time)."""
    started = time.monotonic()
    try:
        check_refit(plan, rank, **execute_options)
    except ShardcoreError as error:
        return type(error).__name__, str(error), getattr(error, "ranks", ()), time.monotonic() - started
    return "ok", "", (), time.monotonic() - started


def die_after_first_landing() -> None:
    """This process dies (exit code 17) in its next refit, after landing its first batch, the next one posted."""
    from shardcore.engine.transfer.exchange import Exchange

    real, landed = Exchange._land, [0]

    def dying(self: Exchange, flight: Any) -> None:
        if landed[0] == 1:
            os._exit(17)
        real(self, flight)
        landed[0] += 1

    Exchange._land = dying  # type: ignore[method-assign]


def killed_mid_transfer(rank: int, world: int, victim: int, timeout: float) -> tuple[str, str, tuple, float]:
    """``victim`` (a destination rank) dies after its first received batch, with the next one already posted
    (two batches in flight); the others must name it in time."""
    plan = plan_refit(plan_layout(world, "tp=2 + tp=1 + tp=1"), 0, [1, 2], preset("tiny-dense"))
    if rank == victim:
        die_after_first_landing()
    return timed_outcome(plan, rank, bucket_bytes=64 << 10, timeout=timeout)


def absent(rank: int, world: int, missing: int, timeout: float) -> tuple[str, str, tuple, float]:
    """``missing`` never calls execute (it runs other code for longer than the timeout)."""
    if rank == missing:
        time.sleep(timeout + 3)
        return "absent", "", (), 0.0
    plan = plan_refit(plan_layout(world, "tp=2 + tp=2"), 0, [1], preset("tiny-dense"))
    return timed_outcome(plan, rank, timeout=timeout)


def staging_peaks(rank: int, world: int, cases: list[tuple], bucket_bytes: int) -> list[tuple[int, int, bool]]:
    """Per case: this rank's staging peak, its messages and whether every destination matched (check_rank)."""
    from shardcore.engine.transfer import execute as engine

    seen: list[Any] = []

    def recording(*args: Any, **kwargs: Any) -> Any:
        seen.append(real(*args, **kwargs))
        return seen[-1]

    real, engine.execute_refit = engine.execute_refit, recording
    try:
        reports = [check_refit(_plan(world, case), rank, bucket_bytes=bucket_bytes, timeout=120) for case in cases]
    finally:
        engine.execute_refit = real
    return [(stats.peak_buffer_bytes, stats.messages, not report.mismatches) for stats, report in zip(seen, reports)]


def refit_again_into_other_tensors(rank: int, world: int) -> dict[str, bool]:
    """Two refits of one plan: the second, from other sources (doubled) into other destinations, reuses where the
    first found its in-place messages in their tensors, and must land in its own tensors only."""
    import torch

    from tests.engine.trust_workers import _tensors

    plan = plan_refit(plan_layout(world, "tp=2,role=train + tp=2"), 0, [1], preset("tiny-dense"))
    sources, first = _tensors(plan, rank)
    execute_refit(plan, sources, first, timeout=30)
    landed = {name: tensor.clone() for name, tensor in first.items()}
    doubled = {name: tensor * 2 for name, tensor in sources.items()}
    _, second = _tensors(plan, rank)
    stats = execute_refit(plan, doubled, second, timeout=30)
    return {
        "received": stats.bytes_received > 0 or not second,
        "first kept": all(torch.equal(first[name], landed[name]) for name in first),
        "second doubled": all(torch.equal(second[name], landed[name] * 2) for name in second),
    }


def refits_in_two_sessions(rank: int, world: int) -> dict[str, Any]:
    """One plan refitted into one set of destinations by the default session (version 1) and by a session of its
    own (version 2): each records its own version and keeps its own schedule; both land bitwise."""
    from shardcore.engine import RefitSession, held_version
    from shardcore.engine.transfer.session import DEFAULT_SESSION
    from tests.engine.trust_workers import _correct, _tensors

    plan = plan_refit(plan_layout(world, "tp=2,role=train + tp=2"), 0, [1], preset("tiny-dense"))
    sources, destinations = _tensors(plan, rank)
    own = RefitSession()
    execute_refit(plan, sources, destinations, timeout=60, version=1)
    default_schedule = DEFAULT_SESSION.schedule
    execute_refit(plan, sources, destinations, timeout=60, version=2, session=own)
    return {
        "default": tuple(held_version(destinations) or ()),
        "own": tuple(held_version(destinations, own) or ()),
        "default schedule kept": DEFAULT_SESSION.schedule is default_schedule,
        "own schedule": own.schedule is not None and own.schedule is not default_schedule,
        "correct": _correct(plan, rank, destinations),
        "has destinations": bool(destinations),
    }


class OneSendDropped:
    """A plan whose part on ``rank`` lacks its last send: parts that disagree, as a planner bug would make them."""

    def __init__(self, plan: Any, rank: int) -> None:
        self._plan, self._rank = plan, rank
        self._part = replace(plan.for_rank(rank), sends=plan.for_rank(rank).sends[:-1])

    def for_rank(self, rank: int) -> Any:
        return self._part if rank == self._rank else self._plan.for_rank(rank)

    def __getattr__(self, name: str) -> Any:
        return getattr(self._plan, name)


def parts_disagree(rank: int, world: int, culprit: int) -> dict[str, Any]:
    """A refit whose parts disagree (``culprit``'s lacks a send) stops on every rank before a byte moves, naming
    the pair; the world is clean after it: the next refit, of the true plan, lands bitwise."""
    import torch

    from tests.engine.trust_workers import _correct, _tensors

    plan = plan_refit(plan_layout(world, "tp=2,role=train + tp=1,dp=2"), 0, [1], preset("tiny-dense"))
    dropped = plan.for_rank(culprit).sends[-1]
    sources, destinations = _tensors(plan, rank)
    out: dict[str, Any] = {"dropped": (dropped.src, dropped.dst)}
    started = time.monotonic()
    try:
        execute_refit(OneSendDropped(plan, culprit), sources, destinations, timeout=60)
        out["error"] = "no error"
    except ShardcoreError as error:
        out["error"], out["ranks"] = f"{type(error).__name__}: {error}", list(getattr(error, "ranks", []))
    out["seconds"] = time.monotonic() - started
    out["untouched"] = all(bool((t == -1).all()) for t in destinations.values())
    execute_refit(plan, sources, destinations, timeout=60)
    out["then correct"] = _correct(plan, rank, destinations) and all(
        not torch.equal(t, torch.full_like(t, -1)) for t in destinations.values()
    )
    return out


def allocated_refit(rank: int, world_size: int, config: dict[str, Any]) -> dict[str, Any]:
    """A bf16 Hugging Face model's refit with every tensor from ``allocate_refit``: seeded sources on the trainer
    (tp=2,pp=2), empty destinations on two engines (tp=2, dp=2), executed; each destination rank's tensors are
    compared with the sources ``allocate_refit`` seeds for it under the reverse plan (the same global tensors, in
    its own layout, computed on its own). Returns the dtypes seen and the names that differ."""
    import torch

    from shardcore import allocate_refit
    from shardcore.refit import manifest_from_hf_config

    manifest = manifest_from_hf_config(config).manifest
    layout = plan_layout(world_size, "tp=2,pp=2,role=train + tp=2 + dp=2")
    plan = plan_refit(layout, 0, [1, 2], manifest)
    sources, destinations = allocate_refit(plan, rank, seed=11)
    execute_refit(plan, sources, destinations, timeout=60)
    differ = []
    shard = next((s.index for s in layout.shards[1:] if rank in s), None)
    if shard is not None:
        expected = allocate_refit(plan_refit(layout, shard, [0], manifest), rank, seed=11).sources
        differ = [name for name, got in destinations.items() if not torch.equal(got, expected[name])]
    return {
        "dtypes": sorted({str(t.dtype) for t in (*sources.values(), *destinations.values())}),
        "destinations": len(destinations),
        "differ": differ,
    }
