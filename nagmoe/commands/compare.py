"""`nagmoe compare RUN_A RUN_B [--tokens N] [--sample strided|first] [--device D] [--batch-rows N] [--json FILE]`:
the paired difference B - A in validation bits per byte on the same windows (issue 66), with its 95% interval,
what these windows resolve, and a one-line verdict. RUN_A is the reference, RUN_B the variant.

Where the losses come from: both runs' kept per-window losses (RUN_DIR/eval_windows.json, written by the final
eval) when both read cleanly, are of the same sample of the data both runs name, are of each run's latest valid
checkpoint, and no other sample was asked for; else both latest checkpoints are scored here on one sample. Never
one kept and one fresh: the trainer's numerics (its device, autocast, batch rows) may differ from this process's,
which would plant a difference of its own. The sample: RUN_A's `train.eval_sample` and `train.eval_tokens`, or
--sample / --tokens.
"""
from __future__ import annotations

import json
import os
import time

from nagmoe.base.errors import UserError, one_line, shown, warn

SAMPLE_CHOICES = ("strided", "first")  # = nagmoe.data.eval_sample.SAMPLES, spelled here: the parser loads no data code
EVAL_BATCH_TOKENS = 8192  # tokens per forward when --batch-rows is not given


def add_arguments(p):
    p.add_argument("run_a", metavar="RUN_A", help="the reference run dir")
    p.add_argument("run_b", metavar="RUN_B", help="the variant run dir (the difference is B - A)")
    p.add_argument("--tokens", type=int, default=None, metavar="N",
                   help="score this many validation tokens (default: RUN_A's train.eval_tokens)")
    p.add_argument("--sample", default=None, choices=SAMPLE_CHOICES,
                   help="which windows (default: RUN_A's train.eval_sample): strided over the split, or the first")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))
    p.add_argument("--batch-rows", type=int, default=None, metavar="N",
                   help=f"windows per forward (default: {EVAL_BATCH_TOKENS} tokens' worth)")
    p.add_argument("--json", default=None, metavar="FILE", help="also write the comparison as JSON")


def _run_side(run_dir: str, label: str):
    """(config, val TokenShards) of one run dir; UserError when it is not one."""
    from nagmoe.data.loader import TokenShards
    from nagmoe.rundir.info import CONFIG_FILE, read_saved_config

    if not os.path.isdir(run_dir):
        raise UserError(f"{label}: {shown(run_dir)} is not a directory")
    cfg = read_saved_config(run_dir)
    if cfg is None:
        raise UserError(f"{label}: {shown(run_dir)} is not a run dir (no {CONFIG_FILE})")
    return cfg, TokenShards(cfg.data.data_dir, "val", verify=cfg.data.verify_shards)


def _latest_step(run_dir: str):
    """(path, step) of the run's latest valid checkpoint, (None, None) without one."""
    from nagmoe.checkpoint import latest_valid_checkpoint, list_checkpoints

    path = latest_valid_checkpoint(run_dir)
    return path, (None if path is None else dict((p, s) for s, p in list_checkpoints(run_dir))[path])


def _kept(run_dir: str, label: str):
    """The run's kept window losses, or None (absent; malformed: said in one line, then scored fresh)."""
    from nagmoe.eval.val_windows import read_window_losses

    try:
        return read_window_losses(run_dir)
    except UserError as e:
        warn(one_line(f"{label}: kept window losses ignored ({e}); scoring both runs fresh", 400))
        return None


def _why_not_reused(kept, steps, fingerprint: str, seq_len: int, wanted) -> str | None:
    """None when both kept files can be paired as they are; else why not, in a few words."""
    if any(k is None for k in kept):
        return "not both runs have kept window losses"
    a, b = kept
    for k, step, label in ((a, steps[0], "A"), (b, steps[1], "B")):
        if k.data_fingerprint != fingerprint or k.seq_len != seq_len or k.split != "val":
            return f"{label}'s kept losses are of other data or seq_len"
        if step is None or k.step != step:
            return f"{label}'s kept losses are of step {k.step}, its latest checkpoint of step {step}"
    if a.fingerprint != b.fingerprint:
        return "the two kept files are of different samples"
    if wanted is not None and a.fingerprint != wanted:
        return "another sample was asked for"
    return None


def _score(run_dir: str, latest, shards, ids, batch_rows: int, device: str, sample: str):
    """(WindowLosses of the run's latest checkpoint `latest` = (path, step) on `ids`, seconds scoring, tokens)."""
    from nagmoe.data.bpb import token_bytes
    from nagmoe.eval.core import inference_context
    from nagmoe.eval.generate import load_run
    from nagmoe.eval.val_windows import score_windows

    if latest[0] is None:
        raise UserError(f"{shown(run_dir)} has no valid checkpoint under checkpoints/ to score (train it first)")
    run = load_run(run_dir, device, checkpoint=latest[0])  # the one whose step was checked; verified on load
    t0 = time.perf_counter()
    losses = score_windows(run.model, shards, run.config.data.seq_len, ids, batch_rows,
                           token_bytes(run.config.data.data_dir), device, inference_context(device), sample,
                           latest[1])
    if device == "cuda":
        import torch

        torch.cuda.synchronize()
    return losses, time.perf_counter() - t0, len(ids) * run.config.data.seq_len


