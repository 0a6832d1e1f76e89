"""Crash-safe checkpoints: torch.distributed.checkpoint (DCP) for tensors, JSON for the rest, a manifest.

Layout (one directory per checkpoint):

    RUN_DIR/checkpoints/step_000123/
        .metadata, __0_0.distcp, ...   DCP files: {"model": model state, "optim": optimizer state}
        state.json                     {"format", "step", "rng": [per rank], "extra": extra_state}
        manifest.json                  sha256 and size of every other file; written last

Crash safety: everything is written under `step_000123.tmp-<pid>`, files are fsync'ed while hashing, the
manifest goes in last, then one `os.rename` publishes the directory. A reader takes a checkpoint only if its
manifest exists and every listed file has the recorded size and sha256, so a half-written, truncated or
corrupted checkpoint is never loaded. Old checkpoints are removed only after the new one is published
(renamed to `*.del-<pid>` first, so a crash mid-delete leaves nothing that looks like a checkpoint).

DCP runs without a process group in one process (`no_dist=True`, checked on torch 2.13); under an
initialised group the save/load are collective, rank 0 writes the JSON files and the manifest, and every
rank's RNG state is stored (restored by rank index). Model and optimizer state go through
`torch.distributed.checkpoint.state_dict` (parameter-name keys, DDP/compile wrappers stripped), which
accepts a plain nn.Module and a single optimizer, a list of them or an `OptimizerBundle`.

Expert parallelism: expert stacks have the same names on every rank but different contents (each EP rank
holds a slice of the experts). `shard_plan` maps such parameter names to `(DeviceMesh, placements)`; the
parameter and every optimizer-state tensor of its shape are then saved and loaded as DTensors, so DCP
stores each expert once with its global offset (replicas over data-parallel ranks deduplicated) and a
load on another layout — another EP degree, or one process without any plan (`nagmoe consolidate`) —
reads the right experts.
"""
from __future__ import annotations

import base64
import hashlib
import json
import logging
import os
import random
import re
import shutil
import warnings
from typing import Any, Optional

import numpy as np
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

from nagmoe.errors import UserError
from nagmoe.train.safe_dcp import safe_dcp_load

log = logging.getLogger(__name__)

CHECKPOINTS = "checkpoints"
MANIFEST = "manifest.json"
STATE = "state.json"
FORMAT = 1
STEP_DIR = re.compile(r"^step_(\d+)$")
TMP_DIR = re.compile(r"^step_(\d+)\.tmp-")  # a save in progress, or one killed before it published
_HASH_CHUNK = 1 << 22


# ----------------------------------------------------------------------------------------------------------
# Small helpers
# ----------------------------------------------------------------------------------------------------------
def _distributed() -> bool:
    return dist.is_available() and dist.is_initialized()


def _rank() -> int:
    return dist.get_rank() if _distributed() else 0


def _barrier() -> None:
    if _distributed():
        dist.barrier()


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


def _dcp(fn, state: dict, path: str) -> None:
    """dcp.save / dcp.load; single-process when no group is initialised (DCP then warns on every call
    that it assumes one process — which is exactly our intent, so that one warning is silenced)."""
    no_dist = not _distributed()
    with warnings.catch_warnings():
        if no_dist:
            warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninit")
        fn(state, checkpoint_id=path, no_dist=no_dist)


def _fsync_dir(path: str) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def _write_json(path: str, obj: Any) -> None:
    with open(path, "w") as f:
        json.dump(obj, f, indent=1, allow_nan=False)
        f.flush()
        os.fsync(f.fileno())


def _sha256_and_sync(path: str) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for chunk in iter(lambda: f.read(_HASH_CHUNK), b""):
            h.update(chunk)
        os.fsync(f.fileno())
    return h.hexdigest()


def _files_under(root: str) -> list[str]:
    out = []
    for dirpath, _, files in os.walk(root):
        for name in files:
            out.append(os.path.relpath(os.path.join(dirpath, name), root))
    return sorted(out)


def checkpoint_name(step: int) -> str:
    return f"step_{step:06d}"


def list_checkpoints(run_dir: str) -> list[tuple[int, str]]:
    """Published checkpoint directories (valid or not), oldest first; tmp/del directories are ignored."""
    root = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = STEP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


# ----------------------------------------------------------------------------------------------------------
# RNG state as JSON
# ----------------------------------------------------------------------------------------------------------
def _b64(t: torch.Tensor) -> str:
    return base64.b64encode(t.cpu().numpy().tobytes()).decode("ascii")


def _unb64(s: str) -> torch.Tensor:
    return torch.frombuffer(bytearray(base64.b64decode(s)), dtype=torch.uint8)


