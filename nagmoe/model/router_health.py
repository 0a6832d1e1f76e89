"""Router and load health of the MoE layers: one telemetry spec for training metrics, `nagmoe analyze` and the
report (issue 22).

Legend: L MoE layers, E experts, R expert-parallel ranks (experts [r·E/R, (r+1)·E/R) live on EP rank r).

Per forward, each MoELayer leaves in `last_stats`: `tokens_per_expert` (E,) routing slots per expert and
`router_entropy_sum` (sum over its tokens of the router distribution's entropy, nats) with `router_tokens`.
`RouterTelemetry.add(model)` adds them into on-device accumulators (no host sync); `flat()`/`load_flat()` give
one tensor to all-reduce over ranks; `report(ep)` reads them once and returns, per layer:

  entropy            mean router entropy per token, nats (log E = uniform; 0 = one-hot)
  max_over_mean      max over experts of the slots / their mean (1 = balanced, E = one expert takes every slot)
  cv                 coefficient of variation of the slots over experts (std / mean, 0 = balanced)
  dead               experts that received no slot in the accumulated interval
  ep_max_over_mean   max over EP ranks of the slots their local experts received / the mean (R > 1 only)
  load               the slots per expert as fractions of the layer's slots (L x E: the report's heatmap)
  dropped_frac       routing slots dropped by model.moe.capacity_factor / all slots (0 when dropless)
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

    @property
    def empty(self) -> bool:
        return self.counts_LE is None

    def add(self, model) -> None:
        """Add the last forward's statistics of every MoE layer of `model` (device ops only)."""
        layers = [layer for layer in moe_layers(model) if "tokens_per_expert" in layer.last_stats]
        if not layers:
            return
        counts = torch.stack([layer.last_stats["tokens_per_expert"].to(torch.float64) for layer in layers])
        entropy = torch.stack([layer.last_stats["router_entropy_sum"].to(torch.float64) for layer in layers])
        tokens = torch.stack([layer.last_stats["router_tokens"].to(torch.float64) for layer in layers])
        dropped = torch.stack([layer.last_stats.get("dropped_slots", torch.zeros((), device=counts.device))
                               .to(device=counts.device, dtype=torch.float64) for layer in layers])
        self.add_tensors(counts, entropy, tokens, dropped)

    def add_tensors(self, counts_LE, entropy_L, tokens_L, dropped_L=None) -> None:
        dropped_L = torch.zeros_like(entropy_L) if dropped_L is None else dropped_L
        if self.counts_LE is None:
            self.counts_LE, self.entropy_L, self.tokens_L = counts_LE.clone(), entropy_L.clone(), tokens_L.clone()
            self.dropped_L = dropped_L.clone()
        else:
            self.counts_LE += counts_LE
            self.entropy_L += entropy_L
            self.tokens_L += tokens_L
            self.dropped_L += dropped_L

    def flat(self) -> torch.Tensor:
        """Everything as one tensor (to all-reduce SUM over ranks); `from_flat` undoes it."""
        return torch.cat([self.counts_LE.flatten(), self.entropy_L, self.tokens_L, self.dropped_L])

    def from_flat(self, flat: torch.Tensor) -> "RouterTelemetry":
        L, E = self.counts_LE.shape
        out = RouterTelemetry()
        out.counts_LE = flat[:L * E].view(L, E)
        out.entropy_L, out.tokens_L, out.dropped_L = flat[L * E:].view(3, L)
        return out

    def report(self, ep: int = 1) -> Optional[dict]:
        """Per-layer lists (module docstring); one host read. None when nothing was added."""
        if self.counts_LE is None:
            return None
        counts = self.counts_LE.double().cpu()
        mean = counts.mean(1).clamp_min(1e-12)
        L, E = counts.shape
        out = {
            "entropy": (self.entropy_L.double().cpu() / self.tokens_L.double().cpu().clamp_min(1)).tolist(),
            "max_over_mean": (counts.max(1).values / mean).tolist(),
            "cv": (counts.std(1, unbiased=False) / mean).tolist(),
            "dead": (counts == 0).sum(1).tolist(),
            "load": (counts / counts.sum(1, keepdim=True).clamp_min(1e-12)).tolist(),
            "dropped_frac": (self.dropped_L.double().cpu() / counts.sum(1).clamp_min(1e-12)).tolist(),
        }
        if ep > 1 and E % ep == 0:
            per_rank = counts.view(L, ep, E // ep).sum(2)
            out["ep_max_over_mean"] = (per_rank.max(1).values / per_rank.mean(1).clamp_min(1e-12)).tolist()
        return out
