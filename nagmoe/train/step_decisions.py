"""What the training loop decides between steps, and the one collective it costs (issue 67).

Every rank must take the same decisions (stop, save, preempt, write), but a decision need not cost a collective
each step. Three kinds:

* **Local, the same arithmetic on every rank, no collective.** The stop: `step == train.max_steps`, or the FLOP
  budget (`flops + step_flops / 2 > budget`). `flops` sums `step_flops`, a function of the config and of MoD's
  executed fractions, and those come from counts all-reduced with the step's MoD histograms (integer-valued
  float64: the sum is exact, so every rank holds the same fractions to the bit); so every rank stops at the same
  step. Step-count saves and token milestones likewise. Each exchange below also checks it: every rank sends
  its step and its square (sums W·s and W·s² only when all W are equal), so a disagreement ends the run with
  one line instead of a hang at the next mismatched collective.
* **At sync steps** (every `train.sync_every` steps, and the last): any rank's preemption signal, the request
  file (rank 0 stats it), rank 0's checkpoint clock and rank 0's lease confirmation travel in one all-reduce.
  Bounds: a preemption is answered within sync_every steps (at the paper's ~0.4 s a step, the default 10 steps is ~4 s
  against the 120 s Slurm gives the batch script's trap, launch/train.sbatch); a save by minutes is late by
  at most sync_every steps; the metrics lines are buffered on rank 0 and written only after a sync step
  confirmed the lease (or after a fence before a checkpoint), so no line is written after the lease is lost.
  With a background save in flight (train.checkpoint_async), each rank adds whether its save thread is done and
  whether it failed: when every rank is done, or one failed, every rank settles the save at that step (one more
  collective, once per save: nagmoe/checkpoint/async_save.py).
* **At metrics steps** (`log.every`, eval steps, the last): the step's loss and auxiliary sums (their mean over
  ranks is the logged loss), the step's expert counts (its worst load) and, at log steps, the router's
  telemetry since the last report ride the same all-reduce (RouterAccounting.deferred_payload).

The non-finite guard needs no collective: a rank whose loss is not finite poisons a replicated gradient
(`poison_term`), DDP's all-reduce spreads the NaN, and every rank sees a non-finite global gradient norm: the
same decision everywhere (nagmoe/train/guards.py). With `log.every` 10 and sync_every 10 (the defaults of the paper
configs) that is one collective per 10 steps, and rank 0's two path calls (the request file's stat, the lease's
open) per 10 steps (tools/bench/count_bookkeeping.py counts them). Without a process group the same decisions run with no
collective.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Optional

import numpy as np
import torch

from nagmoe.base.errors import UserError

STEP_CHECK_LIMIT = 2 ** 26  # step² stays exact in float64 below this; beyond it only the sum is compared


@dataclass
class Shared:
    """What an exchange tells every rank (the same on each)."""
    preempt: bool = False  # some rank saw a signal, or rank 0 the request file (sync steps)
    clock_due: bool = False  # rank 0's checkpoint clock (sync steps)
    loss_sums: Optional[list] = None  # [loss, aux] summed over micro-steps, mean over ranks (metrics steps)
    worst_load: Optional[float] = None  # the step's worst layer max/mean expert load over every rank
    settle_save: bool = False  # the background save in flight ended on every rank, or failed on one (sync steps)

    def into(self, rec: dict, accum: int) -> None:
        """A metrics step's values into the step's record (its loss per micro-step, as the trainer logs it)."""
        if self.loss_sums is not None:
            rec["loss"], rec["aux_loss"] = (v / accum for v in self.loss_sums)
        if self.worst_load is not None:
            rec["moe_max_over_mean"] = self.worst_load


def poison_term(seen: torch.Tensor, param: torch.nn.Parameter) -> torch.Tensor:
    """A term for the last micro-step's loss that adds (seen - seen) to every element of `param`'s gradient:
    exactly 0 when this rank's loss so far (`seen`) is finite (g + 0 = g: the gradients are bitwise unchanged),
    NaN when it is not. Through DDP's all-reduce every rank then sees a non-finite gradient norm, so the guard
    decides the same on every rank without a collective of its own."""
    return (seen.detach() - seen.detach()).to(param.dtype) * param.sum()


class StepDecisions:
    """The loop's shared decisions for one `Trainer._run`. `exchange` is called at every step that is a sync or
    a metrics step, by every rank, in the same order (`preemption`: the loop's PreemptionWatch; None for a
    metrics-only exchange, Trainer.train_step's)."""

    def __init__(self, trainer, preemption=None):
        self.trainer, self.preemption = trainer, preemption
        self.mesh = trainer.mesh
        self.every = max(1, int(trainer.cfg.train.sync_every))
        self.lease_error: Optional[str] = None

    def is_sync(self, step: int, last: bool) -> bool:
        """Whether optimizer step `step` is a sync step (every sync_every steps, and the last); the same on every
        rank. Metrics steps are the steps whose record is written (LoopLog)."""
        return last or step % self.every == 0

    def exchange(self, step: int, sync: bool, metrics: bool, with_interval: bool) -> Shared:
        """One all-reduce (SUM, float64) of what this step's decisions need (module docstring); no collective
        without a process group. A lost lease raises the holder's UserError on every rank."""
        trainer, mesh = self.trainer, self.mesh
        head = [float(step), float(min(step, STEP_CHECK_LIMIT)) ** 2, 0.0, 0.0, 0.0, 0.0, 0.0]
        lease_error = None
        background = getattr(trainer, "background_save", None)
        pending = sync and background is not None and background.pending  # the same on every rank
        if pending:  # how this rank's background save stands (nagmoe/checkpoint/async_save.py)
            head[5], head[6] = float(background.failed_locally()), float(not background.done_locally())
        if sync:
            head[2] = float(self.preemption.local_request())
            if mesh.rank == 0:
                head[3] = float(trainer.checkpoint_schedule().rank0_clock_due())
                lease_error = self._confirm_lease()
                head[4] = float(lease_error is not None)
        device = mesh.collective_device() if mesh.distributed else torch.device("cpu")
        parts = [torch.tensor(head, dtype=torch.float64, device=device)]
        sums = router = None
        if metrics:
            if not trainer.sums_global:
                sums = trainer.step_sums
                parts.append(sums.to(device, torch.float64))
            router = trainer.routing.deferred_payload(with_interval) if mesh.distributed else None
            if router is not None:
                parts.append(router.to(device, torch.float64))
        buf = torch.cat(parts) if len(parts) > 1 else parts[0]
        if mesh.distributed:
            import torch.distributed as dist

            dist.all_reduce(buf, op=dist.ReduceOp.SUM)
        world = mesh.world_size if mesh.distributed else 1
        out = Shared()
        worst = None
        if router is not None:  # the router's sums back to its device (its telemetry stays there)
            worst = trainer.routing.take_reduced(buf[-router.numel():].to(router.device), with_interval)
        values = buf[:len(head) + (2 if sums is not None else 0)].tolist()  # the exchange's one host read
        self._check_step(step, values[0], values[1], world)
        if sync:
            out.preempt, out.clock_due = values[2] > 0.5, values[3] > 0.5
            out.settle_save = pending and (values[5] > 0.5 or values[6] < 0.5)
            if values[4] > 0.5:  # rank 0 saw the lease taken: its line on every rank (a rare extra collective)
                raise UserError(mesh.broadcast(lease_error) if mesh.distributed else lease_error)
        if sums is not None:
            # the mean over ranks as before (float64 sum / W, back to the step's float32)
            out.loss_sums = [float(np.float32(v / world)) for v in values[len(head):len(head) + 2]]
        if worst is not None:
            out.worst_load = float(worst)
        return out

    def _confirm_lease(self) -> Optional[str]:
        """Rank 0: None while the run dir's lease is ours, else the line every rank stops with."""
        try:
            self.trainer.rundir.confirm_lease()
        except UserError as e:
            return str(e)
        return None

    def _check_step(self, step: int, total: float, squares: float, world: int) -> None:
        s = float(step)
        same = total == world * s and (step >= STEP_CHECK_LIMIT or squares == world * s * s)
        if not same:
            raise UserError(f"the ranks disagree on the step at step {step} of this rank (mean over ranks "
                            f"{total / world:.2f}): their stop decisions diverged; a bug, please report it")
