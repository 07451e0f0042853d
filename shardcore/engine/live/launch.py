"""Worlds for live checks: N local gloo processes, or the world torchrun set up.

A *job* is a module-level function ``job(options, on_stage) -> report`` run on every rank of
an initialised world (``on_stage(name)`` reports progress); ``shardcore check`` and
``shardcore refit --check`` are two jobs.

* ``run_local_job`` starts N local gloo processes itself (spawned, one pipe each). It owns
  them end to end: progress events stream back as they happen, a failing rank's error comes
  back as one line (never a launcher traceback), a dead rank is named with its exit code or the
  signal that killed it and the memory it held (unless it said ``LEAVING`` first: a rank an elastic
  check loses on purpose), the ranks' resident memory is sampled for progress lines, and on
  Ctrl-C or any error every process is ended before the call returns.
* A local rank starts and ends one way (``start_local_process``, ``join_local_world``, ``leave_world``,
  ``end_processes``): ``run_local_job`` and the test worlds of ``shardcore.testing`` are built on them.
* ``run_joined_job`` joins the world torchrun set up (``RANK``, ``WORLD_SIZE``, ``LOCAL_RANK``).
  Reports travel as pickled bytes in tensors (``all_gather_objects``), so no numpy is needed
  (torch's ``all_gather_object`` needs it on torch 2.13).
"""

from __future__ import annotations

import os
import re
import signal
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from datetime import timedelta
from typing import Any

from ...errors import GroupCreationError, ShardcoreError
from ...plan.arguments import format_bytes, shown_ranks
from ..collectives import all_gather_objects
from ..torch_state import check_torch_imports, import_torch
from .shrinkable import SHRINKABLE_GLOO, register_shrinkable_gloo

OnEvent = Callable[[str, int, float], None]
"""Progress callback: (stage, rank, seconds since the job started)."""
OnHeld = Callable[[dict[int, int], float], None]
"""Memory callback: (resident bytes of each running rank, seconds since the job started)."""
Job = Callable[[Any, Callable[[str], None]], Any]
"""A function run on every rank: (options, on_stage) -> a picklable report."""

LEAVING = "leaving"
"""The stage a rank reports before its process ends on purpose (a rank an elastic check loses): no error, no report."""
LIVE_CHECK_TIMEOUT = 120.0
"""Seconds a rank of a live check (``shardcore check``, ``refit --check``) waits for the others by default:
shorter than a library call's (``plan.arguments.DEFAULT_TIMEOUT``), since a person is waiting."""
GRACE_SECONDS = 5.0
"""After the first failure, how long the other ranks get to report their own errors."""
SILENCE_SECONDS = 60.0
"""Beyond the job's timeout, how long no rank may send anything before the ranks still out are named."""
SAMPLE_SECONDS = 1.0
"""How often the parent reads each local rank's resident memory: for ``on_held``, and to say what a rank
killed by a signal held."""


def error_line(error: BaseException) -> str:
    """One line for an error: shardcore's own message as is, anything else with its type."""
    text = str(error).strip() or type(error).__name__
    return text if isinstance(error, ShardcoreError) else f"{type(error).__name__}: {text}"


_RANK_PREFIX = re.compile(r"^rank \d+: ")


def distinct_errors(errors: dict[int, str]) -> list[str]:
    """Each distinct error once, prefixed by the ranks that hit it (a leading ``rank N:`` is not a difference)."""
    by_text: dict[str, list[int]] = {}
    for rank, text in sorted(errors.items()):
        by_text.setdefault(_RANK_PREFIX.sub("", text), []).append(rank)
    return [f"rank {r[0]}: {text}" if len(r) == 1 else f"ranks {shown_ranks(r)}: {text}" for text, r in by_text.items()]


# ----------------------------------------------------------------------------- local processes


def join_local_world(rank: int, world: int, port: int, backend: str, timeout: float) -> None:
    """Join a local world of ``world`` processes on 127.0.0.1 as ``rank``: the one way a local rank starts, for
    ``run_local_job`` and for the test worlds (``shardcore.testing``). Sets the variables torchrun would set,
    so that code reading them (a strategy, a plugin) sees a local rank as it sees a torchrun one.

    Args:
        rank: this process's rank.
        world: the world size.
        port: the store's port on 127.0.0.1 (rank 0 serves it).
        backend: ``gloo``, or ``SHRINKABLE_GLOO`` (gloo that can shrink).
        timeout: the default group's timeout, in seconds.
    """
    os.environ.update(
        MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
        RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
    )  # fmt: skip
    torch = import_torch()
    import torch.distributed as dist

    torch.set_num_threads(1)  # as torchrun does: many ranks share few cores, extra threads only contend
    if backend == SHRINKABLE_GLOO:
        register_shrinkable_gloo()
    dist.init_process_group(
        backend, init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world, timeout=timedelta(seconds=timeout)
    )


