"""What goes wrong with S3 requests: typed errors for S3 failures and the retry-fault counters.

:func:`classify_error` maps botocore/aiobotocore/s3fs exceptions to ckptd's storage errors and scrubs
anything key-like from messages; the ``_count_*`` hooks run on botocore's retry events and fill the
backend's :class:`~ckptd.writer.backends.RetryMetrics`; :func:`treat_429_as_throttling` makes every
HTTP 429 retryable.
"""

from __future__ import annotations

import logging
import re
from collections.abc import Iterator, Mapping
from typing import Any
from urllib.parse import urlparse

from ckptd.writer.backends import RetryMetrics
from ckptd.writer.errors import (
    CkptdError,
    InvalidRequestError,
    StorageError,
    StorageFullError,
    StorageNotFoundError,
    StoragePermissionError,
)

logger = logging.getLogger(__name__)

_NOT_FOUND_CODES = frozenset({"NoSuchBucket", "NoSuchKey", "NotFound", "404", "NoSuchUpload"})
_PERMISSION_CODES = frozenset(
    {
        "AccessDenied",
        "403",
        "AllAccessDisabled",
        "AccountProblem",
        "InvalidAccessKeyId",
        "InvalidClientTokenId",
        "SignatureDoesNotMatch",
        "ExpiredToken",
        "ExpiredTokenException",
        "InvalidToken",
        "TokenRefreshRequired",
        "UnrecognizedClientException",
        "InvalidSecurity",
    }
)
# A full store or a spent quota, as S3-compatible servers say it: Ceph RGW answers 403 QuotaExceeded, MinIO
# 507 XMinioStorageFull (500 in old releases, "StorageFull" in forks) and XMinioAdminBucketQuotaExceeded for
# a bucket quota; HTTP 507 is "Insufficient Storage" whatever the code. Checked before 403 (permission).
# EntityTooLarge (one object over the size limit) is not about space: it stays a plain StorageError.
_FULL_CODES = frozenset(
    {"QuotaExceeded", "XMinioStorageFull", "StorageFull", "XMinioAdminBucketQuotaExceeded", "InsufficientStorage"}
)
_FULL_STATUS = 507
_FULL_MESSAGE = re.compile(r"(?i)minimum free (?:drive|disk) threshold|no space left|storage cap exceeded")
# exception class names from botocore's credential chain (matched by name: several are optional there)
_CREDENTIAL_ERRORS = frozenset(
    {
        "NoCredentialsError",
        "PartialCredentialsError",
        "CredentialRetrievalError",
        "ProfileNotFound",
        "NoAuthTokenError",
        "UnauthorizedSSOTokenError",
        "SSOTokenLoadError",
        "TokenRetrievalError",
    }
)
_SECRET_PATTERNS = [
    re.compile(r"\b(?:AKIA|ASIA|AROA|AIDA)[A-Z0-9]{12,}\b"),
    re.compile(r"(?i)(x-amz-(?:credential|signature|security-token)=)[^&\s\"']+"),
    re.compile(
        r"(?i)((?:signature|credential|awsaccesskeyid|aws_secret_access_key|secret)\s*[=:]\s*)[^,&\s\"']+"
    ),
]

_THROTTLING_CODES = frozenset(
    {
        "Throttling",
        "ThrottlingException",
        "ThrottledException",
        "RequestThrottledException",
        "TooManyRequestsException",
        "ProvisionedThroughputExceededException",
        "TransactionInProgressException",
        "RequestLimitExceeded",
        "BandwidthLimitExceeded",
        "LimitExceededException",
        "RequestThrottled",
        "SlowDown",
        "PriorRequestNotComplete",
        "EC2ThrottledException",
    }
)


def split_s3_url(url: str) -> tuple[str, str]:
    """``s3://bucket/a/b`` → ``("bucket", "a/b")``; raise :class:`InvalidRequestError` otherwise."""
    parsed = urlparse(url)
    if parsed.scheme not in ("s3", "s3a") or not parsed.netloc:
        raise InvalidRequestError(f"not an s3:// URL: {scrub(url)!r}")
    return parsed.netloc, parsed.path.strip("/")


