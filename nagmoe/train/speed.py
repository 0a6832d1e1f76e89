"""Speed and memory options of the training step: `train.compile` and `train.activation_checkpointing`.

compile (`train.compile`: auto | true | false; auto = on for CUDA, off for CPU; `resolve_compile`): the unit
    is the sublayer of a block (attention, MLP/MoE), compiled once per sublayer class and shared by every
    block (`compile_model`): `torch.compile(Class.forward, dynamic=None)` called with the module as its first
    argument, so parameters are graph inputs (dynamo inlines nn modules) and a 26-block model runs the same
    one attention graph and one FFN graph 26 times. Nothing that differs per block reaches the guards: the
    block index lives in the residual stream's loop (`stream.apply(index, ...)`, eager), NAG's gate
    (`NAGGate.sublayer_number` is read only at init) and MoD's bookkeeping stay outside the unit. The stream
    itself (pre-norm's norm and add, NAG's modulator and update) runs between the units: NAG's through
    `model.nag.impl` (`compiled` on CUDA: its own fused regions, also index-free), the embedding eagerly; the
    loss's chunk (decode, softcap, log-softmax, NLL) is its own compiled region (`model.loss_chunk`,
    nagmoe/ops/loss.py), one graph for every chunk. Dynamic sizes:
      - static MoD (`model.mod.impl=static`, the CUDA default): `select=Selection` goes to the sublayer's MoD
        unit, compiled once per class like the plain one, with fullgraph=True but for the MoE (its expert call
        may leave the graph, below): the same graphs before and after skipping starts, whatever the counts. The
        Selection comes undecided (the score, the calibrator's thresholds and skip flags, the sublayer as a (1,)
        device index) and every sublayer's forward decides it first thing (`mod.decide`: the mask, the executed
        counts, the score histogram; issue 69, item 3), so the decision is traced into the unit's graph, in the
        forward's own frame (a wrapper frame around it would split the MoE's unit at its expert call), instead
        of running as ~40 small eager ops between units;
      - gather MoD's FFN runs on the gathered executed tokens `(1, N, D)` (`rows=` too, to the MoD unit): N
        changes every step, so the first such call recompiles once with N symbolic (`dynamic=None`, automatic
        dynamic shapes) and later steps reuse that graph;
      - gather MoD's attention (`select=ExecutedTokens`: python counts and per-slot key ends) and decoding with
        an inference cache (`cache=`) run the sublayer eagerly: those python ints would otherwise be guarded
        and recompile per step;
      - the MoE's expert call stays in the graph only where it has no host read (the grouped backend,
        `torch._grouped_mm` in bf16, no expert-parallel dispatcher); otherwise it runs eagerly between two
        graphs (the loop backend's per-expert counts and the EP all-to-all's split sizes are python ints).
    Training, evaluation (eval mode, no grad) and a smaller last batch each add a graph at most; the count
    does not grow with depth or steps (tests/perf/test_compiled_blocks.py). Parameter names, hence
    checkpoints, are unchanged: the compiled call is an instance attribute (`forward`), as the checkpointing
    wrapper below.
    With compile off on CUDA the trainer refuses a layout whose eager memory estimate exceeds the device
    (`nagmoe.train.memory.eager_memory_refusal`).
activation checkpointing: every sublayer (attention, MLP/MoE) runs under non-reentrant
    `torch.utils.checkpoint` while training: its activations are recomputed in the backward instead of being
    kept, so the memory of a deep model is the stream (two lanes per sublayer) plus one sublayer's
    activations. The NAG update itself is not recomputed (its saved inputs are the stream lanes). Sublayers
    are deterministic given their input (the RNG state is restored for the recompute), and their
    bookkeeping (`last_stats`) is overwritten with the same values, so results equal the plain step. With
    compile on, the checkpoint wraps the compiled sublayer (the recompute runs the compiled forward again).
"""
from __future__ import annotations

import functools

import torch
from torch.utils.checkpoint import checkpoint

from nagmoe.model.mod import Selection
from nagmoe.ops.nag_fused import dispatch_mode_active

