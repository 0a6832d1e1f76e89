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

    def begin_step(self) -> None:
        self.step = RouterTelemetry()

    def add(self, model, rank: int, world: int) -> None:
        """After each micro-step's forward: its routing statistics (device ops only)."""
        self.step.add(model, rank, world)

    def end_step(self, distributed: bool) -> Optional[torch.Tensor]:
        """The step's routing summed over ranks (one all-reduce) into the interval's telemetry; the worst layer's
        max/mean expert load (1 = balanced) as a device tensor, read with the step's metrics. None without MoE."""
        self.counts_LE = None
        if self.step.empty:
            return None
        flat = self.step.flat()
        if distributed:
            import torch.distributed as dist

            dist.all_reduce(flat)
        step = self.step.from_flat(flat)
        self.interval.add_tensors(step.counts_LE, step.entropy_L, step.tokens_L, step.dropped_L, step.rerouted_L)
        self.interval.add_peaks(step)  # EP: the busiest rank's received rows
        self.counts_LE = step.counts_LE
        return (step.counts_LE.max(1).values / step.counts_LE.mean(1).clamp_min(1e-9)).max()

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
