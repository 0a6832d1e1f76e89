"""How a save that failed on one rank ends on every rank the same way (issue 68, item 5).

Rank 0 alone creates a save's directory and publishes it; the other ranks used to wait for it at a barrier, so a
UserError inside the publish (another writer moved the directory, the lease was taken) ended rank 0 and left the
rest there until the hang watchdog. Now whatever rank 0 (or any rank's background save) meets becomes a
**verdict**, shared as the fence's is, and every rank raises the same thing from it:

  None           the save is published
  ("io", line)   an I/O failure (a full disk, a failing file system): `SaveIOFailure(line)` on every rank; the
                 trainer keeps the previous checkpoints and trains on, unless the save was its last (one line,
                 exit 2: nagmoe/train/checkpoint_schedule.py)
  ("halt", line) anything else (a UserError: the directory moved, the lease taken; an unexpected error):
                 `UserError(line)` on every rank, the run stops with that line
"""
from __future__ import annotations

from typing import Callable, Optional

from nagmoe.base.errors import UserError

Verdict = Optional[tuple]


class SaveIOFailure(OSError):
    """A save lost to an I/O failure on some rank; `reason` is the line every rank reports."""

    def __init__(self, reason: str):
        super().__init__(reason)
        self.reason = reason


def io_reason(exc: BaseException) -> Optional[str]:
    """The one-line reason of an I/O failure (an OSError, or DCP's CheckpointException wrapping one); None when
    `exc` is not one."""
    if isinstance(exc, SaveIOFailure):
        return exc.reason
    if isinstance(exc, OSError):
        return f"{type(exc).__name__}: {exc.strerror or exc}"
    failures = getattr(exc, "failures", None)  # torch.distributed.checkpoint's CheckpointException
    if isinstance(failures, dict):
        for wrapped in failures.values():
            inner = wrapped[0] if isinstance(wrapped, tuple) else wrapped
            if isinstance(inner, OSError):
                return f"{type(inner).__name__}: {inner.strerror or inner}"
    return None


def verdict_of(exc: BaseException, rank: int) -> tuple:
    """The verdict of `exc` met by `rank` during a save."""
    reason = io_reason(exc)
    if reason is not None:
        return ("io", reason)
    if isinstance(exc, UserError):
        return ("halt", str(exc))
    return ("halt", f"checkpoint save failed on rank {rank}: {type(exc).__name__}: {exc}")


def run_for_verdict(fn: Callable[[], object], rank: int) -> tuple:
    """(fn's result, None) or (None, its verdict). Only errors become verdicts (an Exception, or DCP's
    CheckpointException, a BaseException); KeyboardInterrupt, SystemExit and the like propagate."""
    from torch.distributed.checkpoint.api import CheckpointException

    try:
        return fn(), None
    except (Exception, CheckpointException) as exc:
        return None, verdict_of(exc, rank)


def raise_verdict(verdict: Verdict) -> None:
    """What every rank raises for a shared verdict (module docstring); nothing for None."""
    if verdict is None:
        return
    kind, line = verdict
    if kind == "io":
        raise SaveIOFailure(line)
    raise UserError(line)
