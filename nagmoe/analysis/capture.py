"""Read-only taps into a model's forward pass for the analyses, without editing model code.

- `attention_inputs_tap(model, fn)`: a forward pre-hook on every block's attention calls
  `fn(layer, module, x_BTD, select)` with the exact tensor the residual stream hands the attention (NAG: the
  direction R̄; pre-norm: rmsnorm(x)) and MoD's `select` (the executed tokens, or None when all execute).
- `gate_modulator_tap(model, fn)` (NAG): `fn(index, m_BT)` with every sublayer's modulator m, computed by the
  stream on the full (B, T) direction before the sublayer runs (under MoD the FFN itself only sees the
  gathered executed tokens, so a hook on the FFN would miss the skipped ones).
- `decode_state(model)`: records the state the residual stream decodes (NAG: `NAGState(log_norm_BT,
  direction_BTD)`; pre-norm: the stream x_BTD).
The NAG ops and the stream's `decode` are methods, not module forwards, so no module hook sees them:
they are shadowed by a recording wrapper (an instance attribute in front of the method) for the duration of the
block and removed on exit, also when the forward raises.
"""
from __future__ import annotations

import contextlib
from typing import Callable

import torch


@contextlib.contextmanager
def attention_inputs_tap(model, fn: Callable):
    handles = []
    try:
        for layer, block in enumerate(model.blocks):
            def hook(module, args, kwargs, layer=layer):
                x = args[0] if args else kwargs.get("x_BTD")
                if isinstance(x, torch.Tensor):
                    fn(layer, module, x, kwargs.get("select"))
            handles.append(block.attn.register_forward_pre_hook(hook, with_kwargs=True))
        yield
    finally:
        for h in handles:
            h.remove()


@contextlib.contextmanager
def _shadow(obj, name: str, make_wrapper: Callable):
    """Put `make_wrapper(original_bound_method)` in front of obj.<name> for the block."""
    original = getattr(obj, name)
    own = name in vars(obj)  # an instance attribute (restore it) or a class method (remove our shadow)
    object.__setattr__(obj, name, make_wrapper(original))
    try:
        yield
    finally:
        if own:
            object.__setattr__(obj, name, original)
        else:
            object.__delattr__(obj, name)


@contextlib.contextmanager
def gate_modulator_tap(model, fn: Callable[[int, torch.Tensor], None]):
    """The stream computes m through its NAG ops (`stream.ops`: `modulator`, or the fused `gated_update` that
    returns m third); both are shadowed, and the gate is recognised by its weight tensor."""
    stream = model.stream
    gates, ops = getattr(stream, "gates", None), getattr(stream, "ops", None)
    if not gates or ops is None:
        yield
        return
    index_of = {id(gate.weight): index for index, gate in enumerate(gates)}

    def make_modulator(original):
        def recording_modulator(direction_BTD, weight, *args, **kwargs):
            m = original(direction_BTD, weight, *args, **kwargs)
            fn(index_of[id(weight)], m)
            return m
        return recording_modulator

    def make_gated_update(original):
        def recording_gated_update(log_norm, direction, branch, weight, *args, **kwargs):
            out = original(log_norm, direction, branch, weight, *args, **kwargs)
            fn(index_of[id(weight)], out[2])
            return out
        return recording_gated_update

    with _shadow(ops, "modulator", make_modulator), _shadow(ops, "gated_update", make_gated_update):
        yield


class DecodeRecorder:
    """`last`: the state passed to the most recent `stream.decode` call inside the block."""

    def __init__(self):
        self.last = None


@contextlib.contextmanager
def decode_state(model):
    recorder = DecodeRecorder()

    def make(original):
        def recording_decode(state, *args, **kwargs):
            recorder.last = state
            return original(state, *args, **kwargs)
        return recording_decode

    with _shadow(model.stream, "decode", make):
        yield recorder
