"""A torch-engine save in the background (issue 68): the step is blocked only while the state is copied off the
device; the files are written, hashed and published while training goes on.

At a save point every rank (torch_layout.save_checkpoint, handed a `BackgroundSave`):
  1. (main thread) the shared prologue: the step not already saved, rank 0's fresh `step_N.tmp-<tag>`, every
     rank's RNG state; then **staging**: the model and optimizer tensors copied to CPU memory (pinned on CUDA),
     buffers reused from save to save (DCP's DefaultStager);
  2. (a daemon thread) **the background write**: DCP's save of the staged copy on a side gloo group (never the
     training group: two threads must not share one group's collectives), **digests**: each rank hashes and
     fsyncs the files it wrote (files.own_digests), gathered to rank 0 with any rank's failure; **publish**:
     rank 0 confirms the run dir's lease (the fence's check), writes state.json and the manifest, renames
     `step_N.tmp-<tag>` to `step_N` and prunes (publish.publish). Nothing is published unless every rank wrote
     and hashed its files.
At most one save is in flight. `settle` (collective, main thread, every rank at the same point: the next save
point, a sync step where every rank is done or one failed, the end of the run) waits for this rank's thread and
shares every rank's verdict (save_verdict.py), so every rank raises the same line or none does. A kill anywhere
in the window leaves the previous checkpoint published and valid, and either no `step_N` or a complete one: the
only rename is the last act, after the manifest (tests/recovery/test_kill_async_save.py).

DCP's own `async_save` runs the same save in a non-daemon executor that the interpreter joins at exit; a thread of
our own is a daemon, so a rank that halts while a peer is dead does not hang at exit in the side group's gather.
"""
from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint import FileSystemWriter

from nagmoe.checkpoint.files import hash_threads, own_digests
from nagmoe.checkpoint.save_verdict import Verdict, raise_verdict, run_for_verdict

SAVE_FILES_PER_RANK = 4  # DCP writer threads per rank (torch_layout's value: the manifest's hashing in parallel)


def dcp_writer(path: str) -> FileSystemWriter:
    return FileSystemWriter(path, thread_count=min(SAVE_FILES_PER_RANK, hash_threads()))


def gather_digests(tmp: str, rank: int, group=None, failed: Verdict = None) -> Optional[list]:
    """Every rank hashes its own files of `tmp` (a rank whose write `failed` sends that verdict instead, as does
    a rank whose hashing fails: no rank skips the gather); rank 0 gets [(digests, verdict)] per rank, the others
    None."""
    mine = (None, failed) if failed is not None else run_for_verdict(lambda: own_digests(tmp, rank), rank)
    if not (dist.is_available() and dist.is_initialized()):
        return [mine]
    out = [None] * dist.get_world_size(group) if rank == 0 else None
    dist.gather_object(mine, out, dst=0, group=group)
    return out


def merge_gathered(gathered: list) -> dict:
    """Rank 0: the digests of every rank's files, or the first failure (by rank) raised."""
    merged: dict = {}
    for digests, verdict in gathered:
        raise_verdict(verdict)
        merged.update(digests)
    return merged


class BackgroundSave:
    """One rank's side of the torch engine's background saves (module docstring); `close()` at the end."""

    def __init__(self, rank: int, pin: bool, log: Callable[[str], None] = lambda _msg: None):
        from torch.distributed.checkpoint.staging import DefaultStager, StagingOptions

        self.rank, self.log = rank, log
        self.distributed = dist.is_available() and dist.is_initialized()
        # a side group for the background's collectives (DCP's plan, the digests): collective to create, here
        self.group = dist.new_group(backend="gloo") if self.distributed else None
        self.stager = DefaultStager(StagingOptions(use_pinned_memory=pin, use_shared_memory=False,
                                                   use_async_staging=False, use_non_blocking_copy=pin))
        self.thread: Optional[threading.Thread] = None
        self.step: Optional[int] = None
        self.verdict: Verdict = None
        self.timing: dict = {}

    @property
    def pending(self) -> bool:
        """A save was started and not yet settled: the same on every rank (they start and settle together)."""
        return self.thread is not None

    def done_locally(self) -> bool:
        return self.thread is not None and not self.thread.is_alive()

    def failed_locally(self) -> bool:
        return self.done_locally() and self.verdict is not None

    def start(self, tensors: dict, step: int, tmp: str, publish_fn: Callable[[dict], None]) -> None:
        """Stage `tensors` (the step waits for the copy), then write, hash and (rank 0: `publish_fn(digests)`)
        publish in the background. The caller settled the previous save."""
        assert self.thread is None, "a save is still in flight: settle it first"
        started = time.perf_counter()
        staged = self.stager.stage(tensors)
        self.step, self.verdict = step, None
        self.timing = {"staged_s": time.perf_counter() - started}
        self.thread = threading.Thread(target=self._work, args=(staged, tmp, publish_fn), daemon=True,
                                       name=f"nagmoe-checkpoint-{step}")
        self.thread.start()

    def _work(self, staged: dict, tmp: str, publish_fn: Callable[[dict], None]) -> None:
        started = time.perf_counter()
        _, verdict = run_for_verdict(lambda: self._write(staged, tmp), self.rank)
        written = time.perf_counter()
        gathered = gather_digests(tmp, self.rank, self.group, failed=verdict)
        hashed = time.perf_counter()
        if self.rank == 0:  # any rank's failure, or the publish's (the lease, the rename, the disk)
            _, verdict = run_for_verdict(lambda: publish_fn(merge_gathered(gathered)), self.rank)
        self.timing.update(write_s=written - started, hash_s=hashed - written,
                           publish_s=time.perf_counter() - hashed)
        self.verdict = verdict

    def _write(self, staged: dict, tmp: str) -> None:
        # (in one process DCP warns that it assumes one process; the synchronous path silences that warning, but
        # warnings.catch_warnings is not thread-safe: from this thread it could drop the main thread's warnings)
        dcp.save(staged, storage_writer=dcp_writer(tmp), process_group=self.group, no_dist=not self.distributed)

    def settle(self) -> Optional[int]:
        """Collective: wait for this rank's save, share every rank's verdict, raise it on every rank (save_verdict:
        SaveIOFailure for an I/O failure, UserError for the rest). Returns the settled save's step, or None when
        none was in flight."""
        if self.thread is None:
            return None
        waited = time.perf_counter()
        if self.thread.is_alive():
            self.thread.join()
            self.log(f"waited {time.perf_counter() - waited:.1f} s for the background save of step {self.step}")
        self.thread, step, verdict = None, self.step, self.verdict
        if self.distributed:
            verdicts: list = [None] * dist.get_world_size()
            dist.all_gather_object(verdicts, verdict)
            verdict = next((v for v in verdicts if v is not None), None)
        raise_verdict(verdict)
        return step

    def close(self) -> None:
        """Release the staging buffers (pinned memory on CUDA). A thread still running is left to the process's
        exit (a daemon): its save is not published unless complete."""
        self.stager.close()
