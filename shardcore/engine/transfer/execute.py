"""Execute a refit plan: move every planned slice of every weight with point-to-point messages.

Every rank of the world calls :func:`execute_refit`, idle ranks too; or, with ``group=``, every rank of a refit
group between two jobs (``transfer.group``), over that group and its store, the jobs' default groups untouched.
The steps:

1. **Check, then agree, before a byte moves.** Each rank checks its arguments and its tensors
   against the plan (names, local shapes, dtypes, device, a layout it can write in place), and the
   world meets (``engine.agreement``): every rank brings the terms it is about to run (the layout,
   the source and destination shards, the manifest, the planner's options, bucket size, ops per
   batch, verification and the refit's version). A rank whose terms differ is named on every rank
   with what differs; a rank that failed its checks arrives with its error. Either way no byte moves.
2. **Exchange** (``transfer.exchange``), in batches both ends post alike (``transfer.schedule``),
   each message checked against its sender's ledger. A converting refit first computes its fp8
   scales, exchanging partial amaxes where a per-tensor scale needs them, and casts on the way
   (``transfer.convert``); through a layout, the destination ranks quantize what lands instead
   (``transfer.landing``).
3. **Agree on the outcome** at an end meeting, so that a refit that failed anywhere fails
   everywhere, naming the rank at fault and why.

Refits are sessions of the world's party, numbered by the store's epoch: a rank that failed, skipped
a refit or was replaced cannot shift any later refit. Each refit's messages carry a tag of its own
(from the epoch), so nothing of a failed refit can ever match a later one's messages.

Versions: ``version=step`` records, per destination tensor, the version it holds
(``held_version``); a refit that fails keeps the previous version, marked not intact when bytes
were already written (refit again before serving). A delta refit (``ExecuteOptions.delta``) sends
each piece as its changes since the version its destination holds (``transfer.delta``).

CPU worlds: run one intra-op thread per process (torchrun's default, ``OMP_NUM_THREADS=1``) when
processes outnumber cores; with more, every pack and unpack copy fights the other processes'
OpenMP threads and runs 10-100x slower (see BENCHMARKS.md).
"""

from __future__ import annotations

import functools
import logging
import time
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, replace
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple

from ...errors import RefitInputError, RefitIntegrityError, RefitMismatchError, RefitPeerError, ShardcoreError
from ...plan.arguments import DEFAULT_TIMEOUT, as_timedelta, shown, shown_ranks
from ...refit import pairing
from ...refit.collector import gc_paused
from ...refit.landing import NO_DELTA
from ...refit.options import DEFAULT_BUCKET_BYTES, DEFAULT_MAX_OPS, ExecuteOptions, Verify
from ...refit.schedule import Batch, rank_batches
from ...version import __version__
from ..agreement import GRACE, Party, Purpose, Terms, arrive_failed, convene, declare_absent, exchange_notes, meet
from ..device import served_devices
from ..torch_state import dist, import_torch, is_fake_world
from .convert import Conversion
from .delta import DeltaSession
from .exchange import Codec, Exchange
from .landing import Landing
from .pieces import Plain
from .session import DEFAULT_SESSION, HeldVersion, RefitSession, Schedule

if TYPE_CHECKING:
    import torch
    from torch.distributed import ProcessGroup

    from ...refit.part import RankRefit
    from ...refit.plan import RefitPlan
    from .group import RefitGroup

log = logging.getLogger("shardcore.refit")

TAG_BASE = 1 << 30
"""Refit messages use tags from here (one per refit, from its epoch), away from a user's own tag 0."""
START = Purpose("refit", "execute_refit", RefitPeerError, lambda message, ranks: RefitInputError(message, ranks))
END = Purpose("refit", "execute_refit", RefitPeerError)


