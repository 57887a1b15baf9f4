"""The verl manager's own storage calls (no verl needed): on S3 they reach the endpoint its daemon writes
to, and a failure on rank 0 is every rank's.

The daemon and the worker see one environment: ``CKPTD_STORAGE_ENDPOINT_URL`` (and addressing style, region)
names a moto server, while ``AWS_ENDPOINT_URL_S3`` names a port where nothing listens, so a storage call
made without the ckptd storage options fails instead of finding the server by chance. The manager is
``CkptdMegatronCheckpointManager``'s mixin over a stand-in for verl's class (the methods tested here call
verl's only through ``super()``): rank 0's replacement of an earlier run's step (existence check and
delete), ckptd's retention after a commit, and a load (which root holds the step, and the options the
Megatron load is given). When rank 0 cannot replace such a step, every rank raises (none is left waiting
for it, or goes on to stage the step).
"""

from __future__ import annotations

import json
import os
import uuid
from pathlib import Path
from typing import Any

import pytest
import torch

from ckptd.client import CheckpointClient, Placement
from ckptd.integrations.verl import _CkptdMixin, _has_step, storage_options
from ckptd.testing.fixtures import BUCKET
from ckptd.testing.launch import run_ranks
from ckptd.testing.s3server import S3Server
from ckptd.writer.errors import CkptdError, StorageError

pytestmark = pytest.mark.timeout(180)
NOWHERE = "http://127.0.0.1:9"  # the discard port: nothing listens


class _VerlStandIn:
    """What the mixin's tested methods read of verl's ``MegatronCheckpointManager`` (rank 0, one role)."""

    def __init__(self) -> None:
        self.role, self.rank = "actor", 0
        self.use_megatron_fsdp, self.peft_cls = False, None
        self.should_save_model, self.should_save_optimizer = True, False
        self.should_load_model, self.should_load_optimizer, self.should_load_extra = True, False, False
        self.checkpoint_load_contents = ["model"]
        self.model, self.optimizer, self.lr_scheduler = ["model chunks"], None, None
        self.finalized: list[str] = []

    def _finalize_save(self, *, local_path: str, max_ckpt_to_keep: int | None = None, **kw: Any) -> None:
        self.finalized.append(local_path)  # verl's manifest, tracker and folder retention


Manager = type("Manager", (_CkptdMixin, _VerlStandIn), {"_ckptd_base": _VerlStandIn})


@pytest.fixture
def s3_env(s3: S3Server, monkeypatch: pytest.MonkeyPatch) -> dict[str, str]:
    """The job's environment (this process is the worker; the daemon gets the same)."""
    env = {**s3.env(), "AWS_ENDPOINT_URL_S3": NOWHERE, "CKPTD_STORAGE_ENDPOINT_URL": s3.endpoint_url,
           "CKPTD_STORAGE_ADDRESSING_STYLE": "path", "CKPTD_STORAGE_REGION": s3.region,
           "CKPTD_STORAGE_MAX_ATTEMPTS": "2", "CKPTD_STORAGE_FS_RETRIES": "1"}
    for key, value in env.items():
        monkeypatch.setenv(key, value)
    return env


def _save(socket: str, steps: list[int]) -> None:
    client = CheckpointClient(socket, placement=Placement(0, 1, 1, 0), timeout_s=60)
    try:
        for step in steps:
            client.save(step, {"x": torch.full((8,), float(step))}).wait(60)
    finally:
        client.close()


def test_worker_storage_calls_use_the_daemons_s3_options(
    s3_env: dict[str, str], start_daemon: Any, tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    base = f"s3://{BUCKET}/verl-{uuid.uuid4().hex[:8]}"
    root = f"{base}/actor"
    assert storage_options(root) == {"endpoint_url": s3_env["CKPTD_STORAGE_ENDPOINT_URL"], "addressing_style": "path",
                                     "region": s3_env["AWS_REGION"], "max_attempts": 2, "fs_retries": 1}
    d = start_daemon(root, "d0", env=s3_env)  # reads CKPTD_STORAGE_* itself
    _save(d.socket, [1, 2, 3])
    mgr: Any = Manager()
    monkeypatch.setenv("CKPTD_ROOT", base)

    # rank 0 replaces a step an earlier run committed: found and deleted on the daemon's endpoint
    assert _has_step(root, 2, storage_options(root))
    mgr._drop_abandoned(root, 2)
    assert not _has_step(root, 2, storage_options(root)) and _has_step(root, 3, storage_options(root))

    # ckptd's retention after verl's finalize: the newest 1 of the steps this manager saved (1, then 3)
    first = str(tmp_path / "checkpoints" / "global_step_1" / "actor")
    local = str(tmp_path / "checkpoints" / "global_step_3" / "actor")
    mgr._finalize_save(local_path=first, max_ckpt_to_keep=1)
    assert _has_step(root, 1, storage_options(root))
    mgr._finalize_save(local_path=local, max_ckpt_to_keep=1)
    assert mgr.finalized == [first, local]
    assert not _has_step(root, 1, storage_options(root)) and _has_step(root, 3, storage_options(root))

    # a load: the step is looked for where CKPTD_ROOT points now, else where the manifest says it went
    os.makedirs(local)
    Path(local, "ckpt_contents.json").write_text(json.dumps({"ckptd": {"root": root, "step": 3}, "contents": {}}))
    loads: list[tuple[str, int, dict[str, object]]] = []

    class Loaded:
        extra: dict[str, object] = {}
        source_rank = 0

    def fake_load(at: str, step: int, *a: Any, storage_options: dict[str, object], **kw: Any) -> Loaded:
        loads.append((at, step, storage_options))
        return Loaded()

    monkeypatch.setattr("ckptd.client.megatron.load_checkpoint", fake_load)
    mgr.load_checkpoint(local)
    monkeypatch.setenv("CKPTD_ROOT", f"{base}-moved")  # nothing there: the manifest's root is used
    mgr.load_checkpoint(local)
    assert loads == [(root, 3, storage_options(root))] * 2


def _drop_fails_on_rank0(rank: int, world: int, root: str) -> tuple[str, str] | None:
    """Rank 0's storage refuses the existence check; every rank then does what it would do next."""
    import torch.distributed as dist

    import ckptd.integrations.verl as verl

    if rank == 0:
        def refused(*a: Any, **kw: Any) -> bool:
            raise StorageError(f"{root}: the endpoint refused the request")

        verl._has_step = refused
    mgr: Any = Manager()
    mgr.rank = rank
    outcome = None
    try:
        mgr._drop_abandoned(root, 2)
    except CkptdError as exc:
        outcome = (type(exc).__name__, str(exc))
    dist.barrier()  # the ranks go on together (with rank 0 still alive, as a Ray worker stays after a raise)
    return outcome


def test_a_failure_on_rank_0_is_every_ranks(tmp_path: Path) -> None:
    root = str(tmp_path / "ckptd" / "actor")
    got = run_ranks(_drop_fails_on_rank0, 2, root, timeout_s=120)
    assert got[0] == ("StorageError", f"{root}: the endpoint refused the request")
    assert got[1] is not None and got[1][0] == "StepFailedError", got  # not left waiting, nor staging
    assert "rank 0 could not replace" in got[1][1] and "StorageError" in got[1][1]
