"""Speed and memory options of the training step: `train.compile` and `train.activation_checkpointing`.

compile: `model.compile()` compiles the module's forward in place (parameter names, hence checkpoints, are
    unchanged; DDP wraps the same module). Graph breaks, by design, where the step is data-dependent:
      - MoE dispatch: the per-expert token counts go to the host (`counts_E.tolist()` in the loop backend,
        the grouped offsets are on-device but the capacity-free shapes are data-dependent);
      - MoD: the number of executed tokens per sublayer decides the gathered shapes (`select`);
      - the inference cache (generation only).
    Everything between those (attention, the NAG update and modulator, the dense MLP, the decode) compiles
    into fused regions. The NAG update is also fused on its own by `model.nag.impl=compiled`.
activation checkpointing: every sublayer (attention, MLP/MoE) runs under non-reentrant
    `torch.utils.checkpoint` while training: its activations are recomputed in the backward instead of being
    kept, so the memory of a deep model is the stream (two lanes per sublayer) plus one sublayer's
    activations. The NAG update itself is not recomputed (its saved inputs are the stream lanes). Sublayers
    are deterministic given their input (the RNG state is restored for the recompute), and their
    bookkeeping (`last_stats`) is overwritten with the same values, so results equal the plain step.
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint


def _checkpointed_forward(module: torch.nn.Module, forward, *args, **kwargs):
    if module.training and torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)  # eval, no_grad and decoding: nothing to save


def enable_activation_checkpointing(model) -> int:
    """Wrap the forward of every sublayer of `model` (a Transformer) in activation checkpointing; returns the
    number of sublayers wrapped. Idempotent. The wrapper is an instance attribute: no parameter is renamed."""
    wrapped = 0
    for sublayer in model.sublayers():
        if getattr(sublayer, "_checkpointed", False):
            continue
        sublayer.forward = functools.partial(_checkpointed_forward, sublayer, sublayer.forward)
        sublayer._checkpointed = True
        wrapped += 1
    return wrapped


def compile_model(model) -> None:
    """Compile the model's forward in place (see the module docstring for the graph breaks)."""
    model.compile(dynamic=None)
