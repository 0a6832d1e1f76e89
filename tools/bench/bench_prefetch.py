"""Benchmark: the wait for batches hidden behind the step by data.prefetch (issue 67 item 4), written as JSON.

    python tools/bench/bench_prefetch.py                                   # synthetic shards, the default grid
    python tools/bench/bench_prefetch.py --latency-ms 5 20 --step-ms 20 --step-kind sleep matmul

A real `TokenLoader` (random ids, a temporary data dir) is slowed by an injected latency: each batch sleeps
`--latency-ms` before the real read (a slow filesystem, a busy page cache). The step is a stand-in for the
training step: `sleep` (the host waiting on a GPU, which releases the GIL) or `matmul` (a fixed amount of CPU work
in torch, calibrated to about `--step-ms` on this machine). Each case runs depth 0 (read in place) and depth
`--depth` back to back, `--repeats` times alternating, in one process; per case the medians:

    steps_per_s     iterations (wait for the batch, step) a second
    wait_ms         the main thread's wait for a batch, per step (what `data_wait_s` records in the trainer)
    ratio           steps_per_s with prefetch / without
    hidden_share    1 - wait_ms(prefetch) / wait_ms(0): the share of the wait hidden behind the step

The ideal is an iteration of max(step, latency + read) instead of step + latency + read.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from nagmoe.data.loader import TokenLoader  # noqa: E402
from nagmoe.data.prefetch import PrefetchLoader  # noqa: E402
from bench_loader import synthetic_data_dir  # noqa: E402  (tools/bench/)
from bench_output import emit_json  # noqa: E402  (tools/bench/)


class Slowed:
    """A loader whose every batch takes `latency_s` more, before the real read."""

    def __init__(self, loader, latency_s: float):
        self.loader, self.latency_s = loader, latency_s

    def __next__(self):
        time.sleep(self.latency_s)
        return next(self.loader)

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


def make_step(kind: str, step_s: float):
    if kind == "sleep":
        return lambda: time.sleep(step_s)
    a = torch.randn(256, 256)

    def matmul(n):
        for _ in range(n):
            torch.mm(a, a)

    matmul(20)
    n, t0 = 200, time.perf_counter()
    matmul(n)
    per = (time.perf_counter() - t0) / n
    reps = max(1, round(step_s / per))
    return lambda: matmul(reps)


def run_once(data_dir: str, args, depth: int, latency_s: float, step) -> dict:
    inner = Slowed(TokenLoader(data_dir, "train", args.seq_len, args.batch_rows, seed=0, verify=False), latency_s)
    loader = PrefetchLoader(inner, depth=depth)
    try:
        for _ in range(args.warmup):
            next(loader)
            step()
        wait = 0.0
        t0 = time.perf_counter()
        for _ in range(args.steps):
            w = time.perf_counter()
            next(loader)
            wait += time.perf_counter() - w
            step()
        dt = time.perf_counter() - t0
    finally:
        loader.close()
    return {"steps_per_s": args.steps / dt, "wait_ms": 1e3 * wait / args.steps, "iteration_ms": 1e3 * dt / args.steps}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--latency-ms", type=float, nargs="+", default=[5.0, 20.0, 40.0])
    p.add_argument("--step-ms", type=float, nargs="+", default=[20.0])
    p.add_argument("--step-kind", nargs="+", choices=["sleep", "matmul"], default=["sleep", "matmul"])
    p.add_argument("--depth", type=int, default=2, help="against depth 0")
    p.add_argument("--seq-len", type=int, default=2048)
    p.add_argument("--batch-rows", type=int, default=8)
    p.add_argument("--synthetic", type=int, default=4_000_000, metavar="N_TOKENS")
    p.add_argument("--vocab-size", type=int, default=32768)
    p.add_argument("--steps", type=int, default=60)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--threads", type=int, default=1, help="torch threads of the main thread's stand-in step")
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    cases = []
    with tempfile.TemporaryDirectory() as root:
        data_dir = synthetic_data_dir(root, args.synthetic, args.vocab_size, shard_tokens=1 << 22)
        for kind in args.step_kind:
            for step_ms in args.step_ms:
                step = make_step(kind, step_ms / 1e3)
                for latency_ms in args.latency_ms:
                    runs = {0: [], args.depth: []}
                    for _ in range(args.repeats):  # alternating, so a slow minute hits both
                        for depth in runs:
                            runs[depth].append(run_once(data_dir, args, depth, latency_ms / 1e3, step))
                    med = {d: {k: statistics.median(r[k] for r in rs) for k in rs[0]} for d, rs in runs.items()}
                    off, on = med[0], med[args.depth]
                    case = {"step_kind": kind, "step_ms": step_ms, "latency_ms": latency_ms,
                            "off": {k: round(v, 3) for k, v in off.items()},
                            "on": {k: round(v, 3) for k, v in on.items()},
                            "ratio": round(on["steps_per_s"] / off["steps_per_s"], 3),
                            "hidden_share": round(1 - on["wait_ms"] / off["wait_ms"], 3)}
                    cases.append(case)
                    print(f"{kind:6s} step {step_ms:5.1f} ms  latency {latency_ms:5.1f} ms  |  depth 0: "
                          f"{off['steps_per_s']:6.2f} steps/s, wait {off['wait_ms']:6.2f} ms  |  depth {args.depth}: "
                          f"{on['steps_per_s']:6.2f} steps/s, wait {on['wait_ms']:6.2f} ms  |  "
                          f"ratio {case['ratio']:.3f}, hidden {case['hidden_share']:.3f}", file=sys.stderr, flush=True)
    now = datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")
    result = {"bench": "prefetch", "date": now,
              "machine": f"{platform.node()} {platform.processor() or platform.machine()}, {os.cpu_count()} cpus",
              "torch": torch.__version__, "depth": args.depth, "seq_len": args.seq_len, "batch_rows": args.batch_rows,
              "steps": args.steps, "repeats": args.repeats, "threads": args.threads, "cases": cases}
    emit_json(result, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
