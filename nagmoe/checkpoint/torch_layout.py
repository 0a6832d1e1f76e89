"""The torch engine's checkpoint: torch.distributed.checkpoint (DCP) for tensors, JSON for the rest.

    RUN_DIR/checkpoints/step_000123/
        .metadata, __0_0.distcp, ...   DCP files: {"model": model state, "optim": optimizer state}
        state.json                     {"format": 1, "step", "rng": [per rank], "extra": extra_state,
                                        "layout": {"world_size", "ep"} (the layout that saved it)}
        manifest.json                  written last (nagmoe.checkpoint.files, .publish)

DCP runs without a process group in one process (`no_dist=True`, checked on torch 2.13); under an
initialised group the save/load are collective, rank 0 writes the JSON files and the manifest, and every
rank's RNG state is stored (restored by rank index; a rank the saving layout did not have gets generators
seeded from (seed, step, rank): nagmoe.checkpoint.rng.restore_rank_rng). Model and optimizer state go through
`torch.distributed.checkpoint.state_dict` (parameter-name keys, DDP/compile wrappers stripped), which
accepts a plain nn.Module and a single optimizer, a list of them or any iterable of optimizers.

Expert parallelism: expert stacks have the same names on every rank but different contents (each EP rank
holds a slice of the experts). `shard_plan` maps such parameter names to `(DeviceMesh, placements)`; the
parameter and every optimizer-state tensor of its shape are then saved and loaded as DTensors, so DCP
stores each expert once with its global offset (replicas over data-parallel ranks deduplicated) and a
load on another layout — another EP degree, or one process without any plan (`nagmoe consolidate`) —
reads the right experts.

Another layout on resume (issue 25): a checkpoint saved on W ranks with EP degree P loads on W' ranks with
EP degree P' (any world size and micro-batch the config accepts). Replicated tensors (parameters, Muon
momentum, AdamW moments and step counts) are read whole on every rank; an expert stack and each optimizer
tensor of its shape are read as the new layout's slice [p'·E/P', (p'+1)·E/P') of the global expert axis,
wherever the saving layout had put those experts (a plain tensor when P was 1, DTensor shards when not).
"""
from __future__ import annotations

import json
import warnings
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from nagmoe.checkpoint.async_save import BackgroundSave, dcp_writer, gather_digests, merge_gathered
from nagmoe.checkpoint.files import extra_with_step, read_checkpoint_state, verify_checkpoint
from nagmoe.checkpoint.save_verdict import raise_verdict, run_for_verdict
from nagmoe.checkpoint.publish import already_saved, new_save_dir, publish, save_paths
from nagmoe.checkpoint.rng import capture_rng_state, restore_rank_rng
from nagmoe.checkpoint.safe_dcp import safe_dcp_load
from nagmoe.base.errors import UserError

FORMAT = 1  # state.json "format" of a torch-engine checkpoint


# ----------------------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _on_rank0(fn: Callable[[], Any]) -> Any:
    """`fn` on rank 0, its result on every rank; its failure raised on every rank (save_verdict.py)."""
    result, verdict = run_for_verdict(fn, 0) if _rank() == 0 else (None, None)
    result, verdict = _broadcast_from_rank0((result, verdict))
    raise_verdict(verdict)
    return result


def _broadcast_from_rank0(obj: Any) -> Any:
    if not _distributed():
        return obj
    box = [obj]
    dist.broadcast_object_list(box, src=0)
    return box[0]


def _optimizer_list(optimizers) -> list[torch.optim.Optimizer]:
    if optimizers is None:
        return []
    if isinstance(optimizers, torch.optim.Optimizer):
        return [optimizers]
    return list(optimizers)  # a list/tuple of optimizers or an OptimizerBundle (iterable of optimizers)


