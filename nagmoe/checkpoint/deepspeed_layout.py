"""The DeepSpeed engine's checkpoint files (parallel.engine=deepspeed), in the shared run-dir layout:

    step_000123/mp_rank_00_model_states.pt                  replicated parameters + buffers (DeepSpeed)
    step_000123/zero_pp_rank_<r>_mp_rank_00_optim_states.pt  rank r's ZeRO partition + AdamW state (DeepSpeed)
    step_000123/own_rank_<r>.pt                             rank r's own parameters (EP expert stacks, 0-dim
                                                            scalars) + their AdamW state (nagmoe)
    step_000123/state.json, manifest.json                   {"format": "deepspeed-1", step, rng, extra, layout}

The engine (nagmoe.train.deepspeed_engine) writes DeepSpeed's files through DeepSpeed and ours through
`write_own_state`, then publishes like the torch engine (nagmoe.checkpoint.publish). `deepspeed_model_state`
reads the whole model (every expert) in one process without unpickling and without deepspeed installed,
which is how eval, generate, analyze and consolidate read a DeepSpeed run.
"""
from __future__ import annotations

import os

import torch

from nagmoe.checkpoint.files import read_checkpoint_state, verify_checkpoint
from nagmoe.checkpoint.safe_dcp import weights_only_load
from nagmoe.base.errors import UserError, shown
from nagmoe.base.files import atomic_writer, expect

FORMAT = "deepspeed-1"  # state.json "format" of a DeepSpeed checkpoint (the torch engine refuses it)
OWN_FILE = "own_rank_{rank:05d}.pt"  # the parameters DeepSpeed does not manage, one file per rank
MODEL_STATES = "mp_rank_00_model_states.pt"  # DeepSpeed's file of the module state (no model parallelism)


# DeepSpeed's own classes in its ZeRO optimizer files (0.19.8, stages 1 and 2): plain values, no behaviour
# at load. Everything else in DeepSpeed's files is tensors and containers.
DEEPSPEED_CLASSES = (("deepspeed.runtime.zero.config", "ZeroStageEnum"),
                     ("deepspeed.utils.tensor_fragment", "fragment_address"),
                     ("deepspeed.runtime.fp16.loss_scaler", "LossScaler"))


def load_deepspeed_file(path: str, map_location=None) -> dict:
    """One file DeepSpeed wrote, read with `weights_only=True` plus DEEPSPEED_CLASSES (imported from the
    installed deepspeed, which a resume has): what our checkpoint engine hands DeepSpeed instead of its own
    `torch.load(weights_only=False)`."""
    import importlib

    classes = tuple(getattr(importlib.import_module(m), n) for m, n in DEEPSPEED_CLASSES)
    return weights_only_load(path, path, map_location, classes)


def write_own_state(directory: str, rank: int, params: dict, expert_names: list, optim_state) -> None:
    """Rank `rank`'s own parameters (name -> tensor) and their optimizer state dict (or None), through the safe
    writer (nagmoe.base.files; the publish fsyncs it while hashing)."""
    with atomic_writer(os.path.join(directory, OWN_FILE.format(rank=rank)), binary=True) as f:
        torch.save({"params": {n: p.detach().cpu() for n, p in params.items()}, "expert_names": list(expert_names),
                    "optim": optim_state}, f)


def read_own_state(path: str, rank: int, device="cpu") -> dict:
    """{"params", "expert_names", "optim"} of rank `rank` (plain data: `weights_only`)."""
    file = os.path.join(path, OWN_FILE.format(rank=rank))
    return weights_only_load(file, file, device)


def check_deepspeed_state(path: str, layout: dict) -> dict:
    """state.json of a DeepSpeed checkpoint written on `layout` (world size, EP, ZeRO stage), or UserError."""
    state = read_checkpoint_state(path)
    if state.get("format") != FORMAT:
        raise UserError(f"checkpoint {path}: format {state.get('format')!r} was not written by "
                        f"parallel.engine=deepspeed (expected {FORMAT!r})")
    if state.get("layout") != layout:
        raise UserError(f"checkpoint {path} was written with {state.get('layout')}; this run is "
                        f"{layout} (a DeepSpeed checkpoint resumes on the same layout only)")
    return state


def deepspeed_model_state(path: str, verified: bool = False) -> dict:
    """The whole model's state dict (every expert) from a DeepSpeed checkpoint, in one process and without
    unpickling (`weights_only` loads; deepspeed need not be installed): replicated parameters and buffers from
    DeepSpeed's module file, expert stacks concatenated over the EP ranks of the first data-parallel replica
    (ranks 0..ep-1, rank = dp_rank·ep + ep_rank), 0-dim parameters from rank 0. Verifies the manifest first
    unless the caller just did (`verified`)."""
    if not verified:
        verify_checkpoint(path)
    state = read_checkpoint_state(path)
    if state.get("format") != FORMAT:
        raise UserError(f"checkpoint {path}: format {state.get('format')!r} is not a DeepSpeed checkpoint")
    ep = expect(state.get("layout") or {}, "ep", int, f"{shown(os.path.join(path, 'state.json'))} layout")
    module_file = os.path.join(path, MODEL_STATES)
    out = dict(weights_only_load(module_file, module_file, "cpu")["module"])
    owns = [read_own_state(path, r) for r in range(ep)]
    experts = set(owns[0]["expert_names"])
    for name, tensor in owns[0]["params"].items():
        out[name] = torch.cat([o["params"][name] for o in owns]) if name in experts else tensor
    return out
