"""What a training rank imports: save to the node daemon, load from storage.

Importing this package loads no zarr/fsspec and starts no thread or event loop. Its names are imported
on first use: the save path (:mod:`ckptd.client.client`, which needs torch) and the readers (``load``,
``read_commit``, ``read_flat``, ``read_sidecar``: :mod:`ckptd.client.reader`, which need zarr/fsspec),
so that light submodules (``ckptd.client.paths``, ``ckptd.client.protocol``) import without either.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from ckptd.writer.errors import (
    BackpressureError,
    CheckpointNotFoundError,
    CkptdError,
    DaemonUnavailableError,
    InvalidKeyError,
    JobMismatchError,
    NoCommittedStepError,
    PlacementError,
    RootMismatchError,
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
    "DaemonUnresponsiveError",
    "InvalidKeyError",
    "JobMismatchError",
    "NoCommittedStepError",
    "Placement",
    "PlacementError",
    "RootMismatchError",
    "SaveHandle",
    "SaveTimeoutError",
    "Shard",
    "StateDict",
    "StateMismatchError",
    "StepFailedError",
    "StepState",
    "UncommittedStepError",
    "load",
    "plan_state",
    "read_commit",
    "read_flat",
    "read_sidecar",
]

if TYPE_CHECKING:
    from ckptd.client.client import CheckpointClient, StateDict
    from ckptd.client.daemon_lost import DaemonUnresponsiveError
    from ckptd.client.handle import SaveHandle
    from ckptd.client.placement import Placement
    from ckptd.client.protocol import StepState
    from ckptd.client.reader import load, read_commit, read_flat, read_sidecar
    from ckptd.client.state import Shard, plan_state

_LAZY = {
    "CheckpointClient": "ckptd.client.client",
    "DaemonUnresponsiveError": "ckptd.client.daemon_lost",
    "Placement": "ckptd.client.placement",
    "SaveHandle": "ckptd.client.handle",
    "StateDict": "ckptd.client.client",
    "StepState": "ckptd.client.protocol",
    "Shard": "ckptd.client.state",
    "plan_state": "ckptd.client.state",
    "load": "ckptd.client.reader",
    "read_commit": "ckptd.client.reader",
    "read_flat": "ckptd.client.reader",
    "read_sidecar": "ckptd.client.reader",
}


def __getattr__(name: str) -> Any:
    module = _LAZY.get(name)
    if module is None:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value