def classify_error(exc: BaseException, url: str) -> CkptdError:
    """Map an exception from botocore/aiobotocore/s3fs to ckptd's typed storage errors.

    :class:`StorageFullError` for a full store or a spent quota (``QuotaExceeded``, ``XMinioStorageFull``,
    HTTP 507), :class:`StorageNotFoundError` for a missing bucket/object, :class:`StoragePermissionError` for
    denied access, unknown or wrong keys and missing credentials, :class:`StorageError` for the rest
    (including transient faults that outlived their retries). The message names the bucket and
    prefix, the S3 error code and HTTP status, never a credential. Already-typed errors pass through.
    The caller should ``raise classify_error(exc, url) from exc``.
    """
    if isinstance(exc, CkptdError):
        return exc
    place = describe_location(url)
    for err in _chain(exc):
        if type(err).__name__ in _CREDENTIAL_ERRORS:
            return StoragePermissionError(
                f"no usable AWS credentials for {place} ({type(err).__name__}): "
                "configure the standard AWS chain (environment, profile or instance role)"
            )
        response = getattr(err, "response", None)
        if isinstance(response, Mapping) and isinstance(response.get("Error"), Mapping):
            code = str(response["Error"].get("Code") or "")
            message = scrub(str(response["Error"].get("Message") or ""))
            status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
            detail = f"{code or 'error'}, HTTP {status}" + (f": {message}" if message else "")
            if code in _FULL_CODES or status == _FULL_STATUS or _FULL_MESSAGE.search(message):
                return StorageFullError(f"no space left for {place} ({detail})")
            if code in _NOT_FOUND_CODES or status == 404:
                what = "bucket does not exist" if code == "NoSuchBucket" else "not found"
                return StorageNotFoundError(f"{what}: {place} ({detail})")
            if code in _PERMISSION_CODES or status == 403:
                return StoragePermissionError(f"access denied to {place} ({detail})")
            return StorageError(f"S3 request failed for {place} ({detail})")
    name = type(exc).__name__
    text = scrub(str(exc))
    if isinstance(exc, FileNotFoundError):
        return StorageNotFoundError(f"not found: {place} ({name}: {text})")
    if isinstance(exc, PermissionError):
        return StoragePermissionError(f"access denied to {place} ({name}: {text})")
    return StorageError(f"S3 operation failed for {place} ({name}: {text})")


def count_retry(metrics: RetryMetrics, request: Any = None, **_kwargs: Any) -> None:
    """``request-created`` runs once per attempt; attempts after the first are retries."""
    context = getattr(request, "context", None) or {}
    attempt = context.get("retries", {}).get("attempt", 1)
    if attempt > 1:
        metrics.retries += 1


def count_fault(
    metrics: RetryMetrics, response: Any = None, caught_exception: BaseException | None = None, **_kwargs: Any
) -> None:
    """Runs on ``needs-retry`` after every attempt; counts the failures a retry may follow."""
    if caught_exception is not None:
        metrics.faults[type(caught_exception).__name__] += 1
        logger.debug("S3 attempt failed: %s", type(caught_exception).__name__)
        return
    if not isinstance(response, tuple) or len(response) != 2:
        return
    http, parsed = response
    status = getattr(http, "status_code", None)
    if isinstance(status, int) and (status >= 500 or status == 429):
        error = parsed.get("Error", {}) if isinstance(parsed, dict) else {}
        code = str(error.get("OriginalCode") or error.get("Code") or status)
        metrics.faults[code] += 1
        logger.debug("S3 attempt failed: HTTP %s %s", status, code)


def treat_429_as_throttling(response: Any = None, **_kwargs: Any) -> None:
    """Make botocore retry every HTTP 429, not only those whose error code it knows.

    botocore's standard and adaptive modes retry 500/502/503/504 by status but 429 only by error
    code (``Throttling``, ``SlowDown``...): a 429 answered to a HEAD (no body, so the code is just
    ``"429"``) or with another code (``TooManyRequests``) fails at once. Runs first on
    ``needs-retry`` and renames such codes to ``Throttling``, so the regular handler retries them with
    throttling backoff, attempt limit and retry quota. Returns ``None``: it never decides itself.
    """
    if not isinstance(response, tuple) or len(response) != 2:
        return
    http, parsed = response
    if getattr(http, "status_code", None) != 429 or not isinstance(parsed, dict):
        return
    error = parsed.setdefault("Error", {})
    if error.get("Code") not in _THROTTLING_CODES:
        error["OriginalCode"] = error.get("Code")
        error["Code"] = "Throttling"


def _chain(exc: BaseException) -> Iterator[BaseException]:
    seen: set[int] = set()
    todo: list[BaseException] = [exc]
    while todo:
        err = todo.pop(0)
        if id(err) in seen:
            continue
        seen.add(id(err))
        yield err
        todo.extend(e for e in (err.__cause__, err.__context__) if e is not None)


def _client_response(exc: BaseException) -> Mapping[str, Any] | None:
    for err in _chain(exc):
        response = getattr(err, "response", None)
        if isinstance(response, Mapping) and isinstance(response.get("Error"), Mapping):
            return response
    return None


def error_code(exc: BaseException) -> str | None:
    response = _client_response(exc)
    return None if response is None else str(response["Error"].get("Code") or "")


def error_status(exc: BaseException) -> int | None:
    response = _client_response(exc)
    if response is None:
        return None
    status = response.get("ResponseMetadata", {}).get("HTTPStatusCode")
    return int(status) if status is not None else None


def describe_location(url: str) -> str:
    try:
        bucket, prefix = split_s3_url(url)
    except InvalidRequestError:
        return scrub(url)
    return f"bucket {bucket!r}, prefix {prefix!r} (s3://{bucket}/{prefix})"


def scrub(text: str) -> str:
    """Remove anything that looks like a credential or a signature from ``text``."""
    text = _SECRET_PATTERNS[0].sub("<redacted>", text)
    for pattern in _SECRET_PATTERNS[1:]:
        text = pattern.sub(r"\1<redacted>", text)
    return text
