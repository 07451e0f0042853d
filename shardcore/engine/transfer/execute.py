"""Execute a refit plan: move every planned slice of every weight with point-to-point sends.

Every rank of the world calls :func:`execute_refit`, idle ranks too. The steps:

1. **Check inputs, then agree.** Each rank checks its source and destination tensors
   against the plan (names, local shapes, dtypes) and the world meets at a store barrier
   where any rank's problem is everyone's error. No byte moves before that.
2. **Exchange.** The transfers between two ranks are sorted (sender and receiver sort them the
   same way), cut along their first dim to at most ``bucket_bytes / 2``, and made into messages:
   a piece of 256 KiB or more travels alone, straight from the source tensor and into the
   destination tensor wherever its slice is contiguous there; smaller pieces are packed in order
   into one staged buffer per message. The cut depends on sizes only, so both ends agree on it.
   Every message has a key, (index within its pair, src, dst), and every rank posts its messages
   in increasing key, in rounds: each round is one ``batch_isend_irecv`` of its sends to and
   receives from all peers at once, and holds as many messages as fit ``bucket_bytes`` of staged
   bytes (in-place messages take none). The smallest unfinished message of the world is always in
   the current round of both its ends, so no set of ranks can wait on each other in a cycle. The
   same code runs on gloo, NCCL and HCCL. Local copies (pieces a rank holds in both layouts) run
   while the first round is on the wire.
3. **Agree on the outcome** at a second store barrier, so that a refit that failed anywhere
   fails everywhere, naming the rank at fault.

Faults: gloo breaks a connection whose peer died, and a bounded wait (to the call's
deadline) catches a peer that hangs; a rank that fails leaves the reason in the store (which
also wakes the ranks waiting at the end), and the others read it there, so the error names the
rank at fault, not merely the rank seen waiting. (A gloo wait that times out closes the pair, so
waits are never sliced and retried.)

CPU worlds: run one intra-op thread per process (torchrun's default, ``OMP_NUM_THREADS=1``) when
processes outnumber cores; with more, every pack and unpack copy fights the other processes'
OpenMP threads and runs 10-100x slower (see BENCHMARKS.md).
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from ...errors import RefitInputError, RefitPeerError, ShardcoreError
from ..torch_state import import_torch

if TYPE_CHECKING:
    import torch

    from ...refit.planner import RankRefit

log = logging.getLogger("shardcore.refit")

DEFAULT_BUCKET_BYTES = 64 << 20
"""Staging memory one rank may use at a time for packed or non-contiguous pieces, sends and receives together."""
DEFAULT_TIMEOUT = 300.0
_ALIGN = 16  # byte offset of each piece in a bucket: any dtype's view of it is aligned
_SOLO_BYTES = 256 << 10  # a piece this big travels alone, from and into the tensors where contiguous
_MAX_NAMED = 8
_READ_GRACE = 2.0  # seconds rank 0 keeps the store up for the others after a barrier timed out
_calls = 0
_previous_prefix: str | None = None


@dataclass
class TransferStats:
    """What one rank did: bytes sent, received and copied locally, buckets, peers and wall time."""

    rank: int
    bytes_sent: int = 0
    bytes_received: int = 0
    bytes_copied: int = 0
    buckets: int = 0
    peers: int = 0
    seconds: float = 0.0
    peak_buffer_bytes: int = 0

    @property
    def bytes_moved(self) -> int:
        """Bytes this rank received or copied: what its destination tensors gained."""
        return self.bytes_received + self.bytes_copied

    @property
    def gb_per_s(self) -> float:
        """Bytes received and copied per second, in GB/s (10^9)."""
        return self.bytes_moved / self.seconds / 1e9 if self.seconds > 0 else 0.0


class _Piece(NamedTuple):
    """A dense box of one tensor: its offset in the sender's and the receiver's local tensor."""

    tensor: str
    shape: tuple[int, ...]
    src_offset: tuple[int, ...]
    dst_offset: tuple[int, ...]
    nbytes: int


# ----------------------------------------------------------------------------- inputs


def _dtype(name: str) -> torch.dtype:
    import torch

    dtype = getattr(torch, name, None)
    if not isinstance(dtype, torch.dtype):
        raise RefitInputError(f"the manifest's dtype {name!r} is not a torch dtype (e.g. 'bfloat16', 'float32')")
    return dtype


def _check_tensors(
    kind: str, given: Mapping[str, Any], shapes: Mapping[str, tuple[int, ...]], needed: set[str], manifest: Any
) -> list[str]:
    """Problems of one side's tensors: needed ones missing, any known one with the wrong shape or dtype."""
    import torch

    problems = []
    for name in sorted(needed - set(given)):
        problems.append(f"{kind} tensor {name!r} is missing (expected local shape {list(shapes[name])})")
    for name, tensor in given.items():
        if name not in shapes:
            if name not in needed and not _in_manifest(manifest, name):
                problems.append(f"{kind} tensor {name!r} is not in the manifest: check its name")
            continue
        if not isinstance(tensor, torch.Tensor):
            problems.append(f"{kind} tensor {name!r} is a {type(tensor).__name__}, not a torch.Tensor")
            continue
        expected = tuple(shapes[name])
        if tuple(tensor.shape) != expected:
            problems.append(f"{kind} tensor {name!r} has shape {list(tensor.shape)}, expected {list(expected)}")
        dtype = _dtype(manifest.tensor(name).dtype)
        if tensor.dtype != dtype:
            problems.append(f"{kind} tensor {name!r} has dtype {tensor.dtype}, expected {dtype}")
    return problems


