"""Rank functions for refits between two jobs: a trainer's world (4 ranks, Megatron tp=2,pp=2) and an engine's
(4 workers: 2 replicas at tp=2, in vLLM's layout), each job its own world, meeting only in a refit group.

The trainer's sources at refit ``step`` are the known global tensors plus ``step`` (so every refit moves other
bytes); an engine worker compares every destination tensor, bitwise, with those global tensors put through the
weight map (``layout_check.through_map``).
"""

from __future__ import annotations

import time
from datetime import timedelta
from pathlib import Path
from typing import Any

from shardcore import RefitGroup, connect_refit, execute_refit, held_version
from shardcore.engine.live.layout_check import FILL, through_map
from shardcore.engine.live.refit_check import cut, known_tensor
from shardcore.refit import RefitRequest
from tests.engine.refit_workers import die_after_first_landing
from tests.engine.trust_workers import timed_outcome

TRAINER = "tp=2,pp=2,role=train"
"""The trainer's shard: Megatron's layout, 4 ranks."""
ENGINE = "tp=2,dp=2"
"""The engine's shard: 2 replicas at tp=2, vLLM's layout, 4 workers."""
CONFIG = {
    "model_type": "qwen2",
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "vocab_size": 100,
    "torch_dtype": "float32",
}
"""A small Qwen2 (q/k/v biases, padded vocabulary): what the engine holds is vLLM's packing of it."""


def request(config: str, engine: str = ENGINE) -> RefitRequest:
    """The refit over the group's numbering: the trainer's shard (its ranks first), then the engine's."""
    return RefitRequest(f"hf:{config}", f"{TRAINER} + {engine}", 0, (1,), to_layout="vllm")


def _full(plan: Any, step: int) -> Any:
    """The source's global tensor ``name`` at refit ``step``."""
    manifest = plan.manifest
    cache: dict[str, Any] = {}

    def full(name: str) -> Any:
        if name not in cache:
            cache[name] = known_tensor(manifest.tensor(name), manifest.index(name)) + step
        return cache[name]

    return full


def _send(plan: Any, group: RefitGroup, step: int, **options: Any) -> Any:
    """The trainer's part of one refit: its local shards of the step's global tensors."""
    full, manifest = _full(plan, step), plan.manifest
    mine = plan.for_rank(group.rank)
    sources = {
        name: cut(full(name), manifest.tensor(name), plan.source, group.rank, manifest) for name in mine.source_shapes
    }
    return execute_refit(plan, sources, {}, group=group, version=step, **options)


def _destinations(plan: Any, group: RefitGroup) -> dict[str, Any]:
    import torch

    mine = plan.for_rank(group.rank)
    return {
        name: torch.full(shape, FILL, dtype=getattr(torch, plan.destination_tensor(name).destination_dtype))
        for name, shape in mine.destination_shapes.items()
    }


def _mismatches(plan: Any, group: RefitGroup, destinations: dict[str, Any], step: int) -> list[str]:
    """The destination tensors that are not, bitwise, the step's global tensors through the weight map."""
    import torch

    expected, full = through_map(plan, group.rank), _full(plan, step)
    assert expected is not None
    bits = lambda t: t.contiguous().reshape(-1).view(torch.uint8)  # noqa: E731
    return [name for name, got in destinations.items() if not torch.equal(bits(got), bits(expected(name, full)))]


def _world_sum(value: float) -> float:
    """An all_reduce on this job's own world: it still works."""
    import torch
    import torch.distributed as dist

    tensor = torch.tensor([value])
    dist.all_reduce(tensor)
    return float(tensor.item())


# ----------------------------------------------------------------------------- 20 refits, then a second engine


