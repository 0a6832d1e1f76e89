"""Python's garbage collector off the training step (issue 67, item 3).

A generational collection starts whenever allocations outnumber deallocations by a threshold: at any point of
any step, on each rank at its own moment. In a distributed job one rank's pause (tens of milliseconds once the
heap holds a model's worth of objects) stalls every rank at the next collective. So, with `train.gc_every` K > 0:

  * after set-up, `gc.freeze()` moves every object alive then (the model, optimizer, data, the imported modules)
    into a permanent generation no collection traverses again;
  * automatic collection is off for the loop;
  * a full collection runs every K steps, after step s with s % K == 0: the same steps on every rank (the step
    count is the same everywhere), so the pauses line up instead of staggering. Reference cycles made in the loop
    are still freed, at most K steps late.
K = 0 leaves Python's automatic collection as it is (the legacy value: runs before the key behave as they did).
Leaving the loop (normally or by an exception) puts the collector back as it was and unfreezes, so the process
(e.g. `nagmoe experiment` running runs one after another) gets its heap back.
"""
from __future__ import annotations

import gc


class LoopGC:
    def __init__(self, every: int):
        self.every = every
        self.collections = 0
        self._was_enabled = None

    def __enter__(self) -> "LoopGC":
        if self.every > 0:
            self._was_enabled = gc.isenabled()
            gc.collect()  # set-up's garbage first: frozen garbage would never be freed
            gc.freeze()
            gc.disable()
        return self

    def step_done(self, step: int) -> None:
        if self.every > 0 and step % self.every == 0:
            gc.collect()
            self.collections += 1

    def __exit__(self, *exc) -> None:
        if self.every > 0:
            gc.unfreeze()
            if self._was_enabled:
                gc.enable()
