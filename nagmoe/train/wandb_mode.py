"""`log.wandb: auto` (issue 27; the paper configs' setting): a compute node without network must never hang or
fail a run because of its logger. Online only when credentials exist (WANDB_API_KEY, or a ~/.netrc entry for
the service's host) and the service answers an HTTP request within `timeout_s`; otherwise offline, with the
command that uploads the run later. `off`, `offline` and `online` are taken as set.
"""
from __future__ import annotations

import netrc
import os
import urllib.error
import urllib.parse
import urllib.request
from typing import Optional

DEFAULT_BASE_URL = "https://api.wandb.ai"
PROBE_TIMEOUT_S = 3.0


def base_url() -> str:
    return os.environ.get("WANDB_BASE_URL", DEFAULT_BASE_URL).rstrip("/")


def has_credentials(url: str) -> bool:
    if os.environ.get("WANDB_API_KEY"):
        return True
    host = urllib.parse.urlparse(url).hostname or ""
    try:
        return netrc.netrc().authenticators(host) is not None
    except (FileNotFoundError, netrc.NetrcParseError, OSError):
        return False


def service_answers(url: str, timeout_s: float = PROBE_TIMEOUT_S) -> bool:
    """Any HTTP response (an error status too) within the timeout: the service is reachable."""
    try:
        with urllib.request.urlopen(f"{url}/healthz", timeout=timeout_s):
            return True
    except urllib.error.HTTPError:
        return True
    except (urllib.error.URLError, OSError, ValueError):  # refused, unresolvable, timed out
        return False


def resolve_wandb_mode(setting: str, timeout_s: float = PROBE_TIMEOUT_S) -> tuple[str, Optional[str]]:
    """(the mode wandb runs in, why `auto` chose offline or None)."""
    if setting != "auto":
        return setting, None
    url = base_url()
    if not has_credentials(url):
        return "offline", "no wandb credentials (WANDB_API_KEY or ~/.netrc)"
    if not service_answers(url, timeout_s):
        return "offline", f"{url} did not answer within {timeout_s:.0f} s"
    return "online", None


def sync_hint(run_dir: str) -> str:
    return f"wandb sync {os.path.join(os.path.abspath(run_dir), 'wandb', 'offline-run-*')}"


def start_wandb(cfg, run_dir: str):
    """The run's wandb logger (rank 0 calls it), or None with `log.wandb: off`, or with `auto` where wandb is not
    installed (a warning); `offline`/`online` without wandb is a UserError naming the extra."""
    from nagmoe.base.errors import UserError
    from nagmoe.base.errors import warn

    setting = cfg.log.wandb
    if setting == "off":
        return None
    try:
        import wandb
    except ImportError:
        if setting == "auto":  # auto never stops a run: no logger where wandb is not installed
            warn("log.wandb=auto: wandb is not installed; logging to metrics.jsonl only")
            return None
        raise UserError(f"log.wandb={setting} needs wandb: pip install 'nagmoe[wandb]'") from None
    from nagmoe.config import to_dict
    from nagmoe.rundir.wandb_id import read_wandb_id

    mode, why_offline = resolve_wandb_mode(setting)  # auto: online only with credentials and an answer
    if why_offline is not None:
        warn(f"log.wandb=auto: offline ({why_offline}); upload later with: {sync_hint(run_dir)}")
    return wandb.init(mode=mode, dir=run_dir, project=cfg.log.project,
                      name=os.path.basename(os.path.abspath(run_dir)), config=to_dict(cfg),
                      resume="allow", id=read_wandb_id(run_dir))  # unique per run dir (wandb_id.py)


def wandb_record(rec: dict) -> dict:
    """A metrics record as wandb receives it: None values left out; the router report's per-layer lists as
    {"layer_0": v, ...}, so each layer is a chart (wandb charts scalars, not lists); the report's scalars keep
    their keys (`router.max_over_mean_p90`, ...), so a resumed run's series continue."""
    out = {k: v for k, v in rec.items() if v is not None}
    router = out.get("router")
    if isinstance(router, dict):
        out["router"] = {k: {f"layer_{i}": x for i, x in enumerate(v)} if isinstance(v, list) else v
                         for k, v in router.items()}
    return out
