"""Device placement check (issue 39): every tensor a training step creates is created where it is used.

On CUDA a factory call without `device=` makes a host tensor: used beside device tensors it is a silent
host-to-device copy (a 0-dim one is promoted as a scalar, a larger one crashes the op), and `torch.tensor(data,
device=cuda)` from Python data is a copy out of pageable host memory that waits for the stream. Neither shows on
a CPU machine, where every device is the host. The check sees the call itself, so it needs no second device:

    with PlacementCheck() as check:       # a TorchFunctionMode
        trainer.train_step()              # forward, backward (checkpoint recompute included), optimizer
    check.findings                        # Counter {(site, function, kind): calls}

Kinds:
  * "no device"  a factory (torch.tensor, arange, zeros, full, empty, randint, ...) called without `device=`
                 (the `*_like` and `Tensor.new_*` functions take their source's device and are fine);
  * "host data"  `torch.tensor` / `as_tensor` / `Tensor.new_tensor` of Python or NumPy data with a device:
                 a synchronising copy out of pageable memory on CUDA (`torch.full((), v, device=...)` is a fill).
Only calls made directly by code outside torch are checked (torch's own internals, e.g. a non-capturable
optimizer's host step counters, are torch's choice). The site is that caller: "path:line". `ALLOWED` lists
sites that create host tensors on purpose, each with its reason.
"""
from __future__ import annotations

import collections
import os
import sys

import torch
from torch.overrides import TorchFunctionMode

FACTORIES = frozenset({"tensor", "as_tensor", "scalar_tensor", "arange", "range", "linspace", "logspace", "zeros",
                       "ones", "full", "empty", "empty_strided", "eye", "rand", "randn", "randint", "randperm",
                       "tril_indices", "triu_indices", "from_numpy", "frombuffer"})
HOST_DATA = frozenset({"tensor", "as_tensor", "new_tensor"})
_TORCH_DIR = os.path.dirname(os.path.abspath(torch.__file__)) + os.sep
_SELF = os.path.abspath(__file__)
_REPO = os.path.dirname(os.path.dirname(os.path.dirname(_SELF))) + os.sep

# (path suffix of the calling file, function name): why a host tensor is right there
ALLOWED: dict[tuple[str, str], str] = {
    ("nagmoe/parallel/mesh.py", "tensor"): "`all_reduce` of Python floats: host values in, host values out",
    ("nagmoe/train/step_decisions.py", "tensor"): "the loop's exchange: host decisions (step, flags) shared by every "
                                                  "rank every train.sync_every steps and at metrics steps",
    ("nagmoe/parallel/distributed_muon.py", "tensor"): "the plan's fingerprint, compared once per new plan",
    ("nagmoe/cuda_rules/contracts.py", "tensor"): "the EP payload-dtype debug check (CUDA-rules runs only)",
}


def _caller():
    """The frame that called the torch function (this file's frames skipped)."""
    frame = sys._getframe(2)
    while frame is not None and os.path.abspath(frame.f_code.co_filename) == _SELF:
        frame = frame.f_back
    return frame


def _site(frame) -> str:
    path = os.path.abspath(frame.f_code.co_filename)
    shown = os.path.relpath(path, _REPO) if path.startswith(_REPO) else os.path.basename(path)
    return f"{shown}:{frame.f_lineno}"


def _kind(name: str, args, kwargs):
    if name in HOST_DATA:
        data = args[1] if name == "new_tensor" and len(args) > 1 else (args[0] if args else kwargs.get("data"))
        if name == "new_tensor" or kwargs.get("device") is not None:  # new_tensor: the source's device
            return None if isinstance(data, torch.Tensor) else "host data"
        if name == "as_tensor" and isinstance(data, torch.Tensor):
            return None  # no copy: the tensor stays where it is
        return "no device"
    if name in FACTORIES and kwargs.get("device") is None:
        return "no device"
    return None


class PlacementCheck(TorchFunctionMode):
    """`with PlacementCheck() as c: ...` then `c.findings` (module docstring), `allowed` sites (default ALLOWED)
    left out."""

    def __init__(self, allowed: dict | None = None):
        super().__init__()
        self.allowed = ALLOWED if allowed is None else allowed
        self.findings: collections.Counter = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in FACTORIES or name in HOST_DATA:
            kind = _kind(name, args, kwargs)
            frame = _caller() if kind else None
            if frame is not None and not os.path.abspath(frame.f_code.co_filename).startswith(_TORCH_DIR):
                path = os.path.abspath(frame.f_code.co_filename)
                if not any(path.endswith(suffix) and name == fn for suffix, fn in self.allowed):
                    self.findings[(_site(frame), name, kind)] += 1
        return func(*args, **kwargs)

    def report(self) -> str:
        return "\n".join(f"{site} torch.{name}: {kind} (x{n})" for (site, name, kind), n in sorted(self.findings.items()))