def leave_world() -> None:
    """Destroy the default process group, if there is one (and never import a torch that failed to import)."""
    if "torch" in sys.modules:
        import torch.distributed as dist

        if dist.is_initialized():
            dist.destroy_process_group()


def _local_worker(
    job: Job, rank: int, world: int, port: int, options: Any, timeout: float, started: float, backend: str, conn: Any
) -> None:
    """One spawned process: join the local gloo world, run the job, send events and the report over ``conn``."""

    def send(*message: Any) -> None:
        conn.send(message)

    try:
        send("started", rank, time.time() - started)
        join_local_world(rank, world, port, backend, timeout)
        send("joined", rank, time.time() - started)
        report = job(options, lambda stage: send(stage, rank, time.time() - started))
        send("done", rank, report)
    except BaseException as error:  # the parent shows it as one line; a traceback would be noise
        send("failed", rank, error_line(error))
    finally:
        leave_world()
        conn.close()


@contextmanager
def _sigint_blocked() -> Iterator[None]:
    """Children started inside inherit a blocked SIGINT, so a terminal's Ctrl-C (sent to the whole
    process group) reaches only the parent, which ends them: no traceback from each child. A Ctrl-C
    meanwhile stays pending in the parent and arrives when the block ends.

    multiprocessing's resource tracker is started first: the first spawned process starts it, and starting
    it *unblocks* SIGINT when done (CPython's ``resource_tracker.ensure_running``). Inside the block that let
    a Ctrl-C land between a worker's start and its record, and the worker, never ended, outlived the
    command holding its stderr; the workers started after it did not block SIGINT either."""
    from multiprocessing import resource_tracker

    resource_tracker.ensure_running()
    signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGINT})
    try:
        yield
    finally:
        signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGINT})


def start_local_process(context: Any, target: Callable[..., None], args: tuple[Any, ...]) -> tuple[Any, Any]:
    """Start a daemon process of the ``spawn`` ``context`` running ``target(*args, conn)``; returns the process and
    the parent's end of a pipe to it. The parent's copy of the child's end is closed, so that the parent's end
    reads EOF once the process has ended (how a death is seen)."""
    parent, child = context.Pipe()
    process = context.Process(target=target, args=(*args, child), daemon=True)
    process.start()
    child.close()
    return process, parent


def end_processes(processes: Sequence[Any], grace: float = 0.0) -> None:
    """End every process still running: each gets ``grace`` seconds (all together) to end on its own, then
    SIGTERM, then SIGKILL after a moment."""
    deadline = time.monotonic() + grace
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
    for process in processes:
        if process.is_alive():
            process.terminate()
    deadline = time.monotonic() + 3
    for process in processes:
        process.join(max(0.0, deadline - time.monotonic()))
        if process.is_alive():
            process.kill()
            process.join()


def run_local_job(
    nproc: int,
    job: Job,
    options: Any,
    timeout: float,
    on_event: OnEvent | None = None,
    backend: str = "gloo",
    on_held: OnHeld | None = None,
) -> list[Any]:
    """Start ``nproc`` local gloo processes running ``job``, stream their progress, collect their reports.

    Args:
        nproc: processes (ranks) to start.
        job: a module-level function ``(options, on_stage) -> report``.
        options: the job's arguments (picklable), the same on every rank.
        timeout: seconds a rank waits for the others; the default group's timeout.
        on_event: progress callback: (stage, rank, seconds since start) for ``started``, ``joined``
            and each stage the job reports.
        backend: the world's backend: ``gloo``, or ``SHRINKABLE_GLOO`` (gloo that can shrink).
        on_held: memory callback, every SAMPLE_SECONDS: each running rank's resident bytes (Linux only), so
            that a long transfer shows it is alive and what it holds.

    Returns:
        Every rank's report, in rank order (None for a rank that reported ``LEAVING`` and ended).

    Raises:
        BackendUnavailableError: torch would not import in the workers (``check_torch_imports``).
        GroupCreationError: a rank failed or died (each distinct error once; one killed by a signal is named
            so, with the memory it was last seen to hold: SIGKILL is most often the out-of-memory killer), or
            no rank sent anything for ``timeout + SILENCE_SECONDS`` (naming the ranks still out).
        KeyboardInterrupt: passed on after every process has been ended.
    """
    import multiprocessing
    from multiprocessing.connection import wait

    from .ports import free_port

    check_torch_imports()
    context = multiprocessing.get_context("spawn")
    port, started = free_port(), time.time()
    processes: list[Any] = []
    try:
        with _sigint_blocked():
            readers = _start_workers(context, processes, nproc, (job, options, timeout, port, started, backend))
        gathering = _Gathering(nproc, processes, readers, timeout, on_event)
        resident = _Resident(processes, started, on_held)
        while gathering.waiting():
            ready: Any  # wait returns some of the readers it was given
            for ready in wait(list(readers), timeout=0.2):
                gathering.read(ready, resident.most)
            gathering.check_progress()
            resident.sample()
        return gathering.reports_in_rank_order()
    finally:
        end_processes(processes)


