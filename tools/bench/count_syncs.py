"""Count device-to-host syncs of one training micro-step (forward + backward), per call site.

    python tools/bench/count_syncs.py --config configs/tiny-mod20.yaml [KEY=VALUE ...] [--device cpu|cuda]
        [--dtype bf16|fp32] [--batch-rows 2]

Builds the model of the config (random tokens, no data needed), takes `--warm-steps` eager steps so that MoD
skips (model.mod.start_tokens and the injection warm-up are set to 0 here), then counts one micro-step under
nagmoe.train.sync_count.SyncCounter and prints the per-site table and the budget of issue 26: 0 outside MoD,
at most 1 per MoD sublayer (docs/benchmarks.md records the counts). Exit 1 when over budget.
"""
from __future__ import annotations

import argparse
import os
import sys

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, REPO)


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--config", required=True)
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE")
    p.add_argument("--device", default="cpu", choices=("cpu", "cuda"))
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp32"))
    p.add_argument("--batch-rows", type=int, default=2)
    p.add_argument("--warm-steps", type=int, default=2)
    args = p.parse_args(argv)

    from nagmoe.config import load_config
    from nagmoe.train.sync_count import budget, count_micro_step, mod_sublayers

    cfg = load_config(args.config, [*args.overrides, "model.mod.start_tokens=0", "model.nag.warmup_tokens=0"])
    counter, model = count_micro_step(cfg, args.device, args.dtype, args.batch_rows, args.warm_steps)
    allowed = budget(model)
    print(counter.table())
    print(f"total {counter.total} per micro-step; budget {allowed} "
          f"({mod_sublayers(model)} MoD sublayers x 1)")
    return 0 if counter.total <= allowed else 1


if __name__ == "__main__":
    sys.exit(main())
