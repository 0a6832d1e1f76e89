"""The trainer's saves: when (nagmoe/train/checkpoint_schedule.py), how (either engine's save, a refused or
failed save kept non-fatal where it may be), and the save point after each step, where a preemption is answered
too. A mixin of Trainer: it reads the trainer's config, run dir, engine, model, optimizers, loader and progress."""
from __future__ import annotations

import time
from typing import Optional

from nagmoe.checkpoint import save_checkpoint
from nagmoe.train.checkpoint_schedule import CheckpointSchedule, save_error


class TrainerCheckpoints:
    def checkpoint_schedule(self) -> CheckpointSchedule:
        """When to save and what a failed save does; `self.clock` (a test's fake clock) drives the time-based
        saves."""
        if getattr(self, "_schedule", None) is None:
            self._schedule = CheckpointSchedule(self.cfg.train, self.mesh, self.run_dir, self.progress.tokens,
                                                getattr(self, "clock", time.monotonic))
        return self._schedule

    def checkpoint(self, milestone: bool = False, fatal: bool = True) -> Optional[str]:
        """Save this step (collective). A save refused for lack of disk space, or failing with an I/O error,
        keeps the previous checkpoints and returns None with a one-line warning, unless `fatal` (the last
        step, a preemption): then it raises that line as a UserError (exit 2)."""
        schedule, step = self.checkpoint_schedule(), self.progress.step
        state = {"step": step, "progress": self.progress.as_dict(), "loader": self.loader.state_dict(),
                 **({"milestone": True} if milestone else {}), **self.routing.extra_state()}
        refusal = schedule.disk_refusal()
        if refusal is not None:
            schedule.failed(step, refusal, fatal)
            return None
        started = time.perf_counter()
        keep = self.cfg.train.keep_checkpoints
        try:
            if self.engine is not None:
                path = self.engine.save_checkpoint(self.run_dir, step, state, keep=keep, fence=self.fence)
            else:
                path = save_checkpoint(self.run_dir, step, self.model, self.optim, state, keep=keep,
                                       shard_plan=self.shard_plan, fence=self.fence)
        except BaseException as e:  # DCP raises CheckpointException (a BaseException) for any rank's failure
            reason = save_error(e)
            if reason is None:
                raise
            schedule.failed(step, reason, fatal)
            return None
        schedule.saved(self.progress.tokens)
        self._log(f"checkpoint {path}{' (milestone)' if milestone else ''} in {time.perf_counter() - started:.1f} s")
        return path

    def save_point(self, step: int, last: bool, gate_stop: bool, sync: bool, shared, loop, watchdog,
                   preemption) -> None:
        """After step `step`'s record: save when due (steps, minutes by rank 0's clock at sync steps, milestones,
        the last step, a gate-collapse stop), then answer a preemption seen at this sync step (its checkpoint,
        the marker, Preempted: exit 75). The metrics lines up to a save are written before it (a sync step's
        already are: the exchange confirmed the lease; else a fence first)."""
        save, milestone = self.checkpoint_schedule().due(step, self.progress.tokens, last or gate_stop,
                                                         sync and shared.clock_due)
        preempt = sync and shared.preempt and not last  # the last step ends the run anyway
        path = None
        if save and not sync:
            self.fence()
            loop.flush()
        if save:
            with watchdog.phase("a checkpoint save"):
                path = self.checkpoint(milestone, fatal=last or gate_stop or preempt)
        if preempt:
            with watchdog.phase("the preemption checkpoint"):
                preemption.stop(lambda: path if path is not None else self.checkpoint(), step)
