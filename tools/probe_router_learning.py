"""Does the LM loss teach a top-1 router to pick the right expert? The behaviour probe of issue 22 as a command
(the task and both phases: nagmoe/analysis/routing_probe.py; the test: tests/model/test_router_learning.py).

    python tools/probe_router_learning.py [--seeds 3] [--oracle-steps 300] [--router-steps 100] [--out probe.json]

Variants: pre-norm, NAG with model.moe.gate_grad=step_gain (the default) and NAG with gate_grad=none (the
legacy form: the LM loss cannot reach a top-1 router under NAG); then pre-norm and NAG with the loss-free expert
bias at each γ of --bias-rates.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402

from nagmoe.analysis.routing_probe import CHANCE, probe  # noqa: E402


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--oracle-steps", type=int, default=300)
    ap.add_argument("--router-steps", type=int, default=100)
    ap.add_argument("--bias-rates", type=float, nargs="*", default=[1e-3, 1e-2],
                    help="γ of the loss-free expert bias variants (model.moe.expert_bias; none: no such variant)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {"date": time.strftime("%Y-%m-%d"), "chance": CHANCE}
    variants = [("prenorm", "step_gain", None), ("nag", "step_gain", None), ("nag", "none", None)]
    variants += [(residual, "step_gain", rate) for rate in args.bias_rates for residual in ("prenorm", "nag")]
    for residual, gate_grad, rate in variants:
        runs = [probe(residual, gate_grad, s, args.oracle_steps, args.router_steps, bias_update_rate=rate)
                for s in range(args.seeds)]
        name = f"{residual}/{gate_grad}" + ("" if rate is None else f"/bias {rate:g}")
        out[name] = runs
        print(f"{name:26s} " + "  ".join(
            f"acc {r['routing_accuracy']:.2f} loss {r['loss']:.3f}" for r in runs), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
