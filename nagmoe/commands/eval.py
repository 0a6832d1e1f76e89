"""`nagmoe eval --run-dir DIR [--tasks SPEC ...] [--max-per-task N] [--out FILE.json]`: CORE-style in-context
scores of a run's latest valid checkpoint.

A task SPEC is `shakespeare` (the offline next-line task from the validation scenes; the default), a JSONL task
file (format: `nagmoe/eval/tasks.py`), or a local copy of nanochat's CORE bundle (a directory with core.yaml,
eval_meta_data.csv and eval_data/, or its parent holding eval_bundle/). Prints one line per task (accuracy and
centred accuracy) and the mean centred accuracy; `--out` also writes them as JSON.

`--lm-eval TASK... [--model-args add_bos_token=False,...]` runs lm-evaluation-harness tasks with the `nagmoe`
model instead (nagmoe/eval/lm_eval_model.py) and, for rolling tasks, prints which BOS convention scored them;
`--write-lm-eval-tasks DIR` writes the --tasks as lm-eval tasks (nagmoe/eval/lm_eval_tasks.py).
"""
from __future__ import annotations

import json
import os

from nagmoe.base.errors import UserError, shown
from nagmoe.eval.task_specs import DECISIONS, OFFLINE_TASK, resolve_device, resolve_tasks  # noqa: F401  (old home)


def add_arguments(p):
    p.add_argument("--run-dir", required=True, help="a training run dir (config.yaml + checkpoints/)")
    p.add_argument("--tasks", nargs="+", default=None, metavar="SPEC",
                   help="'shakespeare' (offline next-line task; the default), a task .jsonl, "
                        "or a CORE bundle directory")
    p.add_argument("--decision", default="mean", choices=DECISIONS,
                   help="an option's score: mean token loss (CORE, default) or summed loss (lm-eval's acc)")
    p.add_argument("--lm-eval", nargs="+", default=None, metavar="TASK",
                   help="run these lm-evaluation-harness tasks on the run (model `nagmoe`) instead of --tasks")
    p.add_argument("--include-path", default=None, metavar="DIR", help="lm-eval: a directory of task YAMLs")
    p.add_argument("--batch-size", type=int, default=8, metavar="N", help="lm-eval: requests per forward")
    p.add_argument("--model-args", default=None, metavar="K=V[,K=V...]",
                   help="lm-eval: model arguments of `nagmoe` (add_bos_token, max_length, checkpoint); "
                        "add_bos_token=False for bits per byte as the README's recipe")
    p.add_argument("--write-lm-eval-tasks", default=None, metavar="DIR",
                   help="write the --tasks as lm-eval tasks (YAML + JSONL) into DIR and stop; with the "
                        "shakespeare task also the validation scenes as a rolling (bits per byte) task")
    p.add_argument("--max-per-task", type=int, default=None, metavar="N", help="evaluate at most N examples per task")
    p.add_argument("--offline-items", type=int, default=200, metavar="N", help="items of the shakespeare task")
    p.add_argument("--seed", type=int, default=0, metavar="S", help="seed of the shakespeare task")
    p.add_argument("--out", default=None, metavar="FILE.json", help="also write the results as JSON")
    p.add_argument("--device", default="auto", choices=("auto", "cpu", "cuda"))


