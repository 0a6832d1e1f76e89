"""When the trainer saves, and what it does when a save cannot be written (issue 27).

Saves are due (any of):
  * every `train.checkpoint_every` steps, and at the last step (as before);
  * `train.checkpoint_every_minutes` of wall time since the last save or the start, on rank 0's clock: rank 0
    decides at each sync step and every rank follows (the decision rides the loop's one collective,
    nagmoe/train/step_decisions.py), so ranks whose clocks disagree still save together, at most
    `train.sync_every` steps late;
  * a milestone: each time the run's tokens pass a multiple of `train.keep_milestone_every_tokens`, never
    pruned, so the depth analysis has the model through training. `train.milestone_dtype` bf16 | fp32: the
    weights only, under RUN_DIR/milestones/ (nagmoe/checkpoint/milestone.py), besides the full checkpoints and
    not one of them: it neither makes a full save due nor restarts the minute clock. `full` (a run dir from
    before the key): a full checkpoint marked in its state.json (`extra.milestone`), which pruning keeps
    (nagmoe.checkpoint.publish.prune).

Before a save rank 0 compares the free space of the run dir's file system with the newest checkpoint's size
(x1.1) and every rank follows its decision. A save that is refused, or fails with an OSError (ENOSPC,
EIO, ...; DCP reports it from any rank to all), leaves the previous checkpoints as they were, removes its
partial directory and says so in one line; training continues. At the last step (or a preemption) there is
nothing to continue: the run stops with that line (exit 2), its previous checkpoint intact.
"""
from __future__ import annotations

import os
import shutil
import time
from typing import Callable, Optional

from nagmoe.checkpoint.files import CHECKPOINTS, list_checkpoints
from nagmoe.checkpoint.publish import remove_leftovers
from nagmoe.checkpoint.save_verdict import io_reason
from nagmoe.base.errors import UserError, warn
from nagmoe.rundir.names import MILESTONES

DISK_MARGIN = 1.1  # free space needed: the newest checkpoint's size times this


def dir_bytes(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


class CheckpointSchedule:
    def __init__(self, train_cfg, mesh, run_dir: str, tokens: int, clock: Callable[[], float] = time.monotonic):
        self.cfg, self.mesh, self.run_dir, self.clock = train_cfg, mesh, run_dir, clock
        self.last_save = clock()
        self.weights_milestones = train_cfg.milestone_dtype != "full"  # a milestone of its own, not a checkpoint
        every = train_cfg.keep_milestone_every_tokens
        self.milestone_index = tokens // every if every else 0

    def rank0_clock_due(self) -> bool:
        """Rank 0's clock decision (False elsewhere, and without `checkpoint_every_minutes`); no collective: it
        travels with a sync step's exchange."""
        minutes = self.cfg.checkpoint_every_minutes
        return bool(minutes) and self.mesh.rank == 0 and self.clock() - self.last_save >= 60.0 * minutes

    def is_milestone(self, tokens: int) -> bool:
        every = self.cfg.keep_milestone_every_tokens
        return bool(every) and tokens // every > self.milestone_index

    def due(self, step: int, tokens: int, last: bool, clock_due: bool = False) -> tuple[bool, bool]:
        """(a full checkpoint now, a milestone now) after optimizer step `step` with `tokens` seen; `clock_due`:
        rank 0's clock decision as shared by a sync step (the same on every rank). No collective: the rest is the
        same arithmetic on every rank. With `full` milestones a milestone is that checkpoint (saved marked);
        with weights milestones it is saved on its own, and the checkpoint only when otherwise due."""
        milestone = self.is_milestone(tokens)
        every = self.cfg.checkpoint_every
        full = last or clock_due or bool(every and step % every == 0)
        return full or (milestone and not self.weights_milestones), milestone

    def saved(self, tokens: int) -> None:
        """A full checkpoint was written: the minute clock restarts (and a `full` milestone is done)."""
        self.last_save = self.clock()
        if not self.weights_milestones:
            self.milestone_saved(tokens)

    def milestone_saved(self, tokens: int) -> None:
        every = self.cfg.keep_milestone_every_tokens
        if every:
            self.milestone_index = tokens // every

    def milestone_failed(self, step: int, reason: str) -> None:
        """A weights milestone at `step` failed: its partial directory goes, training continues (it is no resume
        point), one warning; the milestone stays due and is tried again at the next step."""
        if self.mesh.rank == 0:
            remove_leftovers(os.path.join(self.run_dir, MILESTONES))
            warn(f"milestone at step {step} not written ({reason}); training continues")

    # --------------------------------------------------------------------------------------------------
    def disk_refusal(self) -> Optional[str]:
        """Why the next save would not fit (rank 0 measures, every rank gets the same answer), or None."""
        reason = None
        if self.mesh.rank == 0:
            published = list_checkpoints(self.run_dir)
            needed = int(DISK_MARGIN * dir_bytes(published[-1][1])) if published else 0
            free = shutil.disk_usage(self.run_dir).free
            if free < needed:
                reason = f"{free / 2**30:.2f} GiB free, the last checkpoint took {needed / DISK_MARGIN / 2**30:.2f} GiB"
        if self.mesh.distributed:
            reason = self.mesh.broadcast(reason)
        return reason

    def failed(self, step: int, reason: str, fatal: bool) -> None:
        """A save at `step` was refused or failed: clean up, keep the previous checkpoints, say so."""
        if self.mesh.rank == 0:
            remove_leftovers(os.path.join(self.run_dir, CHECKPOINTS))
        published = list_checkpoints(self.run_dir)
        kept = os.path.basename(published[-1][1]) if published else "none"
        message = f"checkpoint at step {step} not written ({reason}); newest checkpoint kept: {kept}"
        if fatal:
            raise UserError(message)
        if self.mesh.rank == 0:
            warn(f"{message}; training continues")


def background_saves_on(cfg, distributed: bool, device_type: str) -> bool:
    """`train.checkpoint_async` resolved (issue 68): auto = on for distributed runs and on CUDA; never on the
    DeepSpeed engine (its save is DeepSpeed's own; the trainer refuses `on` there)."""
    mode = cfg.train.checkpoint_async
    if cfg.parallel.engine == "deepspeed" or mode == "off":
        return False
    return mode == "on" or distributed or device_type == "cuda"


def save_error(exc: BaseException) -> Optional[str]:
    """The one-line reason of a failed save, or None when `exc` is not an I/O failure (then it propagates)."""
    return io_reason(exc)
