"""Router and load health of the MoE layers: one telemetry spec for training metrics, `nagmoe analyze` and the
report (issue 22).

Legend: L MoE layers, E experts, R expert-parallel ranks (experts [r·E/R, (r+1)·E/R) live on EP rank r).

Per forward, each MoELayer leaves in `last_stats`: `tokens_per_expert` (E,) routing slots per expert and
`router_entropy_sum` (sum over its tokens of the router distribution's entropy, nats) with `router_tokens`.
`RouterTelemetry.add(model)` adds them into on-device accumulators (no host sync); `flat()`/`load_flat()` give
one tensor to all-reduce over ranks; `report(ep)` reads them once and returns, per layer:

  entropy            mean router entropy per token, nats (log E = uniform; 0 = one-hot)
  max_over_mean      max over experts of the slots / their mean (1 = balanced, E = one expert takes every slot)
  min_over_mean      min over experts of the slots / their mean (1 = balanced, 0 = a dead expert)
  cv                 coefficient of variation of the slots over experts (std / mean, 0 = balanced)
  dead               experts that received no slot in the accumulated interval
  ep_max_over_mean   max over EP ranks of the slots their local experts received / the mean (R > 1 only)
  load               the slots per expert as fractions of the layer's slots (L x E: the report's heatmap)
  dropped_frac       routing slots dropped by model.moe.capacity_factor / all slots (0 when dropless)
With the loss-free expert bias (model.moe.expert_bias) also:
  rerouted_frac      the share of chosen (token, expert) slots that are not in the unbiased top-k (0 when b = 0)
  bias_range, bias_std   of each layer's bias b at the report (b is replicated: every rank's is the same)
  bias_flip_share    the share of the layer's experts whose update sign sign(mean(c) - c) differs from the
                     previous step's, over the interval's updates (~0 while b travels, ~1 when it oscillates
                     about its balance point; absent before a second update)
Across layers: `max_over_mean_p50`, `_p90`, `_max` (nearest-rank percentiles of the per-layer max_over_mean).
Under expert parallelism (what sets EP step time): `receive_peak_rows`, the most rows one rank received in one
layer's all-to-all in one micro-step, and `receive_peak_over_mean`, the largest such busiest-rank / mean-rank
ratio (over layers, micro-steps and the interval's steps; activation-checkpoint recompute is never added).
"""
from __future__ import annotations

from typing import Optional

import torch


def moe_layers(model) -> list:
    """The MoE sublayers of `model` in depth order (those with routing statistics)."""
    return [sub for sub in model.sublayers() if hasattr(sub, "router") and hasattr(sub, "n_experts")]


