"""Operator commands: ``ckptd status`` (ask a live daemon) and ``ckptd plan`` (size the arena).

Both are light: ``status`` speaks the socket protocol directly (no torch, no arena mapping), ``plan``
is the pure rule of sizing.py.
"""

from __future__ import annotations

import argparse
import glob
import json
import os
import time
from typing import Any

import msgspec

from ckptd.client.paths import client_socket_path, default_socket_path
from ckptd.client.protocol import (
    HEADER,
    PROTOCOL_VERSION,
    ErrorReply,
    Hello,
    Reply,
    ReportRequest,
    StatusReport,
    Welcome,
    _Msg,
    decode_reply,
    encode,
    frame_length,
    recv_exactly,
)
from ckptd.client.trust import connect_own
from ckptd.daemon.sizing import WEIGHT_BYTES, parse_count, plan_arena
from ckptd.writer.errors import ConfigError, DaemonUnavailableError, ProtocolError

COMMANDS = ("status", "plan")


def add_commands(sub: Any) -> None:  # argparse's _SubParsersAction is private
    """Register ``status`` and ``plan`` on the ``ckptd`` parser's subcommands."""
    st = sub.add_parser("status", help="show a running daemon: steps in flight, arena, throughput, errors")
    where = st.add_mutually_exclusive_group()
    where.add_argument("--socket", help="the daemon's socket (default: $CKPTD_SOCKET, the socket of "
                       "$CKPTD_ROOT, else this user's one daemon on the node)")
    where.add_argument("--root", help="find the daemon serving this checkpoint root (among this user's sockets)")
    st.add_argument("--json", action="store_true")
    st.add_argument("--timeout", type=float, default=5.0, help="seconds to wait for the daemon's answer")
    st.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                    help="wait up to this long for a daemon to answer at all (a starting one fills its arena "
                    "before it listens): what a job script runs between `ckptd serve &` and its ranks "
                    "(default 0: ask once)")

    pl = sub.add_parser("plan", help="the staging arena size a model needs (per node)")
    pl.add_argument("--params", required=True, help="parameter count: 7e9, 70B, 350M or an integer")
    pl.add_argument("--tp", type=int, default=1)
    pl.add_argument("--pp", type=int, default=1)
    pl.add_argument("--dp", type=int, default=1)
    pl.add_argument("--ranks-per-node", type=int, default=8)
    pl.add_argument("--weight-dtype", default="bf16", choices=sorted(WEIGHT_BYTES))
    pl.add_argument("--optimizer", default="adam", choices=["adam", "sgd", "none"])
    pl.add_argument("--json", action="store_true")


def run_command(args: argparse.Namespace) -> int:
    if args.command == "plan":
        return _plan(args)
    return _status(args)


# --- status ---------------------------------------------------------------------------------------
def request(path: str, msg: _Msg, timeout: float) -> Reply:
    """One request/reply on a fresh connection to the daemon at ``path``: a daemon of this user's only
    (:func:`~ckptd.client.trust.connect_own`, :class:`ConfigError` for anything else)."""
    with connect_own(path, timeout) as sock:
        try:
            sock.sendall(encode(msg))
            header = recv_exactly(sock, HEADER.size)
            reply = decode_reply(recv_exactly(sock, frame_length(header)))
        except (OSError, ProtocolError) as exc:
            raise DaemonUnavailableError(f"no answer from a ckptd daemon at {path}: {exc}") from exc
    if isinstance(reply, ErrorReply):
        raise DaemonUnavailableError(f"the daemon at {path} refused: {reply.code}: {reply.message}")
    return reply


def find_socket(root: str, timeout: float) -> str:
    """The socket of this user's daemon that serves ``root`` (sockets next to the default one)."""
    from ckptd.writer.urls import normalize_root

    want = normalize_root(root)
    base = os.path.dirname(default_socket_path(os.environ))
    for path in sorted(glob.glob(os.path.join(base, "**", "*.sock"), recursive=True)):
        try:
            welcome = request(path, Hello(v=PROTOCOL_VERSION, pid=os.getpid(), rank=-1), timeout)
        except (DaemonUnavailableError, ConfigError):  # not there, or not this user's
            continue
        if isinstance(welcome, Welcome) and normalize_root(welcome.root) == want:
            return path
    raise DaemonUnavailableError(f"no running daemon serves {want} (looked for sockets under {base})")


