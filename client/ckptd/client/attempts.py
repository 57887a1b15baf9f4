"""Which attempt at a step a save belongs to: the token that keeps two attempts' bytes apart.

A step may be saved more than once: again after a failure, or by a trainer restarted from an earlier step
that reaches it again. The nodes' daemons coordinate through storage alone, so without a name for the
attempt a coordinator could commit one node's part of a failed attempt beside the other nodes' parts of
the new one, and a restarted rank could join its node's unfinished attempt of the dead processes
(docs/format.md, "Attempts").

The token is ``<incarnation>.<n>``. The incarnation is shared by every rank of one run of the trainer's
processes; ``n`` counts this process's save calls of the step (1 the first time, 2 for a retry), the same
on every rank because every rank makes every save call. A call that tries again inside itself (the Megatron
save replans once when a state tensor changed under its plan, :func:`ckptd.client.megatron.save.save`)
is one call: it keeps its token, since its peers, which did not try again, keep theirs. The counts are
the process's, by (incarnation, rank, step), kept for its life (a few ints a saved step): a client made anew
in the same process (another root, a client per save) goes on counting, so a token never repeats within an
incarnation.
The incarnation is, first found:

- ``CKPTD_INCARNATION``, when the launcher sets it: the same on every rank of one run, another on each
  restart;
- a random token agreed through the default process group's store: one ``compare_set`` by each rank at its
  first save (the first rank to ask sets it; no collective, nobody waits). The store lives as long as the
  process group, so a restarted job agrees on a new one;
- none: the token is ``""`` and attempts are told apart by time and by rank, as before this token existed.
"""

from __future__ import annotations

import contextlib
import re
import secrets
from collections.abc import Iterator, Mapping

import torch.distributed as dist

from ckptd.writer.errors import ConfigError

ENV = "CKPTD_INCARNATION"
STORE_KEY = "ckptd/incarnation"
MAX_LEN = 96  # the bound in VALID
VALID = re.compile(r"[A-Za-z0-9_.:-]{1,96}")
_COUNTS: dict[tuple[str, int, int], int] = {}  # (incarnation, rank, step): save calls made, by every client


def valid_token(token: str) -> bool:
    """An attempt token or incarnation as this module makes them (``""``: none)."""
    return token == "" or VALID.fullmatch(token) is not None


def _from_store() -> str:
    """The incarnation agreed through the default process group's store; ``""`` without one."""
    if not (dist.is_available() and dist.is_initialized()):
        return ""
    try:
        store = dist.distributed_c10d._get_default_store()
        agreed = store.compare_set(STORE_KEY, "", secrets.token_hex(8))
    except Exception:  # a store without compare_set, a private API that moved: no incarnation
        return ""
    token = agreed.decode() if isinstance(agreed, bytes) else str(agreed)
    return token if VALID.fullmatch(token) else ""


class Attempts:
    """This process's attempt tokens: :meth:`next` once per save call, the same again inside :meth:`one_call`."""

    def __init__(self, env: Mapping[str, str], rank: int = 0) -> None:
        given = env.get(ENV, "")
        if not valid_token(given):
            raise ConfigError(f"{ENV}={given!r}: up to {MAX_LEN} of A-Z a-z 0-9 _ . : -")
        self._incarnation = given
        self._rank = rank
        self._call: tuple[int, str | None] | None = None  # (step, its token once taken) inside one_call

    @property
    def incarnation(self) -> str:
        if not self._incarnation:  # asked again until a process group exists (a client made before it)
            self._incarnation = _from_store()
        return self._incarnation

    def next(self, step: int) -> str:
        """The token of a new save of ``step`` by this process."""
        if self._call is not None and self._call[0] == step and self._call[1] is not None:
            return self._call[1]  # tried again within one save call
        incarnation = self.incarnation
        token = ""  # unnamed: nothing to count
        if incarnation:
            key = (incarnation, self._rank, step)
            n = _COUNTS[key] = _COUNTS.get(key, 0) + 1
            token = f"{incarnation}.{n}"
        if self._call is not None and self._call[0] == step:
            self._call = (step, token)
        return token

    @contextlib.contextmanager
    def one_call(self, step: int) -> Iterator[None]:
        """Saves of ``step`` inside are one save call: the first takes the next token, the others reuse it
        (inside an outer one for the same step: the outer call's)."""
        if self._call is not None and self._call[0] == step:
            yield
            return
        outer, self._call = self._call, (step, None)
        try:
            yield
        finally:
            self._call = outer
