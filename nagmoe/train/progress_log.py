"""The trainer's progress on stderr, suited to where it goes (issue 27): on a terminal the tqdm bar; otherwise
(a Slurm log file, a pipe) one plain line per logging interval — no carriage-return frames in a log file:

    [nagmoe] step 120/4000 loss 3.412 val_bpb - tok/s 51,234 TFLOP/s 380.1 MFU 38.4% step_s 0.640 (data 0.002,
             loop 0.011) peak 61.2 GiB elapsed 0:12:04 ETA 6:30:11

A line is written at the first step, then at most one per `min_interval_s` among the steps that `log.every`
selects, and always at the last step. tok/s, TFLOP/s and MFU are over the whole iteration (step_s: the loop's
own time included, nagmoe/train/loop_clock.py). MFU is against the device's bf16 data-sheet peak times the world
size (nagmoe.config.flops.mfu), "-" where the peak is unknown (CPU). ETA from the time since this process started:
per step over the steps left to `train.max_steps`, and per FLOP over the FLOPs left to `train.flop_budget` (the
paper configs stop on a budget); the sooner of the two where both are set, "-" where neither is.
"""
from __future__ import annotations

import sys
import time
from typing import Optional, TextIO

from nagmoe.config.flops import mfu


def _clock(seconds: float) -> str:
    seconds = int(max(0.0, seconds))
    return f"{seconds // 3600}:{seconds % 3600 // 60:02d}:{seconds % 60:02d}"


class ProgressLog:
    def __init__(self, total_steps: Optional[int], start_step: int, device_name: str, world_size: int = 1,
                 every: int = 1, stream: Optional[TextIO] = None, tty: Optional[bool] = None,
                 min_interval_s: float = 10.0, flop_budget: Optional[float] = None):
        """`tty`: a bar (True) or plain lines (False); None: a bar where the stream is a terminal.
        `flop_budget`: train.flop_budget, for the ETA of a run that stops on it (the FLOPs are `rec["flops"]`)."""
        self.stream = stream if stream is not None else sys.stderr
        self.tty = self.stream.isatty() if tty is None else tty
        self.total, self.start_step, self.every = total_steps, start_step, max(1, every)
        self.device_name, self.world_size, self.min_interval_s = device_name, world_size, min_interval_s
        self.flop_budget = flop_budget
        self.start_flops: Optional[float] = None  # the run's FLOPs when this process started (at its first step)
        self.started = time.monotonic()
        self.last_line: Optional[float] = None
        self.bar = None
        if self.tty:
            from tqdm import tqdm

            self.bar = tqdm(total=total_steps, initial=start_step, unit="step", file=self.stream,
                            dynamic_ncols=True, mininterval=1.0)

    def update(self, rec: dict, step_flops: float, step_seconds: float, last: bool,
               val_bpb: Optional[float]) -> None:
        """After each optimizer step: `rec` the step's metrics, `step_flops` its FLOPs (all ranks) and
        `step_seconds` its time."""
        if self.start_flops is None and "flops" in rec:
            self.start_flops = rec["flops"] - step_flops
        if self.bar is not None:
            self.bar.update(1)
            extra = {"eta": self.eta(rec, time.monotonic())} if not self.total and self.flop_budget else {}
            self.bar.set_postfix(loss=f"{rec['loss']:.3f}", bpb=f"{val_bpb:.3f}" if val_bpb else "-",
                                 tok_s=f"{rec['tokens_per_s']:.0f}", **extra)  # tqdm's own ETA needs max_steps
            return
        step, now = rec["step"], time.monotonic()
        due = self.last_line is None or (step % self.every == 0 and now - self.last_line >= self.min_interval_s)
        if not (due or last):
            return
        self.last_line = now
        flops_s = step_flops / max(step_seconds, 1e-9)
        util = mfu(flops_s, self.device_name, self.world_size)
        elapsed = now - self.started
        eta = self.eta(rec, now)
        total = f"/{self.total}" if self.total else ""
        bpb = f"{val_bpb:.4f}" if val_bpb else "-"
        loop = (f" step_s {rec['step_s']:.3f} (data {rec['data_wait_s']:.3f}, loop {rec['loop_s']:.3f})"
                if "loop_s" in rec else "")  # the loop's own time (nagmoe/train/loop_clock.py)
        peak = f" peak {rec['peak_memory_gib']:.1f} GiB" if rec.get("peak_memory_gib") is not None else ""
        self.stream.write(f"[nagmoe] step {step}{total} loss {rec['loss']:.4f} val_bpb {bpb} "
                          f"tok/s {rec['tokens_per_s']:,.0f} TFLOP/s {flops_s / 1e12:.1f} "
                          f"MFU {'-' if util is None else f'{100 * util:.1f}%'}{loop}{peak} elapsed {_clock(elapsed)} "
                          f"ETA {eta}\n")
        self.stream.flush()

    def eta(self, rec: dict, now: float) -> str:
        """The time left: per step to max_steps, per FLOP to the FLOP budget, the sooner; "-" if neither."""
        elapsed, left = now - self.started, []
        done = rec["step"] - self.start_step
        if self.total and done > 0:
            left.append(elapsed / done * max(0, self.total - rec["step"]))
        if self.flop_budget and self.start_flops is not None and "flops" in rec:
            flops_done = rec["flops"] - self.start_flops
            if flops_done > 0:
                left.append(elapsed / flops_done * max(0.0, self.flop_budget - rec["flops"]))
        return _clock(min(left)) if left else "-"

    def close(self) -> None:
        if self.bar is not None:
            self.bar.close()
