"""`nagmoe prepare-data --config PATH [key=value ...] [--tokenizer-only | --num-shards N [--shard-index I] | --merge
| --dry-run [--tokens T] [--num-shards N] [--json]]`

Without flags: one pass (train/load the tokenizer, tokenise, write shards + index.json to data.data_dir).
Sharded (SLURM job array), see `nagmoe.data.prepare`:
  1. `--tokenizer-only`                     train the tokenizer once (skip when data.tokenizer is set)
  2. `--num-shards N [--shard-index I]`     one slice per array task (I defaults to the array task's offset,
                                            SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN)
  3. `--merge [--num-shards N]`             commit all parts into index.json

`--dry-run` reads and writes no data and needs no corpus: from the config alone it prints the plan for T training
tokens (shards, bytes on disk, train/val split, Slurm array size and time estimate; docs/paper-corpus.md).
T defaults to the run's own need: `nagmoe.config.budget_tokens` (the token bound at full depth, from
train.max_steps / train.flop_budget / train.schedule_steps) divided by 1 - model.mod.skip_rate, an upper bound
for MoD runs (skipping saves at most that share of the FLOPs, so the same budget buys at most that many more
tokens).
"""
from __future__ import annotations

import json
import math
import os
import sys

from nagmoe.commands.common import add_config_arguments, config_from_args
from nagmoe.base.errors import UserError


def add_arguments(p):
    add_config_arguments(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--tokenizer-only", action="store_true",
                      help="sharded step 1: train the tokenizer into DATA_DIR/parts/tokenizer.json")
    mode.add_argument("--merge", action="store_true", help="sharded step 3: merge DATA_DIR/parts into index.json")
    mode.add_argument("--dry-run", action="store_true",
                      help="print the plan (shards, disk, split, Slurm array and time); read and write no data")
    p.add_argument("--num-shards", type=int, default=None, metavar="N",
                   help="sharded step 2: number of slices of the input files (one per array task)")
    p.add_argument("--shard-index", type=int, default=None, metavar="I",
                   help="this task's slice (default: from SLURM_ARRAY_TASK_ID)")
    p.add_argument("--tokenizer-chars", type=int, default=None, metavar="C",
                   help="train the BPE on at most C characters of train documents (default 2e9)")
    p.add_argument("--tokens", type=float, default=None, metavar="T",
                   help="--dry-run: training tokens to plan for, e.g. 61e9 (default: the run's need, from the config)")
    p.add_argument("--json", action="store_true", help="--dry-run: the plan as one JSON object")


def _slurm_array_index() -> int | None:
    """This array task's slice, SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN (None outside an array job)."""
    from nagmoe.base.environment import array_task_index

    return array_task_index()


def _summary(index: dict, data_dir: str) -> str:
    t = index["totals"]
    return (f"prepared {data_dir}: train {t['train']['n_tokens']:,} tokens / {t['train']['n_documents']:,} docs "
            f"in {t['train']['n_shards']} shards; val {t['val']['n_tokens']:,} tokens / "
            f"{t['val']['n_documents']:,} docs; vocab {index['vocab_size']} ({index['dtype']})")


# ----------------------------------------------------------------------------------------------------------
# --dry-run: the plan from the config alone
# ----------------------------------------------------------------------------------------------------------
# Tokenisation throughput, measured on 2026-12-01 on a 2-core CPU machine (AMD EPYC VM, shared with other jobs,
# so rates are tokens per CPU-second of each process): `nagmoe prepare-data` of one 10.07M-token slice of
# Shakespeare text (.jsonl, one document per scene) with configs/tiny.yaml's BPE (vocab 4096), num_proc=1 and 2.
# Runs and caveats in docs/paper-corpus.md.
MEASURED = "measured on 2026-12-01 on a 2-core CPU machine (tiny.yaml BPE, vocab 4096, Shakespeare .jsonl)"
WORKER_TOKENS_PER_S = 400_000  # one tokenising process (data.num_proc > 1: each worker)
READER_TOKENS_PER_S = 3_100_000  # a task's main process alone: read documents, hash the val split, write shards
TASK_TARGET_S = 3600  # suggested array size: about one hour of estimated work per array task
TIME_MARGIN = 3  # suggested sbatch --time: this many times the estimate (rounded up to 15 min)


