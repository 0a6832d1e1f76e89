"""Does the LM loss teach a top-1 router to pick the right expert? A behaviour probe for issue 22 (not a test:
its acceptance bound is not met yet; docs/decisions.md, "router gradient under NAG").

    python tools/probe_router_learning.py [--seeds 3] [--oracle-steps 300] [--router-steps 200] [--out probe.json]

Task: vocabulary 64 in 4 classes of 16 tokens; the next token is a class-specific permutation of the current
one. Phase 1 trains a 1-block MoE model (4 experts, top-1, balancing losses off) with the router replaced by an
oracle (class c -> expert c, gate probability ~0.95), so each expert becomes its class's specialist. Phase 2
re-initialises the router, freezes everything else and trains the router alone on the LM loss; routing accuracy
is the fraction of held-out tokens sent to their class's expert (chance 0.25). Variants: pre-norm, NAG with
model.moe.gate_grad=step_gain and NAG with gate_grad=none.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from nagmoe.config import AttentionConfig, ModelConfig, MoEConfig, NAGConfig  # noqa: E402
from nagmoe.model import build_model  # noqa: E402

VOCAB, EXPERTS = 64, 4
PER_CLASS = VOCAB // EXPERTS


def next_token_table(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    table = torch.empty(VOCAB, dtype=torch.long)
    for c in range(EXPERTS):
        table[c * PER_CLASS:(c + 1) * PER_CLASS] = c * PER_CLASS + torch.randperm(PER_CLASS, generator=gen)
    return table


def probe(residual: str, gate_grad: str, seed: int, oracle_steps: int, router_steps: int) -> dict:
    torch.manual_seed(seed)
    cfg = ModelConfig(residual=residual, vocab_size=VOCAB, d_model=16, n_layers=1, max_seq_len=16, ffn="moe",
                      attention=AttentionConfig(kind="mha", n_heads=2, impl="math"),
                      moe=MoEConfig(n_experts=EXPERTS, top_k=1, expert_hidden=32, impl="loop", lb_loss_weight=0.0,
                                    z_loss_weight=0.0, gate_grad=gate_grad),
                      nag=NAGConfig(C=EXPERTS, warmup_tokens=0))
    model = build_model(cfg)
    moe = model.blocks[0].ffn
    table, gen, classes = next_token_table(seed), torch.Generator().manual_seed(seed), {}

    def batch(rows=32, generator=gen):
        x = torch.randint(0, VOCAB, (rows, 16), generator=generator)
        return x, table[x]

    learned_router = moe.router.forward
    moe.router.forward = lambda x: 4.0 * F.one_hot(classes["c"].reshape(-1), EXPERTS).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(oracle_steps):
        x, y = batch()
        classes["c"] = x // PER_CLASS
        loss = model(x, y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    oracle_loss = float(loss.detach())

    moe.router.forward = learned_router
    bound = 3 ** 0.5 * cfg.d_model ** -0.5
    torch.nn.init.uniform_(moe.router.weight, -bound, bound)
    for p in model.parameters():
        p.requires_grad_(False)
    moe.router.weight.requires_grad_(True)
    opt = torch.optim.AdamW([moe.router.weight], lr=1e-2)
    routed = {}
    moe.router.register_forward_hook(lambda m, i, o: routed.__setitem__("expert", o.argmax(-1)))
    for _ in range(router_steps):
        x, y = batch()
        loss = model(x, y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    x, y = batch(64, torch.Generator().manual_seed(99))
    with torch.no_grad():
        held_out = float(model(x, y).loss)
    accuracy = float((routed["expert"].view(-1) == (x // PER_CLASS).view(-1)).float().mean())
    return {"oracle_loss": oracle_loss, "loss": held_out, "routing_accuracy": accuracy}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--seeds", type=int, default=3)
    ap.add_argument("--oracle-steps", type=int, default=300)
    ap.add_argument("--router-steps", type=int, default=200)
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    torch.set_num_threads(1)
    out = {"date": time.strftime("%Y-%m-%d")}
    for residual, gate_grad in (("prenorm", "step_gain"), ("nag", "step_gain"), ("nag", "none")):
        runs = [probe(residual, gate_grad, s, args.oracle_steps, args.router_steps) for s in range(args.seeds)]
        out[f"{residual}/{gate_grad}"] = runs
        print(f"{residual:8s} gate_grad={gate_grad:9s} " + "  ".join(
            f"acc {r['routing_accuracy']:.2f} loss {r['loss']:.3f}" for r in runs), flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
