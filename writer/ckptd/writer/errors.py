"""The one error hierarchy of ckptd.

Every error ckptd raises derives from :class:`CkptdError`; each subclass also inherits the builtin it
resembles, so ``except TimeoutError`` or ``except FileNotFoundError`` keep working for callers that do
not know ckptd. The daemon sends errors to clients by class name (``code``) and message; the client
re-raises the same class, so a typed error survives the socket.

This module lives in the writer (the lowest layer) so that every layer can import it; it imports
nothing heavy.
"""

from __future__ import annotations

import errno

#: errno values that mean "no space": the disk is full or the user's quota is spent
NO_SPACE_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT})


class CkptdError(Exception):
    """Root of every ckptd error."""


# --- input rejected -------------------------------------------------------------------------------
class InvalidRequestError(CkptdError, ValueError):
    """A request or state dict that ckptd refuses: the message says what and where."""


class ConfigError(CkptdError, ValueError):
    """A daemon or storage option that is unknown, of the wrong type or out of range (file, env or flag)."""


class ProtocolError(InvalidRequestError):
    """A malformed, oversized or undecodable message on the daemon socket."""


class InternalError(CkptdError, RuntimeError):
    """The daemon failed on a request through a fault of its own (its log holds the traceback); the
    connection stays usable."""


class ProtocolVersionError(ProtocolError):
    """The peer speaks a protocol version this side does not."""


class InvalidKeyError(InvalidRequestError):
    """A tensor key that is not a safe relative name (``..``, absolute, empty parts, bad characters)."""


class UnsupportedDtypeError(InvalidRequestError, TypeError):
    """A tensor dtype ckptd cannot store."""


class ShardLayoutError(InvalidRequestError):
    """Shards of one array overlap, leave gaps, disagree on global shape or dtype, or cross chunks."""


class LeaseError(InvalidRequestError):
    """A save names a staging lease that was never granted to this connection, or misuses it."""


class StepCommittedError(InvalidRequestError, FileExistsError):
    """The step already committed; a committed step is never written again."""


class DuplicateSaveError(InvalidRequestError):
    """The same rank saved the same step twice while it was in flight."""


class PlacementError(CkptdError, ValueError):
    """This rank's global rank, world size or node cannot be told from the launcher's environment."""


# --- capacity and time ----------------------------------------------------------------------------
class ArenaError(CkptdError, MemoryError):
    """The staging arena cannot hold the request at all (larger than the whole arena)."""


class BackpressureError(CkptdError, BlockingIOError):
    """The staging arena is full (a previous save is still draining) and the policy said not to wait."""


class SaveTimeoutError(CkptdError, TimeoutError):
    """Waiting for a staging slot, a node part or a commit exceeded its timeout."""


# --- daemon and storage ---------------------------------------------------------------------------
class DaemonUnavailableError(CkptdError, ConnectionError):
    """No daemon answers on the socket, or the connection to it broke."""


class DaemonShuttingDownError(DaemonUnavailableError):
    """The daemon is draining after SIGTERM and accepts no new saves."""


class RootMismatchError(CkptdError, ValueError):
    """The daemon on the socket writes to another checkpoint root than the one this client was given."""


class JobMismatchError(CkptdError, ValueError):
    """The daemon on the socket belongs to another, still running job (the message names both jobs)."""


class StaleDaemonError(JobMismatchError):
    """The daemon on the socket belongs to another job that is over; it is draining and about to exit.

    A client with ``start_daemon=True`` waits for it to exit and starts its own; ``daemon_pid`` is its pid."""

    def __init__(self, message: str, daemon_pid: int = 0) -> None:
        super().__init__(message)
        self.daemon_pid = daemon_pid


class StepFailedError(CkptdError, RuntimeError):
    """A save was accepted but the step did not commit; the message carries the cause."""


class StepAbandonedError(StepFailedError):
    """The daemon writing the step died; its successor marked the step failed: it will never commit."""


class StepStateError(CkptdError, RuntimeError):
    """A step job was asked for a transition its state machine forbids (a daemon bug, never bad input)."""


class StorageError(CkptdError, OSError):
    """Storage refused an operation for good (after retries where retrying made sense)."""


class StoragePermissionError(StorageError, PermissionError):
    """Credentials missing or wrong, or access denied to the bucket/prefix named in the message."""


class StorageNotFoundError(StorageError, FileNotFoundError):
    """The bucket, root or object does not exist."""


class StorageFullError(StorageError):
    """The storage has no space left (``ENOSPC``) or the user's quota is spent (``EDQUOT``): the step
    fails, earlier steps stay intact, and the next step can commit once space returns."""


class CheckpointNotFoundError(CkptdError, FileNotFoundError):
    """No committed checkpoint for the requested step (or none at all for ``latest``)."""


class NoCommittedStepError(CheckpointNotFoundError):
    """The root holds no committed step at all (or does not exist): what ``latest`` finds before the first
    commit. Megatron-LM's loader starts from scratch on it, and on nothing else."""


class UncommittedStepError(CheckpointNotFoundError):
    """The step exists in storage but never committed: it is not a checkpoint."""


class CorruptCheckpointError(CkptdError, ValueError):
    """Stored bytes disagree with their checksums or manifests."""


class UnsupportedFormatError(CorruptCheckpointError):
    """The checkpoint is stored in a format version newer than this ckptd reads."""


class StateMismatchError(CkptdError, KeyError):
    """The template to load into differs from the checkpoint (missing/extra key, shape or dtype)."""

    def __str__(self) -> str:  # KeyError quotes its message; keep it readable
        return str(self.args[0]) if self.args else ""


class LayoutMismatchError(StateMismatchError):
    """The checkpoint was written with another TP/PP layout than the loader's."""


def first_leaf(exc: BaseException) -> BaseException:
    """The first real exception inside (possibly nested) exception groups: what a task group's failure
    reaches the caller as (its typed error, not an ``ExceptionGroup``)."""
    while isinstance(exc, BaseExceptionGroup) and exc.exceptions:
        exc = exc.exceptions[0]
    return exc


def error_classes() -> dict[str, type[CkptdError]]:
    """Every concrete error class by name, for re-raising errors received over the socket."""
    found: dict[str, type[CkptdError]] = {}
    stack: list[type[CkptdError]] = [CkptdError]
    while stack:
        cls = stack.pop()
        found[cls.__name__] = cls
        stack.extend(cls.__subclasses__())
    return found


class PlanUnknownError(LeaseError):
    """A save names a registered save plan the daemon does not hold (it restarted, or dropped an old plan):
    the client registers the plan again and retries."""
