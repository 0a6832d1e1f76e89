"""Kernel contracts of the CUDA fast paths, checked on the CPU (under the CUDA-rules tier, nagmoe/cuda_rules/tier.py).

- `KernelContracts`: a dispatch mode that sees every aten op after autocast has cast its inputs. `_grouped_mm`
  must get two operands of one low-precision dtype (CUDA's kernel and the meta kernel accept bf16 only): an
  fp32 x bf16 call fails on the GPU ("Expected inputs of BF16 type").
- `SavedActivationCheck`: `saved_tensors_hooks` around the MoE and attention sublayers. Nothing they save for
  backward may be an fp32 tensor larger than the carrier (the fp32 residual stream entering the sublayer,
  B x T x D): a bigger one is a cast that CUDA's rules made and the memory estimate did not plan for (pow's fp32
  copy of ReLU² was S x H = 4x the carrier). The router (fp32 by design, N x E) is allowed.
- `payload_dtypes_agree`: the debug check of expert parallelism (every rank ships the same dtype; an all-to-all
  sizes its buffers by each rank's own dtype, so a mismatch is garbage rows, not an error).
- Instruments for tests and byte benchmarks: `AllToAllPayloads` (what expert parallelism ships), `LargestRows`
  (the largest tensor of a given width an op makes).
"""
from __future__ import annotations

from contextlib import contextmanager
from typing import Optional

import torch
from torch import nn
from torch.utils._python_dispatch import TorchDispatchMode

LOW_PRECISION = (torch.bfloat16, torch.float16)


class KernelContracts(TorchDispatchMode):
    """Records `_grouped_mm` calls and every contract violation (`violations`, `grouped_mm_dtypes`)."""

    def __init__(self):
        super().__init__()
        self.violations: list[str] = []
        self.grouped_mm_dtypes: list[tuple[str, str]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func._schema.name == "aten::_grouped_mm":
            a, b = args[0], args[1]
            dtypes = (str(a.dtype).split(".")[-1], str(b.dtype).split(".")[-1])
            self.grouped_mm_dtypes.append(dtypes)
            if a.dtype != b.dtype or a.dtype not in LOW_PRECISION:
                self.violations.append(f"_grouped_mm got {dtypes[0]} x {dtypes[1]} (needs one low-precision dtype)")
        return func(*args, **(kwargs or {}))


def check_gmm_operands(a: torch.Tensor, b: torch.Tensor) -> None:
    """grouped_gemm.ops.gmm's contract (the megablocks path): both operands bf16."""
    if a.dtype != torch.bfloat16 or b.dtype != torch.bfloat16:
        raise RuntimeError(f"grouped_gemm got {a.dtype} x {b.dtype} (needs bf16 x bf16)")


class SavedActivationCheck:
    """Records fp32 tensors larger than the carrier that MoE / attention sublayers save for backward."""

    def __init__(self, model: nn.Module, sublayer_types: tuple, allow_types: tuple = ()):
        self.model, self.sublayer_types, self.allow_types = model, sublayer_types, allow_types
        self.violations: list[tuple[str, tuple]] = []
        self.saved_bytes: dict[str, int] = {}  # per sublayer: bytes of the distinct storages saved for backward
        self._stack: list[tuple[str, int]] = []  # (sublayer name, carrier numel)
        self._allowed = 0
        self._seen: set[int] = set()  # storages already counted (they stay alive while saved)

    def _pack(self, t: torch.Tensor):
        if self._stack and not self._allowed and not isinstance(t, nn.Parameter):
            name, carrier = self._stack[-1]
            storage = t.untyped_storage()
            if storage.data_ptr() not in self._seen:  # a tensor saved by two ops (r·r saves r twice) costs once
                self._seen.add(storage.data_ptr())
                self.saved_bytes[name] = self.saved_bytes.get(name, 0) + storage.nbytes()
            if t.dtype == torch.float32 and t.numel() > carrier:
                self.violations.append((name, tuple(t.shape)))
        return t

    @contextmanager
    def active(self):
        handles = []
        for name, mod in self.model.named_modules():
            if isinstance(mod, self.sublayer_types):
                handles.append(mod.register_forward_pre_hook(lambda m, args, name=name: self._enter(name, args)))
                handles.append(mod.register_forward_hook(lambda m, args, out: self._leave()))
            elif isinstance(mod, self.allow_types):
                handles.append(mod.register_forward_pre_hook(lambda m, args: self._enter_allowed()))
                handles.append(mod.register_forward_hook(lambda m, args, out: self._leave_allowed()))
        try:
            with torch.autograd.graph.saved_tensors_hooks(self._pack, lambda t: t):
                yield self
        finally:
            for h in handles:
                h.remove()

    def _enter(self, name: str, args) -> None:  # hooks return None: a returned value would replace the output
        self._stack.append((name, _carrier_numel(args)))

    def _leave(self) -> None:
        self._stack.pop()

    def _enter_allowed(self):
        self._allowed += 1

    def _leave_allowed(self):
        self._allowed -= 1


def _carrier_numel(args) -> int:
    """Elements of the sublayer's input: the stream tensor it reads (the largest floating input)."""
    sizes = [a.numel() for a in args if isinstance(a, torch.Tensor) and a.is_floating_point()]
    return max(sizes) if sizes else 0


def payload_dtypes_agree(payload: torch.Tensor, group: Optional[object] = None) -> None:
    """Debug check for expert parallelism: raise when the ranks of `group` would ship different dtypes."""
    import torch.distributed as dist

    codes = {torch.float32: 0, torch.bfloat16: 1, torch.float16: 2, torch.float64: 3}
    mine = torch.tensor([codes.get(payload.dtype, 9)], dtype=torch.int64, device=payload.device)
    lo, hi = mine.clone(), mine.clone()
    dist.all_reduce(lo, op=dist.ReduceOp.MIN, group=group)
    dist.all_reduce(hi, op=dist.ReduceOp.MAX, group=group)
    if int(lo) != int(hi):
        raise RuntimeError(f"expert-parallel all-to-all: ranks ship different dtypes (this rank {payload.dtype}); "
                           "the exchange would produce garbage rows")


class AllToAllPayloads(TorchDispatchMode):
    """Instrument: (dtype name, bytes) of every floating all-to-all payload, forward and backward, where it enters
    the functional collective: what the wire carries (tests, tools/bench/bench_ep_payload_bytes.py)."""

    def __init__(self):
        super().__init__()
        self.seen: list[tuple[str, int]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if "all_to_all" in func._schema.name and args[0].is_floating_point():
            self.seen.append((str(args[0].dtype).removeprefix("torch."), args[0].numel() * args[0].element_size()))
        return func(*args, **(kwargs or {}))


class LargestRows(TorchDispatchMode):
    """Instrument: the most rows (elements / width) of any op output whose last dimension is `width` (and whose
    dtype is `dtype`, when given), and every dtype produced: a slot copy in fp32, a (B, T, V) logits tensor."""

    def __init__(self, width: int, dtype: Optional[torch.dtype] = None):
        super().__init__()
        self.width, self.dtype, self.rows, self.dtypes = width, dtype, 0, set()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in (out if isinstance(out, (tuple, list)) else (out,)):
            if isinstance(t, torch.Tensor):
                self.dtypes.add(t.dtype)
                if t.dim() and t.shape[-1] == self.width and self.dtype in (None, t.dtype):
                    self.rows = max(self.rows, t.numel() // self.width)
        return out
