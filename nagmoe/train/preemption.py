"""Preemption: stop at a step boundary with a checkpoint, so that a restarted run loses and repeats nothing.

Two ways to ask a running trainer to stop:
  * a signal to the training process: SIGUSR1 or SIGTERM (a terminal, `kill`, Slurm's `--signal=USR1@T`
    to the job steps, torchrun forwarding the TERM it got);
  * a request file `RUN_DIR/preempt.request`, written by the Slurm batch script's trap when Slurm signals
    the batch shell (`#SBATCH --signal=B:USR1@120`). torchrun handles only TERM/INT/HUP/QUIT (a USR1 would
    kill it), so a file on the shared file system is the robust way to reach every rank on every node.

Every `train.sync_every` steps (nagmoe/train/step_decisions.py) every rank contributes its local view
(`local_request`: its signal; rank 0 also stats the request file) to the loop's one collective, so all ranks
stop at the same step, within sync_every steps of the request, even when only one of them saw it. `stop()` then saves a checkpoint (collective), rank 0 writes the marker
`RUN_DIR/preempted.json` (step, checkpoint, reason) and consumes the request file, and every rank raises
`Preempted`: a `SystemExit` with code 75 (EX_TEMPFAIL, "try again"), or 0 under torchrun, which would report
any other worker code as a crash. After a USR1 the batch script requeues the job unless the run finished
(summary.json), whether or not it sees the marker; a trainer started again resumes from that checkpoint and
drops the marker.
"""
from __future__ import annotations

import json
import os
import signal
import threading
import time
from typing import Callable, NoReturn, Optional

from nagmoe.base.errors import shown
from nagmoe.base.environment import hook_setting, launched_by_torchrun, slurm_restart_count
from nagmoe.base.files import atomic_writer, expect, expect_object, read_json, write_atomic
from nagmoe.rundir.names import MARKER_FILE, REQUEST_FILE

EXIT_PREEMPTED = 75  # EX_TEMPFAIL (sysexits.h): stopped on purpose with a checkpoint; run again to continue
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


def preempted_exit_code() -> int:
    """EXIT_PREEMPTED, except under torchrun (TORCHELASTIC_RUN_ID set): torchrun reports any non-zero worker
    code as a failure with a traceback and exits 1 itself, so there the workers exit 0 and the marker is
    the only signal (the batch script reads it either way)."""
    return 0 if launched_by_torchrun() else EXIT_PREEMPTED


class Preempted(SystemExit):
    """Raised by `PreemptionWatch.stop` after the checkpoint; ends the process with `preempted_exit_code()`
    unless caught."""

    def __init__(self, step: int, checkpoint: str):
        super().__init__(preempted_exit_code())
        self.step, self.checkpoint = step, checkpoint

    def __str__(self) -> str:
        return f"preempted at step {self.step} (checkpoint {self.checkpoint})"


def _remove_quietly(path: str) -> None:
    try:
        os.remove(path)
    except FileNotFoundError:
        pass


def read_marker(run_dir: str) -> Optional[dict]:
    """The marker of a preempted run (None when the run was not preempted or has resumed since), checked for
    the fields its readers rely on: `step` an integer, `checkpoint` and `reason` strings, `slurm_restart_count`
    an integer or null. Anything else is a UserError naming the file and field."""
    path = os.path.join(run_dir, MARKER_FILE)
    if not os.path.lexists(path):
        return None
    where = shown(path)
    marker = expect_object(read_json(path), where)
    expect(marker, "step", int, where)
    expect(marker, "checkpoint", str, where)
    expect(marker, "reason", str, where)
    expect(marker, "slurm_restart_count", (int, type(None)), where, required=False)
    return marker


def request_stop(run_dir: str, reason: str = "request") -> str:
    """Ask a trainer running in `run_dir` to checkpoint and stop at its next step boundary (what the batch
    script's trap does with `mktemp` + `mv`). Returns the request file's path."""
    path = os.path.join(run_dir, REQUEST_FILE)
    write_atomic(path, f"{reason} {time.time():.0f}\n")  # a fresh temporary: never through a planted link
    return path


MARKER_DELAY_ENV = "NAGMOE_TEST_MARKER_DELAY_S"


def _marker_delayed_for_a_test() -> bool:
    """Test hook (tests/slurm): with NAGMOE_TEST_MARKER_DELAY_S set, the marker is not written before this
    process exits, as when it is written on another node and the batch script's NFS client does not see it
    yet, or when the save outlasts the signal window. The batch script must requeue regardless. Acts only
    under NAGMOE_TEST_HOOKS=1 (nagmoe.base.environment.hook_setting)."""
    return bool(hook_setting(MARKER_DELAY_ENV))


class PreemptionWatch:
    """Watches for a stop request during `Trainer.run`: `install()` before the loop, `local_request()` at each
    sync step (step_decisions.py carries it to every rank), `stop(checkpoint_fn, step)` when it says so, `uninstall()` in a finally."""

    def __init__(self, run_dir: str, rank: int = 0):
        self.run_dir, self.rank = run_dir, rank
        self.request_path = os.path.join(run_dir, REQUEST_FILE)
        self.marker_path = os.path.join(run_dir, MARKER_FILE)
        self.signal_name: Optional[str] = None  # set by the handler (async-signal work: one assignment)
        self._previous: dict = {}

    def install(self) -> "PreemptionWatch":
        """Catch SIGUSR1/SIGTERM (main thread only: Python delivers signals there) and drop the marker of an
        earlier preemption: this run resumes now."""
        if threading.current_thread() is threading.main_thread():
            for sig in SIGNALS:
                self._previous[sig] = signal.signal(sig, self._on_signal)
        if self.rank == 0:
            _remove_quietly(self.marker_path)
        return self

    def uninstall(self) -> None:
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)
        self._previous.clear()

    def _on_signal(self, signum, frame) -> None:
        self.signal_name = signal.Signals(signum).name

    def local_reason(self) -> Optional[str]:
        """Why this rank wants to stop (a signal name or the request file), or None."""
        if self.signal_name is not None:
            return self.signal_name
        if os.path.exists(self.request_path):
            return REQUEST_FILE
        return None

    def local_request(self) -> bool:
        """This rank's part of a sync step's decision (nagmoe/train/step_decisions.py): a signal it caught, or, on
        rank 0 only, the request file (one stat for the job: the run dir is shared by every rank)."""
        return self.signal_name is not None or (self.rank == 0 and os.path.exists(self.request_path))

    def stop(self, checkpoint_fn: Callable[[], str], step: int) -> NoReturn:
        """Checkpoint (collective), write the marker, consume the request, then raise `Preempted` on every
        rank. The barrier keeps all ranks alive until the marker exists: under torchrun the first rank to
        exit makes the agent stop the others."""
        path = checkpoint_fn()
        if self.rank == 0 and not _marker_delayed_for_a_test():
            marker = {"step": step, "checkpoint": path, "reason": self.local_reason() or "another rank",
                      "time": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
                      "slurm_job_id": os.environ.get("SLURM_JOB_ID"),
                      "slurm_restart_count": slurm_restart_count()}  # checked at start
            with atomic_writer(self.marker_path, durable=True) as f:  # read by the batch script, maybe elsewhere
                json.dump(marker, f, indent=1)
            _remove_quietly(self.request_path)
        import torch.distributed as dist

        if dist.is_available() and dist.is_initialized():
            dist.barrier()
        raise Preempted(step, path)
