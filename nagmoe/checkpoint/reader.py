"""One reader for every engine's checkpoint: the whole model in one process, for eval, generate, analyze and
consolidate. The layout is told by state.json's "format" (1: torch engine, DCP; "deepspeed-1": DeepSpeed
engine; "weights-1": a weights-only milestone of either engine, nagmoe/checkpoint/milestone.py); either way the
manifest is verified first and nothing outside the allow-lists is unpickled."""
from __future__ import annotations

from torch import nn

from nagmoe.checkpoint import deepspeed_layout, milestone, torch_layout
from nagmoe.checkpoint.files import extra_with_step, read_checkpoint_state, verify_checkpoint


def checkpoint_format(path: str):
    """state.json's "format" of checkpoint `path` (call after verifying it)."""
    return read_checkpoint_state(path)["format"]  # checked (read_checkpoint_state: a bad one is a UserError)


def load_model_weights(path: str, model: nn.Module, verified: bool = False) -> dict:
    """Load the full model state of checkpoint or milestone `path` (any engine) into the single-device `model`;
    return the checkpoint's extra state with "step" set. No RNG is restored, no optimizer state is read. The
    manifest is verified first unless the caller just did (`verified`, e.g. from latest_valid_checkpoint)."""
    if not verified:
        verify_checkpoint(path)
    fmt = checkpoint_format(path)
    if fmt == deepspeed_layout.FORMAT:
        model.load_state_dict(deepspeed_layout.deepspeed_model_state(path, verified=True))
        return extra_with_step(read_checkpoint_state(path))
    if fmt == milestone.FORMAT:
        return milestone.load_milestone(path, model, verified=True)
    return torch_layout.load_checkpoint(path, model, None, restore_rng=False, verified=True)
