"""Execute a refit plan: move every planned slice of every weight with point-to-point sends.

Every rank of the world calls :func:`execute`, idle ranks too. The steps:

1. **Check inputs, then agree.** Each rank checks its source and destination tensors
   against the plan (names, local shapes, dtypes) and the world meets at a store barrier
   where any rank's problem is everyone's error. No byte moves before that.
2. **Local copies** for the pieces a rank holds in both layouts.
3. **Pairwise exchange.** Pieces between two ranks are sorted (sender and receiver sort the
   same transfers the same way), cut along their first dim to fit a bucket, and packed in
   order into buckets of at most ``bucket_bytes / 2`` (one send and one receive buffer are
   live at a time; a piece is sent from, or received into, the tensor itself when its slice
   is contiguous). Step ``s`` pairs rank ``r`` with ``r + s`` (send) and ``r - s`` (receive),
   modulo the world; within a step, round ``j`` moves bucket ``j`` of both pairs with one
   ``batch_isend_irecv``. Every rank walks the steps and rounds in the same order and every
   operation of a round is matched within that round, so no set of ranks can wait on each
   other in a cycle. The same code runs on gloo, NCCL and HCCL.
4. **Agree on the outcome** at a second store barrier, so that a refit that failed anywhere
   fails everywhere, naming the rank at fault.

Faults: gloo breaks a connection whose peer died, and a bounded wait (to the call's
deadline) catches a peer that hangs; a rank that fails leaves the reason in the store, and
the others read it there, so the error names the rank at fault, not merely the rank seen
waiting. (A gloo wait that times out closes the pair, so waits are never sliced and retried.)
"""

from __future__ import annotations

import logging
import time
from collections.abc import Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from datetime import timedelta
from typing import TYPE_CHECKING, Any, NamedTuple, cast

from ..errors import RefitError, ShardcoreError

if TYPE_CHECKING:
    import torch

    from ..refit.planner import RankRefit

log = logging.getLogger("shardcore.refit")

DEFAULT_BUCKET_BYTES = 64 << 20
"""Extra memory one rank may use for packing: half for the send buffer, half for the receive one."""
DEFAULT_TIMEOUT = 300.0
_ALIGN = 16  # byte offset of each piece in a bucket: any dtype's view of it is aligned
_MAX_NAMED = 8
_calls = 0
_previous_prefix: str | None = None


class RefitInputError(RefitError):
    """A rank's source or destination tensors do not match the plan (missing, shape, dtype)."""


class RefitPeerError(ShardcoreError, RuntimeError):
    """A rank died, never arrived or failed during the refit; ``ranks`` names the ones at fault."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


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


@dataclass
class _Bucket:
    """Pieces packed back to back (aligned) into one buffer exchanged with one peer."""

    peer: int
    pieces: list[tuple[_Piece, int]] = field(default_factory=list)
    nbytes: int = 0


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


def _buckets(peer: int, transfers: Sequence[Any], cap: int) -> list[_Bucket]:
    """The pieces for one peer, in the order both sides derive (sorted transfers), packed into buckets."""
    buckets: list[_Bucket] = []
    current = _Bucket(peer)
    for transfer in sorted(transfers):
        for piece in _pieces(transfer, cap):
            offset = -(-current.nbytes // _ALIGN) * _ALIGN
            if current.pieces and offset + piece.nbytes > cap:
                buckets.append(current)
                current, offset = _Bucket(peer), 0
            current.pieces.append((piece, offset))
            current.nbytes = offset + piece.nbytes
    if current.pieces:
        buckets.append(current)
    return buckets


def _by_peer(transfers: Sequence[Any], attr: str) -> dict[int, list[Any]]:
    peers: dict[int, list[Any]] = {}
    for transfer in transfers:
        peers.setdefault(getattr(transfer, attr), []).append(transfer)
    return peers


# ----------------------------------------------------------------------------- tensors


def _view(tensor: torch.Tensor, offset: tuple[int, ...], shape: tuple[int, ...]) -> torch.Tensor:
    return tensor[tuple(slice(o, o + n) for o, n in zip(offset, shape))]


def _as_bytes(tensor: torch.Tensor) -> torch.Tensor:
    """A contiguous tensor's bytes as a flat uint8 view (no copy)."""
    import torch

    return tensor.reshape(-1).view(torch.uint8)