def trainer_refits(rank: int, world: int, address: str, config: str, refits: int, timeout: float) -> dict[str, Any]:
    """20 refits into engine ``a``, then engine ``b`` (2 workers, tp=2) joins and gets one refit."""
    group = connect_refit(address, side="trainer", rank=rank, trainer_ranks=world, engine_ranks=4, timeout=timeout)
    plan = request(config).plan(group.size)
    moved = [_send(plan, group, step).bytes_sent for step in range(refits)]
    second = connect_refit(
        address, side="trainer", rank=rank, trainer_ranks=world, engine_ranks=2, name="b", timeout=timeout
    )
    _send(request(config, "tp=2").plan(second.size), second, 100)
    group.process_group.allreduce([_ones()]).wait()  # engine a may look at its weights now
    second.close()
    group.close()
    return {"moved": moved, "world": _world_sum(1.0), "generation": group.generation, "formed": group.seconds}


def _ones() -> Any:
    import torch

    return torch.ones(1)


def engine_refits(rank: int, world: int, address: str, config: str, refits: int, timeout: float) -> dict[str, Any]:
    """Engine ``a``: every refit bitwise; after engine ``b``'s refit its weights and version are still step 19's."""
    group = connect_refit(address, side="engine", rank=rank, trainer_ranks=4, engine_ranks=world, timeout=timeout)
    plan = request(config).plan(group.size)
    destinations = _destinations(plan, group)
    before = held_version(destinations)
    wrong, versions = [], []
    for step in range(refits):
        execute_refit(plan, {}, destinations, group=group, version=step)
        wrong += [(step, name) for name in _mismatches(plan, group, destinations, step)]
        versions.append(held_version(destinations))
    group.process_group.allreduce([_ones()]).wait()  # the trainer has refit engine b by now
    kept = _mismatches(plan, group, destinations, refits - 1)
    group.close()
    return {
        "before": before,
        "wrong": wrong,
        "versions": [tuple(v) if v else None for v in versions],
        "kept_wrong": kept,
        "kept_version": tuple(held_version(destinations) or ()),
        "checked": len(destinations),
        "world": _world_sum(1.0),
        "group_rank": group.rank,
    }


def second_engine(rank: int, world: int, address: str, config: str, timeout: float) -> dict[str, Any]:
    """Engine ``b`` joins while engine ``a`` holds its weights, and gets a full refit (version 100); it reaches
    the trainer's store through a store object of its own (a TCPStore client), not the address."""
    import torch.distributed as dist

    host, port = address.rsplit(":", 1)
    store = dist.TCPStore(host, int(port), None, False, timedelta(seconds=timeout))
    group = connect_refit(
        store, side="engine", rank=rank, trainer_ranks=4, engine_ranks=world, name="b", timeout=timeout
    )
    plan = request(config, "tp=2").plan(group.size)
    destinations = _destinations(plan, group)
    execute_refit(plan, {}, destinations, group=group, version=100)
    group.close()
    return {"wrong": _mismatches(plan, group, destinations, 100), "version": tuple(held_version(destinations) or ())}


# ----------------------------------------------------------------------------- a worker dies; the engine restarts

VICTIM = 1
"""The engine worker that dies in the second refit (group rank 4 + 1)."""
LEAVER = 2
"""The trainer rank that goes away in the restarted engine's second refit."""


def trainer_through_restart(rank: int, world: int, address: str, config: str, flag: str, timeout: float) -> dict:
    """Refit 0 works; in refit 1 an engine worker dies: named here in time, the trainer's world still works;
    then the restarted engine joins a new group and refit 2 reaches it whole; in refit 3 trainer rank ``LEAVER``
    goes away, and the engine names it."""
    group = connect_refit(address, side="trainer", rank=rank, trainer_ranks=world, engine_ranks=4, timeout=timeout)
    plan = request(config).plan(group.size)
    _send(plan, group, 0, timeout=timeout)
    fault = timed_outcome(lambda: _send(plan, group, 1, timeout=timeout, bucket_bytes=4096))
    world_sum = _world_sum(float(rank))
    group.close()
    if rank == 0:
        Path(flag).write_text("restart")
    again = connect_refit(address, side="trainer", rank=rank, trainer_ranks=world, engine_ranks=4, timeout=60)
    after = timed_outcome(lambda: _send(plan, again, 2, timeout=timeout))
    if rank == LEAVER:
        die_after_first_landing()
    left = timed_outcome(lambda: _send(plan, again, 3, timeout=timeout, bucket_bytes=4096))
    again.close()
    generations = (group.generation, again.generation)
    return {"fault": fault, "world": world_sum, "after": after, "left": left, "generations": generations}


