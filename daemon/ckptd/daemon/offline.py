"""The offline commands on a checkpoint root: ``ckptd ls``, ``verify``, ``gc`` (with ``--after``: a rollback)
and ``merge``. No daemon: each opens the root (local or S3) itself; :mod:`ckptd.daemon.cli` parses their
arguments and calls :func:`run_offline`."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from collections.abc import Mapping, Sequence
from typing import TYPE_CHECKING, Any

import msgspec

from ckptd.writer.errors import CheckpointNotFoundError, ConfigError, CorruptCheckpointError
from ckptd.writer.format import COMMIT_MARKER, CONTROL_DIR, FAILED_MARKER, PARTS_DIR, split_step_path

if TYPE_CHECKING:
    from ckptd.writer.root import CheckpointRoot

log = logging.getLogger("ckptd")

# exit codes (docs/operations.md, "Checking and cleaning a root"); 2, any typed error, is the CLI's own
EXIT_CORRUPT = 1  # verify: a step failed its checks (or there was nothing to verify); gc --after: not complete
EXIT_UNREADABLE = 3  # verify: no step is corrupt, but a step (or part of one) could not be read
VERIFY_SHOWN = 20  # verify: the failures a step lists on a terminal


async def run_offline(args: argparse.Namespace, options: Mapping[str, object]) -> int:
    """``ls``, ``verify``, ``gc`` or ``merge`` (``args.command``) on ``args.root``, opened with ``options``."""
    from ckptd.daemon.config import root_given
    from ckptd.writer.root import open_root

    try:
        root_given(args.root)
    except ValueError as exc:
        raise ConfigError(str(exc)) from None
    async with open_root(args.root, options, create=False) as root:
        if args.command == "ls":
            return await _ls(root, args.json, args.step)
        if args.command == "verify":
            return await _verify(root, args.step, args.json)
        if args.command == "gc":
            if args.keep is None and args.after is None:
                raise ConfigError("gc needs --keep N, --after STEP, or both")
            gone, rc = ([], 0) if args.after is None else await _rollback(root, args.after, args.dry_run, args.grace)
            return rc if args.keep is None else max(rc, await _gc(root, args.keep, args.dry_run, args.grace, gone))
        if args.command == "merge":
            return await _merge(root, args.step, args.workers, args.json)
        raise ConfigError(f"unknown command {args.command!r}")


async def _ls(root: CheckpointRoot, as_json: bool, which: str | None = None) -> int:
    rows = []
    found, unreadable = await root.scan_steps()
    committed = set(found)
    steps = await root.steps()
    if which is not None:
        wanted = await root.resolve(which)  # a number, 'latest', step_N or Megatron-LM's iter_NNNNNNN
        steps = [s for s in steps if s == wanted]
        if not steps:
            raise CheckpointNotFoundError(f"no step {wanted} under {root.url}")
    for step in steps:
        row: dict[str, Any] = {"step": step, "committed": None if step in unreadable else step in committed,
                               "merged": False}
        try:
            if step in unreadable:
                raise unreadable[step]
            await _ls_row(root, row)
        except Exception as exc:  # one step that cannot be read is a row saying so, not the end of the listing
            row["state"], row["error"] = _failure(root, exc)
        rows.append(row)
    if not steps:
        await _no_steps(root)
    if as_json:
        print(json.dumps(rows))
        return 0
    print(f"{'step':>8}  {'state':<17} {'size':>10} {'arrays':>7} {'nodes':>5} {'world':>5}  {'saved at':<14} "
          "committed at")
    for r in rows:
        size = f"{r['bytes'] / 2**20:.1f}MiB" if "bytes" in r else "-"
        p = r.get("layout")
        saved_at = f"TP{p['tp']} PP{p['pp']} DP{p['dp']}" if p else "-"
        last = r.get("error") or (r.get("committed_at", "-") if r["committed"] else r.get("failed", ""))
        print(f"{r['step']:>8}  {r['state']:<17} {size:>10} {r.get('arrays', '-'):>7} {r.get('nodes', '-'):>5} "
              f"{r.get('world_size', '-'):>5}  {saved_at:<14} {last}")
    return 0


async def _no_steps(root: CheckpointRoot) -> None:
    """A root with no steps: an empty table (a new root), but a step's own folder given for its root is an
    error (a root that happens to be called ``iter_N`` holds ckptd's control folder)."""
    url = root.url
    parent, step = split_step_path(url)
    if step is not None and await _a_steps_folder(root):
        raise CheckpointNotFoundError(f"{url} is the folder of step {step}, not a checkpoint root: "
                                      f"ckptd ls {parent} --step {step}")
    print(f"ckptd ls: no steps under {url}", file=sys.stderr)


async def _a_steps_folder(root: CheckpointRoot) -> bool:
    """Whether a folder called like a step (``step_12``, ``iter_0000012``) is one: its control folder holds a
    step's markers or parts, or it has none at all (a root has one from its daemon's first write on)."""
    names = await root.backend.list_dir(CONTROL_DIR)
    if any(n.startswith((COMMIT_MARKER, FAILED_MARKER, PARTS_DIR)) for n in names):
        return True
    return not names and not os.path.isdir(os.path.join(root.url.removeprefix("file://"), CONTROL_DIR))


async def _ls_row(root: CheckpointRoot, row: dict[str, Any]) -> None:
    """Fill ``row`` (one step of ``ckptd ls``) from the step's manifests; ``state`` is what the table shows."""
    step = row["step"]
    if row["committed"]:
        row["state"] = "committed"
        c = await root.read_commit(step)
        row.update(bytes=c.nbytes, arrays=len(c.arrays), nodes=c.num_nodes, world_size=c.world_size,
                   layout=_parallel_layout(c.objects),
                   committed_at=time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(c.committed_at)))
        row["merged"] = await root.read_merged_manifest(step, source=c) is not None
        if row["merged"]:
            row["state"] = "committed+merged"
        return
    row["state"] = "incomplete"
    failed = await root.read_failed(step)  # the step failed (or its daemon died and a successor abandoned it)
    if failed is not None:
        row["state"], row["failed"] = "failed", f"{failed.get('code')}: {failed.get('message')}"


