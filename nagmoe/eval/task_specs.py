"""Task specs, the option decisions and the device choice of the evaluating commands (`eval`, `analyze`,
`report`): below both nagmoe/commands/ and nagmoe/analysis/, which each use them. No torch at import: the
command line imports this while it builds its parser."""
from __future__ import annotations

import os

from nagmoe.base.errors import UserError

OFFLINE_TASK = "shakespeare"
# an option's score: its mean token loss (nanochat's CORE) or its summed loss (lm-eval's acc)
DECISIONS = ("mean", "sum")


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
