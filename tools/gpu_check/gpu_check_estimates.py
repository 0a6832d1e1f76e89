"""The memory estimates the GPU check sets its measured peaks beside, computed ahead of time on a CPU (issue 39).

A GPU is lent for minutes: the estimator's probes (nagmoe/train/memory.py, activations measured on the CPU under
CUDA's autocast rules of the GPU machine's torch) must not run there. They run here and are committed in
tools/gpu_check/gpu_check_estimates.json, one entry per training config of the check and torch version of CUDA's rules
(RULES: the GPU machine's torch), each with a fingerprint of what the estimate depends on: the config at the
check's size, the layout, the rules version and the code of the estimator and the model (its tokens, so a
comment or a line break does not count). An entry whose fingerprint no longer matches is stale: the check records
"estimate stale" instead of a number, and tests/perf/test_gpu_check_estimates.py fails until it is rewritten:

    python tools/gpu_check/gpu_check_estimates.py --write        # recompute every entry (under a minute, 2 cores)
    python tools/gpu_check/gpu_check_estimates.py --check        # exit 1 naming each stale or missing entry
    python tools/gpu_check/gpu_check_estimates.py --code-digest  # print the code's digest (the standard library)

The fingerprint must read the same under the GPU machine's Python (3.12) as under the one that wrote it (issue 52):
the code digest hashes the token stream (tokenize's names and texts, an f-string as its source text, which 3.12
splits into parts), not ast.dump (3.12 adds fields, 3.13 drops empty ones, 3.12.1 adds empty strings to nested
f-string format specs), and the config is hashed as JSON of plain values only (no str() of an object). The JSON
keeps the code digest its entries were computed with; the test computes the digest under every Python 3.10-3.13
it finds and compares.
"""
from __future__ import annotations

import argparse
import hashlib
import io
import json
import os
import sys
import tokenize

from gpu_check_common import REPO
from gpu_check_configs import PAPER, SIZES, micro_batch_tokens, paper_config

ESTIMATES = os.path.join(REPO, "tools", "gpu_check", "gpu_check_estimates.json")
RULES = ("2.11",)  # the GPU machine's torch (tools/gpu_check/gpu_check.sh); add a version when its torch changes
# what the estimate's numbers depend on besides the config: the estimator, the model it probes, the rules tier
CODE = ("nagmoe/train/memory.py", "nagmoe/train/speed.py", "nagmoe/model", "nagmoe/ops", "nagmoe/config/schema.py",
        "nagmoe/cuda_rules/table.py", "nagmoe/cuda_rules/tier.py")
EP, WORLD = 1, 1  # the check trains each config on one GPU


def _code_files() -> list[str]:
    files = []
    for rel in CODE:
        path = os.path.join(REPO, rel)
        if os.path.isdir(path):
            files += sorted(f"{rel}/{f}" for f in os.listdir(path) if f.endswith(".py"))
        else:
            files.append(rel)
    return files


_LAYOUT = ("NEWLINE", "INDENT", "DEDENT", "ENDMARKER")  # kept by name only: their text is whitespace


def source_tokens(source: str) -> list[str]:
    """`source`'s tokens as "NAME text" lines, the same under Python 3.10-3.13: comments and blank or wrapped
    lines (COMMENT, NL) are dropped, layout tokens keep only their name, and an f-string, which 3.12's tokenize
    splits into FSTRING_START ... FSTRING_END, is one STRING token of its source text as before 3.12, and a name
    that tokenize before 3.12 splits at a combining mark (NAME, ERRORTOKEN, NAME, ...) is one NAME as in 3.12.
    Docstrings are strings: they count."""
    lines: list[str] = []
    stream = io.StringIO(source)

    def readline() -> str:
        lines.append(stream.readline())
        return lines[-1]

    def text(start, end) -> str:
        (r0, c0), (r1, c1) = start, end
        if r0 == r1:
            return lines[r0 - 1][c0:c1]
        return lines[r0 - 1][c0:] + "".join(lines[r0:r1 - 1]) + lines[r1 - 1][:c1]

    out, depth, fstart, name_end = [], 0, None, None
    for tok in tokenize.generate_tokens(readline):
        name = tokenize.tok_name[tok.type]  # names, not numbers: the numbers differ across versions
        if name == "FSTRING_START":
            fstart = tok.start if not depth else fstart  # a nested f-string is part of the outer one's text
            depth += 1
        elif name == "FSTRING_END":
            depth -= 1
            if not depth:
                out.append("STRING " + text(fstart, tok.end))
        elif depth or name in ("COMMENT", "NL"):
            continue
        elif name in ("NAME", "ERRORTOKEN") and tok.start == name_end:  # no two names touch: a split name
            out[-1], name_end = out[-1] + tok.string, tok.end
        elif name == "ERRORTOKEN" and tok.string.strip():  # an identifier character before 3.12's tokenize
            out.append(f"NAME {tok.string}")
            name_end = tok.end
        else:
            out.append(name if name in _LAYOUT else f"{name} {tok.string}")
            name_end = tok.end if name == "NAME" else None
    return out


def code_digest() -> str:
    """The digest of CODE's token streams (source_tokens): the standard library only, no torch or nagmoe."""
    h = hashlib.sha256()
    for rel in _code_files():
        with open(os.path.join(REPO, rel), encoding="utf-8") as f:  # universal newlines: CRLF reads as LF
            tokens = "\n".join(source_tokens(f.read()))
        h.update(rel.encode() + b"\0" + tokens.encode() + b"\0")
    return h.hexdigest()


def fingerprint(cfg, rules: str, code: str) -> str:
    """What one estimate depends on (module docstring); data paths and logging are not part of it."""
    from nagmoe.config import to_dict

    t = cfg.train
    what = {"model": to_dict(cfg.model), "seq_len": cfg.data.seq_len, "ep": EP, "world": WORLD, "rules": rules,
            "micro_batch_tokens": micro_batch_tokens(cfg), "optimizer": t.optimizer, "precision": t.precision,
            "activation_checkpointing": t.activation_checkpointing, "code": code}
    # no default=str: a value JSON cannot hold raises instead of hashing a str() that may differ across versions
    return hashlib.sha256(json.dumps(what, sort_keys=True).encode()).hexdigest()[:16]


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
        return {"missing": f"no committed estimate for {key(name, rules)} "
                           "(tools/gpu_check/gpu_check_estimates.py --write)"}
    if entry.get("fingerprint") != fingerprint(cfg, rules, code_digest()):
        return {"stale": f"{key(name, rules)}: config or code changed since it was computed "
                         "(tools/gpu_check/gpu_check_estimates.py --write)", "bytes_when_computed": entry["total"]}
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
    data = {"about": "memory estimates of tools/gpu_check/gpu_check.sh's training sections "
                     "(tools/gpu_check/gpu_check_estimates.py)",
            "code_digest": code, "measured_with_torch": torch.__version__,
            "sizes": {k: SIZES["gpu"][k] for k in ("vocab", "seq", "batch_tokens")}, "entries": entries}
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
    mode.add_argument("--code-digest", action="store_true", help="print the code digest (no torch needed)")
    args = ap.parse_args(argv)
    if args.code_digest:
        print(code_digest())
        return 0
    if args.write:
        write()
        return 0
    found = problems()
    for line in found:
        print(line, file=sys.stderr)
    return 1 if found else 0


if __name__ == "__main__":
    sys.exit(main())
