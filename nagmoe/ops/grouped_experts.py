"""Expert compute for the dropless MoE layer, behind a backend registry.

Every backend computes, for routing slots already sorted by expert,
    y_s = relu(x_s @ w_in[e(s)])² @ w_out[e(s)]          (ReLU² expert MLP, no biases)
where expert e owns the contiguous rows offs[e-1]:offs[e] (offs = cumsum(counts_E)). An expert with zero
slots is an empty group; it contributes nothing and receives a zero weight gradient.

Shape legend: S = routing slots sorted by expert (tokens x top_k), D = model width, H = expert hidden width,
E = number of experts.

Backends (op "moe_experts", reference "loop"; `auto` takes the first available in this order):
  grouped     `torch._grouped_mm(x[S,D], w[E,D,H], offs=int32 cumsum)`; torch >= 2.8. Runs bf16 everywhere and
              fp32 on CPU in eager mode, with row strides a multiple of 16 bytes (D and H multiples of 4 in
              fp32, of 8 in bf16). Other cases fall back to `loop` for that call, with a warning.
  loop        one matmul pair per non-empty expert: the reference and the test oracle (slow for many experts).
  megablocks  `grouped_gemm.ops.gmm` (the grouped GEMM that MegaBlocks' dMoE uses), only where it imports
              (CUDA builds); never chosen by `auto`, never on the critical install path.
"""
from __future__ import annotations

import importlib.util
import warnings

import torch

from nagmoe.base.errors import UserError
from nagmoe.ops.activations import relu_squared
from nagmoe.ops.registry import Registry


def _grouped_mm_present() -> bool:
    return hasattr(torch, "_grouped_mm")


def _grouped_gemm_importable() -> bool:
    return importlib.util.find_spec("grouped_gemm") is not None


_AVAILABLE = {"grouped": _grouped_mm_present, "loop": lambda: True, "megablocks": _grouped_gemm_importable}
EXPERT_BACKENDS = Registry("moe_experts", reference="loop")
EXPERT_BACKENDS.register("grouped", available=_grouped_mm_present)
EXPERT_BACKENDS.register("loop", slow=True)  # always available, so `auto` never reaches megablocks
EXPERT_BACKENDS.register("megablocks", available=_grouped_gemm_importable)


def resolve_expert_backend(requested: str = "auto") -> str:
    """Backend name for `model.moe.impl`. An unavailable explicit choice warns and falls back to what `auto`
    picks here (not blindly to the slow reference), e.g. megablocks -> grouped on a CPU machine."""
    if requested != "auto" and requested not in _AVAILABLE:
        raise UserError(f"model.moe.impl: {requested!r} is not one of auto, {', '.join(_AVAILABLE)}")
    return EXPERT_BACKENDS.resolve(requested)  # the registry warns and falls back like `auto`


# ----------------------------------------------------------------------------------------------------------
# loop (reference)
# ----------------------------------------------------------------------------------------------------------
def experts_loop(x_SD: torch.Tensor, w_in_EDH: torch.Tensor, w_out_EHD: torch.Tensor,
                 counts_E: torch.Tensor) -> torch.Tensor:
    outs = []
    start = 0
    for e, n in enumerate(counts_E.tolist()):
        if n == 0:
            continue
        h_nH = relu_squared(x_SD[start:start + n] @ w_in_EDH[e].to(x_SD.dtype))
        outs.append(h_nH @ w_out_EHD[e].to(x_SD.dtype))
        start += n
    if not outs:  # no slots at all (an empty micro-batch)
        return x_SD.new_zeros(0, w_out_EHD.shape[-1])
    return torch.cat(outs)


