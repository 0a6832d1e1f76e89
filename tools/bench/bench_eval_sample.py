"""What pairing and a larger strided sample buy (issue 66): score run dirs' latest checkpoints on every window of
the val split once, then for each pair (variant vs reference, as given) the standard error of the bpb difference
on sub-samples of that split: the old sample (the first `--old-tokens` in stored order), a strided one of the same
size, and the whole split; paired (nagmoe/analysis/paired.py) and unpaired (each run's own error over windows,
combined as if the runs had been scored on independent samples). Also the scoring's tokens/s on this machine.

    python tools/bench/bench_eval_sample.py runs/demo/baseline-s0 runs/demo/nag-s0 runs/demo/nag-mod20-s0 \
        --pairs 1:0 2:1 [--old-tokens 65536] [--threads 1] [--out bench.json]

Pairs are `VARIANT:REFERENCE` indices into the run dirs. Writes JSON (--out) and prints a table.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)

import numpy as np  # noqa: E402
import torch  # noqa: E402

from nagmoe.analysis.paired import LN2, Z95, paired_difference, ratio_and_se  # noqa: E402
from nagmoe.data.eval_sample import eval_window_ids  # noqa: E402
from nagmoe.eval.val_windows import WindowLosses  # noqa: E402


def score_all(run_dir: str, batch_rows: int) -> tuple:
    """(WindowLosses of every val window, tokens/s) of the run's latest checkpoint."""
    from nagmoe.data.bpb import token_bytes
    from nagmoe.data.loader import TokenShards
    from nagmoe.eval.generate import load_run
    from nagmoe.eval.val_windows import score_windows

    run = load_run(run_dir, "cpu")
    seq_len = run.config.data.seq_len
    shards = TokenShards(run.config.data.data_dir, "val")
    ids = np.arange(int(shards.window_starts(seq_len)[-1]), dtype=np.int64)
    t0 = time.perf_counter()
    losses = score_windows(run.model, shards, seq_len, ids, batch_rows, token_bytes(run.config.data.data_dir))
    dt = time.perf_counter() - t0
    return losses, len(ids) * seq_len / dt


def subset(losses: WindowLosses, ids: np.ndarray) -> WindowLosses:
    at = np.searchsorted(losses.window_ids, ids)
    return WindowLosses(losses.data_fingerprint, losses.seq_len, "given", losses.split_windows, ids,
                        losses.nats[at], losses.bytes[at], losses.tokens[at])


def unpaired_se(a: WindowLosses, b: WindowLosses) -> float:
    """se of bpb_B - bpb_A if the two had been scored on independent samples: each run's own delta-method error
    over its windows (the document-to-document variation included), combined in quadrature."""
    def se(w):  # the run's own bpb error over its windows (the document-to-document variation included)
        return ratio_and_se(w.nats / LN2, w.bytes.astype(np.float64))[1]
    return math.sqrt(se(a) ** 2 + se(b) ** 2)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("run_dirs", nargs="+")
    ap.add_argument("--pairs", nargs="+", required=True, metavar="V:R")
    ap.add_argument("--old-tokens", type=int, default=65536)
    ap.add_argument("--batch-rows", type=int, default=32)
    ap.add_argument("--threads", type=int, default=1)
    ap.add_argument("--out", default=None)
    args = ap.parse_args(argv)
    torch.set_num_threads(args.threads)
    scored = [score_all(d, args.batch_rows) for d in args.run_dirs]
    first = scored[0][0]
    n_all, seq_len = first.split_windows, first.seq_len
    samples = {"old (first windows)": eval_window_ids(n_all, args.old_tokens, seq_len, "first"),
               "strided, old size": eval_window_ids(n_all, args.old_tokens, seq_len, "strided"),
               "whole split (new)": np.arange(n_all, dtype=np.int64)}
    result = {"date": time.strftime("%Y-%m-%d %H:%M %Z"), "threads": args.threads,
              "tokens_per_s": {d: tps for d, (_, tps) in zip(args.run_dirs, scored)}, "pairs": []}
    print(f"scoring tokens/s ({args.threads} thread(s), {args.batch_rows} rows of {seq_len}): "
          + ", ".join(f"{os.path.basename(d)} {tps:,.0f}" for d, (_, tps) in zip(args.run_dirs, scored)))
    print(f"{'pair':<34} {'sample':<22} {'windows':>7} {'tokens':>8} {'diff bpb':>9} {'paired se':>9} "
          f"{'unpaired se':>11} {'ratio':>6}")
    for spec in args.pairs:
        v, r = (int(i) for i in spec.split(":"))
        name = f"{os.path.basename(args.run_dirs[v])} - {os.path.basename(args.run_dirs[r])}"
        for label, ids in samples.items():
            a, b = subset(scored[r][0], ids), subset(scored[v][0], ids)
            p = paired_difference([(a, b)])
            u = unpaired_se(a, b)
            row = {"pair": name, "sample": label, "windows": p["windows"], "tokens": p["tokens"],
                   "difference_bpb": p["difference_bpb"], "paired_se_bpb": p["se_bpb"], "unpaired_se_bpb": u,
                   "se_nats_per_token": p["se_nats_per_token"], "resolves_bpb": Z95 * p["se_bpb"]}
            result["pairs"].append(row)
            print(f"{name:<34} {label:<22} {p['windows']:>7} {p['tokens']:>8,} {p['difference_bpb']:>+9.4f} "
                  f"{p['se_bpb']:>9.4f} {u:>11.4f} {u / p['se_bpb'] if p['se_bpb'] else float('inf'):>6.1f}")
    if args.out:
        with open(args.out, "w") as f:
            json.dump(result, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
