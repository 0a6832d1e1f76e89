"""metrics.jsonl: one JSON object per logged step, appended and flushed line by line.

Values are made strict JSON: tensors and numpy scalars become Python numbers, and non-finite floats
(NaN/inf) become null, so any JSON reader (jq, pandas, browsers) can read the file. On resume the trainer
calls `truncate_metrics(path, checkpoint_step)` so that each step appears exactly once.

The file is appended in place, so it is opened through `nagmoe.safe_files.open_append`: a symlink or a hard link
planted at RUN_DIR/metrics.jsonl is refused (exit 2 naming it) and the file it points to is never written; the
resume's rewrite refuses the same names and goes through a fresh temporary.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any, Optional

import numpy as np
import torch

from nagmoe.safe_files import atomic_writer, open_append

METRICS_FILE = "metrics.jsonl"


def plain_json(value: Any) -> Any:
    """Convert to strict-JSON values: tensors/numpy -> Python, NaN/inf -> None."""
    if isinstance(value, torch.Tensor):
        value = value.item() if value.numel() == 1 else value.tolist()
    elif isinstance(value, np.generic):
        value = value.item()
    elif isinstance(value, np.ndarray):
        value = value.tolist()
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {str(k): plain_json(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [plain_json(v) for v in value]
    return value


class MetricsWriter:
    """Appends records to RUN_DIR/metrics.jsonl; every line is flushed so a crash loses at most one."""

    def __init__(self, run_dir: str, filename: str = METRICS_FILE):
        os.makedirs(run_dir, exist_ok=True)
        self.path = os.path.join(run_dir, filename)
        self._file = open_append(self.path)

    def write(self, record: dict) -> None:
        self._file.write(json.dumps(plain_json(record), allow_nan=False) + "\n")
        self._file.flush()

    def close(self) -> None:
        if not self._file.closed:
            self._file.close()

    def __enter__(self) -> "MetricsWriter":
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def read_metrics(path: str) -> list[dict]:
    """All parseable records of a metrics file (a torn last line from a crash is skipped)."""
    if not os.path.exists(path):
        return []
    records = []
    with open(path) as f:
        for line in f:
            record = _parse(line)
            if record is not None:
                records.append(record)
    return records


def _parse(line: str) -> Optional[dict]:
    try:
        record = json.loads(line)
    except ValueError:
        return None
    return record if isinstance(record, dict) else None


def truncate_metrics(path: str, step: int) -> int:
    """Drop every record with `step` > the given step (and unparseable lines); atomic rewrite.

    Records without a `step` key are kept. Returns the number of records kept; a missing file is a no-op.
    """
    if not os.path.lexists(path):
        return 0
    open_append(path).close()  # the checks of the append that follows (a link there: UserError), nothing written
    kept = []
    with open(path) as f:
        for line in f:
            record = _parse(line)
            if record is None:
                continue
            if "step" in record and record["step"] is not None and record["step"] > step:
                continue
            kept.append(line if line.endswith("\n") else line + "\n")
    with atomic_writer(path, durable=True) as f:
        f.writelines(kept)
    return len(kept)
