"""The chunked loss's chunk behind a backend registry (op "loss", reference "eager").

Legend: N tokens of one chunk, D model width, V vocabulary.

`Transformer.forward` scores the decoded state a chunk of tokens at a time (nagmoe/model/transformer.py,
`chunked_loss`); one chunk is
    logits_NV = stream.decode_with(rows, w_VD)     pre-norm: softcap·tanh(linear(rms_norm(x), W).float() / softcap)
                                                   NAG:      linear(rms_normalise(R_bar)·exp(s)/d, W).float()
    loss      = -log_softmax(logits_NV)[y_N]        (cross-entropy: ignore_index targets score 0, sum or per token)
Eager, that is a chain of passes over the (N, V) logits (cast, divide, tanh, multiply, log-softmax, gather)
each saving its output, and the same chain again in the backward: at the r40 models 16 chunks of 2048 x 32768
fp32 logits per micro-step (issue 60).

  eager     the chunk function below as it is: today's ops, the reference and the oracle of `compiled`, and
            what runs whenever `train.compile` is off (the CPU default; `make demo` is unchanged).
  compiled  the same function under `torch.compile(dynamic=None, fullgraph=True)`: the decode's matmul plus
            one fused region for cast, softcap, log-softmax and NLL, and one for their backward (the
            partitioner saves one (N, V) tensor, the matmul's output, where eager saves 3-4 fp32 ones). Attached
            by `nagmoe.train.speed.compile_model` with the sublayers' compiler backend; all chunks of a step
            share one graph (a short last chunk, or eval/no-grad, adds one).

liger-kernel's fused linear cross-entropy is not registered: docs/decisions.md, "The loss: a compiled chunk,
not liger's fused linear cross-entropy".

Under an active TorchDispatchMode (an instrument: SyncCounter, KernelContracts) the compiled chunk runs the
eager function, as NAG's fused regions do (nagmoe/ops/nag_fused.py): dynamo skips frames under such a mode,
and fullgraph=True turns that skip into an error.
"""
from __future__ import annotations

import logging

import torch
import torch.nn.functional as F

from nagmoe.ops.nag_fused import _compiler_present, dispatch_mode_active
from nagmoe.ops.registry import Registry

log = logging.getLogger("nagmoe.backends")

IGNORE_INDEX = -1  # targets < 0 are not scored (nagmoe.model.transformer re-exports it)

LOSS_BACKENDS = Registry("loss", reference="eager")
# inductor needs a C++ compiler for CPU code; CUDA code goes through Triton
LOSS_BACKENDS.register("compiled", available=lambda: _compiler_present("cuda" if torch.cuda.is_available()
                                                                         else "cpu"))
LOSS_BACKENDS.register("eager")


def chunk_cross_entropy(stream, rows, w_VD: torch.Tensor, y_N: torch.Tensor, reduction: str) -> torch.Tensor:
    """The cross-entropy of one chunk: `rows` the chunk's (1, N, ...) state (a tensor or NAGState), `y_N` its
    targets; `reduction` "sum" (a scalar) or "none" (N losses)."""
    logits_NV = stream.decode_with(rows, w_VD).flatten(0, 1)
    return F.cross_entropy(logits_NV, y_N, ignore_index=IGNORE_INDEX, reduction=reduction)


_COMPILED: dict = {}  # compiler backend -> the compiled chunk, shared by every model of the process


def compiled_chunk(backend="inductor"):
    """`chunk_cross_entropy` compiled with `backend` (torch.compile's; tests use "aot_eager" / "eager"), once per
    backend: the stream is an argument (dynamo inlines it, its softcap and precision are guarded constants), so
    the pre-norm and the NAG stream, and every model, share the compiled object and each gets its own graph."""
    if backend not in _COMPILED:
        _COMPILED[backend] = torch.compile(chunk_cross_entropy, dynamic=None, backend=backend, fullgraph=True)
    return _COMPILED[backend]


def resolve_loss_backend(compile_on: bool, backend="inductor") -> str:
    """The loss chunk's backend for a trainer with `train.compile` resolved to `compile_on`: eager when off;
    compiled when on and its compiler can run here (inductor: a C++ compiler on CPU), else eager with the
    registry's warning. The choice is logged once."""
    if not compile_on:
        name = "eager"
    elif backend != "inductor":  # dynamo's own backends (tests) need no compiler
        name = "compiled"
    else:
        name = LOSS_BACKENDS.resolve("compiled")
    log.info("loss: %s", name)
    return name


def run_chunk(chunk_fn, stream, rows, w_VD, y_N, reduction):
    """`chunk_fn` (the compiled chunk or the eager function) on one chunk; the eager function under an active
    dispatch mode (module docstring)."""
    if chunk_fn is not chunk_cross_entropy and not torch.compiler.is_compiling() and dispatch_mode_active():
        chunk_fn = chunk_cross_entropy
    return chunk_fn(stream, rows, w_VD, y_N, reduction)
