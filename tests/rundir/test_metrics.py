import json
import math
import os

import numpy as np
import torch

from nagmoe.rundir.metrics import METRICS_FILE, MetricsWriter, read_metrics, truncate_metrics


def test_writer_appends_strict_json_lines(tmp_path):
    with MetricsWriter(str(tmp_path)) as w:
        w.write({"step": 1, "loss": torch.tensor(2.5), "lr": np.float32(0.5), "tokens": np.int64(64), "flops": 1e9})
        w.write({"step": 2, "loss": float("nan"), "hist": torch.tensor([1.0, 2.0]), "tokens": 128, "flops": 2e9})
        # Flushed line by line: readable before close.
        assert len(read_metrics(w.path)) == 2
    with MetricsWriter(str(tmp_path)) as w:  # a resumed run appends
        w.write({"step": 3, "loss": 1.0, "tokens": 192, "flops": 3e9})
    lines = (tmp_path / METRICS_FILE).read_text().splitlines()
    records = [json.loads(line, parse_constant=lambda c: math.nan) for line in lines]
    assert records[0] == {"step": 1, "loss": 2.5, "lr": 0.5, "tokens": 64, "flops": 1e9}
    assert records[1] == {"step": 2, "loss": None, "hist": [1.0, 2.0], "tokens": 128, "flops": 2e9}  # NaN -> null
    assert [r["step"] for r in records] == [1, 2, 3]


def _record(step: int) -> dict:
    """A record as the trainer writes it: step, tokens and FLOPs so far, and the loss."""
    return {"step": step, "tokens": 64 * step, "flops": 1e9 * step, "loss": 1.0 / step}


def test_truncate_drops_later_steps_and_torn_line(tmp_path):
    path = tmp_path / METRICS_FILE
    with MetricsWriter(str(tmp_path)) as w:
        for step in range(1, 8):
            w.write(_record(step))
    with open(path, "a") as f:
        f.write('{"step": 8, "loss": 0.1')  # crash mid-line
    assert truncate_metrics(str(path), 4) == 4
    records = read_metrics(str(path))
    assert records[0] == _record(1)
    assert [r["step"] for r in records] == [1, 2, 3, 4]
    assert path.read_text().endswith("\n")
    assert sorted(os.listdir(tmp_path)) == [METRICS_FILE]  # no tmp file left behind
    with MetricsWriter(str(tmp_path)) as w:  # resume: each step appears once
        w.write(_record(5))
    assert [r["step"] for r in read_metrics(str(path))] == [1, 2, 3, 4, 5]
    assert truncate_metrics(str(tmp_path / "missing.jsonl"), 3) == 0
    assert not (tmp_path / "missing.jsonl").exists()


def test_a_line_the_trainer_completes_while_it_is_read_is_not_corruption(tmp_path, monkeypatch):
    """A monitor reads metrics.jsonl of a live run: the last line is half written when it is read and the
    trainer appends the rest (and the next line) before the reader asks for more. The reading is the file as it
    was at its end: the records before, the half line skipped as torn, never a 'not valid JSON' error. The
    writer's append is arranged to fall in exactly that moment (a real file, written by a second handle)."""
    import builtins

    import nagmoe.rundir.metrics as metrics_module

    path = tmp_path / METRICS_FILE
    full = [json.dumps({"step": s, "tokens": 512 * s, "flops": 1.0 * s, "loss": 3.0}) + "\n" for s in (1, 2, 3)]
    cut = len(full[1]) // 2
    path.write_text(full[0] + full[1][:cut])

    class ReadWhileWritten:
        def __init__(self, f):
            self.f = f

        def readline(self):
            line = self.f.readline()
            if line == full[1][:cut]:  # the reader is at the end of the half line: the trainer finishes it
                with open(path, "a") as writer:
                    writer.write(full[1][cut:] + full[2])
            return line

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

    monkeypatch.setattr(metrics_module, "open", lambda *a, **k: ReadWhileWritten(builtins.open(*a, **k)),
                        raising=False)
    assert [r["step"] for r in read_metrics(str(path))] == [1]
    monkeypatch.undo()
    assert [r["step"] for r in read_metrics(str(path))] == [1, 2, 3]  # the next reading sees it all
