"""Run directories: the resolved config, provenance (git commit, versions, backends), resume checks."""
from __future__ import annotations

import copy
import json
import os
import platform
import stat
import subprocess
import sys
import time

from nagmoe.config import RESUMABLE_KEYS, Config, config_from_dict, dump_yaml, missing_legacy_keys, set_key, to_dict
from nagmoe.base.errors import UserError, shown
from nagmoe.base.files import NUMBER, expect, expect_object, read_json, write_atomic
from nagmoe.rundir.names import CONFIG_FILE, RUN_INFO_FILE, SUMMARY_FILE
from nagmoe.config.schema import RESUMABLE_LAYOUT_KEYS



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
    return [f"{k}: {shown(a.get(k), 60)} -> {shown(b.get(k), 60)}" for k in sorted(set(a) | set(b))
            if a.get(k) != b.get(k) and k not in may_change]


def _saved_yaml(run_dir: str):
    path = os.path.join(run_dir, CONFIG_FILE)
    if not os.path.isfile(path):
        return None
    from nagmoe.config.yaml_files import read_yaml

    return read_yaml(path) or {}  # UTF-8, bounded; a torn or foreign file is one line naming it


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


def prepare_run_dir(run_dir: str, cfg: Config, resuming: bool, accept_config_change: bool = False) -> None:
    """Refuse a resume whose config differs beyond the schedule-length and layout keys (unless
    `accept_config_change`, train --accept-config-change); write
    the resolved config atomically."""
    os.makedirs(run_dir, exist_ok=True)
    saved = read_saved_config(run_dir)
    if resuming and saved is not None:
        diffs = config_differences(saved, cfg)
        if diffs and not accept_config_change:
            raise UserError(f"{os.path.join(run_dir, CONFIG_FILE)}: resuming with a different config "
                            f"({'; '.join(diffs)}); only {', '.join(RESUMABLE_KEYS)} and the layout "
                            f"({', '.join(RESUMABLE_LAYOUT_KEYS)}, the world size) may change (pass --accept-config-change "
                            "to resume anyway)")
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
    a fresh temporary (nagmoe.base.files), so a name planted in a shared run dir is never written through."""
    write_atomic(path, json.dumps(obj, indent=1), durable=True)


def read_run_info(run_dir: str, own_only: bool = False) -> dict | None:
    """run_info.json checked for what its readers rely on (None when there is none): an object whose `previous`
    (the earlier starts) is a list of objects and whose `git_commit` is a string; anything else is a UserError
    naming the file and field, so a resume stops before it rewrites the file and loses its history.

    `own_only` (the trainer, which replaces the file): a symlink or a hard link planted at the name is not this
    run's file, so it is neither read nor taken for a history (None); the rename that follows replaces it."""
    path = os.path.join(run_dir, RUN_INFO_FILE)
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return None
    if own_only and (stat.S_ISLNK(st.st_mode) or st.st_nlink > 1):
        return None
    where = shown(path)
    info = expect_object(read_json(path), where)
    for i, start in enumerate(expect(info, "previous", list, where, required=False, default=[])):
        expect_object(start, f"{where} previous[{i}]")
    expect(info, "git_commit", str, where, required=False)
    return info


def update_run_info(run_dir: str, key: str, value) -> bool:
    """Set one key of this start's run_info.json (atomically; the rest, `previous` included, kept). False, and
    nothing written, when the file is missing or does not pass `read_run_info` (someone else's file is not
    rewritten; this start's was checked when it was written)."""
    try:
        info = read_run_info(run_dir, own_only=True)
    except UserError:
        return False
    if info is None:
        return False
    info[key] = value
    _replace_json(os.path.join(run_dir, RUN_INFO_FILE), info)
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
    prev = read_run_info(run_dir, own_only=True)  # earlier starts kept; a bad file: UserError, nothing written
    info["previous"] = [] if prev is None else prev.get("previous", []) + [
        {k: v for k, v in prev.items() if k != "previous"}]
    _replace_json(os.path.join(run_dir, RUN_INFO_FILE), info)
    return info


# summary.json's fields as its readers (the report, `nagmoe flops --run-dir`) rely on them; each may be absent
# (older runs) or null (nothing measured), else of this type.
SUMMARY_FIELDS = {"val_bpb": NUMBER, "steps": int, "tokens": NUMBER, "flops": NUMBER, "wall_time_s": NUMBER,
                  "skip_rate": NUMBER, "run_skip_rate": NUMBER, "flops_executed": NUMBER, "flop_budget": NUMBER,
                  "executed_fractions": (list, *NUMBER), "skip_per_sublayer": list}
NUMBER_LISTS = ("executed_fractions", "skip_per_sublayer")


def read_summary(run_dir: str) -> dict | None:
    """summary.json checked against SUMMARY_FIELDS (None when there is none; a bad one is a UserError naming
    the file and field)."""
    path = os.path.join(run_dir, SUMMARY_FILE)
    if not os.path.lexists(path):
        return None
    where = shown(path)
    summary = expect_object(read_json(path), where)
    for key, kinds in SUMMARY_FIELDS.items():
        if summary.get(key) is not None:
            expect(summary, key, kinds, where)
    for key in NUMBER_LISTS:
        if isinstance(summary.get(key), list):
            for i, value in enumerate(summary[key]):
                expect({f"{key}[{i}]": value}, f"{key}[{i}]", NUMBER, where)
    return summary


def write_summary(run_dir: str, summary: dict) -> None:
    path = os.path.join(run_dir, SUMMARY_FILE)
    _replace_json(path, summary)
