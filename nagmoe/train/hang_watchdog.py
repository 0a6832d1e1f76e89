"""The progress watchdog: a hang becomes a failure in bounded time (issue 51 item 4).

A collective whose peer is gone (a host lost, a network partition) or a stuck file system blocks the main thread
inside C code, where no exception, no timeout of ours and no Python signal handler reaches it; torch's own
process-group timeout is 30 min (gloo) or 10 min (NCCL) per collective, and a partitioned gloo peer was seen to
hang a rank for 7 min before Slurm noticed. A daemon thread watches the time since the main thread last showed
progress (a completed step, or the start of a long phase) and fires when it exceeds the allowance:

    limit      = train.hang_timeout_s when > 0, else max(HANG_MULTIPLE x median recent step time, HANG_FLOOR_S)
    allowance  = limit after a step; max(limit, long_phase_s) for the first step (compilation, data) and inside
                 a long phase (a checkpoint save, an evaluation): `with watchdog.phase("checkpoint save"):`
    SIGTERM    = Slurm's stop or torchrun's forwarding: the preemption handler waits for a step boundary that a
                 hung step never reaches; with no progress TERM_GRACE_S after the signal the watchdog fires,
                 inside Slurm's default KillWait (30 s). The signal is seen through `signal.set_wakeup_fd` (the
                 C-level handler writes the signal number there even while the main thread is blocked).

Firing writes one line naming the rank, host and last completed step, and (distributed) the ranks that fell
silent or behind with their hosts and steps, read from the rendezvous store (nagmoe.parallel.progress_board: each
rank's heartbeat thread publishes its last finished step there; issue 61), dumps every thread's Python stack to
stderr (the rank's log; `faulthandler`), and ends the process with EXIT_HUNG through `os._exit` (the main
thread cannot be interrupted), so the launcher sees a failed step and can restart from the last checkpoint.
The step path costs a few attribute writes and a median of at most 50 numbers (`step_done`): no lock, no host
sync, nothing collective.

The collectives' own timeout follows the same allowances (nagmoe.parallel.collective_timeouts): long for the
first step and inside a phase, NAGMOE_DIST_TRAIN_TIMEOUT_S (100 s) after a step; a gloo collective past it raises,
and `timed_out` makes that one line naming rank, host and step and the ranks behind, then the stack (exit status 1,
as before).
"""
from __future__ import annotations

import collections
import faulthandler
import os
import re
import select
import signal
import socket
import statistics
import sys
import threading
import time
import traceback
from contextlib import contextmanager
from typing import Callable, Optional

from nagmoe.base.errors import shown
from nagmoe.parallel.collective_timeouts import NoCollectives, collective_timeouts, is_collective_timeout
from nagmoe.base.environment import (DEFAULT_HANG_LONG_PHASE_S as LONG_PHASE_S,
    DEFAULT_HANG_TERM_GRACE_S as TERM_GRACE_S, hang_allowances)
from nagmoe.train.guards import TrainingHalted

EXIT_HUNG = 76  # EX_PROTOCOL (sysexits.h): a peer or the file system stopped answering; a restart may cure it
# a collective past its timeout keeps the status it always had (torch's error: 1; tests/recovery/
# test_distributed_kill.py): the batch script restarts on a new checkpoint, whatever the status
EXIT_COLLECTIVE_TIMEOUT = 1
HANG_MULTIPLE, HANG_FLOOR_S = 20.0, 180.0  # the derived limit: max(20 x median step, 180 s)
RECENT_STEPS = 50


