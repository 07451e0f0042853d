"""A real local gloo world for tests of shardcore and its plugins (spawned processes on 127.0.0.1).

``run_world(4, fn, arg)`` runs ``fn(rank, world_size, arg)`` on every rank after
``init_process_group("gloo")`` and returns the results in rank order. ``fn`` must be a
module-level function (it is pickled into spawned processes). A rank that raises, or a
world that outlives ``timeout``, fails the call with a message naming the ranks.
``backend=SHRINKABLE_GLOO`` starts the world on gloo that can shrink instead (a stand-in for
NCCL's communicator shrink, so that ``torch.distributed.shrink_group`` runs on CPU).
``run_jobs([(4, trainer, args), (4, engine, args)])`` runs several such worlds at once, each a job
with a store of its own (a trainer and an inference engine, say), and returns each job's results.

Each call gets a process group of its own (a new store on a new port, destroyed after ``fn``),
but starting processes and importing torch costs seconds per rank: inside ``kept_worlds()``
(a test session, say) the processes that served one call serve the next, whatever its world
size, with its environment variables as they were before the call. A process is kept only after
a call in which every rank returned and that left shardcore's code as it found it and the default
group its own (not a survivors' world formed in the call, whose store another world must not meet); after a failure,
a death, a timeout or ``allow_failures`` its world's processes are ended and the next call starts
new ones. A new process joins a call only once it has imported torch, as the kept ones have.

A rank's process starts, joins its world, leaves it and is ended as a live check's local rank is
(``engine.live.launch``: one launcher); this module adds what tests need on top: processes kept between
calls, several jobs at once, patched code named, and a failed rank's whole traceback.
"""

from __future__ import annotations

import os
import pkgutil
import sys
import time
import traceback
import warnings
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager, suppress
from multiprocessing.connection import Connection, wait
from typing import Any

from .engine.live.launch import end_processes, join_local_world, leave_world, start_local_process
from .engine.live.ports import free_port
from .engine.live.shrinkable import SHRINKABLE_GLOO
from .engine.torch_state import import_torch
from .errors import WorldError

_FINISH_SECONDS = 10.0
"""How long a rank that returned may take to destroy its process group before its process is ended."""
_REFORMED = "the default process group (a new world was formed in the call)"
"""What a call that replaced the default group left replaced: its process cannot serve another world cleanly."""


def _code_of_shardcore() -> dict[str, int]:
    """Every function and class bound in a loaded shardcore module or class, by name: what a test that
    patches code (a failure injected into the exchange, say) changes and must undo."""
    bound = {}
    for module_name, module in list(sys.modules.items()):
        if not module_name.startswith("shardcore") or module is None:
            continue
        for name, value in vars(module).items():
            if callable(value):
                bound[f"{module_name}.{name}"] = id(value)
                if isinstance(value, type) and value.__module__ == module_name:
                    for attribute, member in vars(value).items():
                        if callable(member) or isinstance(member, (staticmethod, classmethod, property)):
                            bound[f"{module_name}.{name}.{attribute}"] = id(member)
    return bound


def _run_rank(job: tuple, conn: Connection, baseline: dict[str, int]) -> None:
    """One call's part on this rank: join its process group, run ``fn``, send the outcome with the names of
    shardcore's functions and classes it left replaced, leave the group and say so."""
    rank, world_size, port, fn, args, pg_timeout, backend = job
    environment = dict(os.environ)  # restored after the call: a variable it sets must not reach the next
    import torch.distributed as dist

    ours = None
    try:
        join_local_world(rank, world_size, port, backend, pg_timeout)
        ours = dist.group.WORLD
        ok, value = True, fn(rank, world_size, *args)
    except BaseException:
        ok, value = False, traceback.format_exc()
    now = _code_of_shardcore()
    replaced = sorted(name for name, bound in baseline.items() if now.get(name) != bound)
    if dist.is_initialized() and dist.group.WORLD is not ours:
        replaced.append(_REFORMED)  # a survivors' world: its store and store thread are not this call's to keep
    try:
        conn.send((ok, value, replaced))
    except Exception:  # a result that does not pickle
        conn.send((False, traceback.format_exc(), replaced))
    finally:
        leave_world()
        os.environ.clear()
        os.environ.update(environment)
    conn.send("left")


