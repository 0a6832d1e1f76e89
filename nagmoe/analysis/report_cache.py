"""The report's per-run cache, OUT/data/<label>.json: the analysis and eval of a run's latest checkpoint, reused
while that checkpoint is the same. The out dir may be shared or reused, so the file is read as foreign input:
`read_cache` checks it against the shapes below (the fields the report's sections read) and a file that fails
is a UserError naming it and the field; the report then names it under Problems and measures the run again.

A shape is a type (`NUM` a finite number, `NUM_OR_NULL`, `int`, `str`, `ANY`), a one-element list (a list of
that shape), a dict (an object with those fields; a key starting with "?" may be absent) or a tuple (any of).
"""
from __future__ import annotations

import math
import os
from typing import Any, Optional

from nagmoe.base.errors import UserError, shown
from nagmoe.base.files import expect_object, read_json

NUM = "number"
NUM_OR_NULL = (NUM, None)
INT = "integer"
ANY = "anything"

BINS = {"bins": [{"mean": NUM_OR_NULL, "loss": NUM_OR_NULL, "top1_acc": NUM_OR_NULL}],
        "?spearman_loss": NUM_OR_NULL, "?spearman_top1": NUM_OR_NULL}
DIAL_POINT = {"skip_rate": NUM, "flops_vs_full_depth": NUM, "?calibrated_skip_rate": NUM_OR_NULL,
              "?realised_skip_rate": NUM_OR_NULL, "?val_loss": NUM_OR_NULL, "?val_bpb": NUM_OR_NULL}
MILESTONE = {"step": INT, "tokens": (NUM, None), "val_loss": NUM_OR_NULL, "norm_growth": NUM_OR_NULL,
             "cumulative_rotation": NUM_OR_NULL, "skip_rate": NUM_OR_NULL, "router_max_over_mean": NUM_OR_NULL,
             "router_dead_experts": (INT, None)}
ANALYSIS = {
    "residual": str, "?val_loss": NUM_OR_NULL, "?val_bpb": NUM_OR_NULL, "?windows": (str, None),
    "depth": {"norm_curve": [NUM_OR_NULL], "cumulative_rotation": [NUM], "norm_growth": NUM_OR_NULL,
              "sublayers": [{"?gain_mean": NUM_OR_NULL}], "?dead_sublayers": INT},
    "attention_sink": {"first_key_mass_per_layer": [NUM_OR_NULL], "mean_first_key_mass": NUM_OR_NULL,
                       "layers_above_half": INT, "n_layers": INT},
    "confidence": {"?final_log_norm": (BINS, None)},
    "?router": ({"load": [[NUM_OR_NULL]]}, str),  # a dense FFN: a sentence saying why there is none
    "?compute_dial": ([DIAL_POINT], str, None),
    "?through_training": [MILESTONE],
}
EVAL = {"tasks": [{"accuracy": NUM, "centred": NUM, "examples": INT}]}
CACHE = {"run_dir": str, "checkpoint": str, "analysis_tokens": INT, "analysis": (ANALYSIS, None),
         "eval_items": INT, "eval": (EVAL, None)}


def _fits(value: Any, shape) -> Optional[str]:
    """None when `value` has `shape`, else where it does not ('.depth.norm_curve[3]: ...')."""
    if isinstance(shape, tuple):
        reasons = [_fits(value, s) for s in shape]
        return None if None in reasons else reasons[0]  # the first alternative's: the one a writer writes
    if shape is None:
        return None if value is None else f": expected null, got {shown(value, 60)}"
    if shape == ANY:
        return None
    if shape in (NUM, INT):
        ok = (isinstance(value, (int, float)) and not isinstance(value, bool)
              and (shape == NUM or isinstance(value, int)) and (not isinstance(value, float) or math.isfinite(value)))
        return None if ok else f": expected a {shape}, got {shown(value, 60)}"
    if isinstance(shape, type):
        return None if isinstance(value, shape) else f": expected {shape.__name__}, got {shown(value, 60)}"
    if isinstance(shape, list):
        if not isinstance(value, list):
            return f": expected a list, got {shown(value, 60)}"
        for i, item in enumerate(value):
            reason = _fits(item, shape[0])
            if reason is not None:
                return f"[{i}]{reason}"
        return None
    if not isinstance(value, dict):
        return f": expected an object, got {shown(value, 60)}"
    for key, field_shape in shape.items():
        name = key.lstrip("?")
        if name not in value:
            if key.startswith("?"):
                continue
            return f".{name}: missing"
        reason = _fits(value[name], field_shape)
        if reason is not None:
            return f".{name}{reason}"
    return None


def read_cache(path: str) -> Optional[dict]:
    """The cache at `path` checked against CACHE (None when there is none); a bad one is a UserError."""
    if not os.path.lexists(path):
        return None
    where = shown(path)
    cache = expect_object(read_json(path), where)
    reason = _fits(cache, CACHE)
    if reason is not None:
        raise UserError(f"{where}: not a report cache (field {reason.lstrip('.')})")
    return cache
