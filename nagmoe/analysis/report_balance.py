"""The report's "Expert balance during training" table (issue 43): per run, the router telemetry of its last
logged step (metrics.jsonl's `router`, nagmoe/model/router_health.py) and the mean clip coefficient over its
steps. metrics.jsonl may be written by anyone: a field that is not a number, or a list of numbers, shows "-"."""
from __future__ import annotations

import math
from typing import Optional

HEADERS = ["run", "max/mean p50", "p90", "max", "min/mean (worst layer)", "dead experts", "EP receive peak / mean",
           "dropped", "rerouted by b", "b range (max)", "b sign flips", "mean clip coef"]


def _numbers(value) -> Optional[list]:
    """`value` as a list of finite floats (a number is a list of one); None for anything else."""
    items = value if isinstance(value, list) else [value]
    if not items or not all(isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v)
                            for v in items):
        return None
    return [float(v) for v in items]


def _cell(router: dict, key: str, reduce, spec: str) -> str:
    values = _numbers(router.get(key))
    return "-" if values is None else format(reduce(values), spec)


def _mean(values: list) -> float:
    return sum(values) / len(values)


def balance_row(label: str, metrics: list) -> Optional[list]:
    """The table row of one run, or None when no logged step has router telemetry (a dense FFN)."""
    router = next((r["router"] for r in reversed(metrics) if isinstance(r.get("router"), dict)), None)
    if router is None:
        return None
    clips = [r["clip_coef"] for r in metrics if _numbers(r.get("clip_coef")) is not None]
    return [label, _cell(router, "max_over_mean_p50", max, ".2f"), _cell(router, "max_over_mean_p90", max, ".2f"),
            _cell(router, "max_over_mean_max", max, ".2f"), _cell(router, "min_over_mean", min, ".2f"),
            _cell(router, "dead", max, ".0f"), _cell(router, "receive_peak_over_mean", max, ".2f"),
            _cell(router, "dropped_frac", _mean, ".1%"), _cell(router, "rerouted_frac", _mean, ".1%"),
            _cell(router, "bias_range", max, ".3g"), _cell(router, "bias_flip_share", _mean, ".0%"),
            "-" if not clips else format(_mean(clips), ".3f")]


def balance_rows(groups: dict) -> list:
    return [row for g, rs in groups.items() for r in rs
            if (row := balance_row(f"{g} ({r.label})", r.metrics)) is not None]


NOTE = ("The router telemetry of each run's last logged step (the steps since the previous log): max/mean of the "
        "routing slots per expert across layers (p50, p90, max; 1 = balanced), the worst layer's min/mean (0 = a "
        "dead expert), the busiest EP rank's received rows over the mean in one layer's all-to-all (EP runs), the "
        "share of slots dropped by the capacity factor, and with model.moe.expert_bias the share of slots the bias "
        "moved off the unbiased top-k, the largest per-layer bias range, and the share of bias update signs that "
        "flipped from one step to the next (~100% once b oscillates about its balance point). Mean clip coef: "
        "the factor gradient clipping scaled each step by (1 = no clipping).")
