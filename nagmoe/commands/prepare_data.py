"""`nagmoe prepare-data --config PATH [key=value ...] [--tokenizer-only | --num-shards N [--shard-index I] | --merge]`

Without flags: one pass (train/load the tokenizer, tokenise, write shards + index.json to data.data_dir).
Sharded (SLURM job array), see `nagmoe.data.prepare`:
  1. `--tokenizer-only`                     train the tokenizer once (skip when data.tokenizer is set)
  2. `--num-shards N [--shard-index I]`     one slice per array task (I defaults to the array task's offset,
                                            SLURM_ARRAY_TASK_ID - SLURM_ARRAY_TASK_MIN)
  3. `--merge [--num-shards N]`             commit all parts into index.json
"""
from __future__ import annotations

import os
import sys

from nagmoe.commands.common import add_config_arguments, config_from_args
from nagmoe.errors import UserError


def add_arguments(p):
    add_config_arguments(p)
    mode = p.add_mutually_exclusive_group()
    mode.add_argument("--tokenizer-only", action="store_true",
                      help="sharded step 1: train the tokenizer into DATA_DIR/parts/tokenizer.json")
    mode.add_argument("--merge", action="store_true", help="sharded step 3: merge DATA_DIR/parts into index.json")
    p.add_argument("--num-shards", type=int, default=None, metavar="N",
                   help="sharded step 2: number of slices of the input files (one per array task)")
    p.add_argument("--shard-index", type=int, default=None, metavar="I",
                   help="this task's slice (default: from SLURM_ARRAY_TASK_ID)")
    p.add_argument("--tokenizer-chars", type=int, default=None, metavar="C",
                   help="train the BPE on at most C characters of train documents (default 2e9)")


def _slurm_array_index() -> int | None:
    task = os.environ.get("SLURM_ARRAY_TASK_ID")
    if task is None:
        return None
    return int(task) - int(os.environ.get("SLURM_ARRAY_TASK_MIN", "0"))


def _summary(index: dict, data_dir: str) -> str:
    t = index["totals"]
    return (f"prepared {data_dir}: train {t['train']['n_tokens']:,} tokens / {t['train']['n_documents']:,} docs "
            f"in {t['train']['n_shards']} shards; val {t['val']['n_tokens']:,} tokens / "
            f"{t['val']['n_documents']:,} docs; vocab {index['vocab_size']} ({index['dtype']})")


def run(args) -> int:
    from nagmoe.data import prepare

    cfg = config_from_args(args)
    data_dir = cfg.data.data_dir
    max_chars = args.tokenizer_chars or prepare.TOKENIZER_CHARS
    if args.num_shards is not None and args.num_shards < 1:
        raise UserError(f"--num-shards: {args.num_shards} must be >= 1")
    if args.shard_index is not None and args.num_shards is None:
        raise UserError("--shard-index needs --num-shards")
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
