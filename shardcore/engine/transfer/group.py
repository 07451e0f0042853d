"""A refit group between two jobs: a trainer's torch.distributed world and an inference engine's world.

An engine (vLLM, SGLang) starts its workers itself, with a world of their own, so a refit into it cannot run on
the trainer's default group. ``connect_refit`` forms a group of its own over both jobs' processes from a store
both reach (a TCPStore ``host:port``, served by the trainer's rank 0 unless told otherwise, or any store the
caller has), touching neither job's default group: the trainer keeps training on its world, the engine keeps
serving on its own. ``execute_refit(..., group=...)`` then runs the whole refit over it, with the same trust as
within one world: the agreement, the epochs, failure publication, checks and versions all live on the group's
store, in the group's numbering.

**Numbering.** The trainer's ranks come first: trainer rank ``r`` is group rank ``r``, engine rank ``r`` is group
rank ``trainer_ranks + r``. A plan for the group is made over ``trainer_ranks + engine_ranks`` ranks with the
trainer's shard first (``RefitRequest("...", "tp=2,pp=2,role=train + tp=2,dp=2", 0, (1,)).plan(group.size)``).

**Joining.** Both jobs join a *round* on the store, an admission of the agreement module (``agreement.admit``):
each process claims its group rank, naming its (side, rank) and process, and brings the counts and backend it
was given. The round completes when every rank of both jobs has claimed; it fails at once, on every rank in it,
when a process brings other counts or another backend than the first (naming both), and a process that claims a
(side, rank) someone else holds in the round is told so at once (a job started twice). Anyone left waiting at
the timeout names the ranks that never came. A completed round is the group's *generation*: its process group
and its agreement live under keys of their own, so a restarted engine and the trainer, connecting again, meet
afresh, and the restarted engine's held version is None (a full refit).

**One group per engine.** A second engine connects under another ``name``: its group is another, and a refit
into it leaves the first engine's weights as they are.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import socket
import threading
import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, ClassVar, Literal

from ...errors import RefitGroupError, RefitInputError
from ...plan.arguments import DEFAULT_TIMEOUT, as_timedelta, shown, shown_ranks
from ...version import __version__
from ..agreement import OPEN, Party, Purpose, Terms, admit, arrive_failed, barrier
from ..device import COLLECTIVE_DEVICES
from ..torch_state import OwnStore, dist, import_torch

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

Side = Literal["trainer", "engine"]
SIDES: tuple[Side, ...] = ("trainer", "engine")
FORMED = Purpose("refit group", "connect_refit", RefitGroupError)


@dataclass(eq=False)
class RefitGroup:
    """This process's place in a refit group between two jobs (made by ``connect_refit``).

    Attributes:
        name: The group's name on the store (one per engine).
        address: The store both jobs meet at, as text.
        side: ``trainer`` or ``engine``.
        job_rank: This process's rank in its own job.
        rank: Its rank in the group: ``job_rank`` for the trainer, ``trainer_ranks + job_rank`` for the engine.
        trainer / engine: Each job's ranks, in the group's numbering.
        backend: ``gloo``, ``nccl`` or ``hccl``.
        generation: The join round that formed it (a job that connects again forms the next).
        process_group: The group's own ``torch.distributed.ProcessGroup`` (in no job's group registry); None once
            closed, so that a closed group's object does not keep its threads alive.
        party: Who agrees at each refit, on the group's store.
        seconds: What forming it cost here (joining, the process group, the final meeting).
    """

    name: str
    address: str
    side: Side
    job_rank: int
    rank: int
    trainer: range
    engine: range
    backend: str
    generation: int
    process_group: ProcessGroup | None
    party: Party
    seconds: float
    _store: OwnStore = field(repr=False)

    @property
    def closed(self) -> bool:
        """Whether ``close`` ran: a closed group has dropped its process group."""
        return self.process_group is None

    @property
    def size(self) -> int:
        """Ranks in the group: both jobs'."""
        return len(self.trainer) + len(self.engine)

    def who(self, rank: int) -> str:
        """A group rank as its job knows it: ``engine rank 1 (group rank 5)``."""
        return f"{self._in_job(rank)} (group rank {rank})"

    def naming(self, ranks: Sequence[int]) -> str:
        """How group ranks read in an error: the group's numbering, and the job's rank of each of ``ranks``."""
        named = "".join(f"; rank {rank} is {self._in_job(rank)}" for rank in sorted(ranks)[:4])
        return (
            f"refit group {shown(self.name)}: trainer ranks {shown_ranks(self.trainer)}, engine ranks "
            f"{shown_ranks(self.engine)}{named}"
        )

    def _in_job(self, rank: int) -> str:
        side, first = ("trainer", 0) if rank in self.trainer else ("engine", self.trainer.stop)
        return f"{side} rank {rank - first}"

    def member(self) -> tuple[int, int, Party, str, Any]:
        """What ``execute_refit`` runs on: this rank, the group's size, its party, backend and process group.

        Raises:
            RefitInputError: the group is closed.
        """
        if self.process_group is None:  # closed
            raise RefitInputError(
                f"rank {self.rank}: refit group {shown(self.name)} at {self.address} is closed: connect_refit again"
            )
        return self.rank, self.size, self.party, self.backend, self.process_group

    def close(self) -> None:
        """Leave the group: its process group and store line end here (the other job's are theirs to close).
        After a refit that lost a rank, close it and connect again: the lost rank's connections are gone."""
        if self.process_group is None:  # closed already
            return
        _connections.open.pop((self.address, self.name), None)
        shutdown = getattr(self.process_group, "shutdown", None)
        self.process_group = None
        if callable(shutdown) and self.backend != "gloo":  # gloo's ends with its object
            with contextlib.suppress(Exception):  # already broken (a peer died): nothing left to end
                shutdown()
        self._store.close()


