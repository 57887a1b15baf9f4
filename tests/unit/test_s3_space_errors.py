"""S3-compatible servers' "full" and "quota" answers map to StorageFullError; EntityTooLarge does not.

Real botocore ``ClientError`` objects as botocore builds them from a server's error reply.
"""

from __future__ import annotations

import pytest
from botocore.exceptions import ClientError

from ckptd.writer.backends.s3_errors import classify_error
from ckptd.writer.errors import StorageError, StorageFullError, StoragePermissionError


def _client_error(status: int, code: str, message: str = "") -> ClientError:
    return ClientError({"Error": {"Code": code, "Message": message}, "ResponseMetadata": {"HTTPStatusCode": status}},
                       "PutObject")


@pytest.mark.parametrize(
    ("status", "code", "message", "want"),
    [
        (507, "XMinioStorageFull", "Storage backend has reached its minimum free drive threshold.", StorageFullError),
        (500, "XMinioStorageFull", "", StorageFullError),  # older MinIO releases
        (507, "InternalError", "", StorageFullError),  # 507 Insufficient Storage whatever the code
        (500, "InternalError", "Storage backend has reached its minimum free drive threshold", StorageFullError),
        (403, "QuotaExceeded", "", StorageFullError),  # Ceph RGW: not a permission problem
        (400, "XMinioAdminBucketQuotaExceeded", "Bucket quota exceeded", StorageFullError),
        (400, "EntityTooLarge", "Your proposed upload exceeds the maximum allowed size", StorageError),
        (403, "AccessDenied", "", StoragePermissionError),
    ],
)
def test_classify_space_errors(status: int, code: str, message: str, want: type[StorageError]) -> None:
    err = classify_error(_client_error(status, code, message), "s3://bucket/x")
    assert type(err) is want, err
    assert code in str(err)