class RouterTelemetry:
    def __init__(self):
        self.counts_LE: Optional[torch.Tensor] = None  # routing slots per expert, float64 (exact for counts)
        self.entropy_L: Optional[torch.Tensor] = None  # summed router entropy, nats
        self.tokens_L: Optional[torch.Tensor] = None   # routed tokens
        self.dropped_L: Optional[torch.Tensor] = None  # slots over an expert's capacity (training only)
        self.rerouted_L: Optional[torch.Tensor] = None  # slots the expert bias moved off the unbiased top-k
        # EP: each micro-step's received rows per (layer, rank) (this rank's column filled; the SUM all-reduce
        # fills the others), and the interval's running peaks
        self.received: list = []
        self.world = 1
        self.peak_rows: Optional[torch.Tensor] = None
        self.peak_ratio: Optional[torch.Tensor] = None
        # the expert bias's sign flips between consecutive updates, per layer, and the updates compared
        self.flips_L: Optional[torch.Tensor] = None
        self.flip_updates = 0

    @property
    def empty(self) -> bool:
        return self.counts_LE is None

    def add(self, model, rank: int = 0, world: int = 1) -> None:
        """Add the last forward's statistics of every MoE layer of `model` (device ops only); `rank`/`world`
        place this rank's received rows (expert parallelism) for the receive peak."""
        layers = [layer for layer in moe_layers(model) if "tokens_per_expert" in layer.last_stats]
        if not layers:
            return
        if all("received_rows" in layer.last_stats for layer in layers):
            rows_L = torch.stack([layer.last_stats["received_rows"] for layer in layers])
            received_LW = rows_L.new_zeros(len(layers), world)
            received_LW[:, rank] = rows_L
            self.received.append(received_LW)
            self.world = world
        counts = torch.stack([layer.last_stats["tokens_per_expert"].to(torch.float64) for layer in layers])
        entropy = torch.stack([layer.last_stats["router_entropy_sum"].to(torch.float64) for layer in layers])
        tokens = torch.stack([layer.last_stats["router_tokens"].to(torch.float64) for layer in layers])
        zero = torch.zeros((), device=counts.device)
        dropped = torch.stack([layer.last_stats.get("dropped_slots", zero).to(device=counts.device, dtype=torch.float64)
                               for layer in layers])
        rerouted = torch.stack([layer.last_stats.get("rerouted_slots", zero).to(device=counts.device,
                                                                                dtype=torch.float64)
                                for layer in layers])
        self.add_tensors(counts, entropy, tokens, dropped, rerouted)

    def add_tensors(self, counts_LE, entropy_L, tokens_L, dropped_L=None, rerouted_L=None) -> None:
        dropped_L = torch.zeros_like(entropy_L) if dropped_L is None else dropped_L
        rerouted_L = torch.zeros_like(entropy_L) if rerouted_L is None else rerouted_L
        if self.counts_LE is None:
            self.counts_LE, self.entropy_L, self.tokens_L = counts_LE.clone(), entropy_L.clone(), tokens_L.clone()
            self.dropped_L, self.rerouted_L = dropped_L.clone(), rerouted_L.clone()
        else:
            self.counts_LE += counts_LE
            self.entropy_L += entropy_L
            self.tokens_L += tokens_L
            self.dropped_L += dropped_L
            self.rerouted_L += rerouted_L

    def flat(self) -> torch.Tensor:
        """Everything as one tensor (to all-reduce SUM over ranks); `from_flat` undoes it."""
        parts = [self.counts_LE.flatten(), self.entropy_L, self.tokens_L, self.dropped_L, self.rerouted_L]
        return torch.cat(parts + [r.flatten() for r in self.received])

    def from_flat(self, flat: torch.Tensor) -> "RouterTelemetry":
        L, E = self.counts_LE.shape
        out = RouterTelemetry()
        out.counts_LE = flat[:L * E].view(L, E)
        out.entropy_L, out.tokens_L, out.dropped_L, out.rerouted_L = flat[L * E:L * E + 4 * L].view(4, L)
        if self.received:
            received_MLW = flat[L * E + 4 * L:].view(len(self.received), L, self.world)
            out.received, out.world = list(received_MLW), self.world
            out.note_peaks(received_MLW)
        return out

    def note_peaks(self, received_MLW: torch.Tensor) -> None:
        """Fold micro-steps' received rows (every rank's column filled) into the running peaks (device ops)."""
        busiest_ML = received_MLW.max(2).values
        rows, ratio = busiest_ML.max(), (busiest_ML / received_MLW.mean(2).clamp_min(1e-9)).max()
        self.peak_rows = rows if self.peak_rows is None else torch.maximum(self.peak_rows, rows)
        self.peak_ratio = ratio if self.peak_ratio is None else torch.maximum(self.peak_ratio, ratio)

    def add_peaks(self, other: "RouterTelemetry") -> None:
        for name in ("peak_rows", "peak_ratio"):
            mine, theirs = getattr(self, name), getattr(other, name)
            if theirs is not None:
                setattr(self, name, theirs if mine is None else torch.maximum(mine, theirs))

    def note_bias_signs(self, signs_LE: torch.Tensor, previous_LE: torch.Tensor) -> None:
        """Count the experts whose bias update changed sign since the previous update (device ops only)."""
        flips_L = (signs_LE != previous_LE.to(signs_LE.device)).sum(1).double()
        self.flips_L = flips_L if self.flips_L is None else self.flips_L + flips_L
        self.flip_updates += 1

    def report(self, ep: int = 1, bias_LE: Optional[torch.Tensor] = None) -> Optional[dict]:
        """Per-layer lists (module docstring); one host read (the biases `bias_LE`, when given, ride along).
        None when nothing was added."""
        if self.counts_LE is None:
            return None
        L, E = self.counts_LE.shape
        parts = [self.counts_LE.double()]
        if bias_LE is not None:
            parts.append(bias_LE.to(self.counts_LE.device).double())
            if self.flips_L is not None:
                parts.append(self.flips_L.to(self.counts_LE.device).view(L, 1).expand(L, E))
        both = torch.cat(parts).cpu()
        counts = both[:L]
        mean = counts.mean(1).clamp_min(1e-12)
        out = {
            "entropy": (self.entropy_L.double().cpu() / self.tokens_L.double().cpu().clamp_min(1)).tolist(),
            "max_over_mean": (counts.max(1).values / mean).tolist(),
            "min_over_mean": (counts.min(1).values / mean).tolist(),
            "cv": (counts.std(1, unbiased=False) / mean).tolist(),
            "dead": (counts == 0).sum(1).tolist(),
            "load": (counts / counts.sum(1, keepdim=True).clamp_min(1e-12)).tolist(),
            "dropped_frac": (self.dropped_L.double().cpu() / counts.sum(1).clamp_min(1e-12)).tolist(),
        }
        worst = sorted(out["max_over_mean"])
        for name, q in (("p50", 0.5), ("p90", 0.9)):  # nearest rank: the smallest value with >= q of the layers
            out[f"max_over_mean_{name}"] = worst[max(0, -(-int(q * 100) * L // 100) - 1)]
        out["max_over_mean_max"] = worst[-1]
        if self.peak_rows is not None:
            peaks = torch.stack([self.peak_rows.double(), self.peak_ratio.double()]).cpu().tolist()
            out["receive_peak_rows"], out["receive_peak_over_mean"] = peaks
        if bias_LE is not None:
            bias = both[L:2 * L]
            if self.flips_L is not None:
                out["bias_flip_share"] = (both[2 * L:, 0] / (self.flip_updates * E)).tolist()
            out["rerouted_frac"] = (self.rerouted_L.double().cpu() / counts.sum(1).clamp_min(1e-12)).tolist()
            out["bias_range"] = (bias.max(1).values - bias.min(1).values).tolist()
            out["bias_std"] = bias.std(1, unbiased=False).tolist()
        if ep > 1 and E % ep == 0:
            per_rank = counts.view(L, ep, E // ep).sum(2)
            out["ep_max_over_mean"] = (per_rank.max(1).values / per_rank.mean(1).clamp_min(1e-12)).tolist()
        return out


def expert_biases(model) -> Optional[torch.Tensor]:
    """(L, E) the MoE layers' expert biases (model.moe.expert_bias), or None when the model has none."""
    biases = [layer.expert_bias for layer in moe_layers(model) if getattr(layer, "expert_bias", None) is not None]
    return torch.stack(biases) if biases else None


def saved_bias_signs(state: dict, model, where: str) -> Optional[torch.Tensor]:
    """The last bias update's (L, E) signs from a checkpoint's extra state (`expert_bias_signs`, written by the
    trainer so a resumed run's flip share continues the straight run's), checked against `model`'s biases: None
    when absent (a checkpoint from before the statistic: the first update after it compares nothing) or when
    the model has no bias. Anything but an L x E table of -1/0/1 is a one-line UserError naming `where`."""
    from nagmoe.base.errors import UserError, shown

    value, bias_LE = state.get("expert_bias_signs"), expert_biases(model)
    if value is None or bias_LE is None:
        return None
    L, E = bias_LE.shape
    if not (isinstance(value, list) and len(value) == L and all(
            isinstance(row, list) and len(row) == E and all(type(v) is int and v in (-1, 0, 1) for v in row)
            for row in value)):
        raise UserError(f"{shown(where)}: extra state 'expert_bias_signs' must be {L} rows of {E} values in "
                        f"-1, 0, 1 (the model's MoE layers and experts), got {shown(value, 80)}")
    return torch.tensor(value, dtype=torch.float32, device=bias_LE.device)
