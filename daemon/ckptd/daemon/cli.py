"""The ``ckptd`` command: ``serve``, ``demo``, ``ls``, ``verify``, ``gc``, ``merge``, ``status``, ``plan``."""

from __future__ import annotations

import argparse
import asyncio
import logging
import os
import sys
from collections.abc import Sequence

from ckptd.daemon.commands import COMMANDS, add_commands, run_command
from ckptd.daemon.offline import run_offline
from ckptd.writer.errors import CkptdError, ConfigError

# HTTP/S3 client libraries log request headers (signed credentials) and call arguments at DEBUG.
_QUIET_BELOW_INFO = ("botocore", "aiobotocore", "boto3", "s3fs", "urllib3", "aiohttp", "fsspec")
# `gc` leaves an unfinished step written to more recently alone: a daemon writing it has given up by then
# (the default --part-timeout plus --commit-timeout)
GC_GRACE_S = 1200.0
# exit codes (docs/operations.md, "Checking and cleaning a root"): 2 is any typed error (main); the offline
# commands' own are in ckptd.daemon.offline
EXIT_ERROR = 2


def _log_level(value: str) -> str:
    """A level name logging knows (``WARN`` and ``FATAL`` too), upper-cased; else a usage error."""
    if value.upper() not in logging.getLevelNamesMapping():
        raise argparse.ArgumentTypeError(f"not a log level: {value!r} (DEBUG, INFO, WARNING, ERROR, CRITICAL)")
    return value.upper()


def _setup_logging(level: str) -> None:
    numeric = logging.getLevelNamesMapping()[level]
    logging.basicConfig(
        level=numeric,
        format="%(asctime)s %(levelname)s %(name)s [pid %(process)d] %(message)s",
        stream=sys.stderr,
    )
    for name in _QUIET_BELOW_INFO:
        logging.getLogger(name).setLevel(max(numeric, logging.INFO))


_STORAGE_FLAGS = ("endpoint_url", "region", "profile", "addressing_style", "max_attempts", "fs_retries",
                  "retry_mode", "connect_timeout", "read_timeout")


def _storage_flags(p: argparse.ArgumentParser, *, config: bool = False) -> None:
    p.add_argument("--endpoint-url", help="S3-compatible endpoint URL (credentials come from the AWS chain)")
    p.add_argument("--region", help="S3 region")
    p.add_argument("--profile", help="AWS profile name")
    p.add_argument("--addressing-style", choices=["auto", "virtual", "path"], help="S3 addressing style")
    p.add_argument("--max-attempts", type=int, help="S3: HTTP attempts per request, retries included (default 5)")
    p.add_argument("--fs-retries", type=int, help="S3: outer retry loop of s3fs per operation (default 3)")
    p.add_argument("--retry-mode", choices=["standard", "adaptive"], help="S3: botocore retry mode")
    p.add_argument("--connect-timeout", type=float, help="S3: seconds per connection attempt (default 10)")
    p.add_argument("--read-timeout", type=float, help="S3: seconds per read (default 60)")
    p.add_argument("--storage-option", action="append", default=[], metavar="KEY=VALUE",
                   help="any other storage option, e.g. conditional_put=false (repeatable)")
    if config:
        p.add_argument("--config", help="TOML config file; its [storage] table gives the storage options")


def _storage_flag_values(args: argparse.Namespace) -> dict[str, object]:
    """The command line's layer of storage options (``--storage-option``, then the dedicated flags)."""
    opts: dict[str, object] = {}
    for item in getattr(args, "storage_option", None) or []:
        key, sep, value = item.partition("=")
        if not sep or not key.strip():
            raise ConfigError(f"--storage-option wants KEY=VALUE, got {item!r}")
        opts[key.strip().replace("-", "_")] = value.strip()
    for k in _STORAGE_FLAGS:
        if getattr(args, k, None) is not None:
            opts[k] = getattr(args, k)
    return opts


