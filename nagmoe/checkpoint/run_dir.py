"""Run directories: the resolved config, provenance (git commit, versions, backends), resume checks."""
from __future__ import annotations

import copy
import json
import os
import platform
import subprocess
import sys
import time

from nagmoe.config import (RESUMABLE_KEYS, Config, config_from_dict, dump_yaml, missing_legacy_keys, set_key, to_dict,
                           yaml_load)
from nagmoe.errors import UserError
from nagmoe.safe_files import write_atomic
from nagmoe.schema import RESUMABLE_LAYOUT_KEYS

CONFIG_FILE = "config.yaml"
RUN_INFO_FILE = "run_info.json"
SUMMARY_FILE = "summary.json"


def _flatten(d: dict, prefix: str = "") -> dict:
    out = {}
    for k, v in d.items():
        key = f"{prefix}{k}"
        if isinstance(v, dict):
            out.update(_flatten(v, key + "."))
        else:
            out[key] = v
    return out


def config_differences(saved: Config, new: Config) -> list[str]:
    """Keys (other than the schedule-length and layout ones a resume may change) whose values differ."""
    a, b = _flatten(to_dict(saved)), _flatten(to_dict(new))
    may_change = set(RESUMABLE_KEYS) | set(RESUMABLE_LAYOUT_KEYS)
    return [f"{k}: {a.get(k)!r} -> {b.get(k)!r}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and k not in may_change]


def _saved_yaml(run_dir: str):
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    with open(path) as f:
        return yaml_load(f) or {}


def read_saved_config(run_dir: str):
    """The run's saved config (None without one); keys it predates take their legacy values."""
    data = _saved_yaml(run_dir)
    return None if data is None else config_from_dict(data, validate=False, legacy=True)


def legacy_keys_of(run_dir: str) -> dict:
    """{key: legacy value} for the keys the run dir's saved config predates ({} without a saved config)."""
    data = _saved_yaml(run_dir)
    return {} if data is None else missing_legacy_keys(data)


def adopt_legacy_values(run_dir: str, cfg: Config) -> dict:
    """On resume: set in `cfg` the legacy value of every key the run dir's saved config predates, so the run
    continues with the behaviour it started with (the migration rule); returns {key: value} adopted."""
    legacy = legacy_keys_of(run_dir)
    for key, value in legacy.items():
        set_key(cfg, key, value)
    return legacy


def resume_differences(run_dir: str, new: Config) -> list[str]:
    """`config_differences` between the run dir's saved config and `new` as a resume would apply it (the keys
    the saved config predates take their legacy values in both)."""
    new = copy.deepcopy(new)
    adopt_legacy_values(run_dir, new)
    return config_differences(read_saved_config(run_dir), new)


def prepare_run_dir(run_dir: str, cfg: Config, resuming: bool, force: bool = False) -> None:
    """Refuse a resume whose config differs beyond the schedule-length and layout keys (unless forced); write
    the resolved config atomically."""
    os.makedirs(run_dir, exist_ok=True)
    saved = read_saved_config(run_dir)
    if resuming and saved is not None:
        diffs = config_differences(saved, cfg)
        if diffs and not force:
            raise UserError(f"{os.path.join(run_dir, CONFIG_FILE)}: resuming with a different config "
                            f"({'; '.join(diffs)}); only {', '.join(RESUMABLE_KEYS)} and the layout "
                            f"({', '.join(RESUMABLE_LAYOUT_KEYS)}, the world size) may change (pass --force to "
                            "override)")
    write_atomic(os.path.join(run_dir, CONFIG_FILE), dump_yaml(cfg), durable=True)


def git_commit() -> str:
    here = os.path.dirname(os.path.abspath(__file__))
    try:
        out = subprocess.run(["git", "rev-parse", "HEAD"], cwd=here, capture_output=True, text=True, timeout=5)
        dirty = subprocess.run(["git", "status", "--porcelain", "--untracked-files=no"], cwd=here,
                               capture_output=True, text=True, timeout=5)
    except (OSError, subprocess.TimeoutExpired):
        return "unknown"
    if out.returncode:
        return "unknown"
    return out.stdout.strip() + ("-dirty" if dirty.stdout.strip() else "")


def _replace_json(path: str, obj) -> None:
    """Write `obj` beside `path` and move it over: a reader sees the old file or the new one, never half; through
    a fresh temporary (nagmoe.safe_files), so a name planted in a shared run dir is never written through."""
    write_atomic(path, json.dumps(obj, indent=1), durable=True)


def update_run_info(run_dir: str, key: str, value) -> bool:
    """Set one key of this start's run_info.json (atomically; the rest, `previous` included, kept). False, and
    nothing written, when the file is missing or not a JSON object (someone else's file is not rewritten)."""
    path = os.path.join(run_dir, RUN_INFO_FILE)
    try:
        with open(path) as f:
            info = json.load(f)
    except (OSError, ValueError):
        return False
    if not isinstance(info, dict):
        return False
    info[key] = value
    _replace_json(path, info)
    return True


def write_run_info(run_dir: str, backends: dict, device: str, extra: dict | None = None) -> dict:
    import numpy
    import torch

    import nagmoe

    info = {
        "started": time.strftime("%Y-%m-%dT%H:%M:%S%z"),
        "argv": sys.argv,
        "git_commit": git_commit(),
        "versions": {"nagmoe": nagmoe.__version__, "python": platform.python_version(),
                     "torch": torch.__version__, "numpy": numpy.__version__},
        "host": platform.node(),
        "device": device,
        "backends": backends,
        **(extra or {}),
    }
    path = os.path.join(run_dir, RUN_INFO_FILE)
    history = []
    if os.path.isfile(path):  # keep earlier (pre-resume) starts
        try:
            with open(path) as f:
                prev = json.load(f)
            history = prev.get("previous", []) + [{k: v for k, v in prev.items() if k != "previous"}]
        except (OSError, ValueError):
            history = []
    info["previous"] = history
    _replace_json(path, info)
    return info


def write_summary(run_dir: str, summary: dict) -> None:
    path = os.path.join(run_dir, SUMMARY_FILE)
    _replace_json(path, summary)
