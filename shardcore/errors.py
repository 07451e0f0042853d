"""Typed errors: every message names the bad value, what was expected and the fix."""

from __future__ import annotations

from collections.abc import Sequence


class ShardcoreError(Exception):
    """Base class of every error shardcore raises on purpose."""


class ShardSpecError(ShardcoreError, ValueError):
    """A shard spec (string, dict, JSON or YAML) is malformed or inconsistent."""


class LayoutError(ShardcoreError, ValueError):
    """Shards do not fit the world, a grid / rank request is out of range, or an argument is bad."""


class NoLayoutError(LayoutError):
    """No layout meets the constraints (ranks, memory, model, kept shards); the message names the one that
    cannot be met and the nearest relaxed constraint that would admit a layout."""


class BackendNotFoundError(ShardcoreError, LookupError):
    """No installed backend has the requested name."""


class BackendUnavailableError(ShardcoreError, RuntimeError):
    """The backend is installed but cannot work here (framework or device missing)."""


class TorchInternalsError(BackendUnavailableError):
    """This torch lacks, or has changed, a torch internal shardcore (or a plugin) relies on: the message names
    it and the torch releases tested."""


class GroupCreationError(ShardcoreError, RuntimeError):
    """Process-group creation failed, timed out, or ranks disagree on how to do it; ``ranks`` names those at fault."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class RefitGroupError(GroupCreationError):
    """A refit group between two jobs could not be formed: nobody serves its store, the jobs disagree on its
    counts or backend, a rank joined twice, or processes never came; ``ranks`` names those at fault."""


class LayoutMismatchError(GroupCreationError):
    """Ranks of one world planned different layouts (config drift between ranks)."""


class CheckError(ShardcoreError, ValueError):
    """A live check (``shardcore check``, ``refit --check``) the machine cannot serve: too many processes, no torch."""


class RefitError(ShardcoreError, ValueError):
    """A refit request does not fit: source/destination shards, ranks, or plan options are inconsistent."""


class ManifestError(RefitError):
    """A model manifest is malformed, or a tensor does not fit a shard (split dim, layers, experts)."""


class RefitInputError(RefitError):
    """A rank's refit arguments or tensors do not match the plan (missing, shape, dtype, device); no byte moved."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class OptionValueError(RefitInputError):
    """An executor option (``ExecuteOptions``) the executor cannot run. ``field``, ``value`` (as shown) and
    ``problem`` let a caller name the option its own way: the CLI by its flag (``refit.options.OPTION_FLAGS``)."""

    def __init__(self, field: str, value: str, problem: str) -> None:
        super().__init__(f"{field}={value}: {problem}")
        self.field, self.value, self.problem = field, value, problem


class RefitMismatchError(RefitInputError):
    """Ranks brought different terms to a refit (another plan, manifest, option or version); no byte moved."""


class LostWeightsError(RefitError):
    """Part of a tensor has no surviving copy (every rank that held it is gone): only a checkpoint can restore
    it; ``ranks`` names the lost ranks that held it. Raised before any byte moves."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class RefitPeerError(ShardcoreError, RuntimeError):
    """A rank died, never arrived or failed during the refit; ``ranks`` names the ones at fault."""

    def __init__(self, message: str, ranks: Sequence[int] = ()) -> None:
        super().__init__(message)
        self.ranks = tuple(ranks)


class RefitIntegrityError(RefitPeerError):
    """A received message was short or corrupt: ``ranks`` names its senders."""


class WorldError(ShardcoreError, RuntimeError):
    """A rank of a test world (``shardcore.testing.run_world``) failed or did not finish in time."""


class ShardSpecWarning(UserWarning):
    """A spec that works but is probably a mistake (a key repeated within a shard: the last value wins)."""