def _failure(root: CheckpointRoot, exc: Exception) -> tuple[str, str]:
    """How a step that could not be read is reported: ``("corrupt" | "unreadable", "Type: message")``. An
    untyped error (an ``OSError``, an s3fs or botocore error) is typed by the root's backend first."""
    err = root.backend.error(exc)  # typed errors pass through
    if err is not exc:
        log.debug("%s typed as %s", type(exc).__name__, type(err).__name__, exc_info=exc)
    return ("corrupt" if isinstance(err, CorruptCheckpointError) else "unreadable"), f"{type(err).__name__}: {err}"


def _parallel_layout(objects: dict[str, Any]) -> dict[str, int] | None:
    """The TP/PP/DP sizes a Megatron step was saved at (its ranks' ``megatron`` records), else None."""
    from ckptd.writer.format import MEGATRON_RECORD

    sizes = {(rec["tp_size"], rec["pp_size"], rec["dp_size"]) for o in objects.values()
             if isinstance(rec := o.get(MEGATRON_RECORD), dict) and {"tp_size", "pp_size", "dp_size"} <= rec.keys()}
    if len(sizes) != 1:
        return None
    tp, pp, dp = sizes.pop()
    return {"tp": tp, "pp": pp, "dp": dp}


async def _verify(root: CheckpointRoot, which: str | None, as_json: bool) -> int:
    results: list[dict[str, Any]] = []
    unreadable: dict[int, Exception] = {}
    if which is None:
        steps, found = await root.scan_steps()
        unreadable.update(found)
        results = await _failed_steps(root, {*steps, *unreadable}, as_json)
        for step, exc in unreadable.items():  # its marker could not be looked at: not checked, said so
            state, why = _failure(root, exc)
            results.append({"step": step, "ok": False, "committed": None, "state": state, "errors": [why]})
            if not as_json:
                print(f"step {step}: UNREADABLE (not checked): {why}")
    else:
        steps = [await root.resolve(which)]  # a number, 'latest', step_N or Megatron-LM's iter_NNNNNNN
    if not steps and not unreadable:
        print("no committed steps to verify", file=sys.stderr)
        return EXIT_CORRUPT
    for step in steps:  # a step that cannot be read is reported as such; the next ones are still checked
        results.append(await _verify_step(root, step, as_json, named=which is not None))
    if as_json:
        print(json.dumps(sorted(results, key=lambda r: int(r["step"]))))
    states = {r.get("state") for r in results}
    return EXIT_CORRUPT if "corrupt" in states else EXIT_UNREADABLE if "unreadable" in states else 0