def _storage_options(args: argparse.Namespace) -> dict[str, object]:
    """The storage options of an offline command: its flags over ``CKPTD_STORAGE_*`` over the config file."""
    from ckptd.daemon.config import load_storage_options

    return load_storage_options({"storage": _storage_flag_values(args)}, os.environ, getattr(args, "config", None))


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="ckptd", description="Asynchronous checkpoint daemon for large-model training"
    )
    parser.add_argument("--log-level", type=_log_level, default=os.environ.get("CKPTD_LOG_LEVEL", "INFO"),
                        help="DEBUG, INFO, WARNING, ERROR or CRITICAL (default: $CKPTD_LOG_LEVEL, else INFO)")
    sub = parser.add_subparsers(dest="command", required=True)

    s = sub.add_parser("serve", help="run the node daemon")
    s.add_argument("--config", help="TOML config file (section [daemon], and [storage] for storage options)")
    s.add_argument("--root", help="checkpoint root: a path, file:// or s3:// URL")
    s.add_argument("--socket", help="Unix socket path (default: $CKPTD_SOCKET or a per-user runtime dir)")
    s.add_argument("--arena-size", help="staging arena size, e.g. 8GiB (default 2GiB)")
    s.add_argument("--write-concurrency", type=int, help="chunks written at once (default 8)")
    s.add_argument("--chunk-bytes", help="largest chunk, e.g. 64MiB")
    s.add_argument("--pack-bytes", help="arrays up to this size that one node holds whole become one object "
                   "(default 1MiB on S3, 0 = off on local disks)")
    s.add_argument("--codec", choices=["raw", "zstd"], help="chunk compression (default raw)")
    s.add_argument("--keep", type=int, help="keep the newest N committed steps (default: all)")
    s.add_argument("--part-timeout", dest="part_timeout_s", type=float, help="seconds to wait for all local ranks")
    s.add_argument("--stage-grace", dest="stage_grace_s", type=float,
                   help="seconds writes wait for the node's other ranks to finish staging (default 0.5)")
    s.add_argument("--commit-timeout", dest="commit_timeout_s", type=float, help="seconds to wait for all nodes")
    s.add_argument("--drain-grace", dest="drain_grace_s", type=float, help="seconds to drain on SIGTERM")
    s.add_argument("--no-prefault", dest="prefault", action="store_false", default=None)
    s.add_argument("--no-retain", dest="retain", action="store_false", default=None,
                   help="do not keep the newest committed step in the arena for an in-memory restore")
    s.add_argument("--nice", type=int, help="CPU niceness increment of the daemon (default 10: ranks come first)")
    s.add_argument("--exit-when-idle", dest="exit_when_idle_s", type=float,
                   help="exit once no client has been connected and no step in flight for this many seconds")
    s.add_argument("--restore-hold", dest="restore_hold_s", type=float,
                   help="with --exit-when-idle: while a committed step is kept for an in-memory restore, stay "
                        "this many idle seconds instead, for restarted ranks to restore it (default 300)")
    s.add_argument("--job-id", help="the job this daemon serves: clients of another job refuse it (embedded mode)")
    s.add_argument("--owner-pid", type=int,
                   help="drain and exit once this process is gone (embedded mode: the job's launcher)")
    s.add_argument("--metrics-port", type=int, help="serve Prometheus metrics on this port (opt-in; 0: any free)")
    s.add_argument("--metrics-host", help="address of the metrics endpoint (default 127.0.0.1)")
    _storage_flags(s)

    d = sub.add_parser("demo", help="run the embedded demo: daemon + 4 ranks training, saving, reloading")
    d.add_argument("--root", help="where to write (default: ./ckptd-demo)")
    d.add_argument("--json", action="store_true", help="print one JSON object instead of the table")
    d.add_argument("--ranks", type=int, help="gloo ranks (default: 4; verl: 2)")
    d.add_argument("--steps", type=int, help="training steps (default: 12; verl: 4, job 1's steps)")
    d.add_argument("--save-every", type=int, help="save every N steps (default: 4; verl: 2)")
    d.add_argument("--trainer", choices=["megatron", "verl"], default="megatron",
                   help="verl: verl's checkpoint manager through ckptd's hook, actor and critic, save, then resume "
                        "from the last save in fresh processes and save once more (needs ckptd[verl])")

    ls = sub.add_parser("ls", help="list checkpoints under ROOT")
    ls.add_argument("root")
    ls.add_argument("--step", default=None, help="only this step: N, 'latest', step_N or Megatron-LM's iter_NNNNNNN")
    ls.add_argument("--json", action="store_true")
    _storage_flags(ls, config=True)

    v = sub.add_parser("verify", help="re-read committed steps and check every chunk against its checksums")
    v.add_argument("root")
    v.add_argument("--step", default=None,
                   help="a step: N, 'latest', step_N or Megatron-LM's iter_NNNNNNN (default: every committed step)")
    v.add_argument("--json", action="store_true")
    _storage_flags(v, config=True)

    m = sub.add_parser("merge", help="build the fully-reshardable layout of a committed step (offline)")
    m.add_argument("root")
    m.add_argument("--step", default="latest",
                   help="a step: N, step_N, Megatron-LM's iter_NNNNNNN, or 'latest' (default)")
    m.add_argument("--workers", type=int, default=2, help="buckets merged at once (default 2; memory: ~1 bucket each)")
    m.add_argument("--json", action="store_true", help="print the summary as JSON")
    _storage_flags(m, config=True)

    g = sub.add_parser("gc", help="delete old and unfinished steps, keeping the newest N committed; or every "
                       "step after one (a rollback)")
    g.add_argument("root")
    g.add_argument("--keep", type=_count,
                   help="committed steps to keep, newest first; 0 keeps them all (as `serve --keep 0`) and "
                   "removes only failed and unfinished steps")
    g.add_argument("--after", type=_count, metavar="STEP",
                   help="roll back to committed step STEP: delete every step after it, committed or not (not "
                   "an unfinished one written to within --grace), so that `latest` and retention follow the "
                   "steps saved from STEP on; run it before training resumes from STEP")
    g.add_argument("--dry-run", action="store_true")
    g.add_argument("--grace", type=float, default=GC_GRACE_S, metavar="SECONDS",
                   help="keep unfinished steps written to within SECONDS: a daemon may still be writing one "
                   f"(a step can commit after a newer one); 0 removes them all (default {GC_GRACE_S:.0f})")
    _storage_flags(g, config=True)
    add_commands(sub)
    return parser