def engine_killed(rank: int, world: int, address: str, config: str, timeout: float) -> tuple[str, str, tuple, float]:
    """The first engine: worker ``VICTIM`` dies after landing its first batch of refit 1."""
    group = connect_refit(address, side="engine", rank=rank, trainer_ranks=4, engine_ranks=world, timeout=timeout)
    plan = request(config).plan(group.size)
    destinations = _destinations(plan, group)
    execute_refit(plan, {}, destinations, group=group, version=0, timeout=timeout)
    if rank == VICTIM:
        die_after_first_landing()
    return timed_outcome(
        lambda: execute_refit(plan, {}, destinations, group=group, version=1, timeout=timeout, bucket_bytes=4096)
    )


def engine_restarted(rank: int, world: int, address: str, config: str, flag: str, timeout: float) -> dict[str, Any]:
    """The engine started again (new processes) once the first is gone: it holds no version, and gets refit 2;
    in refit 3 a trainer rank goes away."""
    deadline = time.monotonic() + 120
    while not Path(flag).exists() and time.monotonic() < deadline:
        time.sleep(0.05)
    group = connect_refit(address, side="engine", rank=rank, trainer_ranks=4, engine_ranks=world, timeout=60)
    plan = request(config).plan(group.size)
    destinations = _destinations(plan, group)
    before = held_version(destinations)
    execute_refit(plan, {}, destinations, group=group, version=2)
    wrong, version = _mismatches(plan, group, destinations, 2), tuple(held_version(destinations) or ())
    left = timed_outcome(
        lambda: execute_refit(plan, {}, destinations, group=group, version=3, timeout=timeout, bucket_bytes=4096)
    )
    group.close()
    return {
        "before": before,
        "wrong": wrong,
        "version": version,
        "left": left,
        "world": _world_sum(1.0),
    }


# ----------------------------------------------------------------------------- bad input


def bad_trainer(rank: int, world: int, address: str, timeout: float) -> dict[str, Any]:
    """Counts that disagree (the engine says 3 trainer ranks), then two engine jobs on one name."""

    def connect(name: str) -> RefitGroup:
        return connect_refit(
            address, side="trainer", rank=rank, trainer_ranks=world, engine_ranks=2, name=name, timeout=timeout
        )

    out: dict[str, Any] = {"counts": timed_outcome(lambda: connect("counts"))}
    time.sleep(2.0)  # both engine jobs claim their ranks in one round before the trainer comes
    group: list[RefitGroup] = []
    out["twice"] = timed_outcome(lambda: group.append(connect("twice")))
    out["local twice"] = timed_outcome(lambda: connect("twice"))  # this process again, while its group is open
    for made in group:
        out["parts"] = _parts_disagree(made, timeout)
        made.close()
    return out


def bad_engine(rank: int, world: int, address: str, timeout: float, first: bool) -> dict[str, Any]:
    """The engine job (``first`` False) brings 3 trainer ranks; then it and a copy of it (``first``, already
    waiting) both join ``twice``."""

    def connect(name: str, trainer_ranks: int = 2) -> RefitGroup:
        return connect_refit(
            address, side="engine", rank=rank, trainer_ranks=trainer_ranks, engine_ranks=world, name=name,
            timeout=timeout,
        )  # fmt: skip

    out: dict[str, Any] = {}
    if not first:
        out["counts"] = timed_outcome(lambda: connect("counts", trainer_ranks=3))
    group: list[RefitGroup] = []
    out["twice"] = timed_outcome(lambda: group.append(connect("twice")))
    for made in group:
        out["parts"] = _parts_disagree(made, timeout)
        made.close()
    return out


