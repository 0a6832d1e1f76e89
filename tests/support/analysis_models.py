"""Tiny real models and token batches for the analysis tests (d=32, 2 blocks, vocab 64, 16 positions)."""
from __future__ import annotations

import torch

from nagmoe.config import AttentionConfig, ModelConfig, MoDConfig, MoEConfig, NAGConfig
from nagmoe.model import build_model

VOCAB, BOS, SEQ = 64, 0, 16


def tiny_model(residual: str = "nag", attention: str = "mha", ffn: str = "dense", seed: int = 0,
               mod: MoDConfig = None):
    """A freshly initialised model: its output projections are zero, so no sublayer writes anything (MoD's base
    vectors aside, when `mod` skips)."""
    torch.manual_seed(seed)
    attn = dict(kind=attention, n_heads=4, impl="math")
    if attention == "cca":
        attn.update(q_compression=2, kv_compression=2)
    else:
        attn.update(n_kv_heads=2)
    cfg = ModelConfig(residual=residual, vocab_size=VOCAB, d_model=32, n_layers=2, max_seq_len=SEQ, ffn=ffn,
                      attention=AttentionConfig(**attn), moe=MoEConfig(n_experts=4, top_k=2, expert_hidden=32),
                      nag=NAGConfig(C=4), mod=mod or MoDConfig())
    return build_model(cfg).eval()


@torch.no_grad()
def randomize_outputs(model, seed: int = 1) -> None:
    """Give the zero-initialised output projections random weights, so every sublayer writes something."""
    gen = torch.Generator().manual_seed(seed)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight") or name.endswith("w_out"):
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[-1] ** -0.5)


def token_batches(n_batches: int = 2, rows: int = 3, seed: int = 0) -> list:
    """(x_BT, y_BT) pairs of random tokens whose windows start with BOS (as the analysis' windows do)."""
    gen = torch.Generator().manual_seed(seed)
    out = []
    for _ in range(n_batches):
        ids = torch.randint(1, VOCAB, (rows, SEQ + 1), generator=gen)
        ids[:, 0] = BOS
        out.append((ids[:, :-1].contiguous(), ids[:, 1:].contiguous()))
    return out
