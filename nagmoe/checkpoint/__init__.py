"""Checkpoints, for every engine and every command, in one package: the formats only (nothing here imports
nagmoe.train or nagmoe.parallel: the engines and commands import from it). The run dir around them, its names,
config, provenance and lease, is nagmoe/rundir/, which this package imports and never the reverse.

  files.py            the shared step_N/ layout: names, hashing, manifest verification, listing, state.json
  publish.py          the end of every save: state.json + manifest, atomic rename, pruning old checkpoints
  torch_layout.py     the torch engine's checkpoint: DCP tensors (EP experts as DTensors), save and load
  async_save.py       a torch-engine save in the background: staged, written on a side gloo group, each rank's
                      own files hashed, rank 0 publishing; at most one in flight, settled collectively
  save_verdict.py     a failed save's verdict, shared so that every rank raises the same line at once
  deepspeed_layout.py the DeepSpeed engine's files and the whole-model reader of them
  safe_dcp.py         DCP loading without arbitrary unpickling (restricted unpickler, weights_only planner)
  rng.py              every RNG state as JSON; which state a rank restores on another world size
  resume.py           which checkpoint a run resumes from (newest valid; refusing to start over silently), and
                      the layout it was saved on (another one: resharded by the torch engine, refused on DeepSpeed)
  milestone.py        weights-only milestones (RUN_DIR/milestones/, never resumed from): save, load, listing
  reader.py           one reader for every layout and milestone: the whole model in one process
  consolidate.py      one single-file checkpoint (consolidated.pt) from either layout
"""
from nagmoe.checkpoint.deepspeed_layout import deepspeed_model_state
from nagmoe.checkpoint.files import (CHECKPOINTS, MANIFEST, STATE, checkpoint_name, list_checkpoints,
                                     read_checkpoint_state, unfinished_writes, verify_checkpoint)
from nagmoe.checkpoint.milestone import list_milestones, load_milestone, save_milestone
from nagmoe.checkpoint.reader import checkpoint_format, load_model_weights
from nagmoe.checkpoint.resume import check_resume_layout, latest_valid_checkpoint, resume_checkpoint
from nagmoe.checkpoint.rng import capture_rng_state, restore_rng_state
from nagmoe.checkpoint.safe_dcp import UnsafeCheckpoint, safe_dcp_load
from nagmoe.checkpoint.torch_layout import load_checkpoint, save_checkpoint

__all__ = [
    "CHECKPOINTS", "MANIFEST", "STATE", "UnsafeCheckpoint", "capture_rng_state", "check_resume_layout",
    "checkpoint_format",
    "checkpoint_name", "deepspeed_model_state", "latest_valid_checkpoint", "list_checkpoints", "list_milestones",
    "load_checkpoint", "load_milestone", "load_model_weights",
    "read_checkpoint_state", "restore_rng_state", "resume_checkpoint", "safe_dcp_load", "save_checkpoint",
    "save_milestone",
    "unfinished_writes", "verify_checkpoint",
]
