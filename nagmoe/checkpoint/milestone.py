"""Weights-only milestones (`train.milestone_dtype` bf16 | fp32; issue 68, item 4): what the depth analysis, the
report and the Hugging Face export read from a run's history, without the optimizer state a resume needs.

    RUN_DIR/milestones/step_000123/
        .metadata, __0_0.distcp, ...   DCP files: {"model": model state} only (EP experts as DTensors)
        state.json                     {"format": "weights-1", "step", "rng": [], "extra": the trainer's extra
                                        state + {"milestone": true, "dtype": "bf16" | "fp32"}, "layout"}
        manifest.json                  written last (nagmoe.checkpoint.files)

bf16 casts the matrices, the embedding and the unembedding (the roles a bf16 Hugging Face export casts: all but
a fraction of a percent of the bytes); gates, router, convolutions, scalars and every buffer (MoD's calibration
state, the expert bias) keep their dtype, since the analysis measures exactly those. fp32 keeps every tensor in
the dtype it trains in. A load into the fp32 model casts back (DCP copies into the destination's dtype).

A milestone is written like a checkpoint (a fresh `step_N.tmp-<tag>` by rank 0, DCP collective under a process
group, the manifest last, one rename) but under milestones/: resume lists checkpoints/ only, so a milestone is
never resumed from, and nothing prunes it (only an abandoned timeline's milestones give way: `_publish`). The
full milestones of `train.milestone_dtype: full` (and of every run from before the key) stay where they were:
checkpoints marked `extra.milestone`; `list_milestones` reads both.
"""
from __future__ import annotations

import json
import os
from typing import Callable, Optional

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import get_model_state_dict, set_model_state_dict

from nagmoe.base.errors import UserError, shown
from nagmoe.checkpoint.async_save import gather_digests, merge_gathered
from nagmoe.checkpoint.files import (MANIFEST, checkpoint_name, extra_with_step, list_checkpoints,
                                     read_checkpoint_state, step_dirs, verify_checkpoint)
from nagmoe.checkpoint.publish import is_milestone, new_save_dir, publish_dir, remove_dir, remove_leftovers
from nagmoe.checkpoint.safe_dcp import safe_dcp_load
from nagmoe.checkpoint.torch_layout import (_dcp, _distributed, _ep_degree, _on_rank0, _rank, _unwrap_sharded,
                                            _wrap_sharded)
from nagmoe.rundir.names import MILESTONES

FORMAT = "weights-1"  # state.json "format" of a weights-only milestone (torch_layout.load_checkpoint refuses it)
DTYPES = ("bf16", "fp32")  # train.milestone_dtype's weights-only values ("full" is a checkpoint)
LOW_PRECISION_ROLES = ("matrix", "embedding", "unembedding")  # what bf16 casts (nagmoe/hf/export.py too)


def milestone_paths(run_dir: str, step: int) -> tuple[str, str]:
    """(milestones root, final step_N path)."""
    root = os.path.join(run_dir, MILESTONES)
    return root, os.path.join(root, checkpoint_name(step))


def low_precision_keys(model: nn.Module) -> set:
    """State-dict keys a bf16 milestone casts: the parameters whose role is in LOW_PRECISION_ROLES."""
    from nagmoe.model.roles import param_roles

    return {k for k, role in param_roles(model).items() if role in LOW_PRECISION_ROLES}


def weights_state(model: nn.Module, dtype: str, shard_plan: Optional[dict] = None) -> dict:
    """{"model": the model state} as a milestone stores it: cast by role for bf16, the expert stacks of
    `shard_plan` as DTensors (cast first: the DTensor wraps the cast local shard)."""
    state = get_model_state_dict(model)
    if dtype == "bf16":
        low = low_precision_keys(model)
        state = {k: v.to(torch.bfloat16) if k in low and v.is_floating_point() else v for k, v in state.items()}
    out = {"model": state}
    if shard_plan:
        _wrap_sharded(out, shard_plan)
    return out


