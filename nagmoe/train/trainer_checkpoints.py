"""The trainer's saves: when (nagmoe/train/checkpoint_schedule.py), how (either engine's save, a refused or
failed save kept non-fatal where it may be), and the save point after each step, where a preemption is answered
too. A mixin of Trainer: it reads the trainer's config, run dir, engine, model, optimizers, loader and progress."""
from __future__ import annotations

import os
import time
from typing import Optional

from nagmoe.checkpoint import save_checkpoint, save_milestone
from nagmoe.checkpoint.async_save import BackgroundSave
from nagmoe.checkpoint.milestone import saved_bytes
from nagmoe.checkpoint.publish import save_paths
from nagmoe.train.checkpoint_schedule import CheckpointSchedule, background_saves_on, dir_bytes, save_error


class TrainerCheckpoints:
    def checkpoint_schedule(self) -> CheckpointSchedule:
        """When to save and what a failed save does; `self.clock` (a test's fake clock) drives the time-based
        saves."""
        if getattr(self, "_schedule", None) is None:
            self._schedule = CheckpointSchedule(self.cfg.train, self.mesh, self.run_dir, self.progress.tokens,
                                                getattr(self, "clock", time.monotonic))
        return self._schedule

    def background_saves(self) -> Optional[BackgroundSave]:
        """The run's background saves when `train.checkpoint_async` resolves on (checkpoint_schedule.
        background_saves_on), else None. Collective when on (the side gloo group is created)."""
        if not background_saves_on(self.cfg, self.mesh.distributed, self.device.type):
            return None
        return BackgroundSave(self.rank, pin=self.device.type == "cuda", log=self._log)

    def checkpoint(self, milestone: bool = False, fatal: bool = True) -> Optional[str]:
        """Save this step (collective). A save refused for lack of disk space, or failing with an I/O error,
        keeps the previous checkpoints and returns None with a one-line warning, unless `fatal` (the last
        step, a preemption, a gate-collapse stop): then it raises that line as a UserError (exit 2). With
        background saves (`self.background_save`) a save that is not fatal returns once its state is staged;
        a fatal one is written synchronously, the run ending after it. Either way a save still in flight is
        settled first: at most one at a time."""
        schedule, step = self.checkpoint_schedule(), self.progress.step
        self.settle_saves()
        state = self._extra_state(milestone)
        refusal = schedule.disk_refusal()
        if refusal is not None:
            schedule.failed(step, refusal, fatal)
            return None
        started = time.perf_counter()
        keep = self.cfg.train.keep_checkpoints
        background = self.background_save if not fatal else None
        try:
            if self.engine is not None:
                path = self.engine.save_checkpoint(self.run_dir, step, state, keep=keep, fence=self.fence)
            else:
                if background is not None:  # the lease confirmed now; rank 0 checks it again before the publish
                    self.fence()
                fence, lease_check = (self.fence, None) if background is None else (None, self.rundir.confirm_lease)
                path = save_checkpoint(self.run_dir, step, self.model, self.optim, state, keep=keep,
                                       shard_plan=self.shard_plan, fence=fence, background=background,
                                       lease_check=lease_check)
        except BaseException as e:  # DCP raises CheckpointException (a BaseException) for any rank's failure
            reason = save_error(e)
            if reason is None:
                raise
            schedule.failed(step, reason, fatal)
            return None
        schedule.saved(self.progress.tokens)
        what = " (milestone)" if milestone else ""
        if background is not None and background.pending:
            self._log(f"checkpoint {path}{what}: staged in {time.perf_counter() - started:.1f} s, writing in the "
                      "background")
        else:
            self._log(f"checkpoint {path}{what} in {time.perf_counter() - started:.1f} s")
            self._log_checkpoint_size(path)
        return path

    def _extra_state(self, milestone: bool) -> dict:
        """What a checkpoint or milestone saves besides tensors: the step, progress, the loader's position, the
        router's state (and the milestone mark)."""
        return {"step": self.progress.step, "progress": self.progress.as_dict(), "loader": self.loader.state_dict(),
                **({"milestone": True} if milestone else {}), **self.routing.extra_state()}

    def settle_saves(self) -> None:
        """Collective: end the background save in flight, if any (async_save.BackgroundSave.settle). Its I/O
        failure keeps the previous checkpoints with a warning and training goes on; anything else (the lease
        taken, the directory moved) stops every rank with the same line."""
        background = getattr(self, "background_save", None)
        if background is None or not background.pending:
            return
        try:
            step = background.settle()
        except BaseException as e:
            reason = save_error(e)
            if reason is None:
                raise
            self.checkpoint_schedule().failed(background.step, reason, fatal=False)
            return
        path = save_paths(self.run_dir, step)[1]
        times = ", ".join(f"{k[:-2]} {v:.1f} s" for k, v in background.timing.items())
        self._log(f"checkpoint {path} published from the background ({times})")
        self._log_checkpoint_size(path)

    def _log_checkpoint_size(self, path: str) -> None:
        """The size of the run's first full checkpoint, once (the README's figures are of r40)."""
        if not getattr(self, "_checkpoint_size_logged", False) and self.rank == 0 and os.path.isdir(path):
            self._checkpoint_size_logged = True
            self._log(f"checkpoint size: {dir_bytes(path) / 2**20:.1f} MiB (model and optimizer state)")

    def save_point(self, step: int, last: bool, gate_stop: bool, sync: bool, shared, loop, watchdog,
                   preemption) -> None:
        """After step `step`'s record: save when due (steps, minutes by rank 0's clock at sync steps, milestones,
        the last step, a gate-collapse stop), then answer a preemption seen at this sync step (its checkpoint,
        the marker, Preempted: exit 75). The metrics lines up to a save are written before it (a sync step's
        already are: the exchange confirmed the lease; else a fence first). A weights-only milestone is its own
        save (`save_milestone`), before the full checkpoint when that is due too."""
        schedule = self.checkpoint_schedule()
        save, milestone = schedule.due(step, self.progress.tokens, last or gate_stop, sync and shared.clock_due)
        weights = milestone and schedule.weights_milestones  # its own save, not a checkpoint (milestone.py)
        preempt = sync and shared.preempt and not last  # the last step ends the run anyway
        path = None
        if (save or weights) and not sync:
            self.fence()
            loop.flush()
        if weights:
            with watchdog.phase("a milestone save"):
                self.save_milestone()
        if save:
            with watchdog.phase("a checkpoint save"):
                path = self.checkpoint(milestone and not weights, fatal=last or gate_stop or preempt)
            if milestone and not weights and path is not None:
                self._log_milestone_size(path, "full: model and optimizer state")
        if preempt:
            with watchdog.phase("the preemption checkpoint"):
                preemption.stop(lambda: path if path is not None else self.checkpoint(), step)

    def save_milestone(self) -> Optional[str]:
        """This step's weights-only milestone (`train.milestone_dtype` bf16 | fp32; collective, synchronous: a
        fraction of a full save's bytes). It is no resume point, so an I/O failure is never fatal: a warning,
        and the milestone is tried again at the next step. The extra state is the one `checkpoint` saves."""
        schedule, step = self.checkpoint_schedule(), self.progress.step
        dtype = self.cfg.train.milestone_dtype
        state = self._extra_state(milestone=True)
        started = time.perf_counter()
        try:
            path = save_milestone(self.run_dir, step, self.model, state, dtype, shard_plan=self.shard_plan,
                                  fence=self.fence)
        except BaseException as e:  # DCP raises CheckpointException (a BaseException) for any rank's failure
            reason = save_error(e)
            if reason is None:
                raise
            schedule.milestone_failed(step, reason)
            return None
        schedule.milestone_saved(self.progress.tokens)
        self._log(f"milestone {path} ({dtype} weights) in {time.perf_counter() - started:.1f} s")
        self._log_milestone_size(path, f"weights, {dtype}")
        return path

    def _log_milestone_size(self, path: str, kind: str) -> None:
        """The bytes of the first published milestone of each kind, once (README: their size at r40)."""
        logged = getattr(self, "_milestone_sizes_logged", None)
        if logged is None:
            logged = self._milestone_sizes_logged = set()
        size = saved_bytes(path) if kind not in logged and self.rank == 0 else None
        if size is not None:  # None: not published yet (a background save), told at a later milestone
            logged.add(kind)
            self._log(f"milestone {path}: {size / 2**20:.1f} MiB, {size} bytes ({kind})")
