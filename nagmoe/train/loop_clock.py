"""The loop's own time (issue 67, item 6): what an iteration costs besides forward, backward and the optimizer.

Each metrics line carries, as means over the iterations since the previous line (one iteration when every step
logs), so that every second of the loop is counted once:
  step_s       wall time from the previous line to this one: the whole iteration (the preemption and stop checks,
               the step, evals, logging, checkpoints, garbage collection), the next line taking what follows a
               write;
  data_wait_s  time the step waited for its batches (the loader's read and the copy to the device);
  loop_s       step_s minus the step's own compute (forward, backward, optimizer: the step's time without the
               data wait), so the data wait included: the loop's own time, which on a cluster every rank pays at
               every step.
`tokens_per_s` (and so MFU) is then the global batch over step_s: throughput of the whole loop, not of the step
alone. Steps between lines (log.every > 1) carry their own step and data time only (the terminal bar, W&B).
On CUDA, `peak_memory_gib` is the allocator's peak since the start (torch.cuda.max_memory_allocated).
"""
from __future__ import annotations

import time
from typing import Optional


class LoopClock:
    def __init__(self, clock=time.perf_counter):
        self.clock = clock
        self.mark = clock()
        self.steps, self.compute_s, self.data_s = 0, 0.0, 0.0

    def step_done(self, step_s: float, data_wait_s: float) -> None:
        """After each optimizer step: its own time (`Trainer.train_step`) and the data wait inside it."""
        self.steps += 1
        self.compute_s += max(0.0, step_s - data_wait_s)
        self.data_s += data_wait_s

    def line(self) -> dict:
        """The fields of a metrics line written now; the next line counts from here."""
        now = self.clock()
        n = max(1, self.steps)
        step_s = (now - self.mark) / n
        fields = {"step_s": step_s, "data_wait_s": self.data_s / n, "loop_s": max(0.0, step_s - self.compute_s / n)}
        self.mark, self.steps, self.compute_s, self.data_s = now, 0, 0.0, 0.0
        return fields


def peak_memory_gib(device) -> Optional[float]:
    if getattr(device, "type", None) != "cuda":
        return None
    import torch

    return torch.cuda.max_memory_allocated(device) / 2 ** 30