def _publish(tmp: str, final: str, run_dir: str, state: dict, tag: str, known: dict) -> None:
    """publish.publish_dir (state.json, the manifest from `known` and what no rank hashed, one rename over any
    step_N there: a milestone of an abandoned timeline, the run resumed from an earlier checkpoint or started
    over), then, instead of checkpoints/' pruning, the milestones after this step go (that timeline's too: they
    would be kept beside this run's) with the leftovers of crashed milestone saves."""
    publish_dir(tmp, final, run_dir, state, tag, known)
    for step, path in step_dirs(os.path.dirname(final)):
        if step > state["step"]:
            remove_dir(path, tag)
    remove_leftovers(os.path.dirname(final))


def save_milestone(run_dir: str, step: int, model: nn.Module, extra_state: dict, dtype: str = "bf16",
                   shard_plan: Optional[dict] = None, fence: Optional[Callable[[], None]] = None) -> str:
    """Write RUN_DIR/milestones/step_<step>/ atomically (module docstring); return its path. Collective when a
    process group is initialised. A milestone of this step already there is replaced (`_publish`: it is another
    timeline's; this run's own saves each step once). `fence` (every rank) runs just before the publish: it
    raises when the run dir was taken over."""
    if dtype not in DTYPES:
        raise UserError(f"train.milestone_dtype: {shown(dtype)} is not a weights-only milestone ({', '.join(DTYPES)})")
    extra = {**extra_state, "milestone": True, "dtype": dtype}
    if extra.get("step", step) != step:
        raise ValueError(f"extra_state['step']={extra['step']} disagrees with step={step}")
    json.dumps(extra, allow_nan=False)  # fail on every rank before anything is written
    root, final = milestone_paths(run_dir, step)
    tmp, tag = _on_rank0(lambda: new_save_dir(root, final))
    _dcp(dcp.save, weights_state(model, dtype, shard_plan), tmp)
    gathered = gather_digests(tmp, _rank())  # every rank hashes the files it wrote; also the barrier
    if fence is not None:
        fence()
    layout = {"world_size": dist.get_world_size() if _distributed() else 1, "ep": _ep_degree(shard_plan)}
    state = {"format": FORMAT, "step": step, "rng": [], "extra": extra, "layout": layout}
    # rank 0 publishes; its failure is raised on every rank (save_verdict.py), none is left waiting
    _on_rank0(lambda: _publish(tmp, final, run_dir, state, tag, merge_gathered(gathered)))
    return final


def load_milestone(path: str, model: nn.Module, shard_plan: Optional[dict] = None, verified: bool = False) -> dict:
    """Verify the manifest (rank 0, unless `verified`), load the milestone's weights into `model` (a bf16 tensor
    is cast to the model's dtype); return its extra state with "step" set."""
    _on_rank0(lambda: None if verified else verify_checkpoint(path))  # its UserError raised on every rank
    state = read_checkpoint_state(path)
    if state["format"] != FORMAT:
        raise UserError(f"milestone {shown(path)}: format {shown(state['format'])}, expected {FORMAT!r}")
    tensors = {"model": get_model_state_dict(model)}
    if shard_plan:
        _wrap_sharded(tensors, shard_plan)
    _dcp(safe_dcp_load, tensors, path)  # no arbitrary unpickling (nagmoe.checkpoint.safe_dcp)
    if shard_plan:
        tensors = _unwrap_sharded(tensors)
    set_model_state_dict(model, tensors["model"])
    return extra_with_step(state)


def list_milestones(run_dir: str) -> list[tuple[int, str]]:
    """(step, path) of every milestone of the run, oldest first: the weights-only ones under milestones/ and the
    full ones (checkpoints marked `extra.milestone`) under checkpoints/; a step with both gives the full one."""
    found = dict(step_dirs(os.path.join(run_dir, MILESTONES)))
    found.update((step, path) for step, path in list_checkpoints(run_dir) if is_milestone(path))
    return sorted(found.items())


def saved_bytes(path: str) -> Optional[int]:
    """Bytes of a published checkpoint or milestone (its files as its manifest lists them, plus the manifest);
    None before it is published."""
    try:
        with open(os.path.join(path, MANIFEST)) as f:
            files = json.load(f)["files"]
        return sum(int(e["bytes"]) for e in files.values()) + os.path.getsize(os.path.join(path, MANIFEST))
    except (OSError, ValueError, KeyError, TypeError, AttributeError):
        return None