def _tensor_state(model: nn.Module, optimizers: list[torch.optim.Optimizer],
                  shard_plan: Optional[dict] = None) -> dict:
    state = {"model": get_model_state_dict(model)}
    if optimizers:
        state["optim"] = get_optimizer_state_dict(model, optimizers)  # creates empty optimizer state if needed
    if shard_plan:
        _wrap_sharded(state, shard_plan)
    return state


def _wrap_sharded(state: dict, shard_plan: dict) -> None:
    """Replace the local shards named in `shard_plan` (and their optimizer state) by DTensors, in `state`.

    `get_optimizer_state_dict` returns the optimizer's own per-parameter dicts (not copies), so each is
    copied before its entries are swapped: writing DTensors into them would leave the live optimizer mixing
    DTensors and tensors at its next step (a mid-run checkpoint under EP crashed the run)."""
    from torch.distributed.tensor import DTensor

    def wrap(t: torch.Tensor, spec) -> torch.Tensor:
        mesh, placements = spec
        return DTensor.from_local(t, mesh, list(placements), run_check=False)

    model_state = state["model"]
    optim_state = state.get("optim", {}).get("state", {})
    for name, spec in shard_plan.items():
        local = model_state[name]
        model_state[name] = wrap(local, spec)
        if name not in optim_state:
            continue
        per_param = optim_state[name] = dict(optim_state[name])
        for key, value in list(per_param.items()):
            if torch.is_tensor(value) and value.shape == local.shape:  # momentum, Adam moments (not `step`)
                per_param[key] = wrap(value, spec)


def _unwrap_sharded(state: Any) -> Any:
    """DTensors back to their local shards (nested dicts/lists)."""
    from torch.distributed.tensor import DTensor

    if isinstance(state, DTensor):
        return state.to_local()
    if isinstance(state, dict):
        return {k: _unwrap_sharded(v) for k, v in state.items()}
    if isinstance(state, list):
        return [_unwrap_sharded(v) for v in state]
    return state


def _ep_degree(shard_plan: Optional[dict]) -> int:
    """The EP degree a shard plan describes: the size of the mesh dim its experts are sharded over (1 without
    a plan: nothing is sharded)."""
    from torch.distributed.tensor import Shard

    for mesh, placements in (shard_plan or {}).values():
        for dim, placement in enumerate(placements):
            if isinstance(placement, Shard):
                return int(mesh.size(dim))
    return 1


def _dcp(fn, state: dict, path: str) -> None:
    """dcp.save / dcp.load; single-process when no group is initialised (DCP then warns on every call
    that it assumes one process — which is exactly our intent, so that one warning is silenced). A save
    writes each rank's tensors as up to async_save.SAVE_FILES_PER_RANK files (one writer thread each), so that the
    manifest's and every load's hashing run in parallel too."""
    no_dist = not _distributed()
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
        if fn is dcp.save:
            fn(state, storage_writer=dcp_writer(path), no_dist=no_dist)
        else:
            fn(state, checkpoint_id=path, no_dist=no_dist)