@dataclass
class TransferStats:
    """What one rank did in one refit.

    Attributes:
        rank: This rank.
        bytes_sent / bytes_received / bytes_copied: Tensor bytes sent, received, and copied locally.
        messages: Messages sent and received (ledgers included).
        batches: ``batch_isend_irecv`` calls.
        peers: Ranks this rank exchanged messages with.
        seconds: Wall time of the whole call; ``agreement_seconds`` of it in the two meetings.
        peak_buffer_bytes: Staging memory used (at most ``bucket_bytes``).
        wire_bytes_sent / wire_bytes_received: Data bytes on the wire: in a delta refit the encoded messages
            (``bytes_sent`` and ``bytes_received`` stay the tensor bytes they carry), else the same.
        snapshot_bytes: A delta refit's memory on this rank between refits: what it last sent, per piece.
        landing_peak_bytes: fp8 through a layout: the most staging copies of its local tensors this rank held at
            once, in the wire's dtype, to quantize them once landed (``transfer.landing``).
        version: The version this rank's destinations hold now (None without ``version=``).
        verify: How messages were checked.
    """

    rank: int
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0
    messages: int = 0
    batches: int = 0
    peers: int = 0
    seconds: float = 0.0
    agreement_seconds: float = 0.0
    peak_buffer_bytes: int = 0
    version: int | None = None
    verify: str = "size"
    wire_bytes_sent: int = 0
    wire_bytes_received: int = 0
    snapshot_bytes: int = 0
    landing_peak_bytes: int = 0

    @property
    def bytes_moved(self) -> int:
        """Bytes this rank received or copied: what its destination tensors gained."""
        return self.bytes_received + self.bytes_copied

    @property
    def gb_per_s(self) -> float:
        """Bytes received and copied per second, in GB/s (10^9)."""
        return self.bytes_moved / self.seconds / 1e9 if self.seconds > 0 else 0.0


@dataclass(frozen=True)
class RefitTerms(Terms):
    """What every rank of a refit must bring alike (the plan's own terms, then the executor's)."""

    KIND = "refit"
    HIDDEN = ("layout",)

    layout: str
    source: str
    destinations: str
    manifest: str
    options: str
    bucket_bytes: int
    max_ops: int
    verify: str
    version: int | None
    software: str
    delta: str = "off"


def held_version(destinations: Mapping[str, torch.Tensor], session: RefitSession | None = None) -> HeldVersion | None:
    """The version ``destinations`` hold (as refits with ``version=`` recorded it), None if never recorded.

    When the tensors hold different versions, the oldest is reported, not intact.

    Args:
        destinations: tensor name -> destination tensor, as passed to ``execute_refit``.
        session: the refit session that recorded it (``execute_refit``'s ``session=``); None: the default one.
    """
    return (session or DEFAULT_SESSION).held_version(destinations)


def _naming_group_ranks(execute: Callable[..., TransferStats]) -> Callable[..., TransferStats]:
    """A refit over a refit group fails naming group ranks: its error also says which job's rank each one is."""

    @functools.wraps(execute)
    def named(*args: Any, **kwargs: Any) -> TransferStats:
        try:
            return execute(*args, **kwargs)
        except ShardcoreError as error:
            group = kwargs.get("group")
            if group is not None and error.args:
                error.args = (f"{error.args[0]} [{group.naming(getattr(error, 'ranks', ()))}]", *error.args[1:])
            raise

    return named