class ProgressWatchdog:
    """See the module docstring. `start()` from the main thread before the loop, `step_done(step, seconds)`
    after each step, `phase(name)` around long phases, `stop()` in a finally."""

    def __init__(self, rank: int, timeout_s: Optional[float] = None, long_phase_s: float = LONG_PHASE_S,
                 term_grace_s: float = TERM_GRACE_S, first_step: int = 0,
                 exit_fn: Callable[[int], None] = os._exit, stream=None, collectives=None, board=None):
        self.rank, self.host = rank, socket.gethostname()
        self.board = board  # nagmoe.parallel.progress_board.ProgressBoard (distributed), or None
        self.collectives = collectives if collectives is not None else NoCollectives()  # the same allowances
        self.fixed_limit = timeout_s if timeout_s and timeout_s > 0 else None
        self.long_phase_s, self.term_grace_s = long_phase_s, term_grace_s
        self.exit_fn, self.stream = exit_fn, stream
        self.last_step = first_step
        self.last_progress = time.monotonic()
        self.phase_name: Optional[str] = "the first step"  # the first step is a long phase
        self.term_at: Optional[float] = None
        self.fired: Optional[str] = None
        self._step_times: collections.deque = collections.deque(maxlen=RECENT_STEPS)
        self._stop = threading.Event()
        self._thread: Optional[threading.Thread] = None
        self._wake_r = self._wake_w = None
        self._previous_wakeup_fd: Optional[int] = None

    # ------------------------------------------------------------------------------------ the main thread
    def start(self) -> "ProgressWatchdog":
        if threading.current_thread() is threading.main_thread():  # set_wakeup_fd works from there only
            self._wake_r, self._wake_w = os.pipe()
            os.set_blocking(self._wake_w, False)
            os.set_blocking(self._wake_r, False)
            self._previous_wakeup_fd = signal.set_wakeup_fd(self._wake_w, warn_on_full_buffer=False)
        self._thread = threading.Thread(target=self._watch, name="nagmoe-progress-watchdog", daemon=True)
        self._thread.start()
        return self

    def step_done(self, step: int, seconds: float) -> None:
        """A step completed (attribute writes and a deque append: GIL-atomic, no lock; the collectives' timeout
        from the median of the recent steps, set only when it changes: no communication)."""
        self._step_times.append(seconds)
        self.last_step, self.phase_name, self.last_progress = step, None, time.monotonic()
        if self.board is not None:
            self.board.step_done(step)  # an attribute write: the board's own thread publishes it
        self.collectives.after_step(self._step_times)

    @contextmanager
    def phase(self, name: str):
        """A phase allowed `long_phase_s` (progress when it starts and when it ends); the collectives get
        their long timeout meanwhile."""
        self.phase_name, self.last_progress = name, time.monotonic()
        try:
            with self.collectives.long_phase():
                yield
        finally:
            self.phase_name, self.last_progress = None, time.monotonic()

    def timed_out(self, exc: BaseException) -> Optional[TrainingHalted]:
        """A collective past its timeout (gloo raises): the one line, the stack where it waited, and exit
        status 1, as a `TrainingHalted` to raise; None for any other error."""
        return collective_timeout_halt(exc, self.rank, self.host, self.last_step, self.stream, self.board)

    def stop(self) -> None:
        if self.board is not None:
            self.board.stop()
        self.collectives.restore()
        self._stop.set()
        if self._wake_w is not None:  # wake the thread out of its select() now, not at its next timeout (up to 5 s)
            try:
                os.write(self._wake_w, b"\0")  # not a signal number the thread acts on
            except OSError:  # the pipe is full of signal bytes: the thread is about to read them anyway
                pass
        if self._thread is not None:
            self._thread.join(timeout=5)
        if self._wake_w is not None:
            signal.set_wakeup_fd(self._previous_wakeup_fd if self._previous_wakeup_fd is not None else -1)
            for fd in (self._wake_r, self._wake_w):
                os.close(fd)
            self._wake_r = self._wake_w = None

    # ------------------------------------------------------------------------------------ the watch thread
    def limit(self) -> float:
        """Seconds without progress that count as a hang now (module docstring)."""
        if self.fixed_limit is not None:
            base = self.fixed_limit
        else:
            times = list(self._step_times)
            base = max(HANG_MULTIPLE * statistics.median(times), HANG_FLOOR_S) if times else HANG_FLOOR_S
        return max(base, self.long_phase_s) if self.phase_name is not None else base

    def check(self, now: float) -> Optional[str]:
        """Why the process is hung at monotonic time `now`, or None."""
        waited = now - self.last_progress
        if self.term_at is not None and self.last_progress < self.term_at and now - self.term_at > self.term_grace_s:
            return f"SIGTERM {now - self.term_at:.0f} s ago and no step boundary since (a step blocked)"
        limit = self.limit()
        if waited > limit:
            where = f" in {self.phase_name}" if self.phase_name else ""
            return f"no progress for {waited:.0f} s{where} (limit {limit:.0f} s)"
        return None

    def _interval(self) -> float:
        return max(0.05, min(5.0, self.limit() / 20, self.term_grace_s / 4))

    def _watch(self) -> None:
        while not self._stop.is_set():
            self._wait_for_signal(self._interval())
            if self._stop.is_set():
                return
            reason = self.check(time.monotonic())
            if reason is not None:
                self._fire(reason)
                return

    def _wait_for_signal(self, timeout: float) -> None:
        if self._wake_r is None:
            self._stop.wait(timeout)
            return
        try:
            ready, _, _ = select.select([self._wake_r], [], [], timeout)
            if ready:
                data = os.read(self._wake_r, 64)
                if signal.SIGTERM in data and self.term_at is None:
                    self.term_at = time.monotonic()
        except (OSError, ValueError):  # closed by stop() meanwhile
            self._stop.wait(timeout)

    def _fire(self, reason: str) -> None:
        self.fired = reason
        stream = self.stream or sys.stderr
        behind = _culprits(self.board, self.last_step)
        try:
            print(f"[nagmoe] rank {self.rank} on {self.host}: hung after step {self.last_step}: {reason}{behind}; "
                  f"every thread's stack follows; exiting with code {EXIT_HUNG} so the job can restart from the last "
                  "checkpoint", file=stream, flush=True)
            faulthandler.dump_traceback(file=stream, all_threads=True)
            stream.flush()
        except (OSError, ValueError):  # a closed stream must not keep a hung process alive
            pass
        self.exit_fn(EXIT_HUNG)


