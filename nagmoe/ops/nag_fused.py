"""The NAG sublayer update and modulator behind a backend registry (op "nag_update", reference "eager").

Legend: B batch, T sequence, D model width, C modulator directions.

One NAG sublayer, around its branch F (nagmoe/model/residual.py):
    m_BT     = modulator(R_bar_BTD; W_CD, b_C, coef_C, beta_raw)        (in [0, 1])
    scale_BT = alpha · m_BT · warmup
    (s', R_bar') = nag_update(s_BT, R_bar_BTD, f_BTD, scale_BT)
Eager, this is ~20 small element-wise kernels over (B, T, D), each saving its output for the backward: the
~40% time and ~24% memory overhead of the unfused reimplementation. The fused backends compute exactly the
same functions (nagmoe/nag_math.py stays the oracle), as one region per call:

  eager     the functions of nagmoe/nag_math.py as they are: the reference and the test oracle.
  compiled  the same functions under `torch.compile` (inductor): CPU (C++/OpenMP) and CUDA (Triton). The
            forward and backward each become a few fused loops, and the min-cut partitioner saves only
            the inputs and per-token reductions for the backward instead of every (B, T, D) intermediate.
            Needs a C++ compiler on CPU; first call compiles (~10-20 s on CPU).

`auto` takes `compiled` where CUDA is visible and `eager` elsewhere: on the 2-core CPU machine the compile
time would dominate every short run and test, while the per-step saving there is small.

`gated_update` fuses the modulator with the update (one region) when the modulator is needed only for the
update; under MoD the modulator is needed before the branch runs, so `modulator` and `update` are two regions.
"""
from __future__ import annotations

import functools
import shutil

import torch

from nagmoe.errors import UserError
from nagmoe.nag_math import modulator as eager_modulator, nag_update as eager_nag_update
from nagmoe.ops.registry import Registry


def _compiler_present() -> bool:
    """torch.compile (inductor) needs a C++ compiler for CPU code; CUDA code goes through Triton."""
    return hasattr(torch, "compile") and (shutil.which("g++") is not None or shutil.which("c++") is not None
                                          or torch.cuda.is_available())


NAG_BACKENDS = Registry("nag_update", reference="eager")
NAG_BACKENDS.register("compiled", available=_compiler_present)
NAG_BACKENDS.register("eager")
_KNOWN = ("auto", "eager", "compiled")


def resolve_nag_backend(requested: str = "auto") -> str:
    """Backend name for `model.nag.impl` (see the module docstring for what `auto` picks)."""
    if requested not in _KNOWN:
        raise UserError(f"model.nag.impl: {requested!r} is not one of {', '.join(_KNOWN)}")
    if requested == "auto":
        return "compiled" if torch.cuda.is_available() and _compiler_present() else "eager"
    return NAG_BACKENDS.resolve(requested)


# ----------------------------------------------------------------------------------------------------------
# The functions each backend provides (same signatures for every backend)
# ----------------------------------------------------------------------------------------------------------
def _gated_update(log_norm_BT, direction_BTD, branch_BTD, weight_CD, bias_C, coef_C, beta_raw, alpha, warmup,
                  floor: float, eps: float, gate_scale_BT=None):
    """Modulator + scale + update in one function: returns (log_norm', direction', m_BT, scale_BT).
    `gate_scale_BT`: the MoE's S / stopgrad(S) (1 in the forward), multiplied into the step gain only."""
    m_BT = eager_modulator(direction_BTD, weight_CD, bias_C, coef_C, beta_raw, floor)
    scale_BT = alpha.float() * m_BT * warmup
    step_BT = scale_BT if gate_scale_BT is None else scale_BT * gate_scale_BT
    new_log_norm_BT, new_direction_BTD = eager_nag_update(log_norm_BT, direction_BTD, branch_BTD, step_BT, eps)
    return new_log_norm_BT, new_direction_BTD, m_BT, scale_BT


class NAGOps:
    """The three NAG functions of one backend: `modulator`, `update` (= nag_math.nag_update) and `gated_update`."""

    def __init__(self, backend: str):
        if backend not in ("eager", "compiled"):
            raise UserError(f"model.nag.impl: unknown backend {backend!r}")
        self.backend = backend  # compiled code is cached by torch on the functions' code: shared by instances
        if backend == "eager":
            self.modulator, self.update, self.gated_update = eager_modulator, eager_nag_update, _gated_update
        else:
            # dynamic=None: specialise on the first shape, go dynamic after a shape change (train vs eval)
            compile_ = functools.partial(torch.compile, dynamic=None, fullgraph=True)
            self.modulator = compile_(eager_modulator)
            self.update = compile_(eager_nag_update)
            self.gated_update = compile_(_gated_update)
