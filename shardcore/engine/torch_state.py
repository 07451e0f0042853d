"""The torch.distributed internals shardcore relies on, read and written only here.

Store access: shardcore talks to the default store through ``store_call``, on a client of
its own and one daemon thread that runs the calls in turn, because a TCPStore client blocks on its socket, whatever
``set_timeout`` says, when the store's host is stopped (SIGSTOP, swap, a debugger)
rather than dead: measured on torch 2.13, ``get`` waited until the host was killed.
The thread is abandoned, with its client, when the caller's time is up; the next call starts another.
A group of its own between two jobs (a refit group) has its own store (``OwnStore``), talked to alike on a
thread of its own.

Group keys: a default-mode gloo group named ``G`` leaves, per member, a key
``G//<device>//<gloo device index>/<group rank>`` in the default store (its
connect-full-mesh address); ``group_keys`` names them so the group's destroyer can
delete them.

``strategy="local"`` names each group by setting torch's world-wide default-mode group
counter (``_world.group_count``) before creating it; see ``shardcore.engine.groups.create``.
That counter, the live group names (``_world.pg_names``), the default group's bound
device, the default store and the others in ``INTERNALS`` are private to torch, and
``c10d()`` is the one way to them: its first call checks that this torch still has every
one in the shape relied on (the counter still names the next group), so another torch
release fails there, in one line naming the internal and ``TESTED_TORCH``, rather than
building groups wrong.

Importing torch: every shardcore entry point that needs torch imports it through
``import_torch``. torch 2.13 calls, at the end of its own ``import``, every entry point of
the group ``torch.backends`` (out-of-tree device extensions such as torch-npu) unless
``TORCH_DEVICE_BACKEND_AUTOLOAD`` is ``0``; one that fails turns ``import torch`` into
``RuntimeError: Failed to load the backend extension: NAME`` (torch-npu without Ascend's
CANN toolkit: its ``_C`` module cannot find ``libhccl.so``). The failed import leaves
torch's native operator registrations behind, so a second ``import torch`` in the same
process dies differently ("Only a single TORCH_LIBRARY can be used to register the
namespace triton"): the guard remembers the first failure and never imports twice. On a
machine without numpy (the CPU install), torch warns "Failed to initialize NumPy" while
it is imported; shardcore needs no numpy, so the guard silences exactly that warning.
"""

from __future__ import annotations

import atexit
import os
import queue
import re
import sys
import threading
import time
import warnings
import weakref
from collections.abc import Callable, Mapping
from functools import cache
from types import ModuleType
from typing import TYPE_CHECKING, Any, ClassVar, TypeVar

from ..errors import BackendUnavailableError, GroupCreationError, TorchInternalsError

if TYPE_CHECKING:
    from torch.distributed import ProcessGroup, Store

T = TypeVar("T")

_EXIT_SECONDS = 2.0
"""How long a process that exits waits for its store thread's queued cleanup."""

AUTOLOAD_ENV = "TORCH_DEVICE_BACKEND_AUTOLOAD"
"""torch loads its device extensions on import unless this is ``0`` (it reads ``== "1"``, default ``1``)."""
AUTOLOAD_GROUP = "torch.backends"
"""The entry-point group of torch's autoloaded device extensions (torch-npu registers ``torch_npu``)."""
EXTENSION_FIXES = {
    "torch_npu": "to use Ascend NPUs, install Ascend's CANN toolkit and source its set_env.sh "
    "(e.g. /usr/local/Ascend/ascend-toolkit/set_env.sh)",
}
"""How to repair a known extension so that it loads."""
_AUTOLOAD_FAILURE = re.compile(r"Failed to load the backend extension: (.+?)\. ")


class _Import:
    """The outcome of this process's one attempt to import torch through the guard."""

    failure: BackendUnavailableError | None = None
    seconds: float = 0.0
    """How long the import took (0 when torch was already imported when the guard was first called)."""


def autoloaded_extensions() -> list[str]:
    """The device extensions ``import torch`` will load here (none when autoloading is off)."""
    if os.environ.get(AUTOLOAD_ENV, "1") != "1":
        return []
    from importlib.metadata import entry_points

    return sorted(ep.name for ep in entry_points(group=AUTOLOAD_GROUP))


