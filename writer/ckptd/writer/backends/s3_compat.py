"""Optional S3 capabilities, and how ckptd degrades on S3-compatible servers that lack them.

Three S3 features are used where they help but are not needed for a correct checkpoint:

=======================  =====================================  ========================================
capability               what it buys                           without it (one warning per endpoint)
=======================  =====================================  ========================================
``multipart_listing``    retention and ``gc`` abort unfinished  nothing is aborted; use the server's own
(List/AbortMultipart-    multipart uploads of crashed writers   cleanup (AWS: a lifecycle rule
Upload)                  (invisible, but stored and billed)     ``AbortIncompleteMultipartUpload``)
``conditional_put``      the commit marker is created           check-then-put: a racing second
(``If-None-Match: *``)   atomically (of two racing              coordinator is not excluded
                         coordinators exactly one wins)
``batch_delete``         retention deletes a step in requests   one DELETE per object (slower, same
(``DeleteObjects``)      of up to 1000 keys                     result)
=======================  =====================================  ========================================

Conditional PUTs are probed once per endpoint before the first commit marker (some servers, s3rver
among them, accept the header and overwrite anyway). The others are tried; a server answering
``NotImplemented`` (HTTP 501) or ``MethodNotAllowed`` (405) is remembered as lacking it (per
endpoint, for the process) and warned about once; the operation that needed it carries on without it
instead of failing. So is an abort refused with 403 (a policy without ``s3:AbortMultipartUpload``), also
the abort a failed or cancelled write sends for its own upload (:mod:`~.s3_multipart`). The endpoint is
the one botocore resolved (an ``endpoint_url`` option, the ``AWS_ENDPOINT_URL*`` environment or a profile).
"""

from __future__ import annotations

import contextlib
import logging
import uuid
from typing import Any

from ckptd.writer.backends.s3_errors import error_code, error_status

log = logging.getLogger(__name__)

MULTIPART_LISTING = "multipart_listing"
CONDITIONAL_PUT = "conditional_put"
BATCH_DELETE = "batch_delete"

_CONSEQUENCE = {
    MULTIPART_LISTING: "unfinished multipart uploads of crashed writers are not aborted by retention or gc "
    "(configure the server's own cleanup, e.g. an AbortIncompleteMultipartUpload lifecycle rule)",
    CONDITIONAL_PUT: "commit markers are written check-then-put, which does not exclude a racing coordinator",
    BATCH_DELETE: "steps are deleted one object at a time",
}
_NOT_IMPLEMENTED_CODES = frozenset({"NotImplemented", "MethodNotAllowed", "NotSupported"})
_lacking: set[tuple[str, str]] = set()


def endpoint_of(fs: Any) -> str:
    """The endpoint a filesystem talks to, as botocore resolved it: the configured ``endpoint_url``, else
    ``AWS_ENDPOINT_URL_S3``/``AWS_ENDPOINT_URL`` or a profile's ``endpoint_url``, else AWS's (regional)
    endpoint. Taken from the connected client (kept by ``open_s3_filesystem`` for after it is closed), so
    two servers reached through the environment never share capability flags; the configured endpoint
    or ``"aws"`` where no client was made."""
    resolved = getattr(fs, "resolved_endpoint", None)
    if resolved is None:
        resolved = getattr(getattr(getattr(fs, "_s3", None), "meta", None), "endpoint_url", None)
    return str(resolved or getattr(fs, "endpoint_url", None)
               or (getattr(fs, "client_kwargs", None) or {}).get("endpoint_url") or "aws")


def not_implemented(exc: BaseException) -> bool:
    """Whether the server refused a request because it does not implement it."""
    return error_code(exc) in _NOT_IMPLEMENTED_CODES or error_status(exc) in (501, 405)


def lacks(fs: Any, capability: str) -> bool:
    """Whether this endpoint was found to lack ``capability`` earlier in this process."""
    return (endpoint_of(fs), capability) in _lacking


def mark_lacking(fs: Any, capability: str, exc: BaseException | None) -> None:
    """Remember that the endpoint lacks ``capability``; warn the first time."""
    where = (endpoint_of(fs), capability)
    if where in _lacking:
        return
    _lacking.add(where)
    why = f"{error_status(exc)} {error_code(exc)}" if exc is not None else "silently ignored"
    log.warning("S3 endpoint %s does not support %s (%s): %s", where[0], capability, why, _CONSEQUENCE[capability])


async def probe_conditional_put(fs: Any, path: str) -> None:
    """Find out once per endpoint whether ``If-None-Match: *`` is honoured (some servers ignore it and
    overwrite): two conditional PUTs of a scratch object under ``path`` (``bucket/prefix``), the
    second must be refused; then the object is removed. Marks the endpoint lacking if not."""
    if lacks(fs, CONDITIONAL_PUT) or (endpoint_of(fs), "probed") in _lacking:
        return
    _lacking.add((endpoint_of(fs), "probed"))
    bucket, prefix, _version = fs.split_path(path)
    key = f"{prefix}/_ckptd_probe/{uuid.uuid4().hex}".lstrip("/")
    try:
        await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=b"1", IfNoneMatch="*")
        try:
            await fs._call_s3("put_object", Bucket=bucket, Key=key, Body=b"2", IfNoneMatch="*")
        except Exception as exc:
            if error_code(exc) == "PreconditionFailed" or error_status(exc) == 412:
                return  # honoured
            raise
        mark_lacking(fs, CONDITIONAL_PUT, None)  # the second create-once write overwrote the first
    except Exception as exc:
        if not_implemented(exc):
            mark_lacking(fs, CONDITIONAL_PUT, exc)
        else:  # inconclusive (e.g. a transient fault): the marker write itself will tell
            log.debug("conditional PUT probe on %s inconclusive: %s", endpoint_of(fs), exc)
    finally:
        with contextlib.suppress(Exception):
            await fs._call_s3("delete_object", Bucket=bucket, Key=key)
