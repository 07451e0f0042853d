"""How a refit is executed (``ExecuteOptions``): one object, checked once, for every way in.

``shardcore.execute_refit``, the plugins' ``refit()`` wrappers and ``shardcore refit --check`` all take the
executor's knobs through it, so that a value the executor cannot run (``bucket_bytes=1``) is refused where it is
made: in the CLI's parent before any process starts, in a library call before any rank meets. Torch-free, so the
CLI checks it without importing the engine.
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from datetime import timedelta
from enum import StrEnum
from typing import Literal, NamedTuple

from ..errors import OptionValueError, RefitInputError, ShardcoreError
from ..plan.arguments import as_timedelta, count_problem, shown
from .schedule import ALIGN

DEFAULT_BUCKET_BYTES = 64 << 20
"""Bytes one batch may hold, and so the most staging memory one rank uses at a time."""
MIN_BUCKET_BYTES = 2 * ALIGN
"""The smallest bucket the schedule can cut: two aligned pieces (a send's and a receive's) of one pair."""
MAX_BUCKET_BYTES = 1 << 50
DEFAULT_MAX_OPS = 256
"""Operations per ``batch_isend_irecv``: pytorch/pytorch #174288 saw NCCL hang at ~1,000 ops per batch and
never at 256, and PR #174942 proposed chunking at 256 (``TORCH_NCCL_BATCH_P2P_CHUNK_SIZE``)."""
MIN_MAX_OPS = 2
"""A batch holds at least a send and its receive."""
MAX_MAX_OPS = 1 << 20
MAX_VERSION = 1 << 62


class Verify(StrEnum):
    """How received messages are checked against their sender's ledger."""

    SIZE = "size"
    """Every message's size (the default)."""
    CHECKSUM = "checksum"
    """Its size and a checksum of its bytes, computed by the sender and again by the receiver."""


class OptionFlag(NamedTuple):
    """How an option is given on the command line (``shardcore refit --check``)."""

    flag: str
    metavar: str | None
    """None: a switch (given or not), or a choice of ``choices``."""
    help: str
    choices: tuple[str, ...] | None = None
    """The values a choice takes; None: a switch or a whole number."""
    minimum: Literal[0, 1] = 1
    """The least whole number the flag parses (0 where 0 means something, as a version does); the executor's
    own range (``ExecuteOptions``) is checked after, naming the flag."""


DELTA_SHAPING = ("anchor_every", "delta_checksum")
"""The options that shape a delta refit, and so need ``delta``."""

OPTION_FLAGS: dict[str, OptionFlag] = {
    "bucket_bytes": OptionFlag(
        "--bucket-bytes",
        "N",
        f"bytes one batch of messages may hold, and so the staging memory a rank uses; at least {MIN_BUCKET_BYTES} "
        f"(default {DEFAULT_BUCKET_BYTES >> 20} MiB)",
    ),
    "max_ops": OptionFlag(
        "--max-ops", "N", f"operations per batch_isend_irecv (default {DEFAULT_MAX_OPS}, safe for NCCL)"
    ),
    "verify": OptionFlag(
        "--verify",
        None,
        "check each received message's size against its sender's ledger (size, the default), or its size and a "
        "checksum of its bytes",
        choices=tuple(str(value) for value in Verify),
    ),
    "version": OptionFlag(
        "--refit-version",
        "STEP",
        "the refit's version (e.g. the training step), recorded with the destinations",
        minimum=0,
    ),
    "delta": OptionFlag(
        "--delta",
        None,
        "a delta refit: a first refit, a simulated optimizer step, then a second refit that sends only what changed "
        "(versions --refit-version, default 1, and the next)",
    ),
    "anchor_every": OptionFlag("--anchor-every", "K", "every version divisible by K is a full refit"),
    "delta_checksum": OptionFlag(
        "--delta-checksum", None, "checksum every destination piece once written, against its sender's"
    ),
}
"""The CLI's flag for each option but ``timeout`` (``--timeout``, which every live command shares): the CLI builds
its flags from it and names a refused value by its flag (``OptionValueError.field``)."""