@_naming_group_ranks
def execute_refit(
    plan: RefitPlan,
    sources: Mapping[str, Any],
    destinations: Mapping[str, Any],
    *,
    options: ExecuteOptions | None = None,
    timeout: float | timedelta | None = None,
    bucket_bytes: int | None = None,
    max_ops: int | None = None,
    verify: str | None = None,
    version: int | None = None,
    group: RefitGroup | None = None,
    session: RefitSession | None = None,
) -> TransferStats:
    """Move this rank's part of ``plan``; every rank of the default group (or of ``group``) calls it, idle ranks too.

    Args:
        plan: a ``RefitPlan``: ``plan_refit``'s ``ShardRefitPlan``, a ``RefitRequest``'s plan, a ``subset``.
        sources: tensor name -> this rank's local source tensor (the plan's source side).
        destinations: tensor name -> this rank's preallocated local destination tensor, written in place;
            ``nn.Parameter``s are fine (written under no_grad).
        options: the executor's knobs as one ``ExecuteOptions`` (what the CLI and the plugins' wrappers
            pass); each keyword below that is given (not None) takes the place of its field.
        timeout: seconds (or a timedelta) for the whole call; default 5 minutes.
        bucket_bytes: bytes one batch may hold (default 64 MiB, at least 32): staging memory for packed and
            non-contiguous pieces stays within it (``TransferStats.peak_buffer_bytes``).
        max_ops: operations per ``batch_isend_irecv`` (default 256, safe for NCCL).
        verify: ``size`` (the default) checks every received message's size against its sender's ledger;
            ``checksum`` also a checksum of its bytes.
        version: this refit's version (e.g. the training step), recorded for ``held_version``.
        group: a refit group between two jobs (``connect_refit``): the plan's ranks are the group's, and the
            refit runs over it and its store; None: the default group.
        session: where this process keeps what it needs of this refit for the next (versions held, the last
            schedule, a delta refit's snapshots: ``RefitSession``); None: the process's default session.

    Returns:
        This rank's TransferStats.

    Raises:
        RefitInputError: on every rank, before any byte moves, when a rank's arguments or tensors are
            wrong (naming the rank, the tensor, what was expected and what was given).
        RefitMismatchError: on every rank, before any byte moves, when ranks bring different terms (a
            different plan, manifest, option or version), naming them and what differs.
        RefitIntegrityError: a received message was short or corrupt (naming sender, receiver, tensor);
            on the other ranks a RefitPeerError names it.
        RefitPeerError: on every surviving rank, within ``timeout``, when a rank died, never called
            execute_refit or failed; ``.ranks`` and the message name it.
    """
    started = time.monotonic()
    rank, world, party, backend, process_group = _require_world(group)
    given = {"timeout": timeout, "bucket_bytes": bucket_bytes, "max_ops": max_ops, "verify": verify, "version": version}
    session = session or DEFAULT_SESSION
    prepared = _prepare(session, party, rank, world, backend, plan, sources, destinations, options, given)
    checked, schedule = prepared.options, prepared.schedule
    bucket_bytes, version = checked.bucket_bytes, checked.version
    epoch = _agree(party, rank, prepared.terms, schedule, prepared.amax, prepared.wait)
    _write_zeros(prepared.destinations, prepared.zeros)
    stats = TransferStats(rank, verify=checked.verify, version=version, agreement_seconds=time.monotonic() - started)
    exchange = Exchange(
        rank=rank,
        batches=schedule.batches,
        copies=prepared.mine.copies,
        codec=prepared.codec,
        tag=TAG_BASE + epoch % TAG_BASE,
        verify=checked.verify,
        party=party,
        epoch=epoch,
        deadline=started + prepared.wait.total_seconds(),
        gloo="gloo" in backend,
        bucket_bytes=bucket_bytes,
        group=process_group,
        places=schedule.places,
    )
    if prepared.conversion is not None:
        prepared.conversion.prepare(exchange, prepared.amax)
    _run(exchange, stats, prepared.delta)
    if prepared.conversion is None:  # a conversion's scales are found per refit, and where they lie with them
        schedule.places = exchange.places
    if prepared.landing is not None:
        stats.landing_peak_bytes = prepared.landing.peak_bytes
    ended = time.monotonic()
    _finish(session, party, exchange, epoch, prepared.destinations, version)
    if prepared.delta is not None:  # every rank's receivers now hold what this rank last sent
        prepared.delta.commit(version)
        stats.snapshot_bytes = session.snapshot_bytes()
    stats.agreement_seconds += time.monotonic() - ended
    stats.seconds = time.monotonic() - started
    log.info("shardcore refit: %s", stats)
    return stats


class _Prepared(NamedTuple):
    """What a rank checked on its own before meeting the others."""

    wait: timedelta
    options: ExecuteOptions
    mine: RankRefit
    destinations: dict[str, torch.Tensor]
    terms: RefitTerms
    conversion: Conversion | None
    delta: DeltaSession | None
    landing: Landing | None
    codec: Codec
    """What the exchange moves with: ``delta``, else ``landing``, ``conversion`` or a plain codec."""
    schedule: Schedule
    amax: list[Batch]
    """The batches of a converting refit's partial-amax exchange (``Conversion.amax_batches``; [] for none)."""
    zeros: dict[str, tuple[Any, ...]]
    """The boxes of this rank's destination tensors written as zeros (``_zeroed``)."""