class _Buffers:
    """One reusable byte buffer per direction, grown to the largest bucket seen."""

    def __init__(self, device: Any) -> None:
        self.device, self.peak = device, 0
        self.send: torch.Tensor | None = None
        self.recv: torch.Tensor | None = None

    def get(self, which: str, nbytes: int) -> torch.Tensor:
        import torch

        buffer: torch.Tensor | None = getattr(self, which)
        if buffer is None or buffer.numel() < nbytes:
            buffer = torch.empty(nbytes, dtype=torch.uint8, device=self.device)
            setattr(self, which, buffer)
            self.peak = max(self.peak, sum(b.numel() for b in (self.send, self.recv) if b is not None))
        return buffer[:nbytes]


def _send_tensor(bucket: _Bucket, sources: Mapping[str, torch.Tensor], buffers: _Buffers) -> torch.Tensor:
    """The bytes to send: the source slice itself when it is one contiguous piece, else a packed buffer."""
    if len(bucket.pieces) == 1:
        piece = bucket.pieces[0][0]
        view = _view(sources[piece.tensor], piece.src_offset, piece.shape)
        if view.is_contiguous():
            return _as_bytes(view)
    buffer = buffers.get("send", bucket.nbytes)
    for piece, offset in bucket.pieces:
        view = _view(sources[piece.tensor], piece.src_offset, piece.shape)
        buffer[offset : offset + piece.nbytes].view(view.dtype).view(piece.shape).copy_(view)
    return buffer


def _recv_tensor(
    bucket: _Bucket, destinations: Mapping[str, torch.Tensor], buffers: _Buffers
) -> tuple[torch.Tensor, bool]:
    """Where to receive, and whether it must be unpacked: the destination slice itself when it is
    one contiguous piece, else the receive buffer."""
    if len(bucket.pieces) == 1:
        piece = bucket.pieces[0][0]
        view = _view(destinations[piece.tensor], piece.dst_offset, piece.shape)
        if view.is_contiguous():
            return _as_bytes(view), False
    return buffers.get("recv", bucket.nbytes), True


def _unpack(bucket: _Bucket, buffer: torch.Tensor, destinations: Mapping[str, torch.Tensor]) -> None:
    for piece, offset in bucket.pieces:
        target = _view(destinations[piece.tensor], piece.dst_offset, piece.shape)
        target.copy_(buffer[offset : offset + piece.nbytes].view(target.dtype).view(piece.shape))


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
        """Wait for every rank at ``phase`` until the deadline, polling the store (and failure reports).

        Raises naming the ranks at fault: those reported by others, else those that never arrived.
        """
        key = f"{self.prefix}/{phase}"
        try:
            self.store.set(f"{key}/at/{self.rank}", "1")
            if self.store.add(f"{key}/arrived", 1) == self.world:
                self.store.set(f"{key}/done", "1")
            pause = 0.001
            while not self.store.check([f"{key}/done"]):  # polled: a store wait that times out logs warnings
                if self.failures():
                    raise RefitError("a rank reported a failure")
                if time.monotonic() >= self.deadline:
                    raise TimeoutError(f"refit {phase}")
                time.sleep(pause)
                pause = min(0.1, pause * 2)
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
            raise RefitPeerError(
                f"rank {self.rank}: ranks {_listed(missing)} did not reach refit {phase} within {self.timeout:g}s: "
                f"every rank of the world must call refit execute (is one dead, slow, or running other code?)",
                missing,
            ) from None
        failed = self.failures()
        if failed:
            raise self.failed_error(failed)

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
            keys += [f"{previous}/{phase}/{key}" for phase in ("start", "end") for key in ("arrived", "done")]
        for key in keys:
            try:
                self.store.delete_key(key)
            except Exception:  # best effort
                return


# ----------------------------------------------------------------------------- execute


