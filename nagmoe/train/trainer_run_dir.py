"""What the trainer does to its run dir, in the one order a start keeps (issue 54; the names: nagmoe/rundir/names.py):

1. rank 0 takes the lease (nagmoe/rundir/lease.py) before anything in the run dir is read or written;
2. before anything is written: the newest valid checkpoint verified (or the refusal to start over silently), the
   schemas of the history files a start rewrites or truncates (run_info.json, metrics.jsonl), the legacy values of
   the keys the saved config predates adopted (every rank), the resume layout checked (another world size,
   parallel.ep or micro-batch: resharded by the torch engine, refused on DeepSpeed);
3. then rank 0 writes: config.yaml and the W&B id at once, metrics.jsonl truncated back to the checkpoint after the
   load, run_info.json once the build is done;
4. every rank fences before each checkpoint publish, metrics write and summary.json (`fence`, or the lease
   confirmation of a sync step's exchange, nagmoe/train/step_decisions.py); `release` gives the run dir back,
   however the run ends.
A UserError on rank 0 is raised on every rank (ParallelMesh.on_rank0), so no rank waits in a later collective."""
from __future__ import annotations

import os
import time
from typing import Callable, Optional

from nagmoe.checkpoint import check_resume_layout, resume_checkpoint
from nagmoe.rundir.info import adopt_legacy_values, prepare_run_dir, read_run_info, write_run_info
from nagmoe.rundir.lease import RunDirLease, fence_on_all_ranks
from nagmoe.rundir.metrics import check_metrics_steps, truncate_metrics
from nagmoe.rundir.names import METRICS_FILE
from nagmoe.rundir.wandb_id import ensure_wandb_id


def check_history_files(run_dir: str) -> None:
    """The schemas of the history files a start rewrites (run_info.json) or truncates (metrics.jsonl), checked
    before it writes anything: a bad one is a UserError naming the file and field, and the run dir stays as it
    was."""
    read_run_info(run_dir, own_only=True)
    check_metrics_steps(os.path.join(run_dir, METRICS_FILE))


class TrainerRunDir:
    """The trainer's run dir on every rank of `mesh` (nagmoe.parallel.mesh.ParallelMesh); rank 0 reads, writes and
    holds the lease. `log`: the trainer's progress messages."""

    def __init__(self, path: str, mesh, log: Callable[[str], None]):
        self.path, self.mesh, self._log = path, mesh, log
        self.lease: Optional[RunDirLease] = None

    def take_lease(self, take_over: bool) -> None:
        """Step 1: one trainer per run dir, before anything in it is read or written."""
        def take():
            self.lease = RunDirLease(self.path, take_over).acquire()

        self.mesh.on_rank0(take)

    def open(self, cfg, start_over: bool, accept_config_change: bool) -> Optional[str]:
        """Step 2, then config.yaml and the W&B id: the checkpoint to resume from (None: a fresh start). `cfg` gets
        the legacy values of the keys its run dir's config predates."""
        mesh, run_dir = self.mesh, self.path
        started = time.perf_counter()
        latest = mesh.on_rank0(lambda: resume_checkpoint(run_dir, start_over))  # refuses if none is valid
        mesh.on_rank0(lambda: check_history_files(run_dir))  # a bad one: exit 2 before anything is written
        if latest is not None:
            self._log(f"verified {latest} in {time.perf_counter() - started:.1f} s")
            # every rank: the keys the run dir's config predates keep their legacy values
            for key, value in adopt_legacy_values(run_dir, cfg).items():
                self._log(f"{key}={value!r}: the run dir's config predates this key (its legacy value)")
            # another layout (world size, parallel.ep, train.micro_batch_tokens) resumes on the torch engine,
            # which reshards on load; DeepSpeed refuses it here, before the run dir is written
            change = mesh.on_rank0(lambda: check_resume_layout(latest, run_dir, cfg, mesh.world_size))
            if change is not None:
                self._log(f"resuming {latest} on another layout: {change}")
        mesh.on_rank0(lambda: prepare_run_dir(run_dir, cfg, resuming=latest is not None,
                                              accept_config_change=accept_config_change))
        mesh.on_rank0(lambda: ensure_wandb_id(run_dir, resuming=latest is not None))
        return latest

    def truncate_metrics(self, step: int) -> None:
        """After the load (also from step 0: a run killed before its first checkpoint logged steps already)."""
        if self.mesh.rank == 0:
            truncate_metrics(os.path.join(self.path, METRICS_FILE), step)

    def write_run_info(self, backends: dict, device: str, info: dict) -> None:
        if self.mesh.rank == 0:
            write_run_info(self.path, backends, device, info)

    def fence(self) -> None:
        """Collective, before each checkpoint publish, metrics write and summary.json: rank 0 confirms the lease is
        still ours; if another trainer took it over, every rank raises the same UserError (exit 2) and nothing
        more is written (nagmoe.rundir.lease)."""
        fence_on_all_ranks(self.mesh, self.lease)

    def confirm_lease(self) -> None:
        """Rank 0's part of a sync step (nagmoe/train/step_decisions.py): raise the UserError of `fence` if the
        lease is no longer ours; its verdict travels with the step's exchange instead of a broadcast."""
        if self.lease is not None:
            self.lease.confirm()

    def release(self) -> None:
        """Give the run dir back (rank 0 holds the lease); idempotent."""
        if self.lease is not None:
            self.lease.release()
            self.lease = None
