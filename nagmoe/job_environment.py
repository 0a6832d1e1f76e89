"""What a job learns from its environment (Slurm and torchrun variables), validated: a bad value is a
UserError naming the variable (exit 2) at start, before anything is written."""
from __future__ import annotations

import os
from typing import Mapping, Optional

from nagmoe.errors import UserError, shown

RESTART_COUNT_ENV = "SLURM_RESTART_COUNT"


def slurm_restart_count(environ: Optional[Mapping[str, str]] = None) -> int:
    """How many times Slurm has requeued this job (0 when unset or empty: a first start or no Slurm)."""
    env = os.environ if environ is None else environ
    raw = env.get(RESTART_COUNT_ENV) or ""
    if raw == "":
        return 0
    if not (raw.isascii() and raw.isdigit() and len(raw) <= 9):
        raise UserError(f"environment variable {RESTART_COUNT_ENV}={shown(raw, 40)} must be a count (0 to 999999999)")
    return int(raw)
