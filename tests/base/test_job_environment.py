"""Issue 41, build item 4: the job's environment. sbatch's default --export=ALL carries the submitting shell into
the job, so the rendered values win over the login shell's (MASTER_PORT, OMP/MKL threads) in every template;
the job logs the environment it uses; test hooks act only under NAGMOE_TEST_HOOKS=1; TORCHELASTIC_RUN_ID,
SLURM_RESTART_COUNT and SLURM_ARRAY_TASK_ID are validated at start (one line, exit 2, nothing written)."""
import os
import re
import subprocess
import sys

import pytest

from nagmoe.cli import main

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "tiny.yaml")
LOGIN_SHELL = {"MASTER_PORT": "1234", "OMP_NUM_THREADS": "64", "MKL_NUM_THREADS": "64", "SLURM_JOB_ID": "7",
               "SLURM_JOB_NODELIST": "localhost", "SLURM_NNODES": "1"}


def _env_lines(script: str) -> str:
    """The script's lines that set the threads and the rendezvous port (run by bash below)."""
    keep = [line for line in script.splitlines()
            if re.match(r"(export (OMP|MKL)_NUM_THREADS|MASTER_PORT=)", line)]
    assert keep, script
    return "\n".join(keep)


def _run_lines(lines: str) -> dict:
    out = subprocess.run(["bash", "-c", lines + '\necho "$OMP_NUM_THREADS $MKL_NUM_THREADS ${MASTER_PORT:-}"'],
                         env={**os.environ, **LOGIN_SHELL}, capture_output=True, text=True, check=True)
    omp, mkl, *port = out.stdout.split()
    return {"omp": omp, "mkl": mkl, "port": port[0] if port else None}


def _one(root, pattern):
    found = sorted(root.rglob(pattern))
    assert found, f"no {pattern} under {root}"
    return found[0].read_text()


def _rendered(tmp_path, kind):
    if kind in ("train", "preflight"):
        run = tmp_path / kind
        args = ["launch", "slurm", "--config", TINY, "--run-dir", str(run), "--gpus-per-node", "0",
                "--cpus-per-task", "4", "--procs-per-node", "2"]
        if kind == "preflight":
            args.append("--preflight")
        assert main(args) == 0
        name = "train.sbatch" if kind == "train" else "preflight.sbatch"
        return _one(run, name)
    if kind == "prepare_data":
        run = tmp_path / "prep"
        assert main(["launch", "slurm", "--config", TINY, "--run-dir", str(run), "--array", "2",
                     "--gpus-per-node", "0"]) == 0
        return _one(run, "prepare_slices.sbatch")
    from nagmoe.launch.experiment import REPORT_SCRIPT

    return REPORT_SCRIPT.format(name="x", sbatch_lines="", threads=3, out="o", python="p", run_dirs="r",
                                title="t", description="", eval_items=1, analysis_tokens=1)


@pytest.mark.parametrize("kind", ["train", "preflight", "prepare_data", "report"])
def test_rendered_values_win_over_the_login_shell(kind, tmp_path, capsys):
    try:
        script = _rendered(tmp_path, kind)
    except (AssertionError, FileNotFoundError) as e:
        pytest.fail(f"could not render the {kind} script: {e}\n{capsys.readouterr().err[-2000:]}")
    got = _run_lines(_env_lines(script))
    assert got["omp"] != "64" and got["mkl"] == got["omp"], (kind, got)
    if kind in ("train", "preflight"):
        assert got["port"] == str(20000 + 7), got  # the job's own port, not the login shell's 1234