def _task_rate(num_proc: int) -> tuple[float, str]:
    """Estimated tokens/s of one array task: one process does everything in series; with workers the main
    process and the workers overlap, so the slower side bounds it (linear in num_proc until the reader caps)."""
    if num_proc <= 1:
        return 1.0 / (1.0 / READER_TOKENS_PER_S + 1.0 / WORKER_TOKENS_PER_S), "1 process reads and tokenises"
    workers = num_proc * WORKER_TOKENS_PER_S
    if workers >= READER_TOKENS_PER_S:
        return float(READER_TOKENS_PER_S), f"{num_proc} workers, bound by the main (reading) process"
    return float(workers), f"{num_proc} workers x {WORKER_TOKENS_PER_S:,} tokens/s"


def _target_tokens(cfg, tokens) -> tuple[int, str]:
    if tokens is not None:
        if not math.isfinite(tokens) or tokens < 1:
            raise UserError(f"--tokens: {tokens:g} must be a positive number of training tokens")
        return math.ceil(tokens), "--tokens"
    from nagmoe.config import budget_tokens

    full = budget_tokens(cfg)
    if full is None:
        raise UserError("--tokens: needed (the config bounds no run length: set train.max_steps or "
                        "train.flop_budget, or pass --tokens T)")
    skip = cfg.model.mod.skip_rate
    if skip > 0:
        return math.ceil(full / (1.0 - skip)), (f"default: the run's {full:,.0f} tokens at full depth / "
                                                f"(1 - model.mod.skip_rate {skip:g}), an upper bound")
    return math.ceil(full), "default: the run's token bound, nagmoe.config.budget_tokens"


def _slurm_time(seconds: float) -> str:
    s = max(900, math.ceil(seconds / 900) * 900)  # whole quarter hours, at least one
    d, s = divmod(s, 86400)
    return (f"{d}-" if d else "") + f"{s // 3600:0{2 if d else 1}d}:{s % 3600 // 60:02d}:00"


def dry_run_plan(cfg, tokens=None, num_slices=None) -> dict:
    """Shards, bytes, split, array size and time for `tokens` training tokens; reads nothing but the config."""
    from nagmoe.data.tokenizer import token_dtype

    d = cfg.data
    train, source = _target_tokens(cfg, tokens)
    total = math.ceil(train / (1.0 - d.val_fraction))  # the split is per document, val_fraction of the tokens
    val = total - train
    dtype = token_dtype(cfg.model.vocab_size)  # the rule prepare_slice writes with
    rate, rate_how = _task_rate(d.num_proc)
    suggested = num_slices is None
    n = max(1, math.ceil(total / rate / TASK_TARGET_S)) if suggested else num_slices
    task_s = total / n / rate
    shards = {s: math.ceil(t / d.shard_tokens) for s, t in (("train", train), ("val", val))}
    return {
        "corpus": d.corpus, "data_dir": d.data_dir, "target_tokens": train, "target_source": source,
        "val_fraction": d.val_fraction, "total_tokens": total, "train_tokens": train, "val_tokens": val,
        "vocab_size": cfg.model.vocab_size, "dtype": dtype.name, "bytes_per_token": dtype.itemsize,
        "shard_tokens": d.shard_tokens, "shards": shards,
        # each slice ends its own partial shard per split, so up to num_slices - 1 more
        "shards_max": {s: v + n - 1 for s, v in shards.items()},
        "bytes": {"train": train * dtype.itemsize, "val": val * dtype.itemsize, "total": total * dtype.itemsize},
        "num_shards": n, "num_shards_suggested": suggested, "num_proc": d.num_proc,
        "cpus_per_task": d.num_proc + (d.num_proc > 1),
        "tokens_per_task": total / n, "task_tokens_per_s": rate, "task_rate_basis": rate_how,
        "task_seconds": task_s, "sbatch_time": _slurm_time(TIME_MARGIN * task_s),
        "cpu_hours": n * task_s * (d.num_proc + (d.num_proc > 1)) / 3600,
        "useful_num_proc": math.ceil(READER_TOKENS_PER_S / WORKER_TOKENS_PER_S),
        "measured": {"note": MEASURED, "worker_tokens_per_s": WORKER_TOKENS_PER_S,
                     "reader_tokens_per_s": READER_TOKENS_PER_S},
    }


def _size(b: int) -> str:
    if b >= 1e9:
        return f"{b:,} bytes ({b / 1e9:,.1f} GB = {b / 2**30:,.1f} GiB)"
    return f"{b:,} bytes ({b / 1e6:,.1f} MB)"


def _duration(seconds: float) -> str:
    if seconds >= 3600:
        return f"{seconds / 3600:.2f} h"
    return f"{seconds / 60:.1f} min" if seconds >= 60 else f"{seconds:.0f} s"


