"""The training loop's records (issue 67): each step's record assembled, the written ones buffered on rank 0 and
written to metrics.jsonl and W&B only once the lease is confirmed (`flush`, after a sync step's exchange or a
fence: nagmoe/train/step_decisions.py), the progress line on stderr at once, and the loop's own time.

Written records: log steps (`log.every`), eval steps and the last. The router's telemetry per layer at
`log.stats_every` multiples (and the last), folded to the worst layer between (router_accounting.compact).
A crash loses the buffered lines, at most those of `train.sync_every` steps; the lines up to a checkpoint are
written before it is saved, so a resume (which truncates metrics.jsonl back to its checkpoint) repeats none and
misses none."""
from __future__ import annotations

from typing import Optional

import torch

from nagmoe.rundir.metrics import MetricsWriter
from nagmoe.train.loop_clock import LoopClock, peak_memory_gib
from nagmoe.train.progress_log import ProgressLog
from nagmoe.train.wandb_mode import wandb_record


class LoopLog:
    def __init__(self, trainer, progress_mode: str):
        self.trainer = trainer
        cfg = trainer.cfg
        self.every, self.stats_every = cfg.log.every, cfg.log.stats_every
        self.rank0 = trainer.rank == 0
        self.metrics = MetricsWriter(trainer.run_dir) if self.rank0 else None
        self.wandb = trainer.wandb
        self.progress: Optional[ProgressLog] = None  # a bar on a terminal, plain lines in a log file
        if progress_mode != "off" and self.rank0:
            device = trainer.device
            name = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
            self.progress = ProgressLog(cfg.train.max_steps, trainer.progress.step, name, trainer.world_size,
                                        self.every, tty=False if progress_mode == "lines" else None,
                                        flop_budget=cfg.train.flop_budget)
        self.clock = LoopClock()  # the loop's own time, per written record (loop_clock.py)
        self.buffer: list[dict] = []

    def logged(self, step: int, last: bool) -> bool:
        return last or step % self.every == 0

    def per_layer(self, step: int, last: bool) -> bool:
        """The router report per layer on this line, else each list folded to its worst layer."""
        return last or not self.stats_every or step % self.stats_every == 0

    def record(self, rec: dict, decisions, step: int, last: bool, dt: float) -> tuple:
        """Step `step`'s record, its exchange (step_decisions.py) and its line: a written record (log steps, eval
        steps, the last) gets the loss and worst load over every rank and the router's telemetry, every record
        its timing; written ones are buffered, and a sync step (the lease confirmed on every rank) writes the
        buffer. Returns (sync, what the exchange shared: None when there was none)."""
        trainer = self.trainer
        logged = self.logged(step, last)
        written = logged or "val_bpb" in rec
        sync = decisions.is_sync(step, last)
        shared = decisions.exchange(step, sync, written, logged) if sync or written else None
        if written:
            shared.into(rec, trainer.accum)
            router = (trainer.routing.report(trainer.mesh.ep, trainer.model, self.per_layer(step, last))
                      if logged else None)
            if router is not None:
                rec["router"] = router
        self.timing(rec, written, dt, trainer.data_wait_s, trainer.cfg.train.batch_tokens)
        if written:
            self.add(rec)
        if sync:
            self.flush()
        return sync, shared

    def timing(self, rec: dict, written: bool, dt: float, data_wait_s: float, batch_tokens: int) -> None:
        """The loop's time into `rec`: a written line's since the last written one (loop_clock.py), else this
        step's; tokens per second over the whole iteration; the peak memory on CUDA."""
        timing = self.clock.line() if written else {"step_s": dt, "data_wait_s": data_wait_s}
        peak = peak_memory_gib(self.trainer.device)
        rec.update(timing, tokens_per_s=batch_tokens / timing["step_s"],
                   **({"peak_memory_gib": peak} if peak is not None else {}))

    def add(self, rec: dict) -> None:
        """A written record, kept until the next flush (rank 0; the other ranks write nothing)."""
        if self.rank0:
            self.buffer.append(rec)

    def flush(self) -> None:
        """Write the buffered records. Only after the lease was confirmed on every rank (the caller's part)."""
        for rec in self.buffer:
            self.metrics.write(rec)
            if self.wandb is not None:
                self.wandb.log(wandb_record(rec), step=rec["step"])
        self.buffer.clear()

    def show(self, rec: dict, step_flops: float, last: bool, val_bpb: Optional[float]) -> None:
        if self.progress is not None:
            self.progress.update(rec, step_flops, rec["step_s"], last, val_bpb)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.close()
        if self.metrics is not None:
            self.metrics.close()
