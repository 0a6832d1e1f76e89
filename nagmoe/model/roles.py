"""Parameter roles: which optimizer group a parameter belongs to, decided by what it *is*, never by ndim.

A module declares roles for its own (non-recursive) parameters with a class attribute
`param_roles = {"local_name": ROLE}`; plain `nn.Linear` weights are "matrix", `nn.Embedding` weights
"embedding", `nn.Conv1d` weights/biases "conv". Anything else without a declared role is a schema bug and
raises, so a new parameter can never silently land in Muon.
"""
from __future__ import annotations

from torch import nn

MATRIX = "matrix"  # hidden linear / expert weight matrices -> Muon
EMBEDDING = "embedding"  # token embedding table -> AdamW
UNEMBEDDING = "unembedding"  # output head -> AdamW
GATE = "gate"  # NAG modulator directions/bias/coef, beta, alpha, MoD base vectors -> low-LR AdamW
ROUTER = "router"  # MoE router -> AdamW (never Muon)
CONV = "conv"  # convolution kernels (CCA) -> AdamW
SCALAR = "scalar"  # encode gain, norm weights, temperatures, biases -> AdamW
ROLES = (MATRIX, EMBEDDING, UNEMBEDDING, GATE, ROUTER, CONV, SCALAR)


def param_roles(model: nn.Module) -> dict[str, str]:
    roles: dict[str, str] = {}
    for mod_name, mod in model.named_modules():
        declared = getattr(mod, "param_roles", None) or {}
        for p_name, _ in mod.named_parameters(recurse=False):
            if p_name in declared:
                role = declared[p_name]
            elif isinstance(mod, nn.Linear) and p_name == "weight":
                role = MATRIX
            elif isinstance(mod, nn.Linear):
                role = SCALAR
            elif isinstance(mod, nn.Embedding):
                role = EMBEDDING
            elif isinstance(mod, nn.Conv1d):
                role = CONV
            else:
                raise ValueError(f"parameter {mod_name}.{p_name} of {type(mod).__name__} has no declared role")
            if role not in ROLES:
                raise ValueError(f"parameter {mod_name}.{p_name}: unknown role {role!r}")
            roles[f"{mod_name}.{p_name}" if mod_name else p_name] = role
    return roles
