"""Rank functions for the refit-trust tests: disagreeing plans, failures of every kind, faulty messages, versions.

Each function runs on every rank of a live gloo world (``shardcore.testing.run_world``) and returns what
that rank saw, so the tests can check every rank's error and every destination's bytes.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import torch

from shardcore import ShardcoreError, execute_refit
from shardcore.engine import held_version
from shardcore.engine.live.refit_check import cut, known_tensor
from shardcore.engine.transfer import exchange as exchange_module
from shardcore.plan import plan_layout
from shardcore.refit import Manifest, RefitRequest, TensorSpec, plan_refit

SPEC = "tp=2 + tp=1,dp=2"
"""Four ranks: a tp=2 source shard and a destination with two replicas."""


def _tensors(
    plan: Any, rank: int, fill: float | None = None
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's sources (cut from the known global tensors) and destinations (filled with ``fill``)."""
    manifest, mine = plan.manifest, plan.for_rank(rank)
    sources = {
        name: cut(
            known_tensor(manifest.tensor(name), manifest.index(name)),
            manifest.tensor(name),
            plan.source,
            rank,
            manifest,
        )
        for name in mine.source_shapes
    }
    destinations = {
        name: torch.full(shape, -1.0 if fill is None else fill, dtype=getattr(torch, manifest.tensor(name).dtype))
        for name, shape in mine.destination_shapes.items()
    }
    return sources, destinations


def _correct(plan: Any, rank: int, destinations: Mapping[str, torch.Tensor]) -> bool:
    """Whether every destination equals its slice of the known global tensors, bitwise."""
    manifest = plan.manifest
    target = next((p for p in plan.destinations if rank in p), None)
    for name, got in destinations.items():
        full = known_tensor(manifest.tensor(name), manifest.index(name))
        if not torch.equal(
            got.view(-1).view(torch.uint8),
            cut(full, manifest.tensor(name), target, rank, manifest).view(-1).view(torch.uint8),
        ):
            return False
    return True


def timed_outcome(call: Callable[[], Any]) -> tuple[str, str, tuple[int, ...], float]:
    """``call``'s outcome as a rank reports it: its error's type, message and named ranks (``"ok"`` if none), and
    how long it took."""
    started = time.monotonic()
    try:
        call()
    except ShardcoreError as error:
        return type(error).__name__, str(error), tuple(getattr(error, "ranks", ())), time.monotonic() - started
    return "ok", "", (), time.monotonic() - started


def _plan(world: int, spec: str = SPEC, model: str = "tiny-dense") -> Any:
    return RefitRequest(model, spec, 0, (1,)).plan(world)


def disagreeing_plans(rank: int, world: int) -> dict[str, Any]:
    """One rank plans another destination layout, another manifest, another version: each is named, no byte moves."""
    out: dict[str, Any] = {}
    good = _plan(world)
    for label, mine in (
        ("destination", _plan(world, "tp=2 + tp=2") if rank == 3 else good),
        ("manifest", _plan(world, model="tiny-moe") if rank == 2 else good),
    ):
        sources, destinations = _tensors(mine, rank)
        before = {name: t.clone() for name, t in destinations.items()}
        out[label] = timed_outcome(lambda: execute_refit(mine, sources, destinations, timeout=20))
        out[label + " untouched"] = all(torch.equal(before[n], destinations[n]) for n in destinations)
    sources, destinations = _tensors(good, rank)
    out["version"] = timed_outcome(
        lambda: execute_refit(good, sources, destinations, timeout=20, version=5 if rank == 1 else 4)
    )
    out["after"] = timed_outcome(lambda: execute_refit(good, sources, destinations, timeout=20, version=9))
    out["after correct"] = _correct(good, rank, destinations)
    return out


def _raising_once(rank: int) -> Callable[[], None]:
    """On ``rank``, make the exchange raise while packing its first send (after every check has passed);
    returns the undo."""
    real = exchange_module.Exchange._pack

    def raising(self: Any, message: Any, wire: torch.Tensor, staged: bool) -> None:
        raise RuntimeError(f"injected failure packing a message to rank {message.peer}")

    if rank == 0:
        exchange_module.Exchange._pack = raising  # type: ignore[method-assign]

    def undo() -> None:
        exchange_module.Exchange._pack = real  # type: ignore[method-assign]

    return undo