COMPILE_SETTINGS = ("auto", "true", "false")


def resolve_compile(setting, device_type: str) -> bool:
    """`train.compile` for a device type: auto = on for CUDA (inductor + Triton), off for CPU (a cold inductor
    compile costs minutes on a small CPU machine and gains little there); true / false as set (booleans and
    their strings accepted, as old saved configs have them)."""
    if isinstance(setting, bool):
        return setting
    value = str(setting).lower()
    if value == "auto":
        return device_type == "cuda"
    if value in ("true", "false"):
        return value == "true"
    raise ValueError(f"train.compile: {setting!r} is not one of {', '.join(COMPILE_SETTINGS)}")


# ----------------------------------------------------------------------------------------------------------
# Sublayer forward: [checkpoint] -> [compiled unit | eager]
# ----------------------------------------------------------------------------------------------------------
def _checkpointed_forward(module: torch.nn.Module, forward, *args, **kwargs):
    if module.training and torch.is_grad_enabled():
        return checkpoint(forward, *args, use_reentrant=False, **kwargs)
    return forward(*args, **kwargs)  # eval, no_grad and decoding: nothing to save


def _routed_forward(module: torch.nn.Module, compiled, eager, x, *args, **kwargs):
    """The compiled unit for a plain call `sublayer(x)`; static MoD's `select=Selection` (and a gathered MoE's
    `rows=`) to the MoD unit (`_compiled_mod_forward`); gather MoD's `select=ExecutedTokens` and decoding's
    `cache=` run eagerly (module docstring)."""
    if not torch.compiler.is_compiling() and dispatch_mode_active():
        # an instrument's dispatch mode (SyncCounter, KernelContracts): dynamo would skip the frame, and a
        # fullgraph unit then fails ("found no compiled frames"); the instrument sees the same function eagerly
        return eager(x, *args, **kwargs)
    given = {k: v for k, v in kwargs.items() if v is not None}
    if not args and not given:
        return compiled(module, x)
    select = given.get("select")
    if not args and "cache" not in given and (select is None or isinstance(select, Selection)):
        return module.__dict__["_compiled_mod_forward"](module, x, **given)
    return eager(x, *args, **kwargs)


def _install_forward(module: torch.nn.Module) -> None:
    """Compose the instance's forward from its original one and the options set on it (`_compiled_forward`,
    `_checkpointed`), whatever order they were enabled in."""
    if "_nagmoe_base_forward" not in module.__dict__:
        module._nagmoe_base_forward = module.forward  # the class's forward, bound (or an earlier instance one)
    forward = module._nagmoe_base_forward
    compiled = module.__dict__.get("_compiled_forward")
    if compiled is not None:
        forward = functools.partial(_routed_forward, module, compiled, forward)
    if module.__dict__.get("_checkpointed", False):
        forward = functools.partial(_checkpointed_forward, module, forward)
    module.forward = forward


def enable_activation_checkpointing(model) -> int:
    """Wrap the forward of every sublayer of `model` (a Transformer) in activation checkpointing; returns the
    number of sublayers wrapped. Idempotent. The wrapper is an instance attribute: no parameter is renamed."""
    wrapped = 0
    for sublayer in model.sublayers():
        if getattr(sublayer, "_checkpointed", False):
            continue
        sublayer._checkpointed = True
        _install_forward(sublayer)
        wrapped += 1
    return wrapped


# ----------------------------------------------------------------------------------------------------------
# Compiled sublayers
# ----------------------------------------------------------------------------------------------------------
_COMPILED: dict = {}  # (sublayer class, backend) -> the compiled class forward, shared by every instance


