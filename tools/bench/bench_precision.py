"""CPU side-by-side of `train.precision` (issue 26): one forward + backward under bf16 autocast of a NAG and a
pre-norm model of the same internals, `legacy` vs `uniform`, interleaved repeats in one process; prints the
median step time of each and the ratios (NAG / pre-norm per policy: the residual's own cost).

    python tools/bench/bench_precision.py [--d-model 256 --vocab 8192 --seq 512 --rows 4 --repeats 7]
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--d-model", type=int, default=256)
    p.add_argument("--vocab", type=int, default=8192)
    p.add_argument("--seq", type=int, default=512)
    p.add_argument("--rows", type=int, default=4)
    p.add_argument("--repeats", type=int, default=7)
    args = p.parse_args(argv)

    import torch

    from nagmoe.config import load_config
    from nagmoe.model import build_model

    models = {}
    for residual in ("nag", "prenorm"):
        cfg = load_config(os.path.join(REPO, "configs/tiny.yaml"), [
            f"model.residual={residual}", f"model.d_model={args.d_model}", f"model.vocab_size={args.vocab}",
            f"model.max_seq_len={args.seq}", f"data.seq_len={args.seq}", "model.attention.n_heads=4"])
        torch.manual_seed(0)
        models[residual] = build_model(cfg.model).train()
    idx = torch.randint(0, args.vocab, (args.rows, args.seq + 1), generator=torch.Generator().manual_seed(0))
    times = {(r, p): [] for r in models for p in ("legacy", "uniform")}
    for repeat in range(args.repeats + 1):  # the first round warms up
        for (residual, policy) in times:
            model = models[residual]
            model.set_precision(policy)
            t0 = time.perf_counter()
            with torch.autocast("cpu", dtype=torch.bfloat16):
                out = model(idx[:, :-1], idx[:, 1:])
            (out.loss + out.aux_loss).backward()
            model.zero_grad(set_to_none=True)
            if repeat:
                times[residual, policy].append(time.perf_counter() - t0)
    med = {k: statistics.median(v) for k, v in times.items()}
    for (residual, policy), t in med.items():
        print(f"{residual:8s} {policy:8s} {t * 1e3:8.1f} ms")
    for policy in ("legacy", "uniform"):
        print(f"NAG / pre-norm under {policy}: {med['nag', policy] / med['prenorm', policy]:.3f}")
    for residual in models:
        print(f"{residual}: uniform / legacy {med[residual, 'uniform'] / med[residual, 'legacy']:.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