class _Connections:
    """What this process keeps between connects: the stores it serves and the groups it has open."""

    def __init__(self) -> None:
        self.served: dict[tuple[str, int], Store] = {}
        """The stores this process serves, by address: kept for the process's life, so that a job that connects
        again (an engine restarted) finds the same store, and a group's close does not end it for the other job."""
        self.open: dict[tuple[str, str], RefitGroup] = {}
        """The open groups, by (store, name): a second connect to one is a job that joins twice."""

    def close_all(self) -> None:
        """At exit, while the interpreter lives: close the groups the caller left open, so that no gloo thread of
        theirs outlives it (one that does can abort the process at shutdown: see ``torch_state.world_token``)."""
        for group in list(self.open.values()):
            group.close()


_connections = _Connections()
atexit.register(_connections.close_all)


def connect_refit(
    address: str | Store,
    *,
    side: Side,
    rank: int,
    trainer_ranks: int,
    engine_ranks: int,
    backend: str = "gloo",
    name: str = "refit",
    timeout: float | timedelta | None = None,
    serve: bool | None = None,
) -> RefitGroup:
    """Form (or join) the refit group between a trainer job and an engine job; every process of both calls it.

    Args:
        address: ``host:port`` of a TCPStore, or a ``torch.distributed.Store`` both jobs reach.
        side: ``trainer`` or ``engine``: which job this process belongs to.
        rank: this process's rank in its own job (0 .. its job's count - 1).
        trainer_ranks, engine_ranks: how many processes each job brings; both jobs must pass the same.
        backend: ``gloo`` (CPU tensors), ``nccl`` (CUDA) or ``hccl`` (Ascend NPU).
        name: the group's name on the store; another engine connects under another name.
        timeout: seconds (or a timedelta) to wait for every process of both jobs; default 5 minutes.
        serve: whether this process serves the TCPStore at ``address`` (default: the trainer's rank 0 does).

    Returns:
        This process's ``RefitGroup``, once every process of both jobs has its process group.

    Raises:
        RefitInputError: a bad argument (named, with the fix), before touching the store.
        RefitGroupError: within the timeout: nobody serves ``address``; the jobs pass other counts or backends
            (naming both); this job's rank joined twice; or processes of either job never came (named).
    """
    started = time.monotonic()
    wait = _checked(side, rank, trainer_ranks, engine_ranks, backend, name, timeout)
    import_torch()
    where = address if isinstance(address, str) else _store_text(address)
    group_rank = rank if side == "trainer" else trainer_ranks + rank
    if (where, name) in _connections.open:
        held = _connections.open[(where, name)]
        raise RefitGroupError(
            f"{side} rank {rank}: this process already joined refit group {shown(name)} at {where} as {held.side} rank "
            f"{held.job_rank} (generation {held.generation}); a job joins once: close() that group before connecting "
            "again",
            (group_rank,),
        )
    _device_ready(backend)
    store, host = _store(address, side == "trainer" and rank == 0 if serve is None else serve, serve is None, wait)
    own = OwnStore(store, group_rank, host)
    terms = _Terms(trainer_ranks, engine_ranks, backend, f"shardcore {__version__}")
    try:
        generation = _join(own, name, side, rank, terms, wait)
        scope = f"refit-group/{name}/{generation}"
        trainer, engine = range(trainer_ranks), range(trainer_ranks, trainer_ranks + engine_ranks)
        title = (
            f"of refit group {shown(name)} (trainer ranks {shown_ranks(trainer)}, engine ranks {shown_ranks(engine)})"
        )
        lingers = 0 if serve is None and isinstance(address, str) else None  # the trainer's rank 0 serves the store
        party = Party(scope, range(trainer_ranks + engine_ranks), lingers, own, title)
        try:
            process_group = _process_group(backend, store, scope, group_rank, party.size, wait)
        except Exception as error:
            failure = RefitGroupError(f"{side} rank {rank}: {type(error).__name__}: {error}", (group_rank,))
            arrive_failed(party, FORMED, None, OPEN, failure, wait)
            raise failure from None
        barrier(party, FORMED, wait)
    except BaseException:
        own.close()
        raise
    group = RefitGroup(
        name,
        where,
        side,
        rank,
        group_rank,
        trainer,
        engine,
        backend,
        generation,
        process_group,
        party,
        time.monotonic() - started,
        own,
    )
    _connections.open[(where, name)] = group
    return group


