"""A test server in its own child process, tied to its parent by a pipe (both sides live here).

The child prints ``<prefix><port>`` on stdout once it listens and runs until its stdin closes (the parent
closed the pipe or died) or it gets SIGTERM, so a crashed test run never leaves a server behind. Used by
``s3server.py`` (moto) and ``faultproxy.py``; importable without pytest.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import threading


# --- parent side ----------------------------------------------------------------------------------
def read_port(proc: subprocess.Popen[str], prefix: str, timeout: float) -> int | None:
    """The port the child reports on stdout, or None if it reports none within ``timeout`` seconds."""
    found: list[int] = []

    def reader() -> None:
        assert proc.stdout is not None
        for line in proc.stdout:
            if line.startswith(prefix):
                found.append(int(line[len(prefix) :]))
                return

    thread = threading.Thread(target=reader, daemon=True)
    thread.start()
    thread.join(timeout)
    return found[0] if found else None


def stop(proc: subprocess.Popen[str], timeout: float = 10.0) -> None:
    """Close the child's stdin (it exits on EOF), then SIGTERM, then SIGKILL; ``timeout`` bounds the waits."""
    if proc.stdin is not None:
        with contextlib.suppress(OSError):
            proc.stdin.close()
    try:
        proc.wait(timeout=timeout / 2)
    except subprocess.TimeoutExpired:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=timeout / 2)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
    if proc.stdout is not None:
        proc.stdout.close()


# --- child side -----------------------------------------------------------------------------------
def serve_until_parent_leaves(prefix: str, port: int) -> None:
    """Report ``port`` to the parent, then block until stdin closes or SIGTERM (Ctrl-C is the parent's)."""
    done = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: done.set())
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    def wait_stdin() -> None:
        if not os.isatty(0):  # run by hand from a terminal: only SIGTERM stops it
            sys.stdin.read()  # returns at EOF
            done.set()

    threading.Thread(target=wait_stdin, daemon=True).start()
    print(f"{prefix}{port}", flush=True)
    done.wait()