def _extension_failure(error: RuntimeError) -> BackendUnavailableError | None:
    """The one-line error for torch's autoload failure, or None for any other RuntimeError."""
    found = _AUTOLOAD_FAILURE.search(str(error))
    if found is None:
        return None
    from importlib.metadata import entry_points

    name = found.group(1)
    owner = next((ep.dist for ep in entry_points(group=AUTOLOAD_GROUP) if ep.name == name and ep.dist), None)
    package = f" ({owner.name} {owner.version})" if owner is not None else ""
    cause = error.__cause__
    why = f": {type(cause).__name__}: {str(cause).strip()[:200]}" if cause is not None else ""
    fix = EXTENSION_FIXES.get(name, f"to use it, repair the install of {owner.name if owner else name}")
    return BackendUnavailableError(
        f"import torch fails: torch autoloads its device extension {name!r}{package}, which failed to load{why}; "
        f"{fix}, or set {AUTOLOAD_ENV}=0 to run on CPU/CUDA without it"
    )


def import_torch() -> ModuleType:
    """torch, imported once per process through the one guard every shardcore entry point uses.

    Returns:
        The ``torch`` module.

    Raises:
        BackendUnavailableError: an autoloaded device extension broke ``import torch`` (one
            line naming the extension, its error and both fixes); raised again, without a
            second import, on every later call.
        TorchInternalsError: this torch lacks or changed an internal shardcore relies on (``c10d``).
        ImportError: torch is not installed.
    """
    module = sys.modules.get("torch")
    if module is not None:
        return module
    if _Import.failure is not None:
        raise _Import.failure
    started = time.perf_counter()
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
            import torch
    except RuntimeError as error:
        failure = _extension_failure(error)
        if failure is None:
            raise
        _Import.failure = failure
        raise failure from None
    _Import.seconds = time.perf_counter() - started
    if torch.distributed.is_available():
        c10d()  # this torch's internals, checked once, as soon as shardcore imports it
    return torch


def torch_import_seconds() -> float:
    """Seconds this process spent importing torch through ``import_torch`` (0 when something else imported it
    first): most of a live check's start-up, which a worker reports as its import time."""
    return _Import.seconds


def check_torch_imports() -> None:
    """Before starting processes that import torch: import it here when an autoloaded extension could
    break it (torch-npu installed), so the failure is one line in this process rather than one per rank.

    Raises:
        BackendUnavailableError: as ``import_torch``.
    """
    if autoloaded_extensions():
        import_torch()


def dist() -> Any:
    """``torch.distributed`` (imported on first use, so that importing shardcore never imports torch)."""
    import torch.distributed

    return torch.distributed


def is_fake_world() -> bool:
    """True under torch's fake backend, where no rank can see another."""
    return str(dist().get_backend()) == "fake"


TESTED_TORCH = ("2.13.0", "2.14.1")
"""The torch releases shardcore's tests run on (tox: every env, and ``torch214``)."""


def _names_groups_by_counter(c10d: ModuleType) -> bool:
    """Whether the next default-mode group is named by ``_world.group_count``, which can be set (the counter
    is left as found)."""
    world = c10d._world
    count = world.group_count
    try:
        world.group_count = count + 7
        named = c10d._process_group_name([], use_hashed_name=False)
        return isinstance(count, int) and named == str(count + 7) and world.group_count == count + 8
    finally:
        world.group_count = count


INTERNALS: dict[str, Callable[[ModuleType], bool]] = {
    "_world.group_count names the next default-mode group and can be set": _names_groups_by_counter,
    "_world.pg_names (group -> name)": lambda c10d: isinstance(c10d._world.pg_names, dict),
    "_world.pg_backend_config (group -> 'device:backend,...')": lambda c10d: isinstance(
        c10d._world.pg_backend_config, dict
    ),
    "_get_default_group()": lambda c10d: callable(c10d._get_default_group),
    "_get_default_store()": lambda c10d: callable(c10d._get_default_store),
    "_get_process_group_name(group)": lambda c10d: callable(c10d._get_process_group_name),
    "ProcessGroup._get_backend(device)": lambda c10d: callable(c10d.ProcessGroup._get_backend),
    "ProcessGroup.bound_device_id": lambda c10d: hasattr(c10d.ProcessGroup, "bound_device_id"),
    "shrink_group(ranks, shrink_flags=SHRINK_ABORT | SHRINK_DEFAULT)": lambda c10d: (
        callable(c10d.shrink_group) and isinstance(c10d.SHRINK_ABORT, int) and isinstance(c10d.SHRINK_DEFAULT, int)
    ),
}
"""Each torch.distributed internal shardcore relies on (in ``distributed_c10d``), and how to tell it is there
as relied on."""


