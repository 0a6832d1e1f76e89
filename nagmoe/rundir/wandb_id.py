"""The wandb run id of a run dir: random, stored in RUN_DIR/wandb_id at the run's first start, read back on
every resume (issue 41). The run dir's base name was the id before: `runs/paper/nag-r80-s0` and
`runs/sweep/nag-r80-s0` then shared one wandb run, and with `resume="allow"` the second overwrote the first's
history. A run dir that started before this file existed (checkpoints, no wandb_id) keeps its base name, so
its wandb history continues (the migration rule)."""
from __future__ import annotations

import os
import re
import secrets
import string

from nagmoe.base.errors import UserError, shown
from nagmoe.base.files import read_text, write_atomic
from nagmoe.rundir.names import WANDB_ID_FILE

ALPHABET = string.ascii_lowercase + string.digits
ID_LENGTH = 16
VALID_ID = re.compile(r"[A-Za-z0-9._-]{1,128}")  # what wandb accepts in a run id, bounded


def new_wandb_id() -> str:
    return "".join(secrets.choice(ALPHABET) for _ in range(ID_LENGTH))


def ensure_wandb_id(run_dir: str, resuming: bool) -> None:
    """At a fresh start (nothing to resume) give the run dir its own id; a resume keeps whatever it has."""
    path = os.path.join(run_dir, WANDB_ID_FILE)
    if not resuming and not os.path.lexists(path):
        write_atomic(path, new_wandb_id() + "\n")
    elif os.path.lexists(path):
        read_wandb_id(run_dir)  # a bad file is one line at start, not when wandb starts


def read_wandb_id(run_dir: str) -> str:
    """The run dir's wandb id: RUN_DIR/wandb_id, checked, or the base name for a run dir from before it."""
    path = os.path.join(run_dir, WANDB_ID_FILE)
    if not os.path.lexists(path):
        return os.path.basename(os.path.abspath(run_dir))
    if os.path.isfile(path) and os.path.getsize(path) > 1024:
        raise UserError(f"{shown(path)}: {os.path.getsize(path)} bytes, not a wandb run id")
    run_id = read_text(path).strip()
    if not VALID_ID.fullmatch(run_id):
        raise UserError(f"{shown(path)}: {shown(run_id, 60)} is not a wandb run id (1 to 128 of A-Z a-z 0-9 . _ -)")
    return run_id
