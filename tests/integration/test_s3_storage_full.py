"""An S3-compatible store that is full, or a quota that is spent, fails the step with StorageFullError.

Real moto server behind the fault proxy, which answers the data uploads the way MinIO (507
``XMinioStorageFull`` on a PUT) and Ceph RGW (403 ``QuotaExceeded`` on an UploadPart of a multipart
upload) do. Every rank's ``wait()`` gets :class:`StorageFullError`, the step's arena space comes back,
the earlier step still loads, and once the store has space again the next step commits.
The mapping of each server's codes is checked in tests/unit/test_s3_space_errors.py.
"""

from __future__ import annotations

import time

import pytest
import torch
from test_s3 import aws_env, in_aws_env, options, s3_flags  # noqa: F401 (fixture)

from ckptd.client import CheckpointClient, Placement, Shard
from ckptd.client.protocol import PROTOCOL_VERSION, ReportRequest, StatusReport
from ckptd.client.reader import load
from ckptd.daemon.commands import request
from ckptd.testing.faultproxy import Fault, FaultProxy
from ckptd.testing.fixtures import BUCKET
from ckptd.testing.s3server import S3Server
from ckptd.writer.errors import StorageFullError

pytestmark = [pytest.mark.s3, pytest.mark.timeout(180), pytest.mark.usefixtures("in_aws_env")]

MiB = 1 << 20
MULTIPART = 100 * MiB  # s3fs uploads an object of >= 2 x 50 MiB as a multipart upload


def _numel(rank: int, numel: int) -> int:
    return numel if rank == 0 else 1024  # rank 0 holds the big array; both ranks are in the step


def _state(rank: int, step: int, numel: int) -> dict[str, Shard]:
    g = torch.Generator().manual_seed(100 * step + rank)
    n = _numel(rank, numel)
    return {f"w{rank}": Shard(f"w{rank}", torch.randn(n, generator=g), (n,), (0,))}


def _loads(root: str, step: int, numel: int, endpoint: str) -> None:
    for rank in range(2):
        n = _numel(rank, numel)
        template = {f"w{rank}": Shard(f"w{rank}", torch.zeros(n), (n,), (0,))}
        load(root, step, template, storage_options=options(endpoint))
        assert torch.equal(template[f"w{rank}"].data, _state(rank, step, numel)[f"w{rank}"].data), (step, rank)


def _report_after_failure(socket_path: str) -> StatusReport:
    deadline = time.monotonic() + 30
    while True:
        report = request(socket_path, ReportRequest(v=PROTOCOL_VERSION), 10)
        assert isinstance(report, StatusReport)
        if report.failures >= 1 or time.monotonic() > deadline:
            return report
        time.sleep(0.05)


CASES = {
    # MinIO below its free-drive threshold: every object PUT of the step's data
    "minio-507-put": dict(path_regex=r"/step_2/w0/c\.", error_status=507, error_code="XMinioStorageFull",
                          numel=(1 * MiB) // 4, chunk="64KiB"),
    # Ceph RGW over the user's quota: the parts of a multipart upload (rank 0's one 100 MiB chunk)
    "ceph-quota-uploadpart": dict(path_regex=r"/step_2/w0/c\..*partNumber=", error_status=403,
                                  error_code="QuotaExceeded", numel=MULTIPART // 4, chunk="100MiB"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_s3_full_or_quota_fails_typed_and_the_next_step_commits(case: str, s3: S3Server, proxy: FaultProxy,
                                                                 start_daemon) -> None:
    c = CASES[case]
    numel, small = int(c["numel"]), 1024
    root = f"s3://{BUCKET}/full-{case}"
    arena = numel * 4 + 32 * MiB  # with 100 MiB: step 3 fits only if step 2's space came back
    d = start_daemon(root, "d0", *s3_flags(proxy.url), "--chunk-bytes", str(c["chunk"]), "--stage-grace", "0",
                     arena=f"{arena >> 20}MiB", env=aws_env(s3))
    clients = [CheckpointClient(d.socket, placement=Placement(r, 2, 2, 0), lease_timeout_s=20) for r in range(2)]
    for h in [cl.save(1, _state(r, 1, small)) for r, cl in enumerate(clients)]:
        h.wait(60)

    proxy.set_faults(fail_all=Fault.ERROR, methods=["PUT"], path_regex=str(c["path_regex"]),
                     error_status=int(c["error_status"]), error_code=str(c["error_code"]))
    # rank 0 saves and hears of the failure before rank 1 saves at all (the daemon does not wait for the
    # node's last rank: --stage-grace 0): rank 1, a late member of the failed attempt, gets the same error
    # instead of starting a new attempt that would wait --part-timeout for a rank that already gave up
    with pytest.raises(StorageFullError, match=str(c["error_code"])):
        clients[0].save(2, _state(0, 2, numel)).wait(120)
    with pytest.raises(StorageFullError, match=str(c["error_code"])):
        clients[1].save(2, _state(1, 2, numel)).wait(30)
    assert proxy.stats().faults.get("error", 0) >= 1
    report = _report_after_failure(d.socket)  # the daemon records the failure just after the ranks hear it
    # released: what is used is step 1, kept for an in-memory restore, and the next saves' space asked ahead
    assert report.arena_free_bytes + report.arena_retained_bytes + report.arena_ahead_bytes == report.arena_bytes
    assert str(c["error_code"]) in report.last_error and report.in_flight == 0
    _loads(root, 1, small, s3.endpoint_url)  # the earlier step is intact

    proxy.clear_faults()  # space is back
    for h in [cl.save(3, _state(r, 3, numel)) for r, cl in enumerate(clients)]:
        h.wait(120)
    _loads(root, 3, numel, s3.endpoint_url)
    for cl in clients:
        cl.close()
