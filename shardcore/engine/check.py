"""The live side of ``shardcore check``: build a layout on a world, verify every group with a collective.

Two ways to get a world:

* ``run_local`` starts N local gloo processes itself (spawned, one pipe each). It owns them
  end to end: progress events stream back as they happen, a failing rank's error comes back
  as one line (never a launcher traceback), a dead rank is named with its exit code, and on
  Ctrl-C or any error every process is ended before the call returns.
* ``run_joined`` joins the world torchrun set up (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).
  Reports are gathered as byte tensors, so it needs no numpy (torch's ``all_gather_object``
  does on torch 2.13).

``prepare`` checks in the calling process what can be checked before any worker starts:
the timeout, the strategy, the backend (name, availability, options) and the layout against
the backend.
"""

from __future__ import annotations

import json
import os
import re
import signal
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from datetime import timedelta
from typing import Any

from ..errors import GroupCreationError, ShardcoreError
from ..plan.layout import DEFAULT_ORDER, Layout, plan_layout

STAGES = ("started", "joined", "imported", "built", "verified")
"""Progress events a rank sends, in order: its process runs (local mode only; importing torch
follows, the slow part of a big local world), joined the world (every rank must arrive),
imported the backend's framework, built its groups, verified them."""

OnEvent = Callable[[str, int, float], None]
"""Progress callback: (stage, rank, seconds since the check started)."""


@dataclass(frozen=True)
class CheckOptions:
    """What ``shardcore check`` builds: the arguments of ``build_shards``, picklable for workers."""

    shards: str
    backend: str | None = None
    order: str = DEFAULT_ORDER
    allow_idle: bool = False
    strategy: str = "auto"
    timeout: float = 120.0
    """Seconds a rank waits for the others (joining, agreeing, creating a group)."""
    backend_options: dict[str, Any] = field(default_factory=dict)


@dataclass(frozen=True)
class Prepared:
    """What the parent learned before starting anything: the layout and the backend actually used."""

    layout: Layout
    backend: str
    backend_source: str
    """Where the name came from: ``--backend``, ``$SHARDCORE_BACKEND`` or ``default``."""


@dataclass
class RankReport:
    """What one rank saw: its shard, how many groups it verified, its times, and anything wrong."""

    rank: int
    shard: int | None
    verified: int = 0
    import_seconds: float = 0.0
    """Importing the backend's framework (``Backend.load_framework``), apart from group creation."""
    build_seconds: float = 0.0
    verify_seconds: float = 0.0
    strategy: str = ""
    """The strategy ``auto`` resolved to on this rank, and why."""
    failures: list[str] = field(default_factory=list)


def prepare(options: CheckOptions, world_size: int) -> Prepared:
    """Check everything that needs no other process, before any worker starts.

    Args:
        options: the check's arguments.
        world_size: ranks in the world to be checked.

    Returns:
        The planned layout and the backend's name and where it came from.

    Raises:
        ShardcoreError: a subclass naming the bad timeout, strategy, backend, option or layout.
    """
    from .groups import as_timedelta, check_strategy_early
    from .plugins import BACKEND_ENV, get_backend
    from .shards import check_options

    as_timedelta(options.timeout)
    check_strategy_early(options.strategy)
    backend = get_backend(options.backend)
    source = "--backend" if options.backend else f"${BACKEND_ENV}" if os.environ.get(BACKEND_ENV) else "default"
    check_options(backend, options.backend_options)
    layout = plan_layout(world_size, options.shards, order=options.order, allow_idle=options.allow_idle)
    backend.validate(layout, options.backend_options)
    return Prepared(layout, backend.name, source)


def _verify(shard: Any, rank: int, device: str) -> tuple[int, list[str]]:
    """All-gather global ranks over each distinct group; the result must equal the planned members."""
    import torch
    import torch.distributed as dist

    from ..plan.layout import distinct_groups

    verified, failures = 0, []
    for ranks, names in distinct_groups(shard.group_ranks):
        group = shard.groups.get(names[0])
        if group is None:
            failures.append(f"rank {rank}: group {'/'.join(names)} {list(ranks)} was not created")
            continue
        out = [torch.empty(1, dtype=torch.int64, device=device) for _ in ranks]
        dist.all_gather(out, torch.tensor([rank], dtype=torch.int64, device=device), group=group)
        seen = tuple(int(t.item()) for t in out)
        if seen != ranks:
            failures.append(f"rank {rank}: group {'/'.join(names)} gathered {list(seen)}, planned {list(ranks)}")
        verified += 1
    return verified, failures


def _collective_device() -> str:
    """Where collective tensors live: cpu under gloo, else the accelerator."""
    import torch.distributed as dist

    from .device import device_type

    return "cpu" if str(dist.get_backend()) == "gloo" else device_type()