def _compiled_class_forward(cls, backend, mod_unit: bool = False):
    """The compiled class forward shared by every instance; `mod_unit`: the one for MoD's calls (`select=`,
    `rows=`), a separate compiled object so its graphs never evict the plain ones. A static-MoD unit has no host
    read by construction: it compiles with fullgraph=True (a `.item()`, `.tolist()` or `nonzero` in it fails
    the compile instead of breaking the graph), except a MoE's, whose expert call may leave the graph on
    purpose (`_run_experts`)."""
    key = (cls, backend, mod_unit)
    if key not in _COMPILED:
        # dynamic=None: static shapes first; a size that changes (gather MoD's executed tokens, a short last
        # eval batch) recompiles once as a symbolic size, then that graph serves every later size
        fullgraph = mod_unit and not hasattr(cls, "run_experts")
        _COMPILED[key] = torch.compile(cls.forward, dynamic=None, backend=backend, fullgraph=fullgraph)
    return _COMPILED[key]


def _experts_in_graph(layer, x_SD: torch.Tensor) -> bool:
    """Whether the MoE's expert call can stay inside the compiled graph: no host read in it (module
    docstring). Evaluated while tracing (the dtype under autocast is known then)."""
    from nagmoe.ops.grouped_experts import expert_compute_dtype, grouped_mm_supports

    if layer.dispatcher is not None or layer.backend != "grouped":
        return False
    return grouped_mm_supports(expert_compute_dtype(x_SD), x_SD.device.type, layer.w_in.shape[1], layer.w_in.shape[2])


def _run_experts(layer, in_graph, eager, x_SD: torch.Tensor, counts_E: torch.Tensor) -> torch.Tensor:
    if torch.compiler.is_compiling() and not _experts_in_graph(layer, x_SD):
        return eager(x_SD, counts_E)  # a graph break: runs eagerly, the rest of the forward resumes compiled
    return in_graph(x_SD, counts_E)


def compile_model(model, backend="inductor") -> dict:
    """Compile every sublayer of `model` (a Transformer) in place, one compiled forward per sublayer class
    (module docstring), and its loss chunk. Idempotent; returns {"unit", "classes", "backend", "loss"} for the
    run's log. `backend`:
    torch.compile's (tests count graphs with "eager" / "aot_eager")."""
    classes = []
    for sublayer in model.sublayers():
        cls = type(sublayer)
        if cls.__name__ not in classes:
            classes.append(cls.__name__)
        if "_compiled_forward" in sublayer.__dict__:
            continue
        if hasattr(sublayer, "run_experts") and hasattr(sublayer, "dispatcher"):  # a MoE layer
            run = sublayer.run_experts
            sublayer.run_experts = functools.partial(_run_experts, sublayer, run, torch.compiler.disable(run))
        sublayer._compiled_forward = _compiled_class_forward(cls, backend)
        sublayer._compiled_mod_forward = _compiled_class_forward(cls, backend, mod_unit=True)
        _install_forward(sublayer)
    loss = "eager"
    if hasattr(model, "loss_chunk"):  # the loss's chunk: one compiled region (nagmoe/ops/loss.py)
        from nagmoe.ops.loss import compiled_chunk, resolve_loss_backend

        loss = resolve_loss_backend(True, backend)
        if loss == "compiled":
            model.loss_chunk = compiled_chunk(backend)
    return {"unit": "sublayer", "classes": classes, "backend": backend if isinstance(backend, str) else "custom",
            "loss": loss}


# ----------------------------------------------------------------------------------------------------------
# What runs: SDPA backends
# ----------------------------------------------------------------------------------------------------------
def sdpa_backends(device_type: str) -> str:
    """The SDPA kernels F.scaled_dot_product_attention may pick here: on CUDA the enabled ones of flash /
    efficient / cudnn / math (torch.backends.cuda.*_sdp_enabled; SDPA takes the first that supports the
    call's dtype, head dim and mask); on CPU its flash kernel or the math one (`math/cpu-flash`)."""
    if device_type != "cuda":
        return "math/cpu-flash"
    flags = (("flash", "flash_sdp_enabled"), ("efficient", "mem_efficient_sdp_enabled"),
             ("cudnn", "cudnn_sdp_enabled"), ("math", "math_sdp_enabled"))
    enabled = [name for name, fn in flags if getattr(torch.backends.cuda, fn, lambda: False)()]
    return "/".join(enabled) or "none enabled"
