"""Start real training-rank processes joined by a gloo process group (for the demo, tests, benchmarks).

Each rank is its own OS process (forkserver: torch is imported once, ranks fork from a clean server; NCCL
ranks, one GPU each, are spawned instead), gets torchrun-style environment variables, joins
``torch.distributed`` with gloo (or NCCL) on 127.0.0.1 and runs
``fn(rank, world_size, *args)``. Results and tracebacks come back over a pipe.

This is the one launcher: :func:`ckptd.testing.toy_gpt.spawn_ranks` is a thin wrapper over
:func:`run_ranks`.
"""

from __future__ import annotations

import contextlib
import multiprocessing as mp
import os
import pickle  # allow-pickle: rank results come back from our own child over a private pipe
import shutil
import socket
import tempfile
import time
import traceback
from collections.abc import Callable, Iterator, Mapping, Sequence
from multiprocessing.connection import Connection
from multiprocessing.process import BaseProcess
from typing import Any, Literal

# Imported once by the forkserver, so forked ranks start warm. The server is one per parent process and
# keeps the list it started with, so the (optional) megatron-core modules are in the default list: a
# pytest session that first launches plain ranks still forks warm Megatron ranks later (~4 s per rank
# saved). A module that does not import is skipped by the server.
_PRELOAD = [
    "torch",
    "torch.distributed",
    "numpy",
    "megatron.core.models.gpt",
    "megatron.core.optimizer",
    "megatron.core.distributed",
    "megatron.core.pipeline_parallel",
]


class RankFailedError(RuntimeError):
    """A rank raised or died; the message carries its traceback or exit code."""


@contextlib.contextmanager
def socket_dir(prefix: str = "ckptd-") -> Iterator[str]:
    """A short private directory (``0700`` under ``/tmp``) for daemons' sockets, removed afterwards: a Unix
    socket's path holds at most 107 bytes, which a test's ``tmp_path`` or a deep ``--root`` outgrows."""
    d = tempfile.mkdtemp(prefix=prefix, dir="/tmp")  # mkdtemp makes it 0700
    try:
        yield d
    finally:
        shutil.rmtree(d, ignore_errors=True)


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


Launcher = Literal["torchrun", "ray", "slurm"]


def launcher_env(launcher: Launcher, rank: int, world_size: int, local_world_size: int) -> dict[str, str]:
    """The variables a rank gets from torchrun, from verl's Ray workers, or from ``srun`` (ranks packed per node)."""
    local, node = rank % local_world_size, rank // local_world_size
    if launcher == "torchrun":
        return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local),
                "LOCAL_WORLD_SIZE": str(local_world_size), "GROUP_RANK": str(node)}
    if launcher == "ray":  # verl's worker env: no LOCAL_WORLD_SIZE, no node index
        return {"RANK": str(rank), "WORLD_SIZE": str(world_size), "LOCAL_RANK": str(local),
                "RAY_LOCAL_WORLD_SIZE": str(local_world_size), "RAY_LOCAL_RANK": str(local)}
    nodes = -(-world_size // local_world_size)
    return {"SLURM_PROCID": str(rank), "SLURM_NTASKS": str(world_size), "SLURM_LOCALID": str(local),
            "SLURM_NODEID": str(node), "SLURM_NNODES": str(nodes),
            "SLURM_TASKS_PER_NODE": f"{local_world_size}(x{nodes})"}


def _child(
    rank: int, world_size: int, port: int, store: str, fn: Callable[..., Any], args: Sequence[Any],
    env: Mapping[str, str], conn: Connection, local_world_size: int, launcher: Launcher = "torchrun",
    backend: str = "gloo",
) -> None:
    os.environ.update(env)
    threads = os.environ.get("OMP_NUM_THREADS", "1")
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port), OMP_NUM_THREADS=threads)
    os.environ.update(launcher_env(launcher, rank, world_size, local_world_size))
    import torch
    import torch.distributed as dist

    torch.set_num_threads(int(os.environ["OMP_NUM_THREADS"]))
    try:
        # the rendezvous through a file: a TCP store's port, free when picked, can be taken by another
        # process before rank 0 listens on it (EADDRINUSE); MASTER_PORT stays set, as torchrun sets it
        if backend == "nccl":  # one GPU a rank, by its local rank
            torch.cuda.set_device(rank % local_world_size)
        dist.init_process_group(backend, rank=rank, world_size=world_size, init_method=f"file://{store}")
        # every rank's side of the mesh connected before any rank goes on: a rank whose fn returns at once
        # would otherwise tear its connections down under a peer still connecting (gloo: "Connection closed
        # by peer" in that peer's init_process_group, which then hides the peer's own result or error)
        dist.barrier()
        result = fn(rank, world_size, *args)
        # plain pickle, by value: multiprocessing's own pickler would pass tensors as shared-memory file
        # descriptors, which the parent can no longer fetch once this process has exited
        conn.send_bytes(pickle.dumps(("ok", result)))
    except BaseException:
        conn.send_bytes(pickle.dumps(("error", traceback.format_exc())))
        raise SystemExit(1) from None
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()
        conn.close()


