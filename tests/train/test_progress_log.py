"""Issue 27, logs that suit the place: `nagmoe train` with stdout and stderr going to files (a Slurm job's log)
writes plain lines — the first step, throttled intervals, the last step, each with loss, tokens/s, TFLOP/s,
MFU and ETA — and not one carriage return (tqdm's frames stay for terminals)."""
import os
import subprocess
import sys

from nagmoe.config import dump_yaml
from nagmoe.train.progress_log import ProgressLog

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def test_train_into_a_log_file_writes_plain_lines_without_carriage_returns(micro_config, tmp_path):
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(dump_yaml(micro_config("train.max_steps=4")))
    with open(tmp_path / "out.log", "w") as out, open(tmp_path / "err.log", "w") as err:
        r = subprocess.run([sys.executable, "-m", "nagmoe", "train", "--config", str(cfg_path), "--run-dir",
                            str(tmp_path / "run")], cwd=REPO, stdout=out, stderr=err, timeout=300,
                           env={**os.environ, "OMP_NUM_THREADS": "1"})
    text = (tmp_path / "out.log").read_text() + (tmp_path / "err.log").read_text()
    assert r.returncode == 0, text[-2000:]
    assert "\r" not in text
    lines = [ln for ln in text.splitlines() if ln.startswith("[nagmoe] step ")]
    assert lines[0].startswith("[nagmoe] step 1/4 ") and lines[-1].startswith("[nagmoe] step 4/4 "), lines
    assert len(lines) < 4  # throttled: not one line per step
    for key in ("loss ", "tok/s ", "TFLOP/s ", "MFU - ", "ETA "):
        assert key in lines[-1], lines[-1]


def test_a_line_per_interval_and_the_eta(tmp_path):
    with open(tmp_path / "log", "w+") as f:
        log = ProgressLog(10, 0, "NVIDIA H100 80GB HBM3", world_size=2, every=2, stream=f, tty=False,
                          min_interval_s=0.0)
        for step in range(1, 11):
            rec = {"step": step, "loss": 2.0, "tokens_per_s": 1000.0, "tokens": step * 1000}
            log.update(rec, step_flops=989e12, step_seconds=1.0, last=step == 10, val_bpb=None)
        f.seek(0)
        lines = f.read().splitlines()
    assert [ln.split()[2] for ln in lines] == ["1/10", "2/10", "4/10", "6/10", "8/10", "10/10"]
    assert "MFU 50.0%" in lines[0]  # 989 TFLOP/s over two H100s
    assert lines[-1].endswith("ETA 0:00:00")


def test_a_run_that_stops_on_its_flop_budget_has_an_eta(monkeypatch):
    """Issue 67 item 7: the paper configs stop on train.flop_budget; the ETA is the time per FLOP since this process
    started (a resumed run: from its first step here) times the FLOPs left; with max_steps too, the sooner."""
    import io

    from nagmoe.train import progress_log

    clock = [100.0]
    monkeypatch.setattr(progress_log.time, "monotonic", lambda: clock[0])

    def lines_of(max_steps):
        stream = io.StringIO()
        log = ProgressLog(max_steps, 2, "cpu", stream=stream, tty=False, min_interval_s=0.0, flop_budget=10e15)
        for step in range(3, 11):  # resumed at step 2 (2e15 FLOPs done before); 1 s and 1e15 FLOPs a step
            clock[0] += 1.0
            rec = {"step": step, "loss": 2.0, "tokens_per_s": 1000.0, "flops": step * 1e15}
            log.update(rec, step_flops=1e15, step_seconds=1.0, last=step == 10, val_bpb=None)
        return stream.getvalue().splitlines()

    lines = lines_of(None)
    assert [ln.split()[2] for ln in lines] == [str(s) for s in range(3, 11)]  # no "/total" without max_steps
    assert [ln.split("ETA ")[1] for ln in lines] == [f"0:00:{10 - s:02d}" for s in range(3, 11)], lines
    sooner = lines_of(6)  # max_steps 6 comes before the budget's step 10
    assert [ln.split("ETA ")[1] for ln in sooner[:4]] == ["0:00:03", "0:00:02", "0:00:01", "0:00:00"], sooner


def test_a_quiet_run_asked_for_lines_logs_the_flop_budget_eta(micro_config, tmp_path, capsys):
    """`nagmoe train --quiet --progress lines` (what launch/train.sbatch runs) on a run that stops on its FLOP
    budget (4 steps' worth, no max_steps): plain lines, no "/total", an ETA from the first line on."""
    import torch

    from nagmoe.cli import main
    from nagmoe.config.flops import flops_per_token

    cfg = micro_config("train.max_steps=null")
    step_flops = flops_per_token(cfg.model, cfg.data.seq_len, None, cfg.train.flop_convention) * cfg.train.batch_tokens
    cfg_path = tmp_path / "c.yaml"
    cfg_path.write_text(dump_yaml(micro_config("train.max_steps=null", f"train.flop_budget={4 * step_flops!r}")))
    torch.set_num_threads(1)
    capsys.readouterr()
    assert main(["train", "--config", str(cfg_path), "--run-dir", str(tmp_path / "run"), "--quiet",
                 "--progress", "lines"]) == 0
    err = capsys.readouterr().err
    lines = [ln for ln in err.splitlines() if ln.startswith("[nagmoe] step ")]
    assert lines and lines[0].startswith("[nagmoe] step 1 ") and lines[-1].startswith("[nagmoe] step 4 "), \
        err[-2000:]
    assert all(" ETA -" not in ln for ln in lines) and lines[-1].endswith(" ETA 0:00:00"), lines
    assert "[nagmoe] device " not in err and "\r" not in err  # --quiet's start-up lines stay off