def capture_rng_state() -> dict:
    """This process's torch (CPU, CUDA if initialised), numpy and python RNG states, JSON-serialisable."""
    version, words, gauss = random.getstate()
    kind, keys, pos, has_gauss, cached = np.random.get_state()
    state = {
        "torch_cpu": _b64(torch.get_rng_state()),
        "numpy": {"kind": kind, "keys": keys.tolist(), "pos": int(pos), "has_gauss": int(has_gauss),
                  "cached_gaussian": float(cached)},
        "python": {"version": version, "words": list(words), "gauss_next": gauss},
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        state["torch_cuda"] = [_b64(s) for s in torch.cuda.get_rng_state_all()]
    return state


def restore_rng_state(state: dict) -> None:
    torch.set_rng_state(_unb64(state["torch_cpu"]))
    n = state["numpy"]
    np.random.set_state((n["kind"], np.asarray(n["keys"], dtype=np.uint32), n["pos"], n["has_gauss"],
                         n["cached_gaussian"]))
    p = state["python"]
    random.setstate((p["version"], tuple(p["words"]), p["gauss_next"]))
    cuda = state.get("torch_cuda")
    if cuda and torch.cuda.is_available():
        if len(cuda) == torch.cuda.device_count():
            torch.cuda.set_rng_state_all([_unb64(s) for s in cuda])
        else:  # different device count: restore the current device from the first saved state
            torch.cuda.set_rng_state(_unb64(cuda[0]))


# ----------------------------------------------------------------------------------------------------------
# Verification
# ----------------------------------------------------------------------------------------------------------
def verify_checkpoint(path: str) -> dict:
    """Check the manifest of checkpoint `path`; return it, or raise UserError naming the bad file."""
    manifest_path = os.path.join(path, MANIFEST)
    if not os.path.isdir(path):
        raise UserError(f"checkpoint {path} does not exist or is not a directory")
    if not os.path.isfile(manifest_path):
        raise UserError(f"checkpoint {path} has no {MANIFEST} (incomplete checkpoint)")
    try:
        with open(manifest_path) as f:
            manifest = json.load(f)
        files = manifest["files"]
    except (OSError, ValueError, KeyError, TypeError) as e:
        raise UserError(f"checkpoint manifest {manifest_path} is unreadable ({type(e).__name__})") from None
    if STATE not in files:
        raise UserError(f"checkpoint manifest {manifest_path} does not list {STATE}")
    for rel, entry in files.items():
        file_path = os.path.join(path, rel)
        if not os.path.isfile(file_path):
            raise UserError(f"checkpoint file {file_path} is missing")
        size = os.path.getsize(file_path)
        if size != entry["bytes"]:
            raise UserError(f"checkpoint file {file_path} has {size} bytes, manifest says {entry['bytes']} "
                            "(truncated or overwritten)")
        digest = _sha256_and_sync(file_path)
        if digest != entry["sha256"]:
            raise UserError(f"checkpoint file {file_path} fails its sha256 check (corrupted)")
    return manifest


def unfinished_writes(run_dir: str) -> list[tuple[int, str]]:
    """Temporary directories of saves that never published (the process died mid-write), oldest first."""
    root = os.path.join(run_dir, CHECKPOINTS)
    if not os.path.isdir(root):
        return []
    found = []
    for name in os.listdir(root):
        m = TMP_DIR.match(name)
        if m and os.path.isdir(os.path.join(root, name)):
            found.append((int(m.group(1)), os.path.join(root, name)))
    return sorted(found)


def latest_valid_checkpoint(run_dir: str) -> Optional[str]:
    """Newest checkpoint directory under RUN_DIR/checkpoints whose manifest verifies, or None. Each newer one
    passed over is named in a warning: a published checkpoint that fails verification (corrupt, truncated,
    incomplete) and a save that never finished (its temporary directory; the next save removes it)."""
    chosen, chosen_step = None, -1
    for step, path in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
        except UserError as e:
            log.warning("skipping invalid checkpoint %s: %s", path, e)
            continue
        chosen, chosen_step = path, step
        break
    for step, path in unfinished_writes(run_dir):
        if step > chosen_step:
            log.warning("skipping unfinished checkpoint %s: its save was interrupted", path)
    return chosen


def resume_checkpoint(run_dir: str, force: bool = False) -> Optional[str]:
    """The checkpoint a (re)started run resumes from: the latest valid one, or None for a fresh run.

    Refuses (UserError) when the run dir holds published checkpoints and none of them verifies: starting
    over would silently replace the run (its first save prunes them as an abandoned timeline). `force`
    starts over anyway."""
    if not os.path.isdir(run_dir):
        return None
    latest = latest_valid_checkpoint(run_dir)
    published = list_checkpoints(run_dir)
    if latest is None and published and not force:
        raise UserError(f"{os.path.join(run_dir, CHECKPOINTS)}: {len(published)} checkpoint(s), none is valid "
                        "(warnings above name them); refusing to start the run over: restore or move them "
                        "away, or pass --force")
    return latest


def read_checkpoint_state(path: str) -> dict:
    """The checkpoint's state.json: {"format", "step", "rng", "extra"} (no verification)."""
    with open(os.path.join(path, STATE)) as f:
        return json.load(f)


# ----------------------------------------------------------------------------------------------------------
# Save / load
# ----------------------------------------------------------------------------------------------------------
def _remove_dir(path: str, tag: str) -> None:
    """Rename out of the step_* namespace first, so a crash mid-delete never leaves a look-alike checkpoint."""
    doomed = f"{path}.del-{tag}"
    os.rename(path, doomed)
    shutil.rmtree(doomed, ignore_errors=True)


def _prune(root: str, run_dir: str, new_step: int, keep: int, tag: str) -> None:
    """Keep the `keep` newest checkpoints up to `new_step`; later ones belong to an abandoned timeline (the
    run resumed from an earlier step, so they were invalid or not chosen) and would shadow the new one."""
    published = list_checkpoints(run_dir)
    older = [(s, p) for s, p in published if s <= new_step]
    doomed = [p for s, p in published if s > new_step] + [p for _, p in older[:-keep]]
    for path in doomed:
        _remove_dir(path, tag)
    for name in os.listdir(root):  # leftovers of crashed saves or deletes
        if ".tmp-" in name or ".del-" in name:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def save_checkpoint(run_dir: str, step: int, model: nn.Module, optimizers=None,
                    extra_state: Optional[dict] = None, keep: int = 2, shard_plan: Optional[dict] = None) -> str:
    """Write RUN_DIR/checkpoints/step_<step>/ atomically; keep the newest `keep`; return its path.

    `extra_state` must be JSON-serialisable (tokens, flops, data-loader position, ...); the RNG states of
    every rank are added automatically. Collective when a process group is initialised. `shard_plan`: the
    expert-parallel parameters (module docstring).
    """
    if keep < 1:
        raise UserError(f"train.keep_checkpoints: {keep} must be >= 1")
    extra_state = dict(extra_state or {})
    if extra_state.get("step", step) != step:
        raise ValueError(f"extra_state['step']={extra_state['step']} disagrees with step={step}")
    root = os.path.join(run_dir, CHECKPOINTS)
    final = os.path.join(root, checkpoint_name(step))
    json.dumps(extra_state, allow_nan=False)  # fail on every rank before anything is written
    tag = str(_broadcast_from_rank0(os.getpid()))
    tmp = f"{final}.tmp-{tag}"
    if _rank() == 0:
        os.makedirs(root, exist_ok=True)
        shutil.rmtree(tmp, ignore_errors=True)
        os.makedirs(tmp)
    _barrier()

    _dcp(dcp.save, _tensor_state(model, _optimizer_list(optimizers), shard_plan), tmp)

    rng = capture_rng_state()
    if _distributed():
        all_rng: list = [None] * dist.get_world_size()
        dist.all_gather_object(all_rng, rng)
    else:
        all_rng = [rng]
    if _rank() == 0:
        _write_json(os.path.join(tmp, STATE), {"format": FORMAT, "step": step, "rng": all_rng, "extra": extra_state})
        files = {rel: {"sha256": _sha256_and_sync(os.path.join(tmp, rel)),
                       "bytes": os.path.getsize(os.path.join(tmp, rel))} for rel in _files_under(tmp)}
        _write_json(os.path.join(tmp, MANIFEST), {"format": FORMAT, "step": step, "files": files})
        _fsync_dir(tmp)
        if os.path.exists(final):  # re-saving a step (e.g. a resumed run): replace it only once ours is complete
            _remove_dir(final, tag)
        os.rename(tmp, final)
        _fsync_dir(root)
        _prune(root, run_dir, step, keep, tag)
    _barrier()
    return final


def load_checkpoint(path: str, model: nn.Module, optimizers=None, restore_rng: bool = True,
                    shard_plan: Optional[dict] = None) -> dict:
    """Verify the manifest, then load model (and optimizer) state in place; return the extra state.

    The returned dict is the `extra_state` given to `save_checkpoint` with `"step"` set. A bad checksum,
    missing or truncated file raises UserError naming the file, before anything is loaded.
    """
    error = None
    if _rank() == 0:
        try:
            verify_checkpoint(path)
        except UserError as e:
            error = str(e)
    error = _broadcast_from_rank0(error)
    if error is not None:
        raise UserError(error)
    state = read_checkpoint_state(path)
    if state.get("format") != FORMAT:
        raise UserError(f"checkpoint {path}: unsupported format {state.get('format')!r} (expected {FORMAT})")

    opts = _optimizer_list(optimizers)
    tensors = _tensor_state(model, opts, shard_plan)
    _dcp(safe_dcp_load, tensors, path)  # no arbitrary unpickling (nagmoe.train.safe_dcp)
    if shard_plan:
        tensors = _unwrap_sharded(tensors)
    set_model_state_dict(model, tensors["model"])
    if opts:
        set_optimizer_state_dict(model, opts, tensors["optim"])
    if restore_rng:
        rngs = state["rng"]
        restore_rng_state(rngs[_rank()] if _rank() < len(rngs) else rngs[0])
    extra = dict(state["extra"])
    extra["step"] = state["step"]
    return extra