def run_ranks(
    fn: Callable[..., Any],
    world_size: int,
    *args: Any,
    local_world_size: int | None = None,
    env: Mapping[str, str] | None = None,
    timeout_s: float = 300.0,
    may_exit: Sequence[int] = (),
    preload: Sequence[str] = (),
    launcher: Launcher = "torchrun",
    backend: str = "gloo",
) -> list[Any]:
    """Run ``fn`` on ``world_size`` ranks and return their results in rank order.

    ``fn`` and ``args`` must be picklable (a module-level function); results come back by value
    (tensors included). ``may_exit`` lists ranks allowed to end without a result (tests that kill a rank
    on purpose; their result is None). Any other failure raises :class:`RankFailedError` with the rank's
    traceback. ``preload`` adds modules for the forkserver to import, which takes effect only when this
    call starts the server (the first launch in this process). ``launcher`` picks the environment each rank
    gets (:func:`launcher_env`): torchrun's, Ray's as verl sets it, or SLURM's. ``backend`` is the process
    group's (``"nccl"`` puts each rank on the GPU of its local rank).
    """
    if backend == "nccl":  # spawned: a preloaded module may have initialized CUDA in the forkserver
        ctx: Any = mp.get_context("spawn")
    else:
        ctx = mp.get_context("forkserver")
        ctx.set_forkserver_preload([*_PRELOAD, *(m for m in preload if m not in _PRELOAD)])
    port = free_port()
    with tempfile.TemporaryDirectory(prefix="ckptd-rdv-") as rendezvous:
        store = os.path.join(rendezvous, "store")
        procs, pipes = [], []
        for rank in range(world_size):
            parent, child = ctx.Pipe(duplex=False)
            p = ctx.Process(
                target=_child,
                args=(rank, world_size, port, store, fn, args, dict(env or {}), child, local_world_size or world_size,
                      launcher, backend),
                name=f"rank{rank}",
            )
            p.start()
            child.close()
            procs.append(p)
            pipes.append(parent)
        return _collect(procs, pipes, timeout_s, may_exit)


def _collect(
    procs: Sequence[BaseProcess], pipes: Sequence[Connection], timeout_s: float, may_exit: Sequence[int]
) -> list[Any]:
    """Each rank's result, in rank order, once all sent one; :class:`RankFailedError` as soon as one failed."""
    world_size = len(procs)
    results: list[Any] = [None] * world_size
    errors: list[str] = []
    deadline = time.monotonic() + timeout_s
    pending = set(range(world_size))
    while pending:
        for rank in list(pending):
            conn = pipes[rank]
            if conn.poll(0.05):
                try:
                    status, value = pickle.loads(conn.recv_bytes())  # allow-pickle: our own child, see _child
                except EOFError:
                    status, value = "exit", None
                if status == "ok":
                    results[rank] = value
                elif status == "error":
                    errors.append(f"rank {rank} failed:\n{value}")
                elif rank not in may_exit:
                    procs[rank].join(5)
                    errors.append(f"rank {rank} died (exit code {procs[rank].exitcode}) without a result")
                pending.discard(rank)
        if errors or time.monotonic() > deadline:
            break
    if pending and not errors:
        errors.append(f"ranks {sorted(pending)} did not finish within {timeout_s:.0f}s")
    for p in procs:
        p.join(1 if errors else 30)
        if p.is_alive():
            p.kill()
            p.join()
    if errors:
        raise RankFailedError("\n".join(errors))
    return results


class DaemonProcess:
    """A ``ckptd serve`` subprocess (the demo, tests and benchmarks run the daemon as users do)."""

    def __init__(self, root: str, socket_path: str, *extra: str, env: Mapping[str, str] | None = None,
                 log_path: str | None = None) -> None:
        import subprocess
        import sys

        self.root = root
        self.socket = socket_path
        self.log_path = log_path
        cmd = [sys.executable, "-m", "ckptd.daemon.cli", "serve", "--root", root, "--socket", socket_path, *extra]
        out = open(log_path, "ab") if log_path else subprocess.DEVNULL  # noqa: SIM115 - owned by the process
        self.proc = subprocess.Popen(cmd, stdout=out, stderr=out, stdin=subprocess.DEVNULL,
                                     env={**os.environ, **(env or {})})

    def wait_ready(self, timeout: float = 60.0) -> DaemonProcess:
        """Wait until this daemon answers a ``Hello`` on its socket with its own pid.

        A successful ``connect()`` is not enough: the socket of a daemon killed on the same path keeps
        accepting connections for a moment after its connections were reset (the kernel releases the
        dead process's files one by one), and resets them too without a reply.
        """
        from ckptd.client.protocol import PROTOCOL_VERSION, Hello, Welcome
        from ckptd.daemon.commands import request
        from ckptd.writer.errors import DaemonUnavailableError

        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RankFailedError(f"daemon exited with code {self.proc.returncode}: {self.log_tail()}")
            try:
                hello = Hello(v=PROTOCOL_VERSION, pid=os.getpid(), rank=-1)
                welcome = request(self.socket, hello, max(0.1, min(5.0, deadline - time.monotonic())))
            except DaemonUnavailableError:  # nothing listens yet, or a dead predecessor's socket reset us
                welcome = None
            if isinstance(welcome, Welcome) and welcome.daemon_pid == self.pid:
                return self
            time.sleep(0.05)
        raise RankFailedError(f"daemon not ready within {timeout}s: {self.log_tail()}")

    def log_tail(self, n: int = 4000) -> str:
        if not self.log_path or not os.path.exists(self.log_path):
            return ""
        with open(self.log_path, "rb") as fh:
            return fh.read().decode(errors="replace")[-n:]

    @property
    def pid(self) -> int:
        return int(self.proc.pid)

    def kill(self) -> None:
        self.proc.kill()
        self.proc.wait()

    def stop(self, timeout: float = 60.0) -> int:
        """SIGTERM, wait for the drain; SIGKILL if it overstays. Returns the exit code."""
        import subprocess

        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        return int(self.proc.returncode)
