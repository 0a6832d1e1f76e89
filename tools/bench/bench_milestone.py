"""Bytes of a full checkpoint against a weights-only milestone (bf16, fp32) at r40 (issue 68, item 4).

    python tools/bench/bench_milestone.py [--layers 2] [--dir /tmp/x] [--out bench_milestone.json]

Measured: configs/paper/nag-mod20-r40.yaml at its real width, experts and vocabulary with `--layers` blocks (the
reduced r40 of the CI rehearsal, tests/parallel/test_rehearsal_r40.py), its optimizers built as the trainer builds
them (Muon for the matrices, AdamW for the rest), saved by `save_checkpoint` (model + optimizer state) and by
`save_milestone` (bf16, fp32), each one process, the bytes its manifest lists (+ the manifest). Predicted: the
same three from the tensors' bytes (each state-dict tensor's numel x element size; the optimizer's per role, per
element, read off the reduced model's own state), checked against the measurement, then at r40's 13 blocks from
the parameter and buffer shapes of the model built on the meta device (nothing materialised).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
from torch.distributed.checkpoint.state_dict import get_optimizer_state_dict  # noqa: E402

from nagmoe.checkpoint import save_checkpoint, save_milestone  # noqa: E402
from nagmoe.checkpoint.milestone import low_precision_keys, saved_bytes  # noqa: E402
from nagmoe.config import load_config  # noqa: E402
from nagmoe.model import build_model  # noqa: E402
from nagmoe.model.roles import param_roles  # noqa: E402
from nagmoe.train.optim import build_optimizers  # noqa: E402

CONFIG = os.path.join(os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))),
                      "configs", "paper", "nag-mod20-r40.yaml")


def tensor_bytes(t: torch.Tensor, dtype=None) -> int:
    return t.numel() * (torch.empty((), dtype=dtype or t.dtype).element_size())


def weights_bytes(model, dtype: str) -> int:
    """The model state's tensor bytes as a milestone of `dtype` (bf16 | fp32) stores them."""
    low = low_precision_keys(model) if dtype == "bf16" else set()
    return sum(tensor_bytes(t, torch.bfloat16 if k in low and t.is_floating_point() else None)
               for k, t in model.state_dict().items())


def optimizer_bytes_per_element(model, optim) -> dict:
    """{role: optimizer-state bytes per parameter element} of an optimizer whose state exists."""
    roles, numel = param_roles(model), dict((k, p.numel()) for k, p in model.named_parameters())
    state = get_optimizer_state_dict(model, list(optim))["state"]
    total, elements = {}, {}
    for name, per_param in state.items():
        role = roles[name]
        total[role] = total.get(role, 0) + sum(tensor_bytes(v) for v in per_param.values() if torch.is_tensor(v))
        elements[role] = elements.get(role, 0) + numel[name]
    return {role: total[role] / elements[role] for role in total}


def predicted(model, per_element: dict) -> dict:
    roles = param_roles(model)
    optim = sum(p.numel() * per_element[roles[k]] for k, p in model.named_parameters())
    fp32 = weights_bytes(model, "fp32")
    return {"full": int(fp32 + optim), "bf16": weights_bytes(model, "bf16"), "fp32": fp32}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--layers", type=int, default=2, help="blocks of the measured (reduced) r40")
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed after)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.manual_seed(0)
    cfg = load_config(CONFIG, [f"model.n_layers={args.layers}"])
    model = build_model(cfg.model)
    optim = build_optimizers(model, cfg.train)
    root = args.dir or tempfile.mkdtemp(prefix="bench_milestone_")
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
           "config": os.path.relpath(CONFIG), "measured_layers": args.layers}
    try:
        full = save_checkpoint(os.path.join(root, "full"), 1, model, optim)  # creates the optimizer's state
        measured = {"full": saved_bytes(full)}
        for dtype in ("bf16", "fp32"):
            measured[dtype] = saved_bytes(save_milestone(os.path.join(root, dtype), 1, model, {}, dtype))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    per_element = optimizer_bytes_per_element(model, optim)
    out["optimizer_bytes_per_element"] = per_element
    out["measured"], out["predicted_measured_size"] = measured, predicted(model, per_element)
    with torch.device("meta"):
        full_model = build_model(load_config(CONFIG).model)
    out["r40_layers"] = load_config(CONFIG).model.n_layers
    out["predicted_r40"] = r40 = predicted(full_model, per_element)
    out["ratio_measured"] = {k: measured[k] / measured["full"] for k in ("bf16", "fp32")}
    out["ratio_r40"] = {k: r40[k] / r40["full"] for k in ("bf16", "fp32")}
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