def check_torch_internals(
    owner: str, module: ModuleType, internals: Mapping[str, Callable[[ModuleType], bool]]
) -> None:
    """Check that this torch has each internal ``owner`` relies on, as relied on.

    Args:
        owner: who relies on them, for the message (``"shardcore"``, a plugin's name).
        module: the torch module they live in, handed to each check.
        internals: each internal's name (as the message shows it) and its check, which returns False, or
            raises AttributeError, ImportError, TypeError or ValueError, when the internal is missing or changed.

    Raises:
        TorchInternalsError: the first missing or changed internal, named with this torch's version and
            ``TESTED_TORCH`` (one line).
    """
    for name, present in internals.items():
        try:
            found = present(module)
        except (AttributeError, ImportError, TypeError, ValueError):
            found = False
        if not found:
            raise TorchInternalsError(torch_internal_missing(owner, f"{module.__name__}.{name}"))


def torch_internal_missing(owner: str, internal: str) -> str:
    """The one-line message for a torch internal ``owner`` relies on that this torch lacks or changed."""
    import torch

    tested = " and ".join(TESTED_TORCH)
    return (
        f"torch {torch.__version__} lacks or changed {internal}, which {owner} relies on (tested on torch {tested}): "
        f"install one of those (pip install 'torch=={TESTED_TORCH[-1]}')"
    )


@cache
def c10d() -> Any:
    """torch's ``distributed_c10d`` module, once this torch is known to have every internal in ``INTERNALS``.

    Raises:
        TorchInternalsError: it lacks one, or has changed it (see ``check_torch_internals``).
    """
    from torch.distributed import distributed_c10d

    check_torch_internals("shardcore", distributed_c10d, INTERNALS)
    return distributed_c10d


def live_group_count() -> int:
    """Process groups this process holds, the default group included."""
    return len(c10d()._world.pg_names)


def group_counter() -> int:
    """torch's counter that names default-mode groups; every rank must hold the same value."""
    return int(c10d()._world.group_count)


def set_group_counter(value: int) -> None:
    """Set the counter that names the next default-mode group (checked by ``c10d``)."""
    c10d()._world.group_count = value


def bound_device() -> Any:
    """The device the default group is bound to (``init_process_group(device_id=...)``), or None."""
    return c10d()._get_default_group().bound_device_id


def default_group_can_shrink() -> bool:
    """Whether ``dist.shrink_group`` would shrink the default group here: its backend's ``supports_shrinking``,
    found as torch 2.13's ``shrink_group`` finds it (the bound device's backend, else CUDA's, else the CPU's)."""
    import torch

    group = c10d()._get_default_group()
    device = getattr(group, "bound_device_id", None)
    try:
        if device is not None:
            backend = group._get_backend(device)
        else:
            try:
                backend = group._get_backend(torch.device("cuda"))
            except Exception:  # no CUDA backend: torch falls back to the CPU's, as here
                backend = group._get_backend(torch.device("cpu"))
        return bool(backend.supports_shrinking)
    except Exception:  # no backend to ask, or one without the property: torch's shrink_group refuses too
        return False


def torchcomms_enabled() -> bool:
    """Whether torch routes ``new_group`` through TorchComms (``TORCH_DISTRIBUTED_USE_TORCHCOMMS=1`` with
    torchcomms installed), where every group is a split of the whole world."""
    enabled = getattr(c10d(), "_use_torchcomms_enabled", None)
    return bool(enabled()) if callable(enabled) else False


def default_store() -> Store:
    """The default group's store: every rank reaches it, whatever the backend."""
    return c10d()._get_default_store()


