"""CUDA's autocast rules on the CPU: Python kernels on the `AutocastCPU` dispatch key that apply CUDA's policy.

CPU and CUDA autocast do not cast the same ops (nagmoe/cuda_rules/table.py): `pow` (hence `square`) is fp32 on
CUDA and untouched on CPU; `sum` is fp32 on CUDA; CPU casts `cat`, `stack`, `index_copy`, linalg ops that CUDA
leaves alone. So a CPU test under `torch.autocast("cpu")` cannot see the dtypes a GPU run will meet.

`CudaAutocastRules(version)` is a context manager that, while active, replaces the AutocastCPU kernel of every
op in the version's table by a kernel applying CUDA's policy, and the AutocastCPU kernel of every op that only
CPU autocast casts by a fall-through (as if it were not registered). Each policy kernel excludes the
AutocastCPU key for the call it makes (as CUDA's wrappers exclude AutocastCUDA), while a composite op falls
through to its parts (square -> pow, cross_entropy -> log_softmax + nll_loss), so every op meets the rules
exactly where CUDA's dispatcher would, including under activation-checkpoint recompute and
`torch.compile` (AOT tracing dispatches through the same key). Registrations live in one
`torch.library.Library` that is destroyed on exit, which restores the previous kernels. The kernels act only
while CPU autocast is on (the key is in the thread's dispatch set only then): run the code under
`torch.autocast("cpu", dtype=torch.bfloat16)` inside the context, or use `cuda_rules_autocast`.
"""
from __future__ import annotations

import contextlib
import os
import warnings
from typing import Optional

import torch

from nagmoe.cuda_rules.table import (APPEND_DTYPE_OVERLOAD, BANNED, FP32, FP32_APP, FP32_OPT, LOWER, PROMOTE,
                                     rules_for, version_key)
from nagmoe.base.errors import UserError

ENV_VAR = "NAGMOE_CUDA_RULES"  # a torch version ("2.11"): the Trainer and tools run under CPU bf16 + these rules
_AUTOCAST_CPU = torch._C.DispatchKeySet(torch._C.DispatchKey.AutocastCPU)


def _overload(name: str) -> torch._ops.OpOverload:
    base, _, overload = name.partition(".")
    return getattr(getattr(torch.ops.aten, base), overload or "default")


def _eligible(t) -> bool:
    """CUDA's `is_eligible`: a floating tensor on the autocast device that is not fp64."""
    return isinstance(t, torch.Tensor) and t.is_floating_point() and t.dtype != torch.float64 and \
        t.device.type == "cpu"


def _cast(value, dtype: torch.dtype):
    if _eligible(value):
        return value if value.dtype == dtype else value.to(dtype)
    if isinstance(value, (list, tuple)):
        return type(value)(_cast(v, dtype) for v in value)
    return value


def _tensors(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, (list, tuple)):
            yield from _tensors(v)


def _promoted(lower: torch.dtype, args, kwargs) -> torch.dtype:
    """CUDA's `promote_type`: the widest floating dtype among the eligible args, fp32 over the lower dtype."""
    current = lower
    for t in _tensors(list(args) + list(kwargs.values())):
        if not _eligible(t) or t.dtype == current:
            continue
        if current == torch.float32 or t.dtype == torch.float32:
            current = torch.float32
        else:
            raise RuntimeError(f"autocast promote: mixed lower-precision dtypes {current} and {t.dtype}")
    return current