def _start_workers(
    context: Any, processes: list[Any], nproc: int, work: tuple[Job, Any, float, int, float, str]
) -> dict[Any, int]:
    """Start a spawned process per rank running ``_local_worker`` on ``work`` (job, options, timeout,
    port, start time, backend), each with a pipe back; returns each pipe's reading end with its rank.

    Each process joins ``processes`` as it starts, so that the caller ends those already running when
    a later one fails to start.
    """
    job, options, timeout, port, started, backend = work
    readers: dict[Any, int] = {}
    for rank in range(nproc):
        process, reader = start_local_process(
            context, _local_worker, (job, rank, nproc, port, options, timeout, started, backend)
        )
        processes.append(process)
        readers[reader] = rank
    return readers


class _Resident:
    """The resident memory of each local rank, read from ``/proc`` every SAMPLE_SECONDS (none where there is no
    ``/proc``): the most each rank was seen to hold, and what the running ones hold now for ``on_held``."""

    def __init__(self, processes: list[Any], started: float, on_held: OnHeld | None) -> None:
        self.processes, self.started, self.on_held = processes, started, on_held
        self.most: dict[int, int] = {}
        self.last = 0.0
        self.page = os.sysconf("SC_PAGE_SIZE") if hasattr(os, "sysconf") else 4096

    def sample(self) -> None:
        """Read every running rank's resident bytes, when SAMPLE_SECONDS have passed since the last time."""
        now = time.monotonic()
        if now - self.last < SAMPLE_SECONDS:
            return
        self.last = now
        held: dict[int, int] = {}
        for rank, process in enumerate(self.processes):
            try:
                with open(f"/proc/{process.pid}/statm", encoding="ascii") as file:
                    held[rank] = int(file.read().split()[1]) * self.page
            except (OSError, ValueError, IndexError):  # ended, or no /proc here
                continue
            self.most[rank] = max(self.most.get(rank, 0), held[rank])
        if held and self.on_held is not None:
            self.on_held(held, time.time() - self.started)


def death(rank: int, exitcode: int | None, held: int | None) -> str:
    """Why a rank's process ended without a word: killed by a signal (SIGKILL, with no error of its own, is
    most often the kernel's out-of-memory killer; ``held``: the resident bytes it was last seen with), or its
    exit code."""
    if exitcode is None or exitcode >= 0:
        return f"rank {rank} died (exit code {exitcode})"
    try:
        name = signal.Signals(-exitcode).name
    except ValueError:
        name = f"signal {-exitcode}"
    memory = "" if not held else f"; it held ~{format_bytes(held)}"
    likely = ": likely out of memory" if -exitcode == signal.SIGKILL else ""
    return f"rank {rank} killed by {name}{likely}{memory}"


