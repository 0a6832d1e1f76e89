"""Bytes one MoE layer saves for backward under CUDA's autocast rules (issue 38), before and after ReLU² became r·r.

    python tools/bench/bench_moe_saved_bytes.py [--tokens 2048] [--d-model 256] [--experts 8] [--top-k 2] [--hidden 512]

Distinct storages saved by autograd inside the layer (nagmoe.cuda_rules.contracts.SavedActivationCheck), one
forward on the CPU under `cuda_rules_autocast("2.11")`. "before" swaps the loop path's activation back to
`relu(h).square()` (the grouped path cannot run it: fp32 x bf16 `_grouped_mm` fails), so both columns use the
loop path; the grouped path's "after" is printed beside it. Prints one JSON line.
"""
from __future__ import annotations

import argparse
import json

import torch
import torch.nn.functional as F

import nagmoe.ops.grouped_experts as grouped_experts
from nagmoe.config import MoEConfig
from nagmoe.cuda_rules.contracts import SavedActivationCheck
from nagmoe.cuda_rules.tier import cuda_rules_autocast
from nagmoe.model.moe import MoELayer


def saved_bytes(impl: str, tokens: int, d: int, e: int, k: int, h: int) -> int:
    torch.manual_seed(0)
    layer = MoELayer(d, MoEConfig(n_experts=e, top_k=k, expert_hidden=h, impl=impl))
    x = torch.randn(1, tokens, d, requires_grad=True)
    check = SavedActivationCheck(layer, (MoELayer,))
    with cuda_rules_autocast("2.11"), check.active():
        layer(x)
    return check.saved_bytes[""]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", type=int, default=2048)
    ap.add_argument("--d-model", type=int, default=256)
    ap.add_argument("--experts", type=int, default=8)
    ap.add_argument("--top-k", type=int, default=2)
    ap.add_argument("--hidden", type=int, default=512)
    a = ap.parse_args()
    shape = (a.tokens, a.d_model, a.experts, a.top_k, a.hidden)
    after = {impl: saved_bytes(impl, *shape) for impl in ("grouped", "loop")}
    fixed = grouped_experts.relu_squared
    grouped_experts.relu_squared = lambda h: F.relu(h).square()  # the code before issue 38
    try:
        before = saved_bytes("loop", *shape)
    finally:
        grouped_experts.relu_squared = fixed
    slots = a.tokens * a.top_k
    print(json.dumps({"tokens": a.tokens, "d_model": a.d_model, "experts": a.experts, "top_k": a.top_k,
                      "hidden": a.hidden, "slots": slots, "before_loop_bytes": before,
                      "after_loop_bytes": after["loop"], "after_grouped_bytes": after["grouped"],
                      "saved_by_fix_bytes": before - after["loop"], "slots_x_hidden_x_4": slots * a.hidden * 4}))


if __name__ == "__main__":
    main()