def _make_kernel(name: str, policy: str):
    op = _overload(name)
    dtype_index = next((i for i, a in enumerate(op._schema.arguments) if a.name == "dtype"), None)
    append_op = _overload(APPEND_DTYPE_OVERLOAD[name]) if policy == FP32_APP else None
    positional = [a for a in op._schema.arguments if not a.kwarg_only]

    def with_defaults(args: tuple) -> tuple:
        # the dtype overload takes every positional argument (norm.Scalar's p defaults to 2 but is required there)
        return args + tuple(a.default_value for a in positional[len(args):])

    def kernel(*args, **kwargs):
        with torch._C._ExcludeDispatchKeyGuard(_AUTOCAST_CPU):
            first_eligible = bool(args) and _eligible(args[0])
            if policy == LOWER:
                low = torch.get_autocast_dtype("cpu")
                return op(*_cast(args, low), **{k: _cast(v, low) for k, v in kwargs.items()})
            if policy == FP32:
                return op(*_cast(args, torch.float32), **{k: _cast(v, torch.float32) for k, v in kwargs.items()})
            if policy == FP32_OPT:
                if first_eligible:
                    if dtype_index is not None and dtype_index < len(args):
                        if args[dtype_index] is None:
                            args = args[:dtype_index] + (torch.float32,) + args[dtype_index + 1:]
                    elif kwargs.get("dtype") is None:
                        kwargs = {**kwargs, "dtype": torch.float32}
                return op(*args, **kwargs)
            if policy == FP32_APP:
                return (append_op(*with_defaults(args), **kwargs, dtype=torch.float32) if first_eligible
                        else op(*args, **kwargs))
            if policy == PROMOTE:
                to = _promoted(torch.get_autocast_dtype("cpu"), args, kwargs)
                return op(*_cast(args, to), **{k: _cast(v, to) for k, v in kwargs.items()})
            if policy == BANNED:
                raise RuntimeError(f"aten::{name} is banned under CUDA autocast (unsafe in low precision); "
                                   "use the *_with_logits form")
            raise AssertionError(policy)

    return kernel


def cpu_only_autocast_ops(table: dict[str, str]) -> list[str]:
    """Ops that CPU autocast casts and CUDA's table does not: their CPU casts are switched off."""
    cpu = torch._C._dispatch_get_registrations_for_dispatch_key("AutocastCPU")
    return sorted(n.split("::", 1)[1] for n in cpu if n.startswith("aten::") and n.split("::", 1)[1] not in table)


class CudaAutocastRules:
    """While active, CPU autocast applies CUDA's rules of torch `version` (module docstring)."""

    def __init__(self, version: str):
        self.version = version_key(version)
        self.table = rules_for(version)
        self._lib: Optional[torch.library.Library] = None

    @property
    def active(self) -> bool:
        return self._lib is not None

    def __enter__(self) -> "CudaAutocastRules":
        if self._lib is not None:
            raise RuntimeError("CudaAutocastRules is already active")
        lib = torch.library.Library("aten", "IMPL")
        try:
            with warnings.catch_warnings():  # "overriding a previously registered kernel": that is the point
                warnings.simplefilter("ignore")
                for name, policy in self.table.items():
                    if hasattr(getattr(torch.ops.aten, name.partition(".")[0], None) or object(),
                               name.partition(".")[2] or "default"):
                        lib.impl(name, _make_kernel(name, policy), "AutocastCPU")
                for name in cpu_only_autocast_ops(self.table):
                    lib.impl(name, torch.library.fallthrough_kernel, "AutocastCPU")  # as if not registered
        except BaseException:
            lib._destroy()
            raise
        self._lib = lib
        return self

    def __exit__(self, *exc) -> None:
        lib, self._lib = self._lib, None
        if lib is not None:
            lib._destroy()

    def describe(self) -> str:
        return f"cuda-autocast-rules torch {self.version} on cpu (bf16)"


@contextlib.contextmanager
def cuda_rules_autocast(version: str, dtype: torch.dtype = torch.bfloat16):
    """`torch.autocast("cpu", dtype)` under CUDA's rules of torch `version`: the CPU stand-in for
    `torch.autocast("cuda", dtype)`."""
    with CudaAutocastRules(version), torch.autocast("cpu", dtype=dtype):
        yield


def rules_from_env(environ=None) -> Optional[str]:
    """The torch version named by NAGMOE_CUDA_RULES (None when unset/empty); a bad value is a UserError."""
    value = (environ if environ is not None else os.environ).get(ENV_VAR, "").strip()
    if not value:
        return None
    if value == "installed":
        value = torch.__version__
    try:
        rules_for(value)
    except UserError as e:
        raise UserError(f"{ENV_VAR}: {e}") from None
    return version_key(value)