def execute(
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
        bucket_bytes: extra memory for packing (a send and a receive buffer of half each); a piece
            larger than half is cut along its first dim.

    Returns:
        This rank's TransferStats.

    Raises:
        RefitInputError: on every rank, before any byte moves, when a rank's tensors are missing or
            have the wrong shape or dtype (the message names the tensor, expected and actual).
        RefitPeerError: on every surviving rank, within ``timeout``, when a rank died, never called
            execute or failed; ``.ranks`` and the message name it.
    """
    global _calls
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
        stats.bytes_copied = _copy_locally(mine.copies, sources, destinations)
        _exchange(mine, rank, world_size, sources, destinations, bucket_bytes // 2, world, stats)
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
    world_size: int,
    sources: Mapping[str, Any],
    destinations: Mapping[str, Any],
    cap: int,
    world: _World,
    stats: TransferStats,
) -> None:
    """Pairwise-exchange steps, one batch of (at most) one send and one receive per round."""
    import torch.distributed as dist

    sends = {peer: _buckets(peer, ts, cap) for peer, ts in _by_peer(mine.sends, "dst").items()}
    recvs = {peer: _buckets(peer, ts, cap) for peer, ts in _by_peer(mine.recvs, "src").items()}
    stats.peers = len(set(sends) | set(recvs))
    device = next((t.device for t in (*sources.values(), *destinations.values())), "cpu")
    buffers = _Buffers(device)
    steps = sorted({(peer - rank) % world_size for peer in sends} | {(rank - peer) % world_size for peer in recvs})
    for step in steps:
        out = sends.get((rank + step) % world_size, [])
        into = recvs.get((rank - step) % world_size, [])
        for round_ in range(max(len(out), len(into))):
            ops, pending, unpack = [], [], None
            if round_ < len(out):
                bucket = out[round_]
                ops.append(dist.P2POp(dist.isend, _send_tensor(bucket, sources, buffers), bucket.peer))
                pending.append(("send to", bucket))
            if round_ < len(into):
                bucket = into[round_]
                target, packed = _recv_tensor(bucket, destinations, buffers)
                ops.append(dist.P2POp(dist.irecv, target, bucket.peer))
                pending.append(("receive from", bucket))
                unpack = (bucket, target) if packed else None
            works = _start(ops, pending, rank, world)
            _wait(works, pending, rank, world)
            if unpack is not None:
                _unpack(unpack[0], unpack[1], destinations)
            for what, bucket in pending:
                payload = sum(piece.nbytes for piece, _ in bucket.pieces)
                if what == "send to":
                    stats.bytes_sent += payload
                else:
                    stats.bytes_received += payload
                stats.buckets += 1
                log.debug(
                    "shardcore refit: rank %d step %d round %d: %s rank %d, %d pieces, %d B",
                    rank,
                    step,
                    round_,
                    what,
                    bucket.peer,
                    len(bucket.pieces),
                    bucket.nbytes,
                )
    stats.peak_buffer_bytes = buffers.peak


def _start(ops: list[Any], pending: list[tuple[str, _Bucket]], rank: int, world: _World) -> list[Any]:
    import torch.distributed as dist

    try:
        return dist.batch_isend_irecv(ops)
    except Exception as error:  # gloo raises RuntimeError when a peer's connection is gone
        raise _peer_failure(error, pending, rank, world) from None


def _wait(works: list[Any], pending: list[tuple[str, _Bucket]], rank: int, world: _World) -> None:
    """Wait for each work until the call's deadline; name the peer whose work failed."""
    for index, work in enumerate(works):
        try:
            work.wait(world.remaining())
        except Exception as error:  # gloo: RuntimeError on timeout or a closed connection
            which = pending[index : index + 1] if len(works) == len(pending) else pending
            raise _peer_failure(error, which, rank, world) from None


def _peer_failure(
    error: BaseException, pending: list[tuple[str, _Bucket]], rank: int, world: _World
) -> RefitInputError | RefitPeerError:
    """Blame a failed wait on the rank that other ranks reported, else on this work's peer."""
    peers = sorted({bucket.peer for _, bucket in pending})
    reported = world.failures()
    if reported:
        return world.failed_error(reported)
    text = str(error).splitlines()[0] if str(error) else type(error).__name__
    timed_out = time.monotonic() >= world.deadline - 0.01 or "Timed out" in text
    why = f"did not answer within {world.timeout:g}s" if timed_out else "closed the connection (it has probably died)"
    what = " and ".join(f"{kind} peer rank {bucket.peer}" for kind, bucket in pending)
    return RefitPeerError(f"rank {rank}: {what}: the peer {why}; {text[:200]}", peers)


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "RefitInputError",
    "RefitPeerError",
    "TransferStats",
    "execute",
]