class _Gathering:
    """What the local ranks have sent so far (reports, errors, who said ``LEAVING``) and when they last
    sent anything: ``run_local_job`` reads every pipe into it until each rank is accounted for, the
    grace after the first failure is over, or the ranks fall silent.
    """

    def __init__(
        self, nproc: int, processes: list[Any], readers: dict[Any, int], timeout: float, on_event: OnEvent | None
    ) -> None:
        self.nproc, self.processes, self.readers = nproc, processes, readers
        self.timeout, self.on_event = timeout, on_event
        self.reports: dict[int, Any] = {}
        self.errors: dict[int, str] = {}
        self.leaving: set[int] = set()
        self.silence, self.last_news = timeout + SILENCE_SECONDS, time.monotonic()
        self.give_up: float | None = None

    def waiting(self) -> bool:
        """Some rank has neither reported nor failed, and the grace after a failure (if any) is not over."""
        accounted = len(self.reports) + len(self.errors)
        return accounted < self.nproc and (self.give_up is None or time.monotonic() < self.give_up)

    def read(self, ready: Any, held: dict[int, int]) -> None:
        """Take one message from the pipe ``ready``, or its EOF once the process has ended (``held``: the most
        each rank was seen to hold, for a death's message)."""
        rank = self.readers[ready]
        try:
            message = ready.recv()
        except EOFError:  # the process ended; its exit code says how
            del self.readers[ready]
            self._ended(rank, held.get(rank))
            return
        self.last_news = time.monotonic()
        kind, _, payload = message
        if kind == "done":
            self.reports[rank] = payload
        elif kind == "failed":
            self.errors[rank] = payload
        else:
            if kind == LEAVING:
                self.leaving.add(rank)
            if self.on_event is not None:
                self.on_event(kind, rank, payload)

    def _ended(self, rank: int, held: int | None) -> None:
        """A rank's process ended: no report when it said it was leaving, a death when it said neither
        its report nor its error first."""
        if rank in self.leaving:
            self.reports.setdefault(rank, None)
        elif rank not in self.reports and rank not in self.errors:
            self.processes[rank].join(1)
            self.errors[rank] = death(rank, self.processes[rank].exitcode, held)

    def check_progress(self) -> None:
        """Start the grace at the first failure; raise when no rank has sent anything for too long.

        Raises:
            GroupCreationError: nothing for ``timeout + SILENCE_SECONDS`` (naming the ranks still out).
        """
        if self.errors and self.give_up is None:
            self.give_up = time.monotonic() + GRACE_SECONDS
        if time.monotonic() - self.last_news > self.silence:
            out = [rank for rank in range(self.nproc) if rank not in self.reports and rank not in self.errors]
            raise GroupCreationError(
                f"ranks {shown_ranks(out)} sent nothing for {self.silence:.0f}s "
                f"(timeout {self.timeout:g}s + {SILENCE_SECONDS:g}s)"
            )

    def reports_in_rank_order(self) -> list[Any]:
        """Every rank's report, in rank order.

        Raises:
            GroupCreationError: some rank failed or died (each distinct error once).
        """
        if self.errors:
            raise GroupCreationError("shardcore check failed:\n" + "\n".join(distinct_errors(self.errors)))
        return [self.reports[rank] for rank in sorted(self.reports)]


# ----------------------------------------------------------------------------- torchrun


def init_from_env() -> None:
    """Join torchrun's world on this process's device (``LOCAL_RANK``), without binding the default group."""
    import torch
    import torch.distributed as dist

    from ..device import comm_backend, device_type

    device = device_type()
    local_rank = int(os.environ.get("LOCAL_RANK", "0"))
    if device == "cuda":
        torch.cuda.set_device(local_rank)
    elif device == "npu":
        torch.npu.set_device(local_rank)  # type: ignore[attr-defined]  # registered by torch_npu
    dist.init_process_group(backend=os.environ.get("SHARDCORE_COMM_BACKEND") or comm_backend(device))


def run_joined_job(job: Job, options: Any, on_event: OnEvent | None = None) -> list[Any] | None:
    """Run ``job`` on the world torchrun set up; rank 0 gets every report, the others None.

    Args:
        job: a module-level function ``(options, on_stage) -> report``.
        options: the job's arguments, the same on every rank.
        on_event: progress callback, called on every rank for this rank's own stages.

    Raises:
        ShardcoreError: the job failed on this rank (``BackendUnavailableError``: torch does not import).
    """
    import_torch()
    import torch.distributed as dist

    started = time.time()
    init_from_env()
    rank = dist.get_rank()
    emit = on_event or (lambda stage, rank, seconds: None)
    try:
        emit("joined", rank, time.time() - started)
        report = job(options, lambda stage: emit(stage, rank, time.time() - started))
        reports = all_gather_objects(report)
        return reports if rank == 0 else None
    finally:
        dist.destroy_process_group()


__all__ = [
    "LEAVING",
    "LIVE_CHECK_TIMEOUT",
    "Job",
    "OnEvent",
    "OnHeld",
    "death",
    "distinct_errors",
    "end_processes",
    "error_line",
    "init_from_env",
    "join_local_world",
    "leave_world",
    "run_joined_job",
    "run_local_job",
    "start_local_process",
]
