"""The training loop's own time per step (issue 67): `loop_s` and `step_s` of the metrics lines of a real trainer run
on 2 gloo ranks, for comparing two commits on one machine.

    python tools/bench/bench_loop_time.py [--model micro|r40] [--ep 2] [--steps 40] [--every 10] [--json FILE]

micro: configs/tiny.yaml with tests/conftest.py's MICRO_OVERRIDES (vocab 512, width 32, 2 layers, 256-token
steps) on a micro data set prepared here. r40: configs/paper/nag-mod20-r40.yaml reduced as the CI rehearsal
reduces it (2 blocks of the paper's width, experts and vocabulary; 128-token sequences, 512-token steps), on the
offline Shakespeare prepared here with the paper's vocabulary. Both log every `--every` steps (the paper configs' 10); `train.hang_timeout_s=0`, one thread a
rank. Reported: the median over the written lines of loop_s and step_s (each line holds the means since the
previous one: nagmoe/train/loop_clock.py), leaving out the first line (warm-up) and the last (the final eval).
It uses only what the trainer had before issue 67's item 1 (the metrics' loop_s), so the same file runs on the
parent commit: copy it into a worktree of that commit and run it there.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile


def _repo() -> str:
    """The checkout this file sits in (tools/bench/ here; tools/ when copied into an older commit's worktree)."""
    path = os.path.dirname(os.path.abspath(__file__))
    while not os.path.isdir(os.path.join(path, "nagmoe")):
        path = os.path.dirname(path)
    return path


REPO = _repo()
for _path in (REPO, os.path.join(REPO, "tests", "support"), os.path.dirname(os.path.abspath(__file__))):
    if _path not in sys.path:
        sys.path.insert(0, _path)

from count_bookkeeping import MICRO_OVERRIDES, prepare_micro_data  # noqa: E402  (the same micro data and model)

R40_REDUCED = ["model.n_layers=2", "data.seq_len=128", "train.batch_tokens=512", "train.micro_batch_tokens=256",
               "model.nag.warmup_tokens=512", "model.mod.start_tokens=512", "train.eval_tokens=1024",
               "train.device=cpu", "log.wandb=off", "train.eval_every=0", "train.checkpoint_every=0",
               "train.checkpoint_every_minutes=null", "train.keep_milestone_every_tokens=null"]


def rank_run(config: str, overrides: list, run_dir: str) -> list:
    import torch

    from nagmoe.config import load_config
    from nagmoe.train.trainer import Trainer

    torch.set_num_threads(1)
    Trainer(load_config(config, overrides), run_dir, quiet=True).run()
    with open(os.path.join(run_dir, "metrics.jsonl")) as f:
        return [json.loads(line) for line in f]


def main() -> int:
    from gloo_ranks import run_on_ranks

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--model", choices=("micro", "r40"), default="micro")
    ap.add_argument("--ep", type=int, default=2)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--every", type=int, default=10)
    ap.add_argument("--json", default=None)
    args = ap.parse_args()
    with tempfile.TemporaryDirectory(prefix="bench_loop_") as work:
        if args.model == "micro":
            data_dir, corpus = prepare_micro_data(os.path.join(work, "micro_data"))
        else:  # the paper's vocabulary needs its own tokenizer: the whole offline Shakespeare, as the rehearsal
            from nagmoe.config import load_config
            from nagmoe.data.prepare import prepare_single

            data_dir, corpus = os.path.join(work, "r40_data"), "shakespeare"
            prepare_single(load_config(os.path.join(REPO, "configs", "paper", "nag-mod20-r40.yaml"),
                                       [*R40_REDUCED, "data.corpus=shakespeare", f"data.data_dir={data_dir}",
                                        "data.num_proc=2", "data.val_fraction=0.05"]))
        common = [f"data.data_dir={data_dir}", f"data.corpus={corpus}", f"parallel.ep={args.ep}",
                  f"train.max_steps={args.steps}", f"train.schedule_steps={args.steps}", f"log.every={args.every}",
                  "train.hang_timeout_s=0"]
        if args.model == "micro":
            config, overrides = os.path.join(REPO, "configs", "tiny.yaml"), [*MICRO_OVERRIDES, *common]
        else:
            config = os.path.join(REPO, "configs", "paper", "nag-mod20-r40.yaml")
            overrides = [*R40_REDUCED, *common, "train.flop_budget=null"]
        lines = run_on_ranks(rank_run, 2, config, overrides, os.path.join(work, "run"), timeout=3600)[0]
    kept = lines[1:-1]
    out = {"model": args.model, "ep": args.ep, "steps": args.steps, "every": args.every, "lines": len(kept),
           "loop_s_median": statistics.median(r["loop_s"] for r in kept),
           "step_s_median": statistics.median(r["step_s"] for r in kept),
           "loop_s": [r["loop_s"] for r in kept], "step_s": [r["step_s"] for r in kept]}
    print(json.dumps(out, indent=1))
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=1)
    return 0


if __name__ == "__main__":
    sys.exit(main())
