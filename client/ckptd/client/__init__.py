"""What a training rank imports: save to the node daemon, load from storage.

Importing this package loads no zarr/fsspec and starts no thread or event loop.
"""

from ckptd.client.client import CheckpointClient, Placement, SaveHandle, StateDict
from ckptd.client.protocol import StepState
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
    "StateDict",
    "StateMismatchError",
    "StepFailedError",
    "StepState",
    "UncommittedStepError",
    "plan_state",
]
