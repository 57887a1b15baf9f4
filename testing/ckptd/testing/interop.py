"""Two independent zarr v3 readers against one committed step: zarr-python lists the hierarchy without a
warning, and tensorstore's ``zarr3`` driver reads every array to the same bytes (see docs/format.md,
"Other zarr v3 readers"). Used by the tests of plain saves (tests/integration/test_tensorstore.py) and of
the Megatron save and merge (tests/integration/test_merge.py).

    arrays = check_readers(root)                    # a local root
    arrays = check_readers(url, s3=S3Access(...))   # tensorstore's own s3 kvstore, zarr-python's s3fs
"""

from __future__ import annotations

import os
import warnings
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import numpy as np
import zarr

from ckptd.testing.fixtures import unavailable
from ckptd.writer.format import CONTROL_DIR, step_dir


@dataclass(frozen=True)
class S3Access:
    """Where an ``s3://bucket/prefix`` root is served (tensorstore takes the credentials from the environment:
    ``AWS_ACCESS_KEY_ID``/``AWS_SECRET_ACCESS_KEY``)."""

    endpoint_url: str
    region: str
    key: str
    secret: str


def _split(url: str) -> tuple[str, str]:
    bucket, _, prefix = url.removeprefix("s3://").partition("/")
    return bucket, prefix.strip("/")


def open_group(url: str, path: str, s3: S3Access | None = None) -> zarr.Group:
    """zarr-python's view of a group under a root (``path`` ``""``: the root)."""
    if s3 is None:
        return zarr.open_group(os.path.join(url, path), mode="r")
    options = {"endpoint_url": s3.endpoint_url, "key": s3.key, "secret": s3.secret}
    return zarr.open_group(f"{url.rstrip('/')}/{path}", mode="r", storage_options=options)


def kvstore(url: str, path: str, s3: S3Access | None = None) -> dict[str, Any]:
    """tensorstore's kvstore spec of a folder under a root."""
    if s3 is None:
        return {"driver": "file", "path": os.path.join(url, path, "")}
    bucket, prefix = _split(url)
    return {"driver": "s3", "bucket": bucket, "path": f"{prefix}/{path}/" if prefix else f"{path}/",
            "endpoint": s3.endpoint_url, "aws_region": s3.region,
            # the environment's keys; the default chain also works but logs (C++, to stderr) that it found no
            # profile and no web identity
            "aws_credentials": {"type": "environment"}}


def check_readers(
    url: str, step: int = 1, *, s3: S3Access | None = None, expected: Mapping[str, np.ndarray] | None = None,
    merged: bool = False,
) -> dict[str, zarr.Array[Any]]:
    """Check one committed step with both readers; returns zarr-python's arrays of the step by path.

    With warnings as errors, zarr-python lists the root (the step is a group of it), the step and every group
    below it. tensorstore opens every array of the step (the merged layout and the control folders
    included) and reads the bytes, dtype and shape zarr-python reads, and, for the arrays in ``expected``
    (stored dtype: bfloat16 as uint16 bits), those bytes too. ``merged``: the step must hold a merged layout.
    """
    try:
        import tensorstore as ts
    except ImportError:
        unavailable("tensorstore is not installed (the test extra pins it)")
        raise
    name = step_dir(step)
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # zarr-python warns about any object in a group's folder that is no node
        assert name in set(open_group(url, "", s3).group_keys())
        members = dict(open_group(url, name, s3).members(max_depth=None))
        for path, node in members.items():
            if isinstance(node, zarr.Group):
                open_group(url, f"{name}/{path}", s3).members()
    arrays = {path: node for path, node in members.items() if isinstance(node, zarr.Array)}
    assert CONTROL_DIR in arrays  # the step's control folder reads as an empty array
    if merged:
        assert f"merged/{CONTROL_DIR}" in arrays and any(p.startswith("merged/optimizer.state.") for p in arrays)
    missing = sorted(set(expected or {}) - set(arrays))
    assert not missing, f"arrays not found: {missing}"
    context = ts.Context()  # one thread pool and HTTP client for every array
    opened = [ts.open({"driver": "zarr3", "kvstore": kvstore(url, f"{name}/{path}", s3)}, read=True,
                      context=context) for path in arrays]
    reads = [future.result().read() for future in opened]
    for (path, arr), read in zip(arrays.items(), reads, strict=True):
        z, t = np.asarray(arr[...]), np.asarray(read.result())
        assert (t.dtype, t.shape) == (z.dtype, z.shape), path
        assert t.tobytes() == z.tobytes(), f"{path}: tensorstore and zarr-python read different bytes"
        if expected is not None and path in expected:
            want = expected[path]
            assert (t.dtype, t.shape) == (want.dtype, want.shape), path
            assert t.tobytes() == want.tobytes(), f"{path}: differs from the saved tensor"
    return arrays