def check_rank(options: CheckOptions, on_stage: Callable[[str], None] = lambda stage: None) -> RankReport:
    """Run on one rank of an initialised world: import the framework, build, verify, destroy, sync.

    Args:
        options: the check's arguments, the same on every rank.
        on_stage: called with ``imported``, ``built`` and ``verified`` as each is done.

    Returns:
        This rank's report.
    """
    import torch.distributed as dist

    from .groups import choose_strategy
    from .plugins import get_backend
    from .shards import build_shards, destroy_shards, my_shard

    rank, world = dist.get_rank(), dist.get_world_size()
    backend = get_backend(options.backend)
    started = time.perf_counter()
    load = getattr(backend, "load_framework", None)
    if callable(load):
        load()
    imported = time.perf_counter()
    on_stage("imported")
    strategy, why = choose_strategy(options.strategy)
    shards = build_shards(
        world,
        options.shards,
        backend=options.backend,
        order=options.order,
        allow_idle=options.allow_idle,
        strategy=options.strategy,
        timeout=options.timeout,
        **options.backend_options,
    )
    built = time.perf_counter()
    on_stage("built")
    mine = my_shard(shards)
    report = RankReport(
        rank,
        None if mine is None else mine.index,
        import_seconds=imported - started,
        build_seconds=built - imported,
        strategy=f"{strategy}: {why}",
    )
    try:
        if mine is not None:
            report.verified, report.failures = _verify(mine, rank, _collective_device())
    finally:
        destroy_shards(shards)
    dist.barrier()
    report.verify_seconds = time.perf_counter() - built
    on_stage("verified")
    return report


def error_line(error: BaseException) -> str:
    """One line for an error: shardcore's own message as is, anything else with its type."""
    text = str(error).strip() or type(error).__name__
    return text if isinstance(error, ShardcoreError) else f"{type(error).__name__}: {text}"


_RANK_PREFIX = re.compile(r"^rank \d+: ")


def rank_ranges(ranks: list[int]) -> str:
    """Sorted ranks as runs: ``0-3, 6, 8-9``."""
    runs: list[list[int]] = []
    for rank in ranks:
        if runs and rank == runs[-1][1] + 1:
            runs[-1][1] = rank
        else:
            runs.append([rank, rank])
    return ", ".join(str(a) if a == b else f"{a}-{b}" for a, b in runs)


def distinct_errors(errors: dict[int, str]) -> list[str]:
    """Each distinct error once, prefixed by the ranks that hit it (a leading ``rank N:`` is not a difference)."""
    by_text: dict[str, list[int]] = {}
    for rank, text in sorted(errors.items()):
        by_text.setdefault(_RANK_PREFIX.sub("", text), []).append(rank)
    return [f"{'rank' if len(r) == 1 else 'ranks'} {rank_ranges(r)}: {text}" for text, r in by_text.items()]


# ----------------------------------------------------------------------------- local processes

GRACE_SECONDS = 5.0
"""After the first failure, how long the other ranks get to report their own errors."""


def _local_worker(rank: int, world: int, port: int, options: CheckOptions, conn: Any, started: float) -> None:
    """One spawned process: join the local gloo world, check, send events and the report over ``conn``."""
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world))

    def send(*message: Any) -> None:
        conn.send(message)

    try:
        send("started", rank, time.time() - started)
        import torch.distributed as dist

        dist.init_process_group(
            "gloo",
            init_method=f"tcp://127.0.0.1:{port}",
            rank=rank,
            world_size=world,
            timeout=timedelta(seconds=options.timeout),
        )
        send("joined", rank, time.time() - started)
        report = check_rank(options, lambda stage: send(stage, rank, time.time() - started))
        send("done", rank, asdict(report))
    except BaseException as error:  # the parent shows it as one line; a traceback would be noise
        send("failed", rank, error_line(error))
    finally:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


@contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Children started inside inherit a blocked SIGINT, so a terminal's Ctrl-C (sent to the whole
    process group) reaches only the parent, which ends them: no traceback from each child. A Ctrl-C
    meanwhile stays pending in the parent and arrives when the block ends."""
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def _end(processes: list[Any]) -> None:
    """End every process still running: SIGTERM, then SIGKILL after a moment."""
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + 3
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def run_local(nproc: int, options: CheckOptions, on_event: OnEvent | None = None) -> list[RankReport]:
    """Start ``nproc`` local gloo processes, stream their progress and collect their reports.

    Args:
        nproc: processes (ranks) to start.
        options: the check's arguments (``prepare`` them first).
        on_event: progress callback: (stage, rank, seconds since start) for each of ``STAGES``.

    Returns:
        Every rank's report, in rank order.

    Raises:
        GroupCreationError: a rank failed or died (each distinct error once), or no rank sent
            anything for ``timeout + 60`` seconds (naming the ranks still out).
        KeyboardInterrupt: passed on after every process has been ended.
    """
    import multiprocessing
    from multiprocessing.connection import wait

    from .ports import free_port

    context = multiprocessing.get_context("spawn")
    port, started = free_port(), time.time()
    processes: list[Any] = []
    readers: dict[Any, int] = {}
    try:
        with _sigint_blocked():
            for rank in range(nproc):
                reader, writer = context.Pipe(duplex=False)
                process = context.Process(
                    target=_local_worker, args=(rank, nproc, port, options, writer, started), daemon=True
                )
                process.start()
                writer.close()
                processes.append(process)
                readers[reader] = rank
        reports: dict[int, RankReport] = {}
        errors: dict[int, str] = {}
        silence, last_news, give_up = options.timeout + 60, time.monotonic(), None
        while len(reports) + len(errors) < nproc and (give_up is None or time.monotonic() < give_up):
            ready: Any  # wait returns some of the readers it was given
            for ready in wait(list(readers), timeout=0.2):
                rank = readers[ready]
                try:
                    message = ready.recv()
                except EOFError:  # the process ended; its exit code says how
                    del readers[ready]
                    if rank not in reports and rank not in errors:
                        processes[rank].join(1)
                        errors[rank] = f"rank {rank} died (exit code {processes[rank].exitcode})"
                    continue
                last_news = time.monotonic()
                kind, _, payload = message
                if kind == "done":
                    reports[rank] = RankReport(**payload)
                elif kind == "failed":
                    errors[rank] = payload
                elif on_event is not None:
                    on_event(kind, rank, payload)
            if errors and give_up is None:
                give_up = time.monotonic() + GRACE_SECONDS
            if time.monotonic() - last_news > silence:
                out = [rank for rank in range(nproc) if rank not in reports and rank not in errors]
                raise GroupCreationError(
                    f"ranks {rank_ranges(out)} sent nothing for {silence:.0f}s (timeout {options.timeout:g}s + 60s)"
                )
        if errors:
            raise GroupCreationError("shardcore check failed:\n" + "\n".join(distinct_errors(errors)))
        return [reports[rank] for rank in sorted(reports)]
    finally:
        _end(processes)


# ----------------------------------------------------------------------------- torchrun


def _init_from_env() -> None:
    """Join torchrun's world on this process's device (``LOCAL_RANK``), without binding the default group."""
    import torch
    import torch.distributed as dist

    from .device import comm_backend, device_type

    device = device_type()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    elif device == "npu":
        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]  # registered by torch_npu
    dist.init_process_group(backend=os.environ.get("SHARDCORE_COMM_BACKEND") or comm_backend(device))


def gather_reports(report: RankReport) -> list[RankReport] | None:
    """Every rank's report on rank 0 (None elsewhere), sent as UTF-8 bytes in tensors: no numpy needed.

    Lengths are all-gathered first, then every payload padded to the longest.
    """
    import torch
    import torch.distributed as dist

    device, world = _collective_device(), dist.get_world_size()
    data = json.dumps(asdict(report)).encode()
    length = torch.tensor([len(data)], dtype=torch.int64, device=device)
    lengths = [torch.empty_like(length) for _ in range(world)]
    dist.all_gather(lengths, length)
    longest = max(int(t.item()) for t in lengths)
    payload = torch.zeros(longest, dtype=torch.uint8)
    payload[: len(data)] = torch.frombuffer(bytearray(data), dtype=torch.uint8)
    payload = payload.to(device)
    payloads = [torch.empty_like(payload) for _ in range(world)]
    dist.all_gather(payloads, payload)
    if dist.get_rank() != 0:
        return None
    return [
        RankReport(**json.loads(bytes(p[: int(n.item())].cpu().tolist()).decode())) for p, n in zip(payloads, lengths)
    ]


def run_joined(options: CheckOptions, on_event: OnEvent | None = None) -> list[RankReport] | None:
    """Join the world torchrun set up; rank 0 gets every report, the others None.

    Args:
        options: the check's arguments, the same on every rank.
        on_event: progress callback, called on every rank for this rank's own stages.

    Raises:
        ShardcoreError: building or verifying failed on this rank.
    """
    import torch.distributed as dist

    started = time.time()
    _init_from_env()
    rank = dist.get_rank()
    emit = on_event or (lambda stage, rank, seconds: None)
    try:
        emit("joined", rank, time.time() - started)
        report = check_rank(options, lambda stage: emit(stage, rank, time.time() - started))
        return gather_reports(report)
    finally:
        dist.destroy_process_group()


__all__ = [
    "STAGES",
    "CheckOptions",
    "Prepared",
    "RankReport",
    "check_rank",
    "distinct_errors",
    "error_line",
    "gather_reports",
    "prepare",
    "rank_ranges",
    "run_joined",
    "run_local",
]
