"""The NAG sublayer update and modulator behind a backend registry (op "nag_update", reference "eager").

Legend: B batch, T sequence, D model width, C modulator directions.

One NAG sublayer, around its branch F (nagmoe/model/residual.py):
    m_BT     = modulator(R_bar_BTD; W_CD, b_C, coef_C, beta_raw)        (in [0, 1])
    scale_BT = alpha · m_BT · warmup
    (s', R_bar') = nag_update(s_BT, R_bar_BTD, f_BTD, scale_BT)
Eager, this is ~20 small element-wise kernels over (B, T, D), each saving its output for the backward: the
~40% time and ~24% memory overhead of the unfused reimplementation. The fused backends compute exactly the
same functions (nagmoe/ops/nag_math.py stays the oracle), as one region per call:

  eager     the functions of nagmoe/ops/nag_math.py as they are: the reference and the test oracle.
  compiled  the same functions under `torch.compile` (inductor): CPU (C++/OpenMP) and CUDA (Triton). The
            forward and backward each become a few fused loops, and the min-cut partitioner saves only
            the inputs and per-token reductions for the backward instead of every (B, T, D) intermediate.
            Needs a C++ compiler on CPU; first call compiles (~10-20 s on CPU).

`auto` takes `compiled` for CUDA tensors and `eager` for any other device, resolved per device from the
tensors a call gets (`NAGOps.backend_for`), not from whether the host has a GPU: a small CPU model on a GPU
host (a test, a checkpoint fixture, a CPU-side estimate) would otherwise pay a cold inductor C++ compile
(~50 s) and behave unlike the same code on a CPU machine; on CPU the compile would dominate every short run
while the per-step saving is small. Auto on CUDA without torch.compile falls back to eager with a warning.

Under an active TorchDispatchMode (an instrument: KernelContracts, SyncCounter, a dtype recorder) the
compiled regions run their eager functions: torch >= 2.12's dynamo skips every frame while a non-infra
dispatch mode is on the stack, and fullgraph=True turns that skip into "found no compiled frames". The
instrument then sees the eager ops, the same functions the compiled region fuses.

`gated_update` fuses the modulator with the update (one region) when the modulator is needed only for the
update; under MoD the modulator is needed before the branch runs, so `modulator` and `update` are two regions
(static MoD: `masked_update`, the base vector, the executed-row mask and the gate scale inside the update's region).
"""
from __future__ import annotations

import functools
import logging
import shutil
import warnings

import torch

from nagmoe.base.errors import UserError
from nagmoe.ops.nag_math import modulator as eager_modulator, nag_update as eager_nag_update
from nagmoe.ops.registry import Registry

log = logging.getLogger("nagmoe.backends")


def _compiler_present(device_type: str = "cpu") -> bool:
    """torch.compile (inductor) needs a C++ compiler for CPU code; CUDA code goes through Triton (shipped with
    CUDA builds of torch)."""
    if not hasattr(torch, "compile"):
        return False
    return device_type == "cuda" or shutil.which("g++") is not None or shutil.which("c++") is not None


NAG_BACKENDS = Registry("nag_update", reference="eager")
NAG_BACKENDS.register("compiled", available=lambda: _compiler_present("cuda" if torch.cuda.is_available()
                                                                        else "cpu"))
NAG_BACKENDS.register("eager")
_KNOWN = ("auto", "eager", "compiled")


def _check_known(requested: str) -> None:
    if requested not in _KNOWN:
        raise UserError(f"model.nag.impl: {requested!r} is not one of {', '.join(_KNOWN)}")


def resolve_nag_backend(requested: str = "auto", device="cpu") -> str:
    """Backend name for `model.nag.impl` and tensors on `device` (see the module docstring for what `auto`
    picks). A compiled backend that cannot run on the device falls back to eager with a warning."""
    _check_known(requested)
    device_type = torch.device(device).type
    if requested == "eager" or (requested == "auto" and device_type != "cuda"):
        return "eager"
    if _compiler_present(device_type):
        return "compiled"
    if requested == "compiled":
        warnings.warn(f"{NAG_BACKENDS.op}: backend 'compiled' is not available on {device_type}; using 'eager'",
                      stacklevel=2)
    else:  # auto on CUDA: eager there is the known-slow path (~20 unfused kernels per sublayer)
        warnings.warn(f"{NAG_BACKENDS.op}: only the slow backend 'eager' is available on cuda (no torch.compile)",
                      stacklevel=2)
    return "eager"


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