def one_failure_each(rank: int, world: int, timeout: float) -> list[dict[str, Any]]:
    """Good refits between every kind of failure on one rank: a bad argument, a skipped call, an exception in
    the middle of the exchange. After each, the next refit with good inputs must succeed on every rank."""
    plan = _plan(world)
    steps: list[dict[str, Any]] = []

    def step(label: str, call: Callable[[], Any], destinations: Mapping[str, torch.Tensor]) -> None:
        kind, message, ranks, elapsed = timed_outcome(call)
        steps.append({
            "label": label, "kind": kind, "message": message, "ranks": ranks, "elapsed": elapsed,
            "correct": _correct(plan, rank, destinations), "held": held_version(destinations),
        })  # fmt: skip

    sources, destinations = _tensors(plan, rank)
    step("good 1", lambda: execute_refit(plan, sources, destinations, timeout=timeout, version=1), destinations)
    bucket = 1 if rank == 2 else 64 << 20
    step(
        "bad argument",
        lambda: execute_refit(plan, sources, destinations, timeout=timeout, bucket_bytes=bucket, version=2),
        destinations,
    )
    step("good 3", lambda: execute_refit(plan, sources, destinations, timeout=timeout, version=3), destinations)
    if rank == 1:
        time.sleep(timeout + 2)
        steps.append({"label": "skipped", "kind": "skipped"})
    else:
        step("skipped", lambda: execute_refit(plan, sources, destinations, timeout=timeout, version=4), destinations)
    step("good 5", lambda: execute_refit(plan, sources, destinations, timeout=timeout, version=5), destinations)
    fresh = {n: torch.full_like(t, 7.0) for n, t in destinations.items()}
    undo = _raising_once(rank)
    step("exception", lambda: execute_refit(plan, sources, fresh, timeout=timeout, version=6), fresh)
    undo()
    step("good 7", lambda: execute_refit(plan, sources, fresh, timeout=timeout, version=7, verify="checksum"), fresh)
    return steps


def parameters(rank: int, world: int) -> dict[str, Any]:
    """Destinations that are nn.Parameters (requires_grad), as a model's weights are: written in place."""
    plan = _plan(world)
    sources, plain = _tensors(plan, rank)
    weights = {name: torch.nn.Parameter(tensor) for name, tensor in plain.items()}
    stats = execute_refit(plan, sources, weights, timeout=30, version=3)
    return {
        "correct": _correct(plan, rank, {name: p.detach() for name, p in weights.items()}),
        "requires_grad": all(p.requires_grad and p.grad is None for p in weights.values()),
        "version": stats.version,
        "held": held_version(weights),
    }


