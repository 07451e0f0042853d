"""``shardcore check``: build a layout on a live world, verify every group, print one row per shard.

Everything that can be checked in this process is checked before a worker starts
(``engine.check.prepare``, the machine's limits); progress goes to stderr, the table to stdout.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import os
import resource
import sys
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, TextIO

from ..engine import DEFAULT_BACKEND, install_hint
from ..errors import CheckError
from ..plan.arguments import counted, format_bytes, number_or_long, shown
from ..views.tables import format_table
from .arguments import ERROR

if TYPE_CHECKING:
    from ..engine.live.check import CheckOptions, Prepared, RankReport
    from ..plan.layout import Layout

TORCH_HINT = (
    "pip install torch==2.13.0 --index-url https://download.pytorch.org/whl/cpu "
    f"(CPU build; without --index-url, Linux gets the CUDA build), then a backend: {install_hint(DEFAULT_BACKEND)}"
)
MAX_LOCAL_NPROC = 1024
"""Most local processes ``check`` starts; a bigger world is checked under torchrun across nodes."""
FILES_PER_RANK = 3
"""Open files a local rank of an N-rank gloo world needs, per peer: a socket to each peer for the
default group and about two more for its own groups."""
MIB_PER_PROCESS = 250
"""Resident memory of one worker after importing torch (measured: about 220 MiB on torch 2.13 CPU)."""
OVERSUBSCRIBED = 4
"""Processes per core above which ``check`` warns that it will be slow."""
HELD_EVERY = 10.0
"""Seconds without a progress line after which ``Progress.held`` says what the running ranks hold."""
GIB = 1 << 30


def _parse_option(text: str) -> tuple[str, object]:
    key, sep, value = text.partition("=")
    if not sep or not key:
        raise CheckError(f"--option {shown(text)}: expected KEY=VALUE, e.g. --option device_type=cpu")
    try:
        return key, json.loads(value, parse_int=number_or_long)  # a 5,000-digit number reaches the check
    except (ValueError, RecursionError):  # not JSON, or nested too deeply for it: the text itself
        return key, value


def local_limit() -> tuple[int, str]:
    """(most local processes this machine can run, why): the open-file limit or the sane cap."""
    soft, _ = resource.getrlimit(resource.RLIMIT_NOFILE)
    by_files = MAX_LOCAL_NPROC if soft == resource.RLIM_INFINITY else max(1, (soft - 64) // FILES_PER_RANK)
    if by_files < MAX_LOCAL_NPROC:
        return by_files, (
            f"each rank opens about {FILES_PER_RANK} files per peer and the open-file limit is {soft} "
            "(raise it with ulimit -n)"
        )
    return MAX_LOCAL_NPROC, f"a local check starts one process per rank, and {MAX_LOCAL_NPROC} is the most it starts"


def _available_mib() -> int | None:
    try:
        with open("/proc/meminfo", encoding="ascii") as file:
            for line in file:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) // 1024
    except OSError:
        pass
    return None


@dataclass(frozen=True)
class Load:
    """What a live command's processes hold beyond the interpreter and torch (``MIB_PER_PROCESS``), for
    ``check_load``: bytes per rank, what those bytes are, and how to hold less."""

    per_rank: Sequence[int]
    what: str
    """e.g. "the refit's tensors"."""
    less: str
    """How to hold less, e.g. "refit a smaller model or part of it (--tensors), or use fewer processes"."""
    flag: str = "--nproc"
    """The flag that sets the number of processes."""


def check_machine(nproc: int) -> list[str]:
    """Refuse a world whose processes alone this machine cannot hold; return warnings for one it holds only
    slowly. It needs no plan, so a live command runs it before planning (a plan of a large world takes
    seconds), and ``check_load`` once the plan says what each rank holds.

    Memory is read as the kernel's MemAvailable: what can be allocated without swapping. Each process counts
    MIB_PER_PROCESS.

    Raises:
        CheckError: ``nproc`` above ``local_limit``, or more processes than the available memory holds,
            naming the figures and a way out.
    """
    limit, why = local_limit()
    if nproc > limit:
        raise CheckError(
            f"--nproc {nproc}: at most {limit} local processes here ({why}); plan bigger worlds with "
            f"`shardcore plan --world {nproc}`, or run check under torchrun across nodes"
        )
    available = _available_mib()
    if available is not None and nproc * MIB_PER_PROCESS > available:
        raise CheckError(
            f"--nproc {nproc}: {counted(nproc, 'process', 'processes')} need about "
            f"{nproc * MIB_PER_PROCESS / 1024:.1f} GiB (about {MIB_PER_PROCESS} MiB each) but "
            f"{available / 1024:.1f} GiB is available here; use at most {max(1, available // MIB_PER_PROCESS)}, "
            "or run check under torchrun across nodes"
        )
    cores = os.cpu_count() or 1
    if nproc > OVERSUBSCRIBED * cores:
        return [f"{counted(nproc, 'process', 'processes')} on {counted(cores, 'core')}: expect minutes"]
    return []


def check_load(nproc: int, load: Load) -> None:
    """Refuse a world whose processes, with what each rank holds (``load.per_rank``) on top of
    MIB_PER_PROCESS, need more than the kernel's MemAvailable: the kernel would kill them after they start.

    Raises:
        CheckError: naming the total, the rank that holds the most, what is available and how to hold less.
    """
    available = _available_mib()
    if available is None or not load.per_rank:
        return
    need = nproc * MIB_PER_PROCESS / 1024 + sum(load.per_rank) / GIB
    most = max(range(len(load.per_rank)), key=load.per_rank.__getitem__)
    if need > available / 1024:
        raise CheckError(
            f"{load.flag} {nproc}: {counted(nproc, 'process', 'processes')} would hold about {need:.1f} GiB "
            f"({load.what}; rank {most} the most, {load.per_rank[most] / GIB:.1f} GiB, plus about "
            f"{MIB_PER_PROCESS} MiB each) but {available / 1024:.1f} GiB is available here: {load.less}"
        )


def require_torch(command: str) -> None:
    """Refuse a live command before anything starts when torch is not installed.

    Raises:
        CheckError: naming the command and how to install torch.
    """
    if importlib.util.find_spec("torch") is None:
        raise CheckError(f"shardcore {command} needs torch: {TORCH_HINT}")


def torchrun_world() -> int | None:
    """The world size torchrun gave this process (RANK and WORLD_SIZE set), or None when run alone: a live
    command then joins that world instead of starting ``--nproc`` local processes."""
    if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
        return int(os.environ["WORLD_SIZE"])
    return None


def speaks_for_the_world() -> bool:
    """Whether this process prints what every rank would print alike (an error in the input, or one
    the ranks agreed on): always when run alone; under torchrun, only the first process of each node
    (``LOCAL_RANK`` 0), so a bad spec is one line, not one per rank."""
    return torchrun_world() is None or os.environ.get("LOCAL_RANK", "0") == "0"


SPEAKER_GRACE_S = 30.0
"""How long a process that does not speak for the world waits, after an error, for torchrun to end it."""


def report_error(message: str) -> None:
    """Print an error on stderr once per node under torchrun, and never lose it.

    torchrun ends every worker (SIGTERM) as soon as one exits non-zero. A quiet process that failed
    and exited first would so end the speaker before it printed, and an error every rank saw alike
    (a bad spec) would be printed by none. A quiet process therefore waits to be ended; past
    ``SPEAKER_GRACE_S`` the error was its own, and it prints it with its rank.
    """
    if not speaks_for_the_world():
        time.sleep(SPEAKER_GRACE_S)
        message = f"rank {os.environ['RANK']}: {message}"
    print(f"{ERROR} {message}", file=sys.stderr)


class Progress:
    """Progress lines on stderr: per stage, ranks done of N with the time since start.

    A stage's count is printed when it completes, and otherwise when nothing was printed for a
    second; ``-v``
    prints every rank's event, ``-q`` nothing.
    """

    def __init__(self, world: int, verbose: bool, quiet: bool, out: TextIO = sys.stderr) -> None:
        self.world, self.verbose, self.quiet, self.out = world, verbose, quiet, out
        self.counts: dict[str, int] = {}
        self.printed = time.monotonic()

    def __call__(self, stage: str, rank: int, seconds: float) -> None:
        if self.quiet:
            return
        count = self.counts[stage] = self.counts.get(stage, 0) + 1
        if self.verbose:
            self._say(f"  rank {rank} {stage} ({seconds:.1f}s)")
        now = time.monotonic()
        if count == self.world or now - self.printed >= 1.0:
            self.printed = now
            self._say(f"  {stage:<8} {count}/{self.world} ({seconds:.1f}s)")

    def held(self, resident: dict[int, int], seconds: float) -> None:
        """What the running ranks hold, when nothing was printed for HELD_EVERY seconds: a long transfer
        shows it is alive, and memory that grows is seen before the kernel ends a rank for it."""
        now = time.monotonic()
        if self.quiet or now - self.printed < HELD_EVERY:
            return
        self.printed = now
        most = max(resident, key=resident.__getitem__)
        self._say(
            f"  running  {counted(len(resident), 'rank')} hold {format_bytes(sum(resident.values()))}, the most "
            f"rank {most} ({format_bytes(resident[most])}) ({seconds:.1f}s)"
        )

    def _say(self, line: str) -> None:
        print(line, file=self.out, flush=True)


class JoinedProgress(Progress):
    """Under torchrun only rank 0 speaks; its build and verify end with a world sync, so they speak for all."""

    def __call__(self, stage: str, rank: int, seconds: float) -> None:
        if self.quiet or rank != 0:
            return
        what = {
            "joined": f"rank 0 joined a world of {counted(self.world, 'rank')}",
            "imported": "imported the backend's framework",
            "built": f"all {counted(self.world, 'rank')} built their groups",
            "verified": f"all {counted(self.world, 'rank')} verified their groups",
        }.get(stage, stage)
        self._say(f"  {what} ({seconds:.1f}s)")


def _options(args: argparse.Namespace) -> CheckOptions:
    from ..engine.live.check import CheckOptions

    return CheckOptions(
        shards=args.shards,
        backend=args.backend,
        order=args.order,
        allow_idle=args.allow_idle,
        strategy=args.strategy,
        timeout=args.timeout,
        backend_options=dict(_parse_option(text) for text in args.option),
    )


def _header(prepared: Prepared, options: CheckOptions, world: str) -> str:
    source = {"--backend": "", "default": " (the default)"}.get(
        prepared.backend_source, f" (from {prepared.backend_source})"
    )
    return (
        f"shardcore check: {world}, backend {prepared.backend}{source}, strategy {options.strategy}, "
        f"order {prepared.layout.order}, timeout {options.timeout:g}s"
    )


def cmd_check(args: argparse.Namespace) -> int:
    """Check in this process what can be checked, then run the check and print it."""
    require_torch("check")
    from ..engine.live import check
    from ..engine.torch_state import check_torch_imports

    check_torch_imports()  # an autoloaded device extension that breaks torch: one line, before the header

    options = _options(args)
    torchrun = torchrun_world()
    joined = torchrun is not None
    world = args.nproc if torchrun is None else torchrun
    warnings = [] if joined else check_machine(world)
    prepared = check.prepare(options, world)
    speaks = not args.quiet and (not joined or os.environ["RANK"] == "0")
    if speaks:
        where = (
            f"torchrun world of {counted(world, 'rank')}"
            if joined
            else f"{counted(world, 'local gloo process', 'local gloo processes')}"
        )
        if not args.json:  # --json: stdout holds the document alone
            print(_header(prepared, options, where), flush=True)
    for warning in warnings:
        print(f"shardcore: warning: {warning}", file=sys.stderr)
    if joined:
        reports = check.run_joined(prepared.options, JoinedProgress(world, args.verbose, args.quiet))
    else:
        reports = check.run_local(world, prepared.options, Progress(world, args.verbose, args.quiet))
    if reports is None:
        return 0
    if args.json:
        document = _check_document(prepared, options, world, reports)
        print(json.dumps(document, indent=2))
        return 0 if document["ok"] else 1
    table, ok = summary(reports, prepared.layout)
    if speaks:
        print(f"strategy {reports[0].strategy}")
    print(table)
    print("all groups match the plan" if ok else "MISMATCH: some groups differ from the plan")
    return 0 if ok else 1


def _seconds(reports: list[RankReport], attribute: str) -> float:
    return max((getattr(r, attribute) for r in reports), default=0.0)


def check_rows(reports: list[RankReport], layout: Layout) -> list[dict[str, Any]]:
    """Per shard (and the idle ranks, if any): its ranks and spec, the groups its ranks verified, its slowest
    rank's seconds importing the backend's framework, building the groups (group creation only) and verifying
    them, its mismatches, and whether every rank of it reported and matched: the table's rows and ``--json``'s."""
    rows: list[dict[str, Any]] = []
    for plan in layout.shards:
        mine = [r for r in reports if r.shard == plan.index]
        failures = [f for r in mine for f in r.failures]
        rows.append(
            {
                "shard": plan.index,
                "role": plan.spec.role,
                "ranks": [plan.rank_offset, plan.ranks.stop],
                "spec": str(plan.spec),
                **_times(mine),
                "failures": failures,
                "ok": not failures and len(mine) == plan.size,
            }
        )
    idle = [r for r in reports if r.shard is None]
    if idle:
        ranks = [min(r.rank for r in idle), max(r.rank for r in idle) + 1]  # after the last shard: contiguous
        rows.append({"shard": None, "role": None, "ranks": ranks, "spec": None})
        rows[-1].update(**_times(idle), failures=[], ok=True)
    return rows


def _times(reports: list[RankReport]) -> dict[str, Any]:
    return {
        "groups_verified": sum(r.verified for r in reports),
        "import_seconds": _seconds(reports, "import_seconds"),
        "build_seconds": _seconds(reports, "build_seconds"),
        "verify_seconds": _seconds(reports, "verify_seconds"),
    }


def summary(reports: list[RankReport], layout: Layout) -> tuple[str, bool]:
    """One table row per shard (and idle ranks), and whether everything matched.

    Times are each shard's slowest rank: importing the backend's framework, building the
    groups (group creation only), verifying them.
    """
    rows = check_rows(reports, layout)

    def cells(row: dict[str, Any]) -> tuple[object, ...]:
        idle = row["shard"] is None
        failed = f"FAILED ({counted(len(row['failures']), 'mismatch', 'mismatches')})"
        return (
            "idle" if idle else row["shard"],
            row["role"] or "-",
            counted(row["ranks"][1] - row["ranks"][0], "rank") if idle else f"[{row['ranks'][0]}, {row['ranks'][1]})",
            row["spec"] or "-",
            row["groups_verified"],
            *(f"{row[key]:.3f}" for key in ("import_seconds", "build_seconds", "verify_seconds")),
            "ok" if row["ok"] else failed,
        )

    header = ("shard", "role", "ranks", "spec", "groups verified", "import s", "build s", "verify s", "status")
    table = format_table([cells(row) for row in rows], header)
    details = [f for r in reports for f in r.failures]
    return table + ("\n" + "\n".join(details) if details else ""), all(row["ok"] for row in rows)


def _check_document(prepared: Prepared, options: CheckOptions, world: int, reports: list[RankReport]) -> dict[str, Any]:
    """``check --json``: what was checked (world, backend, strategy, order, timeout) and, per shard, what its
    ranks found; ``ok`` when every group matched the plan."""
    rows = check_rows(reports, prepared.layout)
    return {
        "world": world,
        "backend": prepared.backend,
        "backend_source": prepared.backend_source,
        "strategy": reports[0].strategy if reports else str(options.strategy),
        "order": str(prepared.layout.order),
        "timeout": options.timeout,
        "shards": rows,
        "ok": all(row["ok"] for row in rows),
    }


__all__ = [
    "CheckError",
    "Load",
    "Progress",
    "check_load",
    "check_machine",
    "check_rows",
    "cmd_check",
    "local_limit",
    "report_error",
    "require_torch",
    "summary",
    "torchrun_world",
]
