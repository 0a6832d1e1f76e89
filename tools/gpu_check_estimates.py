"""The memory estimates the GPU check sets its measured peaks beside, computed ahead of time on a CPU (issue 39).

A GPU is lent for minutes: the estimator's probes (nagmoe/train/memory.py, activations measured on the CPU under
CUDA's autocast rules of the GPU machine's torch) must not run there. They run here and are committed in
tools/gpu_check_estimates.json, one entry per training config of the check and torch version of CUDA's rules
(RULES: the GPU machine's torch), each with a fingerprint of what the estimate depends on: the config at the
check's size, the layout, the rules version and the code of the estimator and the model (syntax trees, so a
comment does not count). An entry whose fingerprint no longer matches is stale: the check records
"estimate stale" instead of a number, and tests/perf/test_gpu_check_estimates.py fails until it is rewritten:

    python tools/gpu_check_estimates.py --write    # recompute every entry (well under a minute on 2 cores)
    python tools/gpu_check_estimates.py --check    # exit 1 naming each stale or missing entry
"""
from __future__ import annotations

import argparse
import ast
import hashlib
import json
import os
import sys

from gpu_check_common import REPO
from gpu_check_configs import PAPER, SIZES, micro_batch_tokens, paper_config

ESTIMATES = os.path.join(REPO, "tools", "gpu_check_estimates.json")
RULES = ("2.11",)  # the GPU machine's torch (tools/gpu_check.sh); add a version when its torch changes
# what the estimate's numbers depend on besides the config: the estimator, the model it probes, the rules tier
CODE = ("nagmoe/train/memory.py", "nagmoe/train/speed.py", "nagmoe/model", "nagmoe/ops", "nagmoe/schema.py",
        "nagmoe/cuda_rules/table.py", "nagmoe/cuda_rules/tier.py")
EP, WORLD = 1, 1  # the check trains each config on one GPU


def _code_files() -> list[str]:
    files = []
    for rel in CODE:
        path = os.path.join(REPO, rel)
        if os.path.isdir(path):
            files += sorted(os.path.join(rel, f) for f in os.listdir(path) if f.endswith(".py"))
        else:
            files.append(rel)
    return files


def code_digest() -> str:
    h = hashlib.sha256()
    for rel in _code_files():
        with open(os.path.join(REPO, rel)) as f:
            h.update(rel.encode() + b"\0" + ast.dump(ast.parse(f.read())).encode() + b"\0")
    return h.hexdigest()


def fingerprint(cfg, rules: str, code: str) -> str:
    """What one estimate depends on (module docstring); data paths and logging are not part of it."""
    from nagmoe.config import to_dict

    t = cfg.train
    what = {"model": to_dict(cfg.model), "seq_len": cfg.data.seq_len, "ep": EP, "world": WORLD, "rules": rules,
            "micro_batch_tokens": micro_batch_tokens(cfg), "optimizer": t.optimizer, "precision": t.precision,
            "activation_checkpointing": t.activation_checkpointing, "code": code}
    return hashlib.sha256(json.dumps(what, sort_keys=True, default=str).encode()).hexdigest()[:16]


def key(name: str, rules: str) -> str:
    return f"{name} torch {rules}"


def gpu_configs() -> dict:
    """{check config name: its config at the GPU check's size} (the data folder is a placeholder)."""
    return {name: paper_config(name, "gpu", "/nonexistent") for name in PAPER}


def read() -> dict:
    try:
        with open(ESTIMATES) as f:
            data = json.load(f)
        return data if isinstance(data, dict) and isinstance(data.get("entries"), dict) else {"entries": {}}
    except (OSError, ValueError):
        return {"entries": {}}


def lookup(name: str, cfg, rules: str) -> dict:
    """The committed estimate of `name` under `rules`: {"bytes", "fingerprint"} or {"stale"/"missing": why}."""
    entry = read()["entries"].get(key(name, rules))
    if not isinstance(entry, dict) or not isinstance(entry.get("total"), int):
        return {"missing": f"no committed estimate for {key(name, rules)} (tools/gpu_check_estimates.py --write)"}
    if entry.get("fingerprint") != fingerprint(cfg, rules, code_digest()):
        return {"stale": f"{key(name, rules)}: config or code changed since it was computed "
                         "(tools/gpu_check_estimates.py --write)", "bytes_when_computed": entry["total"]}
    return {"bytes": entry["total"], "fingerprint": entry["fingerprint"], "cuda_rules": rules}


def problems() -> list[str]:
    """Each stale or missing entry, one line each."""
    out = []
    for name, cfg in gpu_configs().items():
        for rules in RULES:
            found = lookup(name, cfg, rules)
            if "bytes" not in found:
                out.append(found.get("stale") or found["missing"])
    return out


def write() -> dict:
    import torch

    from nagmoe.train.memory import estimate_memory

    code = code_digest()
    entries = {}
    for name, cfg in gpu_configs().items():
        for rules in RULES:
            est = estimate_memory(cfg, ep=EP, micro_batch_tokens=micro_batch_tokens(cfg), device="cuda",
                                  world_size=WORLD, rules=rules)
            entries[key(name, rules)] = {"config": f"configs/paper/{PAPER[name]}.yaml", "cuda_rules": rules,
                                         "fingerprint": fingerprint(cfg, rules, code), "total": est["total"],
                                         "parts": {k: est[k] for k in est["parts"]}, "layout": est["layout"]}
            print(f"{key(name, rules)}: {est['total'] / 2 ** 30:.2f} GiB", flush=True)
    data = {"about": "memory estimates of tools/gpu_check.sh's training sections (tools/gpu_check_estimates.py)",
            "measured_with_torch": torch.__version__, "sizes": {k: SIZES["gpu"][k] for k in
                                                                ("vocab", "seq", "batch_tokens")},
            "entries": entries}
    tmp = ESTIMATES + ".tmp"
    with open(tmp, "w") as f:
        json.dump(data, f, indent=1, sort_keys=True)
        f.write("\n")
    os.replace(tmp, ESTIMATES)
    return data


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    mode = ap.add_mutually_exclusive_group(required=True)
    mode.add_argument("--write", action="store_true", help="recompute every entry and rewrite the JSON")
    mode.add_argument("--check", action="store_true", help="exit 1 when an entry is stale or missing")
    args = ap.parse_args(argv)
    if args.write:
        write()
        return 0
    found = problems()
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