def _prepare(
    session: RefitSession,
    party: Party,
    rank: int,
    world: int,
    backend: str,
    plan: RefitPlan,
    sources: Mapping[str, Any],
    destinations: Mapping[str, Any],
    options: ExecuteOptions | None,
    given: Mapping[str, object],
) -> _Prepared:
    """Everything this rank checks and derives alone: its options (``options`` with the keywords ``given``), its
    part of the plan, its tensors, its terms, its schedule. A failure still arrives at the refit's first meeting,
    with its error, so the others stop at once and name it.

    Raises:
        RefitInputError: naming this rank and what is wrong.
    """
    wait = DEFAULT_TIMEOUT
    try:
        wait = as_timedelta(given["timeout"] or getattr(options, "timeout", None))  # first: a failure below meets in it
        checked = ExecuteOptions.merged(options, **given)
        if checked.delta and checked.version is None:
            raise RefitInputError("delta=True needs version=: the versions decide which destinations get a delta")
        mine = plan.for_rank(rank)
        conversion = Conversion.of(plan, mine, rank)
        with gc_paused():  # a detached view of each of its tensors, thousands, no cycle among them
            held, wanted = _checked_tensors(rank, backend, mine, plan, sources, destinations, conversion)
        if conversion is not None:
            conversion = replace(conversion, sources=held, destinations=wanted)
        landing = Landing.of(plan, mine, held, wanted)
        if landing is not None and checked.delta:
            raise RefitInputError(f"delta=True {NO_DELTA}")
        # a plan converts on its senders (between Megatron shards) or its receivers (through a layout), never both
        dense = landing or conversion or Plain(sources=held, destinations=wanted)
        delta = _delta_session(session, checked, dense)
        schedule = _schedule(session, plan, mine, checked, rank, world)
        dense.kept_runs = schedule.runs
        amax = [] if conversion is None else conversion.amax_batches(rank, world, checked.bucket_bytes, checked.max_ops)
        terms = _terms(plan, checked)
        zeros = _zeroed(plan, mine, landing)
        codec = dense if delta is None else delta
        return _Prepared(wait, checked, mine, wanted, terms, conversion, delta, landing, codec, schedule, amax, zeros)
    except BaseException as error:
        failure = _as_input_error(rank, error)
        arrive_failed(party, START, None, "open", failure, wait)
        raise failure from None


def _zeroed(plan: RefitPlan, mine: RankRefit, landing: Landing | None) -> dict[str, tuple[Any, ...]]:
    """The boxes of this rank's destination tensors that no source feeds and the refit writes as zeros, by tensor:
    an engine's vocabulary padding, which its own loader zeroes (``Placement.zeroed``). A tensor quantized on
    landing has them zero already (its staging is zero-filled)."""
    placement = plan.destination_placement_of(mine.rank)
    if placement is None:
        return {}
    return {
        name: boxes
        for name, boxes in placement.zeroed(mine.rank).items()
        if name in mine.destination_shapes and (landing is None or name not in landing)
    }


def _write_zeros(destinations: Mapping[str, torch.Tensor], zeros: Mapping[str, tuple[Any, ...]]) -> None:
    """Zero ``zeros``' boxes of ``destinations``: once every rank agreed to the refit, before a byte lands."""
    for name, boxes in zeros.items():
        for box in boxes:
            destinations[name][tuple(slice(start, stop) for start, stop in box)].zero_()


def _schedule(
    session: RefitSession, plan: RefitPlan, mine: RankRefit, checked: ExecuteOptions, rank: int, world: int
) -> Schedule:
    """This rank's schedule, made once per plan part and options and kept in ``session``: the part is the plan's
    own object, kept while the plan lives (``for_rank``), and a schedule costs milliseconds that need not be spent
    again."""
    # staged, never in place: a delta refit's every message (any may travel encoded), else those cast on the way
    staged = plan.manifest.names if checked.delta else plan.manifest.converting
    options = (rank, world, checked.bucket_bytes, checked.max_ops, staged)
    last = session.schedule
    if last is None or last.mine is not mine or last.options != options:
        with gc_paused():  # tens of thousands of pieces and messages, no cycle among them
            batches = rank_batches(mine, *options[:4], plan.manifest.shapes, options[4])
        last = session.schedule = Schedule(mine, options, batches)
    return last


def _delta_session(session: RefitSession, options: ExecuteOptions, dense: Plain) -> DeltaSession | None:
    """A delta refit's part on this rank, its dense pieces moved by ``dense``: the version each destination tensor
    holds intact (None: none to build a delta on: never written, partly overwritten by a failed refit, or a new
    process)."""
    if not options.delta:
        return None
    held = {name: session.held_version({name: tensor}) for name, tensor in dense.destinations.items()}
    versions = {name: h.version if h is not None and h.intact else None for name, h in held.items()}
    return DeltaSession(
        session.bases_held(versions, dense.destinations), dense, session, options.anchor, options.delta_checksum
    )


