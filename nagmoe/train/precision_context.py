"""The Trainer's precision context, shared with the tools that must time or check the same computation.

    CUDA                         torch.autocast("cuda", bf16)
    CPU                          fp32, no autocast
    CPU + NAGMOE_CUDA_RULES=V    torch.autocast("cpu", bf16) under CUDA's autocast rules of torch V
                                 (nagmoe/cuda_rules/tier.py): a CPU run meets the dtypes a GPU run will meet.

The environment variable reaches every process a run starts (torchrun ranks, srun tasks, gpu_check sections).
`scope()` keeps the rules registered for a whole step (forward, backward with its activation-checkpoint
recompute, optimizer), `autocast()` is the forward's region; outside an autocast region the rules are inert.
"""
from __future__ import annotations

from contextlib import nullcontext
from typing import Optional

import torch

from nagmoe.cuda_rules.tier import ENV_VAR, CudaAutocastRules, rules_from_env


class TrainingPrecision:
    def __init__(self, device_type: str, environ=None):
        self.device_type = device_type
        rules = rules_from_env(environ)  # a bad value is a UserError (exit 2)
        self.rules: Optional[str] = rules if device_type == "cpu" else None  # on CUDA the real rules apply
        self._tier = CudaAutocastRules(rules) if self.rules else None

    @property
    def autocast_dtype(self) -> Optional[torch.dtype]:
        return torch.bfloat16 if self.device_type == "cuda" or self.rules else None

    def autocast(self):
        """The forward's autocast region (a fresh context manager per use)."""
        if self.device_type == "cuda":
            return torch.autocast("cuda", dtype=torch.bfloat16)
        if self.rules:
            return torch.autocast("cpu", dtype=torch.bfloat16)
        return nullcontext()

    def scope(self):
        """The rules' registration for a whole step; a no-op when already active or without rules."""
        if self._tier is None or self._tier.active:
            return nullcontext()
        return self._tier

    def describe(self) -> dict:
        """For run_info.json and bench.json."""
        if self.device_type == "cuda":
            return {"autocast": "cuda bf16", "cuda_rules": None}
        if self.rules:
            return {"autocast": "cpu bf16", "cuda_rules": self.rules, "env": f"{ENV_VAR}={self.rules}"}
        return {"autocast": "off (fp32)", "cuda_rules": None}


class _ReusableAutocast:
    """`with trainer.autocast:` works for every use (torch.autocast objects are not re-entrant)."""

    def __init__(self, precision: TrainingPrecision):
        self.precision, self._stack = precision, []

    def __enter__(self):
        ctx = self.precision.autocast()
        self._stack.append(ctx)
        return ctx.__enter__()

    def __exit__(self, *exc):
        return self._stack.pop().__exit__(*exc)


def reusable_autocast(precision: TrainingPrecision) -> _ReusableAutocast:
    return _ReusableAutocast(precision)
