"""Retention (``--keep``) is housekeeping: a step whose commit marker is written is committed, whatever
deleting older steps does afterwards. A store that refuses deletes (an S3 bucket policy denying
``DeleteObject``, Object Lock) leaves the old steps in place and a warning in the log; every save still
commits, and once deletes work again the next commit's retention removes what it could not before.

Aborting the unfinished multipart uploads of a deleted step is optional the same way: a policy without
``s3:AbortMultipartUpload`` leaves them (with a warning), and ``ckptd gc`` still removes every step it should.

Real moto server behind the fault proxy, which answers the refused requests with 403 ``AccessDenied``.
"""

from __future__ import annotations

import re
from pathlib import Path

import pytest
import torch
from test_s3 import aws_env, cli, in_aws_env, options, s3_flags  # noqa: F401 (fixture)

from ckptd.client import CheckpointClient, Placement
from ckptd.client.reader import load
from ckptd.testing.faultproxy import Fault, FaultProxy
from ckptd.testing.fixtures import BUCKET
from ckptd.testing.s3server import S3Server
from ckptd.writer.format import commit_marker

pytestmark = [pytest.mark.s3, pytest.mark.timeout(180), pytest.mark.usefixtures("in_aws_env")]


def _steps(s3: S3Server, prefix: str) -> list[str]:
    return sorted({k.split("/")[1] for k in s3.list_keys(BUCKET, f"{prefix}/") if k.split("/")[1].startswith("step_")})


def test_a_refused_delete_of_an_old_step_fails_no_committed_step(s3: S3Server, proxy: FaultProxy,
                                                                  start_daemon) -> None:
    prefix = "retention-denied"
    d = start_daemon(f"s3://{BUCKET}/{prefix}", "d0", *s3_flags(proxy.url), "--keep", "1", env=aws_env(s3))
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))
    client.save(1, {"x": torch.full((4,), 1.0)}).wait(60)

    denied = f"{re.escape(commit_marker(1))}|\\?delete"  # step 1's marker, and any bulk delete
    proxy.set_faults(fail_all=Fault.ERROR, methods=["DELETE", "POST"], path_regex=denied, error_status=403,
                     error_code="AccessDenied")
    client.save(2, {"x": torch.full((4,), 2.0)}).wait(60)  # committed: retention's failure is not the step's
    assert proxy.stats().faults.get("error", 0) >= 1
    assert _steps(s3, prefix) == ["step_1", "step_2"]  # step 1 could not be deleted; nothing else was lost
    assert d.log_path is not None
    log = Path(d.log_path).read_text()
    assert "step=2 node=0 state=committed" in log and "retention" in log and "AccessDenied" in log, log

    proxy.clear_faults()
    client.save(3, {"x": torch.full((4,), 3.0)}).wait(60)
    assert _steps(s3, prefix) == ["step_3"]  # the next commit's retention removed both
    client.close()
    template = {"x": torch.zeros(4)}
    load(f"s3://{BUCKET}/{prefix}", "latest", template, storage_options=options(s3.endpoint_url))
    assert torch.equal(template["x"], torch.full((4,), 3.0))


def test_gc_removes_its_steps_when_the_store_refuses_to_abort_uploads(s3: S3Server, proxy: FaultProxy,
                                                                        start_daemon) -> None:
    """Each of three old steps holds an upload a crashed writer left; the store refuses the aborts: ``ckptd
    gc`` exits 0 and removes all three (before: an untyped ``ExceptionGroup`` after the first, exit 1)."""
    prefix = "abort-denied"
    root = f"s3://{BUCKET}/{prefix}"
    d = start_daemon(root, "d0", *s3_flags(proxy.url), env=aws_env(s3))
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))
    for step in (1, 2, 3, 4):
        client.save(step, {"x": torch.full((4,), float(step))}).wait(60)
    client.close()
    s3c = s3.client()
    for step in (1, 2, 3):
        s3c.create_multipart_upload(Bucket=BUCKET, Key=f"{prefix}/step_{step}/x/c.0")

    proxy.set_faults(fail_all=Fault.ERROR, methods=["DELETE"], path_regex="uploadId=", error_status=403,
                     error_code="AccessDenied", error_message="Access Denied")
    out = cli("gc", root, "--keep", "1", *s3_flags(proxy.url), env=aws_env(s3))
    assert out.returncode == 0, out.stderr
    assert "removed steps: [1, 2, 3]" in out.stdout, out.stdout
    assert "Traceback" not in out.stderr and "multipart_listing" in out.stderr, out.stderr  # one warning
    assert proxy.stats().faults.get("error", 0) >= 1
    assert _steps(s3, prefix) == ["step_4"]
    uploads = s3c.list_multipart_uploads(Bucket=BUCKET, Prefix=f"{prefix}/").get("Uploads", [])
    assert len(uploads) == 3  # left for the store's own cleanup (docs/operations.md), not lost silently
    template = {"x": torch.zeros(4)}
    load(root, "latest", template, storage_options=options(s3.endpoint_url))
    assert torch.equal(template["x"], torch.full((4,), 4.0))


def test_a_store_without_batch_delete_still_retains_and_collects(s3: S3Server, proxy: FaultProxy,
                                                                             start_daemon) -> None:
    """A server that answers every ``DeleteObjects`` (a POST ``?delete``) with 501: the single deletes (a
    marker; also a stale part, a failure note) are ``DeleteObject``s, and the prefix deletes fall back to
    them, so retention and ``gc`` remove old steps as on a full S3 (before: the marker's delete failed, and
    with it every retention and gc)."""
    prefix = "no-batch-delete"
    root = f"s3://{BUCKET}/{prefix}"
    proxy.set_faults(fail_all=Fault.ERROR, methods=["POST"], path_regex="\\?delete", error_status=501,
                     error_code="NotImplemented", error_message="A header you provided implies functionality "
                     "that is not implemented")
    d = start_daemon(root, "d0", *s3_flags(proxy.url), "--keep", "1", env=aws_env(s3))
    client = CheckpointClient(d.socket, placement=Placement(0, 1, 1, 0))
    for step in (1, 2, 3):
        client.save(step, {"x": torch.full((4,), float(step))}).wait(60)
    client.close()
    assert _steps(s3, prefix) == ["step_3"]
    assert proxy.stats().faults.get("error", 0) >= 1  # the batch deletes were refused, and got round
    s3.client().put_object(Bucket=BUCKET, Key=f"{prefix}/step_2/{commit_marker(2).split('/', 1)[1]}", Body=b"{}")
    out = cli("gc", root, "--keep", "1", "--grace", "0", *s3_flags(proxy.url), env=aws_env(s3))
    assert out.returncode == 0, out.stderr
    assert _steps(s3, prefix) == ["step_3"], out.stdout
    template = {"x": torch.zeros(4)}
    load(root, "latest", template, storage_options=options(s3.endpoint_url))
    assert torch.equal(template["x"], torch.full((4,), 3.0))