async def _verify_step(root: CheckpointRoot, step: int, as_json: bool, *, named: bool) -> dict[str, Any]:
    """Re-read and check one committed step: its JSON row. What fails its checks is ``corrupt``; what could
    not be read at all (permissions, a storage error that outlived its retries) is ``unreadable``."""
    from ckptd.writer.arrays import verify_array
    from ckptd.writer.format import step_dir
    from ckptd.writer.progress import ByteProgress

    t0 = time.perf_counter()
    found: dict[str, list[str]] = {"corrupt": [], "unreadable": []}
    records, merged = [], False
    try:
        commit = await root.read_commit(step)
        records = list(commit.arrays)
        await _verify_sidecars(root, commit.objects, found)
        manifest = await root.read_merged_manifest(step, source=commit)
        if manifest is not None:
            records, merged = records + list(manifest.arrays), True
    except Exception as exc:
        if named and isinstance(exc, CheckpointNotFoundError):
            raise  # `--step` names no committed step: a usage error (exit 2), not damage
        kind, why = _failure(root, exc)
        found[kind].append(why)
    verified = 0
    todo = sum(ch.nbytes for rec in records for sh in rec.shards for ch in sh.chunks)
    bar = ByteProgress(f"verify step {step}", todo, out=None if as_json else sys.stderr)
    try:
        for rec in records:
            try:
                verified += await verify_array(root.store, step_dir(step), rec, bar.advance,
                                               lambda e: found["corrupt"].append(f"{type(e).__name__}: {e}"))
            except Exception as exc:  # typed and reported per array; the other arrays are still checked
                kind, why = _failure(root, exc)
                found[kind].append(why if kind == "corrupt" else f"{why} (array {rec.name} not checked)")
    finally:
        bar.close(not (found["corrupt"] or found["unreadable"]))
    corrupt, unread = found["corrupt"], found["unreadable"]
    state = "corrupt" if corrupt else "unreadable" if unread else "ok"
    if not as_json:
        verdict = [f"CORRUPT ({len(corrupt)} failed check(s))"] if corrupt else []
        verdict += [f"UNREADABLE ({len(unread)} could not be read)"] if unread else []
        what = f"{len(records)} arrays" + (" (incl. merged layout)" if merged else "")
        print(f"step {step}: {', '.join(verdict) or 'OK'}: {what}, {verified / 2**20:.1f} MiB re-read and checked")
        shown = corrupt + unread
        for e in shown[:VERIFY_SHOWN]:
            print(f"  {e}")
        if len(shown) > VERIFY_SHOWN:
            print(f"  ... and {len(shown) - VERIFY_SHOWN} more (--json lists every one)")
    return {"step": step, "ok": state == "ok", "state": state, "bytes": verified, "arrays": len(records),
            "merged": merged, "seconds": round(time.perf_counter() - t0, 3), "errors": corrupt + unread}


async def _verify_sidecars(root: CheckpointRoot, objects: dict[str, Any], found: dict[str, list[str]]) -> None:
    """Read every layout sidecar the commit names, checked against its hash: one missing or damaged is
    ``corrupt`` (a Megatron load or merge of the step would fail), one that cannot be read ``unreadable``."""
    from ckptd.writer.merge import layout_names

    names = layout_names(objects)
    for name in sorted(set(names.values())):
        ranks = ",".join(sorted((r for r, n in names.items() if n == name), key=lambda r: (len(r), r)))
        try:
            await root.read_sidecar(name)
        except CheckpointNotFoundError:
            found["corrupt"].append(f"CorruptCheckpointError: layout sidecar {name} of rank(s) {ranks} is missing")
        except Exception as exc:
            kind, why = _failure(root, exc)
            found[kind].append(f"{why} (layout sidecar of rank(s) {ranks})")