def agent_hosts_store() -> bool:
    """Whether torchrun's agent, not rank 0, hosts the default store (then no rank needs to stay up for it)."""
    return os.environ.get("TORCHELASTIC_USE_AGENT_STORE") == "True"


def store_host() -> str:
    """Who hosts the default store, for messages: rank 0, or torchrun's agent, and its address."""
    store: Any = default_store()
    while hasattr(store, "underlying_store"):
        store = store.underlying_store
    where = f" at {store.host}:{store.port}" if hasattr(store, "host") else ""
    return f"torchrun's agent{where}" if agent_hosts_store() else f"rank 0{where}"


class _Worlds:
    """Weak references to the default group and store last seen, and their number."""

    group: weakref.ref[Any] | None = None
    store: weakref.ref[Any] | None = None
    number = 0


def world_token() -> int:
    """Tells this world from an earlier one in the same process (after destroy and init_process_group, or a
    shrink): what a rank remembers about store keys belongs to the world that wrote them. A number, counted up
    whenever the default group or store is another object than last time.

    Compared by identity through weak references: a new world's objects can reuse a freed one's ``id``, but a
    dead reference matches nothing. Weak, because holding the last default group keeps its gloo threads alive
    after ``destroy_process_group``; one that drops a finished op's tensor while the interpreter shuts down
    aborts the process ("terminate called without an active exception": twice in CI, in torchrun workers).
    """
    group, store = c10d()._get_default_group(), default_store()
    held_group = _Worlds.group() if _Worlds.group is not None else None
    held_store = _Worlds.store() if _Worlds.store is not None else None
    if group is not held_group or store is not held_store:
        _Worlds.group, _Worlds.store, _Worlds.number = weakref.ref(group), weakref.ref(store), _Worlds.number + 1
    return _Worlds.number


class _Line:
    """One store's connection and the one thread that talks on it, both replaced when a call on them is abandoned
    (or, for the default store, when the world changes)."""

    lock = threading.Lock()
    """Guards every line's state (one lock: a line's calls are rare and short)."""
    lines: ClassVar[list[_Line]] = []
    """Every line of this process, for the exit."""
    draining: ClassVar[list[threading.Thread]] = []
    """Workers of closed lines still finishing their queues, for the exit."""
    exit_pid: ClassVar[int | None] = None
    """The process that registered the exit's cleanup (a forked child registers its own)."""

    def __init__(self, name: str, connect: Callable[[], Store]) -> None:
        self.name = name
        self.connect = connect
        self.jobs: queue.SimpleQueue[Any] | None = None
        """The current worker's queue of (job, box, done); None until the first call (or after an abandoned one)."""
        self.generation = 0
        self.given_up = threading.Event()
        """Set when the current worker's line is given up: it ends after the job it runs, leaving its queue."""
        self.thread: threading.Thread | None = None
        self.pid: int | None = None
        """The process that started the worker (a forked child has none, and starts its own)."""

    def put(self, job: Callable[[Store], object], box: dict[str, Any], done: threading.Event) -> None:
        """Queue ``job`` for the worker (starting one if this process has none); call under ``lock``."""
        if self.pid is not None and self.pid != os.getpid():  # a forked child: the parent's worker is not here
            self.retire()
        if self.jobs is None:
            self.jobs = self._start()
        self.jobs.put((job, box, done))

    def retire(self, *, drain: bool = False) -> None:
        """Let the current worker end (under ``lock``); the next call starts another. ``drain``: once its queue is
        done (an orderly end: a group closed, the process exiting), so that the cleanup and counts queued behind
        the last call still reach the store; else after the job it runs, never touching its client again (a call
        on it was given up, or its world is gone)."""
        if self.jobs is not None:
            self.jobs.put(None)
            if not drain:
                self.given_up.set()
        self.jobs, self.generation = None, self.generation + 1

    def _start(self) -> queue.SimpleQueue[Any]:
        """The thread that runs every store job of one generation, in order, on a client of its own: handing a job
        to a waiting thread costs a third of starting one per call (measured with 8 processes on 2 cores)."""
        jobs: queue.SimpleQueue[Any] = queue.SimpleQueue()
        if _Line.exit_pid != os.getpid():
            _Line.exit_pid = os.getpid()
            atexit.register(_end_workers)
        if self not in _Line.lines:
            _Line.lines.append(self)
        self.pid = os.getpid()
        generation, given_up = self.generation, threading.Event()
        self.given_up = given_up

        def serve() -> None:
            client: Store | None = None
            while (item := jobs.get()) is not None:
                job, box, done = item
                try:
                    client = client or self.connect()
                    box["value"] = job(client)
                except BaseException as failure:  # handed to the caller's thread
                    box["error"] = failure
                done.set()
                if given_up.is_set():  # abandoned while this job ran: never touch the client again
                    return

        self.thread = threading.Thread(target=serve, name=f"{self.name}-{generation}", daemon=True)
        self.thread.start()
        return jobs


