"""A save's cost to the training loop, synchronous against in the background, and rank 0's hashing before and after
each rank hashed its own files (issue 68), side by side in one run of 2 gloo ranks.

    python tools/bench/bench_async_checkpoint.py [--gb 7.6] [--dir /tmp/x] [--out bench_async_checkpoint.json]

Each rank holds half of a synthetic state of `--gb` (fp32 tensors of 256 MiB, distinct per rank, as EP's expert
shards are: r40's model + optimizer state is ~7.6 GB), and saves it at step 1 synchronously, at step 2 in the
background twice (steps 2 and 3: `nagmoe.checkpoint.async_save.BackgroundSave`, each settled after; the first
allocates the staging buffers, every later save reuses them), per rank:
  sync_blocked_s     save_checkpoint's time: DCP write, own hashing, gather, fence, rank 0's publish
  async_blocked_s    the time until save_checkpoint returns in the background mode: the staging copy (the loop's
                     wait), buffers reused (async_first_blocked_s: the first save, allocating them)
  async_total_s      until the background save is settled (published)
  rank0_hash_before  rank 0 hashing every file of the published step_1 (what its publish did before issue 68)
  rank0_hash_after   rank 0 hashing its own files only (files.own_digests: what it does now; each rank in parallel)
The files are in the page cache after the save, so hashing measures sha256, not the disk.
"""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import socket
import sys
import tempfile
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.multiprocessing as mp  # noqa: E402

CHUNK = 64 * 2 ** 20  # fp32 elements per tensor: 256 MiB


def rank_state(rank: int, gb: float) -> torch.nn.Module:
    n = max(1, round(gb * 1e9 / (CHUNK * 4) / 2))
    model = torch.nn.Module()
    for i in range(n):  # names distinct per rank: each rank writes its own files (as EP's expert shards)
        model.register_parameter(f"r{rank}_{i}", torch.nn.Parameter(torch.full((CHUNK,), float(i)),
                                                                    requires_grad=False))
    return model


def worker(rank: int, port: int, gb: float, root: str, results) -> None:
    from nagmoe.checkpoint import save_checkpoint
    from nagmoe.checkpoint.async_save import BackgroundSave
    from nagmoe.checkpoint.files import describe_files, own_digests

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    model = rank_state(rank, gb)
    out = {"bytes": sum(p.numel() * 4 for p in model.parameters())}
    dist.barrier()
    t0 = time.perf_counter()
    first = save_checkpoint(root, 1, model, keep=3)
    out["sync_blocked_s"] = time.perf_counter() - t0
    background = BackgroundSave(rank, pin=False)
    for step, name in ((2, "async_first"), (3, "async")):  # the first allocates the staging buffers, later reuse them
        dist.barrier()
        t0 = time.perf_counter()
        save_checkpoint(root, step, model, keep=3, background=background)
        out[f"{name}_blocked_s"] = time.perf_counter() - t0
        background.settle()
        out[f"{name}_total_s"] = time.perf_counter() - t0
        out[f"{name}_phases"] = dict(background.timing)
    background.close()
    dist.barrier()
    if rank == 0:
        t0 = time.perf_counter()
        describe_files(first)
        out["rank0_hash_before_s"] = time.perf_counter() - t0
        t0 = time.perf_counter()
        own_digests(first, 0)
        out["rank0_hash_after_s"] = time.perf_counter() - t0
    dist.barrier()
    dist.destroy_process_group()
    results.put((rank, out))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--gb", type=float, default=7.6)
    ap.add_argument("--dir", default=None, help="where to write (default: a temp dir, removed after)")
    ap.add_argument("--out", default=None)
    args = ap.parse_args()
    root = args.dir or tempfile.mkdtemp(prefix="bench_async_ckpt_")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    ctx = mp.get_context("spawn")
    results = ctx.Queue()
    procs = [ctx.Process(target=worker, args=(r, port, args.gb, root, results)) for r in range(2)]
    try:
        for p in procs:
            p.start()
        ranks = dict(results.get(timeout=3600) for _ in procs)
        for p in procs:
            p.join(timeout=60)
    finally:
        for p in procs:
            if p.is_alive():
                p.kill()
        if args.dir is None:
            shutil.rmtree(root, ignore_errors=True)
    out = {"date": time.strftime("%Y-%m-%d"), "machine": f"{platform.node()} ({os.cpu_count()} CPUs)",
           "gb": args.gb, "ranks": ranks}
    text = json.dumps(out, indent=1)
    print(text)
    if args.out:
        with open(args.out, "w") as f:
            f.write(text + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