def _parts_disagree(group: RefitGroup, timeout: float) -> dict[str, Any]:
    """One refit over ``group`` (the trainer's tp=2 into the engine's tp=2) whose trainer rank 0 lacks a send: it
    stops on both sides at the first meeting, over the group's own store, and writes nothing."""
    import torch

    from shardcore.refit import preset
    from tests.engine.refit_workers import OneSendDropped
    from tests.engine.trust_workers import _tensors

    plan = RefitRequest(preset("tiny-dense"), "tp=2,role=train + tp=2", 0, (1,)).plan(group.size)
    sources, destinations = _tensors(plan, group.rank)
    given = OneSendDropped(plan, 0)
    outcome = timed_outcome(lambda: execute_refit(given, sources, destinations, group=group, timeout=timeout))
    untouched = all(torch.equal(t, torch.full_like(t, -1)) for t in destinations.values())
    dropped = plan.for_rank(0).sends[-1]
    return {"rank": group.rank, "outcome": outcome, "untouched": untouched, "dropped": (dropped.src, dropped.dst)}


# ----------------------------------------------------------------------------- a one-process engine job


ALONE_TRAINER = "tp=2,role=train"
"""The trainer's shard when a one-process engine (``tp=1``) is refit: 2 ranks."""


def _heard() -> tuple[list[str], Any]:
    """The warnings shardcore's agreement logs in this process (a store host that waited out its grace) from now
    on, and the handler that collects them (remove it when done)."""
    import logging

    heard: list[str] = []
    handler = logging.Handler(logging.WARNING)
    handler.emit = lambda record: heard.append(record.getMessage())  # type: ignore[method-assign]
    logging.getLogger("shardcore.agreement").addHandler(handler)
    return heard, handler


def trainer_to_one_process(rank: int, world: int, address: str, config: str, refits: int, timeout: float) -> dict:
    """``refits`` refits into a one-process engine job; what the refits left on this job's own store (the number
    of its keys before and after: the group's meetings live on the group's store) and every lingering meeting
    whose host waited out its grace (the warnings heard)."""
    import logging

    from shardcore.engine.torch_state import default_store

    heard, handler = _heard()
    keys = default_store().num_keys()
    group = connect_refit(address, side="trainer", rank=rank, trainer_ranks=world, engine_ranks=1, timeout=timeout)
    plan = RefitRequest(f"hf:{config}", f"{ALONE_TRAINER} + tp=1", 0, (1,), to_layout="vllm").plan(group.size)
    stats = [_send(plan, group, step, timeout=timeout) for step in range(refits)]
    group.close()
    logging.getLogger("shardcore.agreement").removeHandler(handler)
    return {"keys": (keys, default_store().num_keys()), "heard": heard, "moved": [s.bytes_sent for s in stats]}


def engine_without_default_group(rank: int, world: int, address: str, config: str, refits: int, timeout: float):
    """A one-process engine job with no default process group at all (its world is torn down first): each refit
    completes and lands bitwise, and no meeting's host waited out its grace."""
    import logging

    import torch.distributed as dist

    dist.destroy_process_group()
    heard, handler = _heard()
    group = connect_refit(address, side="engine", rank=rank, trainer_ranks=2, engine_ranks=world, timeout=timeout)
    plan = RefitRequest(f"hf:{config}", f"{ALONE_TRAINER} + tp=1", 0, (1,), to_layout="vllm").plan(group.size)
    destinations = _destinations(plan, group)
    outcomes, wrong, versions = [], [], []
    for step in range(refits):
        refit = lambda version=step: execute_refit(plan, {}, destinations, group=group, version=version)  # noqa: E731
        outcomes.append(timed_outcome(refit))
        wrong += [(step, name) for name in _mismatches(plan, group, destinations, step)]
        versions.append(tuple(held_version(destinations) or ()))
    group.close()
    logging.getLogger("shardcore.agreement").removeHandler(handler)
    initialized = dist.is_initialized()
    return {"outcomes": outcomes, "wrong": wrong, "versions": versions, "heard": heard, "default": initialized}