def _culprits(board, step: int) -> str:
    """"; <who is silent or behind>" from the progress board (bounded in time), or "" without one."""
    if board is None:
        return ""
    try:
        return "; " + board.culprits(step)
    except Exception as e:  # noqa: BLE001 - the line must be written whatever the board does
        return f"; the progress board could not be read ({type(e).__name__})"


def collective_timeout_halt(exc: BaseException, rank: int, host: str, step: int,
                            stream=None, board=None) -> Optional[TrainingHalted]:
    """See `ProgressWatchdog.timed_out`."""
    if not is_collective_timeout(exc):
        return None
    stream = stream or sys.stderr
    first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
    first = re.sub(r"^\[[^\]]*\]\s*", "", first)  # gloo's "[path/to/source.cc:129] " prefix
    message = (f"rank {rank} on {host}: a collective timed out after step {step} ({shown(first, 160)}): a peer "
               f"is gone, partitioned or stuck{_culprits(board, step)}; exiting with status {EXIT_COLLECTIVE_TIMEOUT} "
               "so the job can restart from the last checkpoint")
    try:
        print(f"[nagmoe] {message}; the stack where it waited follows", file=stream, flush=True)
        frames = traceback.extract_tb(exc.__traceback__)[-12:]  # the innermost: where the collective was called
        stream.write("".join(traceback.format_list(frames)))
        stream.flush()
    except (OSError, ValueError):
        pass
    return TrainingHalted(message, EXIT_COLLECTIVE_TIMEOUT)


def start_watchdog(rank: int, timeout_s: Optional[float], step: int, environ=None, board=None):
    """The trainer's watchdog for `train.hang_timeout_s` (0: off, not started), its allowances from NAGMOE_HANG_LONG_PHASE_S
    and NAGMOE_HANG_TERM_GRACE_S (nagmoe.base.environment), started, with the collectives' timeouts
    (nagmoe.parallel.collective_timeouts) following the same first step and long phases. `board`: the run's
    progress board (started; the watchdog's stop stops it), named in the failure lines."""
    long_phase_s, term_grace_s = hang_allowances(environ)
    watchdog = ProgressWatchdog(rank, timeout_s, long_phase_s, term_grace_s, first_step=step,
                                collectives=collective_timeouts(environ), board=board)
    # off (0): the same object never started — nothing watched, the collectives' timeouts still follow the steps
    return watchdog if timeout_s is not None and timeout_s == 0 else watchdog.start()
