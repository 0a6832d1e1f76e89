"""Batches prefetched (issue 67): the next training batches are read while the step runs.

Why. A micro-step's batch is gathered from the memmapped shards row by row, converted to int64, checked against
the vocabulary (`TokenShards.gather`) and, on CUDA, pinned for an asynchronous copy (`host_copy.to_device`).
Done on the main thread between steps, the GPU idles through all of it. Here a daemon thread does it for the
next `depth` batches while the step runs (torchtitan prefetches two batches; nanochat fetches the next one
during forward/backward), so the step waits only when reading is slower than stepping. Memory stays bounded:
at most `depth` batches are read ahead of the ones consumed.

Exactness. Only the thread calls the wrapped loader, in its own order, so the batches are bitwise the same.
Each batch travels with the loader's state right after it was read, and `state_dict()` is the state after the
last batch *consumed*: a checkpoint resumes at the batch the step would have taken next, not past the ones read
ahead (they are dropped and read again). An exception in the thread (a `UserError` from gather's id check,
anything else) is raised on the main thread by the `next()` that would have returned that batch: the same
object, so the CLI prints the same one line. depth=0 is no thread: the wrapped loader, called in place.
"""
from __future__ import annotations

import queue
import threading
import weakref
from typing import Optional, Union

import torch

from nagmoe.base.errors import UserError

JOIN_S = 30.0  # close(): the longest wait for the thread to finish the batch it is reading


class _Failed:
    def __init__(self, error: BaseException):
        self.error = error


def _fill(loader, out: queue.SimpleQueue, slots: threading.Semaphore, stop: threading.Event,
          cuda_index: Optional[int]) -> None:
    """The thread: one slot per batch read ahead (the consumer gives it back); (x, y, state after) or _Failed.
    Holds no reference to the PrefetchLoader, so a dropped one is collected (its finalizer stops this)."""
    try:
        if cuda_index is not None:  # the current device is per thread: pin in this rank's context, not cuda:0's
            torch.cuda.set_device(cuda_index)
        while True:
            slots.acquire()
            if stop.is_set():
                return
            x, y = next(loader)
            if cuda_index is not None:
                x, y = x.pin_memory(), y.pin_memory()
            out.put((x, y, loader.state_dict()))
    except BaseException as e:  # noqa: BLE001 -- every failure goes to the consumer, raised there
        out.put(_Failed(e))


def _signal_stop(stop: threading.Event, slots: threading.Semaphore) -> None:
    stop.set()
    slots.release()  # wakes a thread waiting for a slot


class PrefetchLoader:
    """Wraps an iterator of batches with `state_dict()` / `load_state_dict()` (a `TokenLoader`): the same
    batches in the same order, read `depth` ahead by a daemon thread (pinned when `pin`, for a CUDA copy with
    non_blocking; `device`: the CUDA device to pin for, default the current one). `close()` stops the thread;
    the next `next()` starts it again where the consumer is."""

    def __init__(self, loader, depth: int = 2, pin: bool = False,
                 device: Union[None, int, str, torch.device] = None):
        if not isinstance(depth, int) or isinstance(depth, bool) or depth < 0:
            raise UserError(f"data.prefetch: {depth!r} must be a non-negative integer (batches read ahead)")
        self.loader, self.depth, self.pin, self.device = loader, depth, bool(pin), device
        self._thread: Optional[threading.Thread] = None
        self._state: Optional[dict] = None  # the position consumed, while the wrapped loader is ahead of it
        self._failed: Optional[BaseException] = None  # raised again by every next() until load_state_dict

    def __iter__(self) -> "PrefetchLoader":
        return self

    def _start(self) -> None:
        cuda_index = None
        if self.pin:
            dev = torch.device("cuda") if self.device is None else torch.device(self.device)
            cuda_index = torch.cuda.current_device() if dev.index is None else dev.index
        self._state = self.loader.state_dict()
        self._out: queue.SimpleQueue = queue.SimpleQueue()
        self._slots, self._stop = threading.Semaphore(self.depth), threading.Event()
        self._thread = threading.Thread(target=_fill, args=(self.loader, self._out, self._slots, self._stop,
                                                            cuda_index), name="nagmoe-prefetch", daemon=True)
        self._finalizer = weakref.finalize(self, _signal_stop, self._stop, self._slots)
        self._thread.start()

    def _take(self):
        while True:
            try:
                return self._out.get(timeout=1.0)
            except queue.Empty:
                if not self._thread.is_alive():  # it always puts before it ends; this is a guard against a hang
                    try:
                        return self._out.get_nowait()
                    except queue.Empty:
                        raise RuntimeError("the prefetch thread ended without a batch") from None

    def __next__(self):
        if self.depth == 0:
            return next(self.loader)
        if self._failed is not None:
            raise self._failed
        if self._thread is None:
            self._start()
        item = self._take()
        if isinstance(item, _Failed):
            self._failed = item.error
            self.close()  # the thread has ended; rewinds the loader to the batches consumed
            raise item.error
        x, y, self._state = item
        self._slots.release()
        return x, y

    def state_dict(self) -> dict:
        """The wrapped loader's state as of the batches consumed (not those read ahead)."""
        return dict(self._state) if self._state is not None else self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.close()
        self._failed = None
        self.loader.load_state_dict(state)

    def close(self) -> None:
        """Stop the thread (a bounded join) and rewind the wrapped loader to the position consumed, so nothing
        read ahead is lost; idempotent."""
        thread, self._thread = self._thread, None
        if thread is None:
            return
        self._finalizer.detach()
        _signal_stop(self._stop, self._slots)
        thread.join(JOIN_S)
        if thread.is_alive():  # still inside a read: the loader is its until it ends, so keep the position only
            self.loader = _Stuck(self.loader)
            return
        self.loader.load_state_dict(self._state)
        self._state = None


class _Stuck:
    """The wrapped loader of a close() whose thread did not end in time: no more batches from it."""

    def __init__(self, loader):
        self.loader = loader

    def _refuse(self, *args):
        raise RuntimeError(f"the prefetch thread did not stop within {JOIN_S:.0f} s")

    __next__ = state_dict = load_state_dict = _refuse