# ----------------------------------------------------------------------------------------------------------
# Save / load
# ----------------------------------------------------------------------------------------------------------
def save_checkpoint(run_dir: str, step: int, model: nn.Module, optimizers=None,
                    extra_state: Optional[dict] = None, keep: int = 2, shard_plan: Optional[dict] = None,
                    fence: Optional[Callable[[], None]] = None, background: Optional[BackgroundSave] = None,
                    lease_check: Optional[Callable[[], None]] = None) -> str:
    """Write RUN_DIR/checkpoints/step_<step>/ atomically; keep the newest `keep`; return its path.

    `extra_state` must be JSON-serialisable (tokens, flops, data-loader position, ...); the RNG states of
    every rank are added automatically. Collective when a process group is initialised. `shard_plan`: the
    expert-parallel parameters (module docstring). `fence` (collective, every rank): called just before the
    publish; it raises when the run dir's lease was taken over, and then nothing is published. Each rank hashes
    the files it wrote; rank 0 publishes; its failure there is every rank's (save_verdict.py: the same
    UserError or SaveIOFailure on each, at once).

    `background` (issue 68): the tensors are staged now and written, hashed and published in the background
    (nagmoe/checkpoint/async_save.py); the path is returned before it is published, `background.settle()` says
    how it ended. `lease_check` (rank 0, in the background, before the publish) then plays the fence's part.
    """
    if keep < 1:
        raise UserError(f"train.keep_checkpoints: {keep} must be >= 1")
    extra_state = dict(extra_state or {})
    if extra_state.get("step", step) != step:
        raise ValueError(f"extra_state['step']={extra_state['step']} disagrees with step={step}")
    json.dumps(extra_state, allow_nan=False)  # fail on every rank before anything is written
    root, final = save_paths(run_dir, step)
    if _on_rank0(lambda: already_saved(final)):
        return final  # this step is on disk and verifies: re-saving it could only open a window to lose it
    # a fresh step_N.tmp-<random> made by rank 0 (nagmoe.checkpoint.publish.new_save_dir); the broadcast is the barrier
    tmp, tag = _on_rank0(lambda: new_save_dir(root, final))
    tensors = _tensor_state(model, _optimizer_list(optimizers), shard_plan)
    if background is None:
        _dcp(dcp.save, tensors, tmp)
    all_rng = _gathered_rng()  # the crash tests' "tensors_written" point on the synchronous path
    state = {"format": FORMAT, "step": step, "rng": all_rng, "extra": extra_state,
             "layout": {"world_size": len(all_rng), "ep": _ep_degree(shard_plan)}}

    def publish_digests(digests: dict) -> None:  # rank 0
        if lease_check is not None:
            lease_check()
        publish(tmp, final, run_dir, state, keep, tag, known=digests)

    if background is not None:
        background.start(tensors, step, tmp, publish_digests)
        return final
    gathered = gather_digests(tmp, _rank())
    if fence is not None:
        fence()
    _on_rank0(lambda: publish_digests(merge_gathered(gathered)))  # the verdict travels: no rank left waiting
    return final


def _gathered_rng() -> list:
    """Every rank's RNG state, in rank order (on every rank)."""
    rng = capture_rng_state()
    if not _distributed():
        return [rng]
    all_rng: list = [None] * dist.get_world_size()
    dist.all_gather_object(all_rng, rng)
    return all_rng


def load_checkpoint(path: str, model: nn.Module, optimizers=None, restore_rng: bool = True,
                    shard_plan: Optional[dict] = None, verified: bool = False, rng_seed: int = 0) -> dict:
    """Verify the manifest, then load model (and optimizer) state in place; return the extra state.

    The returned dict is the `extra_state` given to `save_checkpoint` with `"step"` set. A bad checksum,
    missing or truncated file raises UserError naming the file, before anything is loaded (`verified`: the
    caller has just verified it). The checkpoint may come from another layout (module docstring):
    `shard_plan` is this run's. `rng_seed` (train.seed) seeds the generators of a rank the saving layout
    did not have.
    """
    _on_rank0(lambda: None if verified else verify_checkpoint(path))  # its UserError raised on every rank
    state = read_checkpoint_state(path)
    if state.get("format") != FORMAT:
        raise UserError(f"checkpoint {path}: unsupported format {state.get('format')!r} (expected {FORMAT})")

    opts = _optimizer_list(optimizers)
    tensors = _tensor_state(model, opts, shard_plan)
    _dcp(safe_dcp_load, tensors, path)  # no arbitrary unpickling (nagmoe.checkpoint.safe_dcp)
    if shard_plan:
        tensors = _unwrap_sharded(tensors)
    set_model_state_dict(model, tensors["model"])
    if opts:
        set_optimizer_state_dict(model, opts, tensors["optim"])
    if restore_rng:
        restore_rank_rng(state["rng"], _rank(), rng_seed, state["step"])
    return extra_with_step(state)
