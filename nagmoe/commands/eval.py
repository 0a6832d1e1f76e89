"""`nagmoe eval --run-dir DIR [--tasks SPEC ...] [--max-per-task N] [--out FILE.json]`: CORE-style in-context
scores of a run's latest valid checkpoint.

A task SPEC is `shakespeare` (the offline next-line task from the validation scenes; the default), a JSONL task
file (format: `nagmoe/eval/tasks.py`), or a local copy of nanochat's CORE bundle (a directory with core.yaml,
eval_meta_data.csv and eval_data/, or its parent holding eval_bundle/). Prints one line per task (accuracy and
centred accuracy) and the mean centred accuracy; `--out` also writes them as JSON.
"""
from __future__ import annotations

import json
import os

from nagmoe.errors import UserError

OFFLINE_TASK = "shakespeare"


def add_arguments(p):
    p.add_argument("--run-dir", required=True, help="a training run dir (config.yaml + checkpoints/)")
    p.add_argument("--tasks", nargs="+", default=[OFFLINE_TASK], metavar="SPEC",
                   help="'shakespeare' (offline next-line task), a task .jsonl, or a CORE bundle directory")
    p.add_argument("--max-per-task", type=int, default=None, metavar="N", help="evaluate at most N examples per task")
    p.add_argument("--offline-items", type=int, default=200, metavar="N", help="items of the shakespeare task")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the shakespeare task")
    p.add_argument("--out", default=None, metavar="FILE.json", help="also write the results as JSON")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))


def resolve_tasks(specs: list[str], val_fraction: float, offline_items: int = 200, seed: int = 0) -> list:
    """Tasks from the command's SPECs (see the module docstring); UserError naming a bad spec or file line."""
    from nagmoe.eval.offline_task import shakespeare_next_line_task
    from nagmoe.eval.tasks import find_core_bundle, read_core_bundle, read_jsonl_task

    tasks = []
    for spec in specs:
        if spec == OFFLINE_TASK:
            tasks.append(shakespeare_next_line_task(val_fraction, n_items=offline_items, seed=seed))
        elif os.path.isdir(spec):
            bundle = find_core_bundle(spec)
            if bundle is None:
                raise UserError(f"--tasks: {spec} is a directory without core.yaml (or eval_bundle/core.yaml)")
            tasks.extend(read_core_bundle(bundle))
        elif spec.endswith(".jsonl") or os.path.isfile(spec):
            tasks.append(read_jsonl_task(spec))
        else:
            raise UserError(f"--tasks: {spec!r} is not '{OFFLINE_TASK}', a .jsonl task file or a CORE bundle directory")
    return tasks


def resolve_device(requested: str) -> str:
    import torch

    if requested == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if requested == "cuda" and not torch.cuda.is_available():
        raise UserError("--device: cuda was asked for but no CUDA device is visible")
    return requested


def run(args) -> int:
    if args.max_per_task is not None and args.max_per_task < 1:
        raise UserError(f"--max-per-task: {args.max_per_task} must be >= 1")
    if args.offline_items < 1:
        raise UserError(f"--offline-items: {args.offline_items} must be >= 1")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):  # before the evaluation, not after
        raise UserError(f"--out: directory {os.path.dirname(os.path.abspath(args.out))[:200]} does not exist")

    from nagmoe.eval.core import evaluate_tasks, tokenizer_encoder
    from nagmoe.eval.generate import load_run

    device = resolve_device(args.device)
    run_ = load_run(args.run_dir, device)
    tasks = resolve_tasks(args.tasks, run_.config.data.val_fraction, args.offline_items, args.seed)
    print(f"{'task':<36} {'type':<18} {'shots':>5} {'examples':>8} {'accuracy':>9} {'centred':>8}", flush=True)

    def show(r):
        print(f"{r.label:<36} {r.task_type:<18} {r.num_fewshot:>5} {r.examples:>8} {r.accuracy:>9.4f} "
              f"{r.centred:>8.4f}", flush=True)

    results = evaluate_tasks(run_.model, tasks, tokenizer_encoder(run_.tokenizer), run_.bos_id, device,
                             max_examples=args.max_per_task, max_len=run_.config.model.max_seq_len, on_result=show)
    n = len(results["tasks"])
    print(f"CORE-style score (mean centred accuracy over {n} task{'s' if n != 1 else ''}): "
          f"{results['core_metric']:.4f}")
    if args.out:
        out = {"run_dir": os.path.abspath(args.run_dir), "checkpoint": run_.checkpoint, **results}
        from nagmoe.safe_files import atomic_writer

        with atomic_writer(args.out) as f:  # nagmoe.safe_files: never half-written, never through a planted link
            json.dump(out, f, indent=2)
    return 0