def run(args) -> int:
    if args.max_per_task is not None and args.max_per_task < 1:
        raise UserError(f"--max-per-task: {args.max_per_task} must be >= 1")
    if args.offline_items < 1:
        raise UserError(f"--offline-items: {args.offline_items} must be >= 1")
    if args.out and not os.path.isdir(os.path.dirname(os.path.abspath(args.out))):  # before the evaluation, not after
        raise UserError(f"--out: directory {os.path.dirname(os.path.abspath(args.out))[:200]} does not exist")

    if args.lm_eval is not None:
        if args.tasks is not None or args.write_lm_eval_tasks:
            raise UserError("--lm-eval: give either --lm-eval TASK... or --tasks SPEC..., not both")
        return run_lm_eval(args)
    if args.include_path is not None:
        raise UserError("--include-path: only with --lm-eval")
    if args.model_args is not None:
        raise UserError("--model-args: only with --lm-eval")
    from nagmoe.eval.core import evaluate_tasks, tokenizer_encoder
    from nagmoe.eval.generate import load_run

    device = resolve_device(args.device)
    run_ = load_run(args.run_dir, device)
    tasks = resolve_tasks(args.tasks or [OFFLINE_TASK], run_.config.data.val_fraction, args.offline_items, args.seed)
    if args.write_lm_eval_tasks:
        from nagmoe.eval.lm_eval_tasks import write_tasks

        names = write_tasks(tasks, args.write_lm_eval_tasks)
        if OFFLINE_TASK in (args.tasks or [OFFLINE_TASK]):
            from nagmoe.eval.lm_eval_tasks import write_scenes_task

            names.append(write_scenes_task(run_.config.data.val_fraction, args.write_lm_eval_tasks))
        print(f"[nagmoe] wrote lm-eval tasks {', '.join(names)} to {args.write_lm_eval_tasks} (use --include_path)")
        return 0
    print(f"{'task':<36} {'type':<18} {'shots':>5} {'examples':>8} {'accuracy':>9} {'centred':>8}", flush=True)

    def show(r):
        print(f"{r.label:<36} {r.task_type:<18} {r.num_fewshot:>5} {r.examples:>8} {r.accuracy:>9.4f} "
              f"{r.centred:>8.4f}", flush=True)

    results = evaluate_tasks(run_.model, tasks, tokenizer_encoder(run_.tokenizer), run_.bos_id, device,
                             max_examples=args.max_per_task, max_len=run_.config.model.max_seq_len, on_result=show,
                             decision=args.decision)
    n = len(results["tasks"])
    print(f"CORE-style score (mean centred accuracy over {n} task{'s' if n != 1 else ''}): "
          f"{results['core_metric']:.4f}")
    if args.out:
        out = {"run_dir": os.path.abspath(args.run_dir), "checkpoint": run_.checkpoint, **results}
        from nagmoe.base.files import atomic_writer

        with atomic_writer(args.out) as f:  # nagmoe.base.files: never half-written, never through a planted link
            json.dump(out, f, indent=2)
    return 0


def run_lm_eval(args) -> int:
    """lm-evaluation-harness over the run (the registered model `nagmoe`, nagmoe/eval/lm_eval_model.py)."""
    from nagmoe.hf.export import require_transformers

    require_transformers("--lm-eval")
    from nagmoe.eval.lm_eval_model import NagmoeLM, bos_convention, parse_model_args

    model_args = parse_model_args(args.model_args or "")
    if args.batch_size < 1:
        raise UserError(f"--batch-size: {args.batch_size} must be >= 1")
    if args.include_path is not None and not os.path.isdir(args.include_path):
        raise UserError(f"--include-path: {args.include_path[:200]} is not a directory")
    import lm_eval

    model = NagmoeLM(run_dir=args.run_dir, batch_size=args.batch_size, device=resolve_device(args.device),
                     **model_args)
    manager = task_manager(args.include_path, args.lm_eval)
    unknown = [t for t in args.lm_eval if t not in manager.all_tasks]
    if unknown:
        raise UserError(f"--lm-eval: unknown task {shown(unknown[0])} (add its YAML directory with --include-path)")
    results = lm_eval.simple_evaluate(model=model, tasks=list(args.lm_eval), limit=args.max_per_task,
                                      task_manager=manager, log_samples=False, bootstrap_iters=0)
    configs = results.get("configs", {})
    if any(c.get("output_type") == "loglikelihood_rolling" for c in configs.values()):
        # the BOS convention moves bits per byte (by 0.9% on a small run): say which one these numbers used
        print(f"[nagmoe] rolling tasks: {bos_convention(model_args.get('add_bos_token'))}")
    for name, metrics in results["results"].items():
        values = ", ".join(f"{k} {v:.4f}" for k, v in metrics.items() if isinstance(v, float))
        print(f"{name}: {values}")
    if args.out:
        from nagmoe.base.files import atomic_writer

        with atomic_writer(args.out) as f:
            json.dump({"run_dir": os.path.abspath(args.run_dir), "checkpoint": model.run.checkpoint,
                       "model_args": model_args, "results": results["results"], "configs": configs}, f, indent=2,
                      default=str)
    return 0


def task_manager(include_path, names):
    """lm-eval's TaskManager; only the --include-path directory when every task asked for is a plain task there
    (indexing lm-eval's ~15,000 built-in YAMLs takes seconds)."""
    from lm_eval.tasks import TaskManager

    if include_path is not None:
        local = TaskManager(include_path=include_path, include_defaults=False)
        if all(n in local.task_index and local.task_index[n].kind.name in ("TASK", "PY_TASK") for n in names):
            return local
    return TaskManager(include_path=include_path)