def _train_in_process(tmp_path, capsys, **env):
    assert main(["train", "--config", TINY, "--run-dir", str(tmp_path / "run"), "--quiet"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and len(err[0]) <= 600, err
    assert not (tmp_path / "run").exists()  # refused before anything was written
    return err[0]


@pytest.mark.parametrize("value", ["abc", "-1", "1.5", "9" * 4300])
def test_a_bad_slurm_restart_count_is_refused_at_start(value, monkeypatch, tmp_path, capsys):
    """On c9620be a bad SLURM_RESTART_COUNT failed only when writing the preemption marker, after the checkpoint."""
    monkeypatch.setenv("SLURM_RESTART_COUNT", value)
    assert "SLURM_RESTART_COUNT" in _train_in_process(tmp_path, capsys)


def test_a_leaked_torchelastic_run_id_is_refused_at_start(monkeypatch, tmp_path, capsys):
    """TORCHELASTIC_RUN_ID alone (left in a login shell) made a stand-alone train exit 0 on preemption, which a
    batch script reads as a finished run."""
    for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE", "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "leaked-from-an-old-job")
    assert "TORCHELASTIC_RUN_ID" in _train_in_process(tmp_path, capsys)


def test_the_preemption_exit_code_believes_only_a_whole_torchrun_environment(monkeypatch):
    from nagmoe.base.errors import UserError
    from nagmoe.train.preemption import EXIT_PREEMPTED, preempted_exit_code

    for name in ("TORCHELASTIC_RUN_ID", "RANK", "LOCAL_RANK", "WORLD_SIZE", "LOCAL_WORLD_SIZE",
                 "TORCHELASTIC_RESTART_COUNT"):
        monkeypatch.delenv(name, raising=False)
    assert preempted_exit_code() == EXIT_PREEMPTED
    monkeypatch.setenv("TORCHELASTIC_RUN_ID", "x")
    with pytest.raises(UserError, match="TORCHELASTIC_RUN_ID"):
        preempted_exit_code()
    for name, value in (("RANK", "0"), ("LOCAL_RANK", "0"), ("WORLD_SIZE", "1"), ("LOCAL_WORLD_SIZE", "1"),
                        ("TORCHELASTIC_RESTART_COUNT", "0")):
        monkeypatch.setenv(name, value)
    assert preempted_exit_code() == 0  # torchrun's workers exit 0; the marker is the signal


def test_test_hooks_act_only_under_the_switch(monkeypatch):
    """On c9620be any non-empty NAGMOE_TEST_MARKER_DELAY_S withheld the preemption marker in production."""
    from nagmoe.train import preemption

    monkeypatch.delenv("NAGMOE_TEST_HOOKS", raising=False)
    monkeypatch.setenv("NAGMOE_TEST_MARKER_DELAY_S", "3600")
    assert not preemption._marker_delayed_for_a_test()
    monkeypatch.setenv("NAGMOE_TEST_HOOKS", "1")
    assert preemption._marker_delayed_for_a_test()


def test_the_environment_is_logged_through_an_allow_list():
    from nagmoe.base.environment import describe_environment

    line = describe_environment({**LOGIN_SHELL, "NCCL_DEBUG": "INFO", "PYTHONPATH": "/x", "WANDB_API_KEY": "secret",
                                 "AWS_SECRET_ACCESS_KEY": "s3", "HOME": "/root", "TORCH_NCCL_ASYNC_ERROR_HANDLING": "3"})
    for shown in ("MASTER_PORT='1234'", "OMP_NUM_THREADS='64'", "NCCL_DEBUG='INFO'", "PYTHONPATH='/x'",
                  "TORCH_NCCL_ASYNC_ERROR_HANDLING='3'"):
        assert shown in line, line
    assert "secret" not in line and "s3" not in line and "HOME" not in line and "\n" not in line


def test_a_training_job_logs_its_environment_at_start(request):
    """The one end-to-end run of this issue (tests/support/taken_over_run.py) logged it under --quiet."""
    outcome = request.getfixturevalue("taken_over_run")["outcome"]
    assert "[nagmoe] environment: " in outcome["second"]["stderr"] or \
        "[nagmoe] environment: " in outcome["first"]["stderr"], outcome["second"]["stderr"][-2000:]


@pytest.mark.parametrize("task,first", [("abc", None), ("1", "abc"), ("0", "3"), ("9" * 5000, None)])
def test_a_bad_array_task_id_is_one_line(task, first, monkeypatch, tmp_path, capsys):
    monkeypatch.setenv("SLURM_ARRAY_TASK_ID", task)
    if first is None:
        monkeypatch.delenv("SLURM_ARRAY_TASK_MIN", raising=False)
    else:
        monkeypatch.setenv("SLURM_ARRAY_TASK_MIN", first)
    code = main(["prepare-data", "--config", TINY, f"data.data_dir={tmp_path / 'data'}", "--num-shards", "2"])
    err = capsys.readouterr().err.strip().splitlines()
    assert code == 2 and len(err) == 1 and "SLURM_ARRAY_TASK" in err[0] and len(err[0]) <= 600, err


def test_a_bad_setting_shows_no_traceback_from_the_command_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": REPO, "SLURM_RESTART_COUNT": "x" * 100_000}
    out = subprocess.run([sys.executable, "-m", "nagmoe", "train", "--config", TINY, "--run-dir",
                          str(tmp_path / "run")], env=env, capture_output=True, text=True, timeout=120)
    assert out.returncode == 2 and "Traceback" not in out.stdout + out.stderr and len(out.stderr) < 1000, \
        out.stderr[-2000:]


def test_a_test_hook_without_the_switch_is_named_once_at_start(monkeypatch, tmp_path, caplog):
    """The start checks run once per `nagmoe train` (the command and the Trainer must not both run them)."""
    import logging

    monkeypatch.delenv("NAGMOE_TEST_HOOKS", raising=False)
    monkeypatch.setenv("NAGMOE_TEST_MARKER_DELAY_S", "3600")
    with caplog.at_level(logging.WARNING, logger="nagmoe.train"):
        main(["train", "--config", TINY, "--run-dir", str(tmp_path / "run"), "--quiet",
              f"data.data_dir={tmp_path / 'no-data'}"])
    warned = [r.getMessage() for r in caplog.records if "ignoring test hook" in r.getMessage()]
    assert len(warned) == 1 and "NAGMOE_TEST_MARKER_DELAY_S" in warned[0], warned
