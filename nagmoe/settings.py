"""Settings that describe the machine or cluster rather than the experiment, read from the environment
(NAGMOE_DIST_TIMEOUT_S, NAGMOE_LEASE_*): a bad value is a UserError naming the variable (exit 2)."""
from __future__ import annotations

import math
import os
from typing import Mapping, Optional

from nagmoe.errors import UserError


def env_seconds(name: str, default: float, environ: Optional[Mapping[str, str]] = None) -> float:
    """A positive, finite number of seconds from environment variable `name`, `default` when unset or empty."""
    env = os.environ if environ is None else environ
    raw = env.get(name)
    if raw is None or raw == "":
        return default
    try:
        value = float(raw)
    except ValueError:
        value = -1.0
    if not (value > 0 and math.isfinite(value)):
        raise UserError(f"environment variable {name}={raw!r} must be a positive number of seconds")
    return value


LEASE_REFRESH_ENV, LEASE_STALE_ENV = "NAGMOE_LEASE_REFRESH_S", "NAGMOE_LEASE_STALE_S"
DEFAULT_LEASE_REFRESH_S, DEFAULT_LEASE_STALE_S = 5.0, 600.0


def lease_intervals(environ: Optional[Mapping[str, str]] = None) -> tuple[float, float]:
    """(refresh_s, stale_s) of the run-dir lease: how often the holder rewrites it, and how long unrefreshed
    before another trainer may take it over."""
    return (env_seconds(LEASE_REFRESH_ENV, DEFAULT_LEASE_REFRESH_S, environ),
            env_seconds(LEASE_STALE_ENV, DEFAULT_LEASE_STALE_S, environ))