def _checked(
    side: str, rank: int, trainer_ranks: int, engine_ranks: int, backend: str, name: str, timeout: Any
) -> timedelta:
    """The timeout, once every argument is right.

    Raises:
        RefitInputError: the first bad argument, named with the fix.
    """
    if side not in SIDES:
        raise RefitInputError(f"side {shown(side)}: expected 'trainer' or 'engine'")
    for label, count in (("trainer_ranks", trainer_ranks), ("engine_ranks", engine_ranks)):
        if not isinstance(count, int) or isinstance(count, bool) or count < 1:
            raise RefitInputError(f"{label} {shown(count)}: expected a whole number of processes, at least 1")
    mine = trainer_ranks if side == "trainer" else engine_ranks
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < mine:
        raise RefitInputError(
            f"{side} rank {shown(rank)}: expected 0 to {mine - 1} ({side}_ranks is {mine}); pass the rank of this "
            "process in its own job"
        )
    if backend not in COLLECTIVE_DEVICES:
        raise RefitInputError(f"backend {shown(backend)}: expected one of {', '.join(COLLECTIVE_DEVICES)}")
    if not name or "/" in name or not name.isprintable():
        raise RefitInputError(f"name {shown(name)}: expected a non-empty name without '/'")
    return as_timedelta(timeout or DEFAULT_TIMEOUT)


def _store_text(store: Any) -> str:
    """A given store, for messages: its address when it has one."""
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    return f"{store.host}:{store.port}" if hasattr(store, "host") else f"the given {type(store).__name__}"


def _device_ready(backend: str) -> None:
    """Before touching the store: the device the backend moves tensors on is here.

    Raises:
        RefitInputError: it is not (naming the backend and the fix).
    """
    import torch

    here = {"gloo": True, "nccl": torch.cuda.is_available(), "hccl": hasattr(torch, "npu") and torch.npu.is_available()}
    if not here[backend]:
        raise RefitInputError(
            f"backend {shown(backend)} moves {COLLECTIVE_DEVICES[backend]} tensors, and this process has no "
            f"{COLLECTIVE_DEVICES[backend]} device: use backend='gloo' (CPU tensors) or run where the device is"
        )


def _store(address: str | Store, serve: bool, by_trainer: bool, wait: timedelta) -> tuple[Store, str]:
    """The store both jobs meet at, and who hosts it (for messages); served here when ``serve``.

    Raises:
        RefitInputError: ``address`` is not ``host:port``.
        RefitGroupError: the port cannot be served here, or nobody serves it within ``wait``.
    """
    if not isinstance(address, str):
        return address, _store_text(address)
    host, _, port_text = address.rpartition(":")
    if not host or not port_text.isdigit() or not 0 < int(port_text) < 65536:
        raise RefitInputError(f"address {shown(address)}: expected 'host:port' of a TCPStore, e.g. '10.0.0.1:29600'")
    port = int(port_text)
    torch_dist = dist()
    if serve:
        served = _connections.served
        if (host, port) not in served:
            try:
                served[(host, port)] = torch_dist.TCPStore(host, port, None, True, wait, wait_for_workers=False)
            except Exception as error:
                raise RefitGroupError(
                    f"cannot serve the refit group's store at {address}: {_first_line(error)}; pick a free port"
                ) from None
        return served[(host, port)], f"this process's store at {address}"
    box: dict[str, Any] = {}

    def reach() -> None:
        try:
            box["store"] = torch_dist.TCPStore(host, port, None, False, wait)
        except Exception as error:  # handed to the caller
            box["error"] = error

    reaching = threading.Thread(target=reach, name="shardcore-refit-connect", daemon=True)
    reaching.start()
    reaching.join(wait.total_seconds())
    if "store" not in box:
        why = _first_line(box["error"]) if "error" in box else "no answer"
        raise RefitGroupError(
            f"nobody serves the refit group's store at {address} (waited {wait.total_seconds():g}s: {why}); start "
            "the trainer (its rank 0 serves it) or pass the address it serves"
        )
    return box["store"], f"the store at {address}" + (" (the trainer's rank 0)" if by_trainer else "")


