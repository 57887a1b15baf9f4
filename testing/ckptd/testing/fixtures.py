"""Pieces more than one test module needs: the S3 tests' bucket and fault mix, and Megatron's own view
of a rank's optimizer state (the ground truth the Megatron tests compare ckptd's checkpoints with).

Plain module, no fixtures (those live in ``conftest.py``); importable in forked rank processes.
"""

from __future__ import annotations

import hashlib
import os
import time
from collections.abc import Callable
from typing import Any

BUCKET = "ckpt"  # the bucket the ``s3`` and ``s3_auth`` fixtures create

# FaultProxy settings: a fifth of the requests hit a transient fault the S3 client must retry through
TRANSIENT_20 = {
    "slowdown": 0.05,
    "internal": 0.03,
    "throttle": 0.03,
    "reset_before": 0.03,
    "reset_mid_request": 0.03,
    "reset_mid_response": 0.03,
}


def megatron_owned_state(optimizer: Any, layout: Any = None) -> list[dict[str, Any]]:
    """Megatron's own bookkeeping of this rank's distributed-optimizer state: per owned param its name,
    size, sub-range of the flattened param and every state tensor there (cloned). With a
    :class:`~ckptd.client.megatron.MegatronLayout`, ``mp`` names the rank's ``tpN.ppM`` coordinates."""
    from megatron.core.utils import unwrap_model

    mp = f"tp{layout.tp_rank}.pp{layout.pp_rank}" if layout is not None else ""
    out = []
    for opt in optimizer.chained_optimizers:
        names = {p: n for chunk in opt.model_chunks for n, p in unwrap_model(chunk).named_parameters()}
        for param in opt.model_param_gbuf_map:
            rng = opt._get_model_param_range_map(param)["param"]
            tensors = opt._get_main_param_and_optimizer_states(param)
            out.append(
                {
                    "mp": mp,
                    "name": names[param],
                    "numel": param.numel(),
                    "range": (rng.start, rng.end),
                    "tensors": {k: v.detach().clone() for k, v in tensors.items()},
                }
            )
    return out


def tree_digest(root: str) -> str:
    """One hash over every file's path and bytes below ``root``: a committed step must never change."""
    h = hashlib.sha256()
    for dirpath, _dirs, files in sorted(os.walk(root)):
        for name in sorted(files):
            path = os.path.join(dirpath, name)
            h.update(path.encode())
            with open(path, "rb") as fh:
                h.update(fh.read())
    return h.hexdigest()


def unavailable(reason: str) -> None:
    """A test's prerequisite is missing: skip it on a developer's machine, fail it in CI (``CI`` set), where
    ``.ci/run``'s setup provides everything (root for tmpfs mounts, s3rver from npm), so a skip there would
    hide a guarantee that is no longer checked."""
    import pytest

    if os.environ.get("CI"):
        pytest.fail(f"{reason} (CI is set: the setup must provide it)")
    pytest.skip(reason)


def wait_for(cond: Callable[[], bool], what: str, timeout: float = 60.0) -> None:
    """Poll ``cond`` until it holds; ``AssertionError`` naming ``what`` after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while not cond():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f}s waiting for {what}")
        time.sleep(0.01)


async def commit_one_node(writer: Any, step: int, records: list[Any]) -> None:
    """Commit ``step`` of one node and one rank holding ``records`` (``ArrayRecord``s whose chunks are
    written): its part manifest, then the commit, as a daemon would, through ``writer``
    (a :class:`~ckptd.writer.commit.CheckpointWriter`)."""
    from ckptd.writer import format as fmt

    await writer.write_part(fmt.PartManifest(fmt.FORMAT_VERSION, step, 0, 1, 1, [0], records, {}, 0, 0.0))
    await writer.commit(step, 1, timeout=5)