def _serve(conn: Connection) -> None:
    """A rank's process: run each job that arrives until told to stop."""
    import_torch()
    import shardcore

    for module in pkgutil.walk_packages(shardcore.__path__, "shardcore."):
        if not module.name.endswith("__main__"):
            __import__(module.name)  # every module loaded now, so that a patch to any of them is seen
    baseline = _code_of_shardcore()
    conn.send("ready")
    while (job := conn.recv()) is not None:
        _run_rank(job, conn, baseline)


class _Ranks:
    """The kept processes, by position: a world of N ranks runs on the first N."""

    def __init__(self) -> None:
        self.procs: list[Any] = []
        self.conns: list[Connection] = []

    def take(self, world_size: int, deadline: float) -> tuple[list[Any], list[Connection]]:
        """The first ``world_size`` processes, alive and ready for a job (so that no rank of a call waits for
        another's torch import); new ones started where one is missing or dead.

        Raises:
            WorldError: a new process died or was not ready by ``deadline`` (its process is ended).
        """
        import torch.multiprocessing as mp

        context = mp.get_context("spawn")
        started = []
        for index in range(world_size):
            if index < len(self.procs) and self.procs[index].is_alive():
                continue
            proc, parent = start_local_process(context, _serve, ())
            if index < len(self.procs):
                self.procs[index], self.conns[index] = proc, parent
            else:
                self.procs.append(proc)
                self.conns.append(parent)
            started.append(index)
        waiting, died = [self.conns[index] for index in started], []
        while waiting and (ready := _ready(waiting, deadline - time.monotonic())):
            for conn in ready:
                waiting.remove(conn)
                try:
                    conn.recv()  # "ready"
                except EOFError:
                    died.append(conn)
        if waiting or died:
            late = sorted(self.conns.index(conn) for conn in waiting + died)
            self.end(world_size)
            raise WorldError(f"ranks {late} of a {world_size}-rank world did not start (died, or not by the timeout)")
        return self.procs[:world_size], self.conns[:world_size]

    def end(self, count: int, grace: float = 0.0) -> None:
        """End the first ``count`` processes (asked to stop, then ended after ``grace`` seconds)."""
        for conn in self.conns[:count]:
            with suppress(OSError):  # one that died has closed its end
                conn.send(None)
        end_processes(self.procs[:count], grace)
        for conn in self.conns[:count]:
            conn.close()
        del self.procs[:count], self.conns[:count]


_kept: _Ranks | None = None


@contextmanager
def kept_worlds() -> Iterator[None]:
    """Inside, ``run_world`` keeps its processes for the next call (killed on leaving: they are idle)."""
    global _kept
    outer, _kept = _kept, _Ranks()
    try:
        yield
    finally:
        _kept.end(len(_kept.procs))
        _kept = outer