# ----------------------------------------------------------------------------- joining


@dataclass(frozen=True)
class _Terms(Terms):
    """What every process of both jobs brings alike to join: the counts (the group's size), backend and software."""

    KIND: ClassVar[str] = "refit-group"
    trainer_ranks: int
    engine_ranks: int
    backend: str
    software: str


def _whoami() -> str:
    return f"pid {os.getpid()} on {socket.gethostname()}"


def _join(own: OwnStore, name: str, side: str, rank: int, terms: _Terms, wait: timedelta) -> int:
    """Join this name's current round on the store (an admission: ``agreement.admit``); returns the round (the
    group's generation) once every process of both jobs has claimed its rank.

    Raises:
        RefitGroupError: the round failed (other terms, a rank claimed twice, processes that never came), or the
            store stopped answering.
    """
    trainer_ranks, engine_ranks = terms.trainer_ranks, terms.engine_ranks
    party = Party(f"join/{name}", range(trainer_ranks + engine_ranks), None, own, f"of refit group {shown(name)}")
    me = f"{side} rank {rank} ({_whoami()})"
    admission = admit(party, FORMED, terms.encode(), me, wait)
    where = f"refit group {shown(name)} at {own.host} (round {admission.epoch})"
    if admission.conflict is not None:
        (claimant, brought), (first, reference) = admission.conflict
        raise RefitGroupError(
            f"{side} rank {rank}: the jobs disagree on {where}: {claimant} brings {_against(brought, reference)} but "
            f"{first} brought {_against(reference, brought)}; both jobs must pass connect_refit the same "
            "trainer_ranks, engine_ranks and backend (and run one shardcore)"
        )
    if admission.holder is not None:
        raise RefitGroupError(
            f"{me}: joined {where} twice: {admission.holder} already holds {side} rank {rank}; each rank of a job "
            f"joins once (is the {side} job started twice, or the rank wrong?)",
            (own.rank,),
        )
    if not admission.complete:
        absent = (
            ("trainer", [r for r in admission.missing if r < trainer_ranks]),
            ("engine", [r - trainer_ranks for r in admission.missing if r >= trainer_ranks]),
        )
        came = "; ".join(f"{job} ranks {shown_ranks(ranks)}" for job, ranks in absent if ranks) or "none"
        raise RefitGroupError(
            f"{side} rank {rank}: {came} did not join {where} within {wait.total_seconds():g}s; every process of "
            f"both jobs ({trainer_ranks} trainer, {engine_ranks} engine) must call connect_refit with this name and "
            "address (is one job not started, or given another address or name?)"
        )
    return admission.epoch


def _against(text: str, other: str) -> str:
    """The terms in ``text`` that differ from those in ``other``, as ``name=value`` (whole, if another shardcore
    encodes them otherwise)."""
    mine, theirs = _Terms.decode(text), _Terms.decode(other)
    if mine is None or theirs is None:
        return text
    return ", ".join(f"{name}={getattr(mine, name)!r}" for name in mine.differing([theirs]))


# ----------------------------------------------------------------------------- the process group


def _process_group(backend: str, store: Store, scope: str, rank: int, size: int, wait: timedelta) -> ProcessGroup:
    """A process group of the group's ranks on ``store`` (under the generation's keys), in no job's group
    registry, so neither job's default group or group count changes; gloo connects every pair now, NCCL and
    HCCL at the first message (their documented constructors: not run here, no GPU or NPU)."""
    import torch

    torch_dist = dist()
    keys = torch_dist.PrefixStore(f"shardcore/{scope}/pg/", store)
    group = torch_dist.ProcessGroup(keys, rank, size)
    kinds = torch_dist.ProcessGroup.BackendType
    if backend == "gloo":
        device, kind = torch.device("cpu"), kinds.GLOO
        made: Any = torch_dist.ProcessGroupGloo(keys, rank, size, wait)
    elif backend == "nccl":
        device, kind = torch.device("cuda", torch.cuda.current_device()), kinds.NCCL
        options = torch_dist.ProcessGroupNCCL.Options()
        options._timeout = wait
        made = torch_dist.ProcessGroupNCCL(keys, rank, size, options)
    else:
        from torch_npu._C._distributed_c10d import ProcessGroupHCCL

        device, kind = torch.device("npu", torch.npu.current_device()), kinds.CUSTOM  # type: ignore[attr-defined]
        options = ProcessGroupHCCL.Options()
        options._timeout = wait
        made = ProcessGroupHCCL(keys, rank, size, options)
    group._register_backend(device, kind, made)
    group._set_default_backend(kind)
    return group


def _first_line(error: BaseException) -> str:
    text = str(error).strip()
    return (text.splitlines()[0] if text else type(error).__name__)[:200]


__all__ = ["RefitGroup", "connect_refit"]
