"""The ranks of a load agree, before anything is written, on the step and on whether every one can load it.

Each rank checks what it reads, and what it reads differs (its TP/PP/DP coordinates, its slice of every
bucket), so one rank may refuse a checkpoint another would load. Left alone, the ranks that loaded would go
on into the trainer's next collective and wait there for the refusing one until the process group times
out; and ranks that resolve ``"latest"`` a moment apart, while the job before still commits, could load
two different steps. :class:`LoadAgreement` makes two small all-reduces, always both and always in this
order on every rank whatever happened before (so the collectives stay paired), and a third once the ranks
have begun writing:

1. :meth:`~LoadAgreement.step`: the step every rank loads: the highest any rank resolved (as Megatron-LM's
   own load agrees on its tracker file's iteration), with one warning on a rank that saw another.
2. :meth:`~LoadAgreement.verdict`, right before the load's first write: the lowest rank that refused, if
   any. That rank raises its own error; every other raises the same class naming that rank, so a trainer
   that catches the error handles it on every rank, and no rank has written anything.
3. :meth:`~LoadAgreement.done`, after the verdict let every rank write: whether every rank finished. A read
   that fails then (a chunk whose checksum differs, storage gone), or a check after the reads, fails one
   rank while the others would return loaded and wait for it in the trainer's next collective; instead
   every rank raises, the failed rank its own error, the others the same class naming it (their models hold
   the step, that rank's only part of it: load again on every rank).

A rank interrupted meanwhile (``KeyboardInterrupt``, a cancelled task) takes part as one that failed.
Without an initialized process group (one process) there is nothing to agree on and no collective.
:func:`tell_rollback`: the first rank's warning when the agreed step, named by number, is older than the
newest committed one.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist

from ckptd.writer.errors import CkptdError, error_classes

if TYPE_CHECKING:
    from ckptd.writer.root import CheckpointRoot

logger = logging.getLogger(__name__)

_NONE = -1  # a rank that found no committed step
_FAILED = -2  # a rank whose resolution failed otherwise (its refusal follows in the verdict)
_CLASSES = sorted(error_classes())  # the same list on every rank: the code of an error class is its index


class LoadAgreement:
    """The two agreements of one load among the ranks of ``group`` (the default group when None)."""

    def __init__(self, group: dist.ProcessGroup | None = None) -> None:
        together = dist.is_available() and dist.is_initialized() and dist.get_world_size(group) > 1
        self._group = group if together else None
        self._together = together
        self.first = not together or dist.get_rank(group) == 0  # the rank that speaks for all (one log line)
        # where the collectives' tensors go, taken in the caller's thread: a load run on another thread (an
        # event loop already running there) would find CUDA device 0 current on every rank
        self._device = _device(self._group) if together else torch.device("cpu")
        # made once, here: an allocation that fails later (CUDA out of memory after the load filled the
        # device) would fail again in refuse(), leaving the other ranks waiting in an all-reduce
        # (empty: no kernel writes it on this thread's CUDA stream; fill_ is its only write, on the collectives')
        self._flag = torch.empty(1, dtype=torch.int64, device=self._device) if together else None
        self.stepped = False
        self._settled = False  # the verdict is made
        self._ended = False  # no collective follows: every rank ended alike, or the last one is made

    def step(self, resolved: int | None) -> int | None:
        """The step to load: the highest ``resolved`` over the ranks (None: this rank found none; returned
        when no rank found one)."""
        mine = _NONE if resolved is None else resolved
        agreed = self._reduce(mine, highest=True) if self._together else mine
        self.stepped = True
        if agreed < 0:
            return None
        if resolved is not None and agreed != resolved:
            logger.warning("this rank resolved step %d, another rank step %d: loading step %d on every rank",
                           resolved, agreed, agreed)
        return agreed

    def verdict(self, *, last: bool = False) -> None:
        """Every rank can load: go on and write (``last``: every rank ends here alike, with nothing written,
        and no :meth:`done` follows). Else raise the refusing rank's error class, naming it."""
        if self._settled:
            return
        self._settled = True
        if not self._together:
            self._ended = True
            return
        lowest = self._lowest(None)  # (what fails before its all-reduce goes to refuse(), which makes it)
        self._ended = last or lowest is not None  # every rank raises here alike: nothing more to agree on
        if lowest is not None:
            rank, cls = lowest
            raise cls(f"rank {rank} refused this load ({cls.__name__}: that rank's error says why); no rank "
                      "has written into its model or optimizer")

    def done(self) -> None:
        """This rank finished its load (the last collective, after a :meth:`verdict` that let every rank
        write). Raise the failed rank's error class, naming it, where another rank did not finish."""
        if self._ended or not self._settled:
            return
        lowest = self._lowest(None)  # (what fails before its all-reduce goes to refuse(), which makes it)
        self._ended = True
        if lowest is not None:
            rank, cls = lowest
            raise cls(f"rank {rank} failed while loading, after every rank had begun writing ({cls.__name__}: that "
                      "rank's error says why); this rank's model and optimizer hold the step, that rank's only "
                      "part of it: load again on every rank")

    def refuse(self, exc: BaseException) -> None:
        """This rank cannot load (``exc``): take part in what is left of the agreement, saying so (in the
        verdict before any write, else in the last collective)."""
        if self._ended:
            return
        if not self.stepped:
            self.step_failed()
        self._settled = True
        if self._together:  # the verdict's all-reduce, or after the verdict let every rank write, done()'s
            self._lowest(exc)
        self._ended = True

    def _lowest(self, exc: BaseException | None) -> tuple[int, type[CkptdError]] | None:
        """One all-reduce of this rank's failure (``exc``; None: none): the lowest rank that failed and its
        error class, or None where none did."""
        world = dist.get_world_size(self._group)
        mine = world * len(_CLASSES)
        if exc is not None:
            name = type(exc).__name__ if isinstance(exc, CkptdError) else CkptdError.__name__
            code = _CLASSES.index(name) if name in _CLASSES else _CLASSES.index(CkptdError.__name__)
            mine = dist.get_rank(self._group) * len(_CLASSES) + code
        lowest = self._reduce(mine, highest=False)
        if lowest >= world * len(_CLASSES):
            return None
        rank, code = divmod(lowest, len(_CLASSES))
        return rank, error_classes()[_CLASSES[code]]

    def step_failed(self) -> None:
        """This rank could not resolve the step: take part in the step's agreement without one."""
        if self._together:
            self._reduce(_FAILED, highest=True)
        self.stepped = True

    def _reduce(self, value: int, *, highest: bool) -> int:
        flag = self._flag
        assert flag is not None  # only under a process group
        flag.fill_(value)  # (a failure here, before the collective, leaves it to refuse())
        try:
            dist.all_reduce(flag, op=dist.ReduceOp.MAX if highest else dist.ReduceOp.MIN, group=self._group)
            return int(flag.item())
        except BaseException:  # the group itself failed (a peer gone, a timeout): no collective may follow
            self.stepped = self._settled = self._ended = True
            raise


