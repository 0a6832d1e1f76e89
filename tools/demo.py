"""`make demo`: the whole pipeline, small, on the CPU.

1. prepare the offline Shakespeare corpus (byte-level BPE, packed shards) unless already prepared;
2. train the tiny MoE twice — pre-norm baseline and NAG, identical internals — under the same FLOP budget
   (DEMO_STEPS steps' worth), so the LR schedule anneals over exactly that budget;
3. print both val bpb against the unigram (token-frequency) baseline of the same tokenizer and split, and
   write runs/demo/demo.json + demo.md.
Re-running resumes or reuses finished runs (the trainer resumes from the latest checkpoint).
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from nagmoe.config import load_config  # noqa: E402
from nagmoe.data import shards  # noqa: E402
from nagmoe.data.bpb import unigram_bpb  # noqa: E402
from nagmoe.data.prepare import prepare_single  # noqa: E402
from nagmoe.flops import flops_per_token  # noqa: E402
from nagmoe.train.trainer import Trainer  # noqa: E402

RUNS = {"prenorm": "configs/tiny-prenorm.yaml", "nag": "configs/tiny.yaml"}
DEMO_STEPS = 200  # the shared FLOP budget is this many steps of the NAG model at full depth


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", default=os.path.join(REPO, "runs", "demo"))
    ap.add_argument("overrides", nargs="*", help="extra config overrides for both runs")
    args = ap.parse_args(argv)
    os.chdir(REPO)
    t0 = time.time()
    cfg = load_config(RUNS["nag"], args.overrides)
    if not os.path.isfile(os.path.join(cfg.data.data_dir, shards.INDEX)):
        print(f"[demo] preparing {cfg.data.corpus} into {cfg.data.data_dir}", flush=True)
        prepare_single(cfg)
    unigram = unigram_bpb(cfg.data.data_dir)
    print(f"[demo] unigram bpb of the validation split: {unigram:.4f}", flush=True)
    budget = DEMO_STEPS * cfg.train.batch_tokens * flops_per_token(cfg.model, cfg.data.seq_len)
    budget_overrides = [f"train.flop_budget={budget:.6g}", "train.max_steps=null", *args.overrides]
    print(f"[demo] FLOP budget per run: {budget:.3g} (~{DEMO_STEPS} steps of {cfg.train.batch_tokens} tokens)")
    results = {}
    for name, path in RUNS.items():
        run_cfg = load_config(path, budget_overrides)
        run_dir = os.path.join(args.out, name)
        print(f"[demo] training {name} ({path}) -> {run_dir}", flush=True)
        summary = Trainer(run_cfg, run_dir).run()
        results[name] = {k: summary[k] for k in ("val_bpb", "steps", "tokens", "flops", "wall_time_s")}
    out = {"unigram_bpb": unigram, "runs": results, "wall_s": time.time() - t0}
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "demo.json"), "w") as f:
        json.dump(out, f, indent=1)
    lines = ["| run | val bpb | vs unigram | steps | tokens | train time (s) |", "|---|---|---|---|---|---|"]
    for name, r in results.items():
        lines.append(f"| {name} | {r['val_bpb']:.4f} | {r['val_bpb'] - unigram:+.4f} | {r['steps']} | "
                     f"{r['tokens']:,} | {r['wall_time_s']:.0f} |")
    lines.append(f"| unigram | {unigram:.4f} | | | | |")
    table = "\n".join(lines)
    with open(os.path.join(args.out, "demo.md"), "w") as f:
        f.write(f"# nagmoe demo\n\n{table}\n")
    print("\n" + table + f"\n\n[demo] total {out['wall_s']:.0f} s; results in {args.out}/demo.md", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
