"""metrics.jsonl: one JSON object per logged step, appended and flushed line by line.

Values are made strict JSON: tensors and numpy scalars become Python numbers, and non-finite floats
(NaN/inf) become null, so any JSON reader (jq, pandas, browsers) can read the file. On resume the trainer
calls `truncate_metrics(path, checkpoint_step)` so that each step appears exactly once.

The file is appended in place, so it is opened through `nagmoe.base.files.open_append`: a symlink or a hard link
planted at RUN_DIR/metrics.jsonl is refused (exit 2 naming it) and the file it points to is never written; the
resume's rewrite refuses the same names and goes through a fresh temporary.
"""
from __future__ import annotations

import json
import math
import os
from typing import Any

import numpy as np
import torch

from nagmoe.base.errors import UserError, shown
from nagmoe.base.files import NUMBER, atomic_writer, expect, expect_object, loads_json, open_append
from nagmoe.rundir.names import METRICS_FILE



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


# The schema of a record, as its readers rely on it: every line the trainer writes has a step, the tokens and the
# FLOPs so far; the other numbers the report and the tests read are numbers or null (NaN/inf were made null).
RECORD_FIELDS = {"step": int, "tokens": NUMBER, "flops": NUMBER}
NUMBER_OR_NULL_FIELDS = ("loss", "val_bpb", "tokens_per_s", "skip_rate", "lr_mult")


def _lines(path: str):
    """(where, line, record) of each line of `path` (UTF-8, streamed), parsed; a torn last line (invalid JSON
    without its newline: what a crash mid-append leaves) is skipped. Any other line that is not a JSON object —
    corruption, not a crash — is a UserError naming the file and line; so is nesting too deep.

    A line read without its newline was the end of the file when it was read, so the reading ends there: a
    trainer may be appending the rest of it right now (a live run read by a monitor or a test), and what it
    appends after that moment is not this reading's."""
    try:
        with open(path, encoding="utf-8", newline="") as f:
            number, line = 0, f.readline()
            while line:
                number += 1
                where = f"{shown(path)} line {number}"
                try:
                    record = loads_json(line, where)
                except UserError:
                    if line.endswith("\n") or not _is_torn(line):
                        raise
                    return  # torn: the last line of this reading
                yield where, line, expect_object(record, where)
                if not line.endswith("\n"):
                    return
                line = f.readline()
    except UnicodeDecodeError as e:
        raise UserError(f"{shown(path)}: not UTF-8 text (after line {number})") from None
    except OSError as e:
        raise UserError(f"{shown(path)}: cannot read it ({e.strerror or type(e).__name__})") from None


def _is_torn(line: str) -> bool:
    """A prefix of a line the writer could have written: plain invalid JSON (not nesting too deep)."""
    try:
        json.loads(line)
    except RecursionError:
        return False
    except ValueError:
        return True
    return False


def check_record(record: dict, where: str) -> dict:
    """A metrics record with the fields its readers rely on (RECORD_FIELDS, NUMBER_OR_NULL_FIELDS) typed."""
    for key, kinds in RECORD_FIELDS.items():
        expect(record, key, kinds, where)
    for key in NUMBER_OR_NULL_FIELDS:
        if record.get(key) is not None:
            expect(record, key, NUMBER, where)
    return record


def read_metrics(path: str) -> list[dict]:
    """Every record of a metrics file, checked (`check_record`); a torn last line from a crash is skipped, any
    other bad line is a UserError naming the file, line and field. A missing file has no records."""
    if not os.path.exists(path):
        return []
    return [check_record(record, where) for where, _, record in _lines(path)]


def _step(record: dict, where: str):
    """The record's step as the resume's truncation relies on it: absent, null or an integer."""
    return None if record.get("step") is None else expect(record, "step", int, where)


def check_metrics_steps(path: str) -> None:
    """What `truncate_metrics` will read, checked before a resume writes anything (a missing file is fine; a
    link there is refused as the append would refuse it, and not read)."""
    if os.path.lexists(path):
        open_append(path).close()
        for where, _, record in _lines(path):
            _step(record, where)


def truncate_metrics(path: str, step: int) -> int:
    """Drop every record with `step` > the given step (and a torn last line); atomic rewrite.

    Records without a `step` key are kept; a `step` that is not an integer, or a line that is not a JSON object
    (other than a torn last one), is a UserError naming the file, line and field, and nothing is rewritten.
    Returns the number of records kept; a missing file is a no-op.
    """
    if not os.path.lexists(path):
        return 0
    open_append(path).close()  # the checks of the append that follows (a link there: UserError), nothing written
    kept = []
    for where, line, record in _lines(path):  # every line checked before anything is rewritten
        record_step = _step(record, where)
        if record_step is not None and record_step > step:
            continue
        kept.append(line if line.endswith("\n") else line + "\n")
    with atomic_writer(path, durable=True) as f:
        f.writelines(kept)
    return len(kept)
