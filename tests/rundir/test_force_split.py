"""Issue 41, `--force` split: plain --force is refused in train, launch and experiment (exit 2, one line naming
the new flags); a rendered job script carries --accept-config-change only when asked and then with the sha256 of
the submitted config, never --take-over or --start-over; `train --config-sha256` refuses another config."""
import hashlib
import os
import re
import subprocess
import sys

import pytest

REPO = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
TINY = os.path.join(REPO, "configs", "tiny.yaml")


def nagmoe(*args, cwd=REPO):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": REPO}
    return subprocess.run([sys.executable, "-m", "nagmoe", *map(str, args)], cwd=cwd, env=env, capture_output=True,
                          text=True, timeout=120)


def one_line_exit_2(out, *fragments):
    assert out.returncode == 2, (out.returncode, out.stderr[-2000:])
    assert "Traceback" not in out.stdout + out.stderr
    errors = [line for line in out.stderr.splitlines() if "error" in line]
    assert len(errors) == 1, out.stderr
    for fragment in fragments:
        assert fragment in errors[0], errors[0]
    return errors[0]


def experiment_file(tmp_path):
    path = tmp_path / "exp.yaml"
    path.write_text(f'{{"name": "x", "flop_budget": 1e12, "seeds": [0], "runs": {{"nag": {{"config": "{TINY}"}}}}}}')
    return path


@pytest.mark.parametrize("command", ["train", "launch", "experiment"])
def test_plain_force_is_refused_naming_the_new_flags(command, tmp_path):
    args = {"train": ["train", "--config", TINY, "--run-dir", tmp_path / "run"],
            "launch": ["launch", "slurm", "--config", TINY, "--run-dir", tmp_path / "run", "--dry-run"],
            "experiment": ["experiment", experiment_file(tmp_path), "--slurm", "--dry-run", "--runs-root",
                           tmp_path / "runs"]}[command]
    line = one_line_exit_2(nagmoe(*args, "--force"), "--force", "--accept-config-change")
    if command == "train":
        assert "--take-over" in line and "--start-over" in line
    assert not (tmp_path / "run").exists() and not (tmp_path / "runs").exists()


def test_a_rendered_script_carries_only_the_config_change_tied_to_its_config(tmp_path, capsys):
    from nagmoe.cli import main  # accepted launches in this process: their exit status is not the point

    run_dir = tmp_path / "run"
    assert main(["launch", "slurm", "--config", TINY, "--run-dir", str(run_dir), "--accept-config-change",
                 "--gpus-per-node", "0"]) == 0
    script = (run_dir / "slurm" / "train.sbatch").read_text()
    train_line = next(line for line in script.splitlines() if "-m nagmoe train" in line)
    sha = re.search(r"--config-sha256 ([0-9a-f]{64})", train_line).group(1)
    assert "--accept-config-change" in train_line
    for never in ("--take-over", "--start-over", "--force"):
        assert never not in script
    pinned = run_dir / "slurm" / f"config-{sha[:12]}.yaml"
    assert hashlib.sha256(pinned.read_bytes()).hexdigest() == sha
    assert f'CONFIG="$RUN_DIR/slurm/config-{sha[:12]}.yaml"' in script
    # not asked: no acceptance rendered (the sha256 check still pins the config)
    capsys.readouterr()
    assert main(["launch", "slurm", "--config", TINY, "--run-dir", str(tmp_path / "other"), "--dry-run"]) == 0
    out = capsys.readouterr().out
    assert "--accept-config-change" not in out and "--config-sha256" in out


@pytest.mark.parametrize("flag", ["--take-over", "--start-over"])
def test_launch_does_not_offer_take_over_or_start_over(flag, tmp_path):
    out = nagmoe("launch", "slurm", "--config", TINY, "--run-dir", tmp_path / "run", "--dry-run", flag)
    assert out.returncode == 2 and "Traceback" not in out.stderr and flag in out.stderr


def test_experiment_scripts_carry_each_runs_config_sha256(tmp_path):
    from nagmoe.launch import experiment as ex
    from nagmoe.launch.slurm import SlurmOptions

    exp = ex.load_experiment(str(experiment_file(tmp_path)))
    plans = exp.plan(str(tmp_path / "runs"), None, ())
    opts = SlurmOptions(nodes=1, gpus_per_node=0, procs_per_node=1)
    jobs, _ = ex.slurm_jobs(exp, plans, opts, str(tmp_path / "runs"), accept_config_change=True)
    for job in jobs:
        sha = hashlib.sha256(job.config_yaml.encode()).hexdigest()
        assert f"--config-sha256 {sha} --accept-config-change" in job.script
        assert "--take-over" not in job.script and "--start-over" not in job.script


def test_train_refuses_a_config_other_than_the_submitted_one(tmp_path):
    config = tmp_path / "config.yaml"
    config.write_text(open(TINY).read())
    submitted = hashlib.sha256(config.read_bytes()).hexdigest()
    config.write_text(open(TINY).read() + "\n# edited after submission\n")
    one_line_exit_2(nagmoe("train", "--config", config, "--run-dir", tmp_path / "run", "--accept-config-change",
                           "--config-sha256", submitted), "sha256", "submitted")
    assert not (tmp_path / "run").exists()
    # the submitted file passes the check (and then stops at the next problem: no prepared data here)
    config.write_text(open(TINY).read())
    line = one_line_exit_2(nagmoe("train", "--config", config, "--run-dir", tmp_path / "run",
                                  "--config-sha256", submitted, "data.data_dir=" + str(tmp_path / "none")))
    assert "sha256" not in line and "no prepared data" in line
