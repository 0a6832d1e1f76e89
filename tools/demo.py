"""`make demo`: the whole pipeline, small, on the CPU (set-up — the venv — is done by make).

1. prepare the offline Shakespeare corpus (byte-level BPE, packed shards) unless already prepared;
2. run the demo experiment, configs/experiments/demo.yaml: the tiny MoE as pre-norm baseline, NAG, and NAG +
   Mixture-of-Depths 20%, identical internals, one shared FLOP budget (160 steps of the full-depth NAG model);
3. write the report, runs/demo/report.html (what it contains: docs/report.md);
4. print the table against the unigram (token-frequency) bpb of the same tokenizer and split, and check that
   every model beats it by at least 0.3 bpb and is below 3.0 bpb (exit status 1 otherwise), and each comparison's
   paired difference over the same validation windows with its 95% interval, beside the seed statement.
Re-running reuses finished runs and resumes unfinished ones. Extra arguments are config overrides for every run.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

REPO = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, REPO)

from nagmoe.launch import experiment as ex  # noqa: E402
from nagmoe.data.bpb import unigram_bpb  # noqa: E402
from nagmoe.data.prepare import ensure_prepared  # noqa: E402
from nagmoe.base.errors import UserError  # noqa: E402

EXPERIMENT = "configs/experiments/demo.yaml"
MARGIN, CEILING = 0.3, 3.0  # each model: val bpb <= unigram - MARGIN and < CEILING


def check_rows(report: dict, unigram: float) -> tuple[list, bool]:
    """Markdown table rows (one per run) and whether every run passes the demo check."""
    rows, ok = [], True
    for name, g in report["groups"].items():
        bpb = g["val_bpb"][0]
        passed = bpb is not None and bpb <= unigram - MARGIN and bpb < CEILING
        ok &= passed
        acc = g["eval_accuracy"][0] if g["eval_accuracy"] else None
        skip = f"{g['skip_rate'][0]:.1%}" if g["target_skip_rate"] else "-"
        rows.append(f"| {name} | {bpb:.4f} | {bpb - unigram:+.4f} | {'-' if acc is None else f'{acc:.3f}'} | "
                    f"{g['steps'][0]} | {g['tokens'][0]:,} | {g['flops'][0]:.4g} | {skip} | "
                    f"{g['wall_time_s'][0]:.0f} | {'ok' if passed else 'FAIL'} |")
    return rows, ok


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--runs-root", default="runs", help="run dirs go to RUNS_ROOT/demo/RUN-s0")
    ap.add_argument("overrides", nargs="*", help="extra config overrides for every run")
    args = ap.parse_args(argv)
    os.chdir(REPO)
    t0 = time.time()
    exp = ex.load_experiment(EXPERIMENT)
    plans = exp.plan(args.runs_root, overrides=tuple(args.overrides))
    cfg = plans[0].config
    ensure_prepared(cfg, log=lambda line: print(f"[demo] {line}", flush=True))
    t_data = time.time() - t0
    unigram = unigram_bpb(cfg.data.data_dir)
    print(f"[demo] unigram bpb of the validation split: {unigram:.4f}", flush=True)
    print(ex.describe(exp, plans), flush=True)
    status = ex.train_local(plans)
    t_train = time.time() - t0 - t_data
    report = ex.write_experiment_report(exp, args.runs_root)
    t_report = time.time() - t0 - t_data - t_train
    failed = [label for label, s in status.items() if s.startswith("failed")]
    if failed or set(report["groups"]) != set(exp.runs):
        print(f"[demo] FAILED: runs {', '.join(failed) or 'missing from the report'}", flush=True)
        return 1
    rows, ok = check_rows(report, unigram)
    table = "\n".join(["| run | val bpb | vs unigram | next-line acc | steps | tokens | training FLOPs | "
                       "realised skip | train time (s) | check |", "|---|---|---|---|---|---|---|---|---|---|", *rows,
                       f"| unigram | {unigram:.4f} | | | | | | | | |"])
    from nagmoe.analysis.report_paired import paired_line

    comparisons = [f"- {p['variant']} - {p['reference']}: {paired_line(p)}; seeds: {p['seeds']['text']}"
                   for p in report["pairs"]]  # the windows' interval beside the seed statement (issue 66)
    wall = time.time() - t0
    out_dir = exp.out_dir(args.runs_root)
    summary = {"unigram_bpb": unigram, "check_ok": ok, "wall_s": wall, "data_s": t_data, "train_s": t_train,
               "report_s": t_report, "report": report["html"], "groups": report["groups"]}
    with open(os.path.join(out_dir, "demo.json"), "w") as f:
        json.dump(summary, f, indent=1, default=str)
    with open(os.path.join(out_dir, "demo.md"), "w") as f:
        f.write(f"# nagmoe demo\n\n{table}\n\nShared budget {exp.flop_budget:.4g} training FLOPs per run; "
                f"wall time {wall:.0f} s (data {t_data:.0f} s, training {t_train:.0f} s, report {t_report:.0f} s).\n"
                "\nComparisons (paired over the same validation windows):\n\n" + "\n".join(comparisons) + "\n")
    print("\n" + table, flush=True)
    print("\n" + "\n".join(comparisons), flush=True)
    print(f"\n[demo] check (each model <= unigram - {MARGIN} bpb and < {CEILING} bpb): {'ok' if ok else 'FAILED'}")
    print(f"[demo] total {wall:.0f} s (data {t_data:.0f} s, training {t_train:.0f} s, report {t_report:.0f} s); "
          f"report: {report['html']}", flush=True)
    return 0 if ok else 1


if __name__ == "__main__":
    try:
        sys.exit(main())
    except UserError as e:
        print(f"demo: error: {e}", file=sys.stderr)
        sys.exit(2)