def run(args) -> int:
    from nagmoe.eval.task_specs import resolve_device

    if args.tokens is not None and args.tokens < 1:
        raise UserError(f"--tokens: {args.tokens} must be >= 1")
    if args.batch_rows is not None and args.batch_rows < 1:
        raise UserError(f"--batch-rows: {args.batch_rows} must be >= 1")
    if args.json and not os.path.isdir(os.path.dirname(os.path.abspath(args.json))):  # before any scoring
        raise UserError(f"--json: directory {shown(os.path.dirname(os.path.abspath(args.json)))} does not exist")
    (cfg_a, shards_a), (cfg_b, shards_b) = _run_side(args.run_a, "RUN_A"), _run_side(args.run_b, "RUN_B")
    if shards_a.fingerprint != shards_b.fingerprint or cfg_a.data.seq_len != cfg_b.data.seq_len:
        raise UserError(f"the runs are not of the same validation windows: RUN_A {shown(args.run_a, 80)} has data "
                        f"{shards_a.fingerprint} and seq_len {cfg_a.data.seq_len}, RUN_B {shown(args.run_b, 80)} "
                        f"data {shards_b.fingerprint} and seq_len {cfg_b.data.seq_len}")
    from nagmoe.analysis.paired import NotPaired, paired_difference
    from nagmoe.data.eval_sample import eval_window_ids, sample_fingerprint

    seq_len, n_split = cfg_a.data.seq_len, int(shards_a.window_starts(cfg_a.data.seq_len)[-1])
    sample = args.sample or cfg_a.train.eval_sample
    ids = eval_window_ids(n_split, args.tokens if args.tokens is not None else cfg_a.train.eval_tokens, seq_len,
                          sample)
    asked = args.tokens is not None or args.sample is not None  # else any common kept sample will do
    wanted = sample_fingerprint(shards_a.fingerprint, seq_len, ids) if asked else None
    kept = [_kept(args.run_a, "RUN_A"), _kept(args.run_b, "RUN_B")]
    latest = [_latest_step(args.run_a), _latest_step(args.run_b)]
    steps = [step for _, step in latest]
    why = _why_not_reused(kept, steps, shards_a.fingerprint, seq_len, wanted)
    tokens_per_s = None
    if why is None:
        losses = kept
        print(f"reused the kept window losses (eval_windows.json of steps {steps[0]} and {steps[1]}, "
              f"{kept[0].sample} sample): no model loaded", flush=True)
    else:
        print(f"scoring both latest checkpoints on {len(ids)} {sample} windows of {seq_len} tokens ({why})",
              flush=True)
        if len(ids) < 2:  # the interval's spread is over windows: one window has none
            raise UserError(f"the sample holds {len(ids)} window of {seq_len} tokens; a paired interval needs 2 or "
                            "more (raise --tokens)")
        device = resolve_device(args.device)
        rows = args.batch_rows or max(1, EVAL_BATCH_TOKENS // seq_len)
        (la, sa, ta), (lb, sb, tb) = (_score(d, ls, sh, ids, rows, device, sample) for d, ls, sh in
                                      ((args.run_a, latest[0], shards_a), (args.run_b, latest[1], shards_b)))
        losses, tokens_per_s = [la, lb], (ta + tb) / max(sa + sb, 1e-9)
        print(f"scored checkpoints of steps {la.step} and {lb.step} on {device}: {tokens_per_s:,.0f} tokens/s",
              flush=True)
    try:
        d = paired_difference([tuple(losses)])
    except NotPaired as e:
        raise UserError(f"the runs' window losses do not pair: {e}") from None
    lo, hi = d["ci95_bpb"]
    print(f"A (reference) {shown(args.run_a, 120)}: {d['reference_bpb']:.4f} bpb; B (variant) "
          f"{shown(args.run_b, 120)}: {d['variant_bpb']:.4f} bpb; on {d['windows']} windows, {d['tokens']:,} tokens")
    print(f"difference B - A: {d['difference_bpb']:+.4f} bpb, 95% interval [{lo:+.4f}, {hi:+.4f}] "
          f"(method {d['method']}, se {d['se_bpb']:.4f})")
    print(f"in nats/token: {d['difference_nats_per_token']:+.4f} (se {d['se_nats_per_token']:.4f}); these windows "
          f"resolve differences above {d['resolves_bpb']:.4f} bpb")
    resolved = not lo <= 0.0 <= hi  # the 95% interval excludes 0
    print("verdict: " + (f"B {'ahead of' if d['difference_bpb'] < 0 else 'behind'} A by "
                         f"{abs(d['difference_bpb']):.4f} bpb, resolved by these windows" if resolved
                         else "not resolved by these windows"))
    if args.json:
        from nagmoe.base.files import write_atomic
        from nagmoe.rundir.metrics import plain_json

        out = {**d, "run_a": os.path.abspath(args.run_a), "run_b": os.path.abspath(args.run_b),
               "reused": why is None, "tokens_per_s": tokens_per_s, "resolved": resolved}
        write_atomic(args.json, json.dumps(plain_json(out), indent=2))  # strict JSON (NaN -> null), never half-written
        print(f"wrote {shown(args.json, 200)}")
    return 0