def run_world(
    world_size: int,
    fn: Callable[..., Any],
    *args: Any,
    timeout: float = 180.0,
    pg_timeout: float = 60.0,
    allow_failures: bool = False,
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn`` on a new local gloo world (processes kept inside ``kept_worlds()``); with
    ``allow_failures`` a failed rank yields its traceback and a dead one ``"died (exit code N)"``;
    ``backend``: ``gloo`` or ``SHRINKABLE_GLOO``."""
    return run_jobs(
        [(world_size, fn, args)], timeout=timeout, pg_timeout=pg_timeout, allow_failures=allow_failures, backend=backend
    )[0]


def run_jobs(
    jobs: Sequence[tuple[int, Callable[..., Any], tuple[Any, ...]]],
    *,
    timeout: float = 180.0,
    pg_timeout: float = 60.0,
    allow_failures: bool = False,
    backend: str = "gloo",
) -> list[list[Any]]:
    """Run several jobs at once, each ``(world_size, fn, args)`` on a world of its own (its own store and port),
    as ``run_world`` runs one; returns each job's results in rank order. A job's ``fn`` sees its own rank and
    world size; the jobs meet only where ``fn`` makes them (a refit group across jobs, say)."""
    ranks = _kept if _kept is not None else _Ranks()
    deadline = time.monotonic() + timeout
    total = sum(size for size, _, _ in jobs)
    procs, conns = ranks.take(total, deadline)
    owners = [(job, rank) for job, (size, _, _) in enumerate(jobs) for rank in range(size)]
    ports = [free_port() for _ in jobs]
    outcome: dict[int, tuple[bool, Any]] = {}
    replaced: set[str] = set()
    keep = False
    try:
        for conn, (job, rank) in zip(conns, owners):
            size, fn, args = jobs[job]
            conn.send((rank, size, ports[job], fn, args, pg_timeout, backend))
        _collect(procs, conns, outcome, replaced, deadline, timeout, allow_failures)
        keep = ranks is _kept and not allow_failures and all(ok for ok, _ in outcome.values())
        patched = replaced - {_REFORMED}  # code a test replaced and did not put back: worth a warning
        if keep and patched:
            names = ", ".join(sorted(patched))
            warnings.warn(f"a world's call left {names} replaced: its processes are ended", stacklevel=2)
        keep = keep and not replaced and _left(conns)
    finally:
        if not keep:
            ranks.end(total, grace=max(0.1, min(_FINISH_SECONDS, deadline - time.monotonic())))
    failed = {index: value for index, (ok, value) in outcome.items() if not ok}
    if failed and not allow_failures:
        first = min(failed)
        job, rank = owners[first]
        where = f"rank {rank}" if len(jobs) == 1 else f"job {job} rank {rank}"
        shown = (
            sorted(failed) if len(jobs) == 1 else [f"job {owners[i][0]} rank {owners[i][1]}" for i in sorted(failed)]
        )
        raise WorldError(f"ranks {shown} failed; {where}:\n{failed[first]}")
    results: list[list[Any]] = [[] for _ in jobs]
    for index, (job, _) in enumerate(owners):
        results[job].append(outcome[index][1])
    return results


def outcomes(calls: Mapping[str, Callable[[], object]], expected: type[BaseException] = Exception) -> dict[str, str]:
    """Each call's outcome by name, ``"no error"`` or ``"TypeName: message"``: how a rank reports a table of
    bad calls (one that must fail, one that must not) back to the test as picklable text."""
    out = {}
    for name, call in calls.items():
        try:
            call()
            out[name] = "no error"
        except expected as error:
            out[name] = f"{type(error).__name__}: {error}"
    return out


def _left(conns: list[Connection]) -> bool:
    """Whether every rank left its process group within ``_FINISH_SECONDS``."""
    finish = time.monotonic() + _FINISH_SECONDS
    waiting = list(conns)
    while waiting and (ready := _ready(waiting, finish - time.monotonic())):
        for conn in ready:
            try:
                conn.recv()
            except EOFError:
                return False
            waiting.remove(conn)
    return not waiting


def _ready(conns: list[Connection], timeout: float) -> list[Connection]:
    """Those of ``conns`` with something to read, or closed by their process, within ``timeout`` seconds."""
    ready = wait(conns, max(0.0, timeout))
    return [conn for conn in conns if conn in ready]


def _collect(
    procs: list[Any],
    conns: list[Connection],
    outcome: dict[int, tuple[bool, Any]],
    replaced: set[str],
    deadline: float,
    timeout: float,
    allow_failures: bool,
) -> None:
    """Each process's ``(ok, value)`` into ``outcome`` (by its position in ``procs``) as it arrives, and the names
    of what it left replaced into ``replaced``; a process that ends first is dead.

    Raises:
        WorldError: ranks did not finish within ``timeout``, or died (unless ``allow_failures``).
    """
    world_size = len(procs)
    while len(outcome) < world_size:
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            late = sorted(set(range(world_size)) - set(outcome))
            raise WorldError(f"ranks {late} of a {world_size}-rank world did not finish within {timeout:g}s")
        waiting = [conn for rank, conn in enumerate(conns) if rank not in outcome]
        dead = []
        for conn in _ready(waiting, min(remaining, 1.0)):
            try:
                ok, value, left_replaced = conn.recv()
            except EOFError:
                dead.append(conns.index(conn))
                continue
            outcome[conns.index(conn)] = (ok, value)
            replaced.update(left_replaced)
        for rank in dead:
            procs[rank].join(timeout=5.0)
        if dead and not allow_failures:
            raise WorldError(f"ranks {dead} died (exit codes {[procs[r].exitcode for r in dead]})")
        outcome.update({rank: (False, f"died (exit code {procs[rank].exitcode})") for rank in dead})


__all__ = ["SHRINKABLE_GLOO", "kept_worlds", "outcomes", "run_jobs", "run_world"]