def _require_world(group: RefitGroup | None) -> tuple[int, int, Party, str, ProcessGroup | None]:
    """Where the refit runs: this rank, the ranks there, the party that agrees, the collective library and the
    process group to post on (None: the default one); raises before any meeting when there is none to meet in."""
    import_torch()
    if group is not None:
        return group.member()
    torch_dist = dist()
    if not torch_dist.is_available() or not torch_dist.is_initialized():
        raise RefitInputError("torch.distributed is not initialized: call torch.distributed.init_process_group() first")
    if is_fake_world():
        raise RefitInputError("the fake backend moves no bytes: execute a refit on a real world (gloo, nccl, hccl)")
    party = Party.world()
    return int(torch_dist.get_rank()), party.size, party, str(torch_dist.get_backend()), None


def _as_input_error(rank: int, error: BaseException) -> BaseException:
    """A rank's own failure before the refit starts, as one RefitInputError naming the rank (what every rank
    reads for it); an interrupt stays what it is."""
    if not isinstance(error, Exception):
        return error
    text = str(error) if isinstance(error, ShardcoreError) else f"{type(error).__name__}: {error}"
    return RefitInputError(text if text.startswith(f"rank {rank}:") else f"rank {rank}: {text}", (rank,))


def _terms(plan: RefitPlan, options: ExecuteOptions) -> RefitTerms:
    fingerprint = plan.fingerprint()
    return RefitTerms(
        fingerprint["layout"],
        fingerprint["source"],
        fingerprint["destinations"],
        fingerprint["manifest"],
        fingerprint["options"],
        options.bucket_bytes,
        options.max_ops,
        options.verify,
        options.version,
        f"shardcore {__version__}",
        options.delta_terms,
    )


def _agree(party: Party, rank: int, terms: RefitTerms, schedule: Schedule, amax: list[Batch], wait: timedelta) -> int:
    """The refit's first meeting; returns its epoch. Besides the terms, it sums every rank's tally of its messages
    (``schedule``'s and ``amax``'s, the partial-amax exchange's): not 0, some message is seen by one end only or
    differently (the parts of one plan disagree).

    Raises:
        RefitMismatchError: ranks brought different terms (every group outside the majority named), or the
            ranks' parts of the plan disagree (naming the pairs of ranks that do).
    """
    tally = (schedule.tally + pairing.tally(amax)) % pairing.MODULUS
    outcome = convene(party, START, terms.encode(), wait, tally=tally)
    if outcome.groups is not None:
        message = RefitTerms.disagreement(
            rank,
            outcome.groups,
            f"at the start of refit {outcome.epoch}",
            "Every rank must call execute_refit with the same plan (layout, shards, manifest, options), "
            "bucket_bytes, max_ops, verify, version and delta; no byte moved",
        )
        raise RefitMismatchError(message, sorted(r for ranks, _ in outcome.groups[1:] for r in ranks))
    if int(outcome.payload or 0) % pairing.MODULUS:
        _unpaired(party, rank, outcome.epoch, [*schedule.batches, *amax], wait)
    return outcome.epoch


def _unpaired(party: Party, rank: int, epoch: int, batches: list[Batch], wait: timedelta) -> None:
    """The parts of the plan disagree somewhere: every rank leaves a note of its pairs and reads its peers'; the
    ends of each pair that disagrees name it (at least one of them knows of the pair), and every rank hears them.

    Raises:
        RefitMismatchError: always, on every rank.
    """
    notes = pairing.note(batches)
    found: list[pairing.Disagreement] = []

    def conclude(theirs: dict[int, str]) -> str:
        found.extend(pairing.disagreements(rank, notes, {peer: pairing.decode(t) for peer, t in theirs.items()}))
        return pairing.shown(found) if found else ""

    said = exchange_notes(party, START, epoch, pairing.encode(notes), sorted(notes), conclude, wait)
    if found:
        ranks = sorted({r for pair in found for r in (pair.sender, pair.receiver)})
        what = f"these pairs of ranks disagree: {pairing.shown(found)}"
    else:
        ranks = sorted(said)
        first = next(iter(said.values()), "")
        what = f"not on this rank's own pairs; ranks {shown_ranks(ranks)} name theirs: {first}"
    raise RefitMismatchError(
        f"rank {rank}: at the start of refit {epoch}, the ranks' parts of the plan disagree on the messages between "
        f"them ({what}); no byte moved. Each rank derives its part from the same plan, so this is a planner bug: "
        "please report it with the plan's layouts and shards",
        ranks,
    )


# ----------------------------------------------------------------------------- tensors