def _masked_update(log_norm_BT, direction_BTD, y_BTD, base_D, mask_BT, scale_BT, eps: float, gate_scale_BT=None):
    """Static MoD's update (model.mod.impl=static) in one function: f = X_l + F(R_bar) on the executed rows,
    f = X_l on the skipped ones (torch.where: a skipped row's value never enters, whatever it holds), the MoE's
    gate scale on the executed rows only, then the NAG update. Returns (log_norm', direction')."""
    base_D = base_D.to(y_BTD.dtype)
    f_BTD = torch.where(mask_BT.unsqueeze(-1), y_BTD + base_D, base_D)
    step_BT = scale_BT if gate_scale_BT is None else scale_BT * torch.where(mask_BT, gate_scale_BT, 1.0)
    return eager_nag_update(log_norm_BT, direction_BTD, f_BTD, step_BT, eps)


_EAGER = (eager_modulator, eager_nag_update, _gated_update, _masked_update)


def dispatch_mode_active() -> bool:
    """A TorchDispatchMode is active that dynamo will not trace under (torch >= 2.12 skips the frame; infra
    modes and modes that ignore compile internals do not count). Older torch: any mode on the stack."""
    from torch.utils import _python_dispatch

    check = getattr(_python_dispatch, "any_torch_dispatch_mode_on_stack", None)
    return check() if check is not None else torch._C._len_torch_dispatch_stack() > 0


def _region(eager_fn):
    """`eager_fn` as one fullgraph compiled region, run eagerly while a dispatch mode is active (module
    docstring). dynamic=None: specialise on the first shape, go dynamic after a shape change (train vs eval)."""
    compiled_fn = torch.compile(eager_fn, dynamic=None, fullgraph=True)

    @functools.wraps(eager_fn)
    def run(*args, **kwargs):
        if not torch.compiler.is_compiling() and dispatch_mode_active():
            return eager_fn(*args, **kwargs)
        return compiled_fn(*args, **kwargs)

    return run


@functools.lru_cache(maxsize=None)
def _compiled() -> tuple:
    """The compiled regions, made once: torch caches compiled code on the functions' code, shared by every
    NAGOps and device (CPU and CUDA graphs are separate entries under the device guards)."""
    return tuple(_region(fn) for fn in _EAGER)


class NAGOps:
    """The NAG functions of `model.nag.impl` (auto, eager, compiled): `modulator`, `update`
    (= nag_math.nag_update), `gated_update` and `masked_update` (static MoD). Each call takes the backend resolved
    for its tensors' device (the direction's), once per device type, logged on first use."""

    def __init__(self, requested: str = "auto"):
        _check_known(requested)
        self.requested = requested
        self._by_device: dict[str, tuple] = {}  # device type -> (backend, modulator, update, gated, masked)

    def _for(self, device) -> tuple:
        device_type = device.type if isinstance(device, torch.device) else torch.device(device).type
        entry = self._by_device.get(device_type)
        if entry is None:
            backend = resolve_nag_backend(self.requested, device_type)
            entry = (backend, *(_compiled() if backend == "compiled" else _EAGER))
            self._by_device[device_type] = entry
            log.info("nag_update: model.nag.impl=%s -> %s for %s tensors", self.requested, backend, device_type)
        return entry

    def backend_for(self, device) -> str:
        """The backend calls with tensors on `device` run (what the trainer reports as NAGResidual.impl)."""
        return self._for(device)[0]

    def modulator(self, direction_BTD, *args, **kwargs):
        return self._for(direction_BTD.device)[1](direction_BTD, *args, **kwargs)

    def update(self, log_norm_BT, direction_BTD, *args, **kwargs):
        return self._for(direction_BTD.device)[2](log_norm_BT, direction_BTD, *args, **kwargs)

    def gated_update(self, log_norm_BT, direction_BTD, *args, **kwargs):
        return self._for(direction_BTD.device)[3](log_norm_BT, direction_BTD, *args, **kwargs)

    def masked_update(self, log_norm_BT, direction_BTD, *args, **kwargs):
        return self._for(direction_BTD.device)[4](log_norm_BT, direction_BTD, *args, **kwargs)
