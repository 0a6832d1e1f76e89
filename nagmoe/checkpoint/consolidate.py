"""One single-file checkpoint from a sharded (DCP) one, for laptops: generation, the report, inspection.

`consolidate_run(RUN_DIR)` builds the full single-device model of the run's config (all experts), loads the
newest valid checkpoint into it in this one process — DCP reads each expert from whichever rank's shard
holds it, whatever the world size and EP degree of the run; a DeepSpeed-engine checkpoint is read through
its own layout (nagmoe.checkpoint.reader) — and writes `RUN_DIR/consolidated.pt`:

    {"format": "nagmoe-consolidated", "version": 1, "config": <Config as a dict>, "model": <state dict>,
     "step": int, "progress": {...}, "checkpoint": <source path>}

tensors and plain python only, so `torch.load(..., weights_only=True)` reads it. The optimizer state is not
included (resume from the DCP checkpoint instead).
"""
from __future__ import annotations

import os
from typing import Optional

import torch
import torch.distributed as dist
from torch import nn

from nagmoe.checkpoint.reader import load_model_weights
from nagmoe.checkpoint.resume import latest_valid_checkpoint
from nagmoe.rundir.info import CONFIG_FILE, read_saved_config
from nagmoe.config import Config, config_from_dict, to_dict
from nagmoe.base.errors import UserError
from nagmoe.model import build_model
from nagmoe.base.files import atomic_writer

CONSOLIDATED = "consolidated.pt"
FORMAT = "nagmoe-consolidated"
VERSION = 1


def consolidate_run(run_dir: str, checkpoint: Optional[str] = None, out: Optional[str] = None) -> str:
    """Write the consolidated checkpoint of `run_dir` (default: its newest valid checkpoint) to `out`
    (default RUN_DIR/consolidated.pt) atomically; return the path. Single process only."""
    if dist.is_available() and dist.is_initialized():
        raise UserError("nagmoe consolidate runs in one process (not under torchrun/srun)")
    if not os.path.isdir(run_dir):
        raise UserError(f"run dir {run_dir} does not exist")
    cfg = read_saved_config(run_dir)
    if cfg is None:
        raise UserError(f"{os.path.join(run_dir, CONFIG_FILE)} is missing: not a run dir")
    verified = checkpoint is None
    if checkpoint is None:
        checkpoint = latest_valid_checkpoint(run_dir)
        if checkpoint is None:
            raise UserError(f"{run_dir}: no valid checkpoint under checkpoints/")
    model = build_model(cfg.model)
    extra = load_model_weights(checkpoint, model, verified=verified)  # the manifest is checked once, first
    payload = {"format": FORMAT, "version": VERSION, "config": to_dict(cfg),
               "model": {k: v.detach().cpu().contiguous() for k, v in model.state_dict().items()},
               "step": int(extra["step"]), "progress": extra.get("progress", {}),
               "checkpoint": os.path.abspath(checkpoint)}
    out = out or os.path.join(run_dir, CONSOLIDATED)
    with atomic_writer(out, binary=True, durable=True) as f:  # a fresh temporary, renamed (nagmoe.base.files)
        torch.save(payload, f)
    return out


def load_consolidated(path: str) -> tuple[Config, dict]:
    """(config, full model state dict) of a consolidated checkpoint, on CPU."""
    if not os.path.isfile(path):
        raise UserError(f"consolidated checkpoint {path} does not exist")
    try:
        payload = torch.load(path, map_location="cpu", weights_only=True)
    except Exception as e:  # a truncated or foreign file: one line, not a traceback
        raise UserError(f"{path}: not a readable consolidated checkpoint ({type(e).__name__})") from None
    if not isinstance(payload, dict) or payload.get("format") != FORMAT:
        raise UserError(f"{path}: not a nagmoe consolidated checkpoint")
    if payload.get("version") != VERSION:
        raise UserError(f"{path}: consolidated format version {payload.get('version')!r}, expected {VERSION}")
    return config_from_dict(payload["config"], validate=False), payload["model"]


def load_consolidated_model(path: str, device: str = "cpu") -> tuple[Config, nn.Module]:
    """The single-device model of a consolidated checkpoint, in eval mode."""
    cfg, state = load_consolidated(path)
    model = build_model(cfg.model)
    model.load_state_dict(state)
    model.set_precision(cfg.train.precision)
    return cfg, model.to(device).eval()
