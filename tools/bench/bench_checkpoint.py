"""Checkpoint save / verify / resume at the size of a paper run (issue 21, point 4), side by side in one process.

    python tools/bench/bench_checkpoint.py [--gb 7.6] [--dir /tmp/x] [--out bench_checkpoint.json]

A synthetic state (fp32 tensors of 256 MiB each, `--gb` in total: r40's model + optimizer state is ~7.6 GB)
is saved with `save_checkpoint` (DCP write, then the manifest: every file hashed in parallel threads), then:
  verify_1_thread   one sha256 pass with a single hashing thread (what a load cost before, per pass)
  verify_parallel   the same pass with nagmoe.checkpoint.files.hash_threads() threads
  resume_before     two single-thread passes (latest_valid_checkpoint, then load_checkpoint verified again) + load
  resume_now        resume_checkpoint (one parallel pass) + load_checkpoint(verified=True)
The files are in the page cache after the save, so the passes measure hashing, not the disk; a cold cache
adds the disk's read time to every pass (and favours fewer passes even more).
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402

from nagmoe.checkpoint import files, load_checkpoint, resume_checkpoint, save_checkpoint  # noqa: E402

CHUNK = 64 * 2 ** 20  # fp32 elements per tensor: 256 MiB


def synthetic_model(gb: float) -> torch.nn.Module:
    n = max(1, round(gb * 1e9 / (CHUNK * 4)))
    model = torch.nn.Module()
    for i in range(n):
        model.register_parameter(f"p{i}", torch.nn.Parameter(torch.full((CHUNK,), float(i)), requires_grad=False))
    return model


def timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=7.6)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed after)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="bench_ckpt_")
    model = synthetic_model(args.gb)
    nbytes = sum(p.numel() * 4 for p in model.parameters())
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
           "bytes": nbytes, "hash_threads": files.hash_threads()}
    try:
        out["save_s"] = timed(lambda: save_checkpoint(root, 1, model))
        path = resume_checkpoint(root)
        real_threads = files.hash_threads
        files.hash_threads = lambda: 1
        try:
            out["verify_1_thread_s"] = timed(lambda: files.verify_checkpoint(path))
            out["resume_before_s"] = timed(lambda: (files.verify_checkpoint(path), files.verify_checkpoint(path),
                                                    load_checkpoint(path, model, verified=True)))
        finally:
            files.hash_threads = real_threads
        out["verify_parallel_s"] = timed(lambda: files.verify_checkpoint(path))
        out["resume_now_s"] = timed(lambda: load_checkpoint(resume_checkpoint(root), model, verified=True))
    finally:
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    out["verify_speedup"] = out["verify_1_thread_s"] / out["verify_parallel_s"]
    out["resume_speedup"] = out["resume_before_s"] / out["resume_now_s"]
    print(json.dumps(out, indent=1))
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
