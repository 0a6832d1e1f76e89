"""Which checkpoint a run dir resumes from, or is read from by eval/generate/analyze/consolidate."""
from __future__ import annotations

import logging
import os
from typing import Optional

from nagmoe.checkpoint.files import CHECKPOINTS, list_checkpoints, unfinished_writes, verify_checkpoint
from nagmoe.errors import UserError

log = logging.getLogger("nagmoe.checkpoint")  # the package's one logger name


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
