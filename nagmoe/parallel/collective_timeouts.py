"""The collectives' timeout: long for the rendezvous, the first step and long phases, short while training
(issue 51 item 4; torchtitan's `comm.init_timeout_seconds` / `train_timeout_seconds`).

    init timeout   = the default group's (NAGMOE_DIST_TIMEOUT_S, 1800 s): rendezvous, the first step (compilation,
                     the first batches), checkpoint saves, evaluations, and everything after the training loop
                     (consolidation, export)
    train timeout  = min(init, max(NAGMOE_DIST_TRAIN_TIMEOUT_S (100 s), STEP_MULTIPLE x median step time))

A collective waits for its slowest peer; in a healthy step that wait is a fraction of a step, so a timeout of
many steps only ends a peer that is gone or partitioned. On NCCL the timeout makes torch's own watchdog abort
the communicators and dump the flight recorder (launch/train.sbatch turns it on) before nagmoe's progress
watchdog (180 s floor) fires; on gloo the blocked call raises, and the trainer turns that into one line
(nagmoe.train.hang_watchdog.collective_timeout_halt).
The timeouts are set through torch's `_set_pg_timeout` on every process group this rank belongs to (the default
group, the EP/DP groups, DeepSpeed's), from the main thread, only when the value changes."""
from __future__ import annotations

import datetime
import math
import statistics
import warnings
from contextlib import contextmanager
from typing import Callable, Optional

import torch.distributed as dist

from nagmoe.base.environment import dist_train_timeout_setting

STEP_MULTIPLE = 10.0  # the train timeout is at least this many median steps (slow CPU steps, imbalanced ranks)
# gloo's message for a collective past its timeout (gloo/transport/tcp/unbound_buffer.cc), torch 2.x
GLOO_TIMEOUT_TEXT = "Timed out waiting"


def set_every_group_timeout(seconds: float) -> bool:
    """Set the timeout of every process group of this rank; False where torch offers no way (a warning)."""
    from torch.distributed import distributed_c10d as c10d

    timeout = datetime.timedelta(seconds=seconds)
    try:
        groups = list(c10d._world.pg_map)
        for group in groups:
            try:
                c10d._set_pg_timeout(timeout, group)
            except ValueError:  # a group without this rank
                pass
    except AttributeError:  # torch moved its private helpers: keep the one timeout, say so once
        warnings.warn("this torch has no _set_pg_timeout: collectives keep NAGMOE_DIST_TIMEOUT_S throughout",
                      RuntimeWarning, stacklevel=2)
        return False
    return True


class CollectiveTimeouts:
    """The module docstring's two timeouts for one process. `after_step(times)` once per step (main thread),
    `long_phase()` around saves and evaluations, `restore()` when the loop ends."""

    def __init__(self, init_s: float, train_s: float, set_fn: Callable[[float], bool] = set_every_group_timeout):
        self.init_s, self.floor_s = init_s, min(train_s, init_s)
        self.set_fn = set_fn
        self.current_s = init_s  # what the groups have now
        self.training_s: Optional[float] = None  # None until the first step is done
        self.in_phase = False
        self.working = True

    def _apply(self, seconds: float) -> None:
        if self.working and seconds != self.current_s:
            self.working = self.set_fn(seconds)
            self.current_s = seconds

    def after_step(self, step_times) -> None:
        times = list(step_times)
        derived = STEP_MULTIPLE * statistics.median(times) if times else 0.0
        # the median of the recent steps: a first step that compiled counts for two steps, not for the run
        self.training_s = float(min(self.init_s, max(self.floor_s, math.ceil(derived))))
        if not self.in_phase:
            self._apply(self.training_s)

    @contextmanager
    def long_phase(self):
        self.in_phase = True
        self._apply(self.init_s)
        try:
            yield
        finally:
            self.in_phase = False
            if self.training_s is not None:
                self._apply(self.training_s)

    def restore(self) -> None:
        self._apply(self.init_s)


class NoCollectives:
    """One process (or no process group): nothing to time out."""

    def after_step(self, step_times) -> None:
        pass

    @contextmanager
    def long_phase(self):
        yield

    def restore(self) -> None:
        pass


def collective_timeouts(environ=None):
    """The timeouts of this process: `CollectiveTimeouts` under an initialised process group of more than one
    rank, else an object with the same calls that does nothing."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_world_size() < 2:
        return NoCollectives()
    from nagmoe.parallel.env import group_timeout

    return CollectiveTimeouts(group_timeout().total_seconds(), dist_train_timeout_setting(environ))


def is_collective_timeout(exc: BaseException) -> bool:
    """Whether `exc` is a collective that ran past its timeout (gloo raises a RuntimeError with this text; NCCL
    tears the process down itself)."""
    return isinstance(exc, RuntimeError) and GLOO_TIMEOUT_TEXT in str(exc)[:2000]
