"""Which checkpoint a run dir resumes from, or is read from by eval/generate/analyze/consolidate."""
from __future__ import annotations

import logging
import os
from typing import Optional

from nagmoe.checkpoint.files import (CHECKPOINTS, is_valid_checkpoint, list_checkpoints, read_checkpoint_state,
                                     unfinished_writes, verify_checkpoint)
from nagmoe.checkpoint.publish import fresh_tag, remove_replaced
from nagmoe.base.errors import UserError
from nagmoe.rundir.names import HISTORY_FILES
from nagmoe.base.files import fsync_dir

# What a run dir holds once a run has started: finding any of it with no valid checkpoint means a run would
# be started over on top of another one's history.

log = logging.getLogger("nagmoe.checkpoint")  # the package's one logger name


RESCANS = 5  # passes over checkpoints/ while another writer renames or prunes under us (the take-over race)


class CheckpointsChanged(Exception):
    """Another writer renamed or pruned a directory of checkpoints/ while it was being scanned (an old lease
    holder finishing the publish it had started before a take-over: docs/decisions.md); scan again."""


def _newest_valid(run_dir: str, rescan: bool = False) -> tuple[Optional[str], int]:
    """(path, step) of the newest published checkpoint that verifies, (None, -1) if none; each newer one
    that fails is named in a warning. Hashes only what it has to (newest first). `rescan`: a step_N that
    vanishes while it is verified (moved by another writer) raises CheckpointsChanged instead."""
    for step, path in reversed(list_checkpoints(run_dir)):
        try:
            verify_checkpoint(path)
        except UserError as e:
            if rescan and not os.path.lexists(path):
                raise CheckpointsChanged(f"{path} vanished while it was verified") from None
            log.warning("skipping invalid checkpoint %s: %s", path, e)
            continue
        return path, step
    return None, -1


def _warn_unfinished(run_dir: str, after_step: int) -> None:
    for step, path in unfinished_writes(run_dir):
        if step > after_step:
            log.warning("skipping unfinished checkpoint %s: its save was interrupted", path)


def latest_valid_checkpoint(run_dir: str) -> Optional[str]:
    """Newest checkpoint directory under RUN_DIR/checkpoints whose manifest verifies, or None. Each newer one
    passed over is named in a warning: a published checkpoint that fails verification (corrupt, truncated,
    incomplete) and a save that never finished (its temporary directory)."""
    chosen, step = _newest_valid(run_dir)
    _warn_unfinished(run_dir, step)
    return chosen


def recover_unfinished(run_dir: str, after_step: int) -> Optional[tuple[str, int]]:
    """Publish the newest complete temporary directory (its manifest verifies) of a step after `after_step`
    (the newest valid checkpoint's): a save killed after its manifest but before its rename, e.g. between
    moving an invalid step_N away and renaming the replacement in. `.del-` directories are never recovered.
    Returns (path published, step), or None. Run before anything of the run dir (metrics) is truncated.

    Raises CheckpointsChanged when another writer renames that directory (or its step_N) under us — the
    old holder of a taken-over lease publishing the same save — instead of crashing on a vanished path or
    moving the checkpoint it has just published away: the caller scans again (`resume_checkpoint`)."""
    for step, tmp in reversed(unfinished_writes(run_dir)):
        if step <= after_step:
            continue
        if not is_valid_checkpoint(tmp):
            if not os.path.lexists(tmp):
                raise CheckpointsChanged(f"{tmp} vanished while it was verified")
            continue
        final = os.path.join(os.path.dirname(tmp), os.path.basename(tmp).split(".tmp-")[0])
        try:
            if os.path.lexists(final):  # an invalid step_N (a valid one would not be older than the newest valid)
                # a random `.del-` name: a fixed one can be planted; put back if it was `tmp`, just published by
                # another writer
                remove_replaced(final, tmp, fresh_tag())
            os.rename(tmp, final)
        except FileNotFoundError:  # tmp or step_N renamed away by another writer between the checks and here
            raise CheckpointsChanged(f"{tmp} or {final} was moved by another writer") from None
        fsync_dir(os.path.dirname(final))
        log.warning("recovered checkpoint %s from the complete save %s (interrupted before it was published)",
                    final, tmp)
        return final, step
    return None


