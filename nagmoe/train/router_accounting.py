"""The trainer's routing bookkeeping (issues 22 and 43): each optimizer step's routing summed over its
micro-batches and over ranks with one all-reduce, the interval's telemetry read at log steps (per layer, or
folded to the worst layer between log.stats_every steps), and the loss-free
expert bias's once-per-step update from the step's global counts with its sign-flip statistic.

Device tensors throughout; the only host reads are the log step's report and a checkpoint's extra state."""
from __future__ import annotations

from typing import Optional

import torch

from nagmoe.model.router_health import RouterTelemetry, expert_biases, saved_bias_signs


class RouterAccounting:
    def __init__(self):
        self.interval = RouterTelemetry()  # routing since the last logged report
        self.step = RouterTelemetry()  # the current optimizer step's routing (begin_step refills it)
        self.counts_LE: Optional[torch.Tensor] = None  # the last step's global counts (the bias update reads them)
        self.bias_signs: Optional[torch.Tensor] = None  # the last bias update's (L, E) signs (flip share)
        self.pending: Optional[RouterTelemetry] = None  # local steps not yet summed over ranks (end_step)
        self.last_local: Optional[RouterTelemetry] = None  # the last local step (its worst load, when summed)

    def begin_step(self) -> None:
        self.step = RouterTelemetry()

    def add(self, model, rank: int, world: int) -> None:
        """After each micro-step's forward: its routing statistics (device ops only)."""
        self.step.add(model, rank, world)

    def end_step(self, distributed: bool, every_step: bool = True) -> Optional[torch.Tensor]:
        """The step's routing into the interval's telemetry; the worst layer's max/mean expert load (1 = balanced)
        as a device tensor, read with the step's metrics. None without MoE.

        Distributed, the step is summed over ranks by one all-reduce when `every_step` (the expert bias updates
        from the global counts of each step); otherwise it stays local (issue 67): summed into `pending` on this
        rank, and the interval and the worst load come from `deferred_payload` / `take_reduced`, which ride the
        loop's one collective at its metrics steps (nagmoe/train/step_decisions.py). Sums commute, so the interval
        is the same whichever way (float64; the entropy sums up to their order)."""
        self.counts_LE = None
        if self.step.empty:
            return None
        if distributed and not every_step:
            self.pending = self.step if self.pending is None else self._merged(self.pending)
            self.last_local = self.step
            return None
        flat = self.step.flat()
        if distributed:
            import torch.distributed as dist

            dist.all_reduce(flat)
        step = self.step.from_flat(flat)
        self.interval.add_tensors(step.counts_LE, step.entropy_L, step.tokens_L, step.dropped_L, step.rerouted_L)
        self.interval.add_peaks(step)  # EP: the busiest rank's received rows
        self.counts_LE = step.counts_LE
        return worst_load(step.counts_LE)

    def _merged(self, pending: RouterTelemetry) -> RouterTelemetry:
        """`pending` with this step's local routing added (its micro-steps' received rows appended)."""
        s = self.step
        pending.add_tensors(s.counts_LE, s.entropy_L, s.tokens_L, s.dropped_L, s.rerouted_L)
        pending.received.extend(s.received)
        return pending

    def deferred_payload(self, with_interval: bool) -> Optional[torch.Tensor]:
        """What a metrics step all-reduces (SUM) for the router, when steps stay local: the last step's counts
        (its worst load) and, at log steps (`with_interval`), the steps' routing since the last report. None when
        nothing is deferred."""
        last = self.last_local
        if last is None:
            return None
        parts = [last.counts_LE.flatten()]
        if with_interval:
            parts.append(self.pending.flat())
        return torch.cat(parts)

    def take_reduced(self, flat: torch.Tensor, with_interval: bool) -> torch.Tensor:
        """The summed `deferred_payload`: the interval gets the pending steps (global now); returns the last
        step's worst load (a device tensor)."""
        L, E = self.last_local.counts_LE.shape
        counts_LE = flat[:L * E].view(L, E)
        if with_interval:
            step = self.pending.from_flat(flat[L * E:])
            self.interval.add_tensors(step.counts_LE, step.entropy_L, step.tokens_L, step.dropped_L,
                                      step.rerouted_L)
            self.interval.add_peaks(step)
            self.pending = None
        return worst_load(counts_LE)

    def update_bias(self, model) -> None:
        """model.moe.expert_bias: b from this step's global counts, once per taken step; the flip statistic."""
        if self.counts_LE is None:
            return
        signs = model.update_expert_bias(self.counts_LE)
        if signs is None:  # rate 0: b frozen, the last signs kept
            return
        if self.bias_signs is not None:
            self.interval.note_bias_signs(signs, self.bias_signs)
        self.bias_signs = signs

    def report(self, ep: int, model, per_layer: bool = True) -> Optional[dict]:
        """The router report of the steps since the last one (nagmoe.model.router_health); one host read, at log
        steps only. None without MoE. `per_layer` False: each per-layer list folded to its worst layer
        (`compact`), so a metrics line's size does not grow with depth (log.stats_every)."""
        if self.interval.empty:
            return None
        health = self.interval.report(ep, expert_biases(model))
        health.pop("load")  # the L x E matrix stays out of every log line (nagmoe analyze has it)
        self.interval = RouterTelemetry()
        return health if per_layer else compact(health)

    def extra_state(self) -> dict:
        """For the checkpoint's extra state: the last update's signs (a host read, at saves only)."""
        return {} if self.bias_signs is None else {"expert_bias_signs": self.bias_signs.to(torch.int8).tolist()}

    def load_extra_state(self, state: dict, model, where: str) -> None:
        self.bias_signs = saved_bias_signs(state, model, where)


def worst_load(counts_LE: torch.Tensor) -> torch.Tensor:
    """The worst layer's max/mean expert load of a step's global counts (1 = balanced)."""
    return (counts_LE.max(1).values / counts_LE.mean(1).clamp_min(1e-9)).max()


# How a per-layer list folds to one number on a compact line: the worst layer (or the total, for counts).
WORST = {"entropy": min, "min_over_mean": min, "dead": sum, "bias_flip_share": max}


def compact(health: dict) -> dict:
    """The router report with every per-layer list folded to one number under the same key (the worst layer;
    dead experts summed over layers), plus `layers` = how many were folded: the report's balance table reads
    either form (a number is a list of one there)."""
    out = {}
    for key, value in health.items():
        if isinstance(value, list):
            out[key] = WORST.get(key, max)(value) if value else None
            out["layers"] = len(value)
        else:
            out[key] = value
    return out