def format_plan(p: dict) -> str:
    n = p["num_shards"]
    how = (f"suggested: ~{TASK_TARGET_S // 60} min estimated per task" if p["num_shards_suggested"]
           else "from --num-shards")
    return "\n".join([
        f"prepare-data dry run (nothing read or written): data.corpus={p['corpus']} -> {p['data_dir']}",
        f"  target       {p['target_tokens']:,} training tokens ({p['target_source']})",
        f"  corpus       {p['total_tokens']:,} tokens to tokenise: train {p['train_tokens']:,} + "
        f"val {p['val_tokens']:,} (data.val_fraction {p['val_fraction']:g}, per document)",
        f"  dtype        {p['dtype']}, {p['bytes_per_token']} bytes per token (model.vocab_size {p['vocab_size']:,})",
        f"  shards       train {p['shards']['train']:,} + val {p['shards']['val']:,} of data.shard_tokens "
        f"{p['shard_tokens']:,} (up to train {p['shards_max']['train']:,} + val {p['shards_max']['val']:,}: "
        f"each slice ends its own last shard)",
        f"  disk         {_size(p['bytes']['total'])}: train {p['bytes']['train']:,} + val {p['bytes']['val']:,}; "
        "peak the same (--merge hard-links or renames the parts)",
        f"  slurm array  --num-shards {n} = sbatch --array=0-{n - 1} ({how}); --cpus-per-task {p['cpus_per_task']}",
        f"  time (est.)  {p['tokens_per_task']:,.0f} tokens per task at {p['task_tokens_per_s']:,.0f} tokens/s "
        f"({p['task_rate_basis']}) = {_duration(p['task_seconds'])} per task; sbatch --time {p['sbatch_time']} "
        f"({TIME_MARGIN}x); {p['cpu_hours']:,.1f} core-hours allocated in all",
        f"  throughput   {MEASURED}: {WORKER_TOKENS_PER_S:,} tokens/s per tokenising process, "
        f"{READER_TOKENS_PER_S:,} tokens/s main process; extrapolated (num_proc above "
        f"{p['useful_num_proc']} adds nothing)",
        "  note         prepare-data tokenises ALL of data.corpus: choose input files holding the corpus tokens "
        "above; --num-shards is at most their number (slices are whole files)",
    ])


def _dry_run(args, cfg) -> int:
    if args.shard_index is not None:
        raise UserError("--dry-run takes no --shard-index (it plans all slices)")
    if args.tokenizer_chars is not None:
        raise UserError("--dry-run takes no --tokenizer-chars")
    plan = dry_run_plan(cfg, args.tokens, args.num_shards)
    print(json.dumps(plan) if args.json else format_plan(plan))
    return 0


def run(args) -> int:
    from nagmoe.data import prepare

    cfg = config_from_args(args)
    data_dir = cfg.data.data_dir
    max_chars = args.tokenizer_chars or prepare.TOKENIZER_CHARS
    if args.num_shards is not None and args.num_shards < 1:
        raise UserError(f"--num-shards: {args.num_shards} must be >= 1")
    if args.shard_index is not None and args.num_shards is None:
        raise UserError("--shard-index needs --num-shards")
    if args.dry_run:
        return _dry_run(args, cfg)
    if args.tokens is not None or args.json:
        raise UserError(f"{'--tokens' if args.tokens is not None else '--json'} is for --dry-run only")
    if args.tokenizer_only:
        if args.num_shards is not None:
            raise UserError("--tokenizer-only takes no --num-shards/--shard-index")
        path = prepare.prepare_tokenizer_only(cfg, max_chars)
        print(f"tokenizer ready: {path}", file=sys.stderr)
    elif args.merge:
        if args.shard_index is not None:
            raise UserError("--merge takes no --shard-index")
        index = prepare.prepare_merge(cfg, args.num_shards)
        print(_summary(index, data_dir), file=sys.stderr)
    elif args.num_shards is not None:
        index_i = args.shard_index if args.shard_index is not None else _slurm_array_index()
        if index_i is None:
            raise UserError("--num-shards needs --shard-index (or run as a SLURM array task)")
        part = prepare.prepare_part(cfg, index_i, args.num_shards)
        print(f"wrote slice {index_i} of {args.num_shards}: {part}", file=sys.stderr)
    else:
        index = prepare.prepare_single(cfg, max_chars)
        print(_summary(index, data_dir), file=sys.stderr)
    return 0