async def _failed_steps(root: CheckpointRoot, committed: set[int], as_json: bool) -> list[dict[str, Any]]:
    """Uncommitted steps with a failure note: reported (not checkpoints, nothing to verify), not errors."""
    rows: list[dict[str, Any]] = []
    for step in await root.steps():
        try:
            failed = None if step in committed else await root.read_failed(step)
        except Exception as exc:  # its note unreadable: said so, and the next steps still looked at
            state, why = _failure(root, exc)
            rows.append({"step": step, "ok": False, "committed": False, "state": state, "errors": [why]})
            if not as_json:
                print(f"step {step}: {state.upper()}: its failure note: {why}")
            continue
        if failed is not None:
            why = f"{failed.get('code')}: {failed.get('message')}"
            rows.append({"step": step, "ok": True, "committed": False, "state": "failed", "errors": [], "failed": why})
            if not as_json:
                print(f"step {step}: FAILED, not a checkpoint (`ckptd gc` removes it once a newer step "
                      f"committed): {why}")
    return rows


async def _merge(root: CheckpointRoot, which: str, workers: int, as_json: bool) -> int:
    from ckptd.writer.merge import run_merge

    summary = await run_merge(root, which, workers=workers, bar_out=None if as_json else sys.stderr)
    if as_json:
        print(json.dumps(msgspec.to_builtins(summary)))
    elif summary.already_merged:
        print(f"step {summary.step}: already merged ({summary.arrays} arrays)")
    else:
        rate = summary.bytes_read / summary.seconds / 2**20 if summary.seconds else 0.0
        print(f"step {summary.step}: merged {summary.tasks} bucket(s) ({summary.tasks_skipped} already done) into "
              f"{summary.arrays} model-space arrays; read {summary.bytes_read / 2**20:.1f} MiB, wrote "
              f"{summary.bytes_written / 2**20:.1f} MiB in {summary.seconds:.1f}s ({rate:.0f} MiB/s)")
    return 0


async def _rollback(root: CheckpointRoot, step: int, dry_run: bool, grace_s: float) -> tuple[list[int], int]:
    """``gc --after``: the steps removed (or that would be), and the exit code: 1 when an unfinished step after
    ``step`` was kept (a daemon may still commit it, and ``latest`` would follow it again)."""
    from ckptd.writer.commit import CheckpointWriter

    writer = CheckpointWriter(root.backend)
    lately = await writer.written_lately(grace_s, after=step) if grace_s > 0 else []
    removed = await writer.drop_after(step, busy=lately, dry_run=dry_run)
    print(f"{'would remove' if dry_run else 'removed'} steps after {step}:", removed or "none")
    if lately and dry_run:
        print(f"would keep unfinished steps after {step} written to within {grace_s:.0f}s (--grace): {lately}; "
              "the rollback would not be complete")
    elif lately:
        print(f"the rollback is not complete: unfinished steps after {step} written to within {grace_s:.0f}s "
              f"(--grace) were kept: {lately}; a daemon may still commit them. Stop what writes them and run "
              "this again (or with --grace 0)", file=sys.stderr)
    return removed, EXIT_CORRUPT if lately and not dry_run else 0


async def _gc(root: CheckpointRoot, keep: int, dry_run: bool, grace_s: float, gone: Sequence[int] = ()) -> int:
    from ckptd.writer.commit import CheckpointWriter

    writer = CheckpointWriter(root.backend)
    # --keep 0 keeps every committed step, as `serve --keep 0` does (retention itself keeps max(1, keep)):
    # then only failed and unfinished steps older than the newest commit go
    keep = keep or sys.maxsize
    lately = await writer.written_lately(grace_s, gone=gone) if grace_s > 0 else []
    if lately:
        print(f"kept unfinished steps written to within {grace_s:.0f}s (--grace):", lately)
    if dry_run:  # after a dry run's rollback, as if its steps were gone
        print("would remove steps:", await writer.doomed_steps(keep, busy=lately, gone=gone) or "none")
        return 0
    removed = await writer.retain(keep, busy=lately)
    print("removed steps:", removed or "none")
    return 0