def faulty_message(rank: int, world: int, mode: str) -> tuple[str, str, tuple[int, ...], float]:
    """Rank 0 (a sender) corrupts one message after summing it, or sends it short; the receiver names it."""
    plan = _plan(world)
    if rank == 0:
        real_pack, real_bind = exchange_module.Exchange._pack, exchange_module.Exchange._bind

        def corrupting(self: Any, message: Any, wire: torch.Tensor, staged: bool) -> torch.Tensor:
            wire = real_pack(self, message, wire, staged)
            if message.peer == 2 and message.key[0] == 0:
                wire[0] ^= 0xFF
            return wire

        def shortening(self: Any, messages: Any, region: Any) -> Any:
            wires = real_bind(self, messages, region)
            out = []
            for message, (wire, staged) in zip(messages, wires):
                if message.send and not message.ledger and message.peer == 2 and message.key[0] == 0:
                    wire = wire[: wire.numel() // 2]
                    self.posted[message.key] = wire.numel()
                out.append((wire, staged))
            for message, (wire, _) in zip(messages, out):
                if message.ledger and message.send:
                    self._fill_ledger(message, wire)
            return out

        if mode == "corrupt":
            exchange_module.Exchange._pack = corrupting  # type: ignore[method-assign]
        else:
            exchange_module.Exchange._bind = shortening  # type: ignore[method-assign]
    sources, destinations = _tensors(plan, rank)
    verify = "checksum" if mode == "corrupt" else "size"
    try:
        return timed_outcome(lambda: execute_refit(plan, sources, destinations, timeout=30, verify=verify))
    finally:
        if rank == 0:  # undone, as every patch in a kept world must be
            exchange_module.Exchange._pack, exchange_module.Exchange._bind = real_pack, real_bind  # type: ignore[method-assign]


def failing_with_two_in_flight(rank: int, world: int, timeout: float) -> dict[str, Any]:
    """At a small bucket (batches posted two at a time), destination rank 2 raises while unpacking its second
    batch, with its third already on the wire; then a good refit. Reports both outcomes, whether batches were
    posted ahead on this rank, and whether the second refit's destinations are right."""
    plan = _plan(world)
    bucket = 1 << 14
    real, unpacked, ahead = exchange_module.Exchange._receive, [0], [False]

    def unpacking(self: Any, message: Any, wire: torch.Tensor, staged: bool) -> None:
        ahead[0] = ahead[0] or any(slot.overlaps for slot in self.layout.slots)
        unpacked[0] += staged
        if rank == 2 and staged and unpacked[0] == 2:
            raise RuntimeError("injected failure unpacking with two batches in flight")
        real(self, message, wire, staged)

    exchange_module.Exchange._receive = unpacking  # type: ignore[method-assign]
    sources, destinations = _tensors(plan, rank)
    try:
        failed = timed_outcome(lambda: execute_refit(plan, sources, destinations, timeout=timeout, bucket_bytes=bucket))
    finally:
        exchange_module.Exchange._receive = real  # type: ignore[method-assign]
    stats: list[Any] = []
    after = timed_outcome(
        lambda: stats.append(execute_refit(plan, sources, destinations, timeout=timeout, bucket_bytes=bucket))
    )
    return {
        "failed": failed,
        "after": after,
        "correct": _correct(plan, rank, destinations),
        "ahead": ahead[0],
        "batches": stats[0].batches if stats else 0,
    }


def many_transfers(rank: int, world: int, tensors: int) -> dict[str, Any]:
    """A plan of ``tensors`` small tensors replicated on 8 source and 8 destination ranks: one transfer per
    tensor per destination rank, more than 100,000 in all, in batches of at most 256 ops."""
    manifest = Manifest(
        tuple(TensorSpec(f"t{i}", (4,), "float32", stage=("first",)) for i in range(tensors)), name="many"
    )
    plan = plan_refit(plan_layout(world, "dp=8 + dp=8"), 0, [1], manifest)
    sources, destinations = _tensors(plan, rank)
    stats = execute_refit(plan, sources, destinations, timeout=300, max_ops=256)
    mine = plan.for_rank(rank)
    return {
        "correct": _correct(plan, rank, destinations),
        "transfers": len(mine.recvs) + len(mine.copies),
        "batches": stats.batches,
        "messages": stats.messages,
        "peers": stats.peers,
    }


def replaced_world_rank(rank: int, world: int, ports: tuple[int, int], generation: int, results: Any) -> None:
    """One process of a world whose last rank dies in the middle of a refit and is replaced.

    Generation 1 joins the world on ``ports[0]``; its last rank dies inside the exchange, the others get a
    RefitPeerError naming it, and re-form the world on ``ports[1]``, where a new process (generation 2)
    takes the dead rank's place. There the refit with good inputs must succeed on every rank.
    """
    from datetime import timedelta

    import torch.distributed as dist

    torch.set_num_threads(1)
    port = ports[generation - 1]
    dist.init_process_group(
        "gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=60)
    )
    plan = _plan(world)
    sources, destinations = _tensors(plan, rank)
    first = ("replaced", "", (), 0.0)
    if generation == 1:
        if rank == world - 1:
            exchange_module.Exchange._issue = lambda self, messages, wires: os._exit(17)  # type: ignore[method-assign]
        first = timed_outcome(lambda: execute_refit(plan, sources, destinations, timeout=15))
        dist.destroy_process_group()
        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{ports[1]}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=60),
        )
    second = timed_outcome(lambda: execute_refit(plan, sources, destinations, timeout=30))
    results.put((rank, generation, first[:3], second[:3], _correct(plan, rank, destinations)))
    dist.destroy_process_group()


__all__ = [
    "SPEC",
    "disagreeing_plans",
    "failing_with_two_in_flight",
    "faulty_message",
    "many_transfers",
    "one_failure_each",
    "parameters",
    "replaced_world_rank",
]


def staging_that_cannot_be_allocated(rank: int, world: int, timeout: float) -> list[dict[str, Any]]:
    """Rank 2 (a destination that stages pieces) asks for more staging memory than any machine has: its
    allocation fails, it drains, every rank names it within the timeout, and the next refit is right."""
    plan = _plan(world)
    sources, destinations = _tensors(plan, rank)
    real = exchange_module.Exchange.staging_bytes
    steps = []
    for label in ("no staging", "good"):
        if rank == 2 and label == "no staging":
            exchange_module.Exchange.staging_bytes = lambda self: 1 << 60  # type: ignore[method-assign]
        kind, message, ranks, elapsed = timed_outcome(
            lambda: execute_refit(plan, sources, destinations, timeout=timeout)
        )
        exchange_module.Exchange.staging_bytes = real  # type: ignore[method-assign]
        steps.append({"label": label, "kind": kind, "message": message, "ranks": ranks, "elapsed": elapsed,
                      "correct": _correct(plan, rank, destinations)})  # fmt: skip
    return steps
