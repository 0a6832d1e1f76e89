"""What the trainer resolved to run, as run_info.json's `backends` and the start-up line: each sublayer class's
implementation, the residual stream's, MoD's, the compiled units, the loss, SDPA's kernels and the precision.
What the steps then actually ran is nagmoe/train/backends_ran.py."""
from __future__ import annotations

from typing import Optional

import torch

from nagmoe.train.speed import sdpa_backends


def resolved_backends(model) -> dict:
    """`<Class>.impl` / `<Class>.backend` of the model's sublayers (the first of each class), the residual
    stream's `impl` (model.nag.impl) and MoD's (model.mod.impl where the model lives: gather | static)."""
    out = {}
    for sub in model.sublayers():
        for attr in ("impl", "backend"):
            if hasattr(sub, attr):
                out.setdefault(f"{type(sub).__name__}.{attr}", getattr(sub, attr))
    stream = getattr(model, "stream", None)
    if hasattr(stream, "impl"):
        out[f"{type(stream).__name__}.impl"] = stream.impl
    calibrator = model.mod_calibrator() if hasattr(model, "mod_calibrator") else None
    if calibrator is not None:
        out["MoD.impl"] = calibrator.resolved_impl(calibrator.threshold.device)
    return out


def describe_backends(model, compiled: Optional[dict], device: torch.device, precision: str,
                      rules: Optional[str]) -> dict:
    """run_info.json's `backends`: `resolved_backends`, then the compiled units (`compiled`: what
    speed.compile_model returned, None when eager), the loss, SDPA's kernels where attention uses SDPA, and the
    precision (`train.precision`; TF32 on CUDA; `rules`: CUDA's autocast rules emulated on the CPU)."""
    backends = resolved_backends(model)
    backends["compile"] = (f"{compiled['unit']}s ({', '.join(compiled['classes'])}), {compiled['backend']}"
                           if compiled else "off")
    backends["loss"] = (f"{compiled['loss'] if compiled else 'eager'}, "
                        f"{'chunks recomputed' if model.loss_recompute else 'logits kept'}")
    if any(v in ("sdpa", "flash") for k, v in backends.items() if k.endswith("Attention.impl")):
        backends["sdpa"] = sdpa_backends(device.type)
    tf32 = device.type == "cuda" and torch.backends.cuda.matmul.allow_tf32
    backends["precision"] = precision + (", tf32" if tf32 else "")
    if rules:
        backends["precision"] += f", cpu bf16 autocast under CUDA's rules of torch {rules}"
    return backends