@dataclass(frozen=True)
class ExecuteOptions:
    """The executor's knobs, checked when made; picklable, so a live check hands them to its workers.

    Attributes:
        timeout: Seconds (or a timedelta) for the whole call; None: ``plan.arguments.DEFAULT_TIMEOUT``.
        bucket_bytes: Bytes one batch may hold: staging memory for packed and non-contiguous pieces stays
            within it. At least ``MIN_BUCKET_BYTES``.
        max_ops: Operations per ``batch_isend_irecv`` (default 256, safe for NCCL).
        verify: ``size`` checks every received message's size against its sender's ledger; ``checksum`` also
            a checksum of its bytes.
        version: This refit's version (e.g. the training step), recorded for ``held_version``; None: none.
        delta: Send each piece as its changes since the version its destination holds (a delta refit, needs
            ``version``): a destination that holds another version gets it dense. Each sender keeps one copy of
            the bytes it sends (``engine.transfer.delta``).
        anchor_every: With ``delta``, every version divisible by it is a full (dense) refit; None: never.
        delta_checksum: With ``delta``, every destination piece is checksummed once written, against its
            sender's bytes: a mismatch is a ``RefitIntegrityError`` naming the tensor.

    Raises:
        RefitInputError: naming the field, its value and what is accepted.
    """

    timeout: float | timedelta | None = None
    bucket_bytes: int = DEFAULT_BUCKET_BYTES
    max_ops: int = DEFAULT_MAX_OPS
    verify: str = Verify.SIZE.value
    version: int | None = None
    delta: bool = False
    anchor_every: int | None = None
    delta_checksum: bool = False

    def __post_init__(self) -> None:
        _checked_timeout(self.timeout)
        _check_count("bucket_bytes", self.bucket_bytes, MIN_BUCKET_BYTES, MAX_BUCKET_BYTES)
        _check_count("max_ops", self.max_ops, MIN_MAX_OPS, MAX_MAX_OPS)
        if self.verify not in tuple(Verify):
            raise OptionValueError("verify", shown(self.verify), f"expected one of {', '.join(Verify)}")
        object.__setattr__(self, "verify", str(Verify(self.verify)))
        if self.version is not None:
            _check_count("version", self.version, 0, MAX_VERSION)
        if not isinstance(self.delta, bool) or not isinstance(self.delta_checksum, bool):
            raise RefitInputError(
                f"delta={shown(self.delta)}, delta_checksum={shown(self.delta_checksum)}: expected bools"
            )
        if self.anchor_every is not None:
            _check_count("anchor_every", self.anchor_every, 1, MAX_VERSION)
        if any(getattr(self, name) not in (None, False) for name in DELTA_SHAPING) and not self.delta:
            raise RefitInputError("anchor_every and delta_checksum shape a delta refit: pass delta=True too")

    @property
    def delta_terms(self) -> str:
        """The delta settings as every rank must bring them alike (``off`` for a dense refit)."""
        if not self.delta:
            return "off"
        anchor = "" if self.anchor_every is None else f", anchor every {self.anchor_every}"
        return f"on{anchor}" + (", checksum after applying" if self.delta_checksum else "")

    @property
    def anchor(self) -> bool:
        """Whether this refit sends every piece dense: a delta refit whose version ``anchor_every`` divides."""
        return self.anchor_every is not None and self.version is not None and self.version % self.anchor_every == 0

    @property
    def wait(self) -> timedelta:
        """The timeout as a timedelta."""
        return _checked_timeout(self.timeout)

    @classmethod
    def merged(cls, options: ExecuteOptions | None = None, **given: object) -> ExecuteOptions:
        """``options`` (or the defaults) with each keyword in ``given`` that is not None in its place: how
        ``execute_refit(..., options=o, bucket_bytes=b)`` and the plugins' wrappers read their arguments.
        ``options`` itself when nothing is given: it was checked when made, and is not checked again.

        Raises:
            RefitInputError: ``options`` that is not an ExecuteOptions, or a value the executor cannot run.
        """
        if options is not None and not isinstance(options, ExecuteOptions):
            raise RefitInputError(f"options={shown(options)}: expected a shardcore.ExecuteOptions")
        names = {field.name for field in fields(cls)}
        unknown = sorted(set(given) - names)
        if unknown:
            raise RefitInputError(f"{unknown[0]}: not an option of the executor ({', '.join(sorted(names))})")
        chosen = {name: value for name, value in given.items() if value is not None}
        if options is not None and not chosen:
            return options
        return replace(options, **chosen) if options is not None else cls(**chosen)  # type: ignore[arg-type]


def _check_count(field: str, value: object, minimum: int, maximum: int) -> None:
    """Refuse ``value`` unless it is a whole number in ``[minimum, maximum]``.

    Raises:
        OptionValueError: naming ``field``, the value and the range.
    """
    problem = count_problem(value, minimum=minimum, maximum=maximum)
    if problem is not None:
        raise OptionValueError(field, shown(value), problem)


def _checked_timeout(timeout: object) -> timedelta:
    """``timeout`` as a timedelta (None: the default).

    Raises:
        RefitInputError: a timeout that is not positive seconds or a timedelta.
    """
    try:
        return as_timedelta(timeout)
    except ShardcoreError as error:
        raise RefitInputError(str(error)) from None


__all__ = [
    "DEFAULT_BUCKET_BYTES",
    "DEFAULT_MAX_OPS",
    "DELTA_SHAPING",
    "MIN_BUCKET_BYTES",
    "MIN_MAX_OPS",
    "OPTION_FLAGS",
    "ExecuteOptions",
    "OptionFlag",
    "Verify",
]