def _status(args: argparse.Namespace) -> int:
    deadline = time.monotonic() + max(0.0, args.wait)
    while True:
        try:
            path, reply = _report(args)
            break
        except DaemonUnavailableError:  # not (yet) there: asked again until --wait is over
            if time.monotonic() >= deadline:
                raise
            time.sleep(min(0.5, max(0.0, deadline - time.monotonic())))
    if not isinstance(reply, StatusReport):
        raise ProtocolError(f"the daemon answered {type(reply).__name__} to a status report request")
    if args.json:  # the socket the daemon listens on; the one asked when it did not say (an older daemon)
        print(json.dumps({**msgspec.to_builtins(reply), "socket": reply.socket or path}, indent=2))
        return 0
    print(format_report(reply, path))
    return 0


def _report(args: argparse.Namespace) -> tuple[str, Reply]:
    # with neither flag, the socket a client given no root would use: $CKPTD_SOCKET, $CKPTD_ROOT's, else this
    # user's one daemon on the node (several: an error naming how many)
    path = args.socket or (find_socket(args.root, args.timeout) if args.root else client_socket_path(os.environ))
    return path, request(path, ReportRequest(v=PROTOCOL_VERSION), args.timeout)


def format_report(r: StatusReport, path: str) -> str:
    """The human-readable ``ckptd status``."""
    mib = 1 << 20
    used = r.arena_bytes - r.arena_free_bytes
    owner = f"owner pid {r.owner_pid}" if r.owner_pid else "no owner pid"
    state = "DRAINING: takes no new saves; exits when its steps in flight end (or --drain-grace is over)"
    lines = [
        f"daemon   pid {r.daemon_pid}  socket {r.socket or path}  up {r.uptime_s:.0f}s",
        f"job      {r.job_id or 'any (no --job-id)'}  {owner}",
        f"state    {state if r.draining else 'serving'}",
        f"root     {r.root}",
        f"arena    {used / mib:.0f} MiB used / {r.arena_bytes / mib:.0f} MiB  ({r.arena_free_bytes / mib:.0f} MiB "
        f"free, {r.leases} lease(s); {r.arena_ahead_bytes / mib:.0f} MiB granted ahead for next saves)"
        + (f"; {r.arena_waiting} save(s) waiting for staging space" if r.arena_waiting else ""),
        "restore  in-memory restore off (--no-retain)" if not r.retain else
        f"restore  in-memory restore on, {r.arena_retained_bytes / mib:.0f} MiB of the newest commit kept",
        f"steps    {r.in_flight} in flight, {r.commits} committed, {r.failures} failed since start",
        f"written  {r.bytes_written / mib:.1f} MiB, last step at {r.bytes_per_s / mib:.0f} MiB/s; "
        f"storage retries {r.retries}",
        f"metrics  {r.metrics_url or 'off (--metrics-port)'}",
    ]
    if r.last_error:
        lines.append(f"last error  {r.last_error}")
    if r.steps:
        lines.append(f"{'step':>8} {'state':<10} {'node':>4} {'ranks':>7} {'MiB':>9} {'age s':>8}  error")
        for s in r.steps:
            lines.append(f"{s.step:>8} {s.state.value:<10} {s.node:>4} {f'{s.ranks_saved}/{s.local_world_size}':>7} "
                         f"{s.nbytes / mib:>9.1f} {s.age_s:>8.1f}  {s.error}")
    return "\n".join(lines)


# --- plan -----------------------------------------------------------------------------------------
def _plan(args: argparse.Namespace) -> int:
    plan = plan_arena(parse_count(args.params), tp=args.tp, pp=args.pp, dp=args.dp,
                      ranks_per_node=args.ranks_per_node, weight_dtype=args.weight_dtype, optimizer=args.optimizer)
    if args.json:
        print(json.dumps(plan.to_dict(), indent=2))
        return 0
    gib = 1 << 30
    print(f"{plan.params:,} params, TP={plan.tp} PP={plan.pp} DP={plan.dp}, {plan.ranks_per_node} ranks/node, "
          f"{plan.weight_dtype} weights + {plan.optimizer}: {plan.bytes_per_param} B/param staged")
    print(f"per rank  {plan.per_rank_bytes / gib:.2f} GiB")
    print(f"per node  {plan.per_node_bytes / gib:.2f} GiB (with headroom)")
    print(f"--arena-size {plan.minimum_arena_bytes // gib}GiB   (one save staged at a time)")
    print(f"--arena-size {plan.overlap_arena_bytes // gib}GiB   (a save may start while the previous one drains)")
    return 0
