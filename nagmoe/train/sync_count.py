"""Count the places a step forces a device-to-host synchronisation (issue 26), eagerly, on any device.

Two levels, each read counted once, at the call site in our code that caused it:
  * Python-level reads (a TorchFunctionMode): `Tensor.tolist`, `item`, `cpu`, `numpy`, `__bool__`, `__int__`,
    `__float__`, `__index__`, and `to(...)` the CPU from another device. On a CPU machine `tolist` and `cpu`
    dispatch nothing, so only this level sees them; on CUDA each one waits for the stream. Not counted: reads
    inside torch.optim (its non-capturable optimizers keep their `step` counters on the host by design) and
    `to(device)` between equal devices.
  * Synchronising host copies (issue 39): `to(...)` a device from a host tensor, unless the source is pinned and
    the copy `non_blocking` (nagmoe/data/host_copy.py): from pageable memory the host waits for the copy and
    the copy for the stream. Counted as "to-device". On a CPU-only machine a host-to-host copy is no copy.
  * aten ops whose output size or value the host must know (a TorchDispatchMode): `_local_scalar_dense`,
    `nonzero`, `bincount`, `_unique2`, `masked_select`, `repeat_interleave` without `output_size`, and
    boolean-mask `index` / `index_put_`. An op run inside a counted Python-level read is part of that read.
The call site is the innermost frame under nagmoe/ (else the innermost frame outside torch): "path:line op".
`SyncCounter.counts` maps site -> count; `total`, `by_file` summarise. Budgets live in the tests
(tests/train/test_sync_budget.py) and the tool (tools/bench/count_syncs.py).
"""
from __future__ import annotations

import collections
import os
import sys

import torch
from torch.overrides import TorchFunctionMode
from torch.utils._python_dispatch import TorchDispatchMode

_PY_READS = {"tolist", "item", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__"}
_ATEN_SYNCS = {"_local_scalar_dense", "nonzero", "bincount", "_unique2", "masked_select"}
_PACKAGE = os.path.dirname(os.path.dirname(os.path.abspath(__file__))) + os.sep
_REPO = os.path.dirname(_PACKAGE.rstrip(os.sep)) + os.sep
_SELF = os.path.abspath(__file__)


def _call_site() -> str:
    frame, fallback = sys._getframe(2), None
    while frame is not None:
        path = os.path.abspath(frame.f_code.co_filename)
        if path != _SELF:
            if path.startswith(_PACKAGE):
                return f"{os.path.relpath(path, _REPO)}:{frame.f_lineno}"
            if fallback is None and f"{os.sep}torch{os.sep}" not in path:
                fallback = f"{os.path.basename(path)}:{frame.f_lineno}"
        frame = frame.f_back
    return fallback or "?"


def _copy_ends(args, kwargs):
    """(source tensor, target device type) of a `t.to(...)` call; (None, None) when it names no device."""
    device = kwargs.get("device")
    for a in args[1:]:
        if isinstance(a, (str, torch.device)):
            device = a
    source = args[0] if args and isinstance(args[0], torch.Tensor) else None
    if device is None or source is None:
        return None, None
    return source, torch.device(device).type


def _to_cpu(args, kwargs) -> bool:
    """`t.to(...)` that copies a device tensor to the host."""
    source, target = _copy_ends(args, kwargs)
    return target == "cpu" and source.device.type != "cpu"


def _to_device_sync(args, kwargs) -> bool:
    """`t.to(...)` a non-CPU device from a host tensor that waits: a pageable source or a blocking copy."""
    source, target = _copy_ends(args, kwargs)
    if target in (None, "cpu") or source.device.type != "cpu":
        return False
    non_blocking = kwargs.get("non_blocking", any(a is True for a in args[1:]))
    return not (non_blocking and source.is_pinned())


def _in_torch_optim() -> bool:
    frame = sys._getframe(1)
    while frame is not None:
        if f"{os.sep}torch{os.sep}optim{os.sep}" in frame.f_code.co_filename:
            return True
        frame = frame.f_back
    return False


def _bool_index(indices) -> bool:
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices if i is not None)


def _aten_sync(func, args, kwargs) -> bool:
    name = func._schema.name.split("::")[-1]
    if name in _ATEN_SYNCS:
        return True
    if name == "repeat_interleave":
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    if name in ("index", "index_put", "index_put_", "_index_put_impl_"):
        return len(args) > 1 and _bool_index(args[1])
    return False


