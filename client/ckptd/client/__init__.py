"""What a training rank imports: save to the node daemon, load from storage.

Importing this package loads no zarr/fsspec and starts no thread or event loop; the readers
(``load``, ``read_commit``, ``read_flat``, ``read_sidecar``: :mod:`ckptd.client.reader`) are imported
on first use.
"""

from typing import Any

from ckptd.client.client import CheckpointClient, Placement, SaveHandle
from ckptd.client.state import Shard, plan_state
from ckptd.writer.errors import (
    BackpressureError,
    CheckpointNotFoundError,
    CkptdError,
    DaemonUnavailableError,
    InvalidKeyError,
    SaveTimeoutError,
    StateMismatchError,
    StepFailedError,
    UncommittedStepError,
)

__all__ = [
    "BackpressureError",
    "CheckpointClient",
    "CheckpointNotFoundError",
    "CkptdError",
    "DaemonUnavailableError",
    "InvalidKeyError",
    "Placement",
    "SaveHandle",
    "SaveTimeoutError",
    "Shard",
    "StateMismatchError",
    "StepFailedError",
    "UncommittedStepError",
    "load",
    "plan_state",
    "read_commit",
    "read_flat",
    "read_sidecar",
]

_READERS = frozenset({"load", "read_commit", "read_flat", "read_sidecar"})


def __getattr__(name: str) -> Any:
    if name in _READERS:  # the readers pull in zarr and fsspec: only when asked for
        from ckptd.client import reader

        return getattr(reader, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