def _checked_tensors(
    rank: int,
    backend: str,
    mine: RankRefit,
    plan: RefitPlan,
    sources: Mapping[str, Any],
    destinations: Mapping[str, Any],
    conversion: Conversion | None = None,
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor]]:
    """This rank's tensors, once every one is checked: detached where autograd tracks them (a parameter is written
    under no_grad), as given where it does not (a parameter's ``.data``, what the plugins pass; detaching a training
    rank's 8,000 per-expert tensors cost 6.7 ms a refit).

    Raises:
        RefitInputError: every problem of this rank's tensors, in one message.
    """
    read = mine.sources_read
    needed = read if conversion is None else conversion.needed_sources(read)
    problems = _side_problems("source", sources, mine.source_shapes, mine.source_dtypes, needed, plan.manifest.tensor)
    problems += _side_problems(
        "destination",
        destinations,
        mine.destination_shapes,
        mine.destination_dtypes,
        set(mine.destination_shapes),
        plan.destination_tensor,
    )
    # both sides' tensors: a collocated rank holds a source and a destination under one name
    sides = [side.values() for side in (sources, destinations) if isinstance(side, Mapping)]
    problems += _device_problems([tensor for side in sides for tensor in side], backend)
    if problems:
        shown_problems = "; ".join(problems[:5]) + (f"; and {len(problems) - 5} more" if len(problems) > 5 else "")
        raise RefitInputError(f"rank {rank}: {shown_problems}", (rank,))
    return (
        {name: _untracked(tensor) for name, tensor in sources.items() if name in mine.source_shapes},
        {name: _untracked(tensor) for name, tensor in destinations.items() if name in mine.destination_shapes},
    )


def _untracked(tensor: torch.Tensor) -> torch.Tensor:
    """``tensor`` as autograd does not track it: detached where it requires grad, else itself."""
    return tensor.detach() if tensor.requires_grad else tensor


def _side_problems(
    kind: str,
    given: Any,
    shapes: Mapping[str, tuple[int, ...]],
    dtypes: Mapping[str, str],
    needed: set[str],
    spec_of: Callable[[str], Any],
) -> list[str]:
    """Problems of one side's tensors: needed ones missing, any given one unknown, misshapen, of another dtype,
    or not contiguous (the schedule counts staging memory alike at both ends for contiguous tensors only).
    ``shapes`` and ``dtypes`` are the part's (``RankRefit``) for this side; ``spec_of`` gives a tensor's spec by the
    name the side holds it under (a destination's may be an engine's), to tell a given tensor the part does not
    hold from one the manifest does not know."""
    import torch

    if not isinstance(given, Mapping):
        return [f"{kind}s must be a mapping of tensor name -> torch.Tensor, got {type(given).__name__}"]
    problems = [
        f"{kind} tensor {shown(name)} is missing"
        + (f" (expected local shape {list(shapes[name])})" if name in shapes else "")
        for name in sorted(needed - set(given))
    ]
    for name, tensor in given.items():
        if name not in shapes:
            if not _known(spec_of, name):
                problems.append(f"{kind} tensor {shown(name)} is not in the manifest: check its name")
            continue
        if not isinstance(tensor, torch.Tensor) or tensor.layout != torch.strided:
            what = type(tensor).__name__ if not isinstance(tensor, torch.Tensor) else f"{tensor.layout} tensor"
            problems.append(f"{kind} tensor {shown(name)} is a {what}, not a dense torch.Tensor")
            continue
        if tensor.shape != tuple(shapes[name]):
            problems.append(
                f"{kind} tensor {shown(name)} has shape {list(tensor.shape)}, expected {list(shapes[name])}"
            )
        expected = getattr(torch, dtypes[name])
        if tensor.dtype != expected:
            problems.append(f"{kind} tensor {shown(name)} has dtype {tensor.dtype}, expected {expected}")
        if not tensor.is_contiguous():
            problems.append(
                f"{kind} tensor {shown(name)} is not contiguous (strides {list(tensor.stride())}): pass a contiguous "
                f"tensor (for a source, .contiguous(); a parameter's .data is)"
            )
    return problems


def _known(spec_of: Callable[[str], Any], name: str) -> bool:
    try:
        spec_of(name)
    except (KeyError, TypeError, ShardcoreError):
        return False
    return True