def _count(text: str) -> int:
    """An integer >= 0 (argparse type: anything else is a usage error, exit 2)."""
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0 (0 keeps every committed step), got {value}")
    return value


def main(argv: Sequence[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    _setup_logging(args.log_level)
    try:
        rc = _run(args)
        sys.stdout.flush()  # a reader that left (`ckptd ls ROOT | head`) shows here, not at exit
        return rc
    except CkptdError as exc:
        print(f"ckptd {args.command}: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `ckptd ls ROOT | head`: the reader left; no traceback for it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nor from flushing stdout at exit
        return 141


def _run(args: argparse.Namespace) -> int:
    if args.command == "serve":
        return _serve(args)
    if args.command == "demo" and args.trainer == "verl":
        from ckptd.testing.demo_verl import run_verl_demo

        return run_verl_demo(root=args.root, as_json=args.json, ranks=args.ranks, steps=args.steps,
                             save_every=args.save_every)
    if args.command == "demo":
        from ckptd.testing.demo import run_demo

        return run_demo(root=args.root, as_json=args.json, ranks=4 if args.ranks is None else args.ranks,
                        steps=12 if args.steps is None else args.steps,
                        save_every=4 if args.save_every is None else args.save_every)
    if args.command in COMMANDS:
        return run_command(args)
    return asyncio.run(run_offline(args, _storage_options(args)))


# attributes of the serve command's namespace that are not daemon options
_NOT_OPTIONS = frozenset({"command", "config", "log_level", "storage_option", *_STORAGE_FLAGS})


def _serve(args: argparse.Namespace) -> int:
    from ckptd.daemon.config import load_config
    from ckptd.daemon.server import Daemon

    flags: dict[str, object] = {k: v for k, v in vars(args).items() if k not in _NOT_OPTIONS}
    flags["storage"] = _storage_flag_values(args)
    cfg = load_config(flags, os.environ, args.config)
    return asyncio.run(Daemon(cfg).run())


if __name__ == "__main__":
    sys.exit(main())