# ----------------------------------------------------------------------------------------------------------
# grouped (torch._grouped_mm)
# ----------------------------------------------------------------------------------------------------------
class _ContiguousGrad(torch.autograd.Function):
    """Identity whose backward makes the incoming gradient contiguous: `_grouped_mm`'s fp32 CPU backward
    rejects a stride-0 (expanded) gradient such as the one `y.sum().backward()` sends."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return grad.contiguous()


def grouped_mm_supports(dtype: torch.dtype, device_type: str, D: int, H: int) -> bool:
    """Whether `torch._grouped_mm` runs this case (see the module docstring)."""
    if not _grouped_mm_present():
        return False
    if dtype == torch.bfloat16:
        pass
    elif dtype == torch.float32:
        if device_type != "cpu" or torch.compiler.is_compiling():  # CUDA kernel and meta kernel: bf16 only
            return False
    else:
        return False
    align = 16 // dtype.itemsize
    return D % align == 0 and H % align == 0


def expert_compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype every expert backend computes and returns: the autocast dtype when autocast is on for x's device,
    else x's own. `_grouped_mm` is on no autocast list: followed by hand so grouped and loop agree under it; the
    dispatch casts to it before the slots are copied and shipped (nagmoe/model/moe.py, expert parallelism)."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


def expert_path(backend: str, x_SD: torch.Tensor, w_in_EDH: torch.Tensor) -> str:
    """What `EXPERT_FORWARD[backend]` will run for this call: the backend, or `loop (fallback: why)` — the one
    decision the backends themselves take (python only: no host read). Recorded in run_info.json after step 1."""
    dtype, device = expert_compute_dtype(x_SD), x_SD.device.type
    if backend == "grouped" and not grouped_mm_supports(dtype, device, w_in_EDH.shape[1], w_in_EDH.shape[2]):
        return (f"loop (fallback: _grouped_mm cannot run {str(dtype).split('.')[-1]} on {device}"
                f"{' compiled' if torch.compiler.is_compiling() else ''} with D={w_in_EDH.shape[1]}, "
                f"H={w_in_EDH.shape[2]})")
    if backend == "megablocks" and (device != "cuda" or dtype != torch.bfloat16):
        return f"loop (fallback: grouped_gemm needs bf16 on cuda, got {str(dtype).split('.')[-1]} on {device})"
    return backend


def experts_grouped(x_SD: torch.Tensor, w_in_EDH: torch.Tensor, w_out_EHD: torch.Tensor,
                    counts_E: torch.Tensor) -> torch.Tensor:
    dtype = expert_compute_dtype(x_SD)
    D, H = w_in_EDH.shape[1], w_in_EDH.shape[2]
    if expert_path("grouped", x_SD, w_in_EDH) != "grouped":
        warnings.warn(f"moe_experts: torch._grouped_mm cannot run {dtype} on {x_SD.device.type} with D={D}, "
                      f"H={H} (needs bf16, or fp32 on CPU in eager mode, and 16-byte row strides); "
                      f"using the slow loop", stacklevel=2)
        return experts_loop(x_SD, w_in_EDH, w_out_EHD, counts_E)
    offs_E = torch.cumsum(counts_E, 0).to(torch.int32)
    x_SD = x_SD.to(dtype).contiguous()
    # the weights' `.to(dtype)`: a no-op when MoELayer passes its cached casts (nagmoe/ops/cast_cache.py); a cast
    # per call for other callers (the expert-parallel dispatcher's local slices)
    h_SH = _ContiguousGrad.apply(torch._grouped_mm(x_SD, w_in_EDH.to(dtype), offs=offs_E))
    a_SH = relu_squared(h_SH)
    return _ContiguousGrad.apply(torch._grouped_mm(a_SH, w_out_EHD.to(dtype), offs=offs_E))


# ----------------------------------------------------------------------------------------------------------
# megablocks (grouped_gemm), optional
# ----------------------------------------------------------------------------------------------------------
def experts_megablocks(x_SD: torch.Tensor, w_in_EDH: torch.Tensor, w_out_EHD: torch.Tensor,
                       counts_E: torch.Tensor) -> torch.Tensor:
    from grouped_gemm import ops as gg_ops  # lazy: a CUDA-only extension

    dtype = expert_compute_dtype(x_SD)
    if expert_path("megablocks", x_SD, w_in_EDH) != "megablocks":
        warnings.warn("moe_experts: grouped_gemm needs bf16 on CUDA; using the slow loop", stacklevel=2)
        return experts_loop(x_SD, w_in_EDH, w_out_EHD, counts_E)
    return grouped_gemm_experts(gg_ops.gmm, x_SD.to(dtype), w_in_EDH.to(dtype), w_out_EHD.to(dtype), counts_E)


def grouped_gemm_experts(gmm, x_SD: torch.Tensor, w_in_EDH: torch.Tensor, w_out_EHD: torch.Tensor,
                         counts_E: torch.Tensor) -> torch.Tensor:
    """The megablocks path's two grouped GEMMs; `gmm` is `grouped_gemm.ops.gmm` (bf16 operands only, host-side
    group sizes). Separate from the import so its dtype contract is checked on the CPU (tests/cuda_rules)."""
    batch_sizes_E = counts_E.to("cpu", torch.int64)
    h_SH = gmm(x_SD.contiguous(), w_in_EDH, batch_sizes_E, trans_b=False)
    return gmm(relu_squared(h_SH), w_out_EHD, batch_sizes_E, trans_b=False)


EXPERT_FORWARD = {"grouped": experts_grouped, "loop": experts_loop, "megablocks": experts_megablocks}