def _device_problems(tensors: Iterable[Any], backend: str) -> list[str]:
    """Every tensor on one device, and one the refit's collective library (``backend``) moves."""
    import torch

    # each tensor's device, then their types: tens of thousands of tensors, almost always one device
    devices = {device.type for device in {t.device for t in tensors if isinstance(t, torch.Tensor)}}
    served = set(served_devices(backend))
    if len(devices) > 1:
        return [f"tensors are on several devices ({', '.join(sorted(devices))}): put sources and destinations on one"]
    if devices and served and not devices <= served:
        return [
            f"tensors are on {devices.pop()} but the refit's group ({backend}) moves tensors on "
            f"{' or '.join(sorted(served))}: move them there first"
        ]
    return []


# ----------------------------------------------------------------------------- the exchange and its end


def _run(exchange: Exchange, stats: TransferStats, delta: DeltaSession | None) -> None:
    """Allocate the staging buffer and run the exchange (local copies while the first batch is on the wire)."""
    import torch

    try:
        peak = exchange.staging_bytes()
        exchange.staging = torch.empty(peak, dtype=torch.uint8, device=exchange.device) if peak else None
        stats.peak_buffer_bytes = peak
    except Exception as error:  # no staging memory: drain (sends of 1 byte need none) and fail at the end
        exchange.fail(error)
    with torch.no_grad(), gc_paused():  # its messages' runs, views and pieces make no cycle (see ``gc_paused``)
        exchange.run()
    stats.bytes_sent, stats.bytes_received = exchange.bytes_sent, exchange.bytes_received
    stats.bytes_copied = exchange.bytes_copied
    stats.wire_bytes_sent = exchange.bytes_sent if delta is None else delta.wire_sent
    stats.wire_bytes_received = exchange.bytes_received if delta is None else delta.wire_received
    stats.batches = len(exchange.batches)
    stats.messages = sum(len(batch.messages) for batch in exchange.batches)
    stats.peers = len({peer for batch in exchange.batches for peer in batch.peers})


def _finish(
    session: RefitSession,
    party: Party,
    exchange: Exchange,
    epoch: int,
    destinations: Mapping[str, Any],
    version: int | None,
) -> None:
    """The end meeting: this rank's outcome for everyone, everyone's for this rank; then the versions.

    Raises:
        RefitIntegrityError, RefitPeerError: this rank's own fault, or another rank's.
    """
    wait = timedelta(seconds=max(0.0, exchange.deadline - time.monotonic()) + GRACE)
    own = _own_fault(exchange)
    if exchange.lost:
        declare_absent(
            party, epoch, "end", sorted(exchange.lost), f"lost by rank {exchange.rank}: {exchange.lost_text()}"
        )
    try:
        if own is not None:
            arrive_failed(party, END, epoch, "end", own, wait)
            raise own
        meet(party, END, epoch, "end", wait, linger=True)
    except ShardcoreError as error:
        if destinations:  # only this call records versions, so they are still the ones held before the refit
            previous = session.held_version(destinations)
            kept = HeldVersion(
                None if previous is None else previous.version,
                exchange.wrote is False and (previous is None or previous.intact),
            )
            session.hold(destinations, kept)
            intact = "" if kept.intact else ", partly overwritten: refit again before serving"
            error.args = (
                f"{error.args[0]}; this rank's destinations keep version {kept.version}{intact}",
                *error.args[1:],
            )
        raise
    if version is not None:
        session.hold(destinations, HeldVersion(version, True))


def _own_fault(exchange: Exchange) -> BaseException | None:
    """What this rank itself reports at the end: its own error, a lost peer, or a faulty message (unless
    another rank's failure made its senders drain, which also cuts their messages short)."""
    if exchange.error is not None:
        return (
            exchange.error
            if isinstance(exchange.error, ShardcoreError)
            else RefitPeerError(
                f"rank {exchange.rank}: {type(exchange.error).__name__}: {exchange.error}", (exchange.rank,)
            )
        )
    if exchange.lost:
        return RefitPeerError(f"rank {exchange.rank}: {exchange.lost_text()}", sorted(exchange.lost))
    if exchange.integrity.faults and exchange.draining is None and not exchange.others_failed():
        faults = exchange.integrity.faults
        return RefitIntegrityError(
            exchange.integrity.describe(exchange.rank), sorted({sender for sender, _, _ in faults})
        )
    return None


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_MAX_OPS",
    "ExecuteOptions",
    "RefitTerms",
    "TransferStats",
    "Verify",
    "execute_refit",
    "held_version",
]
