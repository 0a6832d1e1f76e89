"""Benchmark: TokenLoader throughput (tokens/s handed to the trainer), written as JSON.

    python tools/bench/bench_loader.py                          # prepares configs/tiny.yaml's data if missing
    python tools/bench/bench_loader.py --data-dir data/shakespeare --seq-len 2048 --batch-rows 8
    python tools/bench/bench_loader.py --synthetic 50000000     # random ids, no `datasets` needed (GPU machine)

Each case times `--steps` batches after `--warmup` batches, on one rank of `--world-size`; `open_s` is the
time to open the split (including the sha256 check of every shard). Compare tokens_per_s with the
trainer's tokens/s: the loader should be far faster.
"""
from __future__ import annotations

import argparse
import datetime
import os
import platform
import sys
import tempfile
import time

import numpy as np

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from nagmoe.config import load_config  # noqa: E402
from nagmoe.data import shards  # noqa: E402
from nagmoe.data.loader import TokenLoader, iter_eval_batches  # noqa: E402
from nagmoe.data.prepare import ensure_prepared  # noqa: E402
from bench_output import emit_json  # noqa: E402  (tools/bench/)


def synthetic_data_dir(root: str, n_tokens: int, vocab_size: int, shard_tokens: int, seed: int = 0) -> str:
    """A data dir of uniform random ids (val = 5 %), committed through the real part/merge path."""
    part = os.path.join(root, "stage", shards.part_dir_name(0, 1))
    os.makedirs(part)
    dtype = np.dtype(np.uint16 if vocab_size <= 1 << 16 else np.uint32)
    rng = np.random.default_rng(seed)
    writers = {s: shards.ShardWriter(part, s, dtype, shard_tokens) for s in shards.SPLITS}
    for split, n in (("train", n_tokens), ("val", max(n_tokens // 20, 4096))):
        for start in range(0, n, 1 << 20):  # "documents" of 1M ids
            writers[split].add_document(rng.integers(0, vocab_size, min(1 << 20, n - start), dtype=dtype))
    tok = os.path.join(root, "stage", "tokenizer.json")
    with open(tok, "w") as f:
        f.write('{"synthetic": true}\n')  # ids only: nothing here decodes them
    from nagmoe.data.tokenizer import file_sha256

    shards.write_part_index(part, writers, vocab_size=vocab_size, bos_id=0, tokenizer_sha256=file_sha256(tok),
                            corpus="synthetic", documents="random ids", val_fraction=0.05, text_field="text")
    data_dir = os.path.join(root, "data")
    shards.merge_parts(data_dir, [part], tok, verify=False)
    return data_dir


def bench_case(data_dir: str, seq_len: int, rows: int, world_size: int, steps: int, warmup: int) -> dict:
    t0 = time.perf_counter()
    loader = TokenLoader(data_dir, "train", seq_len, rows, seed=0, rank=0, world_size=world_size)
    open_s = time.perf_counter() - t0
    for _ in range(warmup):
        next(loader)
    t0 = time.perf_counter()
    for _ in range(steps):
        next(loader)
    dt = time.perf_counter() - t0
    t1 = time.perf_counter()
    n_eval = sum(x.numel() for x, _ in iter_eval_batches(data_dir, seq_len, rows,
                                              max_tokens=steps * rows * seq_len, verify=False))
    eval_dt = time.perf_counter() - t1
    return {"seq_len": seq_len, "batch_rows": rows, "world_size": world_size, "steps": steps,
            "open_s": round(open_s, 4), "tokens_per_s": steps * rows * seq_len / dt,
            "batches_per_s": steps / dt, "eval_tokens_per_s": n_eval / eval_dt if eval_dt > 0 else None}


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    src = p.add_mutually_exclusive_group()
    src.add_argument("--data-dir", help="a prepared data dir")
    src.add_argument("--synthetic", type=int, metavar="N_TOKENS", help="bench on N random train ids")
    p.add_argument("--config", default="configs/tiny.yaml", help="prepared (if needed) when neither is given")
    p.add_argument("--vocab-size", type=int, default=32768, help="--synthetic only")
    p.add_argument("--seq-len", type=int, nargs="+", default=[256, 2048])
    p.add_argument("--batch-rows", type=int, nargs="+", default=[32, 8], help="paired with --seq-len")
    p.add_argument("--world-size", type=int, default=1)
    p.add_argument("--steps", type=int, default=200)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--out", help="also write the JSON here")
    args = p.parse_args(argv)
    if len(args.seq_len) != len(args.batch_rows):
        p.error("--seq-len and --batch-rows need the same number of values")
    with tempfile.TemporaryDirectory() as tmp:
        if args.synthetic:
            data_dir = synthetic_data_dir(tmp, args.synthetic, args.vocab_size, shard_tokens=1 << 24)
        else:
            data_dir = args.data_dir or ensure_prepared(load_config(args.config))
        cases = [bench_case(data_dir, t, b, args.world_size, args.steps, args.warmup)
                 for t, b in zip(args.seq_len, args.batch_rows)]
        index = shards.read_index(data_dir)
    result = {"bench": "loader", "date": datetime.datetime.now().isoformat(timespec="seconds"),
              "machine": {"node": platform.node(), "cpu_count": os.cpu_count(), "python": platform.python_version()},
              "data": {"source": "synthetic" if args.synthetic else data_dir, "dtype": index["dtype"],
                       "train_tokens": index["totals"]["train"]["n_tokens"]},
              "cases": cases}
    emit_json(result, args.out, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
