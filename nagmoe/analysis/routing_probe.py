"""Does the LM loss teach a top-1 router to pick the expert that helps? A behaviour probe (issue 22), used by
`tools/probe_router_learning.py` and by tests/model/test_router_learning.py.

Task: a vocabulary of 64 tokens in 4 classes of 16; the next token is, with probability 1/2, a class-specific
permutation of the current token, otherwise a uniform token of the same class (so the best loss is ~1.96 nats,
not ~0, and a loss ratio means something). Only an expert that learned its class's permutation reaches it.

Phase 1 trains a 1-block MoE model (4 experts, top-1, balancing losses off) with the router replaced by an
oracle (class c -> expert c, gate probability ~0.95), so expert c becomes class c's specialist. Phase 2
re-initialises the router, freezes everything else and trains the router alone on the LM loss. Routing
accuracy is the fraction of held-out tokens sent to their class's expert (chance 1/4).

Width 64: the router is linear, and 64 token embeddings in 4 random classes are linearly separable only when
the width is near the vocabulary (at width 16 no residual gets past ~0.65: the probe would measure the
router's capacity, not the gradient that trains it).
"""
from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

from nagmoe.model import build_model
from nagmoe.config.schema import AttentionConfig, ModelConfig, MoEConfig, NAGConfig

VOCAB, EXPERTS, SEQ = 64, 4, 16
PER_CLASS = VOCAB // EXPERTS
CHANCE = 1.0 / EXPERTS


def _next_token_table(seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(1000 + seed)
    table = torch.empty(VOCAB, dtype=torch.long)
    for c in range(EXPERTS):
        table[c * PER_CLASS:(c + 1) * PER_CLASS] = c * PER_CLASS + torch.randperm(PER_CLASS, generator=gen)
    return table


def _batch(table: torch.Tensor, gen: torch.Generator, rows: int = 32):
    x = torch.randint(0, VOCAB, (rows, SEQ), generator=gen)
    same_class = (x // PER_CLASS) * PER_CLASS + torch.randint(0, PER_CLASS, x.shape, generator=gen)
    y = torch.where(torch.rand(x.shape, generator=gen) < 0.5, table[x], same_class)
    return x, y


def probe_config(residual: str, gate_grad: str, bias_update_rate: Optional[float] = None) -> ModelConfig:
    """`bias_update_rate`: None = no expert bias; else model.moe.expert_bias on at that γ."""
    return ModelConfig(residual=residual, vocab_size=VOCAB, d_model=64, n_layers=1, max_seq_len=SEQ, ffn="moe",
                       attention=AttentionConfig(kind="mha", n_heads=2, impl="math"),
                       moe=MoEConfig(n_experts=EXPERTS, top_k=1, expert_hidden=64, impl="loop", lb_loss_weight=0.0,
                                     z_loss_weight=0.0, gate_grad=gate_grad,
                                     expert_bias=bias_update_rate is not None,
                                     bias_update_rate=bias_update_rate or 0.0),
                       nag=NAGConfig(C=EXPERTS, warmup_tokens=0))


def probe(residual: str, gate_grad: str, seed: int, oracle_steps: int = 300, router_steps: int = 200,
          bias_update_rate: Optional[float] = None) -> dict:
    """Run both phases for one seed; returns the held-out loss and routing accuracy after phase 2. With
    `bias_update_rate` the loss-free expert bias (model.moe.expert_bias) routes too: zero through the oracle
    phase, then updated once per phase-2 step from that step's routing counts, as the trainer does."""
    torch.manual_seed(seed)
    cfg = probe_config(residual, gate_grad, bias_update_rate)
    model = build_model(cfg)
    router = model.blocks[0].ffn.router
    table, gen = _next_token_table(seed), torch.Generator().manual_seed(seed)

    oracle_class = {}
    learned_forward = router.forward
    router.forward = lambda x_ND: 4.0 * F.one_hot(oracle_class["c"].reshape(-1), EXPERTS).float()
    opt = torch.optim.AdamW(model.parameters(), lr=1e-2)
    for _ in range(oracle_steps):
        x, y = _batch(table, gen)
        oracle_class["c"] = x // PER_CLASS
        loss = model(x, y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
    oracle_loss = float(loss.detach())

    router.forward = learned_forward
    bound = 3 ** 0.5 * cfg.d_model ** -0.5
    torch.nn.init.uniform_(router.weight, -bound, bound)
    for p in model.parameters():
        p.requires_grad_(False)
    router.weight.requires_grad_(True)
    opt = torch.optim.AdamW([router.weight], lr=1e-2)
    layer = model.blocks[0].ffn
    for _ in range(router_steps):
        x, y = _batch(table, gen)
        loss = model(x, y).loss
        opt.zero_grad()
        loss.backward()
        opt.step()
        if bias_update_rate is not None:
            model.update_expert_bias(layer.last_stats["tokens_per_expert"].view(1, -1))

    x, y = _batch(table, torch.Generator().manual_seed(99), rows=64)
    routed = {}
    # the chosen expert: the layer's own top-1 choice (of the probabilities, plus b with the bias)
    hook = router.register_forward_hook(
        lambda m, i, o: routed.__setitem__("expert", layer.select_experts(o.float().softmax(-1))[:, 0]))
    with torch.no_grad():
        held_out = float(model(x, y).loss)
    hook.remove()
    accuracy = float((routed["expert"].view(-1) == (x // PER_CLASS).view(-1)).float().mean())
    return {"oracle_loss": oracle_loss, "loss": held_out, "routing_accuracy": accuracy}