def _newest_after_recovery(run_dir: str) -> tuple[Optional[str], int]:
    """The newest valid checkpoint once a complete interrupted save is published (`recover_unfinished`). When
    another writer renames or prunes under us, scan again, at most RESCANS times; then take the newest valid
    checkpoint as it stands, publishing nothing."""
    for _ in range(RESCANS):
        try:
            latest, step = _newest_valid(run_dir, rescan=True)
            return recover_unfinished(run_dir, step) or (latest, step)
        except CheckpointsChanged as e:
            log.warning("checkpoints of %s changed under this resume (%s): scanning again", run_dir, e)
    return _newest_valid(run_dir)


def run_history(run_dir: str) -> list[str]:
    """What of a started run the run dir holds: history files and checkpoint directories of any kind."""
    found = [name for name in HISTORY_FILES if os.path.exists(os.path.join(run_dir, name))]
    root = os.path.join(run_dir, CHECKPOINTS)
    entries = sorted(os.listdir(root)) if os.path.isdir(root) else []
    if entries:
        found.append(f"{CHECKPOINTS}/ ({', '.join(entries[:3])}{', ...' if len(entries) > 3 else ''})")
    return found


def resume_checkpoint(run_dir: str, start_over: bool = False) -> Optional[str]:
    """The checkpoint a (re)started run resumes from (verified: load it with `verified=True`), or None for
    a fresh run.

    First publishes a complete save that was interrupted before its rename (`recover_unfinished`); another
    writer renaming or pruning checkpoints meanwhile (the old holder of a taken-over lease) makes it scan again,
    a bounded number of times, and take the newest valid checkpoint as it then stands. Refuses
    (UserError) when there is no valid checkpoint but the run dir holds a started run's history (metrics,
    run_info, summary, checkpoint directories): starting over would truncate its metrics and its first save
    would prune what is left. `start_over` (train --start-over) starts over anyway."""
    if not os.path.isdir(run_dir):
        return None
    latest, step = _newest_after_recovery(run_dir)
    _warn_unfinished(run_dir, step)
    history = run_history(run_dir) if latest is None else []
    if history and not start_over:
        raise UserError(f"{run_dir}: holds {', '.join(history)}; of its checkpoints none is valid (warnings "
                        "above name any); refusing to start the run over: restore or move them away, or pass "
                        "--start-over")
    return latest


def saved_layout(path: str, run_dir: str) -> dict:
    """{"world_size", "ep", "micro_batch_tokens"} a checkpoint was saved on. World size and EP degree are the
    checkpoint's own record (state.json "layout"; a checkpoint older than that record: its number of RNG
    states and the run dir's parallel.ep); train.micro_batch_tokens is the run dir's config.yaml, i.e. the
    last start's (a resume refused here has not written it)."""
    from nagmoe.rundir.info import read_saved_config

    state = read_checkpoint_state(path)  # checked: `rng` a list, `layout` an object of integers (else UserError)
    layout = state.get("layout") or {}
    world_size = layout.get("world_size", len(state["rng"]))
    ep = layout.get("ep")
    config = read_saved_config(run_dir)
    return {"world_size": world_size, "ep": ep if ep is not None else config.parallel.ep if config is not None else 1,
            "micro_batch_tokens": config.train.micro_batch_tokens if config is not None else None}


def check_resume_layout(path: str, run_dir: str, cfg, world_size: int) -> Optional[str]:
    """Before a resume writes anything: None when checkpoint `path` of `run_dir` was saved on the layout
    (world size, parallel.ep, train.micro_batch_tokens) this run has, else a one-line description of the
    change ("world size 4 -> 2, parallel.ep 2 -> 1"). The torch engine resumes on another layout (its load
    reshards: nagmoe.checkpoint.torch_layout); parallel.engine=deepspeed resumes on the layout it saved on
    only, so there a change is a UserError, whatever --accept-config-change says."""
    old = saved_layout(path, run_dir)
    new = {"world_size": world_size, "ep": cfg.parallel.ep, "micro_batch_tokens": cfg.train.micro_batch_tokens}
    names = {"world_size": "world size", "ep": "parallel.ep", "micro_batch_tokens": "train.micro_batch_tokens"}
    changes = [f"{names[k]} {old[k]} -> {new[k]}" for k in names if old[k] != new[k]]
    if not changes:
        return None
    change = ", ".join(changes)
    if cfg.parallel.engine == "deepspeed":
        raise UserError(f"checkpoint {path}: parallel.engine=deepspeed resumes on the layout it was saved on only "
                        f"({change}); resume with that layout (only parallel.engine=torch reshards a checkpoint)")
    return change