def _in_manifest(manifest: Any, name: str) -> bool:
    try:
        manifest.tensor(name)
    except (KeyError, ShardcoreError):
        return False
    return True


def _validate(mine: Any, manifest: Any, sources: Mapping[str, Any], destinations: Mapping[str, Any]) -> list[str]:
    used = {t.tensor for t in (*mine.sends, *mine.copies)}
    problems = _check_tensors("source", sources, dict(mine.source_shapes), used, manifest)
    problems += _check_tensors(
        "destination", destinations, dict(mine.destination_shapes), set(mine.destination_shapes), manifest
    )
    problems += [
        f"destination tensor {name!r} is not contiguous: pass a contiguous tensor (e.g. a parameter's .data)"
        for name, tensor in destinations.items()
        if hasattr(tensor, "is_contiguous") and not tensor.is_contiguous()
    ]
    return problems


# ----------------------------------------------------------------------------- schedule


def _pieces(transfer: Any, cap: int) -> Iterator[_Piece]:
    """A transfer cut along its first dim with extent > 1 into pieces of at most ``cap`` bytes (or one slab)."""
    shape = tuple(stop - start for start, stop in transfer.box)
    nbytes = int(transfer.bytes)
    dim = next((d for d, n in enumerate(shape) if n > 1), None)
    if dim is None or nbytes <= cap:
        yield _Piece(transfer.tensor, shape, tuple(transfer.src_offset), tuple(transfer.dst_offset), nbytes)
        return
    slab = nbytes // shape[dim]
    step = max(1, cap // slab)
    for start in range(0, shape[dim], step):
        n = min(step, shape[dim] - start)
        cut = (*shape[:dim], n, *shape[dim + 1 :])
        src = tuple(o + start if d == dim else o for d, o in enumerate(transfer.src_offset))
        dst = tuple(o + start if d == dim else o for d, o in enumerate(transfer.dst_offset))
        yield _Piece(transfer.tensor, cut, src, dst, slab * n)


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _messages(transfers: Sequence[Any], cap: int) -> list[tuple[tuple[tuple[_Piece, int], ...], int]]:
    """The messages between one ordered pair of ranks, as both of them derive them: (pieces with their
    byte offsets, message bytes).

    Transfers are sorted and cut to at most ``cap`` bytes; a piece of ``_SOLO_BYTES`` or more travels
    alone (then it can go from and into the tensors themselves), smaller ones are packed in order into
    messages of at most ``cap`` bytes. The cut depends on sizes alone, never on either side's strides,
    so the sender and the receiver cut alike.
    """
    out: list[tuple[tuple[tuple[_Piece, int], ...], int]] = []
    packed: list[tuple[_Piece, int]] = []
    size = 0
    for transfer in sorted(transfers):
        for piece in _pieces(transfer, cap):
            if piece.nbytes >= _SOLO_BYTES:
                out.append((((piece, 0),), piece.nbytes))
                continue
            offset = _aligned(size)
            if packed and offset + piece.nbytes > cap:
                out.append((tuple(packed), size))
                packed, offset = [], 0
            packed.append((piece, offset))
            size = offset + piece.nbytes
    if packed:
        out.append((tuple(packed), size))
    return out


def _by_peer(transfers: Sequence[Any], attr: str) -> dict[int, list[Any]]:
    peers: dict[int, list[Any]] = {}
    for transfer in transfers:
        peers.setdefault(getattr(transfer, attr), []).append(transfer)
    return peers


@dataclass
class _Message:
    """One send or receive of this rank: its place in the world-wide order, its pieces, and where its
    bytes live here (the tensor slice itself, or ``staged`` bytes at ``slot`` of the staging buffer)."""

    key: tuple[int, int, int]  # (index within its pair, src, dst): the order every rank agrees on
    peer: int
    send: bool
    pieces: tuple[tuple[_Piece, int], ...]
    nbytes: int
    in_place: torch.Tensor | None
    slot: int = 0

    @property
    def staged(self) -> int:
        return 0 if self.in_place is not None else self.nbytes

    @property
    def payload(self) -> int:
        return sum(piece.nbytes for piece, _ in self.pieces)


def _schedule(
    mine: Any, rank: int, sources: Mapping[str, Any], destinations: Mapping[str, Any], cap: int, budget: int
) -> list[list[_Message]]:
    """This rank's messages in the world-wide order, cut into rounds whose staged bytes fit ``budget``.

    The order is (index within the pair, src, dst): both ends of a pair give each message the same key,
    and every rank posts its messages in increasing key, one round (a prefix of what is left) at a
    time. So the smallest unfinished message of the whole world is in the current round of both its
    ends, and completes: no set of ranks can wait on each other in a cycle, however each rank cuts its
    rounds. A message staged here takes its bytes of the round's budget; one sent from or received
    into a contiguous tensor slice takes none, so rounds are few when the layouts line up.
    """
    messages = []
    for send, transfers, tensors in ((True, mine.sends, sources), (False, mine.recvs, destinations)):
        for peer, pair in _by_peer(transfers, "dst" if send else "src").items():
            src, dst = (rank, peer) if send else (peer, rank)
            for index, (pieces, nbytes) in enumerate(_messages(pair, cap)):
                in_place = None
                if len(pieces) == 1:
                    piece = pieces[0][0]
                    view = _view(tensors[piece.tensor], piece.src_offset if send else piece.dst_offset, piece.shape)
                    in_place = _as_bytes(view) if view.is_contiguous() else None
                messages.append(_Message((index, src, dst), peer, send, pieces, nbytes, in_place))
    messages.sort(key=lambda message: message.key)
    rounds: list[list[_Message]] = []
    current: list[_Message] = []
    used = 0
    for message in messages:
        if current and used + message.staged > budget:
            rounds.append(current)
            current, used = [], 0
        message.slot = used
        used = _aligned(used + message.staged)
        current.append(message)
    if current:
        rounds.append(current)
    return rounds


# ----------------------------------------------------------------------------- tensors


def _view(tensor: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    return tensor[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


def _copy_locally(copies: Sequence[Any], sources: Mapping[str, Any], destinations: Mapping[str, Any]) -> int:
    copied = 0
    for transfer in sorted(copies):
        shape = tuple(stop - start for start, stop in transfer.box)
        _view(destinations[transfer.tensor], tuple(transfer.dst_offset), shape).copy_(
            _view(sources[transfer.tensor], tuple(transfer.src_offset), shape)
        )
        copied += int(transfer.bytes)
    return copied


# ----------------------------------------------------------------------------- world agreement


def _store() -> Any:
    from torch.distributed import distributed_c10d

    return distributed_c10d._get_default_store()


def _listed(ranks: Sequence[int]) -> str:
    shown = ", ".join(map(str, ranks[:_MAX_NAMED]))
    return f"[{shown}{', ...' if len(ranks) > _MAX_NAMED else ''}]"


class _Failure(NamedTuple):
    """One rank's report: what kind of failure, which ranks it blames, and why."""

    kind: str  # "input" (rejected before any byte moved) or "peer"
    blamed: tuple[int, ...]
    message: str


class _World:
    """Store-side bookkeeping of one execute call: failures reported, and two barriers."""

    def __init__(self, rank: int, world: int, prefix: str, deadline: float, timeout: float) -> None:
        self.rank, self.world, self.prefix, self.deadline, self.timeout = rank, world, prefix, deadline, timeout
        self.store = _store()

    def remaining(self) -> timedelta:
        return timedelta(seconds=max(0.001, self.deadline - time.monotonic()))

    def report(self, failure: _Failure) -> None:
        """Leave this rank's failure where the others look (best effort: the store's host may be dead)."""
        blamed = ",".join(map(str, failure.blamed))
        record = f"{self.rank}\x1f{failure.kind}\x1f{blamed}\x1f{failure.message[:400]}\x1e"
        try:
            self.store.append(f"{self.prefix}/failed", record)
            if failure.kind == "peer":  # wake the ranks already waiting at the end (inputs: all still arrive)
                self.store.set(f"{self.prefix}/end/done", "1")
        except Exception:  # nothing more to do: the caller raises anyway
            log.debug("shardcore refit: could not report the failure to the store", exc_info=True)

    def failures(self) -> dict[int, _Failure]:
        """Failures ranks reported, by rank ({} if the store cannot be read)."""
        try:
            if not self.store.check([f"{self.prefix}/failed"]):
                return {}
            text = self.store.get(f"{self.prefix}/failed").decode(errors="replace")
        except Exception:  # the store's host died: no reports to read
            return {}
        found: dict[int, _Failure] = {}
        for record in filter(None, text.split("\x1e")):
            rank, kind, blamed, message = record.split("\x1f", 3)
            found.setdefault(int(rank), _Failure(kind, tuple(int(r) for r in blamed.split(",") if r), message))
        return found

    def barrier(self, phase: str) -> None:
        """Wait for every rank at ``phase`` until the deadline: one store wait on a key that the last rank
        to arrive sets, or a rank that failed in the exchange (so the others need not wait out the deadline).

        Raises naming the ranks at fault: those reported by others, else those that never arrived.
        """
        key = f"{self.prefix}/{phase}"
        try:
            self.store.set(f"{key}/at/{self.rank}", "1")
            if self.store.add(f"{key}/arrived", 1) == self.world:
                self.store.set(f"{key}/done", "1")
            self.store.wait([f"{key}/done"], self.remaining())  # times out (and c10d logs it) only on a fault
        except Exception as error:  # a timeout, a reported failure, or the store's host is gone
            failed = self.failures()
            if failed:
                raise self.failed_error(failed) from None
            missing = self._missing(key)
            if missing is None:
                raise RefitPeerError(
                    f"rank {self.rank}: lost the store at refit {phase} ({error}); its host (rank 0 under torchrun) "
                    f"has probably died",
                    [0],
                ) from None
            self._read_by_all(key, self.world - len(missing), _READ_GRACE)
            raise RefitPeerError(
                f"rank {self.rank}: ranks {_listed(missing)} did not reach refit {phase} within {self.timeout:g}s: "
                f"every rank of the world must call refit execute (is one dead, slow, or running other code?)",
                missing,
            ) from None
        failed = self.failures()
        if phase == "end":  # the last store reads of the call: rank 0 must not leave (and may take the store) first
            self._read_by_all(key, self.world, _READ_GRACE if failed else self.remaining().total_seconds())
        if failed:
            raise self.failed_error(failed)

    def _read_by_all(self, key: str, arrived: int, seconds: float) -> None:
        """Count this rank as done reading the store at ``key``, and on rank 0 (the store's host under
        torchrun) wait, up to ``seconds``, until the ``arrived`` ranks have read it too. After the end
        barrier, or when every rank times out at about the same moment, rank 0 could otherwise return
        and exit first, and take the store with it before the others had read what they need."""
        try:
            done = self.store.add(f"{key}/read", 1)
            grace = time.monotonic() + seconds
            while self.rank == 0 and done < arrived and time.monotonic() < grace:
                time.sleep(0.01)
                done = self.store.add(f"{key}/read", 0)
        except Exception:  # the store is gone: nothing left to wait for
            log.debug("shardcore refit: the store went away after a barrier timed out", exc_info=True)

    def _missing(self, key: str) -> list[int] | None:
        try:
            return [r for r in range(self.world) if not self.store.check([f"{key}/at/{r}"])]
        except Exception:  # the store is unreachable
            return None

    def failed_error(self, failed: dict[int, _Failure]) -> RefitInputError | RefitPeerError:
        """One error for every rank: the ranks at fault are those blamed that did not report themselves."""
        ranks = sorted(failed)
        first = failed[ranks[0]]
        if all(f.kind == "input" for f in failed.values()):
            return RefitInputError(
                f"rank {self.rank}: refit inputs rejected on ranks {_listed(ranks)} before any byte moved; "
                f"rank {ranks[0]}: {first.message}"
            )
        blamed = {r for f in failed.values() for r in f.blamed}
        culprits = sorted(blamed - set(failed)) or sorted(blamed) or ranks
        return RefitPeerError(
            f"rank {self.rank}: refit failed; ranks at fault: {_listed(culprits)} "
            f"(rank {ranks[0]} reported: {first.message})",
            culprits,
        )

    def cleanup_previous(self) -> None:
        """Drop the previous call's keys, now that every rank is past it: each rank its own, rank 0 the shared."""
        global _previous_prefix
        previous, _previous_prefix = _previous_prefix, self.prefix
        if previous is None:
            return
        keys = [f"{previous}/{phase}/at/{self.rank}" for phase in ("start", "end")]
        if self.rank == 0:
            keys += [f"{previous}/failed"]
            keys += [f"{previous}/{phase}/{key}" for phase in ("start", "end") for key in ("arrived", "done", "read")]
        for key in keys:
            try:
                self.store.delete_key(key)
            except Exception:  # best effort
                return


# ----------------------------------------------------------------------------- execute


def execute_refit(
    plan: Any,
    sources: Mapping[str, Any],
    destinations: Mapping[str, Any],
    *,
    timeout: float | timedelta | None = None,
    bucket_bytes: int = DEFAULT_BUCKET_BYTES,
) -> TransferStats:
    """Move this rank's part of ``plan``; every rank of the default group calls it, idle ranks too.

    Args:
        plan: a ``RefitPlan`` (``shardcore.refit.plan_refit``) or any object with ``manifest`` and
            ``for_rank(rank)`` returning sends, recvs, copies, source_shapes and destination_shapes.
        sources: tensor name -> this rank's local source tensor (the layout's ``src`` side).
        destinations: tensor name -> this rank's preallocated, contiguous local destination tensor.
        timeout: seconds (or a timedelta) for the whole call; default 300 s.
        bucket_bytes: staging memory for packed and non-contiguous pieces in flight at once (sends
            and receives together); a piece larger than half is cut along its first dim, so the
            staging buffer (``TransferStats.peak_buffer_bytes``) stays within ``bucket_bytes``
            unless one slab of the first dim alone is larger.

    Returns:
        This rank's TransferStats.

    Raises:
        RefitInputError: on every rank, before any byte moves, when a rank's tensors are missing or
            have the wrong shape or dtype (the message names the tensor, expected and actual).
        RefitPeerError: on every surviving rank, within ``timeout``, when a rank died, never called
            execute or failed; ``.ranks`` and the message name it.
    """
    global _calls
    import_torch()
    import torch.distributed as dist

    if not dist.is_available() or not dist.is_initialized():
        raise RefitInputError("torch.distributed is not initialized: call torch.distributed.init_process_group() first")
    if isinstance(bucket_bytes, bool) or not isinstance(bucket_bytes, int) or bucket_bytes < 2 * _ALIGN:
        raise RefitInputError(f"bucket_bytes={bucket_bytes!r}: expected an integer of at least {2 * _ALIGN}")
    seconds = (
        timeout.total_seconds()
        if isinstance(timeout, timedelta)
        else DEFAULT_TIMEOUT
        if timeout is None
        else float(timeout)
    )
    if not seconds > 0:
        raise RefitInputError(f"timeout={timeout!r}: expected a positive number of seconds")
    started = time.monotonic()
    rank, world_size = dist.get_rank(), dist.get_world_size()
    _calls += 1
    world = _World(rank, world_size, f"shardcore/refit/{_calls}", started + seconds, seconds)
    stats = TransferStats(rank)
    mine, problems = None, []
    try:
        mine = plan.for_rank(rank)
        problems = _validate(mine, plan.manifest, sources, destinations)
    except Exception as error:  # reported to every rank, then raised by the barrier
        problems = [f"{type(error).__name__}: {error}"]
    if problems:
        world.report(_Failure("input", (rank,), "; ".join(problems)))
    world.barrier("start")  # raises on every rank if any rank reported a problem
    world.cleanup_previous()
    mine = cast("RankRefit", mine)  # set on every rank: a rank without it reported, and the barrier raised
    try:
        _exchange(mine, rank, sources, destinations, bucket_bytes, world, stats)
    except RefitPeerError as error:
        world.report(_Failure("peer", error.ranks, str(error)))
        failed = world.failures()
        raise (world.failed_error(failed) if set(failed) - {rank} else error) from None
    world.barrier("end")
    stats.seconds = time.monotonic() - started
    log.info(
        "shardcore refit: rank %d received %d B, copied %d B, sent %d B in %.3f s (%.3f GB/s), %d buckets, %d peers",
        rank,
        stats.bytes_received,
        stats.bytes_copied,
        stats.bytes_sent,
        stats.seconds,
        stats.gb_per_s,
        stats.buckets,
        stats.peers,
    )
    return stats


def _exchange(
    mine: Any,
    rank: int,
    sources: Mapping[str, Any],
    destinations: Mapping[str, Any],
    bucket_bytes: int,
    world: _World,
    stats: TransferStats,
) -> None:
    """Post each round's sends and receives, to and from every peer, as one batch; copy locally while the
    first round is on the wire; unpack each staged receive as soon as it has arrived."""
    import torch
    import torch.distributed as dist

    rounds = _schedule(mine, rank, sources, destinations, bucket_bytes // 2, bucket_bytes)
    stats.peers = len({message.peer for round_ in rounds for message in round_})
    stats.peak_buffer_bytes = max((m.slot + m.staged for round_ in rounds for m in round_ if m.staged), default=0)
    device = next((t.device for t in (*sources.values(), *destinations.values())), "cpu")
    staging = torch.empty(stats.peak_buffer_bytes, dtype=torch.uint8, device=device)
    if not rounds:
        stats.bytes_copied = _copy_locally(mine.copies, sources, destinations)
    for number, round_ in enumerate(rounds):
        ops = [dist.P2POp(dist.isend if m.send else dist.irecv, _wire(m, sources, staging), m.peer) for m in round_]
        works = _start(ops, round_, rank, world)
        if number == 0:
            stats.bytes_copied = _copy_locally(mine.copies, sources, destinations)
        for done in _completed(works, round_, rank, world):
            for message in done:
                if message.send:
                    stats.bytes_sent += message.payload
                else:
                    stats.bytes_received += message.payload
                    if message.in_place is None:
                        _unpack(message, staging, destinations)
                log.debug(
                    "shardcore refit: rank %d round %d: %s rank %d, %d pieces, %d B%s",
                    rank,
                    number,
                    "send to" if message.send else "receive from",
                    message.peer,
                    len(message.pieces),
                    message.nbytes,
                    "" if message.in_place is not None else " (staged)",
                )
        stats.buckets += len(round_)


def _wire(message: _Message, sources: Mapping[str, torch.Tensor], staging: torch.Tensor) -> torch.Tensor:
    """The bytes a message goes from or into: the tensor slice itself, or its slot of the staging buffer
    (packed first, for a send)."""
    if message.in_place is not None:
        return message.in_place
    buffer = staging[message.slot : message.slot + message.nbytes]
    if message.send:
        for piece, offset in message.pieces:
            view = _view(sources[piece.tensor], piece.src_offset, piece.shape)
            buffer[offset : offset + piece.nbytes].view(view.dtype).view(piece.shape).copy_(view)
    return buffer


def _unpack(message: _Message, staging: torch.Tensor, destinations: Mapping[str, torch.Tensor]) -> None:
    for piece, offset in message.pieces:
        target = _view(destinations[piece.tensor], piece.dst_offset, piece.shape)
        start = message.slot + offset
        target.copy_(staging[start : start + piece.nbytes].view(target.dtype).view(piece.shape))


def _start(ops: list[Any], pending: list[_Message], rank: int, world: _World) -> list[Any]:
    import torch.distributed as dist

    try:
        return dist.batch_isend_irecv(ops)
    except Exception as error:  # gloo raises RuntimeError when a peer's connection is gone
        raise _peer_failure(error, pending, rank, world) from None


def _completed(works: list[Any], pending: list[_Message], rank: int, world: _World) -> Iterator[list[_Message]]:
    """Wait for each work until the call's deadline and yield the messages it completed: one by one
    where the backend gives a work per op (gloo), so a staged receive is unpacked while later ones
    are still on the wire; all at the end where it coalesces them. Names the peer whose work failed."""
    per_op = len(works) == len(pending)
    for index, work in enumerate(works):
        which = pending[index : index + 1] if per_op else pending
        try:
            work.wait(world.remaining())
        except Exception as error:  # gloo: RuntimeError on timeout or a closed connection
            raise _peer_failure(error, which, rank, world) from None
        if per_op or index == len(works) - 1:
            yield which


def _peer_failure(
    error: BaseException, pending: list[_Message], rank: int, world: _World
) -> RefitInputError | RefitPeerError:
    """Blame a failed wait on the rank that other ranks reported, else on this work's peer."""
    peers = sorted({message.peer for message in pending})
    reported = world.failures()
    if reported:
        return world.failed_error(reported)
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    timed_out = time.monotonic() >= world.deadline - 0.01 or "Timed out" in text
    why = f"did not answer within {world.timeout:g}s" if timed_out else "closed the connection (it has probably died)"
    what = " and ".join(sorted({f"{'send to' if m.send else 'receive from'} peer rank {m.peer}" for m in pending}))
    return RefitPeerError(f"rank {rank}: {what}: the peer {why}; {text[:200]}", peers)


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "TransferStats",
    "execute_refit",
]
