"""A parameter's compute-dtype copy made once per weight write, not once per use (the MoE's expert stacks).

Under autocast bf16 the experts run `w.to(bf16)` on their fp32 stacks every micro-step, and again in an
activation-checkpoint recompute, although the weights change only at the optimizer step. `WeightCastCache`
keeps the cast per parameter, keyed by what a write changes:

    key = (parameter identity, w._version, w.data_ptr(), device, dtype)

`_version` is bumped by every in-place write through the parameter or a view of it (Muon's `add_`,
`load_state_dict`'s `copy_`, an in-place init; `keep_experts`' new Parameter changes the identity); a storage
swap changes `data_ptr`. Writes it does not see, and how the cache still follows them:
  - torch's fused AdamW kernel (`fused=True`, the device-guarded step) writes without bumping `_version`: an
    entry also expires when a gradient has gone to the parameter since the cast and its `.grad` is None again,
    i.e. `zero_grad(set_to_none=True)` after the optimizer step (the trainer's order; a zero_grad that keeps
    the tensors would not be seen). Accumulating micro-steps keep `.grad` set and reuse the cast; a checkpoint
    recompute runs before its gradient is sent.
  - a write through `.data` or another tensor on the same storage: nothing in nagmoe writes a parameter so, but
    an engine that flattens parameters into one buffer and writes the buffer does (DeepSpeed ZeRO-1/2's groups,
    FSDP's flat parameters): a parameter that does not own its whole storage is never cached.

Gradients still reach the fp32 parameter on every micro-step: `_CastFrom` returns the cached copy in the
forward and casts the gradient to the parameter's dtype in the backward, which is what `.to`'s own backward
does (`_to_copy`'s backward is a cast of the gradient), so the values are those of the uncached path.

The cache is a plain attribute of the module: not a parameter or buffer, not in the state_dict, dropped by
copy/pickle. Inside a torch.compile trace `get` is not consulted (its dict and `_version` reads would be guarded
on or break the graph): the casts are made before the compiled unit, by the module's forward pre-hook, and
handed in as graph inputs (`stage` outside, `staged` inside; dynamo guards their dtype and shape, not their
identity, so a new copy after an optimizer step does not recompile). Without a staged copy the graph casts.
"""
from __future__ import annotations

import weakref

import torch


class _CastFrom(torch.autograd.Function):
    """Forward: the given cast of `w` (no op); backward: the gradient cast to w's dtype, as `w.to`'s backward,
    and the cache entry marked: a gradient has gone to w since the cast (`WeightCastCache.get`)."""

    @staticmethod
    def forward(ctx, w, w_cast, entry):
        ctx.dtype, ctx.entry = w.dtype, entry
        return w_cast.view_as(w_cast)

    @staticmethod
    def backward(ctx, grad):
        ctx.entry.grad_sent = True
        return grad.to(ctx.dtype), None, None


class _Entry:
    __slots__ = ("param", "key", "cast", "grad_sent")

    def __init__(self, param, key, cast):
        self.param, self.key, self.cast, self.grad_sent = weakref.ref(param), key, cast, False

    def valid(self, w: torch.Tensor, key: tuple) -> bool:
        # a gradient went to w since the cast and w.grad is None now: zero_grad(set_to_none) ran, i.e. an
        # optimizer step may have written w, perhaps without bumping _version (a fused optimizer kernel)
        return self.param() is w and self.key == key and not (self.grad_sent and w.grad is None)


class WeightCastCache:
    """`get(name, w, dtype)` = `w.to(dtype)` (same values, same gradient), the cast done once per write of w."""

    def __init__(self):
        self._entries: dict = {}  # name -> _Entry (weakref to the parameter, key, cast, grad_sent)
        self.casts = 0  # casts made (tests read it)
        self.staged_casts = None  # (dtype, {name: cast with its gradient node}) of the current call (`stage`)

    def get(self, name: str, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        if (w.dtype == dtype or torch.compiler.is_compiling() or torch.is_inference_mode_enabled()
                or w.untyped_storage().nbytes() != w.numel() * w.element_size()):
            # no cast at all (CPU fp32: `.to` returns w) / the graph's own cast / an inference tensor, which a
            # later training forward could not save for its backward / a view into a flat buffer, which its
            # owner writes without this parameter's `_version` (module docstring): not cached
            return w.to(dtype)
        key = (w._version, w.data_ptr(), w.device, dtype)
        entry = self._entries.get(name)
        if entry is None or not entry.valid(w, key):
            with torch.no_grad():
                self._entries[name] = entry = _Entry(w, key, w.detach().to(dtype))
            self.casts += 1
        if w.requires_grad and torch.is_grad_enabled():
            return _CastFrom.apply(w, entry.cast, entry)
        return entry.cast

    def stage(self, dtype: torch.dtype, weights: dict) -> None:
        """Outside a compiled unit, before its call: the casts of `weights` (name -> parameter) for `staged`."""
        self.staged_casts = (dtype, {name: self.get(name, w, dtype) for name, w in weights.items()})

    def staged(self, name: str, w: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """In a compiled unit: the copy `stage` made for this call, else the graph's own `w.to(dtype)`."""
        staged = self.staged_casts
        if staged is not None and staged[0] == dtype and name in staged[1]:
            return staged[1][name]
        return w.to(dtype)

    def clear(self) -> None:
        self._entries.clear()
        self.staged_casts = None

    def __getstate__(self):  # copies and pickles start empty (a weakref does not pickle; a cast is cheap)
        return {"_entries": {}, "casts": 0, "staged_casts": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
