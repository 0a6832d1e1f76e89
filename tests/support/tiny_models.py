"""Tiny model configs and helpers shared by the model tests (kept small: d=32, 2 layers, vocab 64)."""
from __future__ import annotations

import torch

from nagmoe.config import AttentionConfig, ModelConfig, NAGConfig
from nagmoe.model import build_model


def tiny_config(residual: str = "nag", impl: str = "sdpa", **overrides) -> ModelConfig:
    attention = dict(n_heads=4, n_kv_heads=2, impl=impl)
    attention.update(overrides.pop("attention", {}))
    cfg = ModelConfig(residual=residual, vocab_size=64, d_model=32, n_layers=2, max_seq_len=32,
                      attention=AttentionConfig(**attention), nag=NAGConfig(C=4))
    for k, v in overrides.items():
        setattr(cfg, k, v)
    return cfg


def tiny_model(residual: str = "nag", impl: str = "sdpa", seed: int = 0, randomize: bool = True, **overrides):
    """A tiny model; `randomize` gives the zero-initialised output projections random weights, so that every
    sublayer actually moves the stream (at init they would contribute nothing)."""
    torch.manual_seed(seed)
    model = build_model(tiny_config(residual, impl, **overrides))
    if randomize:
        randomize_output_projections(model, seed)
    return model


@torch.no_grad()
def randomize_output_projections(model, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed + 1)
    for name, p in model.named_parameters():
        if name.endswith("c_proj.weight"):
            p.copy_(torch.randn(p.shape, generator=gen) * p.shape[1] ** -0.5)