async def tell_rollback(ckpt: CheckpointRoot, step: int) -> None:
    """A step older than the newest committed one, loaded by number, is a rollback: say (once, on the first
    rank) that ``latest`` and retention still go by step number until the newer steps are removed. Only a
    warning: storage failing to answer here does not fail the load (nor, through the agreement, every rank's)."""
    try:
        newer = await ckpt.latest_hint()
        rolled_back = newer is not None and newer > step and await ckpt.is_committed(newer)
    except (CkptdError, OSError) as exc:
        logger.debug("step %d: could not tell whether it is older than the newest committed step: %s", step, exc)
        return
    if rolled_back:
        logger.warning(
            "loading step %d while step %d is the newest committed under %s: a save of a step number already "
            "committed is refused, a later load of 'latest' returns to step %d, and retention (--keep) keeps the "
            "newest steps by number. To train on from step %d, remove the newer steps before the next save: "
            "ckptd gc %s --after %d", step, newer, ckpt.url, newer, step, ckpt.url, step)


def _device(group: dist.ProcessGroup | None) -> torch.device:
    """Where this group's collectives take their tensors: CUDA when its backend is NCCL alone."""
    backend = str(dist.get_backend(group)).lower()
    if "nccl" in backend and "gloo" not in backend and torch.cuda.is_available():
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