class _Default:
    """The default store's line, and the world it talks to: a new world (destroy, then init_process_group)
    connects anew."""

    line = _Line("shardcore-store", lambda: _clone(default_store()))
    world: int | None = None
    abandoned: int | None = None
    """A world whose store's host is gone (``abandon_store``): no call reaches for it again."""


class OwnStore:
    """A store of a group of its own (a refit group between two jobs), not the default group's: shardcore's calls
    on it run on a line of their own, as the default store's do, and their messages name its host and this
    process's rank in the group (a process with no default group at all can use one).

    Args:
        store: the store (a TCPStore client, or any store both jobs reach).
        rank: this process's rank in the group that meets there.
        host: who hosts the store, for messages (``"trainer rank 0 at 10.0.0.1:29600"``).
    """

    _count = 0

    def __init__(self, store: Store, rank: int, host: str) -> None:
        OwnStore._count += 1
        self.store, self.rank, self.host = store, rank, host
        self.token = ("own", OwnStore._count)
        """Tells this store's keys from the default world's and another group's (what a rank remembers)."""
        self.abandoned = False
        self.line = _Line(f"shardcore-store-own{OwnStore._count}", lambda: _clone(store))

    def close(self) -> None:
        """Stop this store's line once its queue is done (the counts and cleanup the last calls queued reach the
        store: a lingering meeting's host waits for them); later calls fail at once."""
        with _Line.lock:
            self.abandoned = True
            thread = self.line.thread
            self.line.retire(drain=True)
            if self.line in _Line.lines:
                _Line.lines.remove(self.line)
            if thread is not None and thread.is_alive():  # the exit waits for its queue too
                _Line.draining = [*(alive for alive in _Line.draining if alive.is_alive()), thread]


def abandon_store() -> None:
    """Give up this world's store, whose host is gone: later ``store_call``s in this world fail at once, without
    touching a socket (a frozen host would hold each one for its whole timeout), and nothing is cleaned up there."""
    with _Line.lock:
        _Default.abandoned = world_token()
        _Default.line.retire()


def store_abandoned() -> bool:
    """Whether this world's store was given up (``abandon_store``)."""
    return _Default.abandoned is not None and _Default.abandoned == world_token()


def store_call(
    job: Callable[[Store], T],
    seconds: float,
    what: str,
    error: Callable[[str], Exception] = GroupCreationError,
    *,
    on: OwnStore | None = None,
) -> T:
    """Run ``job(store)`` on shardcore's own client of the default store (or of ``on``); give up after ``seconds``.

    Args:
        job: the store operations, run in one daemon thread (they may block on the socket).
        seconds: how long the caller may wait.
        what: where the caller is, for the message (``"at 'agree' of build 3"``).
        error: the caller's error type for an unresponsive or lost store.
        on: a group's own store (``OwnStore``); None: the default group's.

    Returns:
        What ``job`` returned.

    Raises:
        GroupCreationError (or ``error``): the store did not answer in time (its host is unresponsive),
            or the connection failed (its host has probably died). Errors of ``job`` itself that are
            not connection failures propagate unchanged.
    """
    import torch.distributed as dist

    rank = on.rank if on is not None else dist.get_rank()
    host = on.host if on is not None else None
    world = None if on is not None else world_token()
    if on.abandoned if on is not None else _Default.abandoned == world:
        raise error(f"rank {rank}: the store was given up {what}: its host, {host or store_host()}, is gone")
    box: dict[str, Any] = {}
    done = threading.Event()
    line = _line(on, world)
    with _Line.lock:
        line.put(job, box, done)
    try:
        answered = done.wait(seconds)
    except BaseException:  # an interrupt: the job may still be running, so nothing may queue behind it
        answered = False
        raise
    finally:
        if not answered:
            with _Line.lock:  # the worker keeps the old client; the next call starts a new worker, connected anew
                line.retire()
    if not answered:
        raise error(
            f"rank {rank}: the store did not answer within {seconds:.3g}s {what}: its host, {host or store_host()}, "
            f"is unresponsive (stopped, frozen by swap or a debugger) or unreachable"
        )
    failure = box.get("error")
    if isinstance(failure, dist.DistError) and not isinstance(failure, dist.DistStoreError):
        raise error(
            f"rank {rank}: lost the store {what} ({failure}); its host, {host or store_host()}, has probably died"
        ) from None
    if failure is not None:
        raise failure
    return box["value"]