class _Functions(TorchFunctionMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        counted = name in _PY_READS or (name == "to" and _to_cpu(args, kwargs))
        if name == "to" and not counted and _to_device_sync(args, kwargs):
            counted, name = True, "to-device"
        if not counted or self.counter.inside:
            return func(*args, **kwargs)
        if not _in_torch_optim():  # the optimizer's host-side counters: neither this read nor its aten op
            self.counter.record(name)
        self.counter.inside += 1
        try:
            return func(*args, **kwargs)
        finally:
            self.counter.inside -= 1


class _Dispatch(TorchDispatchMode):
    def __init__(self, counter):
        super().__init__()
        self.counter = counter

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if not self.counter.inside and _aten_sync(func, args, kwargs):
            self.counter.record(func._schema.name.split("::")[-1])
        return func(*args, **kwargs)


class SyncCounter:
    """`with SyncCounter() as c: ...` then `c.counts` ({"nagmoe/model/moe.py:181 bincount": 2, ...})."""

    def __init__(self):
        self.counts: collections.Counter = collections.Counter()
        self.inside = 0
        self._modes = None

    def record(self, op: str) -> None:
        self.counts[f"{_call_site()} {op}"] += 1

    def __enter__(self):
        self._modes = (_Dispatch(self), _Functions(self))
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, *exc):
        for mode in reversed(self._modes):
            mode.__exit__(*exc)
        return False

    @property
    def total(self) -> int:
        return sum(self.counts.values())

    def by_file(self) -> dict:
        out = collections.Counter()
        for site, n in self.counts.items():
            out[site.split(":")[0]] += n
        return dict(out)

    def table(self) -> str:
        rows = sorted(self.counts.items(), key=lambda kv: (-kv[1], kv[0]))
        return "\n".join(f"{n:6d}  {site}" for site, n in rows) or "     0  (no sync)"


# ----------------------------------------------------------------------------------------------------------
# One micro-step of a config, and issue 26's budget for it
# ----------------------------------------------------------------------------------------------------------
def count_micro_step(cfg, device: str = "cpu", dtype: str = "bf16", batch_rows: int = 2, warm_steps: int = 2,
                     seed: int = 0, mesh=None):
    """(SyncCounter of one forward + backward, the model) for `cfg` on random tokens; with a `mesh` (expert
    parallelism, a process group already up) each rank keeps its experts and dispatches over the all-to-all."""
    from nagmoe.model import build_model

    torch.manual_seed(seed)
    model = build_model(cfg.model, device=device)
    if mesh is not None:
        from nagmoe.parallel.expert_parallel import shard_experts

        shard_experts(model, mesh)
    model.set_mod_seq_len(cfg.data.seq_len)
    model.set_injection_warmup(1.0)
    gen = torch.Generator().manual_seed(seed)
    autocast = torch.autocast(device_type=device, dtype=torch.bfloat16, enabled=dtype == "bf16")

    def batch():
        return torch.randint(0, cfg.model.vocab_size, (batch_rows, cfg.data.seq_len + 1), generator=gen).to(device)

    def step(idx):
        with autocast:
            out = model(idx[:, :-1], idx[:, 1:])
        (out.loss + out.aux_loss).backward()

    for _ in range(warm_steps):  # calibrate MoD's thresholds so the counted step skips
        step(batch())
        model.mod_update()
        model.zero_grad(set_to_none=True)
    idx = batch()
    with SyncCounter() as counter:
        step(idx)
    return counter, model


def mod_sublayers(model) -> int:
    """MoD-eligible sublayers (each reads once per forward whether it skips, and how many execute)."""
    cal = model.mod_calibrator()
    return 0 if cal is None or cal.skip_rate <= 0 else sum(cal.eligible_list)


def budget(model, ep: int = 1) -> int:
    """Issue 26's budget per micro-step with the grouped expert backend: 0 in attention, NAG, the dense path and
    MoE routing; 1 per MoD sublayer; under EP 1 more per MoE layer (the all-to-all split sizes). The `loop`
    expert backend reads its group sizes: 1 more per MoE layer (a separate budget, not this one)."""
    moe_layers = sum(1 for b in model.blocks if hasattr(b.ffn, "router"))
    return mod_sublayers(model) + (moe_layers if ep > 1 else 0)