def store_in_background(job: Callable[[Store], object], *, on: OwnStore | None = None) -> None:
    """Queue ``job`` (cleanup nobody waits for) on the store's thread and return at once; what it raises is
    dropped, and the next ``store_call`` runs after it, within that call's own time."""
    world = None if on is not None else world_token()
    if on.abandoned if on is not None else _Default.abandoned == world:
        return
    line = _line(on, world)
    with _Line.lock:
        line.put(job, {}, threading.Event())


def _line(on: OwnStore | None, world: int | None) -> _Line:
    """The line of ``on``, or the default store's (retired first when the world changed)."""
    if on is not None:
        return on.line
    with _Line.lock:
        if _Default.world != world:
            _Default.line.retire()
            _Default.world = world
    return _Default.line


def _end_workers() -> None:
    """At exit: let every worker finish its queue (cleanup) and end, briefly, before the interpreter goes; a
    daemon thread still holding a store client then aborts the process ("terminate called")."""
    with _Line.lock:
        threads = [line.thread for line in _Line.lines if line.pid == os.getpid()] + _Line.draining
        for line in _Line.lines:
            line.retire(drain=True)
    deadline = time.monotonic() + _EXIT_SECONDS
    for thread in threads:
        if thread is not None:
            thread.join(max(0.0, deadline - time.monotonic()))


def _clone(store: Store) -> Store:
    """A client of its own where the store can make one (TCPStore), else the shared one."""
    try:
        return store.clone()  # type: ignore[attr-defined]  # missing from torch's stubs
    except (AttributeError, RuntimeError):
        return store


def group_keys(pg: ProcessGroup) -> list[str]:
    """The keys this rank wrote in the default store to connect ``pg`` (gloo; see the module doc).

    Nothing for backends whose keys shardcore does not know (NCCL, custom ones).
    """
    import torch

    devices = [d.split(":") for d in str(c10d()._world.pg_backend_config.get(pg, "")).split(",") if ":" in d]
    gloo = [device for device, backend in devices if backend == "gloo"]
    if not gloo:
        return []
    try:  # one gloo backend serves every device mapped to gloo; its connect keys live under the first
        count = len(pg._get_backend(torch.device(gloo[0])).options._devices)  # type: ignore[attr-defined]
    except (AttributeError, RuntimeError):
        count = 1
    name = c10d()._get_process_group_name(pg)
    return [f"{name}//{gloo[0]}//{index}/{pg.rank()}" for index in range(count)]


__all__ = [
    "AUTOLOAD_ENV",
    "AUTOLOAD_GROUP",
    "TESTED_TORCH",
    "OwnStore",
    "abandon_store",
    "agent_hosts_store",
    "autoloaded_extensions",
    "bound_device",
    "c10d",
    "check_torch_imports",
    "check_torch_internals",
    "default_group_can_shrink",
    "default_store",
    "dist",
    "group_counter",
    "group_keys",
    "import_torch",
    "is_fake_world",
    "live_group_count",
    "set_group_counter",
    "store_abandoned",
    "store_call",
    "store_host",
    "store_in_background",
    "torch_import_seconds",
    "torch_internal_missing",
    "torchcomms_enabled",
    "world_token",
]
